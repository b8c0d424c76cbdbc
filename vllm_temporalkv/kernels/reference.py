"""The paged cache in plain torch: cache update, gather, attention.  The CPU path of the vLLM
backend and the oracle the Triton kernels are tested against.

Cache contract (one layer; ``pages`` is ``[num_pages, H, layout.bytes]`` uint8, see layout.py):
* a token at position p of a sequence goes to page ``block_ids`` (vLLM's slot // block_size);
* p < SINK_TOKENS: its post-RoPE K and V, in half precision, in region slot p (page 0);
* otherwise it waits in tail slot TAIL_SLOT0 + p % BLOCK_TOKENS of its page until its block of
  BLOCK_TOKENS tokens is complete; then the block's keys are un-rotated to pre-RoPE, the block is
  encoded (normalize, outliers, argmin) and its codes written to the block's slot in the page.
  The sink block (positions 0..7) is never encoded.
* attention: a query at position i sees the exact K/V of its own block (the sinks, or the
  block's tokens so far, which wait in half precision) and the *decoded* K/V of every earlier
  block - whether those blocks come from the pages or were completed within this very step.  So
  what a token attends to does not depend on how prefills are chunked, on prefix-cache hits or
  on batching: the same as a token-by-token decode (and as the quality harness's causal protocol).
  A step must attend *before* it writes its tokens: writing can reuse tail slots that still
  hold the context's incomplete block.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..codecs.quantizer import Encoded, KVQuantizer
from ..formats import BLOCK_TOKENS, SINK_TOKENS, KVFormat
from ..layout import TAIL_SLOT0, PageLayout, pack_block_codes, unpack_block_codes
from ..rope import Rope


@dataclasses.dataclass
class LayerCache:
    """Everything needed to read and write one layer's pages."""

    fmt: KVFormat
    layout: PageLayout
    k: KVQuantizer
    v: KVQuantizer
    rope: Rope
    dtype: torch.dtype  # the model's half dtype (region and outlier values)

    @property
    def block_size(self) -> int:
        return self.layout.block_size


def _encode_blocks(lc: LayerCache, pages, page_ids, block_slots, k_pre, v, ) -> None:
    """Encode whole blocks: k_pre/v [nblk * 8, H, D] -> codes (and outliers) in the pages."""
    lay = lc.layout
    for kind, q, x in (("k", lc.k, k_pre), ("v", lc.v, v)):
        enc = q.encode(x)
        codes = lay.codes_view(pages, kind)
        codes[page_ids, :, block_slots] = pack_block_codes(_codec_fmt(lc, q), enc.codes)
        if lay.outliers:
            idx, val = lay.outlier_views(pages, kind, lc.dtype)
            idx[page_ids, :, block_slots] = enc.outlier_idx
            val[page_ids, :, block_slots] = enc.outlier_val.to(lc.dtype)


def _codec_fmt(lc: LayerCache, q: KVQuantizer) -> KVFormat:
    """The format as the codes of this layer/kind are laid out (the hybrid may be channel-chunked)."""
    if q.codec.method == lc.fmt.method:
        return lc.fmt
    return dataclasses.replace(lc.fmt, method=q.codec.method)


@torch.no_grad()
def write_kv(
    lc: LayerCache,
    pages: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    page_ids: torch.Tensor,
) -> None:
    """Cache update for N new tokens (any mix of requests, each request's tokens in order).

    key/value [N, H, D] (post-RoPE keys, as vLLM passes them), positions [N], page_ids [N]."""
    if key.shape[0] == 0:
        return
    lay = lc.layout
    region = lay.region_view(pages, lc.dtype)
    pos = positions.long()
    pid = page_ids.long()
    off = pos % BLOCK_TOKENS
    is_sink = pos < SINK_TOKENS
    ends = (~is_sink) & (off == BLOCK_TOKENS - 1)  # tokens that complete a block
    N = key.shape[0]
    i = torch.arange(N, device=key.device)

    # 1. tokens whose block is not completed within this call will wait in the tail slots
    #    (a block completes in this call iff a later token of the same page closes it)
    completes_here = torch.zeros(N, dtype=torch.bool, device=key.device)
    for r in range(BLOCK_TOKENS):  # mark the rows of every block that ends in this call
        src = i[ends] - (BLOCK_TOKENS - 1 - r)
        ok = src >= 0
        src = src[ok]
        same = (pid[src] == pid[ends][ok]) & (pos[src] == pos[ends][ok] - (BLOCK_TOKENS - 1 - r))
        completes_here[src[same]] = True
    kh, vh = key.to(lc.dtype), value.to(lc.dtype)

    # 2. encode completed blocks: rows from this call's input, or from the tail slots - read
    #    before step 3 writes, which may reuse those slots (a later block of the same page)
    e = i[ends]
    if e.numel():
        _encode_completed(lc, pages, region, kh, vh, pos, pid, e)

    # 3. the waiting tokens (and sinks) go to the region
    s = is_sink
    region[pid[s], :, pos[s], 0] = kh[s]
    region[pid[s], :, pos[s], 1] = vh[s]
    t = (~is_sink) & (~completes_here)
    region[pid[t], :, TAIL_SLOT0 + off[t], 0] = kh[t]
    region[pid[t], :, TAIL_SLOT0 + off[t], 1] = vh[t]


