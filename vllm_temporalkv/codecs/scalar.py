"""KVQuant-style baseline: each value alone, with a per-channel non-uniform datatype.

2**bits centroids per channel (16 / 4 / 2 for 4 / 2 / 1 bits), fitted with the same
Fisher-weighted k-means as the vector methods (the thesis re-implements KVQuant this way, on
pre-RoPE keys).  Codes are laid out ``[T, H, D]``, one value < 2**bits each (packed by the layout).
"""

from __future__ import annotations

from .base import Codec


class ScalarCodec(Codec):
    method = "scalar"
