#!/bin/bash
# Everything the GPU box needs for issue 31's serving stages, cut into folders that each travel in one device call
# (a call carries at most 64 MiB with the ~8 MiB working tree): the vLLM 0.26 bundle (../shared/tools/gpu-vllm,
# prepared into .gpu-vllm), SmolLM2's GGUF (the real weights: converted to the same bf16 folder on the box, checked
# by a weights hash), the gguf wheel that converts it, and the calibration the oracle reference was made with.
#   bash benchmarks/gpu/carry.sh ARTIFACT [OUT=.gpu-carry]     here, once (needs .gpu-vllm from prepare.sh)
# Then, back to back (the box keeps files 30 s after a call): `bash benchmarks/gpu/h100.sh add .gpu-carry/cN` for every
# part but the last, then `bash benchmarks/gpu/h100.sh oracle .gpu-carry/cLAST` (assemble, install, convert, check).
set -euo pipefail
art=${1:?usage: carry.sh ARTIFACT [OUT]}; out=${2:-.gpu-carry}
[ -f .gpu-vllm/site.tar.xz ] && [ -f .gpu-vllm/SHA256 ] || { echo "no .gpu-vllm bundle: run ../shared/tools/gpu-vllm/prepare.sh .gpu-vllm" >&2; exit 1; }
gguf=$(.venv/bin/python -c "from vllm_temporalkv.models import smollm2_gguf; print(smollm2_gguf())")
whl=$(ls /tmp/gguf-whl/gguf-*.whl 2>/dev/null | head -1 || true)  # none yet: downloaded below (pipefail)
[ -n "$whl" ] || { .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d /tmp/gguf-whl gguf && whl=$(ls /tmp/gguf-whl/gguf-*.whl | head -1); }
rm -rf "$out" && mkdir -p "$out/stage"
ln -s "$PWD/.gpu-vllm/site.tar.xz" "$out/stage/site.tar.xz"
cp .gpu-vllm/SHA256 "$out/stage/site.sha256"
ln -s "$gguf" "$out/stage/smollm2.gguf"
cp "$art" "$out/stage/calibration.safetensors"
cp "$whl" "$out/stage/"
tar -C "$out/stage" -chf "$out/carry.tar" .
sha256sum "$out/carry.tar" | cut -d' ' -f1 > "$out/SHA256"
split -b 50m -d -a 1 "$out/carry.tar" "$out/carry.tar.part"
for f in "$out"/carry.tar.part*; do n=${f##*part}; mkdir -p "$out/c$n"; mv "$f" "$out/c$n/"; done
last=$(ls -d "$out"/c[0-9]* | sort -V | tail -1); cp "$out/SHA256" "$last/"
# the throughput stage (h100.sh vllm, after oracle on the same warm box) reads these from the last part's folder
shared=../shared/tools/gpu-vllm
mkdir -p "$last/l8b" && cp "$shared/llama-3.1-8b-shape/config.json" "$last/l8b/" && cp "$shared/vllm_cli.py" "$last/"
smol=$(.venv/bin/python -c "from vllm_temporalkv.models import resolve_model; print(resolve_model(None))")
cp "$smol"/tokenizer.json "$smol"/tokenizer_config.json "$last/l8b/"
rm -rf "$out/stage" "$out/carry.tar"
du -sh "$out"/c*; echo "sha256 $(cat "$out/SHA256")"