def _encode_completed(lc: LayerCache, pages, region, kh, vh, pos, pid, e) -> None:
    """Gather the rows of the blocks ending at this call's tokens e, un-RoPE the keys, encode."""
    nblk = e.numel()
    H, D = kh.shape[1], kh.shape[2]
    kb = torch.empty(nblk, BLOCK_TOKENS, H, D, dtype=lc.dtype, device=kh.device)
    vb = torch.empty_like(kb)
    for r in range(BLOCK_TOKENS):
        src = e - (BLOCK_TOKENS - 1 - r)
        inb = (src >= 0)
        srcc = src.clamp_min(0)
        inb &= (pid[srcc] == pid[e]) & (pos[srcc] == pos[e] - (BLOCK_TOKENS - 1 - r))
        from_tail_k = region[pid[e], :, TAIL_SLOT0 + r, 0]
        from_tail_v = region[pid[e], :, TAIL_SLOT0 + r, 1]
        kb[:, r] = torch.where(inb[:, None, None], kh[srcc], from_tail_k)
        vb[:, r] = torch.where(inb[:, None, None], vh[srcc], from_tail_v)
    block_pos = (pos[e] - (BLOCK_TOKENS - 1))[:, None] + torch.arange(BLOCK_TOKENS, device=kh.device)
    k_pre = lc.rope.invert(kb.reshape(-1, H, D), block_pos.reshape(-1)).to(lc.dtype)
    slot = (pos[e] % lc.block_size) // BLOCK_TOKENS
    _encode_blocks(lc, pages, pid[e], slot, k_pre, vb.reshape(-1, H, D))


