"""The paged cache's operations, one signature for every device:

    write_kv(lc, pages, key, value, positions, page_ids)
    paged_attention(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, scale,
                    out=None, batch_invariant=...)
    forward(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, positions, page_ids,
            scale, out=None, batch_invariant=...)   # a layer's step: attention + cache update

``paged_torch`` (plain torch) is the oracle and the fallback everywhere; ``cpu`` runs the C++ kernels
of csrc/; ``triton_path`` runs the Triton kernels (``triton_encode`` / ``triton_decode``) on CUDA, and on the
CPU in Triton's interpreter when asked (``VLLM_TEMPORALKV_OPS=triton`` with ``TRITON_INTERPRET=1``: how CI tests
the wiring without a GPU); ``cuda_path`` is the Triton path with the decode on the CUDA kernel of csrc/cuda,
wherever that kernel can serve (built by nvcc or loaded from cached cubins; ``VLLM_TEMPORALKV_CUDA_DECODE=0`` keeps
the Triton decode).  ``select`` picks one per layer cache and says which serves, or why not.
"""

from __future__ import annotations

import os
from types import ModuleType

ENV_PATH = "VLLM_TEMPORALKV_OPS"  # "torch" forces the torch path (a diagnostic / the oracle); "triton" the Triton one
ENV_CUDA_DECODE = "VLLM_TEMPORALKV_CUDA_DECODE"  # "0": keep the Triton decode; else the CUDA kernel where it serves


def _triton(lc):
    """(the Triton path module, None) or (None, why not)."""
    try:
        from . import triton_path
    except ImportError as e:
        return None, f"triton not importable: {e}"
    if lc.kernel_blocker:
        return None, lc.kernel_blocker
    if lc.layout.exact_pages:
        return None, "the Triton kernels read the sinks and the tail from the code pages; small pages keep them apart"
    if not triton_path.supports(lc):
        return None, "the Triton kernels serve a half-precision model with head_dim 64, 128 or 256"
    return triton_path, None


def select(lc, device) -> tuple[ModuleType, str]:
    """(ops module, a name for logs) for a layer cache on ``device``."""
    from . import paged_torch

    forced = os.environ.get(ENV_PATH, "").lower()
    if forced == "torch":
        return paged_torch, f"torch ({ENV_PATH}=torch)"
    dev = getattr(device, "type", str(device))
    if dev == "cuda" or forced == "triton":
        if forced == "triton" and dev != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return paged_torch, f"torch ({ENV_PATH}=triton without a GPU needs TRITON_INTERPRET=1)"
        mod, why = _triton(lc)
        if mod is not None and dev == "cuda" and os.environ.get(ENV_CUDA_DECODE, "1") != "0":
            from . import cuda  # imported only on a GPU

            why = cuda.prepare(lc, device)
            if why is None:
                from . import cuda_path

                return cuda_path, cuda_path.mode()
            return mod, f"Triton ({mod.mode()}); the CUDA decode cannot serve: {why}"
        if mod is not None:
            off = f"; {ENV_CUDA_DECODE}=0" if dev == "cuda" else ""
            return mod, f"Triton ({mod.mode()}){off}"
        return paged_torch, f"torch ({why})"
    if dev == "cpu":
        from . import cpu

        if cpu.supports(lc):
            route = cpu.prefill_route(lc)
            return cpu, f"C++ ({cpu.isa()}{'; ' + route if route else ''})"
        if not cpu.available():
            why = "extension not loaded"
        elif lc.kernel_blocker:
            why = lc.kernel_blocker
        else:
            why = "shape not supported by the C++ kernels"
        return paged_torch, f"torch ({why})"
    return paged_torch, "torch"
