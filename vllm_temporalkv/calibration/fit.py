"""From one layer's collected K/V and gradients to statistics, codebooks and the hybrid's MSE."""

from __future__ import annotations

import zlib

import torch

from ..codecs import Codec, make_codec
from ..codecs.quantizer import ChannelStats
from ..formats import OUTLIER_QUANTILES, parse_codebook_key
from . import numba_search  # noqa: F401  registers the fast exact search for assign()
from .kmeans import weighted_kmeans


def quantile_rows(x: torch.Tensor, q: float) -> torch.Tensor:
    """Linear-interpolated quantile over dim 0 (torch.quantile refuses > 16M elements)."""
    xs = x.sort(0).values
    pos = q * (x.shape[0] - 1)
    i = int(pos)
    frac = pos - i
    j = min(i + 1, x.shape[0] - 1)
    return xs[i] * (1 - frac) + xs[j] * frac


def channel_stats(x: torch.Tensor) -> ChannelStats:
    """x [N, H, D] raw values -> per-channel mean / std and outlier thresholds."""
    mean = x.mean(0)
    std = x.std(0, unbiased=False).clamp_min(1e-6)
    lo = quantile_rows(x, OUTLIER_QUANTILES[0])
    hi = quantile_rows(x, OUTLIER_QUANTILES[1])
    return ChannelStats(mean, std, lo, hi)


def fit_codebooks(codec: Codec, z: torch.Tensor, fisher: torch.Tensor | None, *, iters: int = 50,
                  seed: int = 0) -> Codec:
    """Fisher-weighted k-means (k-means++ init) of the normalized samples ``z`` [T, H, D]; sets and
    returns ``codec``'s centroids (rounded to half precision, as they are stored and served)."""
    vecs = codec.to_vectors(z.float())
    H, G, N, v = vecs.shape
    X = vecs.reshape(H * G, N, v)
    w = None if fisher is None else codec.vector_weights(fisher.float()).reshape(H * G, N)
    C = weighted_kmeans(X, w, codec.n_centroids, iters, seed)
    codec.centroids = C.reshape(H, G, codec.n_centroids, v).half().float()
    return codec


def fisher_error(codec: Codec, z: torch.Tensor, fisher: torch.Tensor | None) -> tuple[float, float]:
    """(mse, cost) of quantizing z [T, H, D]: the mean (Fisher-weighted) squared error, which picks the hybrid's
    chunking, and the diagonal-Fisher estimate of the LM loss increase, 1/2 sum g^2 (z - z_hat)^2 per token (nats;
    g = d loss / d z), which compares layers and chunk lengths (the mixed formats' budget)."""
    # element-wise: comparable across chunkings
    vecs = codec.to_vectors(z.float())
    err = (codec.lookup(codec.assign(z)) - vecs) ** 2  # [H, G, N, v]
    if fisher is None:
        return float(err.mean()), float("nan")
    f = codec.to_vectors(fisher.float())
    total = float((f * err).sum())
    return total / float(f.sum()), 0.5 * total / z.shape[0]


def _seed(base: int, layer: int, kv: str, key: str) -> int:
    return (base * 1_000_003 + zlib.crc32(f"{layer}.{kv}.{key}".encode())) % (2**31)


def fit_layer(
    layer: int,
    acts: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    keys: list[str],
    *,
    iters: int,
    seed: int,
    fisher: bool = True,
    on_fit=None,
) -> tuple[dict, dict, dict]:
    """-> (stats {kv: ChannelStats}, codebooks {(kv, key): [H,G,K,v]}, mse {(kv, key): (mse, cost)}) (fisher_error)."""
    stats, books, mse = {}, {}, {}
    for kv in "kv":
        x = acts[kv]
        s = channel_stats(x)
        stats[kv] = s
        z = (x - s.mean) * s.inv_std
        # Fisher weights in normalized space: d loss / d z = std * d loss / d x
        f = (grads[kv] * s.std) ** 2 if fisher else None
        for key in keys:
            method, chunk, k = parse_codebook_key(key)
            codec = fit_codebooks(make_codec(method, chunk, k), z, f, iters=iters, seed=_seed(seed, layer, kv, key))
            books[(kv, key)] = codec.centroids.half()
            # always Fisher-weighted when we have gradients: this is what the hybrid compares
            mse[(kv, key)] = fisher_error(codec, z, (grads[kv] * s.std) ** 2)
            if on_fit is not None:
                on_fit()
    return stats, books, mse
