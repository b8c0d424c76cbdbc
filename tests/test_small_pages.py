"""Small pages (temporalkv_small_pages, issue 34): code pages without the half-precision region, each request's sinks
and incomplete block in two exact pages of a second KV-cache group.  The layout's arithmetic, the torch path against
the default layout (bit for bit: the same math, other addresses), a prefix-cache hit simulated on the pages, and
vLLM 0.32's block manager driving the exact pages' group (ExactSlotsManager: allocation, caching, hits, freeing)."""

import pytest
import torch

from tests.helpers import CFG, synthetic_artifact
from vllm_temporalkv.cache import LayerCache
from vllm_temporalkv.formats import get_format
from vllm_temporalkv.layout import PageLayout, exact_record_bytes
from vllm_temporalkv.ops.paged_torch import ExactPages, forward, gather_kv
from vllm_temporalkv.page_views import exact_view
from vllm_temporalkv.rope import Rope

H, D = 2, 16


def test_page_arithmetic():
    """At 2 bits a 64-token code page is exactly one exact page (8 tokens of K and V in 16 bits): nothing padded.
    Per request of L tokens: cdiv(L, 64) code pages + 2 exact pages, against auto's L tokens of bf16 K/V."""
    two = PageLayout(get_format("temporalkv-2bit"), 64, 64, exact_pages=True)
    assert two.code_record_bytes == two.exact_bytes == exact_record_bytes(64) == two.bytes == 2048
    assert two.region_slots == 0 and two.k_codes == 0
    four = PageLayout(get_format("temporalkv-4bit"), 64, 64, exact_pages=True)
    assert four.bytes == four.code_record_bytes == 4096  # the exact pages padded to the code page
    default = PageLayout(get_format("temporalkv-2bit"), 64, 1024)
    L = 2048
    auto = L * 2 * 64 * 2
    small = (-(-L // 64) + 2) * two.bytes
    assert auto / small > 7.5 and auto / (2 * default.bytes) == pytest.approx(7.11, abs=0.01)
    with pytest.raises(ValueError, match="recent window"):
        PageLayout(get_format("temporalkv-2bit"), 64, 64, window=16, exact_pages=True)


def _caches(fmt="temporalkv-2bit"):
    from transformers import LlamaConfig

    art = synthetic_artifact()
    rope = Rope(LlamaConfig(**{k: v for k, v in CFG.items() if k != "architectures"}))
    big = LayerCache.build(fmt, 1, head_dim=D, block_size=32, dtype=torch.bfloat16, rope=rope, artifact=art)
    small = LayerCache.build(fmt, 1, head_dim=D, block_size=16, dtype=torch.bfloat16, rope=rope, artifact=art,
                             exact_pages=True)
    return big, small


def _run(lc, pages, table, exact, q, k, v, cuts, out):
    for a, b in zip(cuts, cuts[1:]):
        pos = torch.arange(a, b)
        forward(lc, pages, q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), torch.tensor([b]), table[None], pos,
                table[pos // lc.block_size], 0.25, out=out[a:b], batch_invariant=True,
                exact=None if exact is None else ExactPages(exact_view(lc.layout, pages, lc.store_dtype),
                                                            exact[None]))


@pytest.mark.parametrize("fmt", ["temporalkv-2bit", "kvquant-2bit"])
def test_small_pages_serve_what_the_default_pages_serve(fmt):
    """The same tokens streamed through both layouts in several chunkings: every attention output and every K/V
    read back are bit-identical; a request that hits the first two code pages and the sink page (its ring page
    full of another request's bytes) gives the outputs of the request that computed them."""
    big, small = _caches(fmt)
    g = torch.Generator().manual_seed(7)
    n = 107
    k, v = torch.randn(n, H, D, generator=g) * 2, torch.randn(n, H, D, generator=g)
    q = torch.randn(n, 2 * H, D, generator=g)
    ref = torch.empty(n, 2 * H, D)
    bpages = torch.zeros(8, H, big.layout.bytes, dtype=torch.uint8)
    _run(big, bpages, torch.tensor([5, 2, 7, 0]), None, q, k, v, [0, n], ref)
    for cuts in ([0, n], [0, 3, 11, 12, 45, 90] + list(range(91, n + 1))):
        pages = torch.zeros(16, H, small.layout.bytes, dtype=torch.uint8)  # code and exact pages: one pool
        table, exact = torch.tensor([9, 3, 12, 1, 6, 14, 0]), torch.tensor([11, 4])  # 7 code pages; sink, ring
        out = torch.empty(n, 2 * H, D)
        _run(small, pages, table, exact, q, k, v, cuts, out)
        assert torch.equal(out, ref), cuts
        K, V = gather_kv(small, pages, table, n, exact=(exact_view(small.layout, pages, small.store_dtype), exact[0],
                                                         exact[1]))
        EK, EV = gather_kv(big, bpages, torch.tensor([5, 2, 7, 0]), n)
        assert torch.equal(K, EK) and torch.equal(V, EV)
    # a prefix-cache hit at 32 tokens (two whole code pages): the hitting request shares code pages 9, 3 and sink
    # page 11, gets fresh pages for the rest and a ring page that holds someone else's bytes
    pages[2].random_(0, 256, generator=g)
    hit_table, hit_exact = torch.tensor([9, 3, 5, 8, 10, 13, 15]), torch.tensor([11, 2])
    out = torch.empty(n, 2 * H, D)
    _run(small, pages, hit_table, hit_exact, q, k, v, [32, 40, 41, 90, n], out)
    assert torch.equal(out[32:], ref[32:])


def test_block_manager_drives_the_exact_pages():
    """vLLM's own block pool and hybrid coordinator with a code group (full attention, 64-token pages) and the exact
    pages' group: a new request gets cdiv(L, 64) code pages and 2 exact pages; once it has computed a page its
    sink page is cached; a second request with the same first page hits the code page and the sink page (not the
    ring page); one whose sink page was evicted does not hit at all; freeing returns every page."""
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.request import Request
    from vllm.sampling_params import SamplingParams

    from vllm_temporalkv.vllm import compat

    compat.register_exact_slots()
    init_none_hash(sha256)
    bs = 64
    code = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.uint8)
    exact = compat.ExactSlotsSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.uint8)
    assert exact.page_size_bytes == code.page_size_bytes
    cfg = KVCacheConfig(num_blocks=40, kv_cache_tensors=[KVCacheTensor(size=40 * code.page_size_bytes, layers=["a", "b"],
                                                                       layer_stride=0, block_stride=code.page_size_bytes)],
                        kv_cache_groups=[KVCacheGroupSpec(["a"], code), KVCacheGroupSpec(["b"], exact)])
    coord = HybridKVCacheCoordinator(cfg, max_model_len=1024, max_in_flight_tokens=256, use_eagle=False,
                                     enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1,
                                     pcp_world_size=1, scheduler_block_size=bs, hash_block_size=bs)
    hasher = get_request_block_hasher(bs, sha256)

    def request(rid, tokens):
        return Request(rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                       block_hasher=hasher)

    pool = coord.block_pool
    free0 = pool.get_num_free_blocks()
    a = request("a", list(range(200)))
    assert coord.find_longest_cache_hit(a.block_hashes, 199)[1] == 0
    coord.allocate_new_blocks("a", 200, 200)
    code_a, exact_a = coord.get_blocks("a")
    assert len(code_a) == 4 and len(exact_a) == 2
    coord.cache_blocks(a, 200)
    b = request("b", list(range(130)) + [7] * 20)
    blocks, hit, _ = coord.find_longest_cache_hit(b.block_hashes, 149)
    assert hit == 128 and [x.block_id for x in blocks[0]] == [x.block_id for x in code_a[:2]]
    assert [x.block_id for x in blocks[1]] == [exact_a[0].block_id]  # the sink page, not the ring page
    # b takes the hit: the two code pages and a's sink page shared, a ring page and one more code page of its own
    assert coord.get_num_blocks_to_allocate("b", 150, blocks, 0, 128, 128, 150) == 1 + 1
    coord.allocate_new_computed_blocks("b", blocks, 128, 0)
    coord.allocate_new_blocks("b", 150, 150)
    code_b, exact_b = coord.get_blocks("b")
    assert code_b[:2] == code_a[:2] and len(code_b) == 3
    assert exact_b[0] is exact_a[0] and exact_b[1] not in exact_a and len(exact_b) == 2
    for rid in ("a", "b"):
        coord.free(rid)
    assert pool.get_num_free_blocks() == free0
    # evict a's sink page (allocate every free page to another request), then look again: no hit at all
    c = request("c", [1] * (bs * 19 - 1))
    coord.allocate_new_blocks("c", bs * 19 - 1, bs * 19 - 1)  # 19 code + 2 exact pages ...
    d = request("d", [2] * (bs * 16))
    coord.allocate_new_blocks("d", bs * 16, bs * 16)  # ... + 16 + 2 = every page of the pool (39, past the null page)
    assert pool.get_num_free_blocks() == 0
    assert coord.find_longest_cache_hit(b.block_hashes, 149)[1] == 0
    for rid in ("c", "d"):
        coord.free(rid)
    assert pool.get_num_free_blocks() == free0


