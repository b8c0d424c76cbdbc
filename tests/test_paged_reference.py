"""The torch paged cache: streamed writes in any chunking read back as sinks + decoded blocks + tail."""


import pytest
import torch

from tests.helpers import expected_kv, make_cache
from vllm_temporalkv.formats import BLOCK_TOKENS, SINK_TOKENS
from vllm_temporalkv.ops.paged_torch import gather_kv, paged_attention, write_kv

FORMATS = ["temporalkv-2bit", "channelkv-1bit", "kvquant-2bit"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layer", [0, 1])  # layer 0 K is channel-chunked in the hybrid
@pytest.mark.parametrize("outliers", [False, True])
def test_streamed_writes_read_back(fmt, layer, outliers):
    lc = make_cache(fmt, layer, outliers)
    H, D = 2, 16
    g = torch.Generator().manual_seed(layer)
    n = 107
    k, v = torch.randn(n, H, D, generator=g) * 2, torch.randn(n, H, D, generator=g)
    pages = torch.zeros(8, H, lc.layout.bytes, dtype=torch.uint8)
    table = torch.tensor([5, 2, 7, 0])  # scattered pages
    # prefill in uneven chunks, then decode one token at a time
    cuts = [0, 3, 11, 12, 45, 90] + list(range(91, n + 1))
    for a, b in zip(cuts, cuts[1:]):
        pos = torch.arange(a, b)
        write_kv(lc, pages, k[a:b], v[a:b], pos, table[pos // lc.block_size])
        K, V = gather_kv(lc, pages, table, b)
        EK, EV = expected_kv(lc, k, v, b)
        assert torch.equal(K[:SINK_TOKENS], EK[:SINK_TOKENS])  # sinks exact
        assert torch.allclose(K.float(), EK.float(), atol=2e-2, rtol=1e-2), (a, b)
        assert torch.equal(V, EV), (a, b)


def test_two_requests_interleaved_and_attention():
    lc = make_cache("temporalkv-2bit", 1, False)
    H, D = 2, 16
    g = torch.Generator().manual_seed(3)
    pages = torch.zeros(8, H, lc.layout.bytes, dtype=torch.uint8)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    ks = [torch.randn(70, H, D, generator=g) for _ in range(2)]
    vs = [torch.randn(70, H, D, generator=g) for _ in range(2)]
    # one batch: request 0 prefills 0..40, request 1 prefills 0..25
    lens = [40, 25]
    key = torch.cat([ks[0][:40], ks[1][:25]])
    val = torch.cat([vs[0][:40], vs[1][:25]])
    pos = torch.cat([torch.arange(40), torch.arange(25)])
    pid = torch.cat([tables[0][torch.arange(40) // 32], tables[1][torch.arange(25) // 32]])
    write_kv(lc, pages, key, val, pos, pid)
    # next step: both decode one token
    q = torch.randn(2, 4, D, generator=g)
    key = torch.stack([ks[0][40], ks[1][25]])
    val = torch.stack([vs[0][40], vs[1][25]])
    out = paged_attention(lc, pages, q, key, val, torch.tensor([0, 1, 2]), torch.tensor([41, 26]), tables, 0.25)
    write_kv(lc, pages, key, val, torch.tensor([40, 25]), torch.tensor([tables[0][1], tables[1][0]]))
    for r, n in enumerate([41, 26]):
        EK, EV = expected_kv(lc, ks[r], vs[r], n - 1)
        EK = torch.cat([EK, ks[r][n - 1 : n].to(lc.dtype)]).float().repeat_interleave(2, 1)
        EV = torch.cat([EV, vs[r][n - 1 : n].to(lc.dtype)]).float().repeat_interleave(2, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[r], EK) * 0.25, -1)
        ref = torch.einsum("ht,thd->hd", p, EV)
        assert torch.allclose(out[r].float(), ref, atol=2e-2), r


@pytest.mark.parametrize("fmt,dtype", [("temporalkv-2bit", torch.bfloat16), ("kvquant-2bit", torch.bfloat16),
                                       ("temporalkv-2bit", torch.float32)])
def test_attention_does_not_depend_on_chunking(fmt, dtype):
    """One prefill, uneven chunks, or token-by-token decode: every token attends to the same
    K/V (exact own block, decoded earlier blocks), so prefix hits and chunked prefill are safe.
    float32 models too: a step's own new tokens are seen as the cache stores them (bfloat16)."""
    lc = make_cache(fmt, 1, True, dtype=dtype)
    H, D, n = 2, 16, 75
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    q = torch.randn(n, 4, D, generator=g)
    table = torch.tensor([3, 1, 6])
    outs = []
    for cuts in ([0, n], [0, 5, 13, 14, 40, 64, n], list(range(n + 1))):
        pages = torch.zeros(8, H, lc.layout.bytes, dtype=torch.uint8)
        out = torch.empty(n, 4, D)
        for a, b in zip(cuts, cuts[1:]):
            pos = torch.arange(a, b)
            out[a:b] = paged_attention(lc, pages, q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]),
                                       torch.tensor([b]), table[None], 0.25)
            write_kv(lc, pages, k[a:b], v[a:b], pos, table[pos // lc.block_size])
        outs.append(out)
    assert torch.allclose(outs[0], outs[1], atol=1e-5) and torch.allclose(outs[0], outs[2], atol=1e-5)
    # and compression really is in effect: far from exact attention over the exact K/V
    exact = torch.softmax(torch.einsum("thd,shd->hts", q, k.repeat_interleave(2, 1)) * 0.25
                          + torch.triu(torch.full((n, n), -1e9), 1), -1)
    exact = torch.einsum("hts,shd->thd", exact, v.repeat_interleave(2, 1))
    assert (outs[0] - exact).abs().max() > 1e-2


@pytest.mark.parametrize("offset,tq", [(0, 37), (21, 40), (64, 9)])
def test_attend_tiles_match_the_definition(offset, tq):
    """The tiled, band-limited attention equals its definition (own block exact, decoded elsewhere,
    causal), computed densely, for any query tile size."""
    from vllm_temporalkv.ops.paged_torch import _attend

    g = torch.Generator().manual_seed(offset + tq)
    Hkv, grp, D = 2, 3, 16
    tk = offset + tq
    q = torch.randn(tq, Hkv * grp, D, generator=g, dtype=torch.float64)
    ke, ve, kd, vd = (torch.randn(tk, Hkv, D, generator=g, dtype=torch.float64) for _ in range(4))
    qpos, kpos = offset + torch.arange(tq), torch.arange(tk)
    own = (qpos[:, None] // BLOCK_TOKENS) == (kpos[None, :] // BLOCK_TOKENS)
    rep = lambda t: t.transpose(0, 1).repeat_interleave(grp, 0)  # noqa: E731
    s = torch.where(own, q.transpose(0, 1) @ rep(ke).transpose(1, 2), q.transpose(0, 1) @ rep(kd).transpose(1, 2)) * 0.3
    p = torch.softmax(s.masked_fill(kpos[None, :] > qpos[:, None], -float("inf")), -1)
    want = ((p * own) @ rep(ve) + (p * ~own) @ rep(vd)).transpose(0, 1)
    for tile in (1, 5, 256):
        got = _attend(q, ke, ve, kd, vd, 0.3, offset, q_tile=tile)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("offset,tq", [(0, 37), (21, 40), (64, 9), (300, 130)])
@pytest.mark.parametrize("fused", [True, False])
def test_sdpa_path_matches_the_exact_one(offset, tq, fused, monkeypatch):
    """The fast float32 path (flash attention over the decoded keys before each query's block, merged with the
    own block's exact keys) agrees with the float64 definition, on the fused CPU kernel and on plain matmuls."""
    from vllm_temporalkv.ops import paged_torch
    from vllm_temporalkv.ops.paged_torch import _attend, _attend_fast

    if not fused:
        monkeypatch.setattr(paged_torch, "_CPU_FLASH", None)
    g = torch.Generator().manual_seed(7 + offset + tq)
    Hkv, grp, D = 2, 3, 16
    tk = offset + tq
    q = torch.randn(tq, Hkv * grp, D, generator=g)
    ke, ve, kd, vd = (torch.randn(tk, Hkv, D, generator=g) for _ in range(4))
    want = _attend(q, ke, ve, kd, vd, 0.3, offset)
    torch.testing.assert_close(_attend_fast(q, ke, ve, kd, vd, 0.3, offset), want.float(), rtol=1e-5, atol=1e-5)
    # the own block's decoded keys far from its exact ones, with large scores (they must not leak in)
    kd = kd.clone()
    kd[-min(tq, 12):] *= 4
    want = _attend(q, ke, ve, kd, vd, 0.3, offset)
    torch.testing.assert_close(_attend_fast(q, ke, ve, kd, vd, 0.3, offset), want.float(), rtol=1e-5, atol=1e-5)


def test_fast_prefill_does_not_depend_on_chunking():
    """The float32 serving path gives a query bit for bit the same output however its prompt was chunked: under
    load vLLM's scheduler cuts prompts anywhere, and 2-bit codes amplify a last-bit difference of one layer's
    attention into different codes, then different text, downstream (benchmarks/stress.py found it).  Chunks of
    every size class of torch's flash kernel, across its 512-key blocks, ending inside a block."""
    from vllm_temporalkv.ops.paged_torch import _attend_fast

    g = torch.Generator().manual_seed(3)
    Hkv, grp, D, n = 3, 3, 64, 1400
    q = torch.randn(n, Hkv * grp, D, generator=g)
    ke, ve, kd, vd = (torch.randn(n, Hkv, D, generator=g) for _ in range(4))
    kd[600:640] *= 6  # decoded keys with large scores: own blocks the old subtract-and-add correction cancelled
    outs = []
    for cuts in ([0, n], [0, 1024, n], [0, 5, 7, 300, 777, 800, 1399, n], [0, 190, 200, 970, n]):
        outs.append(torch.cat([_attend_fast(q[a:b], ke[:b], ve[:b], kd[:b], vd[:b], 0.125, a)
                               for a, b in zip(cuts, cuts[1:])]))
    for o in outs[1:]:
        assert torch.equal(o, outs[0]), (o - outs[0]).abs().max()
