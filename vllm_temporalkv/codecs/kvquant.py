"""KVQuant-style baseline: each value alone, with a per-channel non-uniform datatype.

2**bits centroids per channel (16 / 4 / 2 for 4 / 2 / 1 bits), fitted with the same
Fisher-weighted k-means as the vector methods (the thesis re-implements KVQuant this way, on
pre-RoPE keys).  Codes are laid out ``[T, H, D]``, one value < 2**bits each (packed by the layout).
"""

from __future__ import annotations

import torch

from .base import Codec


class ScalarCodec(Codec):
    method = "scalar"

    @property
    def vec_dim(self) -> int:
        return 1

    def num_groups(self, head_dim: int) -> int:
        return head_dim

    def token_multiple(self) -> int:
        return 1

    def to_vectors(self, z: torch.Tensor) -> torch.Tensor:
        return z.permute(1, 2, 0)[..., None]

    def from_vectors(self, vecs: torch.Tensor, T: int) -> torch.Tensor:
        return vecs[..., 0].permute(2, 0, 1)

    def codes_layout(self, assign: torch.Tensor, T: int) -> torch.Tensor:
        return assign.permute(2, 0, 1)

    def assign_layout(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.permute(1, 2, 0)
