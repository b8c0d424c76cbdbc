"""The half-precision paged baseline of benchmarks.kernels: a simple paged flash-decoding Triton kernel over an
uncompressed cache.  Imported once TRITON_INTERPRET is decided (benchmarks.kernels.main): triton_encode reads it at
import, and triton.jit decides at decoration."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_temporalkv.ops import triton_decode, triton_encode

FP16_PAGE = 16  # vLLM's default block size, for the half-precision paged baseline
FP16_TILE = 64  # tokens per tile of the baseline kernel

# ---- the half-precision paged baseline -----------------------------------------------------------
#
# BASELINE, not part of the plugin: a deliberately simple paged flash-decoding kernel over an
# uncompressed cache k/v [num_pages, H, PAGE, D] (head-major pages, so each head's rows are
# contiguous), with the same grid (request, KV head, split), split heuristic and reduce kernel as
# triton_decode, so the comparison isolates "read half-precision K/V" vs "decode the codes".


def _fp16_paged_decode(q_ptr, k_ptr, v_ptr, bt_ptr, bt_stride, seq_lens_ptr, acc_ptr, ml_ptr, qk_scale,
                       tiles_per_split, H: tl.constexpr, GQ: tl.constexpr, GQ_P: tl.constexpr,
                       D: tl.constexpr, PAGE: tl.constexpr, BT: tl.constexpr, F32: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    S = tl.num_programs(2)
    DT: tl.constexpr = q_ptr.dtype.element_ty
    n = tl.load(seq_lens_ptr + r)
    t_lo = s * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, tl.cdiv(n, BT))
    bt_row = bt_ptr + r.to(tl.int64) * bt_stride
    g = tl.arange(0, GQ_P)  # the GQ query heads of KV head h, padded to tensor-core rows
    hq = h * GQ + g
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + (r.to(tl.int64) * H * GQ + hq[:, None]) * D + dd[None, :], mask=g[:, None] < GQ, other=0.0)
    m_i = tl.full([GQ_P], -float("inf"), tl.float32)
    l_i = tl.zeros([GQ_P], tl.float32)
    acc = tl.zeros([GQ_P, D], tl.float32)
    for tile in range(t_lo, t_hi):
        tok = tile * BT + tl.arange(0, BT)
        ok = tok < n
        page = tl.load(bt_row + tok // PAGE, mask=ok, other=0).to(tl.int64)
        row = ((page * H + h) * PAGE + tok % PAGE) * D
        k = tl.load(k_ptr + row[:, None] + dd[None, :], mask=ok[:, None], other=0.0)
        if F32:  # the interpreter's half-precision dot is wrong (see triton_decode._dot)
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(ok[None, :], sc * qk_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + dd[None, :], mask=ok[:, None], other=0.0)
        if F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(DT), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    part = (r.to(tl.int64) * H * GQ + hq) * S + s
    gm = g < GQ
    tl.store(acc_ptr + part[:, None] * D + dd[None, :], acc, mask=gm[:, None])
    tl.store(ml_ptr + part * 2, m_i, mask=gm)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=gm)


_fp16_decode_kernel = triton.jit(_fp16_paged_decode)


class Fp16Paged:
    """The baseline's cache and its launch; the reduce is triton_decode's, with identity V stats."""

    def __init__(self, B: int, L: int, H: int, HQ: int, D: int, dtype, device, page: int = FP16_PAGE):
        self.H, self.GQ, self.D, self.page = H, HQ // H, D, page
        per = -(-L // page)
        n = B * per
        self.k = torch.randn(n, H, page, D, dtype=dtype, device=device)
        self.v = torch.randn(n, H, page, D, dtype=dtype, device=device)
        self.bt = torch.randperm(n, device=device).reshape(B, per).to(torch.int32)  # scattered pages
        self.zero = torch.zeros(H, D, device=device)
        self.one = torch.ones(H, D, device=device)

    def splits(self, R: int) -> int:
        tiles = triton.cdiv(self.bt.shape[1] * self.page, FP16_TILE)
        return triton_decode.num_splits(R * self.H, tiles, self.k.device)

    def __call__(self, q, seq_lens, bt, scale, out):
        R, HQ, D = q.shape
        S = self.splits(R)
        acc = torch.empty(R, HQ, S, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(R, HQ, S, 2, dtype=torch.float32, device=q.device)
        tiles = triton.cdiv(bt.shape[1] * self.page, FP16_TILE)
        _fp16_decode_kernel[(R, self.H, S)](
            q, self.k, self.v, bt, bt.stride(0), seq_lens, acc, ml, float(scale) * triton_decode.LOG2E,
            triton.cdiv(tiles, S), H=self.H, GQ=self.GQ, GQ_P=max(16, triton.next_power_of_2(self.GQ)), D=D,
            PAGE=self.page, BT=FP16_TILE, F32=triton_encode.INTERPRET,
        )
        triton_decode._reduce_kernel[(R, HQ)](acc, ml, out, self.zero, self.one, S, HQ=HQ, GQ=self.GQ, D=D,
                                              S_P=triton.next_power_of_2(S))
        return out

    def dense_reference(self, q, r: int, n: int, scale) -> torch.Tensor:
        """float32 attention of request r's query over its first n cached tokens -> [HQ, D]."""
        pg = self.bt[r, : -(-n // self.page)].long()
        k = self.k[pg].permute(1, 0, 2, 3).reshape(self.H, -1, self.D)[:, :n].float()
        v = self.v[pg].permute(1, 0, 2, 3).reshape(self.H, -1, self.D)[:, :n].float()
        qh = q[r].float().view(self.H, self.GQ, self.D)
        p = torch.softmax(qh @ k.transpose(1, 2) * scale, -1)
        return (p @ v).reshape(-1, self.D)
