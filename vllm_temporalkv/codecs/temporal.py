"""TemporalKV (thesis): a vector is ``l`` consecutive tokens of one channel.

Codebooks are shared by groups of ``l`` adjacent channels (G = D / l per head), which makes the
centroid memory equal to ChannelKV's, as the thesis does for a fair comparison.  Codes are laid out
``[T / l, H, D]``: one byte per (token chunk, head, channel).  The geometry is declared once, in
``layout.code_layout``; the generic ``Codec`` does the rest.
"""

from __future__ import annotations

from .base import Codec


class TemporalCodec(Codec):
    method = "temporal"
