#!/usr/bin/env bash
# Issue 33's CPU speed figures on this machine, made the way the committed ones were: the C++ kernels against vLLM's
# own CPU attention, `vllm bench throughput` at the decode-heavy and prefill-heavy shapes (with the step
# breakdown), and the retrieval suite's wall time through the server.  Each benchmark records the CPU and its flags
# and merges its headline keys, named by the machine's class (vllm_temporalkv.cpu_isa.cpu_class: amx, avx512bf16,
# avx512, avx2): kernels.cpu-<class>.*, throughput.smollm2-cpu-<class>.*, retrieval.smollm2-cpu-<class>.*; the
# README's tables are regenerated last.  Why a script: the class's calibration artifact, the names and the flags
# must match the earlier runs for the figures to compare, and a session with a rare machine (AMX) should spend
# it measuring.  The files a run replaces are kept first under <bench>-runs/<date>-before-<LABEL or time>.*.
#
#   bash scripts/cpu-figures.sh                         # all three (~1.5-2 h on a 2-core machine)
#   bash scripts/cpu-figures.sh kernels throughput      # some of them: kernels, throughput, retrieval
#
# Needs `bash scripts/setup.sh` first.  Run nothing else on the machine meanwhile (the figures are timings).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CLASS=$("$PY" -c 'from vllm_temporalkv.cpu_isa import cpu_class; print(cpu_class())')
# (the first figures came from an AVX2 machine: its files and keys carry no class - kernels-cpu-f32.*,
# throughput.smollm2-cpu.* - as benchmarks/kernels_cpu/run.py names them)
SUFFIX="-$CLASS"
[ "$CLASS" != avx2 ] || SUFFIX=""
NAME="smollm2-cpu$SUFFIX"
ART="runs/$CLASS/calibration.safetensors"
RES=benchmarks/results
STAMP=$(date -u +%Y-%m-%d)-before-${LABEL:-$(date -u +%H%M)}  # LABEL=the-change-measured names them
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(kernels throughput retrieval)
for s in "${STEPS[@]}"; do
  case "$s" in kernels | throughput | retrieval) ;; *) echo "unknown step '$s': kernels, throughput or retrieval" >&2; exit 2 ;; esac
done
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) CPUs, class $CLASS"

keep() {  # keep() BASE: the result files BASE.{json,md,png} copied aside before a run replaces them
  local f
  mkdir -p "$RES/$1-runs"
  for f in "$RES/$1".json "$RES/$1".md "$RES/$1".png; do
    [ -e "$f" ] && cp "$f" "$RES/$1-runs/$STAMP.${f##*.}"
  done
  return 0
}

artifact() {  # the served codebook formats need one (~4 min; the kernels' synthetic codebooks do not)
  [ -f "$ART" ] || "$PY" -m calibrate --formats temporalkv-2bit temporalkv-k4v2 --num-samples 4 --seq-len 1024 \
    --output "$ART"
}
# float32 where the CPU has no bf16 units: the dtype that serves there (and vLLM's op on a float32 cache)
DT=()
case "$CLASS" in avx2 | avx512 | scalar) DT=(--dtype f32) ;; esac

for s in "${STEPS[@]}"; do
  case "$s" in
    kernels)
      keep "kernels-cpu$SUFFIX${DT:+-f32}"
      "$PY" -m benchmarks.kernels_cpu "${DT[@]}" --batch 1 8 --context 8192 \
        --formats temporalkv-2bit selective-int4 tada-4bit qjl --budget-s 5 --no-torch-path ;;
    throughput)
      artifact
      keep "throughput-$NAME"
      "$PY" -m benchmarks.throughput --formats auto temporalkv-2bit selective-int4 tada-4bit \
        --shapes 4096-256:8 4096-16:8 --shape-names decode-heavy prefill-heavy --no-serve --name "$NAME" \
        --artifact "$ART" --step-breakdown ;;
    retrieval)
      artifact
      keep "retrieval-$NAME"
      "$PY" -m benchmarks.retrieval --name "$NAME" --artifact "$ART" \
        --formats auto temporalkv-2bit temporalkv-k4v2 selective-int4 tada-4bit qjl --lengths 2048 4096 \
        --samples 1 --enforce-eager ;;
  esac
done
"$PY" -m benchmarks.readme
echo "done: $RES (headline keys kernels.cpu$SUFFIX.* and *.$NAME.*); README tables regenerated"
