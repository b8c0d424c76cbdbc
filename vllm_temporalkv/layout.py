"""Storage arithmetic of a compressed K/V cache: what each part costs, in bits per cached float.

Pure arithmetic, no torch: the honest accounting behind every "bits" column.  Per (layer, KV head,
K or V) a sequence of n tokens stores
* codes: one code per vector, ``bits`` per float on average (kvquant codes packed);
* outliers (optional): ``outlier_cap(D)`` fixed slots per block of BLOCK_TOKENS tokens, each a
  half-precision value plus a 16-bit position (the thesis counts only the value: +0.16 bits);
* sinks: the first SINK_TOKENS tokens in half precision;
* tail: the newest incomplete block in half precision (on average (BLOCK_TOKENS - 1) / 2 tokens);
* centroids: fixed per model, not per token: reported separately (``Artifact.centroid_bytes``).
"""

from __future__ import annotations

import torch

from .formats import BLOCK_TOKENS, SINK_TOKENS, KVFormat, outlier_cap

HALF_BITS = 16
OUTLIER_SLOT_BITS = HALF_BITS + 16  # value + position inside the block


def outlier_bits_per_float(head_dim: int) -> float:
    return outlier_cap(head_dim) * OUTLIER_SLOT_BITS / (BLOCK_TOKENS * head_dim)


def bits_per_float(fmt: KVFormat, head_dim: int, context: int, outliers: bool = False) -> dict[str, float]:
    """Average bits per cached K/V float for one sequence of ``context`` tokens."""
    n_sink = min(SINK_TOKENS, context)
    tail = min((BLOCK_TOKENS - 1) / 2, max(0, context - n_sink))
    coded = max(0.0, context - n_sink - tail)
    parts = {
        "codes": fmt.bits * coded / context,
        "outliers": (outlier_bits_per_float(head_dim) * coded / context) if outliers else 0.0,
        "sinks": HALF_BITS * n_sink / context,
        "tail": HALF_BITS * tail / context,
    }
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------------------------
# The paged layout served by vLLM: one flat byte record per (page, KV head)
#
#   region   [REGION_SLOTS, 2 (K, V), D] half   slots 0..7: the sequence's sink tokens (page 0)
#                                               slots 8..15: the incomplete block (the tail), in
#                                               whichever page holds it
#   k_codes  [nb = B / BLOCK_TOKENS, code_bytes = BLOCK_TOKENS * D * bits / 8] uint8
#   v_codes  [nb, code_bytes] uint8
#   (outliers only) k_idx [nb, cap] int16, k_val [nb, cap] half, v_idx, v_val
#
# Everything a sequence needs lives in its own pages, so prefix caching (full pages are shared,
# their tail slots unused), chunked prefill (the tail persists in the page) and preemption by
# recompute need nothing outside vLLM's block manager.  The price is the fixed region per page:
# 16 half-precision tokens, which large pages amortize (see DESIGN in README / capacity bench).

REGION_SLOTS = 2 * BLOCK_TOKENS  # sinks + tail
TAIL_SLOT0 = BLOCK_TOKENS


def code_bytes_per_block(fmt: KVFormat, head_dim: int) -> int:
    """Bytes of codes for one block of BLOCK_TOKENS tokens of one KV head, K or V."""
    return BLOCK_TOKENS * head_dim * fmt.bits // 8


