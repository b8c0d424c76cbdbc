"""ChannelKV = Coupled Quantization (seed 001): a vector is ``l`` adjacent channels of one token.

One codebook of 256 centroids per channel group (G = D / l per head).  Codes are laid out
``[T, H, D / l]``.  TemporalKV's hybrid uses this chunking on the early layers where it wins.
The geometry is declared once, in ``layout.code_layout``.
"""

from __future__ import annotations

from .base import Codec


class ChannelCodec(Codec):
    method = "channel"
