"""CPU kernels (numba): the codec's nearest-centroid search and Fisher-weighted k-means.

Why: with 2-8 floats per vector and 256 centroids, torch materializes a [N, 256] score matrix per
vector batch and runs at ~0.1 G scores/s on two cores; these fused loops run at 1-2.5 G scores/s,
which is what makes calibration and the quality harness fit on a CPU machine.

``nearest`` follows the codec contract exactly (see codecs/base.py: float32, sequential over the
vector's floats, no fused multiply-add since fastmath is off, ties to the lowest index) and is
tested bit-identical to the torch reference.  ``kmeans`` is Lloyd's algorithm with Hamerly's
bounds (skips points whose assignment provably cannot change) - the same iterates as plain
Lloyd up to float rounding.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba
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
    def _kmeans_one(X, W, C, U, iters, assign):  # pragma: no cover - compiled
        """Weighted k-means++ (uniforms U[K]) then `iters` weighted Lloyd steps, in place on C."""
        N, v = X.shape
        K = C.shape[0]
        # ---- weighted k-means++: next seed ~ w * D^2
        mind = np.empty(N, np.float64)
        cum = np.empty(N, np.float64)
        for k in range(K):
            if k == 0:
                for p in range(N):
                    mind[p] = 1.0
            tot = 0.0
            for p in range(N):
                tot += W[p] * mind[p]
                cum[p] = tot
            if tot <= 0.0:  # every point is already a centroid: repeat one
                pick = 0
            else:
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
    def _kmeans(X, W, C, U, iters, assign):  # pragma: no cover - compiled
        for b in prange(X.shape[0]):
            _kmeans_one(X[b], W[b], C[b], U[b], iters, assign[b])


def nearest(vecs: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Same contract as codecs.base.nearest_torch: [B, N, v], [B, K, v] -> [B, N] int64."""
    X = np.ascontiguousarray(vecs.detach().float().cpu().numpy())
    Ct = np.ascontiguousarray(centroids.detach().float().cpu().transpose(1, 2).numpy())
    out = np.empty(X.shape[:2], dtype=np.int64)
    if X.shape[1]:
        _nearest(X, Ct, out)
    return torch.from_numpy(out)


def kmeans(
    X: torch.Tensor, weights: torch.Tensor | None, n_clusters: int, iters: int, seed: int
) -> torch.Tensor:
    """Weighted k-means++ + Lloyd on B independent problems: X [B, N, v] -> centroids [B, K, v]."""
    B, N, v = X.shape
    Xn = np.ascontiguousarray(X.detach().float().cpu().numpy())
    if weights is None:
        Wn = np.ones((B, N), np.float64)
    else:
        Wn = weights.detach().double().cpu().clamp_min(0).numpy()
        Wn = np.maximum(Wn, Wn.mean(-1, keepdims=True) * 1e-6 + 1e-300)
    gen = torch.Generator().manual_seed(seed)
    U = torch.rand(B, n_clusters, generator=gen, dtype=torch.float64).numpy()
    C = np.zeros((B, n_clusters, v), np.float32)
    assign = np.empty((B, N), np.int64)
    _kmeans(Xn, np.ascontiguousarray(Wn), C, U, iters, assign)
    return torch.from_numpy(C)


def num_threads() -> int:
    return numba.get_num_threads() if HAVE_NUMBA else torch.get_num_threads()
