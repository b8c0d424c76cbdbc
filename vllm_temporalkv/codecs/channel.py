"""ChannelKV = Coupled Quantization (seed 001): a vector is ``l`` adjacent channels of one token.

One codebook of 256 centroids per channel group (G = D / l per head).  Codes are laid out
``[T, H, D / l]``.  TemporalKV's hybrid uses this chunking on the early layers where it wins.
"""

from __future__ import annotations

import torch

from .base import Codec


class ChannelCodec(Codec):
    method = "channel"

    def num_groups(self, head_dim: int) -> int:
        return head_dim // self.chunk

    def token_multiple(self) -> int:
        return 1

    def to_vectors(self, z: torch.Tensor) -> torch.Tensor:
        T, H, D = z.shape
        return z.reshape(T, H, D // self.chunk, self.chunk).permute(1, 2, 0, 3)

    def from_vectors(self, vecs: torch.Tensor, T: int) -> torch.Tensor:
        H, G, N, l = vecs.shape
        return vecs.permute(2, 0, 1, 3).reshape(T, H, G * l)

    def codes_layout(self, assign: torch.Tensor, T: int) -> torch.Tensor:
        return assign.permute(2, 0, 1)

    def assign_layout(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.permute(1, 2, 0)
