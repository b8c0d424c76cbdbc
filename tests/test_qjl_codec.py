"""The QJL reference (codecs/qjl.py) against the paper's equations written out here independently:
estimator (Def. 3.1 eq. 4 + the official code's outlier split), unbiasedness, m-scaling, the
orthogonalized S, outlier selection, the value quantizer, the bit accounting and the recent mask."""

import math

import pytest
import torch

from vllm_temporalkv.codecs import qjl

torch.set_num_threads(1)


def _keys(T=32, H=2, D=16, seed=0, loud=((0, 0, 3), (1, 1, 9))):
    """Random keys with a few loud channels: (group of 16 tokens, head, channel) x6."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=g)
    for grp, h, c in loud:
        k[grp * 16 : (grp + 1) * 16, h, c] *= 6
    return k


def _top_channels(k_group_head, n):
    """Independent outlier rule: channels by L2 norm over the group's tokens, descending, ties low."""
    D = len(k_group_head[0])
    norms = [math.sqrt(sum(row[c] ** 2 for row in k_group_head)) for c in range(D)]
    return sorted(range(D), key=lambda c: (-norms[c], c))[:n]


def _prod_qjl(q, k, S):
    """Def. 3.1 eq. 4, literally: sqrt(pi/2)/m * ||k|| * sum_i (Sq)_i * sign((Sk)_i), sign(0) = -1."""
    m, d = len(S), len(q)
    total = 0.0
    for i in range(m):
        sq = sum(S[i][c] * q[c] for c in range(d))
        sk = sum(S[i][c] * k[c] for c in range(d))
        total += sq * (1.0 if sk > 0 else -1.0)
    return math.sqrt(math.pi / 2) / m * math.sqrt(sum(x * x for x in k)) * total


