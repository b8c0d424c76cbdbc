#!/bin/bash
# The vLLM 0.26 bundle alone (the throughput stage: Llama-3.1-8B shape, dummy weights), cut into folders that each
# travel in one device call beside the working tree (a call carries at most 64 MiB in all):
#   ../shared/tools/gpu-vllm/prepare.sh .gpu-vllm     here, once (~10 min)
#   bash benchmarks/gpu/carry_vllm.sh                 -> .gpu-vllm/c0 .. cN, the last with SHA256, on-device.sh,
#                                                        vllm_cli.py and l8b/ (config + SmolLM2's tokenizer)
# Then, back to back: `h100.sh add .gpu-vllm/cK` for every part but the last, `h100.sh vllm .gpu-vllm/cN SHA`.
# (benchmarks/gpu/carry.sh is the oracle stage's carry: the same bundle plus SmolLM2's weights and a calibration.)
set -euo pipefail
[ -f .gpu-vllm/site.tar.xz ] && [ -f .gpu-vllm/SHA256 ] || { echo "no .gpu-vllm bundle: run ../shared/tools/gpu-vllm/prepare.sh .gpu-vllm" >&2; exit 1; }
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
part=$(( (64 << 20) - tree - $(du -cb .whl | tail -1 | cut -f1) - (512 << 10) ))   # the rest of a call beside the tree and .whl, 512 KiB spare
rm -rf .gpu-vllm/c[0-9]* && split -b $part -d -a 1 .gpu-vllm/site.tar.xz .gpu-vllm/site.tar.xz.part
for f in .gpu-vllm/site.tar.xz.part*; do n=${f##*part}; mkdir -p .gpu-vllm/c$n; mv "$f" .gpu-vllm/c$n/site.tar.xz.part0$n; done
last=$(ls -d .gpu-vllm/c[0-9]* | sort -V | tail -1)
shared=../shared/tools/gpu-vllm
cp .gpu-vllm/SHA256 "$shared/on-device.sh" "$shared/vllm_cli.py" "$last/"
mkdir -p "$last/l8b" && cp "$shared/llama-3.1-8b-shape/config.json" "$last/l8b/"
smol=$(.venv/bin/python -c "from vllm_temporalkv.models import resolve_model; print(resolve_model(None))")
cp "$smol"/tokenizer.json "$smol"/tokenizer_config.json "$last/l8b/"
for d in .gpu-vllm/c[0-9]*; do s=$(du -cb $d .whl | tail -1 | cut -f1); [ $((s + tree)) -le $((64 << 20)) ] || { echo "$d with the tree is $((s + tree)) bytes > 64 MiB" >&2; exit 1; }; done
du -sh .gpu-vllm/c*; echo "tree $tree bytes; sha256 $(cat .gpu-vllm/SHA256)"
