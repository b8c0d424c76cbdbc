"""Dense-and-sparse outliers (KVQuant-style, thesis sec. 5.3), with a hard 1% cap.

Calibration gives per-channel thresholds (0.5% / 99.5% quantiles of the raw values).  Within each
block of BLOCK_TOKENS tokens of one KV head, the values beyond their thresholds compete for
``cap`` exact slots, the farthest (in units of the channel's std) first, ties to the lower flat
index ``t * D + c``.  Every value beyond a threshold is clamped to it before encoding, so one
extreme value does not drag its whole vector to a bad centroid; the kept ones are restored exactly
after decoding.  The cap is per block, so a page can reserve a fixed number of slots.
"""

from __future__ import annotations

import torch

from ..methods import BLOCK_TOKENS


def split_outliers(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, inv_std: torch.Tensor, cap: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H, D] float32 (T multiple of BLOCK_TOKENS) -> (clamped x, idx [nb, H, cap] int16
    with -1 for unused slots, exact values [nb, H, cap] float32)."""
    T, H, D = x.shape
    nb = T // BLOCK_TOKENS
    excess = torch.maximum(lo - x, x - hi).clamp_min(0) * inv_std  # [T, H, D]
    blk = excess.reshape(nb, BLOCK_TOKENS, H, D).permute(0, 2, 1, 3).reshape(nb, H, BLOCK_TOKENS * D)
    top_v, top_i = torch.sort(blk, dim=-1, descending=True, stable=True)
    top_v, top_i = top_v[..., :cap], top_i[..., :cap]
    keep = top_v > 0
    xb = x.reshape(nb, BLOCK_TOKENS, H, D).permute(0, 2, 1, 3).reshape(nb, H, BLOCK_TOKENS * D)
    vals = torch.where(keep, torch.gather(xb, 2, top_i), torch.zeros_like(top_v))
    idx = torch.where(keep, top_i, torch.full_like(top_i, -1)).to(torch.int16)
    return torch.minimum(torch.maximum(x, lo), hi), idx, vals


def merge_outliers(x_hat: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Write the exact values back into x_hat [T, H, D] (any float dtype)."""
    T, H, D = x_hat.shape
    nb = T // BLOCK_TOKENS
    xb = x_hat.reshape(nb, BLOCK_TOKENS, H, D).permute(0, 2, 1, 3).reshape(nb, H, BLOCK_TOKENS * D).clone()
    live = idx >= 0
    i = idx.long().clamp_min(0)
    cur = torch.gather(xb, 2, i)
    xb.scatter_(2, i, torch.where(live, vals.to(xb.dtype), cur))
    return xb.reshape(nb, H, BLOCK_TOKENS, D).permute(0, 2, 1, 3).reshape(T, H, D)
