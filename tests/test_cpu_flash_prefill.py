"""The fast prefill on torch's flash kernel (ops/cpu_flash.py, the default for a bf16 model on an AMX CPU): the
attention ops.cpu.prefill_attention defines, from three parts merged by their log-sum-exps, within bf16 rounding;
served through ops.cpu.forward when selected; and when the auto setting selects it."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_cases import _prefill_dense, make_cache
from vllm_temporalkv.cpu_isa import cpu_flags
from vllm_temporalkv.ops import cpu, cpu_flash, paged_torch

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ extension (the served path) is not built")

# bf16 GEMMs inside flash (scores and weights rounded to bf16) and bf16 partial outputs: ~2^-8 of the largest output
FLASH_TOL = 1.5e-2


@pytest.mark.parametrize("window", [0, 8, 32], ids=["own-block", "window8", "window32"])
@pytest.mark.parametrize("masked", [False, True], ids=["split", "masked"])
@pytest.mark.parametrize("H,G,D", [(3, 3, 64), (2, 4, 128), (1, 1, 96)])
def test_flash_prefill_matches_the_definition(H, G, D, masked, window, monkeypatch):
    """Chunks at offsets inside the sinks, inside and on block boundaries, and deep in a context (where part (a),
    the decoded keys every query sees, exists), of lengths 1 .. 640: within bf16 rounding of the float64
    definition.  Decoded and exact keys are independent here, so taking one for the other fails by O(1).  Parts
    (a) and (b) as two calls (split) and as one masked call (what short chunks take): a mask one key off fails.
    With a recent window the band part (d) in blocks of 16 queries (several blocks per chunk; a band one key too
    long or short fails, as does (c) not moved back by the window)."""
    monkeypatch.setattr(cpu_flash, "MASKED_MAX", 1 << 40 if masked else 0)
    monkeypatch.setattr(cpu_flash, "BAND_ROWS", 16)
    g = torch.Generator().manual_seed(5)
    n = 640
    q = torch.randn(n, H * G, D, generator=g).bfloat16()
    ke, ve, kd, vd = (torch.randn(n, H, D, generator=g).bfloat16() for _ in range(4))
    kd[200:240] *= 4  # a few large decoded scores
    cuts = [(0, 1), (0, 5), (3, 20), (7, 9), (8, 16), (13, 100), (64, 65), (100, 400), (333, 640), (630, 640)]
    for a, b in cuts + ([(0, 640), (30, 45)] if window else []):
        x = cpu._own_block(a, window)
        got = cpu_flash.flash_prefill(q[a:b], kd[:b], vd[:b], ke[x:b], ve[x:b], x, a, D ** -0.5, window=window)
        want = _prefill_dense(q[a:b], ke, ve, kd, vd, D ** -0.5, a, window=window)
        assert got.dtype == torch.bfloat16 and got.shape == (b - a, H * G, D)
        err = (got.double() - want).abs().max().item()
        assert err <= FLASH_TOL * want.abs().max().item(), (a, b, err)
        # and the C++ kernel's float32 answer to the same chunk, as closely
        ref = cpu.prefill_attention(q[a:b], kd[:b], vd[:b], ke[x:b], ve[x:b], x, a, D ** -0.5,
                                    out=torch.empty(b - a, H * G, D), window=window)
        assert (got.float() - ref).abs().max().item() <= FLASH_TOL * ref.abs().max().item(), (a, b)


def test_flash_prefill_gqa_is_the_repeated_heads_answer(monkeypatch):
    """Part (b) passes the KV heads as they are where torch's flash kernel maps query heads to them (``_flash_gqa``):
    bit for bit the answer with K/V repeated per query head, on chunks long enough to take the split (b) call."""
    if not cpu_flash._flash_gqa():
        pytest.skip("this torch's CPU flash kernel takes one K/V head per query head")
    monkeypatch.setattr(cpu_flash, "MASKED_MAX", 0)
    g = torch.Generator().manual_seed(7)
    H, G, D, n = 3, 3, 64, 700
    q = torch.randn(n, H * G, D, generator=g).bfloat16()
    ke, ve, kd, vd = (torch.randn(n, H, D, generator=g).bfloat16() for _ in range(4))
    for a, b, w in [(0, 700, 0), (40, 500, 0), (300, 700, 0), (0, 640, 32), (129, 700, 16)]:
        x = cpu._own_block(a, w)
        args = (q[a:b], kd[:b], vd[:b], ke[x:b], ve[x:b], x, a, D ** -0.5)
        gqa = cpu_flash.flash_prefill(*args, window=w)
        with monkeypatch.context() as m:
            m.setattr(cpu_flash, "_flash_gqa", lambda: False)
            rep = cpu_flash.flash_prefill(*args, window=w)
        assert torch.equal(gqa, rep), (a, b, w)


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("isa", cpu.supported_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_merge_on_every_isa(isa, dtype, window):
    """Part (c) and the merge (C++ window_merge) on each ISA variant, from strided views (q and out rows of wider
    tensors, keys [n, H, D] slices of a K/V pair): float32 end to end is the C++ prefill kernel's answer to float32
    rounding (flash sums in another order), bf16 within bf16 rounding; with and without a recent window."""
    H, G, D = 2, 3, 64
    g = torch.Generator().manual_seed(9)
    n = 300
    wide = torch.randn(n, 2 * H * G, D, generator=g).to(dtype)
    q = wide[:, 1::2]  # [n, Hq, D], head stride 2 D
    kvd, kve = (torch.randn(n, 2, H, D, generator=g).to(dtype) for _ in range(2))
    kd, vd, ke, ve = kvd[:, 0], kvd[:, 1], kve[:, 0], kve[:, 1]
    before = cpu.isa()
    try:
        cpu.set_isa(isa)
        for a, b in [(0, 7), (5, 41), (16, 200), (150, 300)]:
            x = cpu._own_block(a, window)
            out = torch.zeros(b - a, 2 * H * G, D, dtype=dtype)[:, ::2]
            cpu_flash.flash_prefill(q[a:b], kd[:b], vd[:b], ke[x:b], ve[x:b], x, a, D ** -0.5, out, window=window)
            ref = cpu.prefill_attention(q[a:b].float(), kd[:b].float(), vd[:b].float(), ke[x:b].float(),
                                        ve[x:b].float(), x, a, D ** -0.5, out=torch.empty(b - a, H * G, D),
                                        window=window)
            tol = 2e-5 if dtype == torch.float32 else FLASH_TOL
            assert (out.float() - ref).abs().max().item() <= tol * ref.abs().max().item(), (a, b)
    finally:
        cpu.set_isa(before)


def test_window_merge_refuses_mixed_dtypes():
    q = torch.randn(4, 2, 64).bfloat16()
    k = torch.randn(4, 1, 64)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu._C.window_merge(q, k, k, k, k, 0, 0, 0.125, [], [], [], torch.empty_like(q), 0)


@pytest.mark.parametrize("fmt,window", [("temporalkv-2bit", None), ("temporalkv-2bit", 32), ("selective-int4", None),
                                        ("tada-4bit", None), ("qjl", None)])
def test_forward_serves_the_flash_prefill_when_selected(fmt, window, monkeypatch):
    """ops.cpu.forward on a bf16 model, prompts cut into chunks: with VLLM_TEMPORALKV_CPU_PREFILL=flash the outputs
    are the C++ kernel's within bf16 rounding, not bit for bit (so the flash kernel did serve), and the pages
    written for the same cuts are identical (the prefill attention does not touch the cache update); codebook codes
    with and without a recent window, and the calibration-free formats (whose window is on by default) - QJL's
    pages written and its keys decoded on the torch path, its chunks attending on flash / the C++ kernel all the
    same.  Both within bf16 rounding of the torch path's own attention (paged_torch.forward)."""
    D, n = 64, 600
    bs = 16 if fmt == "temporalkv-2bit" and window is None else 256  # a page holds the window and the tail
    lc = make_cache(fmt, D, fmt.startswith("temporalkv"), torch.bfloat16, 1, block_size=bs, window=window)
    assert (window is None and fmt == "temporalkv-2bit") or lc.layout.window  # selective / TaDA: 128 by default
    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(n, 2, D, generator=g).bfloat16(), torch.randn(n, 2, D, generator=g).bfloat16()
    q = torch.randn(n, 6, D, generator=g).bfloat16()
    table = torch.randperm(n // bs + 1, generator=g)
    runs = {}
    for mode in ("kernel", "flash"):
        monkeypatch.setattr(cpu, "PREFILL", mode)
        for cuts in ([0, n], [0, 3, 61, 64, 333, 590, n]):
            pages = torch.zeros(len(table), 2, lc.layout.bytes, dtype=torch.uint8)
            out = torch.empty(n, 6, D, dtype=torch.bfloat16)
            for a, b in zip(cuts, cuts[1:]):
                pos = torch.arange(a, b)
                out[a:b] = cpu.forward(lc, pages, q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]),
                                       torch.tensor([b]), table[None], pos, table[pos // bs], D ** -0.5,
                                       batch_invariant=False)
            runs[mode, len(cuts)] = out, pages
    ref = runs["kernel", 2][0]
    tol = FLASH_TOL * ref.float().abs().max().item()
    pages = torch.zeros(len(table), 2, lc.layout.bytes, dtype=torch.uint8)
    pos = torch.arange(n)
    want = paged_torch.forward(lc, pages, q, k, v, torch.tensor([0, n]), torch.tensor([n]), table[None], pos,
                               table[pos // bs], D ** -0.5, batch_invariant=False)
    assert torch.equal(pages, runs["kernel", 2][1])
    assert (want.float() - ref.float()).abs().max().item() <= tol
    for (mode, cuts), (out, pages) in runs.items():
        assert torch.equal(pages, runs["kernel", cuts][1])
        assert (out.float() - ref.float()).abs().max().item() <= tol
    assert not torch.equal(runs["flash", 2][0], ref)


@pytest.mark.parametrize("gqa", [True, False], ids=["gqa", "repeated-heads"])
def test_fused_flash_chunk_is_the_python_composition(gqa, monkeypatch):
    """A served chunk's flash path in one C++ call (prefill_chunk_flash: write, read back, the flash parts and the
    merge) against the same steps in Python (write_kv, gather_kv, cpu_flash.flash_prefill - what forward takes where
    the C++ encode does not serve): the same pages and outputs bit for bit, for chunks inside the sinks, short ones
    (one masked call) and a long one (parts (a) and (b) apart), with K/V heads passed as they are or repeated."""
    monkeypatch.setattr(cpu, "PREFILL", "flash")
    monkeypatch.setattr(cpu, "AMX_SHORT", False)  # (the AMX kernels: their own tests below)
    monkeypatch.setattr(cpu, "AMX_LONG", False)
    monkeypatch.setattr(cpu, "_flash_gqa", lambda: gqa)
    monkeypatch.setattr(cpu_flash, "_flash_gqa", lambda: gqa)
    D, n, bs = 64, 1000, 16
    lc = make_cache("temporalkv-2bit", D, True, torch.bfloat16, 1, block_size=bs)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(n, 2, D, generator=g).bfloat16(), torch.randn(n, 2, D, generator=g).bfloat16()
    q = torch.randn(n, 6, D, generator=g).bfloat16()
    table = torch.randperm(n // bs + 1, generator=g)
    cuts = [0, 3, 61, 64, 333, 373, n]
    assert cpu_flash.short_mask(40, 333, 3, torch.bfloat16) is not None  # the short chunks take the masked call
    assert cpu_flash.short_mask(n - 373, 373, 3, torch.bfloat16) is None  # and the last one the split
    runs = []
    for fused in (True, False):
        if not fused:  # forward's other route: the cache update in torch (bit-identical pages), then Python
            monkeypatch.setattr(cpu, "encodes", lambda *a, **kw: False)
        pages = torch.zeros(len(table), 2, lc.layout.bytes, dtype=torch.uint8)
        out = torch.empty(n, 6, D, dtype=torch.bfloat16)
        for a, b in zip(cuts, cuts[1:]):
            pos = torch.arange(a, b)
            out[a:b] = cpu.forward(lc, pages, q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), torch.tensor([b]),
                                   table[None], pos, table[pos // bs], D ** -0.5, batch_invariant=False)
        runs.append((out, pages))
    assert torch.equal(runs[0][1], runs[1][1])
    assert torch.equal(runs[0][0], runs[1][0])


@pytest.fixture(params=["tiles", "emulated"])
def amx(request):
    """The AMX kernels' tests run on the tiles where the CPU has them, and emulated (csrc/amx_emulate.h: the same
    code, each tile instruction in AVX512-BF16) wherever the CPU has AVX512-BF16 - so the code that serves on AMX
    Xeons is tested on the machines without tiles too."""
    if request.param == "tiles":
        if not cpu._C.amx_tiles():
            pytest.skip("no AMX tiles here (CPU or OS); the emulated run tests the same code")
        yield "tiles"
        return
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("emulating AMX tiles needs AVX512-BF16")
    cpu.set_amx_emulated(True)
    try:
        yield "emulated"
    finally:
        cpu.set_amx_emulated(False)


def _amx_runs(H, G, D, n, seed, cuts, switch, monkeypatch, fmt="temporalkv-2bit", window=None, bs=16):
    """A prompt of n tokens served through ops.cpu.forward at the cuts, by the C++ kernel, by the flash path with
    the AMX kernel named by ``switch`` (ops.cpu.AMX_SHORT / AMX_LONG; the other one off) off, and with it on:
    {(mode, on): (outputs, pages)}; asserts the pages bit-identical and every chunk's outputs within bf16 rounding
    of the C++ kernel's float32 attention."""
    lc = make_cache(fmt, D, fmt.startswith("temporalkv"), torch.bfloat16, 1, block_size=bs, H=H, GQ=G, window=window)
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, H, D, generator=g).bfloat16(), torch.randn(n, H, D, generator=g).bfloat16()
    q = torch.randn(n, H * G, D, generator=g).bfloat16()
    table = torch.randperm(n // bs + 1, generator=g)
    monkeypatch.setattr(cpu, "AMX_LONG" if switch == "AMX_SHORT" else "AMX_SHORT", False)
    runs = {}
    for mode, on in (("kernel", False), ("flash", False), ("flash", True)):
        monkeypatch.setattr(cpu, "PREFILL", mode)
        monkeypatch.setattr(cpu, switch, on)
        pages = torch.zeros(len(table), H, lc.layout.bytes, dtype=torch.uint8)
        out = torch.empty(n, H * G, D, dtype=torch.bfloat16)
        for a, b in zip(cuts, cuts[1:]):
            pos = torch.arange(a, b)
            out[a:b] = cpu.forward(lc, pages, q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), torch.tensor([b]),
                                   table[None], pos, table[pos // bs], D ** -0.5, batch_invariant=False)
        runs[mode, on] = (out, pages)
    ref = runs["kernel", False][0].float()
    tol = FLASH_TOL * ref.abs().max().item()
    for key, (out, pages) in runs.items():
        assert torch.equal(pages, runs["kernel", False][1]), key
        for a, b in zip(cuts, cuts[1:]):  # chunk by chunk: every kind of chunk within bf16 rounding
            assert (out[a:b].float() - ref[a:b]).abs().max().item() <= tol, (key, a, b)
    return runs


@pytest.mark.parametrize("H,G,D", [(3, 3, 64), (2, 4, 128), (1, 1, 96)])
def test_amx_short_chunks_match_the_kernel(H, G, D, amx, monkeypatch):
    """The short chunks of the flash path on AMX tiles (csrc/amx_attention.h: a prefix-cache hit's new tokens):
    served through ops.cpu.forward, chunk by chunk - at block boundaries and off them, 1 to 60 queries, over
    contexts of 8 to ~1000 (so the own-block rule, the folded query heads and the padded key and row tiles all
    vary) - within bf16 rounding of the C++ kernel's float32 attention on the same pages (which the two paths
    write bit-identically), and not the flash path's outputs bit for bit (the tiles did serve)."""
    n = 1000
    cuts = [0, 8, 9, 40, 41, 101, 161, 168, 200, 256, 257, 300, 333, 393, 430, 490, 550, 610, 670, 730, 790, 850, 910,
            940, 941, n]
    assert all(cpu_flash.short_mask(b - a, a, G, torch.bfloat16) is not None for a, b in zip(cuts[1:], cuts[2:]))
    runs = _amx_runs(H, G, D, n, 6, cuts, "AMX_SHORT", monkeypatch)  # (the first chunk, inside the sinks: flash's)
    got, flash = runs["flash", True][0], runs["flash", False][0]
    assert torch.equal(got[:8], flash[:8])  # the first chunk (inside the sinks) is not short-path work
    assert not torch.equal(got[8:], flash[8:])


@pytest.mark.parametrize("H,G,D", [(3, 3, 64), (2, 4, 128), (1, 1, 96)])
def test_amx_long_chunks_match_the_kernel(H, G, D, amx, monkeypatch):
    """The long chunks of the flash path on AMX tiles (csrc/amx_attention.h long_panel: a prompt's prefill chunks,
    flash-style over 256-key blocks with an online softmax): a 2001-token prompt served through ops.cpu.forward in
    chunks too long for one masked call - the first at position 0 (queries inside the sinks), one starting inside
    them (its exact keys begin with decoded sink rows), others at and off block boundaries, over up to ~1300 cached
    tokens (several key blocks, the panels' causal ends, padded row pairs) - within bf16 rounding of the C++
    kernel's float32 attention on the same pages, and not flash's outputs bit for bit (the tiles served)."""
    n = 2001
    cuts = [0, 5, 700, 1333, 1340, n]
    long_ = [(a, b) for a, b in zip(cuts, cuts[1:]) if cpu_flash.short_mask(b - a, a, G, torch.bfloat16) is None]
    assert len(long_) >= 3 and long_[0] == (0, 5)
    runs = _amx_runs(H, G, D, n, 7, cuts, "AMX_LONG", monkeypatch)
    got, flash = runs["flash", True][0], runs["flash", False][0]
    for a, b in long_[1:]:
        assert not torch.equal(got[a:b], flash[a:b]), (a, b)


@pytest.mark.parametrize("fmt,window,D", [("temporalkv-2bit", 32, 64), ("selective-int4", None, 128),
                                          ("tada-4bit", None, 64), ("qjl", None, 96)])
def test_amx_serves_recent_windows(fmt, window, D, amx, monkeypatch):
    """Chunks whose write and gather run in Python and would attend on flash (a recent window: the codebook formats'
    option, the calibration-free formats' default of 128) on the AMX long-chunk kernel instead (_C.amx_prefill, each
    query exact from its window's start): a 1500-token prompt in chunks of 3 to ~700 queries, inside the sinks, inside
    the first window and past it - within bf16 rounding of the C++ kernel's float32 attention, pages bit-identical,
    not flash's outputs bit for bit."""
    n = 1500
    cuts = [0, 3, 61, 200, 203, 900, n]
    runs = _amx_runs(2, 3, D, n, 8, cuts, "AMX_LONG", monkeypatch, fmt=fmt, window=window, bs=256)
    got, flash = runs["flash", True][0], runs["flash", False][0]
    for a, b in zip(cuts[1:], cuts[2:]):
        assert not torch.equal(got[a:b], flash[a:b]), (a, b)


def test_amx_emulation_is_the_tiles(monkeypatch):
    """On a CPU with tiles: the emulation (csrc/amx_emulate.h) serves a prompt's short and long chunks with the
    tiles' outputs up to the order of their float32 sums (almost every element equal; else one bf16 step, or 2^-10
    of the largest output where a score's last bit moves a softmax weight's bf16 rounding under an output near 0 -
    a misread tile layout is off by O(1)), so the emulated runs of the tests above speak for the tiles on the
    machines without them."""
    if not cpu._C.amx_tiles():
        pytest.skip("no AMX tiles here (CPU or OS) to hold the emulation against")
    H, G, D, n, bs = 2, 3, 64, 1200, 16
    lc = make_cache("temporalkv-2bit", D, True, torch.bfloat16, 1, block_size=bs, H=H, GQ=G)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(n, H, D, generator=g).bfloat16(), torch.randn(n, H, D, generator=g).bfloat16()
    q = torch.randn(n, H * G, D, generator=g).bfloat16()
    table = torch.randperm(n // bs + 1, generator=g)
    cuts = [0, 700, 720, 761, n]  # long, short, short, long
    monkeypatch.setattr(cpu, "PREFILL", "flash")
    outs = []
    for emulated in (False, True):
        cpu.set_amx_emulated(emulated)
        try:
            pages = torch.zeros(len(table), H, lc.layout.bytes, dtype=torch.uint8)
            out = torch.empty(n, H * G, D, dtype=torch.bfloat16)
            for a, b in zip(cuts, cuts[1:]):
                pos = torch.arange(a, b)
                out[a:b] = cpu.forward(lc, pages, q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]),
                                       torch.tensor([b]), table[None], pos, table[pos // bs], D ** -0.5,
                                       batch_invariant=False)
        finally:
            cpu.set_amx_emulated(False)
        outs.append(out.float())
    tiles, emulated = outs
    assert ((emulated - tiles).abs() <= 2 ** -7 * tiles.abs() + 2 ** -10 * tiles.abs().max()).all()
    assert (emulated == tiles).float().mean().item() >= 0.95


def test_the_server_log_names_where_prefill_attends(amx, monkeypatch):
    """ops.select's name for the C++ path (the server logs it once) says where a prefill chunk attends: nothing
    added for the C++ kernel; AMX tiles (emulated, where they are) where the flash path serves a layer they take;
    torch's flash kernel for what they do not (float32, a head dim over 128) or where switched off."""
    from vllm_temporalkv import ops

    name = lambda lc: ops.select(lc, torch.device("cpu"))[1]
    bf, f32, odd = (make_cache("temporalkv-2bit", D, True, dt, 1) for D, dt in
                    [(64, torch.bfloat16), (64, torch.float32), (160, torch.bfloat16)])
    tiles = "emulated AMX tiles" if amx == "emulated" else "AMX tiles"
    monkeypatch.setattr(cpu, "PREFILL", "kernel")
    assert name(bf) == f"C++ ({cpu.isa()})"
    monkeypatch.setattr(cpu, "PREFILL", "flash")
    assert name(bf) == f"C++ ({cpu.isa()}; prefill attention on {tiles})"
    assert name(f32).endswith("; prefill attention on torch's flash kernel)")
    assert name(odd).endswith("; prefill attention on torch's flash kernel)")
    monkeypatch.setattr(cpu, "AMX_LONG", False)
    assert name(bf).endswith(f"on {tiles}, long chunks on torch's flash kernel)")
    monkeypatch.setattr(cpu, "AMX_SHORT", False)
    assert name(bf).endswith("; prefill attention on torch's flash kernel)")


def test_auto_selects_flash_for_bf16_on_amx_only(monkeypatch):
    """The auto setting: a bf16 model on an AMX CPU, not with VLLM_TEMPORALKV_CPU_EXACT=1; flash / kernel as
    forced; a bad value of the variable is refused at import with the fix named."""
    monkeypatch.setattr(cpu, "PREFILL", "auto")
    monkeypatch.setattr(cpu, "EXACT", False)
    for cls, dtype, want in [("amx", torch.bfloat16, True), ("amx", torch.float32, False),
                             ("avx512bf16", torch.bfloat16, False), ("avx2", torch.bfloat16, False)]:
        monkeypatch.setattr(cpu, "cpu_class", lambda c=cls: c)
        assert cpu.use_flash_prefill(dtype) is want, (cls, dtype)
    monkeypatch.setattr(cpu, "cpu_class", lambda: "amx")
    monkeypatch.setattr(cpu, "EXACT", True)
    assert not cpu.use_flash_prefill(torch.bfloat16)
    monkeypatch.setattr(cpu, "PREFILL", "flash")
    assert cpu.use_flash_prefill(torch.float32)
    monkeypatch.setattr(cpu, "PREFILL", "kernel")
    monkeypatch.setattr(cpu, "EXACT", False)
    assert not cpu.use_flash_prefill(torch.bfloat16)