@pytest.mark.parametrize("n_out,m_o", [(0, 0), (2, 16)])
def test_logits_match_direct_transcription(n_out, m_o):
    T, H, Hq, D, m, G = 32, 2, 4, 16, 32, 16
    k = _keys(T, H, D)
    q = torch.randn(2, Hq, D, generator=torch.Generator().manual_seed(1))
    S = qjl.sketch_matrix(D, m, seed=3)
    enc = qjl.encode_keys(k, S, m_outlier=m_o, n_outliers=n_out, group_size=G)
    got = qjl.attention_logits(q, enc, S, scale=1.0)
    assert got.shape == (2, Hq, T) and got.dtype == torch.float32
    assert torch.allclose(qjl.attention_logits(q, enc, S), got / math.sqrt(D))  # default scale 1/sqrt(D)

    S64, k64, q64 = S.double().tolist(), k.double().tolist(), q.double().tolist()
    ref = torch.zeros(2, Hq, T, dtype=torch.float64)
    for t in range(T):
        for hq in range(Hq):
            h = hq // (Hq // H)  # GQA: contiguous query-head groups share a KV head
            grp = [k64[s][h] for s in range(t // G * G, t // G * G + G)]
            out = set(_top_channels(grp, n_out))
            kin = [0.0 if c in out else x for c, x in enumerate(k64[t][h])]
            kout = [x if c in out else 0.0 for c, x in enumerate(k64[t][h])]
            for tq in range(2):
                qin = [0.0 if c in out else x for c, x in enumerate(q64[tq][hq])]
                qout = [x if c in out else 0.0 for c, x in enumerate(q64[tq][hq])]
                ref[tq, hq, t] = _prod_qjl(qin, kin, S64)  # inliers: all m rows of S
                if n_out:
                    ref[tq, hq, t] += _prod_qjl(qout, kout, S64[:m_o])  # outliers: first m_o rows
    assert torch.allclose(got.double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=0)


def test_sign_bits_are_packed_little_endian_and_norms_keep_the_model_dtype():
    k = _keys().to(torch.bfloat16)
    S = qjl.sketch_matrix(16, 32, seed=0)
    enc = qjl.encode_keys(k, S, n_outliers=2, group_size=16)
    assert enc.bits.shape == (32, 2, 4) and enc.bits.dtype == torch.uint8 and enc.outlier_bits.shape == (32, 2, 4)
    assert enc.norm.dtype == enc.outlier_norm.dtype == torch.bfloat16 and S.dtype == torch.float32
    out = qjl.outlier_mask(enc.outlier_idx, 16, 16)
    t, h = 5, 1
    proj = (k[t, h].double().masked_fill(out[t, h], 0) @ S.double().t()).tolist()  # the float64 contract
    for byte in range(4):
        assert enc.bits[t, h, byte].item() == sum(2**j for j in range(8) if proj[8 * byte + j] > 0)
    assert torch.equal(qjl.unpack_signs(enc.bits[t, h]), torch.tensor([1.0 if p > 0 else -1.0 for p in proj]))


def _mean_estimate(q, k, D, m, orthogonal, n, m_o=0, n_out=0):
    """Estimates of <q, k_t> for n independent sketches (seeds 0..n-1) -> [n, T] float64."""
    rows = []
    for seed in range(n):
        S = qjl.sketch_matrix(D, m, seed=seed, orthogonal=orthogonal)
        enc = qjl.encode_keys(k, S, m_outlier=m_o, n_outliers=n_out, group_size=k.shape[0])
        rows.append(qjl.attention_logits(q, enc, S, scale=1.0)[0, 0].double())
    return torch.stack(rows)


def test_gaussian_sketch_is_unbiased_with_outliers():
    """Lemma 3.2 for the paper's Gaussian S, inlier + outlier parts.  Per part, Var of one row's
    estimate is (pi/2)||q||^2||k||^2 - <q,k>^2 (Def. 3.1), divided by m; the parts share rows, so
    their std's add (Cauchy-Schwarz).  Bound: 5 std of the mean over N sketches."""
    D, m, m_o, N = 16, 32, 16, 2000
    g = torch.Generator().manual_seed(7)
    k = torch.randn(8, 1, D, generator=g)
    k[:, :, [3, 7]] *= 8  # two outlier channels
    q = (k[0] + 0.5 * torch.randn(1, D, generator=g))[None]  # scores of both signs and sizes
    est = _mean_estimate(q, k, D, m, False, N, m_o=m_o, n_out=2)
    enc = qjl.encode_keys(k, qjl.sketch_matrix(D, m), m_outlier=m_o, n_outliers=2, group_size=8)
    assert sorted(enc.outlier_idx[0, 0].tolist()) == [3, 7]
    out = torch.zeros(D, dtype=torch.bool)
    out[[3, 7]] = True
    qd, kd = q[0, 0].double(), k[:, 0].double()
    exact = kd @ qd

    def sd(mask, rows):
        qq, kk = qd * mask, kd * mask
        return ((math.pi / 2 * (qq @ qq) * (kk * kk).sum(-1) - (kk @ qq) ** 2) / rows).sqrt()

    bound = 5 * (sd(~out, m) + sd(out, m_o)) / math.sqrt(N)
    err = (est.mean(0) - exact).abs()
    assert (err < bound).all(), (err, bound)
    assert bound.max() < 0.05 * exact.abs().max()  # tight enough that a wrong constant would fail


@pytest.mark.parametrize("orthogonal", [False, True])
def test_mean_is_exact_for_gaussian_rows_and_c_d_times_exact_for_orthogonal_rows(orthogonal):
    """Rows of norm sqrt(D) instead of chi_D scale the mean by c_D = sqrt(D)/E[chi_D]; at D=4 that is
    6.4%, far outside the bound, so this test tells the two constructions apart."""
    D, N = 4, 4000
    g = torch.Generator().manual_seed(11)
    k = torch.randn(4, 1, D, generator=g)
    q = (k[0] + 0.3 * torch.randn(1, D, generator=g))[None]
    est = _mean_estimate(q, k, D, 2 * D, orthogonal, N)  # two orthogonal blocks of D rows
    exact = k[:, 0].double() @ q[0, 0].double()
    c_d = math.sqrt(D) * math.gamma(D / 2) / (math.sqrt(2) * math.gamma((D + 1) / 2))
    bound = 5 * est.std(0) / math.sqrt(N)
    assert ((est.mean(0) - (c_d if orthogonal else 1.0) * exact).abs() < bound).all()
    assert ((c_d - 1) * exact.abs() > 2 * bound).any()


def test_error_shrinks_as_m_grows():
    D, T = 32, 64
    g = torch.Generator().manual_seed(5)
    k, q = torch.randn(T, 1, D, generator=g), torch.randn(1, 1, D, generator=g)
    exact = k[:, 0] @ q[0, 0]
    rms = []
    for m in (32, 128, 512):
        errs = [qjl.attention_logits(q, qjl.encode_keys(k, S, n_outliers=0), S, scale=1.0)[0, 0] - exact
                for S in (qjl.sketch_matrix(D, m, seed=s) for s in range(8))]
        rms.append(torch.stack(errs).pow(2).mean().sqrt().item())
    assert rms[0] > rms[1] > rms[2]
    assert 0.1 < rms[2] / rms[0] < 0.4  # ~ 1/sqrt(16) = 0.25 (Thm 3.6: m ~ 1/eps^2)


def test_sketch_rows_orthogonal_within_blocks_as_in_the_official_code():
    D, m = 8, 20  # blocks of rows 0-7, 8-15 and a partial 16-19
    S = qjl.sketch_matrix(D, m, seed=4)
    assert S.shape == (m, D) and S.dtype == torch.float32
    for a, b in ((0, 8), (8, 16), (16, 20)):
        assert torch.allclose(S[a:b] @ S[a:b].t(), D * torch.eye(b - a), atol=1e-4)
    assert (S[0:8] @ S[8:16].t()).abs().max() > 0.5  # blocks are independent, not mutually orthogonal
    # the official construction, written out: proj [D, m] ~ randn, QR per D-column chunk, * sqrt(D), S = proj^T
    proj = torch.randn(D, m, generator=torch.Generator().manual_seed(4))
    ref = torch.cat([torch.linalg.qr(proj[:, s : s + D]).Q for s in (0, 8, 16)], 1) * math.sqrt(D)
    assert torch.allclose(S, ref.t(), atol=1e-6)
    assert torch.equal(S, qjl.sketch_matrix(D, m, seed=4)) and not torch.equal(S, qjl.sketch_matrix(D, m, seed=5))
    assert torch.equal(qjl.sketch_matrix(D, m, seed=4, orthogonal=False), proj.t())


def test_pack_bit_order_every_byte():
    """_pack: bit j of byte i is entry 8i+j, for every one of the 256 byte patterns, in any leading shape and from a
    view at an odd offset; unpack_signs inverts it."""
    pats = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]: pattern p's bits
    want = torch.arange(256).to(torch.uint8)[:, None]  # [256, 1]: one byte each
    assert torch.equal(qjl._pack(pats), want)
    x = pats[torch.randperm(256, generator=torch.Generator().manual_seed(0))].reshape(4, 8, 64)
    ref = (x.reshape(4, 8, 8, 8).to(torch.uint8) * (2 ** torch.arange(8)).to(torch.uint8)).sum(-1, dtype=torch.uint8)
    assert torch.equal(qjl._pack(x), ref)
    odd = torch.cat([torch.zeros(3, dtype=torch.bool), x.flatten()])[3:].view(4, 8, 64)  # storage offset 3
    assert odd.storage_offset() == 3 and torch.equal(qjl._pack(odd), ref)
    assert torch.equal(qjl.unpack_signs(qjl._pack(x)) > 0, x)


def test_outlier_channels_top_l2_per_head_and_token_group():
    T, H, D = 64, 2, 8
    k = torch.full((T, H, D), 0.01)
    k[3, 0, 5] = 10.0  # one spike: L2 10, largest |x|
    k[:32, 0, 2] = 2.0  # steady: L2 2*sqrt(32) = 11.3
    k[:32, 0, 6] = 1.5  # steady: L2 8.5, larger mean |x| than the spike
    k[32:, 0, 0] = 3.0  # the second group has its own outliers
    k[:, 1] = 0.0  # all ties: lowest channels first
    idx = qjl.select_outlier_channels(k, n_outliers=3, group_size=32)
    assert idx.dtype == torch.uint8 and idx.shape == (2, H, 3)
    assert idx[0, 0].tolist() == [2, 5, 6]  # L2, not max |x| ([5, 2, 6]) nor mean |x| ([2, 6, 5])
    assert idx[1, 0, 0].item() == 0 and idx[0, 1].tolist() == [0, 1, 2]
    big = torch.randn(96, 2, 128, generator=torch.Generator().manual_seed(0))
    assert qjl.select_outlier_channels(big).shape == (3, 2, 8)  # defaults [C]: 8 channels per 32 tokens
    with pytest.raises(ValueError):
        qjl.select_outlier_channels(big[:40])


def _kivi_ref(x, bits, G):
    """Per token and G channels: scale = (max-min)/(2^b-1), code = clamp(round((x-min)/scale)),
    x^ = code*scale + min."""
    T, H, D = x.shape
    codes, rec = torch.zeros(T, H, D, dtype=torch.uint8), torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            for g0 in range(0, D, G):
                grp = x[t, h, g0 : g0 + G].double().tolist()
                mn, mx = min(grp), max(grp)
                scale = (mx - mn) / (2**bits - 1)
                for i, v in enumerate(grp):
                    c = 0 if scale == 0 else min(max(round((v - mn) / scale), 0), 2**bits - 1)
                    codes[t, h, g0 + i], rec[t, h, g0 + i] = c, c * scale + mn
    return codes, rec


@pytest.mark.parametrize("bits", [2, 3])
def test_value_quantizer_matches_its_equation(bits):
    v = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(2)) * 3
    v[1, 0, :32] = 0.75  # constant group: scale 0, decodes exactly, no NaN
    enc = qjl.encode_values(v, bits=bits)
    codes, rec = _kivi_ref(v, bits, 32)
    assert enc.scale.shape == enc.zero.shape == (4, 2, 2) and enc.scale.dtype == torch.float32
    assert torch.equal(enc.codes, codes)
    out = qjl.roundtrip_values(v, bits=bits)
    assert torch.allclose(out.double(), rec, atol=1e-5) and torch.equal(out[1, 0, :32], v[1, 0, :32])
    err = (out - v).abs().reshape(4, 2, 2, 32).amax(-1)
    assert (err <= enc.scale / 2 + 1e-5).all()


