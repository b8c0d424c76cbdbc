"""Fisher-weighted k-means, batched over many codebooks, built on fast-pytorch-kmeans.

The thesis (Alg. 2, sec. 5.2.1) minimizes ``sum_i w_i ||u_i - c(u_i)||^2`` with Lloyd iterations:
assign each vector to its nearest centroid (plain L2), then move each centroid to the *weighted*
mean of its members.  fast-pytorch-kmeans' ``MultiKMeans`` provides the batched, memory-split
nearest-centroid search; it has no sample weights and its k-means++ is quadratic in k, so the
weighted update and a weighted, seeded, O(kN) k-means++ are added here.
"""

from __future__ import annotations

import torch
from fast_pytorch_kmeans import MultiKMeans

_TILE_ELEMS = 1 << 24


class FisherKMeans(MultiKMeans):
    def __init__(self, n_clusters: int, max_iter: int = 50, seed: int = 0):
        super().__init__(n_clusters, max_iter=max_iter, tol=0.0, mode="euclidean")
        self.seed = seed

    def _assign(self, X: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        """Nearest centroid [B, N], via the library's batched search, in bounded tiles."""
        B, N, _ = X.shape
        K = C.shape[1]
        out = torch.empty(B, N, dtype=torch.int64, device=X.device)
        bstep = max(1, min(B, _TILE_ELEMS // max(1, N * K)))
        nstep = max(1, _TILE_ELEMS // max(1, bstep * K))
        for b in range(0, B, bstep):
            for s in range(0, N, nstep):
                out[b : b + bstep, s : s + nstep] = self.max_sim(
                    a=X[b : b + bstep, s : s + nstep], b=C[b : b + bstep]
                )[1]
        return out

    def _init_kpp(self, X: torch.Tensor, w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Weighted k-means++: sample each next seed with probability ~ w * D^2 (batched)."""
        B, N, v = X.shape
        K = self.n_clusters
        C = torch.empty(B, K, v, dtype=X.dtype, device=X.device)
        rows = torch.arange(B, device=X.device)
        first = torch.multinomial(w, 1, generator=gen)[:, 0]
        C[:, 0] = X[rows, first]
        mind = ((X - C[:, :1]) ** 2).sum(-1)
        for k in range(1, K):
            p = w * mind
            dead = p.sum(-1) <= 0  # every point already a centroid: any choice is fine
            p[dead] = 1.0
            pick = torch.multinomial(p, 1, generator=gen)[:, 0]
            C[:, k] = X[rows, pick]
            mind = torch.minimum(mind, ((X - C[:, k : k + 1]) ** 2).sum(-1))
        return C

    def fit(self, X: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """X [B, N, v] float32, weights [B, N] (None = unweighted) -> centroids [B, K, v]."""
        X = X.float()
        B, N, v = X.shape
        K = self.n_clusters
        if weights is None:
            w = torch.ones(B, N, device=X.device)
        else:
            w = weights.float().clamp_min(0)
            # a zero weight would let a cluster lose all its mass; floor tiny weights instead
            w = torch.maximum(w, w.mean(-1, keepdim=True) * 1e-6 + 1e-30)
        gen = torch.Generator(device=X.device).manual_seed(self.seed)
        C = self._init_kpp(X, w, gen)
        Xw = X * w[..., None]
        prev = None
        for _ in range(self.max_iter):
            assign = self._assign(X, C)
            if prev is not None and torch.equal(assign, prev):
                break  # converged: the update would not move any centroid
            prev = assign
            num = torch.zeros(B, K, v, device=X.device).scatter_add_(
                1, assign[..., None].expand(B, N, v), Xw
            )
            den = torch.zeros(B, K, device=X.device).scatter_add_(1, assign, w)
            live = den > 0
            C = torch.where(live[..., None], num / den.clamp_min(1e-30)[..., None], C)
        self.centroids = C
        return C
