"""The Triton kernels behind the ops signature (``forward``, as ``paged_torch`` and ``cpu`` have it): the CUDA path.

A step of one layer, with the attention the cache contract defines (each query sees what the torch path's
attention-then-update order gives it):
* the requests with one query token (decodes) attend in one ``triton_decode`` launch for all of them, straight
  from the codes (no per-request Python), before the step's tokens are stored;
* every new token is stored by ``triton_encode.write_kv`` (encode completed blocks, store the rest), bit-identical
  to ``paged_torch.write_kv``;
* the others (prefill chunks), on a GPU: each context's exact tail read before that write, the keys after it
  (``triton_decode.gather_kv``: blocks decoded by a Triton kernel, bit-identical to the torch decode, so the
  blocks a chunk completes come back as the torch codec would round them), then all chunks' attention in one
  Triton flash launch (``triton_prefill``); on the CPU, in Triton's interpreter, before the write, through
  ``paged_torch.paged_attention`` with the C++ prefill kernel, as the C++ path has it.

On a machine without a GPU the same module runs in Triton's interpreter (``TRITON_INTERPRET=1`` and
``VLLM_TEMPORALKV_OPS=triton`` in the server's environment): that is how CI tests the wiring inside a real vLLM
server.  What the kernels do not cover (a recent window, scaled integer codes, a float32 model whose region is
bfloat16, the batch-invariant float64 attention) stays on the torch path: ``supports`` says which.
"""

from __future__ import annotations

import dataclasses

import torch

from . import paged_torch
from .triton_decode import gather_kv, paged_attention as _triton_decode_attention
from .triton_encode import INTERPRET, write_kv
from .triton_prefill import prefill_attention


def mode() -> str:
    return "interpreter" if INTERPRET else "compiled"


