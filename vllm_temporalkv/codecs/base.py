"""The codec interface shared by every method, and the exact nearest-centroid search.

A codec handles one (layer, K-or-V) cache of shape ``[T, H, D]`` (tokens, KV heads, head_dim) in
*normalized* space.  A method only says how that tensor is cut into vectors: ``to_vectors`` maps it
to ``[H, G, N, v]`` (G codebooks per head, N vectors of v floats each), ``from_vectors`` inverts
it.  Everything else - fitting (Fisher-weighted k-means), encoding (argmin), decoding (lookup) -
is the same for all methods and lives here.

The argmin is the contract every kernel must reproduce bit for bit: the distance of vector u to
centroid c is ``sum_i (u_i - c_i)**2`` accumulated in float32 in order i = 0..v-1 (no fused
multiply-add), and ties go to the lowest centroid index.  A fast matmul screen picks candidates;
the exact distance decides among them.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch

from ..methods import CodeLayout, code_layout

# candidates kept by the matmul screen; the exact argmin is among them unless >= this many
# centroids lie within float32 rounding of each other.
_SCREEN = 4
_TILE_ELEMS = 1 << 24  # bound on the [*, n, K] score temporaries


def exact_sq_dist(u: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``sum_i (u_i - c_i)^2`` over the last dim, float32, sequential in i (the kernel contract)."""
    d = None
    for i in range(u.shape[-1]):
        diff = u[..., i] - c[..., i]
        sq = diff * diff
        d = sq if d is None else d + sq
    return d


