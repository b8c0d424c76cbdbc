"""A prefill chunk's attention on torch's flash kernel: the fast prefill on CPUs with AMX.

Why: on an AMX Xeon vLLM's own bf16 attention runs on AMX tiles, and the C++ prefill kernel (csrc/prefill_impl.h,
float32 FMAs or AVX512_BF16 dot products) is 3-7x slower than it (benchmarks/results/kernels-cpu-amx.md); the
prefill then dominated even decode-heavy serving (throughput-smollm2-cpu-amx: 0.43x auto).  torch's CPU flash
attention runs its bf16 GEMMs through oneDNN's AMX kernels and returns each query's log-sum-exp, so the attention
``prefill_attention`` defines can be split into parts that each fit it, merged exactly by their log-sum-exps.

The definition (``ops.cpu.prefill_attention``): a query at position p attends to decoded keys before its own
8-token block and to exact keys from there to itself.  Every position <= p - 8 is before that block, so

  (a) decoded keys [0, offset - 8): seen by every query of the chunk - one unmasked flash call, the g query heads
      of a KV head folded into the query axis (GQA without copying K/V);
  (b) decoded keys [offset - 8, n - 8): query p sees those <= p - 8 - a causal flash call (top-left aligned: the
      chunk's i-th query sees the i-th key on), K/V repeated per query head (chunk-sized);
  (c) the 8 positions p - 7 .. p: decoded before p's own block, exact from it - per 8-query block a 16-key window
      (the previous block decoded, the own block exact) with a fixed mask, float32 in plain torch.

What it guarantees: the same attention as the C++ kernel up to bf16 rounding (scores and weights in bf16 GEMMs
inside flash, parts merged in float32), not the kernel's bit-for-bit independence of how a prompt was chunked
(flash's sums follow its own blocking of the key axis).  ``VLLM_TEMPORALKV_CPU_PREFILL=kernel`` keeps the C++
kernel (and that guarantee); ``ops.cpu.use_flash_prefill`` decides."""

from __future__ import annotations

import torch

