"""Properties of the reference codecs: vectors, argmin, lookup, shapes/bits, k-means, outliers."""

import pytest
import torch

from vllm_temporalkv.codecs import make_codec
from vllm_temporalkv.codecs.base import exact_sq_dist, nearest, nearest_torch
from vllm_temporalkv.codecs.outliers import merge_outliers, split_outliers
from vllm_temporalkv.codecs.quantizer import ChannelStats, KVQuantizer
from vllm_temporalkv.formats import BLOCK_TOKENS, FORMATS, SINK_TOKENS, calibrated_formats, get_format, outlier_cap
from vllm_temporalkv.calibration import numba_search as cpu
from vllm_temporalkv.calibration.fit import fit_codebooks

ALL = [(f.method, f.chunk, f.n_centroids) for f in FORMATS.values() if f.needs_calibration and not f.kv]


def data(T=64, H=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    slow = torch.cumsum(torch.randn(T, H, D, generator=g) * 0.3, 0)
    return slow + 0.5 * torch.randn(T, H, D, generator=g)


@pytest.mark.parametrize("method,chunk,k", ALL)
def test_vectors_roundtrip_and_code_layout(method, chunk, k):
    x = data()
    c = make_codec(method, chunk, k)
    v = c.to_vectors(x)
    assert v.shape[-1] == c.vec_dim and v.shape[1] == c.num_groups(16)
    assert torch.equal(c.from_vectors(v, x.shape[0]), x)
    a = torch.randint(0, k, v.shape[:3])
    assert torch.equal(c.assign_layout(c.codes_layout(a, x.shape[0])), a)


def test_temporal_vector_is_consecutive_tokens_of_one_channel():
    x = data()
    c = make_codec("temporal", 4, 256)
    v = c.to_vectors(x)  # [H, G, N, 4]
    # group g holds channels 4g..4g+3; vector n = (token chunk n // 4, channel 4g + n % 4)
    h, g, n = 1, 2, 13
    j, ch = divmod(n, 4)
    assert torch.equal(v[h, g, n], x[4 * j : 4 * j + 4, h, 4 * g + ch])


def test_channel_vector_is_adjacent_channels_of_one_token():
    x = data()
    v = make_codec("channel", 4, 256).to_vectors(x)
    assert torch.equal(v[1, 3, 10], x[10, 1, 12:16])


@pytest.mark.parametrize("method,chunk,k", ALL)
def test_code_is_true_argmin_and_decode_is_lookup(method, chunk, k):
    x = data()
    c = fit_codebooks(make_codec(method, chunk, k), x, torch.rand_like(x), iters=5)
    codes = c.encode(x)
    assert codes.dtype == torch.uint8
    vecs = c.to_vectors(x)
    H, G, N, v = vecs.shape
    C = c.centroids
    d = exact_sq_dist(vecs[:, :, :, None, :], C[:, :, None, :, :])  # [H, G, N, K]
    best = d.min(-1, keepdim=True).values
    a = c.assign_layout(codes).long()
    assert torch.equal(torch.gather(d, 3, a[..., None]), best)  # distance of the code = min
    # ties go to the lowest index
    first = (d == best).float().argmax(-1)
    assert torch.equal(a, first)
    dec = c.decode(codes, x.shape[0])
    lookup = torch.stack([C[h, g][a[h, g]] for h in range(H) for g in range(G)]).reshape(H, G, N, v)
    assert torch.equal(c.to_vectors(dec), lookup)


@pytest.mark.parametrize("fmt", calibrated_formats())
def test_shapes_and_bits(fmt):
    f = get_format(fmt)
    T, H, D = 32, 3, 64
    c = make_codec(f.method, f.chunk, f.n_centroids)
    assert c.codebook_shape(H, D)[2] == f.n_centroids
    c.centroids = torch.randn(c.codebook_shape(H, D))
    codes = c.encode(data(T, H, D))
    # bits actually needed by the codes = nominal bits per float
    assert codes.numel() * f.code_layout.code_bits == f.nominal_bits * T * H * D
    assert int(codes.max()) < f.n_centroids
    # centroid storage matches ChannelKV's for the vector methods (thesis Table 13)
    if f.method != "scalar":
        assert torch.Size(c.codebook_shape(H, D)).numel() == H * 256 * D


def test_ties_go_to_lowest_index():
    C = torch.tensor([[[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]])  # duplicates
    C = torch.cat([C, torch.randn(1, 252, 2) + 10], 1)
    u = torch.tensor([[[0.0, 0.0], [1.0, 1.0], [0.5, 0.5]]])
    for fn in (nearest, nearest_torch):
        assert fn(u, C).tolist() == [[0, 1, 0]]


@pytest.mark.skipif(not cpu.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("v,K", [(1, 16), (1, 2), (2, 256), (4, 256), (8, 256)])
def test_cpu_kernel_bit_identical_to_torch_reference(v, K):
    g = torch.Generator().manual_seed(v * 1000 + K)
    X = torch.randn(5, 3000, v, generator=g)
    C = torch.randn(5, K, v, generator=g).half().float()
    C[:, K // 2] = C[:, 0]  # exact duplicates: tie-breaking
    X[:, :50] = C[:, :50] if K >= 50 else X[:, :50]  # points sitting on centroids
    X[:, 50:100] = torch.nextafter(X[:, 50:100], torch.tensor(1e9))  # 1-ulp neighbours
    assert torch.equal(cpu.nearest(X, C), nearest_torch(X, C))


def _stats(x):
    return ChannelStats(x.mean(0), x.std(0), torch.quantile(x, 0.005, 0), torch.quantile(x, 0.995, 0))


def test_outliers_capped_exact_and_clamped():
    T, H, D = 64, 2, 64
    x = data(T, H, D)
    x[9, 0, 5] = 1e3  # a huge outlier
    s = _stats(data(T, H, D, seed=1))
    cap = outlier_cap(D)
    assert cap == 5 and cap <= 0.01 * BLOCK_TOKENS * D
    xc, idx, val = split_outliers(x, s.lo, s.hi, s.inv_std, cap)
    assert idx.shape == (T // BLOCK_TOKENS, H, cap)
    assert (xc >= s.lo).all() and (xc <= s.hi).all()
    # the huge one is first in its block (block 1, head 0, flat index 1*D + 5)
    assert idx[1, 0, 0] == 1 * D + 5 and val[1, 0, 0] == 1e3
    back = merge_outliers(xc, idx, val)
    kept = back != xc
    assert kept.sum() <= cap * (T // BLOCK_TOKENS) * H
    assert torch.equal(back[kept], x[kept])


@pytest.mark.parametrize("outliers", [False, True])
def test_quantizer_keeps_sinks_and_tail_exact(outliers):
    T, H, D = 8 + 3 * BLOCK_TOKENS + 5, 2, 16
    x = data(T, H, D).to(torch.bfloat16)
    c = fit_codebooks(make_codec("temporal", 4, 256), data(256, H, D), None, iters=3)
    q = KVQuantizer(c, _stats(data(256, H, D).float()), outliers=outliers)
    y = q.fake_quant(x)
    assert y.dtype == x.dtype
    assert torch.equal(y[:SINK_TOKENS], x[:SINK_TOKENS])
    assert torch.equal(y[-5:], x[-5:])
    assert not torch.equal(y[SINK_TOKENS:-5], x[SINK_TOKENS:-5])
    enc = q.encode(x[SINK_TOKENS:-5])
    assert (enc.outlier_idx is not None) == outliers
    assert torch.equal(q.decode(enc, 3 * BLOCK_TOKENS, x.dtype), y[SINK_TOKENS:-5])
