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
  (c) the 8 positions p - 7 .. p: decoded before p's own block, exact from it - in C++ (``window_merge``,
      csrc/prefill_impl.h), which also merges (a) and (b) into the output: per query its 8 scores and the parts'
      log-sum-exps in one float32 softmax (in plain torch, (c) and the merge took 3x the flash calls' time).

What it guarantees: the same attention as the C++ kernel up to bf16 rounding (scores and weights in bf16 GEMMs
inside flash, parts merged in float32), not the kernel's bit-for-bit independence of how a prompt was chunked
(flash's sums follow its own blocking of the key axis).  ``VLLM_TEMPORALKV_CPU_PREFILL=kernel`` keeps the C++
kernel (and that guarantee); ``ops.cpu.use_flash_prefill`` decides."""

from __future__ import annotations

import torch

from ..layout import BLOCK_TOKENS

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# part (c) and the merge: the C++ extension's window_merge, registered by ops.cpu when it loads the extension (this
# module is imported by ops.cpu, so it does not import it back)
_window_merge = None


def register_window_merge(fn) -> None:
    global _window_merge
    _window_merge = fn


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
    parts: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (o [H, g, Tq - t0, D], lse [H, g, Tq - t0], t0)
    s = offset - BLOCK_TOKENS
    if s > 0:  # (a): [1, H, g * Tq, D] queries (head h's g query heads one after the other) over [0, s)
        qa = q.view(Tq, H, g, D).permute(1, 2, 0, 3).reshape(1, H, g * Tq, D)
        o, lse = _flash(qa, kd[:s].transpose(0, 1)[None], vd[:s].transpose(0, 1)[None], scale=scale)
        parts.append((o[0].view(H, g, Tq, D), lse[0].view(H, g, Tq), 0))
    qlo = max(0, -s)
    if Tq > qlo:  # (b): queries qlo.. over decoded [max(s, 0), s + Tq), causal from the first
        a, b = max(s, 0), s + Tq
        kb = kd[a:b].transpose(0, 1).repeat_interleave(g, 0)[None]
        vb = vd[a:b].transpose(0, 1).repeat_interleave(g, 0)[None]
        o, lse = _flash(q[qlo:].transpose(0, 1)[None], kb, vb, is_causal=True, scale=scale)
        parts.append((o[0].view(H, g, Tq - qlo, D), lse[0].view(H, g, Tq - qlo), qlo))
    # (c) and the merge: the C++ extension (csrc/prefill_impl.h window_item)
    if _window_merge is None:
        raise RuntimeError("flash_prefill needs the C++ CPU extension (vllm_temporalkv._C_cpu), which is not loaded: "
                           "rebuild it with `pip install --no-build-isolation -e . --no-deps`")
    _window_merge(q, kd, vd, kx, vx, x0, offset, float(scale), [p[0] for p in parts], [p[1] for p in parts],
                  [p[2] for p in parts], out)
    return out


__all__ = ["flash_prefill", "register_window_merge"]
