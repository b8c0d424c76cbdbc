"""The Triton kernels behind the ops signature (``forward``, as ``paged_torch`` and ``cpu`` have it): the CUDA path.

A step of one layer, attention first and then the cache update, as the cache contract requires:
* the requests with one query token (decodes) attend in one ``triton_decode`` launch for all of them, straight
  from the codes (no per-request Python);
* the others (prefill chunks) attend on the torch path (``paged_torch.paged_attention`` for those requests: the
  context decoded once, then flash attention over it and the exact band);
* every new token is stored by ``triton_encode.write_kv`` (encode completed blocks, store the rest), bit-identical
  to ``paged_torch.write_kv``.

On a machine without a GPU the same module runs in Triton's interpreter (``TRITON_INTERPRET=1`` and
``VLLM_TEMPORALKV_OPS=triton`` in the server's environment): that is how CI tests the wiring inside a real vLLM
server.  What the kernels do not cover (a recent window, scaled integer codes, a float32 model whose region is
bfloat16, the batch-invariant float64 attention) stays on the torch path: ``supports`` says which.
"""

from __future__ import annotations

import torch

from . import paged_torch
from .triton_decode import paged_attention as decode_attention
from .triton_encode import INTERPRET, write_kv


def mode() -> str:
    return "interpreter" if INTERPRET else "compiled"


def supports(lc, pages: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernels handle this layer cache (else: the torch path)."""
    D = lc.layout.head_dim
    device_ok = pages is None or (pages.dtype == torch.uint8 and pages.is_contiguous()
                                  and (pages.device.type == "cuda" or INTERPRET))
    return (lc.dtype in (torch.bfloat16, torch.float16) and D in (64, 128, 256) and lc.layout.window == 0
            and lc.k.codec.layout.kernel_variant is not None and lc.v.codec.layout.kernel_variant is not None
            and lc.k.outliers == lc.layout.outliers == lc.v.outliers and device_ok)


@torch.no_grad()
def forward(lc, pages: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
            positions: torch.Tensor, page_ids: torch.Tensor, scale: float, out: torch.Tensor | None = None,
            batch_invariant: bool = True) -> torch.Tensor:
    """Twin of ``paged_torch.forward``.  ``query_start_loc`` and ``seq_lens`` are the metadata builder's host
    tensors: which requests decode is decided on the host, without a device sync."""
    if batch_invariant or not supports(lc, pages):
        return paged_torch.forward(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables,
                                   positions, page_ids, scale, out, batch_invariant)
    if out is None:
        out = torch.empty_like(query)
    dev = pages.device
    qsl = query_start_loc.cpu()
    qlen = qsl[1:] - qsl[:-1]
    one = qlen == 1
    if bool(one.all()):  # a uniform decode batch: one launch, the rows are the requests
        decode_attention(lc, pages, query, key, value, qsl.to(dev), seq_lens.to(dev), block_tables, scale, out)
    else:
        dec = one.nonzero().flatten()
        if dec.numel():
            rows = qsl[:-1][dec].to(dev)
            out[rows] = decode_attention(lc, pages, query[rows], key[rows], value[rows],
                                         torch.arange(dec.numel() + 1, device=dev), seq_lens[dec].to(dev),
                                         block_tables[dec.to(block_tables.device)], scale).to(out.dtype)
        rest = (~one).nonzero().flatten().tolist()  # prefill chunks (paged_attention skips empty ones)
        paged_torch.paged_attention(lc, pages, query, key, value, qsl, seq_lens, block_tables, scale, out,
                                    batch_invariant=False, requests=rest)
    write_kv(lc, pages, key, value, positions, page_ids)
    return out