def supports(lc, pages: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernels handle this layer cache (else: the torch path)."""
    D = lc.layout.head_dim
    device_ok = pages is None or (pages.dtype == torch.uint8 and pages.is_contiguous()
                                  and (pages.device.type == "cuda" or INTERPRET))
    return (lc.kernel_blocker is None and lc.dtype in (torch.bfloat16, torch.float16) and D in (64, 128, 256)
            and device_ok)


@dataclasses.dataclass
class StepPlan:
    """Which requests of a step decode, and the device tensors the decode launch reads: built once per step
    (the metadata builder's host tensors, copied to the device once) and shared by every layer, so a layer's
    forward makes no host-to-device copy and no device sync."""

    uniform_decode: bool  # every request has one query token: one launch, the rows are the requests
    query_start_loc: torch.Tensor  # [R + 1] int32 on the device (uniform) or 0..D (the decodes)
    seq_lens: torch.Tensor  # [R] or [D] int32 on the device
    decode_rows: torch.Tensor | None  # mixed steps: the decodes' token rows (= their request's first row)
    decode_reqs: torch.Tensor | None  # and their request indices, on the block table's device
    prefills: list[int]  # requests with more than one query token (host)
    decode_prefix: int = 0  # mixed steps whose decodes are the first requests (vLLM reorders them so): how many
    # a uniform decode with the block table: each row's position and page, computed on the device from seq_lens
    # and the block table alone (a padded row, seq_len 0: position -1, page -1, which the kernels skip) - what a
    # CUDA graph replays, reading vLLM's persistent buffers
    positions: torch.Tensor | None = None
    page_ids: torch.Tensor | None = None
    max_position: int | None = None  # the block table's capacity in tokens: spares write_kv a device sync


def decode_slots(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int):
    """(positions, page ids) of one query token per request, on the device, no sync: position seq_len - 1 in its
    page; rows with seq_len 0 (padding) get -1 for both."""
    live = seq_lens > 0
    pos = seq_lens.long() - 1
    rows = torch.arange(seq_lens.shape[0], device=block_tables.device)
    page = block_tables[rows, (pos.clamp(min=0) // block_size).to(block_tables.device)]
    return (torch.where(live, pos, -1).to(block_tables.device),
            torch.where(live.to(block_tables.device), page.long(), -1))


def padding_requests(qlen: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The requests vLLM adds to pad a decode batch to a captured CUDA-graph size: 0 query tokens (its
    query_start_loc repeats the last value) and seq_len 0, after every real request (host tensors)."""
    pad = (qlen == 0) & (seq_lens.cpu()[: qlen.shape[0]] == 0)
    real = (~pad).nonzero()
    return pad & (torch.arange(qlen.shape[0]) > (int(real[-1]) if real.numel() else -1))


def plan_step(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, device, table_device=None,
              device_seq_lens: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
              block_size: int | None = None) -> StepPlan:
    """From the host ``query_start_loc`` / ``seq_lens``; ``device_seq_lens``: vLLM's own device copy of
    ``seq_lens`` (a uniform decode reads it as is: no copy at all); with ``block_tables`` and ``block_size``
    a uniform decode also finds its own positions and pages on the device."""
    qsl = query_start_loc.cpu()
    qlen = qsl[1:] - qsl[:-1]
    one = qlen == 1
    # the padding check (a seq_lens read) only when some request is not a one-token decode
    if bool(one.all()) or bool((one | padding_requests(qlen, seq_lens)).all()):
        dev_sl = device_seq_lens if device_seq_lens is not None and device_seq_lens.device == torch.device(device) \
            else seq_lens.to(device, torch.int32)
        # rows = requests (a padding request's row is ignored); 0..R made on the device: a host-to-device copy
        # could not be captured in a CUDA graph, and the decode never reads it (its shape says R)
        plan = StepPlan(True, torch.arange(len(qlen) + 1, dtype=torch.int32, device=device), dev_sl, None, None, [])
        if block_tables is not None and block_size:
            plan.positions, plan.page_ids = decode_slots(dev_sl, block_tables, block_size)
            plan.max_position = block_tables.shape[1] * block_size
        return plan
    dec = one.nonzero().flatten()
    nd = dec.numel()
    prefix = nd if nd and int(dec[-1]) == nd - 1 else 0  # the backend asks vLLM for decodes first
    return StepPlan(False, torch.arange(nd + 1, dtype=torch.int32).to(device),
                    seq_lens.cpu()[dec].to(device, torch.int32), None if prefix else qsl[:-1][dec].to(device),
                    None if prefix else dec.to(table_device or device), (~one).nonzero().flatten().tolist(), prefix)


def _batched_prefill(query: torch.Tensor) -> bool:
    """The prefill chunks' attention in one Triton flash launch (a GPU); on the CPU the C++ prefill kernel's."""
    return query.device.type == "cuda"


@torch.no_grad()
def _cpu_prefill(query: torch.Tensor):
    """The C++ prefill attention for CPU tensors where the extension is loaded (else None: the torch one)."""
    if query.device.type != "cpu":
        return None
    from . import cpu

    return cpu.attend_fast if cpu.available() else None


def forward(lc, pages: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
            positions: torch.Tensor, page_ids: torch.Tensor, scale: float, out: torch.Tensor | None = None,
            batch_invariant: bool = True, plan: StepPlan | None = None, decode=None) -> torch.Tensor:
    """Twin of ``paged_torch.forward``.  ``query_start_loc`` and ``seq_lens`` are the metadata builder's host
    tensors; ``plan`` (``plan_step`` of them, built once per step by the backend) says which requests decode
    and holds their device copies (made here when absent); ``decode``: another launcher of the decode
    attention with ``triton_decode.paged_attention``'s signature (the CUDA kernel: ops/cuda_path.py)."""
    decode_attention = decode or _triton_decode_attention
    if batch_invariant or not supports(lc, pages):
        return paged_torch.forward(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables,
                                   positions, page_ids, scale, out, batch_invariant)
    if out is None:
        out = torch.empty_like(query)
    if plan is None:
        plan = plan_step(query_start_loc, seq_lens, pages.device, block_tables.device)
    if plan.uniform_decode:
        decode_attention(lc, pages, query, key, value, plan.query_start_loc, plan.seq_lens, block_tables, scale, out)
        if plan.positions is not None:  # no host tensor, no sync: what a CUDA graph of the step can replay
            write_kv(lc, pages, key, value, plan.positions, plan.page_ids, max_position=plan.max_position)
            return out
    else:
        if plan.decode_prefix:  # decodes first: their rows are the first ones, views not copies
            d = plan.decode_prefix
            decode_attention(lc, pages, query[:d], key[:d], value[:d], plan.query_start_loc, plan.seq_lens,
                             block_tables[:d], scale, out[:d])
        elif plan.decode_rows is not None and plan.decode_rows.numel():
            rows = plan.decode_rows
            out[rows] = decode_attention(lc, pages, query[rows], key[rows], value[rows], plan.query_start_loc,
                                         plan.seq_lens, block_tables[plan.decode_reqs], scale).to(out.dtype)
        if _batched_prefill(query):  # on a GPU: every prefill chunk in one flash launch (ops/triton_prefill.py),
            # which stores the step's tokens itself (its chunks then read their completed blocks back decoded)
            prefill_attention(lc, pages, query, key, value, query_start_loc.tolist(), seq_lens.tolist(), block_tables,
                              scale, out, plan.prefills, gather=gather_kv,
                              write=lambda: write_kv(lc, pages, key, value, positions, page_ids))
            return out
        # prefill chunks (paged_attention skips empty ones); on the CPU (Triton's interpreter) with the C++ prefill
        # kernel the C++ path uses: the same inputs (bit-identical pages) then give the same outputs - 4-bit codes
        # amplify another summation order's float32 rounding into ~0.1-nat logprob moves through 30 layers
        paged_torch.paged_attention(lc, pages, query, key, value, query_start_loc.cpu(), seq_lens, block_tables,
                                    scale, out, batch_invariant=False, requests=plan.prefills, gather=gather_kv,
                                    attend_fast=_cpu_prefill(query))
    write_kv(lc, pages, key, value, positions, page_ids)
    return out
