"""QJL served (``--kv-cache-dtype qjl``): the pages hold the paper's sketches, read back as the definition says.

* the bytes of a key block are sign(S k_in), sign(S_o k_out), ||k|| / ||k_out|| and the block's outlier channels,
  checked by a transcription of Def. 3.1 (scores computed from the unpacked bits, not through the codec);
* a sequence streamed through the pages in any chunking reads back as the codec defines it (keys post-RoPE, no
  rotation) and attends alike; the first layers carry the larger sketch, so their records are larger;
* refusals: a head dim the value groups do not divide, a layer-less page layout."""

import math

import pytest
import torch
from transformers import LlamaConfig

from tests.helpers import CFG, stream_and_check
from vllm_temporalkv.codecs import calibration_free_quantizers, qjl
from vllm_temporalkv.formats import BLOCK_TOKENS, SINK_TOKENS, FormatError, check_head_dim, get_format
from vllm_temporalkv.layout import PageLayout, bits_per_float, exact_from
from vllm_temporalkv.methods import qjl_key_block_bytes
from vllm_temporalkv.cache import LayerCache
from vllm_temporalkv.rope import Rope

H, D, BS = 2, 32, 32


def _rope():
    return Rope(LlamaConfig(**{**{k: v for k, v in CFG.items() if k != "architectures"}, "hidden_size": 4 * D}))


def make_cache(layer, window, dtype):
    return LayerCache.build("qjl", layer, head_dim=D, block_size=BS, dtype=dtype, rope=_rope(), num_kv_heads=H,
                            window=window)


