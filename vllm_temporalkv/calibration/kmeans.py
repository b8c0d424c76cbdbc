"""The one Fisher-weighted k-means of calibration, batched over many codebooks.

The thesis (Alg. 2, sec. 5.2.1) minimizes ``sum_i w_i ||u_i - c(u_i)||^2`` with Lloyd iterations:
assign each vector to its nearest centroid (plain L2), then move each centroid to the *weighted*
mean of its members (float64 sums; an emptied cluster keeps its centroid); stop after ``iters``
updates or when no centroid moves.  Seeds come from a weighted k-means++ (next seed drawn with
probability ~ w * D^2 from uniforms of a seeded torch generator), computed here once for every
device.  Two engines run the same Lloyd iterations from those seeds:

* CPU: numba, exact argmin with Hamerly's bounds (``numba_search.lloyd``);
* elsewhere (GPU): fast-pytorch-kmeans' batched nearest-centroid search (``FisherKMeans``).

So a CPU and a GPU calibration with the same seed start from the same centroids and differ only
by float rounding (the GPU search is a matmul argmax, which may break near-ties differently).
"""

from __future__ import annotations

import torch
from fast_pytorch_kmeans import MultiKMeans

from . import numba_search

_TILE_ELEMS = 1 << 24


def sample_weights(weights: torch.Tensor | None, shape: tuple[int, int], device) -> torch.Tensor:
    """[B, N] float64 weights > 0 (None = unweighted); a zero weight would let a cluster lose
    all its mass, so tiny weights are floored at 1e-6 of the mean."""
    if weights is None:
        return torch.ones(shape, dtype=torch.float64, device=device)
    w = weights.detach().double().clamp_min(0)
    return torch.maximum(w, w.mean(-1, keepdim=True) * 1e-6 + 1e-300)


@torch.no_grad()
def kmeans_pp(X: torch.Tensor, w: torch.Tensor, n_clusters: int, seed: int, engine: str = "auto") -> torch.Tensor:
    """Weighted k-means++ seeds: X [B, N, v] float32, w [B, N] float64 -> [B, K, v] float32.
    Distances are float32 per coordinate, summed in float64 in coordinate order; on the CPU a
    bit-identical numba loop runs it (256 sequential steps of tiny torch ops are slow there)."""
    B, N, v = X.shape
    gen = torch.Generator().manual_seed(seed)
    U = torch.rand(B, n_clusters, generator=gen, dtype=torch.float64)
    if engine == "auto":
        engine = "numba" if X.device.type == "cpu" and numba_search.HAVE_NUMBA else "torch"
    if engine == "numba":
        return numba_search.kmeans_pp(X, w, U, n_clusters).to(X.device)
    U = U.to(X.device)
    C = torch.empty(B, n_clusters, v, dtype=torch.float32, device=X.device)
    rows = torch.arange(B, device=X.device)
    mind = torch.ones(B, N, dtype=torch.float64, device=X.device)
    for k in range(n_clusters):
        cum = torch.cumsum(w * mind, -1)
        tot = cum[:, -1]
        pick = torch.searchsorted(cum, (U[:, k] * tot)[:, None], side="left")[:, 0].clamp_max(N - 1)
        pick = torch.where(tot > 0, pick, torch.zeros_like(pick))  # all points are centroids: repeat one
        C[:, k] = X[rows, pick]
        t = X - C[:, k : k + 1]
        d = torch.zeros(B, N, dtype=torch.float64, device=X.device)
        for i in range(v):
            d += (t[..., i] * t[..., i]).double()
        mind = d if k == 0 else torch.minimum(mind, d)
    return C


class FisherKMeans(MultiKMeans):
    """The GPU engine: weighted Lloyd from given seeds, with fast-pytorch-kmeans' batched search
    (it has no sample weights, so the weighted update is added here)."""

    def __init__(self, n_clusters: int, max_iter: int = 50):
        super().__init__(n_clusters, max_iter=max_iter, tol=0.0, mode="euclidean")

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

    @torch.no_grad()
    def lloyd(self, X: torch.Tensor, w: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        B, N, v = X.shape
        K = self.n_clusters
        C = seeds.clone()
        Xw = X.double() * w[..., None]
        assign = self._assign(X, C)
        for _ in range(self.max_iter):
            num = torch.zeros(B, K, v, dtype=torch.float64, device=X.device).scatter_add_(
                1, assign[..., None].expand(B, N, v), Xw)
            den = torch.zeros(B, K, dtype=torch.float64, device=X.device).scatter_add_(1, assign, w)
            new = torch.where((den > 0)[..., None], (num / den.clamp_min(1e-300)[..., None]).float(), C)
            if torch.equal(new, C):
                break  # nothing moved: converged
            C = new
            assign = self._assign(X, C)
        self.centroids = C
        return C


def weighted_kmeans(X: torch.Tensor, weights: torch.Tensor | None, n_clusters: int, iters: int, seed: int,
                    engine: str = "auto") -> torch.Tensor:
    """X [B, N, v] (B independent problems), weights [B, N] or None -> centroids [B, K, v] float32.
    ``engine``: "auto" (numba on the CPU when installed, else fast-pytorch-kmeans), "numba", "torch"."""
    X = X.float()
    w = sample_weights(weights, X.shape[:2], X.device)
    if engine == "auto":
        engine = "numba" if X.device.type == "cpu" and numba_search.HAVE_NUMBA else "torch"
    seeds = kmeans_pp(X, w, n_clusters, seed, engine)
    if engine == "numba":
        return numba_search.lloyd(X, w, seeds, iters).to(X.device)
    return FisherKMeans(n_clusters, max_iter=iters).lloyd(X, w, seeds)
