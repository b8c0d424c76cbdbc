"""Triton cache update: the twin of ``paged_torch.write_kv``, writing straight into the page bytes.

Two kernels, launched in this order; the order is part of the contract, because encoding reads the
tail slots where a block's first rows wait, and storing may reuse those slots for a later block of
the same page:

* ``_encode_kernel``: one program per (token of this call, KV head), once for K and once for V (the
  hybrid may chunk K by channels and V by tokens: different code layouts, one kernel per
  specialization).  Only a token that completes a block past the sinks does any work.  It
  un-RoPEs keys with torch's own cos/sin tables and rounds them to the model dtype, picks the
  outliers, clamps, normalizes, takes the exact argmin over all centroids and packs the codes
  into the block's bytes.
* ``_store_kernel``: sinks, and tokens whose block stays incomplete, go to the page's region.

Bit-exactness with the reference codec (tested in the interpreter; launches use
``enable_fp_fusion=False``):
* distances are ``sum_i (u_i - c_i)**2`` in float32, sequential in i, no FMA; ties go to the lowest
  centroid index.  The reference's torch search screens candidates with a matmul first, which
  can in principle miss the exact minimum when four or more centroids tie within rounding; its
  CPU (numba) search and this kernel scan all of them;
* normalization multiplies by the precomputed ``ChannelStats.inv_std``; outliers are ranked by
  excess * inv_std, ties to the lower flat index t * D + c, the same as the stable sort;
* un-RoPE is ``x * cos - rotate_half(x) * sin`` with the reference's tables, then rounded to
  the model dtype with explicit round-to-nearest-even (the interpreter's bf16 cast truncates).
  With a RoPE attention factor != 1 the result is also divided by scale**2: torch divides on the
  CPU but multiplies by the reciprocal on CUDA, so codes can then differ in the last bit on
  some keys.  Llama's default and llama3 RoPE have factor 1.

Cost per (block of 8 tokens, KV head, K or V): 8*D*256 (vector methods) or 8*D*2**bits (scalar)
distance terms of 3 flops each, about 0.8 MFLOP at D = 128, whatever the chunk length; reads
16*D bytes of half values and a few codebook tiles from L2; writes D*bits bytes of codes.  An
8k-token prefill of a Llama-3.1-8B shape (32 layers x 8 KV heads x K,V) costs ~0.4 TFLOP of
non-FMA float32, a few ms on an H100 next to a ~100 ms prefill (benchmarks/kernels.py measures it).
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import torch
import triton
import triton.language as tl

from ..layout import TAIL_SLOT0
from ..methods import BLOCK_TOKENS, KERNEL_CHANNEL_VECTOR, KERNEL_SCALAR, KERNEL_TOKEN_VECTOR, SINK_TOKENS

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TEMPORAL: tl.constexpr = tl.constexpr(KERNEL_TOKEN_VECTOR)  # the code paths, by CodeLayout.kernel_variant
CHANNEL: tl.constexpr = tl.constexpr(KERNEL_CHANNEL_VECTOR)
SCALAR: tl.constexpr = tl.constexpr(KERNEL_SCALAR)
BLOCK: tl.constexpr = tl.constexpr(BLOCK_TOKENS)
SINKS: tl.constexpr = tl.constexpr(SINK_TOKENS)
TAIL0: tl.constexpr = tl.constexpr(TAIL_SLOT0)
# distance elements per loop step of the vector methods: bounds registers on a GPU; in the
# interpreter, fewer and larger steps are much faster
_ENCODE_TILE = 1 << 22 if INTERPRET else 4096


# ---- what the kernels need from a LayerCache, prepared once per (quantizer, device) ------------


@dataclasses.dataclass(frozen=True)
class CodecParams:
    """One (layer, K-or-V) quantizer as kernel arguments."""

    method: int  # CodeLayout.kernel_variant: the kernels branch on the layout's geometry
    chunk: int  # floats per vector (1 for scalar)
    code_bits: int  # bits per code as packed in the page (8 for the vector methods)
    n_centroids: int
    centroids: torch.Tensor  # [H, G, K, v] fp16 (the codec's values are fp16-representable)
    mean: torch.Tensor  # [H, D] float32, like all the statistics
    std: torch.Tensor
    inv_std: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


_PARAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def codec_params(quantizer, device) -> CodecParams:
    per = _PARAMS.setdefault(quantizer, {})
    key = str(device)
    if key not in per:
        codec, s = quantizer.codec, quantizer.stats
        cl = codec.layout  # layout.CodeLayout: the one description of the codes
        f32 = lambda t: t.float().contiguous().to(device)  # noqa: E731
        per[key] = CodecParams(
            cl.kernel_variant,
            cl.vec_dim,
            cl.code_bits,
            cl.n_centroids,
            codec._check_fitted().half().contiguous().to(device),
            f32(s.mean), f32(s.std), f32(s.inv_std), f32(s.lo), f32(s.hi),
        )
    return per[key]


_ROPE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def rope_table(rope, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P >= n, D] float32 for positions 0..P-1, computed by ``Rope.cos_sin`` itself (so
    un-RoPE in the kernel is bit-identical to the reference).  Grows by powers of two."""
    per = _ROPE.setdefault(rope, {})
    key = str(device)
    have = per.get(key)
    if have is None or have[0].shape[0] < n:
        P = max(1024, triton.next_power_of_2(n))
        cos, sin = rope.cos_sin(torch.arange(P, device=rope.inv_freq.device))
        per[key] = (cos[:, 0].contiguous().to(device), sin[:, 0].contiguous().to(device))
    return per[key]