def test_value_quantizer_bf16_stores_scale_and_min_in_the_model_dtype():
    v = (torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    v[2, 1, 32:] = -1.25
    enc = qjl.encode_values(v)
    assert enc.scale.dtype == enc.zero.dtype == torch.bfloat16
    x = v.float().reshape(8, 2, 2, 32)
    assert torch.equal(enc.zero.float(), x.amin(-1))  # the min of bf16 data is exact in bf16
    s = enc.scale.float()[..., None]
    want = torch.where(s > 0, ((x - enc.zero.float()[..., None]) / s.clamp_min(1e-30)).round().clamp(0, 3), 0)
    assert torch.equal(enc.codes.reshape(8, 2, 2, 32).float(), want)  # codes against the stored scale
    out = qjl.decode_values(enc)
    assert out.dtype == torch.bfloat16 and torch.equal(out[2, 1, 32:], v[2, 1, 32:])
    s_exact = (x.amax(-1) - x.amin(-1)) / 3
    slack = s_exact / 2 + 3 * (s_exact - enc.scale.float()).abs() + x.abs().amax(-1) * 2**-8
    assert ((out.float() - v.float()).abs().reshape(8, 2, 2, 32).amax(-1) <= slack + 1e-6).all()


def test_bits_per_float_by_hand():
    # D=128, [C] defaults: keys 256 + 16 (||k||) + 256 + 16 (||k_out||) + 8*8/32 (uint8 indices) = 546
    # values 2*128 + 2*16*128/32 (fp16 scale + min per 32) = 384
    assert qjl.bits_per_float(128) == (546 / 128, 3.0, (546 + 384) / 256)
    assert round(qjl.bits_per_float(128).k, 2) == 4.27  # notes [D]: "~4.27 bits/FPN", values 3
    first = qjl.bits_per_float(128, *qjl.default_sketch_dims(128, layer=0))  # m=512, m_o=128
    assert first.k == (512 + 16 + 128 + 16 + 2) / 128 and round(first.k, 2) == 5.27  # notes: ~5.27
    assert qjl.bits_per_float(128, m=128, n_outliers=0).mean == (128 + 16 + 256 + 128) / 256  # notes: 2.06
    # D=64 [I]: m = m_o = 128: 128 + 16 + 128 + 16 + 2 = 290; values 128 + 64 = 192
    assert qjl.bits_per_float(64) == (290 / 64, 3.0, (290 + 192) / 128)
    assert qjl.bits_per_float(64, *qjl.default_sketch_dims(64, layer=3)).k == (256 + 16 + 64 + 16 + 2) / 64
    assert qjl.default_sketch_dims(128, layer=15) == (256, 256) and qjl.default_sketch_dims(128, 14) == (512, 128)


def test_recent_mask_sliding_for_values_and_block_flush_for_keys():
    m = qjl.qjl_recent_mask(300)  # window 128 [C]
    assert m.dtype == torch.bool and m.shape == (300,) and m[:172].all() and not m[172:].any()
    mb = qjl.qjl_recent_mask(300, block=True)
    assert mb[:256].all() and not mb[256:].any()
    assert not qjl.qjl_recent_mask(100).any() and not qjl.qjl_recent_mask(100, block=True).any()
    assert qjl.qjl_recent_mask(256, block=True).all() and qjl.qjl_recent_mask(256).sum() == 128
    assert qjl.qjl_recent_mask(10, window=0).all()
