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
      chunk's i-th query sees the i-th key on), the KV heads as they are (torch's kernel maps query heads to
      them: GQA; repeated per query head where it cannot, ``_flash_gqa``);
      For a short chunk (a) and (b) are one flash call over decoded [0, s + Tq) with an additive mask (MASKED_MAX);
  (c) the 8 positions p - 7 .. p: decoded before p's own block, exact from it - in C++ (``window_merge``,
      csrc/prefill_impl.h), which also merges the other parts into the output: per query its 8 scores and the
      parts' log-sum-exps in one float32 softmax (in plain torch, (c) and the merge took 3x the flash calls' time).

With a recent window of w tokens (selective, TaDA, QJL; an option for all) a query at p reads exactly from w tokens
before its own block, so everything above moves w positions back: (a) and (b) take the decoded keys <= p - w - 8,
(c) the positions p - w - 7 .. p - w, and a fourth part takes the rest:
  (d) exact keys p - w + 1 .. p (the band): flash calls over blocks of BAND_ROWS queries, each over the exact keys
      its queries' bands cover, with an additive band mask (``_band_mask``); the blocks' outputs fill one part.

What it guarantees: the same attention as the C++ kernel up to bf16 rounding (scores and weights in bf16 GEMMs
inside flash, parts merged in float32), not the kernel's bit-for-bit independence of how a prompt was chunked
(flash's sums follow its own blocking of the key axis).  ``VLLM_TEMPORALKV_CPU_PREFILL=kernel`` keeps the C++
kernel (and that guarantee); ``ops.cpu.use_flash_prefill`` decides."""

from __future__ import annotations

import functools

import torch

from ..layout import BLOCK_TOKENS

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# part (c) and the merge: the C++ extension's window_merge, registered by ops.cpu when it loads the extension (this
# module is imported by ops.cpu, so it does not import it back)
_window_merge = None


# A chunk whose folded queries x keys of parts (a) and (b) number at most this many takes them in one flash call with
# an additive mask (query t of the chunk sees decoded keys <= s + t): short chunks - a prefix-cache hit's new tokens,
# chunked prefill's last pieces - spend more on the second call and its per-head K/V copies than on the work itself
# (measured on a 2-core AMX Xeon, SmolLM2's 3 KV heads x 3: a 40-token chunk over 256 cached tokens 0.59x the split's
# time, 16 over 300 0.67x, 64 over 600 0.90x, 128 over 1000 1.02x, 40 over 8000 1.09x).  Longer chunks keep the
# split: the mask grows with Tq x n and is read for every score, and the masked call computes the whole (b)
# rectangle where the causal call skips half of it.
MASKED_MAX = 1 << 19


@functools.lru_cache(maxsize=8)  # every layer of a step asks for the same chunk shapes
def _mask(t: int, first: int, n: int, g: int, dtype: torch.dtype) -> torch.Tensor:
    """[g * t, n] additive mask: row i * t + u (query head i of the group, the chunk's u-th query) sees key j iff
    j <= first + u."""
    u = torch.arange(t)[:, None]
    m = torch.zeros(t, n, dtype=dtype).masked_fill(torch.arange(n)[None] > first + u, float("-inf"))
    return m.repeat(g, 1)


# queries per flash call of the band part (d): a block's call computes BAND_ROWS x (BAND_ROWS + w) scores for the
# BAND_ROWS x w it needs; fewer rows waste less, more rows spend less on calls (measured on the 2-core AMX Xeon,
# SmolLM2's shape, w = 128, a 4096-token chunk: 64 rows 1.00, 128 rows 0.95, 256 rows 0.99 of 64's time)
BAND_ROWS = 128


@functools.lru_cache(maxsize=16)
def _band_mask(t: int, rel: int, n: int, g: int, w: int, dtype: torch.dtype) -> torch.Tensor:
    """[g * t, n] additive mask: row i * t + u (query head i, the block's u-th query, at key index rel + u) sees
    key j iff rel + u - w < j <= rel + u."""
    d = torch.arange(n)[None] - (rel + torch.arange(t)[:, None])  # key index - the query's own
    m = torch.zeros(t, n, dtype=dtype).masked_fill((d > 0) | (d <= -w), float("-inf"))
    return m.repeat(g, 1)


def _band(q: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, x0: int, offset: int, w: int,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (d): query t (position offset + t) over exact keys offset + t - w + 1 .. offset + t (kx / vx rows from
    position x0) -> (o [H, g, Tq, D], lse [H, g, Tq])."""
    Tq, Hq, D = q.shape
    H = kx.shape[1]
    g = Hq // H
    o = torch.empty(H, g, Tq, D, dtype=q.dtype)
    lse = torch.empty(H, g, Tq, dtype=torch.float32)
    for t0 in range(0, Tq, BAND_ROWS):
        t1 = min(Tq, t0 + BAND_ROWS)
        t = t1 - t0
        a, b = max(offset + t0 - w + 1, 0) - x0, offset + t1 - x0  # kx rows of the block's keys
        qm = q[t0:t1].view(t, H, g, D).permute(1, 2, 0, 3).reshape(1, H, g * t, D)
        ob, lb = _flash(qm, kx[a:b].transpose(0, 1)[None], vx[a:b].transpose(0, 1)[None],
                        attn_mask=_band_mask(t, offset + t0 - x0 - a, b - a, g, w, q.dtype), scale=scale)
        o[:, :, t0:t1] = ob[0].view(H, g, t, D)
        lse[:, :, t0:t1] = lb[0].view(H, g, t)
    return o, lse


@functools.cache
def _flash_gqa() -> bool:
    """Whether torch's CPU flash kernel takes fewer K/V heads than query heads (query head i reading K/V head
    i // (Hq / H), as SDPA's enable_gqa): then part (b) passes the cache's K/V as they are.  A 4096-token chunk of
    SmolLM2's shape on a 2-core AMX Xeon: 38 ms for the call against 42 ms plus ~3 ms copying K/V per query head,
    bit-identical outputs (tests/test_cpu_flash_prefill.py)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 3, 8, generator=g) for n in (4, 2, 2))  # 4 query heads on 2 KV heads
    try:
        got = _flash(q, k, v, is_causal=True)[0]
    except RuntimeError:  # a torch whose CPU flash kernel wants one K/V head per query head
        return False
    return torch.equal(got, _flash(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)[0])


def _heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """[n, H, D] -> [1, H, n, D] for a flash call with g query heads per KV head (repeated where torch's kernel
    lacks GQA)."""
    x = x.transpose(0, 1)
    return (x if g == 1 or _flash_gqa() else x.repeat_interleave(g, 0))[None]


def short_mask(Tq: int, offset: int, g: int, dtype: torch.dtype, window: int = 0) -> torch.Tensor | None:
    """Parts (a) and (b)'s additive mask where a chunk of Tq queries at offset is short enough to take them in one
    flash call (MASKED_MAX), else None: what ``flash_prefill`` and the C++ ``prefill_chunk_flash`` both ask."""
    s = offset - BLOCK_TOKENS - window
    qlo = max(0, -s)
    if Tq > qlo and g * (Tq - qlo) * (s + Tq) <= MASKED_MAX:
        return _mask(Tq - qlo, s + qlo, s + Tq, g, dtype)
    return None


def register_window_merge(fn) -> None:
    global _window_merge
    _window_merge = fn


@torch.no_grad()
def flash_prefill(q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor,
                  x0: int, offset: int, scale: float, out: torch.Tensor | None = None,
                  window: int = 0) -> torch.Tensor:
    """``ops.cpu.prefill_attention``'s attention from the parts in the module comment: queries q [Tq, Hq, D] at
    positions offset..; kd / vd decoded [>= exact start of the last query, H, D] from position 0; kx / vx exact
    from position x0 (<= the first query's exact start, ``ops.cpu._own_block(offset, window)``) to offset + Tq - 1;
    window: a recent window (a multiple of 8; 0: none)."""
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
    s = offset - BLOCK_TOKENS - window  # query t sees decoded keys < s + t + 1 in (a) and (b)
    qlo = max(0, -s)
    mask = short_mask(Tq, offset, g, dt, window)
    if mask is not None:  # (a) and (b) in one masked call (short chunks)
        t = Tq - qlo
        qm = q[qlo:].view(t, H, g, D).permute(1, 2, 0, 3).reshape(1, H, g * t, D)
        o, lse = _flash(qm, kd[: s + Tq].transpose(0, 1)[None], vd[: s + Tq].transpose(0, 1)[None],
                        attn_mask=mask, scale=scale)
        parts.append((o[0].view(H, g, t, D), lse[0].view(H, g, t), qlo))
        qlo = Tq  # nothing left for (b)
    elif s > 0:  # (a): [1, H, g * Tq, D] queries (head h's g query heads one after the other) over [0, s)
        qa = q.view(Tq, H, g, D).permute(1, 2, 0, 3).reshape(1, H, g * Tq, D)
        o, lse = _flash(qa, kd[:s].transpose(0, 1)[None], vd[:s].transpose(0, 1)[None], scale=scale)
        parts.append((o[0].view(H, g, Tq, D), lse[0].view(H, g, Tq), 0))
    if Tq > qlo:  # (b): queries qlo.. over decoded [max(s, 0), s + Tq), causal from the first
        a, b = max(s, 0), s + Tq
        kb, vb = _heads(kd[a:b], g), _heads(vd[a:b], g)
        o, lse = _flash(q[qlo:].transpose(0, 1)[None], kb, vb, is_causal=True, scale=scale)
        parts.append((o[0].view(H, g, Tq - qlo, D), lse[0].view(H, g, Tq - qlo), qlo))
    if window:  # (d)
        o, lse = _band(q, kx, vx, x0, offset, window, scale)
        parts.append((o, lse, 0))
    # (c) and the merge: the C++ extension (csrc/prefill_impl.h window_item)
    if _window_merge is None:
        raise RuntimeError("flash_prefill needs the C++ CPU extension (vllm_temporalkv._C_cpu), which is not loaded: "
                           "rebuild it with `pip install --no-build-isolation -e . --no-deps`")
    _window_merge(q, kd, vd, kx, vx, x0, offset, float(scale), [p[0] for p in parts], [p[1] for p in parts],
                  [p[2] for p in parts], out, int(window))
    return out


__all__ = ["flash_prefill", "register_window_merge", "short_mask"]
