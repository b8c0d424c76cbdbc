"""Selective KV quantization (seed 003) and TaDA (seed 004) against direct float64 transcriptions of
the papers' equations, plus their masks, bit counts and TaDA's per-layer bit search.

Inputs are random but dyadic (k / 32, |x| < 8, plus edge tokens): every such value is exact in bf16
and float32, and sums over heads are exact, so the float32 codecs and the float64 transcriptions
must agree bit for bit."""

import itertools
import math
import random

import pytest
import torch

from tests.helpers import bench_call
from vllm_temporalkv.codecs.selective import SelectiveCodec, selective_mask
from vllm_temporalkv.codecs.tada import (
    TadaCodec,
    bits_per_float,
    budget_bits_from_fraction,
    search_layer_bits,
    tada_mask,
)

torch.set_num_threads(1)

FP16_TINY = 2.0**-24  # the eps / scale floor both modules document


def dyadic(T=12, H=4, D=64, seed=0, dtype=torch.float32):
    """Random k/32 values; token 0 all zero, token 1 has one huge value in head 0, token 2 is
    all zero in head 1 only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-255, 256, (T, H, D), generator=g).double() / 32
    x[0] = 0
    x[1, 0, 3] = 1024.0
    x[2, 1] = 0
    return x.to(dtype)


def f16(v: float) -> float:
    return torch.tensor(v, dtype=torch.float64).to(torch.float16).item()


def to_dtype(v: float, dtype) -> float:
    return torch.tensor(v, dtype=torch.float64).to(dtype).double().item()


# --- Selective (seed 003 §4.4) -------------------------------------------------------------------


def selective_reference(x, qmax):
    """scale = max|x| / qmax + eps (stored fp16), q = clip(round(x / scale), -qmax, qmax), x̂ = q * scale."""
    T, H, D = x.shape
    xd = x.double()
    q = torch.zeros(T, H, D, dtype=torch.float64)
    s = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            vals = xd[t, h].tolist()
            scale = f16(max(abs(v) for v in vals) / qmax + FP16_TINY)
            s[t, h] = scale
            for d, v in enumerate(vals):
                q[t, h, d] = min(max(round(v / scale), -qmax), qmax)  # round: half to even, like torch
    xhat = torch.tensor([[[to_dtype(q[t, h, d].item() * s[t, h].item(), x.dtype) for d in range(D)]
                          for h in range(H)] for t in range(T)], dtype=torch.float64)
    return q, s, xhat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bits,qmax", [(8, 127), (4, 7)])
def test_selective_matches_transcription(bits, qmax, D, dtype):
    x = dyadic(T=6, H=2, D=D, seed=bits + D, dtype=dtype)
    c = SelectiveCodec(bits)
    q, s = c.encode(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and s.dtype == torch.float16 and s.shape == x.shape[:2]
    rq, rs, rx = selective_reference(x, qmax)
    assert torch.equal(s.double(), rs)
    assert torch.equal(q.double(), rq)
    xh = c.roundtrip(x)
    assert xh.dtype == dtype and torch.equal(xh.double(), rx)


def test_selective_edge_tokens():
    x = dyadic(T=6, H=2, D=64, seed=5)
    for bits in (8, 4):
        c = SelectiveCodec(bits)
        q, s = c.encode(x)
        xh = c.roundtrip(x)
        assert torch.isfinite(xh).all()
        assert torch.equal(xh[0], torch.zeros_like(x[0])) and s[0].double().eq(FP16_TINY).all()
        assert torch.equal(xh[2, 1], torch.zeros_like(x[2, 1]))
        # the huge value owns its token's scale: it is rounded to within half a step, and it coarsens
        # the rest of that token, whose values all fall in {-1, 0, 1} steps
        assert abs(xh[1, 0, 3] - 1024.0) <= s[1, 0].float() / 2
        assert q[1, 0, 3] == c.qmax and q[1, 0].abs().sort().values[-2] <= 1
        # everywhere: error within half a step (+ the scale's fp16 rounding, <= qmax * 2**-11 steps)
        step = s.float()[..., None]
        assert ((x - xh).abs() <= step * (0.5 + c.qmax * 2.0**-11)).all()


def test_selective_randn_close_to_transcription():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 2, 64, generator=g) * 3
    x[:, :, 0] *= 20  # an outlier channel
    for bits, qmax in ((8, 127), (4, 7)):
        _, rs, rx = selective_reference(x, qmax)
        xh = SelectiveCodec(bits).roundtrip(x).double()
        # float32 vs float64 rounding may move a value sitting on a rounding tie by one step
        diff = (xh - rx).abs()
        assert (diff <= rs[..., None] * 1.0001).all() and (diff > 0).float().mean() < 0.01


def test_selective_int8_beats_int4():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, 64, generator=g).bfloat16()
    e8 = (SelectiveCodec(8).roundtrip(x).float() - x.float()).pow(2).mean()
    e4 = (SelectiveCodec(4).roundtrip(x).float() - x.float()).pow(2).mean()
    assert 0 < e8 < e4 / 50


@pytest.mark.parametrize("bits,D,expected", [(8, 64, 8.25), (8, 128, 8.125), (4, 64, 4.25), (4, 128, 4.125)])
def test_selective_bits_per_float(bits, D, expected):
    # codes: 8 (or 4, two per byte) bits per value; one fp16 scale per (token, head) of D values
    assert SelectiveCodec(bits).bits_per_float(D) == expected


def test_selective_rejects_other_bits():
    with pytest.raises(ValueError):
        SelectiveCodec(2)


@pytest.mark.parametrize("bits", [8, 4])
def test_served_selective_codes_are_the_codec(bits):
    """What the pages hold (unsigned codes of ``bits`` bits + fp16 scales, SelectiveQuantizer) decodes to exactly
    the paper's quantize-dequantize (SelectiveCodec), through the page's code packing."""
    from vllm_temporalkv.codecs.selective import SelectiveQuantizer
    from vllm_temporalkv.page_views import pack_block_codes, unpack_block_codes

    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(24, 3, 64, generator=g) * 3).bfloat16()
    x[5] = 0.0  # an all-zero token
    q = SelectiveQuantizer(bits)
    enc = q.encode(x)
    assert enc.codes.dtype == torch.uint8 and int(enc.codes.max()) < 2**bits and int(enc.codes.min()) >= 1
    enc.codes = unpack_block_codes(q.codec.layout, pack_block_codes(q.codec.layout, enc.codes), 64)
    assert torch.equal(q.decode(enc, 24, torch.float32), q.codec.decode(*q.codec.encode(x), torch.float32))


def test_selective_mask_short_sequences_stay_exact():
    for T in range(0, 13):
        assert not selective_mask(T, 4, 8).any()
    assert selective_mask(13, 4, 8).tolist() == [False] * 4 + [True] + [False] * 8


def test_selective_mask_is_fifo():
    sinks, window = 3, 5
    prev = selective_mask(0, sinks, window)
    for T in range(1, 40):
        m = selective_mask(T, sinks, window)
        assert m.shape == (T,) and not m[:sinks].any() and not m[max(0, T - window):].any()
        assert m.sum().item() == max(0, T - sinks - window)
        assert not (prev & ~m[: T - 1]).any()  # once compressed, always compressed
        # each new token pushes exactly the oldest window token (position T-1-window) out
        newly = (m[: T - 1] & ~prev).nonzero().flatten().tolist()
        assert newly == ([T - 1 - window] if T > sinks + window else [])
        prev = m
    assert selective_mask(10, 0, 0).all() and selective_mask(10, 2, 0).tolist() == [False] * 2 + [True] * 8


def test_selective_fake_quant():
    x = dyadic(T=20, H=2, D=64, seed=7)
    c = SelectiveCodec(4)
    y = c.fake_quant(x, sinks=2, window=6)
    assert torch.equal(y[:2], x[:2]) and torch.equal(y[14:], x[14:])
    assert torch.equal(y[2:14], c.roundtrip(x[2:14])) and not torch.equal(y[2:14], x[2:14])
    assert torch.equal(c.fake_quant(x[:8], sinks=2, window=6), x[:8])


# --- TaDA (seed 004 §3, Eqs. 1-8) -----------------------------------------------------------------


def tada_reference(x, bits, group=128, half=None):
    """m = (1/H) sum_h x^h (16 bits); dev^h = m - x^h; per group of min(128, D) channels of one
    (token, head): M = min (fp16), S = (max - M) / (2^b - 1) (fp16, floored at 2**-24),
    q = clip(round((dev - M) / S), 0, 2^b - 1); x̂^h = m - (q S + M)."""
    T, H, D = x.shape
    G = min(group, D)
    half = half or (x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float16)
    qmax = 2**bits - 1
    xd = x.double()
    out = torch.zeros(T, H, D, dtype=torch.float64)
    means = torch.zeros(T, D, dtype=torch.float64)
    codes = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        m = [to_dtype(sum(xd[t, h, d].item() for h in range(H)) / H, half) for d in range(D)]
        means[t] = torch.tensor(m, dtype=torch.float64)
        for h in range(H):
            dev = [m[d] - xd[t, h, d].item() for d in range(D)]
            for g0 in range(0, D, G):
                grp = dev[g0 : g0 + G]
                M = f16(min(grp))
                S = f16(max((max(grp) - M) / qmax, FP16_TINY))
                for j, v in enumerate(grp):
                    q = min(max(round((v - M) / S), 0), qmax)
                    codes[t, h, g0 + j] = q
                    out[t, h, g0 + j] = to_dtype(m[g0 + j] - (q * S + M), x.dtype)
    return means, codes, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_tada_matches_transcription(bits, D, dtype):
    x = dyadic(T=5, H=4, D=D, seed=bits * D, dtype=dtype)
    c = TadaCodec(bits)
    enc = c.encode(x)
    assert enc.mean.dtype == (dtype if dtype == torch.bfloat16 else torch.float16)
    assert enc.codes.dtype == torch.uint8 and enc.scale.dtype == enc.minimum.dtype == torch.float16
    assert enc.scale.shape == (5, 4, D // min(128, D)) and int(enc.codes.max()) <= 2**bits - 1
    rm, rq, rx = tada_reference(x, bits)
    assert torch.equal(enc.mean.double(), rm)
    assert torch.equal(enc.codes.double(), rq)
    xh = c.roundtrip(x)
    assert xh.dtype == dtype
    assert torch.allclose(xh.double(), rx, rtol=2e-7 if dtype == torch.float32 else 0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4])
def test_served_tada_is_the_transcription(bits, dtype):
    """What the pages hold for tada-{4,2}bit (TadaQuantizer: codes packed ``8 // bits`` per byte, scale + min per
    token and head, the head mean split across the heads' records) decodes to the transcription of the paper's
    equations - with the mean in the cache's stored half dtype (bfloat16 for a float32 model)."""
    from vllm_temporalkv.codecs.tada import TadaQuantizer
    from vllm_temporalkv.page_views import join_head_mean, pack_block_codes, split_head_mean, unpack_block_codes

    H, D = 3, 64
    x = dyadic(T=16, H=H, D=D, seed=bits, dtype=dtype)
    q = TadaQuantizer(bits)
    enc = q.encode(x)
    assert enc.scales.shape == (16, H, 2) and enc.mean.dtype == torch.bfloat16
    enc.codes = unpack_block_codes(q.codec.layout, pack_block_codes(q.codec.layout, enc.codes), D)
    c = -(-D // H)
    enc.mean = join_head_mean(split_head_mean(enc.mean, H, c), D)
    _, rq, rx = tada_reference(x, bits, half=torch.bfloat16)
    assert torch.equal(enc.codes.double(), rq)
    assert torch.allclose(q.decode(enc, 16, dtype).double(), rx, rtol=2e-7 if dtype == torch.float32 else 0,
                          atol=0)


def test_tada_group_smaller_than_head():
    x = dyadic(T=4, H=4, D=128, seed=11)
    c = TadaCodec(2, group_size=32)
    assert c.encode(x).scale.shape == (4, 4, 4)
    _, _, rx = tada_reference(x, 2, group=32)
    assert torch.allclose(c.roundtrip(x).double(), rx, rtol=2e-7, atol=0)
    assert (c.roundtrip(x) - x).pow(2).mean() < (TadaCodec(2).roundtrip(x) - x).pow(2).mean()


def test_tada_edge_tokens():
    x = dyadic(T=6, H=4, D=64, seed=2)
    for bits in (2, 4, 8):
        xh = TadaCodec(bits).roundtrip(x)
        assert torch.isfinite(xh).all()
        assert torch.equal(xh[0], torch.zeros_like(x[0]))  # all heads zero: mean 0, deviations 0
    # the huge value sits in one head; the mean carries a quarter of it, the deviations the rest
    enc = TadaCodec(8).encode(x)
    assert enc.mean[1, 3].item() == pytest.approx(256, abs=6) and enc.codes[1, 0, 3] == 0  # dev min


def test_tada_error_decreases_with_bits():
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(16, 4, 64, generator=g) + torch.randn(16, 1, 64, generator=g) * 5).bfloat16()
    err = {b: (TadaCodec(b).roundtrip(x).float() - x.float()).pow(2).mean().item() for b in (2, 4, 8)}
    assert err[8] < err[4] / 10 < err[2] / 100


@pytest.mark.parametrize("D,H,bits,expected", [(128, 8, 4, 6.25), (64, 8, 4, 6.5), (128, 32, 4, 4.75),
                                               (64, 4, 8, 12.5), (128, 8, 2, 4.25), (64, 8, 2, 4.5)])
def test_tada_bits_per_float(D, H, bits, expected):
    # b + two fp16 per group of min(128, D) + a 16-bit mean per channel shared by H heads
    assert bits_per_float(D, bits, H) == expected == TadaCodec(bits).bits_per_float(D, H)
    # the same count from the tensors encode actually stores
    enc = TadaCodec(bits).encode(dyadic(T=3, H=H, D=D))
    stored = enc.mean.numel() * 16 + enc.codes.numel() * bits + (enc.scale.numel() + enc.minimum.numel()) * 16
    assert stored / (3 * H * D) == expected


def test_tada_budget_conversion():
    assert bits_per_float(128, 4, 32) / 16 == 0.296875  # the paper's "about 29%" for Llama2-7B
    assert budget_bits_from_fraction(0.35, 8, 128) == pytest.approx(3.35)  # notes §4.3
    assert budget_bits_from_fraction(bits_per_float(64, 4, 8) / 16, 8, 64) == pytest.approx(4)


def test_tada_mask_residual_buffer():
    R = 4
    assert not tada_mask(0, R).any()
    for T in range(1, R + 1):
        assert not tada_mask(T, R).any()
    assert tada_mask(R + 1, R).tolist() == [True] * R + [False]
    assert tada_mask(2 * R, R).sum() == R and tada_mask(2 * R + 1, R).sum() == 2 * R
    prev = tada_mask(0, R)
    for T in range(1, 30):
        m = tada_mask(T, R)
        r = int((~m).sum())
        assert 1 <= r <= R and not m[m.sum():].any() and m[: m.sum()].all()
        assert not (prev & ~m[: T - 1]).any()
        prev = m
    assert tada_mask(7, 0).all() and tada_mask(200).sum() == 128


def test_tada_fake_quant():
    x = dyadic(T=11, H=4, D=64, seed=9)
    c = TadaCodec(2)
    y = c.fake_quant(x, residual=4)  # 11 tokens, R = 4: 8 compressed, 3 in the buffer
    assert torch.equal(y[8:], x[8:]) and torch.equal(y[:8], c.roundtrip(x[:8]))
    assert not torch.equal(y[:8], x[:8])
    assert torch.equal(c.fake_quant(x[:4], residual=4), x[:4])


# --- the per-layer bit search -----------------------------------------------------------------------


def test_search_hand_case():
    # layer 1 barely cares; layers 0 and 2 need 4 bits; 8 bits anywhere breaks the budget of 10/3 avg
    errors = {0: {2: 10.0, 4: 1.0, 8: 0.0}, 1: {2: 0.1, 4: 0.05, 8: 0.0}, 2: {2: 3.0, 4: 0.2, 8: 0.1}}
    assert search_layer_bits(errors, 10 / 3) == {0: 4, 1: 2, 2: 4}
    assert search_layer_bits(errors, 4) == {0: 4, 1: 4, 2: 4}
    assert search_layer_bits(errors, 2) == {0: 2, 1: 2, 2: 2}
    assert search_layer_bits(errors, 8) == {0: 8, 1: 8, 2: 8}
    with pytest.raises(ValueError):
        search_layer_bits(errors, 1.9)
    # units may be (layer, K/V) pairs
    kv = {(0, "k"): errors[0], (0, "v"): errors[1]}
    assert search_layer_bits(kv, 3) == {(0, "k"): 4, (0, "v"): 2}


def test_search_is_optimal_under_budget():
    rng = random.Random(0)
    for _ in range(25):
        L = rng.randint(1, 5)
        errors = {}
        for layer in range(L):
            e2 = rng.uniform(0, 10)
            e4 = rng.uniform(0, e2)
            errors[layer] = {2: e2, 4: e4, 8: rng.uniform(0, e4)}
        budget = rng.choice([2, 2.5, 3, 10 / 3, 4, 5, 6, 8])
        got = search_layer_bits(errors, budget)
        assert sum(got.values()) <= budget * L + 1e-9
        best = min(sum(errors[layer][b] for layer, b in enumerate(c))
                   for c in itertools.product((2, 4, 8), repeat=L) if sum(c) <= budget * L + 1e-9)
        assert math.isclose(sum(errors[layer][b] for layer, b in got.items()), best, rel_tol=1e-12)


def test_per_token_int4_zeroes_the_channels_an_outlier_channel_dwarfs():
    """benchmarks.kv_outliers' measure of why per-token formats break on Qwen2.5 (issue 35): with one channel 50x
    the rest, the per-token absmax scale rounds the other channels to zero; a per-channel scale keeps them."""
    stats = bench_call(
        "import json, torch; from benchmarks.kv_outliers import layer_stats\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(256, 2, 64, generator=g); x[..., 3] = 50 + torch.randn(256, 2, generator=g)\n"
        "y = torch.randn(256, 2, 64, generator=g)\n"
        "print(json.dumps([layer_stats(x), layer_stats(y)]))")
    spiky, plain = stats
    assert spiky["channel_ratio"] > 40 and plain["channel_ratio"] < 2
    assert spiky["int4_zeroed"] > 0.9 > 0.3 > plain["int4_zeroed"]
    assert spiky["int4_rel_err"] > 0.9 and spiky["int4_per_channel_rel_err"] < 0.2  # the zeroed channels: all lost