@torch.no_grad()
def gather_kv(lc: LayerCache, pages: torch.Tensor, block_table: torch.Tensor, n: int):
    """The first n cached tokens of one sequence -> (K post-RoPE, V), each [n, H, D] in lc.dtype."""
    lay = lc.layout
    region = lay.region_view(pages, lc.dtype)
    H, D = region.shape[1], region.shape[-1]
    K = torch.empty(n, H, D, dtype=lc.dtype, device=pages.device)
    V = torch.empty_like(K)
    ns = min(n, SINK_TOKENS)
    if ns:
        p0 = block_table[0]
        K[:ns] = region[p0, :, :ns, 0].transpose(0, 1)
        V[:ns] = region[p0, :, :ns, 1].transpose(0, 1)
    full = n // BLOCK_TOKENS  # complete blocks, the first being the sinks
    if full > 1:
        bpos = torch.arange(1, full, device=pages.device) * BLOCK_TOKENS
        pg = block_table[(bpos // lc.block_size).long()]
        slot = (bpos % lc.block_size) // BLOCK_TOKENS
        T = (full - 1) * BLOCK_TOKENS
        for kind, q, out in (("k", lc.k, K), ("v", lc.v, V)):
            packed = lay.codes_view(pages, kind)[pg, :, slot]  # [nblk, H, code_bytes]
            enc = Encoded(unpack_block_codes(_codec_fmt(lc, q), packed, D), None, None)
            if lay.outliers:
                idx, val = lay.outlier_views(pages, kind, lc.dtype)
                enc.outlier_idx, enc.outlier_val = idx[pg, :, slot], val[pg, :, slot]
            x = q.decode(enc, T, torch.float32)
            if kind == "k":
                x = lc.rope.apply(x, torch.arange(BLOCK_TOKENS, full * BLOCK_TOKENS, device=pages.device))
            out[BLOCK_TOKENS : full * BLOCK_TOKENS] = x.to(lc.dtype)
    tail0 = max(full * BLOCK_TOKENS, SINK_TOKENS)
    if n > tail0:
        pg = block_table[tail0 // lc.block_size]
        r = n - tail0
        K[tail0:] = region[pg, :, TAIL_SLOT0 : TAIL_SLOT0 + r, 0].transpose(0, 1)
        V[tail0:] = region[pg, :, TAIL_SLOT0 : TAIL_SLOT0 + r, 1].transpose(0, 1)
    return K, V


def _decoded_blocks(lc: LayerCache, K: torch.Tensor, V: torch.Tensor, lo: int, hi: int):
    """Encode-decode the whole blocks in positions [lo, hi) of exact K (post-RoPE) / V."""
    pos = torch.arange(lo, hi, device=K.device)
    k_pre = lc.rope.invert(K[lo:hi], pos).to(lc.dtype)
    kq = lc.rope.apply(lc.k.decode(lc.k.encode(k_pre), hi - lo, torch.float32), pos).to(lc.dtype)
    # decoded exactly as gather_kv decodes a stored block (float32, then the model dtype)
    vq = lc.v.decode(lc.v.encode(V[lo:hi]), hi - lo, torch.float32).to(lc.dtype)
    return kq, vq


def _attend(q, k_exact, v_exact, k_dec, v_dec, scale, offset):
    """q [Tq, Hq, D] at positions offset..; keys [Tk, Hkv, D] in two versions: query i uses the
    exact ones of its own block and the decoded ones elsewhere; causal."""
    Hq, Hkv = q.shape[1], k_exact.shape[1]
    g = Hq // Hkv
    Tq, Tk = q.shape[0], k_exact.shape[0]
    # float64 on the CPU: a chunked prefill or a batch changes the matmul shapes and so the float32
    # rounding; a last-bit change in one layer's output can flip a later layer's codes (a discrete
    # jump).  In float64 the result, rounded to the model dtype, no longer depends on the shapes.
    acc = torch.float64 if q.device.type == "cpu" else torch.float32
    heads = lambda t: t.to(acc).transpose(0, 1).repeat_interleave(g, 0)  # noqa: E731
    qf = q.to(acc).transpose(0, 1)  # [Hq, Tq, D]
    qpos = offset + torch.arange(Tq, device=q.device)
    kpos = torch.arange(Tk, device=q.device)
    own = (qpos[:, None] // BLOCK_TOKENS) == (kpos[None, :] // BLOCK_TOKENS)
    s = torch.where(own, qf @ heads(k_exact).transpose(1, 2), qf @ heads(k_dec).transpose(1, 2)) * scale
    s.masked_fill_(kpos[None, :] > qpos[:, None], -math.inf)
    p = torch.softmax(s, -1)
    return ((p * own) @ heads(v_exact) + (p * ~own) @ heads(v_dec)).transpose(0, 1)  # [Tq, Hq, D]


@torch.no_grad()
def paged_attention(
    lc: LayerCache,
    pages: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, Hq, D] and this step's key/value [T, Hkv, D] for a batch of requests laid out by
    query_start_loc [R + 1]; seq_lens [R] count cached + new tokens. Returns [T, Hq, D]."""
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    for r, n in enumerate(seq_lens.tolist()):
        a, b = qsl[r], qsl[r + 1]
        if b == a:
            continue
        ctx = n - (b - a)
        kc, vc = gather_kv(lc, pages, block_tables[r], ctx)  # decoded blocks + exact tail
        K = torch.cat([kc, key[a:b].to(lc.dtype)])
        V = torch.cat([vc, value[a:b].to(lc.dtype)])
        # blocks this step completes (the context's tail block included) also in decoded form
        lo = max(SINK_TOKENS, ctx // BLOCK_TOKENS * BLOCK_TOKENS)
        hi = n // BLOCK_TOKENS * BLOCK_TOKENS
        Kd, Vd = K, V
        if hi > lo:
            Kd, Vd = K.clone(), V.clone()
            Kd[lo:hi], Vd[lo:hi] = _decoded_blocks(lc, K, V, lo, hi)
        out[a:b] = _attend(query[a:b], K, V, Kd, Vd, scale, ctx).to(out.dtype)
    return out
