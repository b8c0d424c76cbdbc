"""TemporalKV (thesis): a vector is ``l`` consecutive tokens of one channel.

Codebooks are shared by groups of ``l`` adjacent channels (G = D / l per head), which makes the
centroid memory equal to ChannelKV's, as the thesis does for a fair comparison.  Codes are laid out
``[T / l, H, D]``: one byte per (token chunk, head, channel).
"""

from __future__ import annotations

import torch

from .base import Codec


class TemporalCodec(Codec):
    method = "temporal"

    def num_groups(self, head_dim: int) -> int:
        return head_dim // self.chunk

    def token_multiple(self) -> int:
        return self.chunk

    def to_vectors(self, z: torch.Tensor) -> torch.Tensor:
        T, H, D = z.shape
        l = self.chunk
        # [T/l, l(tokens), H, G, l(channels)] -> [H, G, T/l, l(channels), l(tokens)]
        v = z.reshape(T // l, l, H, D // l, l).permute(2, 3, 0, 4, 1)
        return v.reshape(H, D // l, (T // l) * l, l)

    def from_vectors(self, vecs: torch.Tensor, T: int) -> torch.Tensor:
        H, G, N, l = vecs.shape
        v = vecs.reshape(H, G, T // l, l, l).permute(2, 4, 0, 1, 3)
        return v.reshape(T, H, G * l)

    def codes_layout(self, assign: torch.Tensor, T: int) -> torch.Tensor:
        H, G, N = assign.shape
        l = self.chunk
        return assign.reshape(H, G, T // l, l).permute(2, 0, 1, 3).reshape(T // l, H, G * l)

    def assign_layout(self, codes: torch.Tensor) -> torch.Tensor:
        Tc, H, D = codes.shape
        l = self.chunk
        return codes.reshape(Tc, H, D // l, l).permute(1, 2, 0, 3).reshape(H, D // l, Tc * l)
