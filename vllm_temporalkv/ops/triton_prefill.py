"""Prefill attention on the GPU: every prefill chunk of a step in one Triton flash-attention launch.

What a chunk's query at position p sees (paged_torch._attend, the oracle): the *decoded* keys / values of every
block before its own (positions < 8 * (p // 8)), and the *exact* ones of its own block up to itself.  The
reference builds both versions per request (``paged_torch.request_keys``: the context's blocks decoded from the
pages, the chunk's completed blocks encoded and decoded) and attends with float32 matmuls over [heads, Tq, n]
scores, request by request; on an H200 serving the Llama-3.1-8B shape that ran at ~1.7k prompt tokens/s against
auto's ~20k+ (benchmarks/gpu/NOTES.md, 2026-11-28): the prefill, not the decode, was the GPU's bottleneck.

Here the step's tokens are written first (the Triton encoder, one launch: a context's exact tail read before),
so the decoded version of every block comes from the pages (one gather launch per request) instead of the torch
codec; the two versions of all prefill requests are stacked into one buffer each and one kernel computes the
attention of every (query tile, query head): an online softmax over the decoded keys before each query's block
(the block-causal mask only bites in the diagonal tiles), then over the exact keys of its own block (at most 8
per query) - float32 accumulation, the half-precision dot products on tensor cores (``_dot``: float32 in Triton's
interpreter).  Same keys, same mask as the oracle; only the summation order differs (checked against it within
the model dtype's tolerance, and the pages bit for bit, tests/test_triton_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..methods import BLOCK_TOKENS, SINK_TOKENS
from .triton_decode import _dot
from .triton_encode import INTERPRET

BM = 64  # queries per program (32 at head_dim 256: the [BM, D] float32 accumulator stays in registers)
BN = 64  # keys per step of the inner loop
WARPS = 4


@triton.jit
def _softmax_step(q, k_ptr, v_ptr, offs_n, key_ok, kv_row0, stride_kt, m_i, l_i, acc, scale_log2e,
                  dd, F32: tl.constexpr, DT: tl.constexpr):
    """One tile of keys (rows kv_row0 + offs_n; key_ok [BM, BN] says which each query sees) into the running
    (max, sum, accumulator) of an online softmax in base 2."""
    kt = tl.load(k_ptr + (kv_row0 + offs_n)[None, :] * stride_kt + dd[:, None],
                 mask=tl.max(key_ok.to(tl.int32), 0)[None, :] > 0, other=0.0)  # [D, BN]
    s = _dot(q, kt, F32, DT) * scale_log2e
    s = tl.where(key_ok, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that has seen nothing yet stays empty
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    v = tl.load(v_ptr + (kv_row0 + offs_n)[:, None] * stride_kt + dd[None, :],
                mask=tl.max(key_ok.to(tl.int32), 0)[:, None] > 0, other=0.0)  # [BN, D]
    acc = acc * alpha[:, None] + _dot(p, v, F32, DT)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _prefill_kernel(q_ptr, kd_ptr, vd_ptr, ke_ptr, ve_ptr, o_ptr,
                    tile_req_ptr, tile_m0_ptr, req_q0_ptr, req_len_ptr, req_ctx_ptr, req_kd0_ptr, req_ke0_ptr,
                    scale_log2e, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                    GQ: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLK: tl.constexpr,
                    F32: tl.constexpr):
    """Queries m0 .. m0 + BM of request r (rows q0 + m; positions ctx + m), query head h: their attention over
    the decoded keys before their blocks (position j at row kd0 + j of kd / vd), then the exact keys of their own
    blocks (position j at row ke0 + j of ke / ve: ke0 is offset by the request's first exact position)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    DT: tl.constexpr = o_ptr.dtype.element_ty
    r = tl.load(tile_req_ptr + t)
    m0 = tl.load(tile_m0_ptr + t)
    q0 = tl.load(req_q0_ptr + r).to(tl.int64)
    qlen = tl.load(req_len_ptr + r)
    ctx = tl.load(req_ctx_ptr + r)
    kd0 = tl.load(req_kd0_ptr + r).to(tl.int64)
    ke0 = tl.load(req_ke0_ptr + r).to(tl.int64)
    kvh = h // GQ
    offs_m = m0 + tl.arange(0, BM)
    q_ok = offs_m < qlen
    pos = ctx + offs_m
    own = pos // BLK * BLK  # each query's first key of its own block
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + dd[None, :], mask=q_ok[:, None],
                other=0.0)
    m_i = tl.full([BM], -float("inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    last = ctx + tl.minimum(m0 + BM, qlen) - 1  # the tile's last query position
    kd_h, vd_h = kd_ptr + kvh * stride_kh, vd_ptr + kvh * stride_kh
    # decoded keys before each query's own block: [0, own of the last query)
    for start in range(0, last // BLK * BLK, BN):
        offs_n = start + tl.arange(0, BN)
        ok = (offs_n[None, :] < own[:, None]) & q_ok[:, None]
        m_i, l_i, acc = _softmax_step(q, kd_h, vd_h, offs_n, ok, kd0, stride_kt, m_i, l_i, acc, scale_log2e, dd,
                                      F32, DT)
    # exact keys of the own blocks: [own of the first query, last]
    ke_h, ve_h = ke_ptr + kvh * stride_kh, ve_ptr + kvh * stride_kh
    for start in range((ctx + m0) // BLK * BLK, last + 1, BN):
        offs_n = start + tl.arange(0, BN)
        ok = (offs_n[None, :] >= own[:, None]) & (offs_n[None, :] <= pos[:, None]) & q_ok[:, None]
        m_i, l_i, acc = _softmax_step(q, ke_h, ve_h, offs_n, ok, ke0, stride_kt, m_i, l_i, acc, scale_log2e, dd,
                                      F32, DT)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real query sees itself: l_i > 0
    tl.store(o_ptr + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + dd[None, :], o.to(DT), mask=q_ok[:, None])


@torch.no_grad()
def prefill_attention(lc, pages: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      qsl: list[int], lens: list[int], block_tables: torch.Tensor, scale: float, out: torch.Tensor,
                      requests, write, gather=None) -> torch.Tensor:
    """Rows of ``out`` for the prefill chunks ``requests`` (indices into the host lists ``qsl`` [R + 1] and
    ``lens`` [R], cached + new tokens), as ``paged_torch.paged_attention`` computes them (no recent window).

    ``write()`` stores the step's tokens (``write_kv`` of every row; any decode rows must have attended before).
    It runs here, between reading each context's exact tail (the tokens of a block the chunk completes, which the
    write encodes) and gathering the keys: the decoded version of every block the chunk completes then comes from
    the pages as the write encoded them (``gather``: gather_kv or a twin) - what ``paged_torch.request_keys``
    computes with the torch codec, here with the step's one encoder launch and one decode launch per request."""
    from . import paged_torch

    reqs = [r for r in requests if qsl[r + 1] > qsl[r]]
    gather = gather or paged_torch.gather_kv
    # positions e0 .. ctx - 1: the context's tokens in the first query's block, exact until this write encodes them
    # (in the sinks, position < 8, they stay exact in the pages and come with the gather below)
    tails = {}
    for r in reqs:
        ctx = lens[r] - (qsl[r + 1] - qsl[r])
        if ctx > SINK_TOKENS and ctx % BLOCK_TOKENS:
            kt, vt = paged_torch.exact_rows(lc, pages, block_tables[r], ctx // BLOCK_TOKENS * BLOCK_TOKENS, ctx)
            tails[r] = kt.to(lc.dtype), vt.to(lc.dtype)
    write()
    if not reqs:
        return out
    kds, vds, kes, ves, meta = [], [], [], [], []
    kd0 = ke0 = 0
    for r in reqs:
        a, b = qsl[r], qsl[r + 1]
        n = lens[r]
        ctx, e0 = n - (b - a), (n - (b - a)) // BLOCK_TOKENS * BLOCK_TOKENS
        Kd, Vd = gather(lc, pages, block_tables[r], n)  # blocks closed by now decoded, sinks and the tail exact
        kt, vt = tails[r] if r in tails else (Kd[e0:ctx], Vd[e0:ctx])  # (empty, or the exact sinks)
        kes += [kt, lc.exact(key[a:b])]
        ves += [vt, lc.exact(value[a:b])]
        kds.append(Kd), vds.append(Vd)
        meta.append((a, b - a, ctx, kd0, ke0 - e0))  # exact row of position j: ke0 - e0 + j
        kd0 += n
        ke0 += n - e0
    kd, vd, ke, ve = (torch.cat(x) for x in (kds, vds, kes, ves))
    Hq, D = query.shape[1], query.shape[2]
    bm = BM if D <= 128 else BM // 2
    tiles = [(i, m) for i, (_, n, _, _, _) in enumerate(meta) for m in range(0, n, bm)]
    dev = query.device
    # one host-to-device copy for the whole step's tables: the tiles' (request, first query), then each of the
    # requests' five fields as a contiguous row (what the kernel indexes by request)
    host = torch.tensor([t[0] for t in tiles] + [t[1] for t in tiles] + [m[i] for i in range(5) for m in meta],
                        dtype=torch.int32)
    tab = host.to(dev, non_blocking=True)
    nt, nr = len(tiles), len(meta)
    per = tab[2 * nt:].view(5, nr)
    G = Hq // ke.shape[1]
    assert kd.stride() == ke.stride(), (kd.stride(), ke.stride())
    # a view of out when it is contiguous per row; else a buffer copied back (rows of out untouched otherwise)
    o = out if out.stride(-1) == 1 else torch.empty_like(out)
    _prefill_kernel[(nt, Hq)](
        query, kd, vd, ke, ve, o, tab[:nt], tab[nt:2 * nt], *per,
        scale * 1.4426950408889634, query.stride(0), query.stride(1), ke.stride(0), ke.stride(1),
        o.stride(0), o.stride(1), GQ=G, D=D, BM=bm, BN=BN, BLK=BLOCK_TOKENS, F32=INTERPRET,
        num_warps=WARPS,
    )
    if o is not out:
        for a, n, _, _, _ in meta:
            out[a:a + n] = o[a:a + n]
    return out
