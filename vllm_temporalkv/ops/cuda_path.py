"""The Triton path (ops/triton_path.py) with its decode attention on the CUDA kernel of csrc/cuda (ops/cuda.py).

Serves wherever the kernel can (ops.select: a CUDA device, nvcc or cached cubins, a supported layer;
``VLLM_TEMPORALKV_CUDA_DECODE=0`` keeps the Triton decode).  Checked on an H100 against the torch oracle (10 format
cases, random page layouts, a CUDA-graph replay: ``bash benchmarks/gpu/h100.sh cuda``) and timed there
(benchmarks/results/cuda-decode/).  The cache update and prefill chunks stay on the Triton path; a decode batch the
kernel does not take (more than 8 query heads per KV head) goes to the Triton decode."""

from __future__ import annotations

import torch

from . import cuda, triton_path
from .cuda_plan import GQP
from .triton_path import StepPlan, plan_step, supports  # noqa: F401 - the backend asks for the step plan

__all__ = ["forward", "mode", "plan_step", "supports"]


def mode() -> str:
    return f"CUDA decode (csrc/cuda) + Triton {triton_path.mode()} encode / prefill"


def _decode(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, scale, out=None):
    if query.shape[1] // key.shape[1] > GQP:
        return triton_path._triton_decode_attention(lc, pages, query, key, value, query_start_loc, seq_lens,
                                                    block_tables, scale, out)
    return cuda.paged_attention(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, scale, out)


@torch.no_grad()
def forward(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, positions, page_ids, scale,
            out=None, batch_invariant: bool = True, plan: StepPlan | None = None) -> torch.Tensor:
    """``triton_path.forward`` with the decode launches on the CUDA kernel."""
    return triton_path.forward(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, positions,
                               page_ids, scale, out, batch_invariant, plan, decode=_decode)