# Faster implementations of the same contract, by device type.  Codecs import no kernels: a
# room that has one (ops/ for serving, calibration/ for k-means) registers it, and tests hold it
# bit-identical to ``nearest_torch``.
_NEAREST_IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def register_nearest(device_type: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Use ``fn`` (bit-identical to ``nearest_torch``) for tensors on ``device_type``."""
    _NEAREST_IMPLS[device_type] = fn


def nearest(vecs: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid. vecs [B, N, v], centroids [B, K, v] -> [B, N] int64.
    A registered fast implementation for the device if there is one, else ``nearest_torch``."""
    fn = _NEAREST_IMPLS.get(vecs.device.type)
    if fn is not None:
        return fn(vecs.float().contiguous(), centroids.float().contiguous())
    return nearest_torch(vecs.float(), centroids.float())


def nearest_torch(vecs: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """The reference nearest-centroid search in plain torch (see the module docstring)."""
    B, N, v = vecs.shape
    K = centroids.shape[1]
    out = torch.empty(B, N, dtype=torch.int64, device=vecs.device)
    if K <= _SCREEN * 2:
        # tiny codebooks (KVQuant 1/2-bit): exact distances to all centroids
        step = max(1, _TILE_ELEMS // max(1, B * K))
        for s in range(0, N, step):
            d = exact_sq_dist(vecs[:, s : s + step, None, :], centroids[:, None, :, :])
            out[:, s : s + step] = d.argmin(-1)  # first minimum = lowest index on ties
        return out
    c_sq = (centroids * centroids).sum(-1)  # [B, K]
    ct = centroids.transpose(1, 2)
    step = max(1, _TILE_ELEMS // max(1, B * K))
    for s in range(0, N, step):
        u = vecs[:, s : s + step]
        approx = torch.baddbmm(c_sq[:, None, :], u, ct, alpha=-2.0)  # ||c||^2 - 2 u.c
        cand = approx.topk(_SCREEN, dim=-1, largest=False).indices.sort(-1).values  # [B, n, S]
        cc = torch.gather(
            centroids[:, None].expand(B, u.shape[1], K, v), 2, cand[..., None].expand(-1, -1, -1, v)
        )
        d = exact_sq_dist(u[:, :, None, :], cc)  # [B, n, S]
        out[:, s : s + step] = torch.gather(cand, 2, d.argmin(-1, keepdim=True))[..., 0]
    return out


class Codec:
    """Codebooks of one method for one (layer, K-or-V) cache: ``centroids`` is ``[H, G, K, v]``.

    Generic over the method's ``CodeLayout`` (layout.py): how z is cut into vectors, which
    codebook group each belongs to, and the natural code tensor ``[T / vec_tokens, H, cols]``."""

    method: ClassVar[str]

    def __init__(self, chunk: int, n_centroids: int, centroids: torch.Tensor | None = None):
        self.chunk = chunk
        self.n_centroids = n_centroids
        self.layout: CodeLayout = code_layout(self.method, chunk, n_centroids)
        self.centroids = None if centroids is None else centroids.float()

    @property
    def vec_dim(self) -> int:
        return self.layout.vec_dim

    def num_groups(self, head_dim: int) -> int:
        """Codebooks per KV head."""
        return self.layout.groups(head_dim)

    def _dims(self):
        cl = self.layout
        return cl.vec_tokens, cl.vec_channels, cl.group_channels // cl.vec_channels

    def to_vectors(self, z: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [H, G, N, v]: within a group, vectors ordered (token row, column)."""
        T, H, D = z.shape
        vt, vc, cpg = self._dims()
        G = self.num_groups(D)
        v = z.reshape(T // vt, vt, H, G, cpg, vc).permute(2, 3, 0, 4, 1, 5)
        return v.reshape(H, G, (T // vt) * cpg, vt * vc)

    def from_vectors(self, vecs: torch.Tensor, T: int) -> torch.Tensor:
        """[H, G, N, v] -> [T, H, D]."""
        H, G = vecs.shape[:2]
        vt, vc, cpg = self._dims()
        v = vecs.reshape(H, G, T // vt, cpg, vt, vc).permute(2, 4, 0, 1, 3, 5)
        return v.reshape(T, H, G * cpg * vc)

    def codes_layout(self, assign: torch.Tensor, T: int) -> torch.Tensor:
        """[H, G, N] -> the natural code tensor [T / vec_tokens, H, cols]."""
        H, G, N = assign.shape
        vt, _, cpg = self._dims()
        return assign.reshape(H, G, T // vt, cpg).permute(2, 0, 1, 3).reshape(T // vt, H, G * cpg)

    def assign_layout(self, codes: torch.Tensor) -> torch.Tensor:
        """Inverse of codes_layout."""
        Tr, H, cols = codes.shape
        _, _, cpg = self._dims()
        return codes.reshape(Tr, H, cols // cpg, cpg).permute(1, 2, 0, 3).reshape(H, cols // cpg, Tr * cpg)

    # --- shared ------------------------------------------------------------------------------
    def codebook_shape(self, num_heads: int, head_dim: int) -> tuple[int, int, int, int]:
        return (num_heads, self.num_groups(head_dim), self.n_centroids, self.vec_dim)

    def vector_weights(self, fisher: torch.Tensor) -> torch.Tensor:
        """Per-element Fisher weights [T, H, D] -> per-vector weights [H, G, N] (sum over the vector)."""
        return self.to_vectors(fisher).sum(-1)

    def _check_fitted(self) -> torch.Tensor:
        if self.centroids is None:
            raise RuntimeError(f"{type(self).__name__} has no centroids: fit() or load them first")
        return self.centroids

    def assign(self, z: torch.Tensor) -> torch.Tensor:
        """[T, H, D] normalized -> [H, G, N] centroid indices (int64)."""
        C = self._check_fitted()
        vecs = self.to_vectors(z.float())
        H, G, N, v = vecs.shape
        idx = nearest(vecs.reshape(H * G, N, v), C.reshape(H * G, -1, v).to(vecs.device))
        return idx.reshape(H, G, N)

    def encode(self, z: torch.Tensor) -> torch.Tensor:
        """Normalized [T, H, D] -> uint8 codes in the method's natural layout."""
        return self.codes_layout(self.assign(z), z.shape[0]).to(torch.uint8)

    def lookup(self, assign: torch.Tensor) -> torch.Tensor:
        """[H, G, N] indices -> [H, G, N, v] centroids (float32)."""
        C = self._check_fitted().to(assign.device)
        H, G, K, v = C.shape
        return torch.gather(C, 2, assign.long()[..., None].expand(H, G, -1, v))

    def decode(self, codes: torch.Tensor, T: int) -> torch.Tensor:
        """Codes in natural layout -> normalized [T, H, D] float32."""
        return self.from_vectors(self.lookup(self.assign_layout(codes)), T)
