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
