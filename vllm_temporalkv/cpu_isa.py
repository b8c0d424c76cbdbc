"""What this CPU can run, and the one piece of process set-up an AMX CPU needs.

* ``cpu_flags()``: /proc/cpuinfo's flags; ``cpu_class()``: the class a figure or a failure is filed under
  (``amx`` / ``avx512bf16`` / ``avx512`` / ``avx2`` / ``scalar``: the machines this project meets differ in
  exactly these steps, and vLLM's CPU build picks its kernels by them).
* ``request_amx()``: Linux hands a process AMX tile state only after it asks (``arch_prctl(
  ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); until then the first tile instruction is a SIGILL.  vLLM's
  worker gets the permission as a side effect of its oneDNN / AMX GEMMs before any attention runs, so code
  that calls vLLM's CPU ops outside the worker (benchmarks.kernels_cpu) must ask first.  torch wraps the
  request (``torch.cpu._init_amx``); on a CPU without AMX this does nothing.
* ``amx_permitted()``: whether the permission is held (``ARCH_GET_XCOMP_PERM``), to check the above.
"""

from __future__ import annotations

import ctypes
import platform
from functools import lru_cache

SIMD_FLAGS = ("sse4_2", "fma", "f16c", "avx", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")

# <asm/prctl.h> and the x86 xstate feature number of the AMX tile data (arch/x86/include/asm/fpu/types.h)
_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_GET_XCOMP_PERM = 0x1022
_XFEATURE_XTILEDATA = 18


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_class(flags: frozenset[str] | set[str] | None = None) -> str:
    """The CPU's class, best first: amx (bf16 tiles), avx512bf16, avx512, avx2, scalar."""
    f = cpu_flags() if flags is None else flags
    if {"amx_tile", "amx_bf16"} <= f:
        return "amx"
    if "avx512_bf16" in f:
        return "avx512bf16"
    if "avx512f" in f:
        return "avx512"
    if "avx2" in f:
        return "avx2"
    return "scalar"


def simd_flags(flags: frozenset[str] | set[str] | None = None) -> list[str]:
    """The SIMD flags that matter here, in a fixed order (recorded beside every speed figure)."""
    f = cpu_flags() if flags is None else flags
    return [x for x in SIMD_FLAGS if x in f]


def amx_permitted() -> bool | None:
    """Whether this process may use AMX tiles (None where the question cannot be asked: not x86_64 Linux,
    or a kernel older than 5.16 that has no XCOMP permissions)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return None
    return bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def request_amx() -> bool:
    """Ask for AMX tile state for this process, as vLLM's worker ends up holding it; True if granted.  A CPU
    without AMX tiles: False, nothing asked."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch.cpu._init_amx())