def test_key_bytes_are_the_papers_sketch():
    """Scores from the stored bytes by Def. 3.1 + the official outlier split, written out here: for each key,
    sqrt(pi/2)/m ||k_in|| <S q, s> + sqrt(pi/2)/m_o ||k_out|| <S_o q, s_o>, with ||k_in|| = sqrt(||k||^2 - ||k_out||^2),
    the signs s read bit by bit (bit j of byte i = row 8i + j), and the outlier channels the block's top-8 by norm."""
    kq, _ = calibration_free_quantizers(get_format("qjl"), head_dim=D, layer=3)
    m, m_o = kq.m, kq.m_o
    assert (m, m_o) == (4 * D, D)  # a first layer: the larger sketch
    g = torch.Generator().manual_seed(0)
    k = torch.randn(16, H, D, generator=g)
    k[:8, 0, 5] *= 7  # a loud channel in the first block
    packed = kq.encode(k).codes
    assert packed.shape == (2, H, qjl_key_block_bytes(D, 3)) and packed.dtype == torch.uint8
    q = torch.randn(H, D, generator=g)
    S = kq.S.double()
    want = kq.decode(kq.encode(k), 16, torch.float64)  # through the codec's surrogate
    for t in range(16):
        b, r = divmod(t, BLOCK_TOKENS)
        for h in range(H):
            rec = packed[b, h].tolist()
            bits = rec[r * m // 8:(r + 1) * m // 8]
            obits = rec[BLOCK_TOKENS * m // 8 + r * m_o // 8:BLOCK_TOKENS * m // 8 + (r + 1) * m_o // 8]
            sign = [1.0 if (bits[i // 8] >> (i % 8)) & 1 else -1.0 for i in range(m)]
            osign = [1.0 if (obits[i // 8] >> (i % 8)) & 1 else -1.0 for i in range(m_o)]
            n0 = BLOCK_TOKENS * (m + m_o) // 8
            norms = torch.tensor(rec[n0:n0 + 4 * BLOCK_TOKENS], dtype=torch.uint8).view(torch.float16).double()
            nrm, onrm = norms.view(BLOCK_TOKENS, 2)[r].tolist()
            out = rec[n0 + 4 * BLOCK_TOKENS:]
            blk = k[b * 8:(b + 1) * 8, h].double()
            top = sorted(range(D), key=lambda c: (-float(blk[:, c].norm()), c))[:qjl.N_OUTLIERS]
            assert out == top
            assert nrm == pytest.approx(float(k[t, h].norm()), rel=1e-3)
            assert onrm == pytest.approx(float(k[t, h, top].norm()), rel=1e-3)
            qi, qo = q[h].double().clone(), q[h].double().clone()
            qi[top], qo[[c for c in range(D) if c not in top]] = 0, 0
            est = (math.sqrt(math.pi / 2) / m * math.sqrt(max(nrm ** 2 - onrm ** 2, 0)) * float((S @ qi) @ torch.tensor(sign, dtype=torch.float64))
                   + math.sqrt(math.pi / 2) / m_o * onrm * float((S[:m_o] @ qo) @ torch.tensor(osign, dtype=torch.float64)))
            assert float(want[t, h] @ q[h].double()) == pytest.approx(est, rel=1e-4, abs=1e-4)


def test_pages_differ_per_layer_and_count_every_bit():
    f = get_format("qjl")
    first, later = (PageLayout(f, 64, 1024, layer=i) for i in (0, 20))
    assert first.kind_code_bytes["k"] == 8 * (256 // 8 + 64 // 8 + 4) + 8  # m = 4D, m_o = D
    assert later.kind_code_bytes["k"] == 8 * (128 // 8 + 128 // 8 + 4) + 8  # m = m_o = 2D
    assert first.kind_code_bytes["v"] == later.kind_code_bytes["v"] == 8 * 64 * 2 // 8
    assert first.kind_scales_per_row == {"k": 0, "v": 4}  # values: a scale and a min per 32 channels
    assert first.code_bytes is None  # K and V differ: nothing for the kernels to read
    assert first.bytes - later.bytes == 128 * (first.kind_code_bytes["k"] - later.kind_code_bytes["k"])
    with pytest.raises(ValueError, match="pass layer"):
        PageLayout(f, 64, 1024)
    # all-in bits: the average over the layers of (K + V) / 2 per compressed float
    b = bits_per_float(f, 64, 1 << 20, num_layers=30)
    k_bits = [8 * qjl_key_block_bytes(64, i) / (8 * 64) for i in range(30)]
    assert b["codes"] + b["scales"] == pytest.approx((sum(k_bits) / 30 + 2 + 1) / 2, rel=1e-3)
    with pytest.raises(FormatError, match="multiple of 32"):
        check_head_dim(f, 48)


def _reference_kv(lc, k, v, n):
    """The first n tokens as the cache holds them: exact (half precision) from exact_from(n), before it the QJL
    surrogate of the post-RoPE keys (no rotation: QJL sketches what attention sees) and the 2-bit values."""
    K, V = lc.exact(k[:n]).clone(), lc.exact(v[:n]).clone()
    lo, hi = SINK_TOKENS, exact_from(n, lc.layout.window)
    if hi > lo:
        K[lo:hi] = lc.k.decode(lc.k.encode(K[lo:hi]), hi - lo, torch.float32).to(lc.dtype)
        V[lo:hi] = lc.v.decode(lc.v.encode(V[lo:hi]), hi - lo, torch.float32).to(lc.dtype)
    return K, V


@pytest.mark.parametrize("layer,window,dtype", [(0, 16, torch.bfloat16), (20, 8, torch.float32),
                                                (20, 0, torch.float16)])
def test_stream_reads_back_and_attends_alike(layer, window, dtype):
    K, exact = stream_and_check(make_cache(layer, window, dtype), _reference_kv, seed=layer + window)
    assert not torch.equal(K[SINK_TOKENS:64], exact[SINK_TOKENS:64])  # compressed, not exact


def test_fake_quant_is_the_served_cache_rotated_back():
    """The quality harness's view (pre-RoPE keys of one sequence): rotating its output forward gives the served
    cache's keys - the surrogate for encoded blocks, the exact keys elsewhere."""
    lc = make_cache(0, 16, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    n = 61
    pre = torch.randn(n, H, D, generator=g).bfloat16()
    pos = torch.arange(n)
    got = lc.rope.apply(lc.k.fake_quant(pre, window=16), pos)
    post = lc.rope.apply(pre, pos).bfloat16()
    want, _ = _reference_kv(lc.replace(dtype=torch.float32), post, post, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
