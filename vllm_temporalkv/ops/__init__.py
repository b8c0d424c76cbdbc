"""The paged cache's operations, one signature for every device:

    write_kv(lc, pages, key, value, positions, page_ids)
    paged_attention(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, scale,
                    out=None, batch_invariant=...)
    forward(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, positions, page_ids,
            scale, out=None, batch_invariant=...)   # a layer's step: attention + cache update

``paged_torch`` (plain torch) is the oracle and the fallback everywhere; ``cpu`` runs the C++ kernels
of csrc/; ``triton_encode`` / ``triton_decode`` are the CUDA kernels (tested in the interpreter, not
yet dispatched: issue "The CUDA path for real").  ``select`` picks one per layer cache.
"""

from __future__ import annotations

import os
from types import ModuleType

ENV_PATH = "VLLM_TEMPORALKV_OPS"  # "torch" forces the torch path (a diagnostic / the oracle)


def select(lc, device) -> tuple[ModuleType, str]:
    """(ops module, a name for logs) for a layer cache on ``device``."""
    from . import paged_torch

    if os.environ.get(ENV_PATH, "").lower() == "torch":
        return paged_torch, f"torch ({ENV_PATH}=torch)"
    if getattr(device, "type", str(device)) == "cpu":
        from . import cpu

        if cpu.supports(lc):
            return cpu, f"C++ ({cpu.isa()})"
        if not cpu.available():
            why = "extension not loaded"
        elif lc.layout.window or lc.k.codec.layout.kernel_variant is None:
            why = "the C++ kernels serve codebook codes without a recent window"
        else:
            why = "shape not supported by the C++ kernels"
        return paged_torch, f"torch ({why})"
    return paged_torch, "torch"
