"""The torch side of the page layout: views of a cache tensor ``[num_pages, H, layout.bytes]`` uint8 at a
``layout.PageLayout``'s offsets, code bytes <-> the codecs' natural code tensors, TaDA's per-token head mean <->
the heads' shares of it, and the half dtype exact values are stored in.  (layout.py is the arithmetic alone.)"""

from __future__ import annotations

import torch

from .layout import PageLayout
from .methods import BLOCK_TOKENS, CodeLayout


def _slice(pages, start, nbytes):
    return pages[..., start : start + nbytes]


def region_view(lay: PageLayout, pages, dtype):
    """[num_pages, H, region_slots, 2, D] in the model's half dtype."""
    n = lay.region_slots * 2 * lay.head_dim * 2
    return _slice(pages, lay.region, n).view(dtype).unflatten(-1, (lay.region_slots, 2, lay.head_dim))


def exact_view(lay: PageLayout, pages, dtype):
    """Small pages: [num_pages, H, BLOCK_TOKENS, 2, D] half, the exact pages' slots (layout.py)."""
    assert lay.exact_pages, "only small pages keep exact pages"
    return _slice(pages, 0, BLOCK_TOKENS * 2 * lay.head_dim * 2).view(dtype).unflatten(
        -1, (BLOCK_TOKENS, 2, lay.head_dim))


def scales_view(lay: PageLayout, pages, kind: str):
    """[num_pages, H, blocks, BLOCK_TOKENS, P] fp16 row scales for K ("k") or V ("v")."""
    start = lay.k_scales if kind == "k" else lay.v_scales
    P = lay.kind_scales_per_row[kind]
    return _slice(pages, start, lay.blocks * BLOCK_TOKENS * P * 2).view(torch.float16).unflatten(
        -1, (lay.blocks, BLOCK_TOKENS, P))


def mean_view(lay: PageLayout, pages, kind: str, dtype):
    """[num_pages, H, blocks, BLOCK_TOKENS, c] half: each head's channels of the per-token head mean."""
    start = lay.k_mean if kind == "k" else lay.v_mean
    n = lay.blocks * lay.mean_bytes
    return _slice(pages, start, n).view(dtype).unflatten(-1, (lay.blocks, BLOCK_TOKENS, lay.mean_channels))


def codes_view(lay: PageLayout, pages, kind: str):
    """[num_pages, H, blocks, code bytes] uint8 for K ("k") or V ("v")."""
    start = lay.k_codes if kind == "k" else lay.v_codes
    n = lay.kind_code_bytes[kind]
    return _slice(pages, start, lay.blocks * n).unflatten(-1, (lay.blocks, n))


def outlier_views(lay: PageLayout, pages, kind: str, dtype):
    """([num_pages, H, blocks, cap] int16 positions, same-shape half values)."""
    i0, v0 = (lay.k_idx, lay.k_val) if kind == "k" else (lay.v_idx, lay.v_val)
    n = lay.blocks * lay.cap * 2
    idx = _slice(pages, i0, n).view(torch.int16).unflatten(-1, (lay.blocks, lay.cap))
    val = _slice(pages, v0, n).view(dtype).unflatten(-1, (lay.blocks, lay.cap))
    return idx, val


# ---- code bytes <-> the codec's natural code tensors (one block of BLOCK_TOKENS tokens) ---------


def pack_block_codes(cl: CodeLayout, codes: torch.Tensor) -> torch.Tensor:
    """Natural codes of nb whole blocks, [nb * rows, H, cols] -> [nb, H, block_bytes] uint8."""
    H, cols = codes.shape[1], codes.shape[2]
    nb = codes.shape[0] // cl.rows
    c = codes.to(torch.uint8).reshape(nb, cl.rows, H, cols).transpose(1, 2)  # [nb, H, rows, cols]
    if cl.code_bits < 8:
        per = 8 // cl.code_bits
        c = c.reshape(*c.shape[:-1], -1, per).to(torch.int32)
        shifts = torch.arange(per, device=c.device, dtype=torch.int32) * cl.code_bits
        c = (c << shifts).sum(-1).to(torch.uint8)
    return c.reshape(nb, H, -1)


def unpack_block_codes(cl: CodeLayout, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of pack_block_codes: [nb, H, block_bytes] -> [nb * rows, H, cols]."""
    nb, H, _ = packed.shape
    c = packed
    if cl.code_bits < 8:
        per = 8 // cl.code_bits
        shifts = torch.arange(per, device=c.device, dtype=torch.int32) * cl.code_bits
        c = ((c.to(torch.int32)[..., None] >> shifts) & ((1 << cl.code_bits) - 1)).to(torch.uint8)
    c = c.reshape(nb, H, cl.rows, cl.cols(head_dim)).transpose(1, 2)
    return c.reshape(nb * cl.rows, H, cl.cols(head_dim))


# ---- the per-token head mean (TaDA) <-> the heads' shares of it -------------------------------


def split_head_mean(mean: torch.Tensor, num_kv_heads: int, channels: int) -> torch.Tensor:
    """[T, D] -> [T, H, c]: head h's share is channels h*c .. h*c + c - 1 (zero-padded past D)."""
    pad = num_kv_heads * channels - mean.shape[-1]
    return torch.nn.functional.pad(mean, (0, pad)).unflatten(-1, (num_kv_heads, channels))


def join_head_mean(shares: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of split_head_mean: [..., H, c] -> [..., D]."""
    return shares.flatten(-2)[..., :head_dim]


def store_half(dtype: torch.dtype) -> torch.dtype:
    """The half dtype a cache stores exact values in (sinks, tail, outliers, head means): the model's own, or
    bfloat16 for a float32 model (a float32 region would cost ~12% of the pages' capacity)."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
