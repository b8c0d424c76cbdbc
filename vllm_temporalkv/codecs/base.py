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

from typing import ClassVar

import torch

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


def nearest(vecs: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid. vecs [B, N, v], centroids [B, K, v] -> [B, N] int64.
    On the CPU a fused numba loop (bit-identical, ~20x faster); otherwise ``nearest_torch``."""
    from ..kernels import cpu

    if vecs.device.type == "cpu" and cpu.HAVE_NUMBA:
        return cpu.nearest(vecs, centroids)
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
    """Codebooks of one method for one (layer, K-or-V) cache: ``centroids`` is ``[H, G, K, v]``."""

    method: ClassVar[str]

    def __init__(self, chunk: int, n_centroids: int, centroids: torch.Tensor | None = None):
        self.chunk = chunk
        self.n_centroids = n_centroids
        self.centroids = None if centroids is None else centroids.float()

    # --- what a method defines -------------------------------------------------------------
    @property
    def vec_dim(self) -> int:
        return self.chunk

    def num_groups(self, head_dim: int) -> int:
        """Codebooks per KV head."""
        raise NotImplementedError

    def token_multiple(self) -> int:
        """T passed to to_vectors must be a multiple of this."""
        raise NotImplementedError

    def to_vectors(self, z: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [H, G, N, v]."""
        raise NotImplementedError

    def from_vectors(self, vecs: torch.Tensor, T: int) -> torch.Tensor:
        """[H, G, N, v] -> [T, H, D]."""
        raise NotImplementedError

    def codes_layout(self, assign: torch.Tensor, T: int) -> torch.Tensor:
        """[H, G, N] -> the method's natural code tensor (first dim: tokens or token chunks)."""
        raise NotImplementedError

    def assign_layout(self, codes: torch.Tensor) -> torch.Tensor:
        """Inverse of codes_layout."""
        raise NotImplementedError

    # --- shared ------------------------------------------------------------------------------
    def codebook_shape(self, num_heads: int, head_dim: int) -> tuple[int, int, int, int]:
        return (num_heads, self.num_groups(head_dim), self.n_centroids, self.vec_dim)

    def vector_weights(self, fisher: torch.Tensor) -> torch.Tensor:
        """Per-element Fisher weights [T, H, D] -> per-vector weights [H, G, N] (sum over the vector)."""
        return self.to_vectors(fisher).sum(-1)

    def fit(
        self,
        z: torch.Tensor,
        fisher: torch.Tensor | None,
        *,
        iters: int = 50,
        seed: int = 0,
    ) -> "Codec":
        """Fisher-weighted k-means (k-means++ init) of the normalized samples ``z`` [T, H, D]."""
        from ..kernels import cpu
        from .kmeans import FisherKMeans

        vecs = self.to_vectors(z.float())
        H, G, N, v = vecs.shape
        X = vecs.reshape(H * G, N, v)
        w = None if fisher is None else self.vector_weights(fisher.float()).reshape(H * G, N)
        if X.device.type == "cpu" and cpu.HAVE_NUMBA:
            C = cpu.kmeans(X, w, self.n_centroids, iters, seed)
        else:  # GPU: fast-pytorch-kmeans' batched search with a weighted update
            C = FisherKMeans(self.n_centroids, max_iter=iters, seed=seed).fit(X, w)
        self.centroids = C.reshape(H, G, self.n_centroids, v)
        # stored (and used by kernels) in half precision, as in the thesis
        self.centroids = self.centroids.half().float()
        return self

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

    def weighted_mse(self, z: torch.Tensor, fisher: torch.Tensor | None) -> float:
        """Mean (Fisher-weighted) squared error of quantizing z; picks the hybrid's chunking."""
        # element-wise diagonal-Fisher estimate of the loss increase, comparable across chunkings
        vecs = self.to_vectors(z.float())
        err = (self.lookup(self.assign(z)) - vecs) ** 2  # [H, G, N, v]
        if fisher is None:
            return float(err.mean())
        f = self.to_vectors(fisher.float())
        return float((f * err).sum() / f.sum())
