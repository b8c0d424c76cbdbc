"""An orthogonal rotation of pre-RoPE keys and / or values before normalization and k-means (a 2-bit remedy).

QuaRot / SpinQuant / TurboQuant rotate keys so that a few large channels spread over all of them.  Here the
calibration fits the codebooks on ``k @ R`` (and the Fisher weights on ``g @ R``: for an orthogonal R the
gradient with respect to the rotated keys is the rotated gradient), and a decoder rotates back, ``k_hat @ R.T``,
before RoPE (values: the attention output could be rotated back once per query instead).  R is the same for every
layer and head: a randomized Hadamard matrix H diag(s) / sqrt(D) (s = +-1 from a fixed seed) where D is a power of
two, else the Q of a seeded Gaussian's QR.  RoPE does not commute with R, so the
served kernels would have to rotate back every decoded key; an artifact calibrated this way is refused by the server
(vllm/options.py) and only the quality harness (harness/simulate.py) reads it.
"""

from __future__ import annotations

import functools

import torch

ROTATIONS = ("hadamard",)


@functools.lru_cache(maxsize=8)
def rotation_matrix(kind: str, dim: int, seed: int = 0) -> torch.Tensor:
    """[dim, dim] float32 orthogonal matrix (rows and columns unit length and orthogonal)."""
    if kind not in ROTATIONS:
        raise ValueError(f"rotation {kind!r} is not one of {', '.join(ROTATIONS)}")
    g = torch.Generator().manual_seed(seed)
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:  # Sylvester: [[H, H], [H, -H]]
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (dim,), generator=g).float() * 2 - 1
        return (h * signs) / dim**0.5
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()  # the sign fix makes Q unique for the seed


def rotate(x: torch.Tensor, kind: str | None, inverse: bool = False) -> torch.Tensor:
    """x [..., D] @ R (or @ R.T with ``inverse``); ``kind`` None: x itself."""
    if kind is None:
        return x
    r = rotation_matrix(kind, x.shape[-1]).to(device=x.device)
    y = x.float() @ (r.T if inverse else r)
    return y.to(x.dtype)
