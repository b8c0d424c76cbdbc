"""Calibration on the CPU (numba): the codec's nearest-centroid search and the Lloyd engine of the
weighted k-means (``kmeans.weighted_kmeans`` seeds it; the GPU engine is fast-pytorch-kmeans).

Why: with 2-8 floats per vector and 256 centroids, torch materializes a [N, 256] score matrix per
vector batch and runs at ~0.1 G scores/s on two cores; these fused loops run at 1-2.5 G scores/s,
which is what makes calibration and the quality harness fit on a CPU machine.

``nearest`` follows the codec contract exactly (see codecs/base.py: float32, sequential over the
vector's floats, no fused multiply-add since fastmath is off, ties to the lowest index) and is
tested bit-identical to the torch reference.  ``lloyd`` is Lloyd's algorithm with Hamerly's
bounds (skips points whose assignment provably cannot change) - the same iterates as plain
Lloyd up to float rounding.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba  # noqa: F401
    from numba import njit, prange

    HAVE_NUMBA = True
except ImportError:  # the torch paths still work, just slower
    HAVE_NUMBA = False

_CH = 256  # points per parallel job


if HAVE_NUMBA:

    @njit(parallel=True, fastmath=False, cache=True)
    def _nearest(X, Ct, out):  # pragma: no cover - compiled
        B, N, v = X.shape
        K = Ct.shape[2]
        nch = (N + _CH - 1) // _CH
        for job in prange(B * nch):
            b = job // nch
            s = (job % nch) * _CH
            e = min(N, s + _CH)
            dist = np.empty(K, np.float32)
            for n in range(s, e):
                x0 = X[b, n, 0]
                for k in range(K):
                    t = x0 - Ct[b, 0, k]
                    dist[k] = t * t
                for i in range(1, v):
                    xi = X[b, n, i]
                    for k in range(K):
                        t = xi - Ct[b, i, k]
                        dist[k] = dist[k] + t * t
                best = dist[0]
                bi = 0
                for k in range(1, K):
                    if dist[k] < best:
                        best = dist[k]
                        bi = k
                out[b, n] = bi

    @njit(fastmath=False, cache=True)
    def _scan(x, Ct, dist):  # pragma: no cover - compiled
        """Full scan of one point: (best index, best distance, second-best distance), squared."""
        v, K = Ct.shape
        for k in range(K):
            t = x[0] - Ct[0, k]
            dist[k] = t * t
        for i in range(1, v):
            for k in range(K):
                t = x[i] - Ct[i, k]
                dist[k] = dist[k] + t * t
        b1 = np.inf
        b2 = np.inf
        bi = 0
        for k in range(K):
            d = dist[k]
            if d < b1:
                b2 = b1
                b1 = d
                bi = k
            elif d < b2:
                b2 = d
        return bi, b1, b2

    @njit(fastmath=False, cache=True)
    def _kpp_one(X, W, C, U):  # pragma: no cover - compiled
        """Weighted k-means++ seeds (next seed ~ w * D^2, drawn with the uniforms U[K]) into C."""
        N, v = X.shape
        K = C.shape[0]
        mind = np.ones(N, np.float64)
        cum = np.empty(N, np.float64)
        for k in range(K):
            tot = 0.0
            for p in range(N):
                tot += W[p] * mind[p]
                cum[p] = tot
            pick = 0
            if tot > 0.0:  # else every point is already a centroid: repeat one
                r = U[k] * tot
                lo = 0
                hi = N - 1
                while lo < hi:
                    mid = (lo + hi) // 2
                    if cum[mid] < r:
                        lo = mid + 1
                    else:
                        hi = mid
                pick = lo
            for i in range(v):
                C[k, i] = X[pick, i]
            for p in range(N):
                d = 0.0
                for i in range(v):
                    t = X[p, i] - C[k, i]
                    d += t * t
                if k == 0 or d < mind[p]:
                    mind[p] = d

    @njit(parallel=True, fastmath=False, cache=True)
    def _kpp(X, W, C, U):  # pragma: no cover - compiled
        for b in prange(X.shape[0]):
            _kpp_one(X[b], W[b], C[b], U[b])

    @njit(fastmath=False, cache=True)
    def _lloyd_one(X, W, C, iters, assign):  # pragma: no cover - compiled
        """`iters` weighted Lloyd steps from the seeds in C, in place."""
        N, v = X.shape
        K = C.shape[0]
        # ---- Lloyd with Hamerly bounds (distances, not squared, for the triangle inequality)
        Ct = np.ascontiguousarray(C.T)
        dist = np.empty(K, np.float32)
        upper = np.empty(N, np.float64)
        lower = np.empty(N, np.float64)
        for p in range(N):
            bi, b1, b2 = _scan(X[p], Ct, dist)
            assign[p] = bi
            upper[p] = np.sqrt(b1)
            lower[p] = np.sqrt(b2)
        sums = np.empty((K, v), np.float64)
        wsum = np.empty(K, np.float64)
        shift = np.empty(K, np.float64)
        for it in range(iters):
            sums[:] = 0.0
            wsum[:] = 0.0
            for p in range(N):
                a = assign[p]
                wsum[a] += W[p]
                for i in range(v):
                    sums[a, i] += W[p] * X[p, i]
            m1 = 0.0
            m2 = 0.0
            k1 = -1
            for k in range(K):
                s = 0.0
                if wsum[k] > 0.0:
                    for i in range(v):
                        nc = np.float32(sums[k, i] / wsum[k])
                        t = nc - C[k, i]
                        s += t * t
                        C[k, i] = nc
                shift[k] = np.sqrt(s)
                if shift[k] > m1:
                    m2 = m1
                    m1 = shift[k]
                    k1 = k
                elif shift[k] > m2:
                    m2 = shift[k]
            if m1 == 0.0:
                break  # nothing moved: converged
            for k in range(K):
                for i in range(v):
                    Ct[i, k] = C[k, i]
            for p in range(N):
                a = assign[p]
                upper[p] += shift[a]
                lower[p] -= m2 if a == k1 else m1
                if upper[p] <= lower[p]:
                    continue
                d = 0.0
                for i in range(v):
                    t = X[p, i] - C[a, i]
                    d += t * t
                upper[p] = np.sqrt(d)
                if upper[p] <= lower[p]:
                    continue
                bi, b1, b2 = _scan(X[p], Ct, dist)
                assign[p] = bi
                upper[p] = np.sqrt(b1)
                lower[p] = np.sqrt(b2)

    @njit(parallel=True, fastmath=False, cache=True)
    def _lloyd(X, W, C, iters, assign):  # pragma: no cover - compiled
        for b in prange(X.shape[0]):
            _lloyd_one(X[b], W[b], C[b], iters, assign[b])


def nearest(vecs: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Same contract as codecs.base.nearest_torch: [B, N, v], [B, K, v] -> [B, N] int64."""
    X = np.ascontiguousarray(vecs.detach().float().cpu().numpy())
    Ct = np.ascontiguousarray(centroids.detach().float().cpu().transpose(1, 2).numpy())
    out = np.empty(X.shape[:2], dtype=np.int64)
    if X.shape[1]:
        _nearest(X, Ct, out)
    return torch.from_numpy(out)


