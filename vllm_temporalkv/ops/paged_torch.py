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
* with a recent window of W tokens (layout.window, e.g. the selective formats) a block is encoded only once
  the sequence reaches W tokens past it: tokens wait in ring slot 8 + p % (W + 8) of their own page, and a
  query at position i sees exactly every key from ``layout.exact_from(i, W)`` on (write_kv_window).
* small pages (``layout.exact_pages``, issue 34): the same contract, but the sinks and the waiting tokens live in
  exact pages of a second KV-cache group, not in the code pages' region: sink p in slot p of the request's sink
  page, a waiting token p in slot p % BLOCK_TOKENS of its ring page (``ExactPages``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..cache import LayerCache
from ..codecs.quantizer import Encoded
from ..layout import TAIL_SLOT0, exact_from
from ..methods import BLOCK_TOKENS, SINK_TOKENS
from ..page_views import (codes_view, join_head_mean, mean_view, outlier_views, pack_block_codes, region_view,
                          scales_view, split_head_mean, unpack_block_codes)


@dataclasses.dataclass(frozen=True)
class ExactPages:
    """Small pages: where each request's exact tokens are.  ``region`` [num_pages, H, BLOCK_TOKENS, 2, D] half (the
    exact pages, ``page_views.exact_view``), ``table`` [R, >= 2]: each request's (sink page, ring page), the rows of
    the second KV-cache group's block table."""

    region: torch.Tensor
    table: torch.Tensor

    def request(self, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(region, sink page, ring page) of request r: what gather_kv reads."""
        return self.region, self.table[r, 0].long(), self.table[r, 1].long()

    def request_pages(self, r: int) -> tuple[torch.Tensor, int, int]:
        """(region, sink page, ring page) of request r, the pages as ints (the C++ path's: no tensor ops)."""
        sink, ring = self.table[r, :2].tolist()
        return self.region, sink, ring

    def tokens(self, query_start_loc: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(region, sink page [n], ring page [n]) of a step's n tokens: what write_kv writes."""
        qsl = query_start_loc.long().cpu()
        req = torch.repeat_interleave(torch.arange(len(qsl) - 1), qsl[1:] - qsl[:-1])[:n].to(self.table.device)
        return self.region, self.table[req, 0].long(), self.table[req, 1].long()


def _regions(lc: LayerCache, pages, page_ids, exact):
    """(region, sink page per token, tail page per token, first tail slot): the code pages' own region (sinks in the
    first page, waiting tokens in their page), or small pages' exact pages (``ExactPages.tokens``)."""
    if exact is None:
        return region_view(lc.layout, pages, lc.store_dtype), page_ids, page_ids, TAIL_SLOT0
    region, sink, ring = exact
    return region, sink, ring, 0


def _stored_keys(lc: LayerCache, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys -> what the key quantizer encodes: pre-RoPE keys (un-rotated), or the keys as they are for
    a quantizer of post-RoPE keys (QJL: ``post_rope``)."""
    if lc.k.post_rope:
        return k.to(lc.dtype)
    return lc.rope.invert(k, pos).to(lc.dtype)


def _served_keys(lc: LayerCache, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Inverse of _stored_keys for decoded keys (float32): rotated forward unless they are post-RoPE already."""
    return k if lc.k.post_rope else lc.rope.apply(k, pos)


def _encode_blocks(lc: LayerCache, pages, page_ids, block_slots, k_pre, v, ) -> None:
    """Encode whole blocks: k_pre/v [nblk * 8, H, D] -> codes (and outliers) in the pages."""
    lay = lc.layout
    for kind, q, x in (("k", lc.k, k_pre), ("v", lc.v, v)):
        enc = q.encode(x)
        codes = codes_view(lay, pages, kind)
        # a quantizer that lays out its own block bytes (QJL's keys: ``packs_blocks``) returns them as stored
        codes[page_ids, :, block_slots] = enc.codes if q.packs_blocks else pack_block_codes(q.code_layout, enc.codes)
        if enc.scales is not None:  # [nb * 8, H, P] -> [nb, H, 8, P]
            scales_view(lay, pages, kind)[page_ids, :, block_slots] = enc.scales.unflatten(0, (-1, BLOCK_TOKENS)).transpose(1, 2)
        if enc.mean is not None:  # [nb * 8, D] -> each head's share [nb, H, 8, c]
            share = split_head_mean(enc.mean.to(lc.store_dtype), x.shape[1], lay.mean_channels)
            mean_view(lay, pages, kind, lc.store_dtype)[page_ids, :, block_slots] = \
                share.unflatten(0, (-1, BLOCK_TOKENS)).transpose(1, 2)
        if lay.outliers:
            idx, val = outlier_views(lay, pages, kind, lc.store_dtype)
            idx[page_ids, :, block_slots] = enc.outlier_idx
            val[page_ids, :, block_slots] = enc.outlier_val.to(lc.store_dtype)


@torch.no_grad()
def write_kv(
    lc: LayerCache,
    pages: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    page_ids: torch.Tensor,
    exact=None,
) -> None:
    """Cache update for N new tokens (any mix of requests, each request's tokens in order).

    key/value [N, H, D] (post-RoPE keys, as vLLM passes them), positions [N], page_ids [N]; ``exact``: small pages'
    (region, sink page [N], ring page [N]) (``ExactPages.tokens``)."""
    if key.shape[0] == 0:
        return
    lay = lc.layout
    if lay.window:
        raise ValueError("a page layout with a recent window is written by write_kv_window (it needs the block tables)")
    if lay.exact_pages != (exact is not None):
        raise ValueError("small pages are written with their exact pages, other layouts without")
    pos = positions.long()
    pid = page_ids.long()
    region, spg, tpg, tail0 = _regions(lc, pages, pid, exact)
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
    kh, vh = key.to(lc.store_dtype), value.to(lc.store_dtype)  # as the region holds them

    # 2. encode completed blocks: rows from this call's input, or from the tail slots - read
    #    before step 3 writes, which may reuse those slots (a later block of the same page)
    e = i[ends]
    if e.numel():
        _encode_completed(lc, pages, region, kh, vh, pos, pid, e, tpg, tail0)

    # 3. the waiting tokens (and sinks) go to the region
    s = is_sink
    region[spg[s], :, pos[s], 0] = kh[s]
    region[spg[s], :, pos[s], 1] = vh[s]
    t = (~is_sink) & (~completes_here)
    region[tpg[t], :, tail0 + off[t], 0] = kh[t]
    region[tpg[t], :, tail0 + off[t], 1] = vh[t]


def _encode_completed(lc: LayerCache, pages, region, kh, vh, pos, pid, e, tpg=None, tail0: int = TAIL_SLOT0) -> None:
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
        tp = (pid if tpg is None else tpg)[e]
        from_tail_k = region[tp, :, tail0 + r, 0]
        from_tail_v = region[tp, :, tail0 + r, 1]
        kb[:, r] = torch.where(inb[:, None, None], kh[srcc], from_tail_k)
        vb[:, r] = torch.where(inb[:, None, None], vh[srcc], from_tail_v)
    block_pos = (pos[e] - (BLOCK_TOKENS - 1))[:, None] + torch.arange(BLOCK_TOKENS, device=kh.device)
    k_pre = _stored_keys(lc, kb.reshape(-1, H, D), block_pos.reshape(-1))
    slot = (pos[e] % lc.block_size) // BLOCK_TOKENS
    _encode_blocks(lc, pages, pid[e], slot, k_pre, vb.reshape(-1, H, D))


@torch.no_grad()
def write_kv_window(lc: LayerCache, pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor) -> None:
    """The cache update with a recent window (layout.window > 0), request by request (a decode step's requests
    all at once: ``_write_decodes_window``): the blocks that leave the window as the sequence grows from ctx to n
    tokens are encoded (rows from this step's input or from the ring of their page, read before anything is
    written), then the tokens still inside it go to the ring.  The older blocks may sit in earlier pages, hence
    the block tables."""
    region = region_view(lc.layout, pages, lc.store_dtype)
    kh, vh = key.to(lc.store_dtype), value.to(lc.store_dtype)  # as the region holds them
    qsl = query_start_loc.tolist()
    if len(qsl) > 1 and qsl == list(range(len(qsl))):  # a decode step: every request one token
        _write_decodes_window(lc, pages, region, kh, vh, seq_lens, block_tables)
    else:
        _write_window_requests(lc, pages, region, kh, vh, qsl, seq_lens.tolist(), block_tables)


def _write_window_requests(lc: LayerCache, pages, region, kh, vh, qsl: list, lens: list, block_tables) -> None:
    """write_kv_window request by request (any number of new tokens each)."""
    lay = lc.layout
    H, D = kh.shape[1], kh.shape[2]
    B = lc.block_size
    for r, n in enumerate(lens):
        a, b = qsl[r], qsl[r + 1]
        if b == a:
            continue
        ctx, bt = n - (b - a), block_tables[r].long()
        lo, hi = exact_from(ctx, lay.window), exact_from(n, lay.window)
        if hi > lo:
            p = torch.arange(lo, hi, device=kh.device)
            new = p >= ctx
            old = p[~new]
            kb = torch.empty(hi - lo, H, D, dtype=lc.store_dtype, device=kh.device)
            vb = torch.empty_like(kb)
            kb[new], vb[new] = kh[a + p[new] - ctx], vh[a + p[new] - ctx]
            kb[~new] = region[bt[old // B], :, lay.ring_slot(old), 0]
            vb[~new] = region[bt[old // B], :, lay.ring_slot(old), 1]
            k_pre = _stored_keys(lc, kb.to(lc.dtype), p)
            first = p[::BLOCK_TOKENS]
            _encode_blocks(lc, pages, bt[first // B], (first % B) // BLOCK_TOKENS, k_pre, vb.to(lc.dtype))
        p = torch.arange(ctx, n, device=kh.device)
        p = p[(p < SINK_TOKENS) | (p >= hi)]  # still exact after this step
        i = a + p - ctx
        sink = p < SINK_TOKENS
        slot = torch.where(sink, p, lay.ring_slot(p))
        pg = torch.where(sink, bt[0], bt[p // B])
        region[pg, :, slot, 0], region[pg, :, slot, 1] = kh[i], vh[i]


def _write_decodes_window(lc: LayerCache, pages, region, kh, vh, seq_lens, block_tables) -> None:
    """write_kv_window for a step of one new token per request, all requests at once (request by request, the
    ~15 small torch ops of each cost a decode step more than the C++ attention of the selective formats).  The
    same writes: a request's token at position ctx = n - 1 moves at most one block out of the window, [lo, lo + 8),
    whose rows all wait in the ring (lo + 8 <= n - window <= ctx); every block is read before anything is written,
    as each request's are in the loop (a request writes only the ring of its own last page, which no other request
    holds: vLLM shares full pages only)."""
    lay, B = lc.layout, lc.block_size
    n = seq_lens.to(device=kh.device, dtype=torch.long)
    ctx = n - 1
    bt = block_tables.long()
    exact0 = lambda m: ((m - lay.window).div(BLOCK_TOKENS, rounding_mode="floor") * BLOCK_TOKENS).clamp(  # noqa: E731
        min=SINK_TOKENS)  # layout.exact_from, element-wise
    lo = exact0(ctx)
    leave = (exact0(n) > lo).nonzero()[:, 0]
    if leave.numel():
        p = lo[leave, None] + torch.arange(BLOCK_TOKENS, device=kh.device)  # [m, 8]
        pg = bt[leave].gather(1, p // B)
        slot = lay.ring_slot(p)
        kb, vb = region[pg, :, slot, 0].flatten(0, 1), region[pg, :, slot, 1].flatten(0, 1)  # [m * 8, H, D]
        k_pre = _stored_keys(lc, kb.to(lc.dtype), p.flatten())
        _encode_blocks(lc, pages, pg[:, 0], (p[:, 0] % B) // BLOCK_TOKENS, k_pre, vb.to(lc.dtype))
    sink = ctx < SINK_TOKENS  # the new tokens: still exact after this step (their block is the newest)
    slot = torch.where(sink, ctx, lay.ring_slot(ctx))
    pg = torch.where(sink, bt[:, 0], bt.gather(1, (ctx // B)[:, None])[:, 0])
    region[pg, :, slot, 0], region[pg, :, slot, 1] = kh, vh


@torch.no_grad()
def gather_kv(lc: LayerCache, pages: torch.Tensor, block_table: torch.Tensor, n: int, *, decode_blocks=None,
              exact=None):
    """The first n cached tokens of one sequence -> (K post-RoPE, V), each [n, H, D] in lc.dtype.
    ``decode_blocks(lc, pages, block_table, full, K, V)``: a twin that fills rows [8, 8 * full) from the codes
    (the Triton path's kernel); the exact sinks and tail are copied here either way.  ``exact``: small pages'
    (region, sink page, ring page) of this sequence (``ExactPages.request``)."""
    lay = lc.layout
    if lay.exact_pages != (exact is not None):
        raise ValueError("small pages are read with their exact pages, other layouts without")
    region = region_view(lay, pages, lc.store_dtype) if exact is None else exact[0]
    H, D = region.shape[1], region.shape[-1]
    K = torch.empty(n, H, D, dtype=lc.dtype, device=pages.device)
    V = torch.empty_like(K)
    ns = min(n, SINK_TOKENS)
    if ns:
        p0 = block_table[0] if exact is None else exact[1]
        K[:ns] = region[p0, :, :ns, 0].transpose(0, 1)
        V[:ns] = region[p0, :, :ns, 1].transpose(0, 1)
    tail0 = exact_from(n, lay.window)  # the encoded blocks end here; the ring holds the rest
    full = tail0 // BLOCK_TOKENS  # encoded blocks, the first being the sinks
    if full > 1 and decode_blocks is not None:
        decode_blocks(lc, pages, block_table, full, K, V)
    elif full > 1:
        bpos = torch.arange(1, full, device=pages.device) * BLOCK_TOKENS
        pg = block_table[(bpos // lc.block_size).long()]
        slot = (bpos % lc.block_size) // BLOCK_TOKENS
        T = (full - 1) * BLOCK_TOKENS
        for kind, q, out in (("k", lc.k, K), ("v", lc.v, V)):
            packed = codes_view(lay, pages, kind)[pg, :, slot]  # [nblk, H, code_bytes]
            enc = Encoded(packed if q.packs_blocks else unpack_block_codes(q.code_layout, packed, D),
                          None, None)
            if lay.kind_scales_per_row[kind]:  # [nblk, H, 8, P] -> [nblk * 8, H, P]
                enc.scales = scales_view(lay, pages, kind)[pg, :, slot].transpose(1, 2).reshape(T, H, -1)
            if lay.mean_bytes:  # the heads' shares [nblk, H, 8, c] -> [nblk * 8, D]
                share = mean_view(lay, pages, kind, lc.store_dtype)[pg, :, slot].transpose(1, 2)
                enc.mean = join_head_mean(share.reshape(T, H, -1), D)
            if lay.outliers:
                idx, val = outlier_views(lay, pages, kind, lc.store_dtype)
                enc.outlier_idx, enc.outlier_val = idx[pg, :, slot], val[pg, :, slot]
            x = q.decode(enc, T, torch.float32)
            if kind == "k":
                x = _served_keys(lc, x, torch.arange(BLOCK_TOKENS, full * BLOCK_TOKENS, device=pages.device))
            out[BLOCK_TOKENS : full * BLOCK_TOKENS] = x.to(lc.dtype)
    if n > tail0:
        K[tail0:], V[tail0:] = exact_rows(lc, pages, block_table, tail0, n, region, exact)
    return K, V


def exact_rows(lc: LayerCache, pages, block_table, lo: int, hi: int, region=None, exact=None):
    """(K, V) [hi - lo, H, D] of positions lo .. hi - 1 of one sequence, tokens not yet encoded (the sinks, the
    tail in its ring slots), in the stored half dtype.  ``region``: the pages' region view (made here when None);
    ``exact``: small pages' exact pages of this sequence."""
    lay = lc.layout
    if region is None:
        region = region_view(lay, pages, lc.store_dtype) if exact is None else exact[0]
    p = torch.arange(lo, hi, device=pages.device)
    if exact is None:
        pg, slot = block_table[(p // lc.block_size).long()], lay.ring_slot(p)
    else:
        pg, slot = exact[2].expand(p.shape), p % BLOCK_TOKENS
    return region[pg, :, slot, 0], region[pg, :, slot, 1]


def _decoded_blocks(lc: LayerCache, K: torch.Tensor, V: torch.Tensor, lo: int, hi: int):
    """Encode-decode the whole blocks in positions [lo, hi) of exact K (post-RoPE) / V."""
    pos = torch.arange(lo, hi, device=K.device)

    def stored(q, x):  # encoded as write_kv stores it: outlier values in the stored half dtype
        enc = q.encode(x)
        if enc.outlier_val is not None:
            enc.outlier_val = enc.outlier_val.to(lc.store_dtype)
        return enc

    k_pre = _stored_keys(lc, K[lo:hi], pos)
    kq = _served_keys(lc, lc.k.decode(stored(lc.k, k_pre), hi - lo, torch.float32), pos).to(lc.dtype)
    # decoded exactly as gather_kv decodes a stored block (float32, then the model dtype)
    vq = lc.v.decode(stored(lc.v, V[lo:hi]), hi - lo, torch.float32).to(lc.dtype)
    return kq, vq


def _attend(q, k_exact, v_exact, k_dec, v_dec, scale, offset, window: int = 0, q_tile: int = 256):
    """q [Tq, Hq, D] at positions offset..; keys [Tk, Hkv, D] in two versions: query i uses the
    exact ones of its own block (and of the ``window`` tokens before it) and the decoded ones elsewhere; causal.

    Scores against the decoded keys everywhere, then the exact ones only over the band of own blocks
    (a few keys per query); queries in tiles so memory stays O(tile x Tk) at long contexts."""
    Hq, Hkv, D = q.shape[1], k_exact.shape[1], q.shape[2]
    g = Hq // Hkv
    Tq = q.shape[0]
    # float64 on the CPU: a chunked prefill or a batch changes the matmul shapes and so the float32
    # rounding; a last-bit change in one layer's output can flip a later layer's codes (a discrete
    # jump).  In float64 the result, rounded to the model dtype, no longer depends on the shapes.
    acc = torch.float64 if q.device.type == "cpu" else torch.float32
    kv = lambda t: t.to(acc).transpose(0, 1)  # noqa: E731  [Hkv, Tk, D]
    kd, vd, ke, ve = kv(k_dec), kv(v_dec), kv(k_exact), kv(v_exact)
    qg = q.to(acc).reshape(Tq, Hkv, g, D).permute(1, 2, 0, 3)  # [Hkv, g, Tq, D]: no K/V copies per group
    out = torch.empty(Hkv, g, Tq, D, dtype=acc, device=q.device)
    for t0 in range(0, Tq, q_tile):
        t1 = min(Tq, t0 + q_tile)
        qpos = offset + torch.arange(t0, t1, device=q.device)
        kend = offset + t1  # causal: no query of the tile sees past its last position
        lo = max(0, (offset + t0 - window) // BLOCK_TOKENS * BLOCK_TOKENS)  # the tile's first exact key
        qt = qg[:, :, t0:t1].reshape(Hkv, g * (t1 - t0), D)
        s = (qt @ kd[:, :kend].transpose(1, 2)).view(Hkv, g, t1 - t0, kend)
        band = (qt @ ke[:, lo:kend].transpose(1, 2)).view(Hkv, g, t1 - t0, kend - lo)
        kpos = torch.arange(lo, kend, device=q.device)
        own = kpos[None, :] >= _window_start(qpos, window)[:, None]  # seen exactly (later keys: masked)
        s[..., lo:kend] = torch.where(own, band, s[..., lo:kend])
        s *= scale
        s[..., lo:kend].masked_fill_(kpos[None, :] > qpos[:, None], -math.inf)
        p = torch.softmax(s, -1)
        o = p.view(Hkv, g * (t1 - t0), kend) @ vd[:, :kend]
        corr = (p[..., lo:kend] * own).reshape(Hkv, g * (t1 - t0), kend - lo) @ (ve[:, lo:kend] - vd[:, lo:kend])
        out[:, :, t0:t1] = (o + corr).view(Hkv, g, t1 - t0, D)
    return out.permute(2, 0, 1, 3).reshape(Tq, Hq, D)


# torch's fused CPU flash kernel (aten/native/cpu/FlashAttentionKernel.cpp) walks keys in 512-key blocks from
# key 0 (one block when there are fewer) and queries in 32 / 64 / 256-row blocks (by query count); a row in a
# partial block of either is rounded differently.  Whole blocks of both make each row's float32 result the same
# however its prompt was chunked (test_fast_prefill_does_not_depend_on_chunking).
_KV_BLOCK = 512
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _query_rows(t: int) -> int:
    """t query rows padded to whole query blocks of the CPU flash kernel."""
    for step, below in ((32, 192), (64, 768)):
        r = -(-t // step) * step
        if r < below:
            return r
    return -(-t // 256) * 256


def _window_start(pos: torch.Tensor, window: int) -> torch.Tensor:
    """First key a query at ``pos`` sees exactly: its own block's, ``window`` tokens earlier (0: all exact).
    ``layout.exact_from`` over tensors, clamped at 0 rather than at the sinks' end: the sink block is exact in
    both versions of the keys, and 0 tells the decoded pass that a query sees nothing decoded."""
    return ((pos - window) // BLOCK_TOKENS * BLOCK_TOKENS).clamp_min(0)


@functools.lru_cache(maxsize=16)  # the layers of a step share them
def _band_mask(offset: int, tq: int, rows: int, k0: int, keys: int, window: int, exact: bool,
               device: str) -> torch.Tensor:
    """[rows, keys] additive mask over keys k0..k0+keys: query row t (position offset + t) sees the keys
    before its exact window (``exact`` False; window 0: before its own block) or the keys from the window's
    start up to itself (``exact`` True); the padding rows see key k0 (their output is dropped)."""
    pos = offset + torch.arange(rows, device=device)
    lo = _window_start(pos, window)
    kpos = k0 + torch.arange(keys, device=device)[None, :]
    see = (kpos >= lo[:, None]) & (kpos <= pos[:, None]) if exact else kpos < lo[:, None]
    see = torch.where((pos < offset + tq)[:, None], see, kpos == k0)
    return torch.zeros(rows, keys, device=device).masked_fill_(~see, -math.inf)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[H, n, D] zero-padded to [H, rows, D] (unchanged when n >= rows)."""
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[1])) if rows > t.shape[1] else t


def _flash_band(qh, kk, vv, scale: float, offset: int, window: int = 0, exact: bool = False, key0: int = 0,
                keys_n: int | None = None):
    """Queries qh [H, Tq, D] at positions offset.. over the keys kk / vv [H, n - key0, D] (positions key0..n-1,
    n >= offset + Tq) that each query sees decoded (``exact`` False: those before its window, ``_window_start``;
    key0 0) or exactly (True: the window up to itself; key0 at most the first query's window start, rounded down
    to _KV_BLOCK): (o, lse); lse = -inf and o = 0 for queries that see none.  ``keys_n``: the keys are the first
    keys_n rows of kk / vv, zero rows after them (padding the caller made in its one copy: none here then)."""
    H, tq, D = qh.shape
    n = key0 + (kk.shape[1] if keys_n is None else keys_n)
    op = _CPU_FLASH
    if op is not None and qh.device.type == "cpu":
        # fused, shaped to whole blocks (see _KV_BLOCK), queries in groups of _KV_BLOCK positions aligned to
        # position 0, each over the key blocks it can see: causal work, not Tq x n (key blocks a row cannot
        # see add exact zeros, so leaving them out rounds nothing differently)
        o = qh.new_empty(H, tq, D)
        lse = qh.new_empty(H, tq)
        a = offset
        while a < offset + tq:
            b = min((a // _KV_BLOCK + 1) * _KV_BLOCK, offset + tq)
            rows = _query_rows(b - a)
            k0 = int(_window_start(torch.tensor(a), window)) // _KV_BLOCK * _KV_BLOCK if exact else 0
            keys = -(-min(b, n) // _KV_BLOCK) * _KV_BLOCK - k0
            mask = _band_mask(a, b - a, rows, k0, keys, window, exact, "cpu")
            j0 = k0 - key0
            og, lg = op(_pad_rows(qh[:, a - offset:b - offset], rows)[None], _pad_rows(kk[:, j0:j0 + keys], keys)[None],
                        _pad_rows(vv[:, j0:j0 + keys], keys)[None], attn_mask=mask[None, None], scale=scale)[:2]
            o[:, a - offset:b - offset], lse[:, a - offset:b - offset] = og[0, :, :b - a], lg[0, :, :b - a]
            a = b
    else:  # plain matmuls
        kk, vv = kk[:, :n - key0], vv[:, :n - key0]
        s = (qh @ kk.transpose(1, 2)).mul_(scale) + _band_mask(offset, tq, tq, key0, n - key0, window, exact,
                                                               str(qh.device))
        lse = torch.logsumexp(s, -1)
        o = torch.softmax(s, -1) @ vv
    if not exact:
        blind = _window_start(offset + torch.arange(tq, device=qh.device), window) == 0  # nothing decoded
        if bool(blind.any()):
            lse = lse.masked_fill(blind, -math.inf)
            o = o.masked_fill(blind[:, None], 0.0)
    return o, lse


def _merge(o1, lse1, o2, lse2):
    """Two attention passes over disjoint keys, merged by their log-sum-exps (lse2 finite everywhere)."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp()[..., None], (lse2 - m).exp()[..., None]
    return (w1 * o1 + w2 * o2) / (w1 + w2)


def _attend_fast(q, k_exact, v_exact, k_dec, v_dec, scale, offset, window: int = 0):
    """What _attend computes, in float32 (the serving default): fused flash passes of every query over the
    decoded keys before its own block (_flash_band), then its own block's exact keys up to itself (at most 8)
    merged in through the log-sum-exp (with a recent window: a second flash pass over the window's exact keys).
    ~10x faster than _attend.  On the CPU a query's result is bit for bit the same however its prompt was
    chunked: the keys it sees are the same, and each part is rounded the same way."""
    Tq, Hq, D = q.shape
    Hkv = k_exact.shape[1]
    g = Hq // Hkv
    n = offset + Tq
    f = torch.float32
    dev = q.device
    qh = q.to(f).transpose(0, 1).contiguous()  # [Hq, Tq, D]

    def heads(t, rows: int = 0):
        """[Tk, Hkv, D] -> [Hq, max(Tk, rows), D] float32: each KV head once per query head of its group, zero rows
        past Tk - one copy (the flash passes read whole _KV_BLOCKs of keys)."""
        Tk = t.shape[0]
        out = torch.empty(Hkv, g, max(Tk, rows), D, dtype=f, device=dev)
        out[:, :, :Tk] = t.transpose(0, 1)[:, None]
        out[:, :, Tk:] = 0
        return out.view(Hkv * g, -1, D)

    # the decoded keys before the last query's own block (none: all queries in block 0, one dummy key)
    kend = max(int(_window_start(torch.tensor(n - 1), window)), 1)
    whole = -(-kend // _KV_BLOCK) * _KV_BLOCK
    o, lse = _flash_band(qh, heads(k_dec[:kend], whole), heads(v_dec[:kend], whole), scale, offset, window,
                         keys_n=kend)
    if window:  # the exact pass reads only the keys from the first query's window on (whole _KV_BLOCKs)
        s0 = int(_window_start(torch.tensor(offset), window)) // _KV_BLOCK * _KV_BLOCK
        oe, lsee = _flash_band(qh, heads(k_exact[s0:n]), heads(v_exact[s0:n]), scale, offset, window, exact=True,
                               key0=s0)
        return _merge(o, lse, oe, lsee).transpose(0, 1)
    # own blocks: queries padded to whole blocks from p0, the first key of the first query's block
    p0 = offset // BLOCK_TOKENS * BLOCK_TOKENS
    front = offset - p0
    nb = -(-(front + Tq) // BLOCK_TOKENS)
    W = nb * BLOCK_TOKENS

    def pad(t, before, after):  # zero rows around dim -2 (of [.., T, D]), no copy when there are none
        return torch.nn.functional.pad(t, (0, 0, before, after)) if before or after else t

    # [Hkv, g, nb, 8, ..]: a query head's blocks next to its KV head's (broadcast over the group, no copies)
    qb = pad(qh, front, W - front - Tq).view(Hkv, g, nb, BLOCK_TOKENS, D)
    ob = pad(o, front, W - front - Tq).view(Hkv, g, nb, BLOCK_TOKENS, D)
    lseb = pad(lse[..., None], front, W - front - Tq).view(Hkv, g, nb, BLOCK_TOKENS)
    hi = min(n, p0 + W)

    def kblocks(t):  # keys p0 .. p0 + W (those past n zero; masked below) -> [Hkv, 1, nb, 8, D]
        x = t[p0:hi].to(f).transpose(0, 1)
        return pad(x, 0, W - (hi - p0)).reshape(Hkv, 1, nb, BLOCK_TOKENS, D)

    keb, veb = kblocks(k_exact), kblocks(v_exact)
    r = torch.arange(BLOCK_TOKENS, device=dev)
    kpos = p0 + torch.arange(W, device=dev).view(nb, BLOCK_TOKENS)
    see = (r[None, None, :] <= r[None, :, None]) & (kpos < n)[:, None, :]  # [nb, 8 queries, 8 keys]
    se = (qb @ keb.transpose(-1, -2)).mul_(scale).masked_fill_(~see, -math.inf)
    m = torch.maximum(lseb, se.amax(-1))  # finite for every real query: it sees itself
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # padding rows
    we = (se - m[..., None]).exp()
    z = (lseb - m).exp()
    acc = z[..., None] * ob + we @ veb
    out = (acc / (z + we.sum(-1))[..., None]).reshape(Hq, W, D)[:, front:front + Tq]
    return out.transpose(0, 1)


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
    batch_invariant: bool = True,
    *,
    requests=None,
    gather=None,
    exact: ExactPages | None = None,
    attend_fast=None,
) -> torch.Tensor:
    """query [T, Hq, D] and this step's key/value [T, Hkv, D] for a batch of requests laid out by
    query_start_loc [R + 1]; seq_lens [R] count cached + new tokens. Returns [T, Hq, D].

    batch_invariant: on the CPU, accumulate in float64 so that outputs do not depend on chunking or
    batching (the oracle); otherwise float32 with torch's fused flash attention (the serving default).
    requests: only these request indices (others' rows of ``out`` untouched); gather: a twin of
    ``gather_kv`` (the C++ one) - how the fast paths reuse this attention for prefill chunks; ``exact``: small
    pages' exact pages (``ExactPages``); attend_fast: a twin of ``_attend_fast`` (the C++ prefill kernel's)."""
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    gather = gather or gather_kv
    for r in range(len(lens)) if requests is None else requests:
        n, a, b = lens[r], qsl[r], qsl[r + 1]
        if b == a:
            continue
        ctx = n - (b - a)
        K, V, Kd, Vd = request_keys(lc, pages, key[a:b], value[a:b], block_tables[r], ctx, gather,
                                    None if exact is None else exact.request(r))
        attend = _attend if batch_invariant else attend_fast or _attend_fast
        out[a:b] = attend(query[a:b], K, V, Kd, Vd, scale, ctx, lc.layout.window).to(out.dtype)
    return out


def request_keys(lc: LayerCache, pages, key, value, block_table, ctx: int, gather=None, exact=None):
    """The keys / values one prefill chunk attends to, positions 0 .. ctx + len(key) - 1, in two versions:
    (K, V) as stored (the context's decoded blocks, its exact sinks and tail, the chunk's own tokens exact) and
    (Kd, Vd) with every block the chunk completes decoded too (what the chunk's later queries see of them).
    ``gather``: gather_kv or a twin; ``exact``: small pages' exact pages of this request."""
    gather = gather or gather_kv
    if exact is None:
        kc, vc = gather(lc, pages, block_table, ctx)  # decoded blocks + exact tail
    else:  # small pages: gather_kv or the C++ twin, with the request's exact pages
        kc, vc = gather(lc, pages, block_table, ctx, exact=exact)
    K = torch.cat([kc, lc.exact(key)])
    V = torch.cat([vc, lc.exact(value)])
    n = K.shape[0]
    # blocks that leave the window during this step (the context's tail block included) also in
    # decoded form: what the step's later queries see of them
    W = lc.layout.window
    lo, hi = exact_from(ctx, W), exact_from(n - 1, W) if W else n // BLOCK_TOKENS * BLOCK_TOKENS
    Kd, Vd = K, V
    if hi > lo:
        Kd, Vd = K.clone(), V.clone()
        Kd[lo:hi], Vd[lo:hi] = _decoded_blocks(lc, K, V, lo, hi)
    return K, V, Kd, Vd


@torch.no_grad()
def forward(lc: LayerCache, pages, query, key, value, query_start_loc, seq_lens, block_tables, positions, page_ids,
            scale: float, out: torch.Tensor | None = None, batch_invariant: bool = True, plan=None,
            exact: ExactPages | None = None, attend_fast=None) -> torch.Tensor:
    """One layer's step as the backend runs it: attention (``paged_attention``), then the cache update
    (``write_kv``, or ``write_kv_window`` with a recent window) - in that order, as the cache contract requires.
    ``plan``: the Triton path's per-step plan (triton_path.StepPlan), not needed here; ``exact``: small pages'
    exact pages (``ExactPages``); ``attend_fast``: as in ``paged_attention``."""
    out = paged_attention(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, scale, out,
                          batch_invariant, exact=exact, attend_fast=attend_fast)
    if lc.layout.window:
        write_kv_window(lc, pages, key, value, query_start_loc, seq_lens, block_tables)
    else:
        write_kv(lc, pages, key, value, positions, page_ids,
                 exact=None if exact is None else exact.tokens(query_start_loc, key.shape[0]))
    return out