from ..layout import BLOCK_TOKENS

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _window_part(q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor,
                 x0: int, offset: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (c): each query over positions p - 7 .. p (decoded before its own block, exact from it).
    Returns (out [Hq, Tq, D] float32, lse [Hq, Tq])."""
    Tq, Hq, D = q.shape
    H = kd.shape[1]
    g = Hq // H
    B = BLOCK_TOKENS
    n = offset + Tq
    b_lo, b_hi = offset // B, (n - 1) // B
    nb = b_hi - b_lo + 1
    first = b_lo * B  # position of the first padded query
    # queries padded to whole blocks
    qp = q.new_zeros(nb * B, Hq, D)
    qp[offset - first: offset - first + Tq] = q
    # decoded keys of positions first - 8 .. first + 8 nb - 9 (each block's previous block), exact ones of first ..
    dec_k, dec_v = kd.new_zeros(nb * B, H, D), vd.new_zeros(nb * B, H, D)
    lo, hi = max(first - B, 0), min(first - B + nb * B, kd.shape[0])
    if hi > lo:
        dec_k[lo - (first - B): hi - (first - B)] = kd[lo:hi]
        dec_v[lo - (first - B): hi - (first - B)] = vd[lo:hi]
    ex_k, ex_v = kx.new_zeros(nb * B, H, D), vx.new_zeros(nb * B, H, D)
    lo, hi = first, min(first + nb * B, x0 + kx.shape[0])  # kx starts at x0 <= first (the first query's own block)
    ex_k[: hi - lo] = kx[lo - x0: hi - x0]
    ex_v[: hi - lo] = vx[lo - x0: hi - x0]
    kw = torch.cat([dec_k.view(nb, B, H, D), ex_k.view(nb, B, H, D)], 1).float()  # [nb, 2B, H, D]
    vw = torch.cat([dec_v.view(nb, B, H, D), ex_v.view(nb, B, H, D)], 1).float()
    # s[b, h, i, r, j]: query r of block b (head h * g + i) against window key j (position first + 8 b - 8 + j)
    qf = qp.float().view(nb, B, H, g, D).permute(0, 2, 3, 1, 4)  # [nb, H, g, B, D]
    s = qf @ kw.permute(0, 2, 3, 1)[:, :, None] * scale  # [nb, H, g, B, 2B]
    r = torch.arange(B)[:, None]
    j = torch.arange(2 * B)[None, :]
    seen = ((j > r) & (j < B)) | ((j >= B) & (j <= B + r))  # positions p - 7 .. p
    keypos = first - B + torch.arange(nb)[:, None] * B + torch.arange(2 * B)[None, :]  # [nb, 2B]
    mask = seen[None] & (keypos >= 0)[:, None, :]  # [nb, B, 2B]
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [nb, H, g, B]; every valid query sees its own key
    o = torch.softmax(s, -1).nan_to_num_(0.0) @ vw.permute(0, 2, 1, 3)[:, :, None]  # [nb, H, g, B, D]
    sl = slice(offset - first, offset - first + Tq)
    o = o.permute(1, 2, 0, 3, 4).reshape(Hq, nb * B, D)[:, sl]
    lse = lse.permute(1, 2, 0, 3).reshape(Hq, nb * B)[:, sl]
    return o, lse


@torch.no_grad()
def flash_prefill(q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor,
                  x0: int, offset: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.cpu.prefill_attention``'s attention (no recent window) from the parts in the module comment: queries
    q [Tq, Hq, D] at positions offset..; kd / vd decoded [>= own block of the last query, H, D] from position 0;
    kx / vx exact from position x0 (<= the first query's own-block start) to offset + Tq - 1."""
    Tq, Hq, D = q.shape
    H = kd.shape[1]
    g = Hq // H
    if out is None:
        out = torch.empty_like(q)
    if Tq == 0:
        return out
    dt = q.dtype
    kd, vd, kx, vx = kd.to(dt), vd.to(dt), kx.to(dt), vx.to(dt)
    parts = [_window_part(q, kd, vd, kx, vx, x0, offset, scale)]
    s = offset - BLOCK_TOKENS
    if s > 0:  # (a): [1, H, g * Tq, D] queries (head h's g query heads one after the other) over [0, s)
        qa = q.view(Tq, H, g, D).permute(1, 2, 0, 3).reshape(1, H, g * Tq, D)
        o, lse = _flash(qa, kd[:s].transpose(0, 1)[None], vd[:s].transpose(0, 1)[None], scale=scale)
        parts.append((o[0].view(H, g, Tq, D).reshape(Hq, Tq, D), lse[0].reshape(Hq, Tq)))
    qlo = max(0, -s)
    if Tq > qlo:  # (b): queries qlo.. over decoded [max(s, 0), s + Tq), causal from the first
        a, b = max(s, 0), s + Tq
        kb = kd[a:b].transpose(0, 1).repeat_interleave(g, 0)[None]
        vb = vd[a:b].transpose(0, 1).repeat_interleave(g, 0)[None]
        o, lse = _flash(q[qlo:].transpose(0, 1)[None], kb, vb, is_causal=True, scale=scale)
        ob = o.new_zeros(Hq, Tq, D)
        lb = lse.new_full((Hq, Tq), float("-inf"))
        ob[:, qlo:], lb[:, qlo:] = o[0], lse[0]
        parts.append((ob, lb))
    lse = torch.stack([p[1] for p in parts])  # [P, Hq, Tq]
    w = torch.exp(lse - lse.amax(0))
    acc = sum(w[i, ..., None] * parts[i][0].float() for i in range(len(parts)))
    out.copy_((acc / w.sum(0)[..., None]).transpose(0, 1))
    return out


__all__ = ["flash_prefill"]