def page_views(pages: torch.Tensor, dtype: torch.dtype):
    """The same page bytes as uint8, the model's half dtype and int16 (all offsets are even)."""
    return pages, pages.view(dtype), pages.view(torch.int16)


# ---- kernels -----------------------------------------------------------------------------------


@triton.jit
def _round_half(x, HALF_BF16: tl.constexpr):
    """float32 -> the model's half dtype -> float32, round to nearest even, on every backend."""
    if HALF_BF16:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float16).to(tl.float32)


@triton.jit
def _pre_value(x_ptr, reg_ptr, rec_h, cos_ptr, sin_ptr, pid_ptr, pos_ptr, i, pg, p_end, h, tok, ch,
               H: tl.constexpr, D: tl.constexpr, KV: tl.constexpr, ROPE: tl.constexpr,
               S2: tl.constexpr, HALF_BF16: tl.constexpr):
    """The value the reference encodes at (row tok of the block ending at call token i, channel ch):
    from this call's input if that row is in it, else from the page's tail slot; keys un-RoPE'd."""
    src = i - (BLOCK - 1) + tok
    ok = src >= 0
    src = tl.where(ok, src, 0)
    ok = ok & (tl.load(pid_ptr + src) == pg) & (tl.load(pos_ptr + src) == p_end - (BLOCK - 1) + tok)
    row = src.to(tl.int64) * H + h
    slot = rec_h + ((TAIL0 + tok) * 2 + KV) * D
    x = tl.where(ok, tl.load(x_ptr + row * D + ch, mask=ok, other=0.0),
                 tl.load(reg_ptr + slot + ch, mask=~ok, other=0.0)).to(tl.float32)
    if ROPE:
        pc = (ch + D // 2) % D
        xp = tl.where(ok, tl.load(x_ptr + row * D + pc, mask=ok, other=0.0),
                      tl.load(reg_ptr + slot + pc, mask=~ok, other=0.0)).to(tl.float32)
        rot = tl.where(ch < D // 2, -xp, xp)  # rotate_half
        t = (p_end - (BLOCK - 1) + tok) * D + ch
        y = x * tl.load(cos_ptr + t) - rot * tl.load(sin_ptr + t)
        if S2 != 1.0:
            y = y / S2
        x = _round_half(y, HALF_BF16)
    return x


@triton.jit
def _encode_kernel(
    x_ptr, pos_ptr, pid_ptr, pages_u8, pages_h, pages_i16,
    cos_ptr, sin_ptr, mean_ptr, inv_std_ptr, lo_ptr, hi_ptr, cb_ptr,
    rec_bytes, codes_off, idx_off, val_off, block_size,
    H: tl.constexpr, D: tl.constexpr, KV: tl.constexpr, METHOD: tl.constexpr, L: tl.constexpr,
    BITS: tl.constexpr, KC: tl.constexpr, CAP: tl.constexpr, CAP_P2: tl.constexpr,
    ROPE: tl.constexpr, S2: tl.constexpr, HALF_BF16: tl.constexpr, GB: tl.constexpr, CB: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.load(pos_ptr + i)
    if (p < SINKS) | (p % BLOCK != BLOCK - 1):  # also a padded row (position -1)
        return
    pg = tl.load(pid_ptr + i)
    rec = (pg.to(tl.int64) * H + h) * rec_bytes  # byte offset of the (page, head) record
    rec_h = rec // 2
    slot = (p % block_size) // BLOCK
    hd = h * D
    code_bytes: tl.constexpr = BLOCK * D * BITS // (8 * L)
    codes = pages_u8 + rec + codes_off + slot * code_bytes

    if CAP > 0:
        # outliers: the CAP largest excesses beyond the thresholds, in std units; ties -> lower t*D+c
        rows = tl.arange(0, BLOCK)[:, None]
        cols = tl.arange(0, D)[None, :]
        x = _pre_value(x_ptr, pages_h, rec_h, cos_ptr, sin_ptr, pid_ptr, pos_ptr, i, pg, p, h,
                       rows, cols, H, D, KV, ROPE, S2, HALF_BF16)
        lo = tl.load(lo_ptr + hd + cols)
        hi = tl.load(hi_ptr + hd + cols)
        excess = tl.maximum(tl.maximum(lo - x, x - hi), 0.0) * tl.load(inv_std_ptr + hd + cols)
        flat = rows * D + cols
        j = tl.arange(0, CAP_P2)
        out_i = tl.full([CAP_P2], -1, tl.int32)
        out_v = tl.zeros([CAP_P2], tl.float32)
        for n in tl.static_range(CAP):
            m = tl.max(tl.max(excess, 1), 0)
            f = tl.min(tl.min(tl.where(excess == m, flat, BLOCK * D), 1), 0)
            xf = tl.max(tl.max(tl.where(flat == f, x, -float("inf")), 1), 0)
            take = (j == n) & (out_v * 0.0 + m > 0)  # (a vector: the interpreter rejects bool scalar & tensor)
            out_i = tl.where(take, f, out_i)
            out_v = tl.where(take, xf, out_v)
            excess = tl.where(flat == f, -1.0, excess)
        tl.store(pages_i16 + (rec + idx_off) // 2 + slot * CAP + j, out_i.to(tl.int16), mask=j < CAP)
        tl.store(pages_h + (rec + val_off) // 2 + slot * CAP + j,
                 out_v.to(pages_h.dtype.element_ty), mask=j < CAP)

    if METHOD == SCALAR:  # scalar: one codebook of KC values per channel, CB channels per step
        PER: tl.constexpr = 8 // BITS
        t = tl.arange(0, BLOCK)[:, None, None]
        k = tl.arange(0, KC)[None, None, :]
        for c0 in range(0, D, CB):
            ch = c0 + tl.arange(0, CB)[None, :, None]
            u = _pre_value(x_ptr, pages_h, rec_h, cos_ptr, sin_ptr, pid_ptr, pos_ptr, i, pg, p, h,
                           t, ch, H, D, KV, ROPE, S2, HALF_BF16)
            if CAP > 0:
                u = tl.minimum(tl.maximum(u, tl.load(lo_ptr + hd + ch)), tl.load(hi_ptr + hd + ch))
            u = (u - tl.load(mean_ptr + hd + ch)) * tl.load(inv_std_ptr + hd + ch)
            diff = u - tl.load(cb_ptr + (hd + ch) * KC + k).to(tl.float32)
            d = diff * diff
            dmin = tl.min(d, 2)
            code = tl.min(tl.where(d == dmin[:, :, None], k, KC), 2)  # [8, CB], lowest on ties
            shift = ((c0 + tl.arange(0, CB)[None, :]) % PER) * BITS
            packed = tl.sum(tl.reshape(code << shift, [BLOCK, CB // PER, PER]), 2)
            byte = c0 // PER + tl.arange(0, CB // PER)[None, :]
            tl.store(codes + tl.arange(0, BLOCK)[:, None] * (D * BITS // 8) + byte, packed.to(tl.uint8))
    else:  # vector methods: GB codebook groups per step, each shared by 8 vectors of the block
        G: tl.constexpr = D // L
        n = tl.arange(0, BLOCK)[None, :, None]
        k = tl.arange(0, KC)[None, None, :]
        for g0 in range(0, G, GB):
            g = g0 + tl.arange(0, GB)[:, None, None]
            d = tl.zeros([GB, BLOCK, KC], tl.float32)
            for e in tl.static_range(L):  # sequential over the vector's floats (the contract)
                if METHOD == TEMPORAL:  # vector n: tokens (n // L) * L + e of channel g * L + n % L
                    tok = (n // L) * L + e
                    ch = g * L + n % L
                else:  # vector n: token n, channels g * L + e
                    tok = n
                    ch = g * L + e
                u = _pre_value(x_ptr, pages_h, rec_h, cos_ptr, sin_ptr, pid_ptr, pos_ptr, i, pg, p, h,
                               tok, ch, H, D, KV, ROPE, S2, HALF_BF16)
                if CAP > 0:
                    u = tl.minimum(tl.maximum(u, tl.load(lo_ptr + hd + ch)), tl.load(hi_ptr + hd + ch))
                u = (u - tl.load(mean_ptr + hd + ch)) * tl.load(inv_std_ptr + hd + ch)
                diff = u - tl.load(cb_ptr + ((h * G + g) * KC + k) * L + e).to(tl.float32)
                d = d + diff * diff
            dmin = tl.min(d, 2)
            code = tl.min(tl.where(d == dmin[:, :, None], k, KC), 2)  # [GB, 8], lowest on ties
            g2 = g0 + tl.arange(0, GB)[:, None]
            n2 = tl.arange(0, BLOCK)[None, :]
            if METHOD == TEMPORAL:  # block bytes [8 / L, D]: row = token chunk, column = channel
                off = (n2 // L) * D + g2 * L + n2 % L
            else:  # block bytes [8, D / L]: row = token, column = channel group
                off = n2 * G + g2
            tl.store(codes + off, code.to(tl.uint8))


@triton.jit
def _store_kernel(k_ptr, v_ptr, pos_ptr, pid_ptr, N, pages_h, rec_h,
                  H: tl.constexpr, D: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.load(pos_ptr + i)
    if p < 0:  # a padded row (a CUDA graph's batch is padded to its captured size)
        return
    pg = tl.load(pid_ptr + i)
    off = p % BLOCK
    # a token whose block is completed by a later token of this call was encoded instead
    j = tl.minimum(i + (BLOCK - 1) - off, N - 1)
    closed = (i + (BLOCK - 1) - off < N) & (tl.load(pid_ptr + j) == pg) & \
        (tl.load(pos_ptr + j) == p + (BLOCK - 1) - off)
    if (p >= SINKS) & closed:
        return
    slot = tl.where(p < SINKS, p, TAIL0 + off)
    base = (pg.to(tl.int64) * H + h) * rec_h + slot * 2 * D
    c = tl.arange(0, D)
    src = (i.to(tl.int64) * H + h) * D + c
    tl.store(pages_h + base + c, tl.load(k_ptr + src))
    tl.store(pages_h + base + D + c, tl.load(v_ptr + src))


# ---- wrapper -------------------------------------------------------------------------------------


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _encode_launch_args(prm: CodecParams, D: int) -> dict:
    """Step sizes: about _ENCODE_TILE distance terms per step."""
    step = _pow2_floor(_ENCODE_TILE // (BLOCK_TOKENS * prm.n_centroids))
    if prm.method == KERNEL_SCALAR:  # CB channels per step, whole bytes of packed codes
        return dict(GB=1, CB=min(D, max(8 // prm.code_bits, step)))
    return dict(GB=min(D // prm.chunk, step), CB=1)


@torch.no_grad()
def write_kv(lc, pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
             page_ids: torch.Tensor, *, max_position: int | None = None) -> None:
    """Triton twin of ``paged_torch.write_kv`` (same arguments).  ``max_position`` (exclusive bound
    on ``positions``) spares a device sync when given."""
    N = key.shape[0]
    if N == 0:
        return
    lay = lc.layout
    H, D = key.shape[1], key.shape[2]
    u8, hv, i16 = page_views(pages, lc.dtype)
    kh = key.to(lc.dtype).contiguous()
    vh = value.to(lc.dtype).contiguous()
    pos = positions.contiguous()
    pid = page_ids.to(pos.dtype).contiguous()
    if max_position is None:
        max_position = int(positions.max()) + 1
    cos, sin = rope_table(lc.rope, max_position, pages.device)
    s2 = float(lc.rope.scale) ** 2
    for kv, (kind, q, x) in enumerate((("k", lc.k, kh), ("v", lc.v, vh))):
        prm = codec_params(q, pages.device)
        idx_off, val_off = (lay.k_idx, lay.k_val) if kind == "k" else (lay.v_idx, lay.v_val)
        cap = lay.cap
        _encode_kernel[(N, H)](
            x, pos, pid, u8, hv, i16, cos, sin, prm.mean, prm.inv_std, prm.lo, prm.hi, prm.centroids,
            lay.bytes, lay.k_codes if kind == "k" else lay.v_codes, idx_off, val_off, lay.block_size,
            H=H, D=D, KV=kv, METHOD=prm.method, L=prm.chunk, BITS=prm.code_bits, KC=prm.n_centroids,
            CAP=cap, CAP_P2=triton.next_power_of_2(max(cap, 1)), ROPE=kind == "k", S2=s2,
            HALF_BF16=lc.dtype == torch.bfloat16, **_encode_launch_args(prm, D),
            enable_fp_fusion=False,
        )
    _store_kernel[(N, H)](kh, vh, pos, pid, N, hv, lay.bytes // 2, H=H, D=D)
