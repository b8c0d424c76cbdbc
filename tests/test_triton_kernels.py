"""Triton kernels against the torch reference (kernels/reference.py).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported), on small shapes; with one, the same tests run compiled, unchanged.  Cache updates must
leave bit-identical pages (codes, outliers, sinks, tail); attention agrees within the model
dtype's tolerance.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.kernel_cases import CASES, DEVICE, GQ, H, IDS, _batch, _decode_setup, _randn, _tol, make_cache  # noqa: E402
from vllm_temporalkv.formats import get_format  # noqa: E402
from vllm_temporalkv.ops import paged_torch as reference, triton_decode, triton_encode  # noqa: E402
from vllm_temporalkv.layout import PageLayout  # noqa: E402

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_write_kv_bit_exact(case):
    fmt, D, outliers, dtype, layer = case
    lc = make_cache(fmt, D, outliers, dtype, layer)
    g = torch.Generator().manual_seed(1)
    lens = {0: 40, 1: 6, 2: 21}
    # scales: many outliers (request 0, beyond the cap), few (1, 2)
    kv = {r: (_randn(g, n, H, D, scale=2.0 - r / 2), _randn(g, n, H, D, scale=2.0 - r / 2)) for r, n in lens.items()}
    tables = torch.tensor([[3, 7, 1], [5, 0, 2], [9, 4, 8]], device=DEVICE)
    pages = torch.randint(0, 256, (10, H, lc.layout.bytes), dtype=torch.uint8, generator=g).to(DEVICE)
    ref = pages.clone()
    # mixed requests per call; request 0's second call completes a block whose first rows wait in
    # the tail and refills that tail within the same page; then a block-completing decode step
    for calls in ({0: (0, 13), 1: (0, 5), 2: (0, 12)}, {0: (13, 30), 1: (5, 6), 2: (12, 21)},
                  {0: (30, 32)}, {0: (32, 39)}, {0: (39, 40)}):
        args = _batch(kv, calls, tables, lc.block_size)
        reference.write_kv(lc, ref, *args)
        triton_encode.write_kv(lc, pages, *args)
        assert torch.equal(pages, ref), calls


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_decode_matches_reference(case):
    lens = [1, 5, 8, 9, 16, 17, 40, 75]  # < 8, 8..16, several pages
    lc, pages, tables, kv, q = _decode_setup(case, lens)
    ctx = {r: (0, n - 1) for r, n in enumerate(lens) if n > 1}
    reference.write_kv(lc, pages, *_batch(kv, ctx, tables, lc.block_size))
    key = torch.stack([kv[r][0][-1] for r in range(len(lens))]).to(lc.dtype)
    val = torch.stack([kv[r][1][-1] for r in range(len(lens))]).to(lc.dtype)
    qsl = torch.arange(len(lens) + 1, device=DEVICE)
    sl = torch.tensor(lens, device=DEVICE)
    scale = case[1] ** -0.5
    ref = reference.paged_attention(lc, pages, q, key, val, qsl, sl, tables, scale)
    for splits in (None, 3):
        out = triton_decode.paged_attention(lc, pages, q, key, val, qsl, sl, tables, scale, splits=splits)
        err = (out.float() - ref.float()).abs().amax((1, 2))
        assert err.max() <= _tol(lc.dtype) * max(1.0, ref.float().abs().max().item()), (splits, err.tolist())


def test_decode_steps_end_to_end():
    """A few serving steps on Triton only (write, then attend), against the reference doing the same:
    blocks complete mid-way, so freshly encoded codes are read back by the decode kernel."""
    case = ("temporalkv-2bit", 64, True, torch.float16, 0)
    lens = [14, 30]
    lc, pages, tables, kv, _ = _decode_setup(case, [n + 4 for n in lens], block_size=16, seed=3)
    ref = pages.clone()
    args = _batch(kv, {0: (0, lens[0]), 1: (0, lens[1])}, tables, lc.block_size)
    reference.write_kv(lc, ref, *args)
    triton_encode.write_kv(lc, pages, *args)
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        pos = [n + step for n in lens]
        q = _randn(g, 2, H * GQ, 64).half()
        key = torch.stack([kv[r][0][p] for r, p in enumerate(pos)]).half()
        val = torch.stack([kv[r][1][p] for r, p in enumerate(pos)]).half()
        qsl = torch.arange(3, device=DEVICE)
        sl = torch.tensor([p + 1 for p in pos], device=DEVICE)
        want = reference.paged_attention(lc, ref, q, key, val, qsl, sl, tables, 0.125)
        got = triton_decode.paged_attention(lc, pages, q, key, val, qsl, sl, tables, 0.125)
        assert (got.float() - want.float()).abs().max() <= _tol(torch.float16), step
        p = torch.tensor(pos, device=DEVICE)
        pid = tables[torch.arange(2, device=DEVICE), p // lc.block_size]
        reference.write_kv(lc, ref, key, val, p, pid)
        triton_encode.write_kv(lc, pages, key, val, p, pid)
        assert torch.equal(pages, ref), step


def test_reference_tail_reuse_regression():
    """A call that completes a block from the tail and refills the same page's tail must encode the
    old tail rows (the reference once overwrote them first)."""
    from tests.helpers import expected_kv, make_cache as small_cache

    lc = small_cache("temporalkv-2bit", 1, False)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(21, 2, 16, generator=g), torch.randn(21, 2, 16, generator=g)
    pages = torch.zeros(4, 2, lc.layout.bytes, dtype=torch.uint8)
    table = torch.tensor([1, 2])
    for a, b in ((0, 12), (12, 21)):
        pos = torch.arange(a, b)
        reference.write_kv(lc, pages, k[a:b], v[a:b], pos, table[pos // lc.block_size])
    K, V = reference.gather_kv(lc, pages, table, 21)
    EK, EV = expected_kv(lc, k, v, 21)
    assert torch.equal(V, EV)


@pytest.mark.parametrize("batched", [False, True], ids=["cpu-prefill", "gpu-prefill"])
def test_triton_path_forward_serves_mixed_batches(monkeypatch, batched):
    """ops.triton_path.forward, what the backend calls on CUDA (here in the interpreter): steps mixing prefill
    chunks and decodes - decodes through the Triton decode kernel, prefills on the torch attention (the CPU's
    route) or all in one Triton flash launch (a GPU's, forced here), every token stored by the Triton encoder -
    give the torch path's outputs (within the dtype's tolerance) and the same pages bit for bit; ``ops.select``
    picks it when asked on the CPU and says why not where it cannot serve."""
    from vllm_temporalkv.ops import select, triton_path

    monkeypatch.setattr(triton_path, "_batched_prefill", lambda q: batched)

    case = ("temporalkv-2bit", 64, True, torch.bfloat16, 1)
    lens = [40, 23, 9]
    lc, pages, tables, kv, _ = _decode_setup(case, [n + 10 for n in lens], block_size=16, seed=5)
    ref = pages.clone()
    g = torch.Generator().manual_seed(6)
    # step 1: two prefill chunks and a whole short prompt; step 2: request 0 continues, 1 and 2 decode;
    # steps 3-4: decodes only (a uniform batch: one launch), blocks completing on the way
    # step 5: a chunk before two decodes (the decodes gathered), step 2 has them first (as vLLM reorders: a slice)
    steps = [{0: (0, 17), 1: (0, 22), 2: (0, 9)}, {1: (22, 23), 2: (9, 10), 0: (17, 40)},
             {0: (40, 41), 1: (23, 24), 2: (10, 11)}, {0: (41, 42), 1: (24, 25), 2: (11, 12)},
             {0: (42, 47), 1: (25, 26), 2: (12, 13)}]
    for calls in steps:
        key, val, pos, pid = _batch(kv, calls, tables, lc.block_size)
        n = key.shape[0]
        q = _randn(g, n, H * GQ, 64).to(lc.dtype)
        qsl = torch.tensor([0] + [b - a for a, b in calls.values()]).cumsum(0)
        sl = torch.tensor([b for _, b in calls.values()])
        bt = tables[list(calls)]
        want = reference.forward(lc, ref, q, key, val, qsl, sl, bt, pos, pid, 0.125, batch_invariant=False)
        # the backend's way: one plan per step (which requests decode, their device tensors), shared by the layers
        plan = triton_path.plan_step(qsl, sl, pages.device)
        assert plan.uniform_decode == all(b - a == 1 for a, b in calls.values())
        assert plan.prefills == [i for i, (a, b) in enumerate(calls.values()) if b - a > 1]
        assert plan.decode_prefix == (2 if list(calls) == [1, 2, 0] else 0)
        second_layer = pages.clone()
        got = triton_path.forward(lc, pages, q, key, val, qsl, sl, bt, pos, pid, 0.125, batch_invariant=False)
        assert (got.float() - want.float()).abs().max() <= _tol(lc.dtype) * max(1.0, want.float().abs().max().item())
        assert torch.equal(pages, ref), calls
        got2 = triton_path.forward(lc, second_layer, q, key, val, qsl, sl, bt, pos, pid, 0.125, batch_invariant=False,
                                   plan=plan)
        assert torch.equal(got2, got) and torch.equal(second_layer, pages)
    monkeypatch.setenv("VLLM_TEMPORALKV_OPS", "triton")
    mod, name = select(lc, torch.device(DEVICE))
    assert mod is triton_path and name.startswith("Triton ("), name
    windowed = make_cache("temporalkv-2bit", 64, False, torch.bfloat16, 1)
    windowed = windowed.replace(layout=PageLayout(get_format("temporalkv-2bit"), 64, 32, window=8))
    mod, name = select(windowed, torch.device(DEVICE))
    assert mod is reference and "recent window" in name, name


def test_uniform_decode_step_needs_no_host_tensors_and_skips_padding():
    """A decode-only step as a CUDA graph would replay it: every row's position and page come from the device
    seq_lens and block table (the host ``positions`` / ``page_ids`` passed are wrong on purpose and must not be
    read), and the batch is padded to a captured size with rows of seq_len 0 whose stale block-table rows point
    at live pages - the real rows' outputs match the torch path, the pages match it bit for bit (nothing
    written through the padding), and blocks complete on the way."""
    from vllm_temporalkv.ops import triton_path

    case = ("temporalkv-2bit", 64, True, torch.bfloat16, 1)
    lens = [23, 15, 9]  # positions 22, 14 (completes a block), 8
    lc, pages, tables, kv, q = _decode_setup(case, lens, block_size=16, seed=7)
    ctx = {r: (0, n - 1) for r, n in enumerate(lens)}
    reference.write_kv(lc, pages, *_batch(kv, ctx, tables, lc.block_size))
    ref = pages.clone()
    key, val, pos, pid = _batch(kv, {r: (n - 1, n) for r, n in enumerate(lens)}, tables, lc.block_size)
    qsl = torch.arange(len(lens) + 1)
    sl = torch.tensor(lens)
    want = reference.forward(lc, ref, q, key, val, qsl, sl, tables, pos, pid, 0.125, batch_invariant=False)
    # padded to 5 rows: seq_len 0, the block table's stale rows = live requests' pages
    P = 2
    g = torch.Generator().manual_seed(8)
    qp = torch.cat([q, _randn(g, P, H * GQ, 64).to(q.dtype)])
    kp = torch.cat([key, _randn(g, P, H, 64).to(key.dtype)])
    vp = torch.cat([val, _randn(g, P, H, 64).to(val.dtype)])
    slp = torch.cat([sl, torch.zeros(P, dtype=sl.dtype)]).to(DEVICE, torch.int32)
    btp = torch.cat([tables, tables[:P]])
    plan = triton_path.plan_step(torch.arange(len(lens) + P + 1), slp.cpu(), pages.device, btp.device, slp, btp,
                                 lc.block_size)
    assert plan.uniform_decode and plan.positions.tolist() == [22, 14, 8, -1, -1]
    assert plan.page_ids.tolist()[:3] == pid.tolist() and plan.page_ids.tolist()[3:] == [-1, -1]
    wrong = torch.zeros(len(lens) + P, dtype=torch.long, device=DEVICE)
    got = triton_path.forward(lc, pages, qp, kp, vp, None, None, btp, wrong, wrong, 0.125,
                              batch_invariant=False, plan=plan)
    n = len(lens)
    assert (got[:n].float() - want.float()).abs().max() <= _tol(lc.dtype) * max(1.0, want.float().abs().max().item())
    assert torch.isfinite(got[n:].float()).all()
    assert torch.equal(pages, ref)
    # vLLM's own padding of a captured batch: the padding requests have 0 query tokens (query_start_loc repeats its
    # last value) and seq_len 0 - still a uniform decode, one row per request, the same result
    vllm_qsl = torch.tensor([0, 1, 2, 3, 3, 3])
    plan2 = triton_path.plan_step(vllm_qsl, slp.cpu(), pages.device, btp.device, slp, btp, lc.block_size)
    assert plan2.uniform_decode and plan2.positions.tolist() == [22, 14, 8, -1, -1]
    assert plan2.query_start_loc.tolist() == list(range(n + P + 1))
    got2 = triton_path.forward(lc, pages, qp, kp, vp, None, None, btp, wrong, wrong, 0.125,
                               batch_invariant=False, plan=plan2)
    assert torch.equal(got2[:n], got[:n]) and torch.equal(pages, ref)
    # a zero-length request that is not trailing padding (a live sequence) keeps the mixed plan
    live = triton_path.plan_step(torch.tensor([0, 1, 1, 2]), torch.tensor([23, 15, 9]), pages.device)
    assert not live.uniform_decode


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gather_kv_bit_exact(case):
    """The prefill path's context read (triton_decode.gather_kv: the encoded blocks decoded by a kernel, sinks and
    tail copied) equals paged_torch.gather_kv bit for bit, over scattered pages and lengths that end mid-block,
    on a block boundary and inside the sinks."""
    lens = [75, 40, 16, 9, 5]
    lc, pages, tables, kv, _ = _decode_setup(case, lens, block_size=16, seed=11)
    reference.write_kv(lc, pages, *_batch(kv, {r: (0, n) for r, n in enumerate(lens)}, tables, lc.block_size))
    for r, n in enumerate(lens):
        for m in {n, n - 3}:
            want = reference.gather_kv(lc, pages, tables[r], m)
            got = triton_decode.gather_kv(lc, pages, tables[r], m)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (r, m)


PREFILL_CASES = [CASES[i] for i in (0, 3, 7)] + [("temporalkv-2bit", 256, False, torch.bfloat16, 1)]  # + 32-query tiles


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[IDS[i] for i in (0, 3, 7)] + ["temporalkv-2bit-d256"])
def test_prefill_attention_matches_the_oracle(case):
    """triton_prefill.prefill_attention (every prefill chunk of a step in one flash launch: decoded keys before each
    query's block, its own block's exact keys; the step's tokens stored in between, the completed blocks read back
    decoded) against paged_torch.forward's float64 attention and its pages, over chunks whose context is empty,
    ends mid-block, on a block boundary or inside the sinks, chunks that span several query tiles (> 64 rows) and
    a one-token chunk among them; rows of a request left out stay untouched."""
    from vllm_temporalkv.ops import triton_encode, triton_prefill

    # (context, chunk) per request
    plan = [(0, 75), (13, 40), (16, 9), (5, 1), (0, 3), (37, 70), (3, 20)]
    lc, pages, tables, kv, _ = _decode_setup(case, [c + n for c, n in plan], block_size=16, seed=7)
    reference.write_kv(lc, pages, *_batch(kv, {r: (0, c) for r, (c, _) in enumerate(plan) if c}, tables,
                                            lc.block_size))
    ref = pages.clone()
    key, val, pos, pid = _batch(kv, {r: (c, c + n) for r, (c, n) in enumerate(plan)}, tables, lc.block_size)
    g = torch.Generator().manual_seed(8)
    q = _randn(g, key.shape[0], H * GQ, case[1]).to(lc.dtype)
    qsl = torch.tensor([0] + [n for _, n in plan]).cumsum(0)
    sl = torch.tensor([c + n for c, n in plan])
    scale = case[1] ** -0.5
    want = reference.forward(lc, ref, q, key, val, qsl, sl, tables, pos, pid, scale)  # float64 attention, then writes
    skip = 3  # a request left out: its rows keep what out held
    got = torch.full_like(q, 7.0)
    triton_prefill.prefill_attention(lc, pages, q, key, val, qsl.tolist(), sl.tolist(), tables, scale, got,
                                     requests=[r for r in range(len(plan)) if r != skip], gather=triton_decode.gather_kv,
                                     write=lambda: triton_encode.write_kv(lc, pages, key, val, pos, pid))
    assert torch.equal(pages, ref)
    a, b = int(qsl[skip]), int(qsl[skip + 1])
    assert bool((got[a:b] == 7.0).all())
    got[a:b], want[a:b] = 0, 0
    err = (got.float() - want.float()).abs().amax((1, 2))
    assert err.max() <= _tol(lc.dtype) * max(1.0, want.float().abs().max().item()), err.tolist()