def kmeans_pp(X: torch.Tensor, weights: torch.Tensor, uniforms: torch.Tensor, n_clusters: int) -> torch.Tensor:
    """The CPU engine of ``kmeans.kmeans_pp`` (bit-identical): X [B, N, v], weights [B, N] float64,
    uniforms [B, K] float64 -> seeds [B, K, v] float32."""
    Xn = np.ascontiguousarray(X.detach().float().cpu().numpy())
    Wn = np.ascontiguousarray(weights.detach().double().cpu().numpy())
    Un = np.ascontiguousarray(uniforms.detach().double().cpu().numpy())
    C = np.zeros((X.shape[0], n_clusters, X.shape[2]), np.float32)
    _kpp(Xn, Wn, C, Un)
    return torch.from_numpy(C)


def lloyd(X: torch.Tensor, weights: torch.Tensor, seeds: torch.Tensor, iters: int) -> torch.Tensor:
    """Weighted Lloyd on B independent problems from the given seeds (``kmeans.weighted_kmeans``
    is the algorithm; this is its CPU engine): X [B, N, v], weights [B, N] float64 (> 0),
    seeds [B, K, v] -> centroids [B, K, v] float32."""
    Xn = np.ascontiguousarray(X.detach().float().cpu().numpy())
    Wn = np.ascontiguousarray(weights.detach().double().cpu().numpy())
    C = np.ascontiguousarray(seeds.detach().float().cpu().numpy()).copy()
    assign = np.empty(X.shape[:2], np.int64)
    _lloyd(Xn, Wn, C, iters, assign)
    return torch.from_numpy(C)


if HAVE_NUMBA:  # calibration and the quality harness encode through the codecs: give them this search
    from ..codecs.base import register_nearest

    register_nearest("cpu", nearest)
