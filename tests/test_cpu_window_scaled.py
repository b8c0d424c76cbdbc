"""The C++ kernels on what they read but do not write: the selective formats' scaled integer codes (one 8- or
4-bit value per float times its token's fp16 scale, csrc method SCALED), TaDA's (the per-token head mean minus
code x scale + min, 4 or 2 bits, csrc method TADA) and recent windows (the ring of exact
tokens in each page, codebook formats too).  Pages are written by the torch path (``encodes`` is False for them);
``gather_kv`` must give the torch path's K/V bit for bit, the decode attention the torch path's output within the
model dtype's rounding (and the float64 oracle's to float32 rounding), and ``forward`` - C++ reads, torch writes -
the torch path's pages and outputs over prefill chunks and decode steps."""

import pytest
import torch

from tests.cpu_cases import _tol, make_cache
from vllm_temporalkv import ops
from vllm_temporalkv.cache import LayerCache
from vllm_temporalkv.ops import cpu, paged_torch

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"C++ CPU kernels not built/loadable: {cpu._LOAD_ERROR}")

# (format, head_dim, dtype, window, block_size): the selective formats at their own window (128) and a short one
# across pages, codebook formats (temporal, hybrid channel K, channel) with a window, float32 models
CASES = [
    ("selective-int8", 64, torch.bfloat16, None, 256),
    ("selective-int4", 128, torch.float16, 16, 32),
    ("selective-int4", 64, torch.bfloat16, 8, 16),
    ("selective-int8", 64, torch.float32, 24, 32),
    ("temporalkv-2bit", 64, torch.bfloat16, 16, 32),
    ("channelkv-2bit", 128, torch.float16, 8, 16),
    ("temporalkv-4bit", 64, torch.float32, 32, 64),
    # TaDA: deviations from the per-token head mean (its channels split across the heads' records)
    ("tada-4bit", 64, torch.bfloat16, 16, 32),
    ("tada-2bit", 128, torch.float16, None, 256),
    ("tada-4bit", 96, torch.float32, 8, 16),
]
IDS = [f"{f}-d{d}-{str(t)[6:]}-w{w}-b{b}" for f, d, t, w, b in CASES]
LENS = [1, 7, 8, 9, 16, 17, 23, 24, 25, 33, 40, 41, 57, 64, 65, 100, 137, 150, 300]

# QJL (seed 002): keys scored from their sign sketches (csrc method QJL), values 2-bit with a scale and a min per 32
# channels (AFFINE); layer 1: the first layers' sketch (m = 4D, m_o = D), layer 20: the later ones' (m = m_o = 2D)
QJL_CASES = [("qjl", 64, torch.float32, 16, 32, 1), ("qjl", 64, torch.bfloat16, 16, 32, 20),
             ("qjl", 128, torch.float16, None, 256, 1), ("qjl", 96, torch.float32, 8, 16, 20)]
QJL_IDS = [f"{f}-d{d}-{str(t)[6:]}-w{w}-b{b}-layer{layer}" for f, d, t, w, b, layer in QJL_CASES]


@pytest.fixture
def each_isa():
    """Every ISA variant the build has, set in turn (``for isa in each_isa():``); the ISA in use before is restored
    when the test ends, passed or failed."""
    before = cpu.isa()

    def isas():
        for isa in cpu.supported_isas():
            cpu.set_isa(isa)
            yield isa

    yield isas
    cpu.set_isa(before)


def _cache(case, H=2, GQ=3):
    fmt, D, dtype, window, bs = case
    return make_cache(fmt, D, False, dtype, 1, H=H, GQ=GQ, block_size=bs, window=window)