def _kernel_caches(fmt, D=64, H=2, GQ=2):
    from transformers import LlamaConfig

    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": H * GQ,
           "num_key_value_heads": H, "hidden_size": H * GQ * D, "vocab_size": 100,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    art = synthetic_artifact(cfg, formats=get_format(fmt).calibrated_formats)
    rope = Rope(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    kw = dict(head_dim=D, dtype=torch.bfloat16, rope=rope, artifact=art)
    return LayerCache.build(fmt, 1, block_size=32, **kw), LayerCache.build(fmt, 1, block_size=16, exact_pages=True,
                                                                          **kw)


def _lockstep(ops, lc, pages, tables, exact, q, k, v, cuts, out):
    """Requests r = 0.. R-1 (the same tokens, their own pages) stepped together: at each step every request
    sends its tokens [a, b) - one token: a decode (the fused kernel), more: a prefill chunk."""
    R = len(tables)
    for a, b in zip(cuts, cuts[1:]):
        pos = torch.arange(a, b)
        qsl = torch.arange(R + 1) * (b - a)
        bt = torch.stack(tables)
        rows = lambda x: torch.cat([x[a:b]] * R)  # noqa: E731
        ep = None if exact is None else ExactPages(exact_view(lc.layout, pages, lc.store_dtype), torch.stack(exact))
        o = torch.empty(R * (b - a), q.shape[1], q.shape[2])
        ops.forward(lc, pages, rows(q), rows(k), rows(v), qsl, torch.full((R,), b), bt, pos.repeat(R),
                    torch.cat([t[pos // lc.block_size] for t in tables]), 0.125, out=o, batch_invariant=False,
                    exact=ep)
        out[a:b] = o[: b - a]
        for r in range(1, R):
            assert torch.equal(o[r * (b - a): (r + 1) * (b - a)], o[: b - a]), (a, b, r)


@pytest.mark.parametrize("fmt", ["temporalkv-2bit", "kvquant-2bit", "temporalkv-1bit"])
def test_cpu_kernels_serve_small_pages_like_the_default_pages(fmt):
    """The C++ path (fused decode, prefill chunks written then gathered) on small pages against itself on the
    default pages: the same tokens of two requests stepped together give bit-identical outputs and pages that
    read back the same K/V (each request's sink and ring pages its own)."""
    from vllm_temporalkv.ops import cpu

    if not cpu.available():
        pytest.skip(f"C++ CPU kernels not built/loadable: {cpu._LOAD_ERROR}")
    big, small = _kernel_caches(fmt)
    assert cpu.supports(big) and cpu.supports(small)
    g = torch.Generator().manual_seed(11)
    n, Hk, D = 90, 2, 64
    k, v = torch.randn(n, Hk, D, generator=g) * 2, torch.randn(n, Hk, D, generator=g)
    q = torch.randn(n, 2 * Hk, D, generator=g)
    cuts = [0, 5, 6, 7, 29, 30, 31, 32, 50, 51] + list(range(52, n + 1))
    ref = torch.empty(n, 2 * Hk, D)
    bpages = torch.zeros(12, Hk, big.layout.bytes, dtype=torch.uint8)
    btables = [torch.tensor([5, 2, 7]), torch.tensor([0, 9, 3])]
    _lockstep(cpu, big, bpages, btables, None, q, k, v, cuts, ref)
    pages = torch.zeros(20, Hk, small.layout.bytes, dtype=torch.uint8)
    tables, exact = [torch.tensor([9, 3, 12, 1, 6, 14]), torch.tensor([2, 8, 10, 13, 15, 16])], \
        [torch.tensor([11, 4]), torch.tensor([17, 0])]
    out = torch.empty(n, 2 * Hk, D)
    _lockstep(cpu, small, pages, tables, exact, q, k, v, cuts, out)
    assert torch.equal(out, ref)
    region = exact_view(small.layout, pages, small.store_dtype)
    for t, x, bt in zip(tables, exact, btables):
        got = cpu.gather_kv(small, pages, t, n, exact=(region, x[0], x[1]))
        want = cpu.gather_kv(big, bpages, bt, n)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert all(torch.equal(a, b) for a, b in zip(got, gather_kv(small, pages, t, n, exact=(region, x[0], x[1]))))


def _mixed(ops, lc, pages, tables, exact, q, k, v, schedule, outs):
    """Requests stepped together on their own schedules (cut lists of one length): a step mixes decodes and
    prefill chunks; request r's tokens are q/k/v[r]."""
    for i in range(len(schedule[0]) - 1):
        spans = [(c[i], c[i + 1]) for c in schedule]
        qsl = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0)
        pos = torch.cat([torch.arange(a, b) for a, b in spans])
        pid = torch.cat([t[torch.arange(a, b) // lc.block_size] for t, (a, b) in zip(tables, spans)])
        cat = lambda x: torch.cat([x[r][a:b] for r, (a, b) in enumerate(spans)])  # noqa: E731
        ep = None if exact is None else ExactPages(exact_view(lc.layout, pages, lc.store_dtype), torch.stack(exact))
        o = torch.empty(int(qsl[-1]), q[0].shape[1], q[0].shape[2])
        ops.forward(lc, pages, cat(q), cat(k), cat(v), qsl, torch.tensor([b for _, b in spans]), torch.stack(tables),
                    pos, pid, 0.125, out=o, batch_invariant=False, exact=ep)
        for r, (a, b) in enumerate(spans):
            outs[r][a:b] = o[qsl[r]: qsl[r + 1]]


def test_cpu_kernels_small_pages_in_mixed_steps():
    """A step that mixes one request's decodes with another's prefill chunks (cpu.forward's split: the fused
    decode for some rows, write-then-gather for the rest): small pages give the default pages' outputs."""
    from vllm_temporalkv.ops import cpu

    if not cpu.available():
        pytest.skip(f"C++ CPU kernels not built/loadable: {cpu._LOAD_ERROR}")
    big, small = _kernel_caches("temporalkv-2bit")
    g = torch.Generator().manual_seed(5)
    n, Hk, D = 80, 2, 64
    k = [torch.randn(n, Hk, D, generator=g) for _ in range(2)]
    v = [torch.randn(n, Hk, D, generator=g) for _ in range(2)]
    q = [torch.randn(n, 2 * Hk, D, generator=g) for _ in range(2)]
    schedule = [[0, 37] + list(range(38, 58)) + [58, 59, 60, 80], [0, 3, 9, 12] + list(range(17, 77, 3)) + [79, 80]]
    assert len(schedule[0]) == len(schedule[1])
    ref, out = [torch.empty(n, 2 * Hk, D) for _ in range(2)], [torch.empty(n, 2 * Hk, D) for _ in range(2)]
    _mixed(cpu, big, torch.zeros(8, Hk, big.layout.bytes, dtype=torch.uint8), [torch.tensor([5, 2, 7]),
           torch.tensor([0, 6, 3])], None, q, k, v, schedule, ref)
    _mixed(cpu, small, torch.zeros(16, Hk, small.layout.bytes, dtype=torch.uint8),
           [torch.tensor([9, 3, 12, 1, 6]), torch.tensor([2, 8, 10, 13, 15])], [torch.tensor([11, 4]),
                                                                               torch.tensor([14, 0])],
           q, k, v, schedule, out)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_cpu_step_plan_is_shared_by_layers_not_their_pages():
    """The backend derives a step's plan once (``cpu.plan_step``: host lists, int32 tables, the exact pages' numbers)
    and hands it to every layer: two layers - their own pages and exact regions, one block table and exact table, as
    vLLM gives them - stepped together on one plan per step give what each gives alone (a value of one layer's
    pages kept in the plan would land in the other's)."""
    from vllm_temporalkv.ops import cpu

    if not cpu.available():
        pytest.skip(f"C++ CPU kernels not built/loadable: {cpu._LOAD_ERROR}")
    _, small = _kernel_caches("temporalkv-2bit")
    g = torch.Generator().manual_seed(8)
    n, Hk, D, L = 60, 2, 64, 2
    qkv = [[[torch.randn(n, h, D, generator=g) for _ in range(2)] for h in (2 * Hk, Hk, Hk)] for _ in range(L)]
    schedule = [[0, 21] + list(range(22, 42)) + [42, 60], [0, 3, 9] + list(range(12, 50, 2)) + [59, 60]]
    assert len(schedule[0]) == len(schedule[1])
    tables = [torch.tensor([9, 3, 12, 1, 6]), torch.tensor([2, 8, 10, 13, 15])]
    exact = [torch.tensor([11, 4]), torch.tensor([14, 0])]
    alone = []
    for q, k, v in qkv:
        outs = [torch.empty(n, 2 * Hk, D) for _ in range(2)]
        _mixed(cpu, small, torch.zeros(16, Hk, small.layout.bytes, dtype=torch.uint8), tables, exact, q, k, v,
               schedule, outs)
        alone.append(outs)
    pages = [torch.zeros(16, Hk, small.layout.bytes, dtype=torch.uint8) for _ in range(L)]
    together = [[torch.empty(n, 2 * Hk, D) for _ in range(2)] for _ in range(L)]
    bt, et = torch.stack(tables), torch.stack(exact)
    for i in range(len(schedule[0]) - 1):
        spans = [(c[i], c[i + 1]) for c in schedule]
        qsl = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0)
        sl = torch.tensor([b for _, b in spans])
        pos = torch.cat([torch.arange(a, b) for a, b in spans])
        pid = torch.cat([t[torch.arange(a, b) // small.block_size] for t, (a, b) in zip(tables, spans)])
        plan = cpu.plan_step(qsl, sl, block_tables=bt)
        for layer, (q, k, v) in enumerate(qkv):
            cat = lambda x: torch.cat([x[r][a:b] for r, (a, b) in enumerate(spans)])  # noqa: E731
            ep = ExactPages(exact_view(small.layout, pages[layer], small.store_dtype), et)
            o = torch.empty(int(qsl[-1]), 2 * Hk, D)
            cpu.forward(small, pages[layer], cat(q), cat(k), cat(v), qsl, sl, bt, pos, pid, 0.125, out=o,
                        batch_invariant=False, plan=plan, exact=ep)
            for r, (a, b) in enumerate(spans):
                together[layer][r][a:b] = o[qsl[r]: qsl[r + 1]]
    assert all(torch.equal(a, b) for x, y in zip(together, alone) for a, b in zip(x, y))
