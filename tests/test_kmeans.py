"""The one weighted k-means of calibration: seeds shared by both engines, engines agree."""

import pytest
import torch

from vllm_temporalkv.calibration import numba_search
from vllm_temporalkv.calibration.kmeans import kmeans_pp, sample_weights, weighted_kmeans
from vllm_temporalkv.codecs.base import nearest_torch

ENGINES = ["torch"] + (["numba"] if numba_search.HAVE_NUMBA else [])


@pytest.mark.parametrize("engine", ENGINES)
def test_fisher_weights_pull_centroids(engine):
    # two far-apart blobs, one weighted 1000x: with 1 centroid the weighted mean sits on it
    X = torch.cat([torch.zeros(100, 2), torch.full((100, 2), 10.0)])[None]
    w = torch.cat([torch.ones(100), torch.full((100,), 1000.0)])[None]
    c = weighted_kmeans(X, w, 1, 10, 0, engine=engine)
    assert torch.allclose(c[0, 0], torch.full((2,), 10 * 1000 / 1001), atol=1e-3)
    c_unw = weighted_kmeans(X, None, 1, 10, 0, engine=engine)
    assert torch.allclose(c_unw[0, 0], torch.full((2,), 5.0), atol=1e-4)


def _werr(X, w, C):
    a = nearest_torch(X, C)
    err = ((X - torch.gather(C, 1, a[..., None].expand(-1, -1, X.shape[-1]))) ** 2).sum(-1)
    return float((w * err).sum() / w.sum())


def test_weighting_lowers_weighted_error_and_engines_agree():
    """CPU (numba) and GPU (fast-pytorch-kmeans) engines start from the same k-means++ seeds and run
    the same Lloyd updates: on well-separated float32 problems they give the same centroids up to
    float rounding (here: identical, since no distance is a near-tie)."""
    g = torch.Generator().manual_seed(1)
    X = torch.randn(3, 4000, 2, generator=g)
    w = torch.rand(3, 4000, generator=g) ** 4
    got = {e: weighted_kmeans(X, w, 64, 30, 0, engine=e) for e in ENGINES}
    unweighted = weighted_kmeans(X, None, 64, 30, 0)
    for C in got.values():
        assert _werr(X, w, C) < _werr(X, w, unweighted)
    if len(got) == 2:
        assert torch.allclose(got["numba"], got["torch"], atol=1e-5)


def test_seeds_are_weighted_and_deterministic():
    g = torch.Generator().manual_seed(2)
    X = torch.randn(2, 500, 4, generator=g)
    w = sample_weights(torch.zeros(2, 500).index_fill_(1, torch.arange(10), 1.0), (2, 500), "cpu")
    C = kmeans_pp(X, w, 5, seed=3)
    assert torch.equal(C, kmeans_pp(X, w, 5, seed=3))
    assert not torch.equal(C, kmeans_pp(X, w, 5, seed=4))
    # the first seed is drawn by weight alone: from the 10 heavy points (the rest weigh 1e-6 x mean)
    first = (X[:, :, None, :] == C[:, None, :1, :]).all(-1)[..., 0]
    assert first[:, :10].any(-1).all()


@pytest.mark.skipif(not numba_search.HAVE_NUMBA, reason="numba not installed")
def test_seed_engines_bit_identical():
    g = torch.Generator().manual_seed(5)
    X = torch.randn(4, 3000, 4, generator=g)
    X[:, 100:200] = X[:, :100]  # duplicates: zero distances
    w = sample_weights(torch.rand(4, 3000, generator=g) ** 3, (4, 3000), "cpu")
    assert torch.equal(kmeans_pp(X, w, 256, 9, engine="numba"), kmeans_pp(X, w, 256, 9, engine="torch"))