def _write_prefix(lc, lens, H, D, seed, room=0):
    """Each request's first n - 1 tokens written by the torch path in one prefill call (random page tables with
    pages for ``room`` more tokens)."""
    g = torch.Generator().manual_seed(seed)
    R, bs = len(lens), lc.block_size
    per = -(-(max(lens) + room) // bs)
    tables = torch.randperm(R * per, generator=g).reshape(R, per)
    pages = torch.randint(0, 256, (R * per, H, lc.layout.bytes), dtype=torch.uint8, generator=g)
    kv = [(torch.randn(n, H, D, generator=g) * 2, torch.randn(n, H, D, generator=g)) for n in lens]
    ctx = [n - 1 for n in lens]
    qsl = torch.tensor([0] + ctx).cumsum(0)
    key = torch.cat([k[:c] for (k, _), c in zip(kv, ctx)]).to(lc.dtype)
    val = torch.cat([v[:c] for (_, v), c in zip(kv, ctx)]).to(lc.dtype)
    if lc.layout.window:
        paged_torch.write_kv_window(lc, pages, key, val, qsl, torch.tensor(ctx), tables)
    else:
        pos = torch.cat([torch.arange(c) for c in ctx])
        rows = torch.cat([torch.full((c,), r) for r, c in enumerate(ctx)])
        paged_torch.write_kv(lc, pages, key, val, pos, tables[rows, pos // bs])
    return pages, tables, kv


def test_the_cpu_path_serves_them():
    for case in CASES:
        lc = _cache(case)
        assert cpu.encodes(lc), case  # and writes them
        mod, name = ops.select(lc, torch.device("cpu"))
        assert mod is cpu, (case, name)
    qjl = LayerCache.build("qjl", 1, head_dim=64, block_size=256, dtype=torch.bfloat16, rope=None, num_kv_heads=2)
    mod, name = ops.select(qjl, torch.device("cpu"))
    assert mod is cpu and "cache update in torch" not in name, name  # QJL: the decode scores its key sketches, C++ writes them
    assert cpu.encodes(qjl)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gather_bit_exact(case, each_isa):
    H, D = 2, case[1]
    lc = _cache(case, H=H)
    pages, tables, _ = _write_prefix(lc, LENS, H, D, seed=1)
    for isa in each_isa():  # each ISA's unpacking of the packed codes (W = 16, 8, 4 lanes)
        for r, n in enumerate(LENS):
            # the n - 1 tokens written (a shorter prefix's ring slots may never have been written: a prefill
            # encodes the blocks that leave the window straight from its input)
            K, V = cpu.gather_kv(lc, pages, tables[r], n - 1)
            EK, EV = paged_torch.gather_kv(lc, pages, tables[r], n - 1)
            assert torch.equal(K, EK) and torch.equal(V, EV), (isa, r)


@pytest.mark.parametrize("case", [c for c in CASES if c[3]] + [("qjl", 64, torch.bfloat16, 16, 32)],
                         ids=[i for c, i in zip(CASES, IDS) if c[3]] + ["qjl-d64-bfloat16-w16-b32"])
def test_decode_steps_write_the_window_as_request_by_request(case):
    """A decode step's window update, all requests at once (paged_torch._write_decodes_window), against the
    request-by-request loop: the same page bytes over 12 steps from every prefix length (blocks leave the window at
    different steps, in the sinks' page and in later pages)."""
    fmt, D = case[0], case[1]
    H = 2
    lc = _cache(case, H=H)
    pages, tables, _ = _write_prefix(lc, LENS, H, D, seed=5, room=12)
    loop = pages.clone()
    g = torch.Generator().manual_seed(6)
    R = len(LENS)
    lens = torch.tensor(LENS) - 1
    region = lambda p: paged_torch.region_view(lc.layout, p, lc.store_dtype)  # noqa: E731
    for _ in range(12):
        lens = lens + 1
        k, v = (torch.randn(R, H, D, generator=g).to(lc.dtype) for _ in range(2))
        paged_torch.write_kv_window(lc, pages, k, v, torch.arange(R + 1), lens, tables)
        kh, vh = k.to(lc.store_dtype), v.to(lc.store_dtype)
        paged_torch._write_window_requests(lc, loop, region(loop), kh, vh, list(range(R + 1)), lens.tolist(), tables)
        assert torch.equal(pages, loop)


def _window_write(write, lc, pages, tables, lens, H, D, seed):
    """A prefill of every request in uneven chunks, then 12 decode steps of all of them, through ``write``
    (cpu.write_kv_window or the torch path's): the pages after each call."""
    g = torch.Generator().manual_seed(seed)
    R, out = len(lens), []
    done = [0] * R
    for cut in (0.3, 0.7, 1.0):  # chunked prefills: several requests' rows in one call, some with none
        ends = [max(done[r], int(n * cut)) for r, n in enumerate(lens)]
        qsl = torch.tensor([0] + [e - d for e, d in zip(ends, done)]).cumsum(0)
        k, v = (torch.randn(int(qsl[-1]), H, D, generator=g).mul(2).to(lc.dtype) for _ in range(2))
        write(lc, pages, k, v, qsl, torch.tensor(ends), tables)
        out.append(pages.clone())
        done = ends
    n = torch.tensor(lens)
    for _ in range(12):
        n = n + 1
        k, v = (torch.randn(R, H, D, generator=g).to(lc.dtype) for _ in range(2))
        write(lc, pages, k, v, torch.arange(R + 1), n, tables)
        out.append(pages.clone())
    return out


@pytest.mark.parametrize("H", [2, 3])
@pytest.mark.parametrize("case", [c for c in CASES if c[3]], ids=[i for c, i in zip(CASES, IDS) if c[3]])
def test_cpp_window_write_is_the_torch_path(case, H, each_isa):
    """cpu.write_kv_window (the C++ encoders of codebook, selective and TaDA codes, blocks leaving the window from
    this call's rows or the ring, then the ring and sink writes) against the torch path: the same page bytes after
    every chunked prefill call and decode step, on every ISA."""
    fmt, D = case[0], case[1]
    lc = _cache(case, H=H)
    lens = LENS[::2]
    g = torch.Generator().manual_seed(8)
    per = -(-(max(lens) + 12) // lc.block_size)
    tables = torch.randperm(len(lens) * per, generator=g).reshape(len(lens), per)
    pages0 = torch.randint(0, 256, (len(lens) * per, H, lc.layout.bytes), dtype=torch.uint8, generator=g)
    want = _window_write(paged_torch.write_kv_window, lc, pages0.clone(), tables, lens, H, D, seed=9)
    for isa in each_isa():
        got = _window_write(cpu.write_kv_window, lc, pages0.clone(), tables, lens, H, D, seed=9)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (isa, i)


@pytest.mark.parametrize("case", QJL_CASES + [("qjl", 64, torch.bfloat16, 0, 32, 1)],
                         ids=QJL_IDS + ["qjl-d64-bfloat16-w0-b32-layer1"])
def test_cpp_qjl_write_is_the_torch_path(case, each_isa):
    """QJL's C++ encoders (sign sketches of the keys under encode_keys' float64 contract - a float32 screen, float64
    where its rounding bound cannot decide -, the outlier channels, the norms; the values' affine codes) against the
    torch path through chunked prefills and decode steps: the same page bytes on every ISA.  Keys tiny enough
    (~1e-33) that every sign goes to the float64 sums, keys zero off their outlier channels (S k_in = 0: sign bit
    0) or ~1e-12 of them there, and zero keys (every channel's sum of squares tied: the lowest channels) are
    written too."""
    fmt, D, dtype, window, bs, layer = case
    H = 2
    lc = make_cache(fmt, D, False, dtype, layer, H=H, GQ=1, block_size=bs, window=window)
    assert cpu.encodes(lc)
    lens = LENS[::2]
    g = torch.Generator().manual_seed(11)
    per = -(-(max(lens) + 12) // bs)
    tables = torch.randperm(len(lens) * per, generator=g).reshape(len(lens), per)
    pages0 = torch.randint(0, 256, (len(lens) * per, H, lc.layout.bytes), dtype=torch.uint8, generator=g)
    if lc.layout.window:
        writers = (paged_torch.write_kv_window, cpu.write_kv_window)
        want = _window_write(writers[0], lc, pages0.clone(), tables, lens, H, D, seed=12)
    else:
        def writer(write):
            def w(lc, pages, k, v, qsl, ends, tables):
                rows = [(r, p) for r in range(len(ends)) for p in range(int(ends[r]) - int(qsl[r + 1] - qsl[r]),
                                                                          int(ends[r]))]
                pos = torch.tensor([p for _, p in rows], dtype=torch.long)
                pid = torch.tensor([int(tables[r, p // bs]) for r, p in rows], dtype=torch.long)
                write(lc, pages, k, v, pos, pid)
            return w
        writers = (writer(paged_torch.write_kv), writer(cpu.write_kv))
        want = _window_write(writers[0], lc, pages0.clone(), tables, lens, H, D, seed=12)
    for isa in each_isa():
        got = _window_write(writers[1], lc, pages0.clone(), tables, lens, H, D, seed=12)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (isa, i)
        # the float64 fallback for every sign, and S k_in = 0
        # (in_scale: the non-outlier channels' size; 1e-12: their share of the norm is below float64's
        # rounding of the whole, so the screen's bound must come from their own sum of squares)
        for k_scale, in_scale in ((1e-33, 1.0), (1.0, 0.0), (1.0, 1e-12), (0.0, 1.0)):  # (0: every channel tied)
            pages = pages0.clone(), pages0.clone()
            k = torch.randn(40, H, D, generator=torch.Generator().manual_seed(13)) * k_scale
            k[:, :, 8:] *= in_scale  # (the outliers: the 8 channels of largest sum of squares, then these)
            v = torch.randn(40, H, D, generator=torch.Generator().manual_seed(14))
            k, v = k.to(dtype), v.to(dtype)
            for w, p in zip(writers, pages):
                w(lc, p, k, v, torch.tensor([0, 40]), torch.tensor([40]), tables[:1])
            assert torch.equal(pages[0], pages[1]), (isa, k_scale)


@pytest.mark.parametrize("fmt,H", [("tada-4bit", 8), ("tada-2bit", 16), ("selective-int4", 3)])
def test_cpp_scaled_write_without_window_is_the_torch_path(fmt, H):
    """The scaled encoders through write_kv (no recent window: blocks completed by this call's tokens or by the
    tail): TaDA's head mean over 8 and 16 heads (torch's sum order), the same page bytes as the torch path; over
    16 heads the torch path writes (its sum is no longer in head order)."""
    D, bs = 64, 32
    lc = make_cache(fmt, D, False, torch.bfloat16, 1, H=H, GQ=1, block_size=bs, window=0)
    g = torch.Generator().manual_seed(4)
    lens = [5, 8, 17, 40, 71]
    tables = torch.randperm(len(lens) * 3, generator=g).reshape(len(lens), 3)
    pages0 = torch.randint(0, 256, (len(lens) * 3, H, lc.layout.bytes), dtype=torch.uint8, generator=g)
    got, want = pages0.clone(), pages0.clone()
    for lo, hi in ((0, 0.5), (0.5, 1.0)):  # two chunks: the second completes blocks begun in the tail
        rows = [(r, p) for r, n in enumerate(lens) for p in range(int(n * lo), int(n * hi))]
        pos = torch.tensor([p for _, p in rows])
        pid = torch.tensor([int(tables[r, p // bs]) for r, p in rows])
        k, v = (torch.randn(len(rows), H, D, generator=g).to(lc.dtype) for _ in range(2))
        cpu.write_kv(lc, got, k, v, pos, pid)
        paged_torch.write_kv(lc, want, k, v, pos, pid)
        assert torch.equal(got, want)
    assert cpu.encodes(lc, got, H) == (H <= 16)
    assert not cpu.encodes(lc, got, 17) or fmt.startswith("selective")


@pytest.mark.parametrize("H", [3, 8])
def test_tada_head_mean_shares_with_a_remainder(H, each_isa):
    """3 KV heads of 64 channels: each head's record keeps a share of 22, 22 and 20 channels of the per-token head
    mean, so a share's last vector overlaps the one before it; 8 heads: shares of 8 channels, narrower than an
    AVX-512 vector (the decoder assembles the mean first there).  Every ISA, bit for bit the torch path."""
    D = 64
    lc = make_cache("tada-4bit", D, False, torch.bfloat16, 1, H=H, GQ=3, block_size=32, window=16)
    pages, tables, _ = _write_prefix(lc, LENS[-4:], H, D, seed=4)
    for isa in each_isa():
        for r, n in enumerate(LENS[-4:]):
            got = cpu.gather_kv(lc, pages, tables[r], n - 1)
            want = paged_torch.gather_kv(lc, pages, tables[r], n - 1)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (isa, r)


@pytest.mark.parametrize("GQ", [3, 5])
@pytest.mark.parametrize("fmt,H", [("tada-4bit", 3), ("tada-4bit", 8), ("selective-int4", 3)])
def test_rows_decode_over_head_groups_and_mean_shares(fmt, H, GQ, each_isa):
    """The rows' formats' fast decode (AVX-512: keys scored and values accumulated straight from the codes, csrc
    rows_kscores / rows_pv, 4 query heads at a time: 5 are a group of 4 and one alone); TaDA's head mean assembled
    from the heads' shares, 22, 22 and 20 channels (3 heads: a share's last vector overlapping the one before it) or 8
    (8 heads: narrower than a vector, the rows decoded and stored first): every ISA, two splittings, against the torch
    path within the model dtype's rounding."""
    D = 64
    lc = make_cache(fmt, D, False, torch.bfloat16, 1, H=H, GQ=GQ, block_size=32, window=16)
    pages, tables, q, key, val, sl, scale, ref, _ = _decode_case(lc, H, GQ, D)
    for isa in each_isa():
        for split_tiles in (cpu.SPLIT_TILES, 1):
            out = cpu.decode_attention(lc, pages, q, key, val, sl, tables, scale, split_tiles=split_tiles)
            err = (out.float() - ref.float()).abs().max().item()
            assert err <= 2 * _tol(lc.dtype, ref), (isa, split_tiles, err)


def _decode_case(lc, H, GQ, D):
    """A decode step of every LENS request over pages the torch path wrote: the inputs, the torch path's output and
    the float64 oracle's (computed once: they dominate the cost)."""
    pages, tables, kv = _write_prefix(lc, LENS, H, D, seed=2)
    g = torch.Generator().manual_seed(3)
    R = len(LENS)
    q = torch.randn(R, H * GQ, D, generator=g).to(lc.dtype)
    key = torch.stack([k[-1] for k, _ in kv]).to(lc.dtype)
    val = torch.stack([v[-1] for _, v in kv]).to(lc.dtype)
    sl, scale = torch.tensor(LENS), D ** -0.5
    ref = paged_torch.paged_attention(lc, pages, q, key, val, torch.arange(R + 1), sl, tables, scale,
                                      batch_invariant=False)
    want64 = paged_torch.paged_attention(lc, pages, q, key, val, torch.arange(R + 1), sl, tables, scale,
                                         out=torch.empty(R, H * GQ, D, dtype=torch.float64), batch_invariant=True)
    return pages, tables, q, key, val, sl, scale, ref, want64


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_decode_matches_reference(case, each_isa):
    """Both decodes (exact, fast), two splittings, on every ISA variant, against the torch path (references computed
    once: they dominate the cost)."""
    H, GQ, D = 2, 3, case[1]
    lc = _cache(case, H=H, GQ=GQ)
    pages, tables, q, key, val, sl, scale, ref, want64 = _decode_case(lc, H, GQ, D)
    R = len(LENS)
    for isa in each_isa():
        for split_tiles in (cpu.SPLIT_TILES, 1):
            out = cpu.decode_attention(lc, pages, q, key, val, sl, tables, scale, split_tiles=split_tiles,
                                       exact=True)
            err = (out.float() - ref.float()).abs().amax((1, 2))
            assert err.max() <= _tol(lc.dtype, ref), (isa, split_tiles, err.tolist())
            got = cpu.decode_attention(lc, pages, q, key, val, sl, tables, scale, out=torch.empty(R, H * GQ, D),
                                       split_tiles=split_tiles, exact=True)  # float32 vs the float64 oracle
            assert (got.double() - want64).abs().max() <= 1e-5 * max(1.0, want64.abs().max().item()), isa
            out = cpu.decode_attention(lc, pages, q, key, val, sl, tables, scale, split_tiles=split_tiles)
            assert (out.float() - ref.float()).abs().max() <= 2 * _tol(lc.dtype, ref), (isa, split_tiles)




@pytest.mark.parametrize("GQ", [3, 4])
@pytest.mark.parametrize("case", QJL_CASES, ids=QJL_IDS)
def test_qjl_decode_scores_the_sketches(case, GQ, each_isa):
    """The decode attention straight from QJL's sketches (no key reconstructed) against the torch path, which decodes
    every key's surrogate k_hat and attends to it: on every ISA, both decodes, two splittings, within the model
    dtype's rounding (the torch path rounds k_hat to it, the kernel never forms it), and a float32 model's output
    equal to the float64 oracle's to float32 rounding.  3 and 4 query heads per KV head: the kernel scores 3 at a
    time on AVX-512 (4: a group of 3 and one alone)."""
    fmt, D, dtype, window, bs, layer = case
    H = 2
    lc = make_cache(fmt, D, False, dtype, layer, H=H, GQ=GQ, block_size=bs, window=window)
    assert cpu.supports(lc)
    pages, tables, q, key, val, sl, scale, ref, want64 = _decode_case(lc, H, GQ, D)
    for isa in each_isa():
        for split_tiles in (cpu.SPLIT_TILES, 1):
            for exact in (True, False):
                out = cpu.decode_attention(lc, pages, q, key, val, sl, tables, scale, split_tiles=split_tiles,
                                           exact=exact)
                err = (out.float() - ref.float()).abs().max().item()
                assert err <= _tol(dtype, ref), (isa, split_tiles, exact, err)
                if dtype == torch.float32:
                    assert (out.double() - want64).abs().max() <= 1e-5 * max(1.0, want64.abs().max().item())


@pytest.mark.parametrize("case", QJL_CASES, ids=QJL_IDS)
def test_qjl_gather_decodes_the_surrogate_keys(case, each_isa):
    """A prefill chunk's context from QJL's pages in C++: the values bit for bit the torch path's, the keys its
    surrogates k_hat summed in another order - equal to the torch path's but where float32 rounding moved a value
    across a model-dtype rounding boundary (at most one unit there; float32: float32 rounding), on every ISA."""
    fmt, D, dtype, window, bs, layer = case
    H = 2
    lc = make_cache(fmt, D, False, dtype, layer, H=H, GQ=3, block_size=bs, window=window)
    pages, tables, _ = _write_prefix(lc, LENS, H, D, seed=1)
    # a model-dtype unit (float32: the rounding of m + m_o signed terms)
    unit = {torch.float32: 2.0 ** -16, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    for isa in each_isa():
        same = total = 0
        for r, n in enumerate(LENS):
            K, V = cpu.gather_kv(lc, pages, tables[r], n - 1)
            EK, EV = paged_torch.gather_kv(lc, pages, tables[r], n - 1)
            assert torch.equal(V, EV), (isa, r)
            d = (K.float() - EK.float()).abs()
            assert (d <= unit * EK.float().abs().clamp_min(1.0)).all(), (isa, r, d.max().item())
            same, total = same + int((K == EK).sum()), total + K.numel()
        if dtype != torch.float32:
            assert same >= 0.98 * total, (isa, same, total)  # rounding flips, not another key


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], CASES[7], QJL_CASES[1][:5]],
                         ids=[IDS[1], IDS[3], IDS[4], IDS[7], "qjl-d64-bfloat16-w16-b32"])
def test_forward_steps_match_the_torch_path(case):
    """Serving steps through ``cpu.forward`` (C++ reads, torch writes) and ``paged_torch.forward``: prefill chunks
    that cross the window and page boundaries, steps mixing a decode and a chunk, then decode steps of a batch: the
    same pages, outputs within the model dtype's rounding."""
    H, GQ, D = 2, 3, case[1]
    lc = _cache(case, H=H, GQ=GQ)
    bs = lc.block_size
    g = torch.Generator().manual_seed(4)
    total = [90, 70]
    per = -(-max(total) // bs)
    tables = torch.randperm(2 * per, generator=g).reshape(2, per)
    pages = torch.zeros(2 * per, H, lc.layout.bytes, dtype=torch.uint8)
    ref = pages.clone()
    kv = [(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)) for n in total]
    done = [0, 0]
    steps = [[37, 20], [13, 30], [1, 5], [6, 1]] + [[1, 1]] * 12  # and steps mixing a decode and a chunk
    for step in steps:
        qsl = torch.tensor([0] + step).cumsum(0)
        pos = torch.cat([torch.arange(done[r], done[r] + c) for r, c in enumerate(step)])
        rows = torch.cat([torch.full((c,), r) for r, c in enumerate(step)])
        key = torch.cat([kv[r][0][done[r]:done[r] + c] for r, c in enumerate(step)]).to(lc.dtype)
        val = torch.cat([kv[r][1][done[r]:done[r] + c] for r, c in enumerate(step)]).to(lc.dtype)
        q = torch.randn(key.shape[0], H * GQ, D, generator=g).to(lc.dtype)
        sl = torch.tensor([d + c for d, c in zip(done, step)])
        pid = tables[rows, pos // bs]
        want = paged_torch.forward(lc, ref, q, key, val, qsl, sl, tables, pos, pid, D ** -0.5, batch_invariant=False)
        got = cpu.forward(lc, pages, q, key, val, qsl, sl, tables, pos, pid, D ** -0.5, batch_invariant=False)
        assert torch.equal(pages, ref), step
        assert (got.float() - want.float()).abs().max() <= 2 * _tol(lc.dtype, want), (step, done)
        done = sl.tolist()
