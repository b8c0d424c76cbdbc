"""The page layout's recent window (layout.PageLayout.window): the last window..window+7 tokens stay in half
precision, in a ring of their own pages; older blocks are encoded as they leave it.  Served by the selective
formats (seed 003) and, as an option, by every format.  Checked against the definition (dense attention where
a query sees exact keys from ``exact_from`` on and decoded ones before), across chunkings and pages."""

import pytest
import torch

from tests.helpers import CFG, stream_and_check, synthetic_artifact
from vllm_temporalkv.cache import LayerCache
from vllm_temporalkv.formats import BLOCK_TOKENS, SINK_TOKENS, FormatError, get_format
from vllm_temporalkv.layout import PageLayout, exact_from
from vllm_temporalkv.ops import paged_torch
from vllm_temporalkv.ops.paged_torch import (_attend, _attend_fast, write_kv,
                                             write_kv_window)
from vllm_temporalkv.rope import Rope

H, D, BS = 2, 16, 32


def make_cache(fmt, window, dtype=torch.bfloat16, layer=1):
    from transformers import LlamaConfig

    art = synthetic_artifact(formats=[fmt]) if get_format(fmt).needs_calibration else None
    rope = Rope(LlamaConfig(**{k: v for k, v in CFG.items() if k != "architectures"}))
    return LayerCache.build(fmt, layer, head_dim=D, block_size=BS, dtype=dtype, rope=rope, num_kv_heads=H,
                            artifact=art, window=window)


def reference_kv(lc, k, v, n):
    """The first n tokens as the cache holds them: exact from exact_from(n), encoded-decoded before."""
    K, V = lc.exact(k[:n]).clone(), lc.exact(v[:n]).clone()  # as stored: half precision
    lo, hi = SINK_TOKENS, exact_from(n, lc.layout.window)
    if hi > lo:
        pos = torch.arange(lo, hi)
        pre = lc.rope.invert(K[lo:hi], pos).to(lc.dtype)
        K[lo:hi] = lc.rope.apply(lc.k.decode(lc.k.encode(pre), hi - lo, torch.float32), pos).to(lc.dtype)
        V[lo:hi] = lc.v.decode(lc.v.encode(V[lo:hi]), hi - lo, torch.float32).to(lc.dtype)
    return K, V


def test_layout_sizes_and_refusals():
    f = get_format("selective-int8")
    lay = PageLayout(f, 64, 1024)
    assert lay.window == 128 and lay.region_slots == 8 + 136
    # codes (8 bits) + one fp16 scale per (token, head) + the region, K and V
    assert lay.bytes == 144 * 2 * 64 * 2 + 2 * 1024 * 64 + 2 * 1024 * 2
    assert PageLayout(get_format("temporalkv-2bit"), 64, 1024).window == 0  # the thesis's page, unchanged
    assert PageLayout(get_format("temporalkv-2bit"), 64, 1024, window=24).region_slots == 8 + 32
    for bad in (12, -8, 1024):
        with pytest.raises(FormatError, match="temporalkv_recent_window"):
            PageLayout(get_format("temporalkv-2bit"), 64, 1024, window=bad)


