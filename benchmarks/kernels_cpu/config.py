"""benchmarks.kernels_cpu's settings and the machine's facts (CPU model, SIMD flags, caches, threads)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vllm_temporalkv.cpu_isa import cpu_class, simd_flags

from ..common import cpu_model

DEFAULT_FORMATS = ["temporalkv-2bit", "temporalkv-4bit", "temporalkv-1bit", "channelkv-2bit", "kvquant-2bit"]
VLLM_BLOCK_SIZE = 128  # vLLM's CPU default (platforms/cpu.py: block_size = 128 unless the user sets one)
DEFAULT_PREFILL = "2048@6144"
HEADLINE_POINTS = {(1, 8192), (8, 8192), (8, 32768)}  # decode (B, L) rows merged into headline.json
HEADLINE_FORMATS = {"temporalkv-2bit"}
TOL = 2e-2  # |C++ - torch| <= TOL * max(1, |torch|max): bf16 outputs, loosely (tests/test_cpu_kernels.py is tight)
VLLM_TOL = 2e-2  # vLLM's bf16 op vs float32 dense attention, same scaling
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def _isz(dt: str) -> int:
    return DTYPES[dt].itemsize


def cpu_facts() -> dict:
    model = cpu_model()
    caches = {}
    for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            lvl, kind = (idx / "level").read_text().strip(), (idx / "type").read_text().strip()
            caches[f"L{lvl}{'' if kind == 'Unified' else kind[0].lower()}"] = (idx / "size").read_text().strip()
        except OSError:
            pass
    return dict(model=model, cpu_class=cpu_class(), simd=simd_flags(), caches=caches, cpu_count=os.cpu_count(),
                affinity=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                torch_threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"))


def _size_bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s.rstrip("KMG")) * mult


def l3_bytes() -> int:
    sizes = [_size_bytes(v) for k, v in cpu_facts()["caches"].items() if k.startswith("L3")]
    return max(sizes) if sizes else 32 << 20