class PageLayout:
    """Byte offsets inside one (page, KV head) record; shared by the torch path and kernels."""

    def __init__(self, fmt: KVFormat, head_dim: int, block_size: int, outliers: bool = False):
        if block_size % BLOCK_TOKENS or block_size < 2 * BLOCK_TOKENS:
            raise ValueError(
                f"{fmt.name} needs a block size that is a multiple of {BLOCK_TOKENS} and at least "
                f"{2 * BLOCK_TOKENS}, got {block_size}"
            )
        self.fmt, self.head_dim, self.block_size, self.outliers = fmt, head_dim, block_size, outliers
        D = head_dim
        self.blocks = block_size // BLOCK_TOKENS  # encode blocks per page
        self.code_bytes = code_bytes_per_block(fmt, D)
        self.cap = outlier_cap(D) if outliers else 0
        off = 0
        self.region = off
        off += REGION_SLOTS * 2 * D * 2
        self.k_codes = off
        off += self.blocks * self.code_bytes
        self.v_codes = off
        off += self.blocks * self.code_bytes
        self.k_idx = off
        off += self.blocks * self.cap * 2
        self.k_val = off
        off += self.blocks * self.cap * 2
        self.v_idx = off
        off += self.blocks * self.cap * 2
        self.v_val = off
        off += self.blocks * self.cap * 2
        self.bytes = -(-off // 16) * 16  # 16-byte aligned records

    def ratio_vs_half(self) -> float:
        """Compression of one page against a bf16/fp16 page of the same tokens."""
        return self.block_size * 2 * self.head_dim * 2 / self.bytes

    # ---- torch views of a cache tensor [num_pages, H, bytes] uint8 ----------------------------
    def _slice(self, pages, start, nbytes):
        return pages[..., start : start + nbytes]

    def region_view(self, pages, dtype):
        """[num_pages, H, REGION_SLOTS, 2, D] in the model's half dtype."""
        n = REGION_SLOTS * 2 * self.head_dim * 2
        return self._slice(pages, self.region, n).view(dtype).unflatten(-1, (REGION_SLOTS, 2, self.head_dim))

    def codes_view(self, pages, kind: str):
        """[num_pages, H, blocks, code_bytes] uint8 for K ("k") or V ("v")."""
        start = self.k_codes if kind == "k" else self.v_codes
        return self._slice(pages, start, self.blocks * self.code_bytes).unflatten(-1, (self.blocks, self.code_bytes))

    def outlier_views(self, pages, kind: str, dtype):
        """([num_pages, H, blocks, cap] int16 positions, same-shape half values)."""
        i0, v0 = (self.k_idx, self.k_val) if kind == "k" else (self.v_idx, self.v_val)
        n = self.blocks * self.cap * 2
        idx = self._slice(pages, i0, n).view(torch.int16).unflatten(-1, (self.blocks, self.cap))
        val = self._slice(pages, v0, n).view(dtype).unflatten(-1, (self.blocks, self.cap))
        return idx, val


# ---- code bytes <-> the codec's natural code tensors (one block of BLOCK_TOKENS tokens) ---------


def pack_block_codes(fmt: KVFormat, codes: torch.Tensor) -> torch.Tensor:
    """Natural codes of nb whole blocks -> [nb, H, code_bytes] uint8.

    temporal [nb*8/l, H, D] -> per block [8/l, D] row-major; channel [nb*8, H, D/l] -> [8, D/l];
    scalar [nb*8, H, D] (values < 2**bits) -> [8, D*bits/8], 8/bits consecutive channels per byte,
    lowest channel in the lowest bits."""
    rows, H = codes.shape[0], codes.shape[1]
    if fmt.method == "temporal":
        nb = rows * fmt.chunk // BLOCK_TOKENS
    else:
        nb = rows // BLOCK_TOKENS
    c = codes.to(torch.uint8).reshape(nb, -1, H, codes.shape[2]).transpose(1, 2)  # [nb, H, r, w]
    if fmt.method == "scalar" and fmt.bits < 8:
        per = 8 // fmt.bits
        c = c.reshape(*c.shape[:-1], -1, per).to(torch.int32)
        shifts = torch.arange(per, device=c.device, dtype=torch.int32) * fmt.bits
        c = (c << shifts).sum(-1).to(torch.uint8)
    return c.reshape(nb, H, -1)


def unpack_block_codes(fmt: KVFormat, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of pack_block_codes: [nb, H, code_bytes] -> natural codes."""
    nb, H, _ = packed.shape
    D = head_dim
    if fmt.method == "temporal":
        r, w = BLOCK_TOKENS // fmt.chunk, D
    elif fmt.method == "channel":
        r, w = BLOCK_TOKENS, D // fmt.chunk
    else:
        r, w = BLOCK_TOKENS, D
    c = packed
    if fmt.method == "scalar" and fmt.bits < 8:
        per = 8 // fmt.bits
        shifts = torch.arange(per, device=c.device, dtype=torch.int32) * fmt.bits
        c = ((c.to(torch.int32)[..., None] >> shifts) & ((1 << fmt.bits) - 1)).to(torch.uint8)
    c = c.reshape(nb, H, r, w).transpose(1, 2)
    return c.reshape(nb * r, H, w)