@pytest.mark.parametrize("window", [0, 8, 24])
@pytest.mark.parametrize("offset,tq", [(0, 37), (21, 40), (64, 9)])
def test_attend_matches_the_definition(window, offset, tq):
    g = torch.Generator().manual_seed(offset + tq + window)
    Hkv, grp = 2, 3
    tk = offset + tq
    q = torch.randn(tq, Hkv * grp, D, generator=g, dtype=torch.float64)
    ke, ve, kd, vd = (torch.randn(tk, Hkv, D, generator=g, dtype=torch.float64) for _ in range(4))
    qpos, kpos = offset + torch.arange(tq), torch.arange(tk)
    exact = kpos[None, :] >= ((qpos - window) // BLOCK_TOKENS * BLOCK_TOKENS)[:, None]
    rep = lambda t: t.transpose(0, 1).repeat_interleave(grp, 0)  # noqa: E731
    s = torch.where(exact, q.transpose(0, 1) @ rep(ke).transpose(1, 2), q.transpose(0, 1) @ rep(kd).transpose(1, 2))
    p = torch.softmax((s * 0.3).masked_fill(kpos[None, :] > qpos[:, None], -float("inf")), -1)
    want = ((p * exact) @ rep(ve) + (p * ~exact) @ rep(vd)).transpose(0, 1)
    for tile in (1, 7, 256):
        torch.testing.assert_close(_attend(q, ke, ve, kd, vd, 0.3, offset, window, q_tile=tile), want,
                                   rtol=1e-12, atol=1e-12)
    for fused in (True, False):  # the float32 serving path: two flash passes merged by log-sum-exp
        f32 = [t.float() for t in (q, ke, ve, kd, vd)]
        saved = paged_torch._CPU_FLASH
        paged_torch._CPU_FLASH = saved if fused else None
        try:
            got = _attend_fast(*f32, 0.3, offset, window)
        finally:
            paged_torch._CPU_FLASH = saved
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_fast_window_does_not_depend_on_chunking():
    g = torch.Generator().manual_seed(4)
    Hkv, grp, n, W = 3, 3, 1400, 128
    q = torch.randn(n, Hkv * grp, 64, generator=g)
    ke, ve, kd, vd = (torch.randn(n, Hkv, 64, generator=g) for _ in range(4))
    outs = []
    for cuts in ([0, n], [0, 1024, n], [0, 5, 7, 300, 777, 800, 1399, n], [0, 190, 200, 970, n]):
        outs.append(torch.cat([_attend_fast(q[a:b], ke[:b], ve[:b], kd[:b], vd[:b], 0.125, a, W)
                               for a, b in zip(cuts, cuts[1:])]))
    for o in outs[1:]:
        assert torch.equal(o, outs[0]), (o - outs[0]).abs().max()


@pytest.mark.parametrize("fmt,window,dtype", [
    ("selective-int8", 16, torch.bfloat16), ("selective-int4", 8, torch.bfloat16),
    ("temporalkv-2bit", 16, torch.bfloat16), ("selective-int8", 0, torch.bfloat16),
    ("tada-2bit", 16, torch.bfloat16), ("tada-4bit", 8, torch.float32), ("tada-4bit", 0, torch.float16)])
def test_stream_reads_back_and_attends_alike(fmt, window, dtype):
    """A sequence prefilled in uneven chunks then decoded token by token, through pages scattered in the pool:
    after every step the cache reads back as the definition says, and every query's output is the same
    however the sequence was chunked (and close to dense attention over the reference K/V).  For TaDA the
    per-token head mean is split across the heads' records (and kept in bfloat16 for a float32 model)."""
    stream_and_check(make_cache(fmt, window, dtype), reference_kv, seed=window)


def test_window_write_is_the_thesis_write_at_window_0():
    """write_kv_window with no window fills pages byte for byte as write_kv does (one contract)."""
    lc = make_cache("temporalkv-2bit", 0)
    g = torch.Generator().manual_seed(1)
    n = 75
    k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    table = torch.tensor([3, 1, 6])
    a_pages, b_pages = (torch.zeros(8, H, lc.layout.bytes, dtype=torch.uint8) for _ in range(2))
    for a, b in zip([0, 5, 13, 40, 64], [5, 13, 40, 64, n]):
        pos = torch.arange(a, b)
        write_kv(lc, a_pages, k[a:b], v[a:b], pos, table[pos // BS])
        write_kv_window(lc, b_pages, k[a:b], v[a:b], torch.tensor([0, b - a]), torch.tensor([b]), table[None])
    assert torch.equal(a_pages, b_pages)


def test_write_kv_refuses_a_window():
    lc = make_cache("selective-int8", 16)
    pages = torch.zeros(4, H, lc.layout.bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="write_kv_window"):
        write_kv(lc, pages, torch.zeros(1, H, D), torch.zeros(1, H, D), torch.tensor([0]), torch.tensor([0]))
