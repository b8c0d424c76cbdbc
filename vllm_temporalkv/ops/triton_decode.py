"""Triton paged flash-decoding straight from the codes: the twin of ``paged_torch.paged_attention``
for decode steps (one query token per request).

Grid (request, KV head, split).  A split streams tiles of BT tokens (BT/8 whole blocks, each
possibly on its own page) of the request's encoded blocks; split 0 also takes the exact tokens:
the sinks and the query's own block from the region (the context's tail), and the step's own
new token.  Per tile, for all GQ query heads of the KV head at once (one load of the codes):

* K: code bytes -> centroids of the head's codebooks (a gather that hits L1: 256*D fp16 = 64 KiB
  per (head, K or V) at D = 128, the same for every tile of the program) -> ``z * std + mean``
  -> exact outliers -> RoPE.  RoPE is split in two: the keys rotate by their offset dt inside
  the tile (a [BT, D/2] cos/sin table loaded once per program) and the query rotates back by the
  tile start, R(t0 + dt) = R(t0) R(dt), so no per-token cos/sin is read.  Channels are processed
  as two halves (c, c + D/2), the rotate_half pairs, so the rotation needs no shuffles.
* scores on tensor cores (the GQ query heads padded to 16 rows), online softmax in base 2.
* V: code bytes -> centroids, *kept normalized*: P @ z accumulates in normalized space and the
  reduce kernel applies ``* std + mean`` once per output (valid because softmax weights sum to
  1), so V costs one gather per element.  Exact V rows (sinks, tail, new token) are normalized
  on the way in.
* outliers: the tile's blocks hold at most BT/8 * cap exact values; they replace decoded ones
  through two one-hot products on tensor cores (mask and value), exact in fp32 accumulation.

``_reduce_kernel`` merges the splits (log-sum-exp) and denormalizes V.

Expected cost per token and KV head (D = 128, b = bits per float, no outliers):
* HBM bytes: 2 * D * b / 8 of codes (64 B at 2 bits, 32 B at 1 bit; fp16 K+V: 512 B) + 8 B of
  block table per 8 tokens; sinks/tail/partials are O(1) per request; codebooks (128 KiB per
  layer and KV head at D = 128) stay in L1/L2 and are read from HBM once per step.
* work: 2*D centroid gathers from L1, ~4*D float ops for K (denorm + 2x2 rotation), 2*GQ*D MACs
  each for q.k and p.v on tensor cores.  At 2 bits the bytes are 8x fewer than fp16 while the
  gathers are ~16 per 64 B read, so this kernel is bound by the L1 gather rate rather than HBM
  unless the batch is large; the speedup over fp16 grows with context and batch (see
  benchmarks/kernels.py).  1-bit codes halve the bytes but not the gathers.
* split count: enough (request, head, split) programs for ~2 waves of the GPU, at least 4 tiles
  per split: B = 1 at 32k uses ~32 splits per head, B = 64 one or two.

In-kernel numerics differ from the reference in rounding only (decoded K/V are not rounded to
the model dtype before the dot products, the softmax runs in base 2 with the scale folded into
q, RoPE angles are composed from the tile start and offset, i.e. within an fp32 ulp of the
angle): outputs agree within bf16 tolerance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import paged_torch
from .triton_encode import (
    BLOCK, INTERPRET, SINKS, TEMPORAL, CHANNEL, _round_half, codec_params, page_views, rope_table,
)

LOG2E = 1.4426950408889634
TILE_TOKENS = 32  # BT: tokens per tile, a multiple of BLOCK_TOKENS
MIN_TILES_PER_SPLIT = 4
# launch settings; benchmarks/gpu/decode_sweep.py measures the alternatives on a GPU
DECODE_WARPS = 2  # H100, temporalkv-2bit B=8 L=32k: 1.19 ms vs 1.84 (4 warps), 1.95 (8)
DECODE_STAGES = 3
WAVES = 2  # programs per SM the split heuristic aims for
CODES_CACHE = ""  # ".cg": code bytes skip L1 (read once), leaving it to the codebooks the gathers hit
CB_EVICT = ""  # "evict_last": codebook lines outlive the streamed codes in L1


@triton.jit
def _dot(a, b, F32: tl.constexpr, DT: tl.constexpr):
    """a @ b on tensor cores in the model's half dtype (F32: in fp32, for the interpreter, whose
    bf16 dot is wrong)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _code_base(bt_row, tok, ok, h, rec_bytes, codes_off, block_size,
               H: tl.constexpr, CODE_BYTES: tl.constexpr):
    """Byte offset of the codes of the block holding token tok (K or V, KV head h)."""
    page = tl.load(bt_row + tok // block_size, mask=ok, other=0).to(tl.int64)
    return (page * H + h) * rec_bytes + codes_off + ((tok % block_size) // BLOCK) * CODE_BYTES


@triton.jit
def _lookup(pages_u8, cb_ptr, bt_row, t0, cend, h, rec_bytes, codes_off, block_size,
            C0: tl.constexpr, DC: tl.constexpr, BT: tl.constexpr, METHOD: tl.constexpr, L: tl.constexpr,
            BITS: tl.constexpr, KC: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
            CM: tl.constexpr, EV: tl.constexpr):
    """Normalized values [BT, DC] of tokens t0..t0+BT, channels C0..C0+DC, from the codes and the
    head's codebooks cb_ptr [G, KC, v].  A vector code is one load of its L centroid floats."""
    CODE_BYTES: tl.constexpr = BLOCK * D * BITS // (8 * L)
    i = tl.arange(0, L)[None, None, :]
    if METHOD == TEMPORAL:  # block bytes [8 / L, D]: one code = L consecutive tokens of a channel
        tj = t0 + tl.arange(0, BT // L) * L  # first token of each chunk (chunks never straddle cend)
        ok = ((tj >= SINKS) & (tj < cend))[:, None]
        c = C0 + tl.arange(0, DC)[None, :]
        base = _code_base(bt_row, tj, (tj >= SINKS) & (tj < cend), h, rec_bytes, codes_off, block_size,
                          H, CODE_BYTES)
        code = tl.load(pages_u8 + base[:, None] + ((tj % BLOCK) // L)[:, None] * D + c, mask=ok, other=0,
                       cache_modifier=CM)
        val = tl.load(cb_ptr + (((c // L) * KC + code.to(tl.int32)) * L)[:, :, None] + i,
                      eviction_policy=EV)  # [BT/L, DC, L]
        val = tl.reshape(tl.permute(val, (0, 2, 1)), (BT, DC))
    elif METHOD == CHANNEL:  # block bytes [8, D / L]: one code = L adjacent channels of a token
        tok = t0 + tl.arange(0, BT)
        ok = (tok >= SINKS) & (tok < cend)
        gc = C0 // L + tl.arange(0, DC // L)[None, :]
        base = _code_base(bt_row, tok, ok, h, rec_bytes, codes_off, block_size, H, CODE_BYTES)
        code = tl.load(pages_u8 + base[:, None] + (tok % BLOCK)[:, None] * (D // L) + gc, mask=ok[:, None], other=0,
                       cache_modifier=CM)
        val = tl.load(cb_ptr + ((gc * KC + code.to(tl.int32)) * L)[:, :, None] + i,
                      eviction_policy=EV)  # [BT, DC/L, L]
        val = tl.reshape(val, (BT, DC))
    else:  # scalar: block bytes [8, D * BITS / 8], lowest channel in the lowest bits
        PER: tl.constexpr = 8 // BITS
        tok = t0 + tl.arange(0, BT)
        ok = (tok >= SINKS) & (tok < cend)
        c = C0 + tl.arange(0, DC)[None, :]
        base = _code_base(bt_row, tok, ok, h, rec_bytes, codes_off, block_size, H, CODE_BYTES)
        byte = tl.load(pages_u8 + base[:, None] + (tok % BLOCK)[:, None] * (D * BITS // 8) + c // PER,
                       mask=ok[:, None], other=0, cache_modifier=CM).to(tl.int32)
        val = tl.load(cb_ptr + c * KC + ((byte >> ((c % PER) * BITS)) & (KC - 1)), eviction_policy=EV)
    return val.to(tl.float32)


@triton.jit
def _outliers(x, pages_h, pages_i16, bt_row, t0, h, rec_bytes, idx_off, val_off, mean_ptr, inv_ptr, cend,
              C0: tl.constexpr, DC: tl.constexpr, TO_Z: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
              BT: tl.constexpr, CAP: tl.constexpr, CAP_P2: tl.constexpr, block_size,
              F32: tl.constexpr, DT: tl.constexpr):
    """Replace decoded values of x [BT, DC] (channels C0..C0+DC of tile rows t0..t0+BT) by the
    exact outliers of the tile's blocks (normalized first when TO_Z)."""
    NO: tl.constexpr = (BT // BLOCK) * CAP_P2
    o = tl.arange(0, NO)
    tok = t0 + (o // CAP_P2) * BLOCK  # first token of the outlier's block
    ok = (o % CAP_P2 < CAP) & (tok >= SINKS) & (tok < cend)
    page = tl.load(bt_row + tok // block_size, mask=ok, other=0).to(tl.int64)
    slot = ((tok % block_size) // BLOCK) * CAP + o % CAP_P2
    rec = (page * H + h) * rec_bytes
    idx = tl.load(pages_i16 + (rec + idx_off) // 2 + slot, mask=ok, other=-1).to(tl.int32)
    val = tl.load(pages_h + (rec + val_off) // 2 + slot, mask=ok, other=0.0).to(tl.float32)
    c = idx % D
    live = idx >= 0
    if TO_Z:
        val = (val - tl.load(mean_ptr + h * D + c, mask=live, other=0.0)) * \
            tl.load(inv_ptr + h * D + c, mask=live, other=0.0)
    row = (o // CAP_P2) * BLOCK + idx // D  # row in the tile
    onto = (tl.arange(0, BT)[:, None] == row[None, :]) & live[None, :]  # [BT, NO]
    col = (c[:, None] - C0) == tl.arange(0, DC)[None, :]  # [NO, DC]
    hit = _dot(onto.to(tl.float32), col.to(tl.float32), F32, DT)
    rep = _dot(onto.to(tl.float32), tl.where(col, val[:, None], 0.0), F32, DT)
    return tl.where(hit > 0.5, rep, x)


@triton.jit
def _decode_kernel(
    q_ptr, knew_ptr, vnew_ptr, pages_u8, pages_h, pages_i16, seq_lens_ptr, bt_ptr, bt_stride,
    kcb_ptr, vcb_ptr, kmean_ptr, kstd_ptr, vmean_ptr, vinv_ptr, cos_ptr, sin_ptr,
    acc_ptr, ml_ptr, qk_scale, tiles_per_split, rec_bytes, k_codes, v_codes,
    k_idx, k_val, v_idx, v_val, block_size,
    H: tl.constexpr, GQ: tl.constexpr, GQ_P: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
    KM: tl.constexpr, KL: tl.constexpr, KBITS: tl.constexpr, KKC: tl.constexpr,
    VM: tl.constexpr, VL: tl.constexpr, VBITS: tl.constexpr, VKC: tl.constexpr,
    CAP: tl.constexpr, CAP_P2: tl.constexpr, F32: tl.constexpr, CM: tl.constexpr, EV: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    S = tl.num_programs(2)
    DT: tl.constexpr = q_ptr.dtype.element_ty
    HD: tl.constexpr = D // 2
    n = tl.load(seq_lens_ptr + r)
    p = n - 1  # the query's position
    cend = (p // BLOCK) * BLOCK  # encoded blocks: [SINKS, cend); the query's own block is exact
    n_tiles = tl.where(cend > SINKS, tl.cdiv(cend, BT), 0)
    t_lo = s * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)
    bt_row = bt_ptr + r.to(tl.int64) * bt_stride

    g = tl.arange(0, GQ_P)
    hq = h * GQ + g
    dh = tl.arange(0, HD)
    dd = tl.arange(0, D)
    q_row = q_ptr + (r.to(tl.int64) * H * GQ + hq[:, None]) * D
    q_lo = tl.load(q_row + dh[None, :], mask=g[:, None] < GQ, other=0.0).to(tl.float32)
    q_hi = tl.load(q_row + HD + dh[None, :], mask=g[:, None] < GQ, other=0.0).to(tl.float32)
    vmean = tl.load(vmean_ptr + h * D + dd)
    vinv = tl.load(vinv_ptr + h * D + dd)

    m_i = tl.full([GQ_P], -float("inf"), tl.float32)
    l_i = tl.zeros([GQ_P], tl.float32)
    acc = tl.zeros([GQ_P, D], tl.float32)

    if s == 0:  # exact tokens; row j of this tile is region slot j (sinks 0..7, tail 8..14)
        j = tl.arange(0, 2 * BLOCK)
        own = cend
        sink_ok = (j < SINKS) & (j < p)
        n_tail = tl.where(p >= SINKS, p - own, 0)  # the own block's tokens before the query
        tail_ok = (j >= BLOCK) & (j - BLOCK < n_tail)
        new = j == 2 * BLOCK - 1  # the step's own token (tail rows stop at 14)
        page = tl.where(j < BLOCK, tl.load(bt_row), tl.load(bt_row + own // block_size)).to(tl.int64)
        reg = (page * H + h) * (rec_bytes // 2) + j * 2 * D
        rows_ok = (sink_ok | tail_ok)[:, None]
        new_off = (r.to(tl.int64) * H + h) * D
        k_lo = tl.where(new[:, None], tl.load(knew_ptr + new_off + dh[None, :] + 0 * j[:, None]),
                        tl.load(pages_h + reg[:, None] + dh[None, :], mask=rows_ok, other=0.0))
        k_hi = tl.where(new[:, None], tl.load(knew_ptr + new_off + HD + dh[None, :] + 0 * j[:, None]),
                        tl.load(pages_h + reg[:, None] + HD + dh[None, :], mask=rows_ok, other=0.0))
        sc = (_dot(q_lo, tl.trans(k_lo), F32, DT) + _dot(q_hi, tl.trans(k_hi), F32, DT)) * qk_scale
        sc = tl.where((sink_ok | tail_ok | new)[None, :], sc, -float("inf"))
        m_i = tl.max(sc, 1)
        pexp = tl.exp2(sc - m_i[:, None])
        l_i = tl.sum(pexp, 1)
        v = tl.where(new[:, None], tl.load(vnew_ptr + new_off + dd[None, :] + 0 * j[:, None]),
                     tl.load(pages_h + reg[:, None] + D + dd[None, :], mask=rows_ok, other=0.0))
        vz = (v.to(tl.float32) - vmean[None, :]) * vinv[None, :]
        acc = _dot(pexp, vz, F32, DT)

    # loop invariants: K statistics, and the rotation by the offset inside a tile
    kstd_lo = tl.load(kstd_ptr + h * D + dh)[None, :]
    kstd_hi = tl.load(kstd_ptr + h * D + HD + dh)[None, :]
    kmean_lo = tl.load(kmean_ptr + h * D + dh)[None, :]
    kmean_hi = tl.load(kmean_ptr + h * D + HD + dh)[None, :]
    dt = tl.arange(0, BT)
    dcos = tl.load(cos_ptr + dt[:, None] * D + dh[None, :])
    dsin = tl.load(sin_ptr + dt[:, None] * D + dh[None, :])
    kcb = kcb_ptr + h * (D // KL) * KKC * KL
    vcb = vcb_ptr + h * (D // VL) * VKC * VL
    for tile in range(t_lo, t_hi):
        t0 = tile * BT
        tok = t0 + dt
        ok = (tok >= SINKS) & (tok < cend)
        k_lo = _lookup(pages_u8, kcb, bt_row, t0, cend, h, rec_bytes, k_codes, block_size,
                       0, HD, BT, KM, KL, KBITS, KKC, H, D, CM, EV) * kstd_lo + kmean_lo
        k_hi = _lookup(pages_u8, kcb, bt_row, t0, cend, h, rec_bytes, k_codes, block_size,
                       HD, HD, BT, KM, KL, KBITS, KKC, H, D, CM, EV) * kstd_hi + kmean_hi
        if CAP > 0:
            k_lo = _outliers(k_lo, pages_h, pages_i16, bt_row, t0, h, rec_bytes, k_idx, k_val, kmean_ptr,
                             kmean_ptr, cend, 0, HD, False, H, D, BT, CAP, CAP_P2, block_size, F32, DT)
            k_hi = _outliers(k_hi, pages_h, pages_i16, bt_row, t0, h, rec_bytes, k_idx, k_val, kmean_ptr,
                             kmean_ptr, cend, HD, HD, False, H, D, BT, CAP, CAP_P2, block_size, F32, DT)
        r_lo = k_lo * dcos - k_hi * dsin
        r_hi = k_hi * dcos + k_lo * dsin
        c0 = tl.load(cos_ptr + t0 * D + dh)[None, :]
        s0 = tl.load(sin_ptr + t0 * D + dh)[None, :]
        sc = (_dot(q_lo * c0 + q_hi * s0, tl.trans(r_lo), F32, DT) +
              _dot(q_hi * c0 - q_lo * s0, tl.trans(r_hi), F32, DT)) * qk_scale
        sc = tl.where(ok[None, :], sc, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        pexp = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pexp, 1)
        vz = _lookup(pages_u8, vcb, bt_row, t0, cend, h, rec_bytes, v_codes, block_size,
                     0, D, BT, VM, VL, VBITS, VKC, H, D, CM, EV)
        if CAP > 0:
            vz = _outliers(vz, pages_h, pages_i16, bt_row, t0, h, rec_bytes, v_idx, v_val, vmean_ptr,
                           vinv_ptr, cend, 0, D, True, H, D, BT, CAP, CAP_P2, block_size, F32, DT)
        acc = acc * alpha[:, None] + _dot(pexp, vz, F32, DT)
        m_i = m_new

    part = (r.to(tl.int64) * H * GQ + hq) * S + s
    gm = g < GQ
    tl.store(acc_ptr + part[:, None] * D + dd[None, :], acc, mask=gm[:, None])
    tl.store(ml_ptr + part * 2, m_i, mask=gm)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=gm)


@triton.jit
def _reduce_kernel(acc_ptr, ml_ptr, out_ptr, vmean_ptr, vstd_ptr, S,
                   HQ: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, S_P: tl.constexpr):
    r = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // GQ
    s = tl.arange(0, S_P)
    dd = tl.arange(0, D)
    part = (r.to(tl.int64) * HQ + hq) * S + s
    m = tl.load(ml_ptr + part * 2, mask=s < S, other=-float("inf"))
    l = tl.load(ml_ptr + part * 2 + 1, mask=s < S, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # empty splits: m = -inf -> weight 0
    acc = tl.load(acc_ptr + part[:, None] * D + dd[None, :], mask=(s < S)[:, None], other=0.0)
    z = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    o = z * tl.load(vstd_ptr + h * D + dd) + tl.load(vmean_ptr + h * D + dd)
    tl.store(out_ptr + (r.to(tl.int64) * HQ + hq) * D + dd, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _gather_kernel(
    pages_u8, pages_h, pages_i16, bt_row, kcb_ptr, vcb_ptr, kmean_ptr, kstd_ptr, vmean_ptr, vstd_ptr,
    cos_ptr, sin_ptr, k_out, v_out, cend, rec_bytes, k_codes, v_codes, k_idx, k_val, v_idx, v_val, block_size,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
    KM: tl.constexpr, KL: tl.constexpr, KBITS: tl.constexpr, KKC: tl.constexpr,
    VM: tl.constexpr, VL: tl.constexpr, VBITS: tl.constexpr, VKC: tl.constexpr,
    CAP: tl.constexpr, CAP_P2: tl.constexpr, F32: tl.constexpr, BF: tl.constexpr,
    CM: tl.constexpr, EV: tl.constexpr,
):
    """One tile of BT tokens of one KV head's encoded blocks -> K (post-RoPE) and V rows in the model dtype:
    the decode kernel's lookups, then ``z * std + mean``, exact outliers and RoPE at each token's position, in
    the reference's order (launched without FMA contraction: bit-identical to ``paged_torch.gather_kv``)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    DT: tl.constexpr = k_out.dtype.element_ty
    HD: tl.constexpr = D // 2
    t0 = tile * BT
    tok = t0 + tl.arange(0, BT)
    ok = ((tok >= SINKS) & (tok < cend))[:, None]
    dh = tl.arange(0, HD)[None, :]
    dd = tl.arange(0, D)[None, :]
    kcb = kcb_ptr + h * (D // KL) * KKC * KL
    vcb = vcb_ptr + h * (D // VL) * VKC * VL
    k_lo = _lookup(pages_u8, kcb, bt_row, t0, cend, h, rec_bytes, k_codes, block_size,
                   0, HD, BT, KM, KL, KBITS, KKC, H, D, CM, EV)
    k_hi = _lookup(pages_u8, kcb, bt_row, t0, cend, h, rec_bytes, k_codes, block_size,
                   HD, HD, BT, KM, KL, KBITS, KKC, H, D, CM, EV)
    k_lo = k_lo * tl.load(kstd_ptr + h * D + dh) + tl.load(kmean_ptr + h * D + dh)
    k_hi = k_hi * tl.load(kstd_ptr + h * D + HD + dh) + tl.load(kmean_ptr + h * D + HD + dh)
    v = _lookup(pages_u8, vcb, bt_row, t0, cend, h, rec_bytes, v_codes, block_size,
                0, D, BT, VM, VL, VBITS, VKC, H, D, CM, EV)
    v = v * tl.load(vstd_ptr + h * D + dd) + tl.load(vmean_ptr + h * D + dd)
    if CAP > 0:
        k_lo = _outliers(k_lo, pages_h, pages_i16, bt_row, t0, h, rec_bytes, k_idx, k_val, kmean_ptr,
                         kmean_ptr, cend, 0, HD, False, H, D, BT, CAP, CAP_P2, block_size, F32, DT)
        k_hi = _outliers(k_hi, pages_h, pages_i16, bt_row, t0, h, rec_bytes, k_idx, k_val, kmean_ptr,
                         kmean_ptr, cend, HD, HD, False, H, D, BT, CAP, CAP_P2, block_size, F32, DT)
        v = _outliers(v, pages_h, pages_i16, bt_row, t0, h, rec_bytes, v_idx, v_val, vmean_ptr,
                      vmean_ptr, cend, 0, D, False, H, D, BT, CAP, CAP_P2, block_size, F32, DT)
    row = tok[:, None].to(tl.int64) * D
    c_lo = tl.load(cos_ptr + row + dh, mask=ok, other=0.0)
    s_lo = tl.load(sin_ptr + row + dh, mask=ok, other=0.0)
    c_hi = tl.load(cos_ptr + row + HD + dh, mask=ok, other=0.0)
    s_hi = tl.load(sin_ptr + row + HD + dh, mask=ok, other=0.0)
    out = (tok[:, None].to(tl.int64) * H + h) * D
    # rounded to the model dtype to nearest even here (the interpreter's own bf16 cast truncates)
    tl.store(k_out + out + dh, _round_half(k_lo * c_lo - k_hi * s_lo, BF).to(DT), mask=ok)
    tl.store(k_out + out + HD + dh, _round_half(k_hi * c_hi + k_lo * s_hi, BF).to(DT), mask=ok)
    tl.store(v_out + out + dd, _round_half(v, BF).to(DT), mask=ok)


def decode_blocks(lc, pages: torch.Tensor, block_table: torch.Tensor, full: int, K: torch.Tensor,
                  V: torch.Tensor) -> None:
    """Rows [8, 8 * full) of K (post-RoPE) and V [n, H, D] from one sequence's codes: the Triton twin of the
    block decode in ``paged_torch.gather_kv`` (its ``decode_blocks``), for prefill chunks on the CUDA path."""
    lay = lc.layout
    H, D = K.shape[1], K.shape[2]
    u8, hv, i16 = page_views(pages, lc.dtype)
    kp, vp = codec_params(lc.k, pages.device), codec_params(lc.v, pages.device)
    cend = full * BLOCK.value  # a Python int: a tl.constexpr argument would specialize (recompile) per length
    cos, sin = rope_table(lc.rope, cend, pages.device)
    _gather_kernel[(triton.cdiv(cend, TILE_TOKENS), H)](
        u8, hv, i16, block_table.contiguous(), kp.centroids, vp.centroids, kp.mean, kp.std, vp.mean, vp.std,
        cos, sin, K, V, cend, lay.bytes, lay.k_codes, lay.v_codes, lay.k_idx, lay.k_val, lay.v_idx, lay.v_val,
        lay.block_size, H=H, D=D, BT=TILE_TOKENS,
        KM=kp.method, KL=kp.chunk, KBITS=kp.code_bits, KKC=kp.n_centroids,
        VM=vp.method, VL=vp.chunk, VBITS=vp.code_bits, VKC=vp.n_centroids,
        CAP=lay.cap, CAP_P2=triton.next_power_of_2(max(lay.cap, 1)), F32=INTERPRET, BF=K.dtype == torch.bfloat16,
        CM=CODES_CACHE, EV=CB_EVICT, enable_fp_fusion=False,
    )


def gather_kv(lc, pages: torch.Tensor, block_table: torch.Tensor, n: int):
    """Twin of ``paged_torch.gather_kv``: the exact sinks and tail copied by torch, the blocks by the kernel."""
    return paged_torch.gather_kv(lc, pages, block_table, n, decode_blocks=decode_blocks)


def num_splits(batch_heads: int, max_tiles: int, device: torch.device) -> int:
    """Splits per (request, KV head): ~2 waves of programs, at least MIN_TILES_PER_SPLIT tiles each."""
    if device.type == "cuda":
        target = WAVES * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4  # interpreter: exercise several splits on small shapes
    return max(1, min(triton.cdiv(target, batch_heads), triton.cdiv(max_tiles, MIN_TILES_PER_SPLIT)))


@torch.no_grad()
def paged_attention(lc, pages: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, out: torch.Tensor | None = None, *, splits: int | None = None,
                    max_position: int | None = None) -> torch.Tensor:
    """Triton twin of ``paged_torch.paged_attention`` for decode batches: request r's one query token
    is query[r] (``query_start_loc`` must be 0..R; it is not read, to spare a device sync).
    ``splits`` overrides the split-K heuristic; ``max_position`` bounds the positions (default:
    the block table's capacity)."""
    R, HQ, D = query.shape
    H = key.shape[1]
    if R != seq_lens.shape[0] or query_start_loc.shape[0] != R + 1:
        raise ValueError("triton_decode.paged_attention takes one query token per request")
    if out is None:
        out = torch.empty_like(query)
    if R == 0:
        return out
    lay = lc.layout
    GQ = HQ // H
    u8, hv, i16 = page_views(pages, lc.dtype)
    kp, vp = codec_params(lc.k, pages.device), codec_params(lc.v, pages.device)
    cap_tokens = block_tables.shape[1] * lay.block_size
    max_tiles = triton.cdiv(cap_tokens, TILE_TOKENS)
    S = splits or num_splits(R * H, max_tiles, pages.device)
    cos, sin = rope_table(lc.rope, max(max_position or cap_tokens, TILE_TOKENS), pages.device)
    acc = torch.empty(R, HQ, S, D, dtype=torch.float32, device=pages.device)
    ml = torch.empty(R, HQ, S, 2, dtype=torch.float32, device=pages.device)
    q = query.to(lc.dtype).contiguous()
    _decode_kernel[(R, H, S)](
        q, key.to(lc.dtype).contiguous(), value.to(lc.dtype).contiguous(), u8, hv, i16,
        seq_lens.contiguous(), block_tables, block_tables.stride(0),
        kp.centroids, vp.centroids, kp.mean, kp.std, vp.mean, vp.inv_std, cos, sin,
        acc, ml, float(scale) * LOG2E, triton.cdiv(max_tiles, S), lay.bytes, lay.k_codes, lay.v_codes,
        lay.k_idx, lay.k_val, lay.v_idx, lay.v_val, lay.block_size,
        H=H, GQ=GQ, GQ_P=max(16, triton.next_power_of_2(GQ)), D=D, BT=TILE_TOKENS,
        KM=kp.method, KL=kp.chunk, KBITS=kp.code_bits, KKC=kp.n_centroids,
        VM=vp.method, VL=vp.chunk, VBITS=vp.code_bits, VKC=vp.n_centroids,
        CAP=lay.cap, CAP_P2=triton.next_power_of_2(max(lay.cap, 1)), F32=INTERPRET,
        CM=CODES_CACHE, EV=CB_EVICT, num_warps=DECODE_WARPS, num_stages=DECODE_STAGES,
    )
    _reduce_kernel[(R, HQ)](acc, ml, out, vp.mean, vp.std, S, HQ=HQ, GQ=GQ, D=D,
                            S_P=triton.next_power_of_2(S))
    return out
