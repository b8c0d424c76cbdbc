#!/bin/bash
# The GPU box's part of issue 14, one device call per stage, issued back to back (the box keeps its
# files only while it stays warm: 30 s after a call).  Run from the repo root ON the box:
#   bash benchmarks/gpu/h100.sh kernels PARTDIR   Triton kernel tests compiled, benchmarks.kernels, + a bundle part
#   bash benchmarks/gpu/h100.sh sweep            launch settings of the Triton decode, side by side
#   bash benchmarks/gpu/h100.sh add PARTDIR       one more part of the vLLM 0.26 bundle (../shared/tools/gpu-vllm)
#   bash benchmarks/gpu/h100.sh oracle PARTDIR   issue 31: carry.sh's last part: assemble, install vLLM 0.26, SmolLM2's real
#                                                weights served on the GPU vs the oracle (benchmarks/gpu/oracle_match.py)
#   bash benchmarks/gpu/h100.sh vllm PARTDIR SHA  the last part, install, benchmarks.throughput (dummy 8B shape;
#                                                TP_FORMATS, TP_SHAPES, TP_ARGS; parts from carry_vllm.sh or carry.sh)
#   bash benchmarks/gpu/h100.sh prof             issue 32: ncu --set full on one CUDA decode launch, stalls per SASS line
#   bash benchmarks/gpu/h100.sh cuda             issue 32's CUDA decode kernel: layout probe, nvcc builds, checks
#                                                against the oracle (poisoned output, emulator, CUDA graph), timings
#                                                beside Triton / SDPA / fp16 paged (CUDA_ARGS extends them), ncu
# carry: .whl (fast-pytorch-kmeans), .gpu-vllm/cN (a part each; the last also on-device.sh, vllm_cli.py and
# SmolLM2's tokenizer in l8b/ beside the Llama-3.1-8B-shaped config.json).  Results land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
site=/tmp/tkv-site
stage=${1:?stage}; parts=${2:-}
if [ ! -d $site/vllm_temporalkv-0.1.0.dist-info ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .whl/*.whl || exit 1
  # the plugin's entry point, as `pip install .` registers it (vLLM finds plugins through entry points)
  d=$site/vllm_temporalkv-0.1.0.dist-info; mkdir -p $d
  printf 'Metadata-Version: 2.1\nName: vllm-temporalkv\nVersion: 0.1.0\n' > $d/METADATA
  printf '[vllm.general_plugins]\nvllm_temporalkv = vllm_temporalkv.vllm.plugin:register\n' > $d/entry_points.txt
fi
export PYTHONPATH=$site:$PWD
add_part() { mkdir -p /root/vllm-parts && cp "$1"/*.part* /root/vllm-parts/ && ls -l /root/vllm-parts; }
case $stage in
kernels)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
  [ -n "$parts" ] && add_part "$parts" &
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py 2>&1 | tee $OUT/pytest-triton.log
  timeout 330 python3 -m benchmarks.kernels --shape llama8b --batch 1 8 32 --context 8192 32768 --reps 50 \
    2>&1 | tee $OUT/kernels.log
  cp benchmarks/results/kernels.json benchmarks/results/kernels.md benchmarks/results/kernels.png \
     benchmarks/results/headline.json $OUT/ 2>/dev/null
  wait ;;
sweep)  # launch settings of the decode kernel (benchmarks/gpu/decode_sweep.py)
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
  timeout ${SWEEP_S:-280} python3 -m benchmarks.gpu.decode_sweep ${SWEEP_ARGS:-} --out $OUT/decode_sweep.json 2>&1 | tee $OUT/decode_sweep.log ;;
add) add_part "$parts" ;;
cuda)  # issue 32 (benchmarks/gpu/cuda_decode.py; CPU dry run of the same: --dry-run)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
  export VLLM_TEMPORALKV_CUDA_CACHE=${VLLM_TEMPORALKV_CUDA_CACHE:-/tmp/tkv-cuda-cache}
  timeout ${CUDA_S:-360} python3 -m benchmarks.gpu.cuda_decode --out $OUT/cuda ${CUDA_ARGS:-} 2>&1 | tee $OUT/cuda.log
  rc=${PIPESTATUS[0]}
  if command -v ncu >/dev/null && [ "$rc" != 124 ]; then  # shared-memory wavefronts / bank conflicts of one launch
    timeout 150 ncu --kernel-name tkv_decode --launch-skip 1 --launch-count 1 --metrics \
      l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,\
smsp__sass_inst_executed_op_shared_ld.sum,dram__bytes_read.sum,gpu__time_duration.sum \
      python3 -m benchmarks.gpu.cuda_decode --out $OUT/cuda --ncu-one temporalkv-2bit:8:32768 2>&1 | tee $OUT/ncu.txt
  fi
  exit $rc ;;
prof)  # issue 32: where the CUDA decode's time goes - ncu's full set on one B = 8, L = 32k launch, per-SASS stalls
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $OUT/gpu.txt
  export VLLM_TEMPORALKV_CUDA_CACHE=/tmp/tkv-cuda-cache
  one=${PROF_ONE:-temporalkv-2bit:8:32768}
  timeout 200 ncu --kernel-name tkv_decode --launch-skip 1 --launch-count 1 --set full --import-source yes \
    --export /tmp/prof -f python3 -m benchmarks.gpu.cuda_decode --out /tmp/c --ncu-one $one > $OUT/ncu-run.log 2>&1
  ncu -i /tmp/prof.ncu-rep --page details > $OUT/details.txt 2>&1
  ncu -i /tmp/prof.ncu-rep --page source --csv --print-source sass > $OUT/source-sass.csv 2>&1
  ncu -i /tmp/prof.ncu-rep --page source --csv --print-source cuda > $OUT/source-cuda.csv 2>&1
  for f in /tmp/tkv-cuda-cache/*k0l4-v0l4-d128-o0-bf16-t384*.cubin; do cuobjdump -sass "$f" > $OUT/sass.txt 2>&1; done
  ls -l $OUT; grep -E "Duration|Issue Slots|Warp Cycles Per Issued|Achieved Occupancy|Registers|No Eligible|One or More|Theoretical Occ" $OUT/details.txt | head -30 ;;
oracle)  # issue 31: the parts of benchmarks/gpu/carry.sh (all but the last added before), then SmolLM2's real weights
  # served by vLLM 0.26 on this GPU against the torch path here and the CPU reference (benchmarks/gpu/oracle_match.py)
  add_part "$parts" >/dev/null || exit 1
  cat /root/vllm-parts/carry.tar.part* > /root/carry.tar && echo "$(cat "$parts"/SHA256)  /root/carry.tar" | sha256sum -c - || exit 1
  mkdir -p /root/carry && tar -C /root/carry -xf /root/carry.tar && rm -f /root/carry.tar /root/vllm-parts/carry.tar.part*
  echo "$(cat /root/carry/site.sha256)  /root/carry/site.tar.xz" | sha256sum -c - || exit 1
  mkdir -p /root/vllm-site && xz -T0 -dc /root/carry/site.tar.xz | tar -C /root/vllm-site -xf - || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $site /root/carry/gguf-*.whl || exit 1
  export PYTHONPATH=/root/vllm-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_TEMPORALKV_CACHE=/root/tkv-cache
  export VLLM_TEMPORALKV_CUDA_CACHE=/tmp/tkv-cuda-cache
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a $OUT/gpu.txt
  model=$(python3 -c "from pathlib import Path; from vllm_temporalkv.models import convert_gguf
print(convert_gguf(Path('/root/carry/smollm2.gguf')))" 2>$OUT/convert.log | tail -1) || exit 1
  # ORACLE_ARGS picks engines (e.g. --formats auto temporalkv-2bit --paths default torch); on the H100 an engine took
  # 26 s (auto), 63-73 s (temporalkv-2bit CUDA / Triton, kernels compiled by the first), the torch path > 128 s.
  # The report is rewritten after every engine: what ran survives the timeout (merge sessions with --rescore).
  timeout ${ORACLE_S:-420} python3 -m benchmarks.gpu.oracle_match --check benchmarks/gpu/smollm2-reference.json \
    --model "$model" --artifact /root/carry/calibration.safetensors --out $OUT/oracle ${ORACLE_ARGS:-} 2>&1 | tee $OUT/oracle.log ;;
vllm)  # issue 31: vLLM 0.26's own bench on the Llama-3.1-8B shape (dummy weights). TP_SHAPES, TP_FORMATS; TP_ARGS adds
  # benchmarks.throughput flags (e.g. --max-num-seqs 1: batch 1); VLLM_TEMPORALKV_CUDA_GRAPHS=1 claims full graphs for
  # our decode; TP_S bounds the whole stage, TP_FMT_S each format. Results: $OUT/tp-TAG.tgz (the box returns 8 files).
  vsite=${VLLM_SITE:-/root/vllm-site}   # (a CPU dry run points it at a site that has vllm)
  if [ ! -d $vsite/vllm ]; then  # not yet installed by an earlier stage on this (warm) box
    add_part "$parts" >/dev/null && bash "$parts"/on-device.sh install "${3:?sha256}" 2>&1 | tail -3 || exit 1
  fi
  export PYTHONPATH=$vsite:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | tr A-Z a-z)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
  mkdir -p /tmp/l8b && cp "$parts"/l8b/* /tmp/l8b/ || exit 1
  tag=${TP_TAG:-$(date +%H%M%S)}
  timeout ${TP_S:-420} python3 -m benchmarks.throughput --model /tmp/l8b --name ${card:-gpu}-l8b --load-format dummy \
    --vllm "python3 $parts/vllm_cli.py" --shapes ${TP_SHAPES:-8192-512:96} --no-serve --gpu-memory-utilization 0.85 \
    --synthetic-artifact --timeout ${TP_FMT_S:-240} --formats ${TP_FORMATS:-temporalkv-2bit auto} ${TP_ARGS:-} \
    2>&1 | tee /tmp/throughput-$tag.log
  rc=${PIPESTATUS[0]}
  for f in $(find benchmarks/results -name "throughput-*.log" -mmin -20); do tail -c 300000 "$f" > "$f.tail" && mv "$f.tail" "$f"; done
  tar -czf $OUT/tp-$tag.tgz --exclude '*.safetensors' /tmp/throughput-$tag.log benchmarks/results/headline.json \
    $(ls -d benchmarks/results/throughput-${card:-gpu}-l8b* 2>/dev/null) 2>/dev/null
  ls -l $OUT; exit $rc ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
