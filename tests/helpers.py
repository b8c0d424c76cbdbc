"""What several test files share (they import it from here, never from one another): a toy model config and its
synthetic artifact, a small paged cache and what it must read back, a streaming check of a cache against its
definition, and how a test runs a benchmark (``python -m benchmarks...``: tests never import ``benchmarks``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from vllm_temporalkv.artifact import Artifact, model_fingerprint
from vllm_temporalkv.calibration import codebook_keys
from vllm_temporalkv.codecs import make_codec
from vllm_temporalkv.codecs.quantizer import ChannelStats
from vllm_temporalkv.formats import BLOCK_TOKENS, get_format, parse_codebook_key
from vllm_temporalkv.cache import LayerCache
from vllm_temporalkv.ops.paged_torch import forward, gather_kv
from vllm_temporalkv.rope import Rope

ROOT = Path(__file__).resolve().parents[1]

CFG = {
    "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "hidden_size": 64, "vocab_size": 100,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
FORMATS = ["temporalkv-2bit", "channelkv-1bit", "kvquant-2bit"]


def synthetic_artifact(cfg=CFG, formats=FORMATS) -> Artifact:
    fp = model_fingerprint(cfg)
    H, D, L = fp["num_kv_heads"], fp["head_dim"], fp["num_layers"]
    g = torch.Generator().manual_seed(0)
    stats = {(i, kv): ChannelStats(torch.randn(H, D, generator=g), torch.rand(H, D, generator=g) + 0.5,
                                   -torch.ones(H, D) * 3, torch.ones(H, D) * 3)
             for i in range(L) for kv in "kv"}
    books = {}
    for key in codebook_keys(formats):
        shape = make_codec(*parse_codebook_key(key)).codebook_shape(H, D)
        for i in range(L):
            for kv in "kv":
                books[(i, kv, key)] = torch.randn(shape, generator=g).half()
    methods = {}
    for f in formats:
        fmt = get_format(f)
        m = ["channel", "temporal"] if fmt.hybrid else [fmt.method] * L
        methods[f] = {"k": m, "v": [fmt.method] * L}
    return Artifact(fp, formats, methods, {"data": "synthetic"}, stats, books, {})

# ---- a small paged cache (tests/test_paged_reference.py, tests/test_triton_kernels.py) ------------------------


def make_cache(fmt, layer, outliers, block_size=32, dtype=torch.bfloat16):
    from transformers import LlamaConfig

    art = synthetic_artifact(formats=FORMATS)
    rope = Rope(LlamaConfig(**{k: v for k, v in CFG.items() if k != "architectures"}))
    return LayerCache.build(fmt, layer, head_dim=art.fingerprint["head_dim"], block_size=block_size, dtype=dtype,
                            rope=rope, artifact=art, outliers=outliers)


def expected_kv(lc, k, v, n):
    """What the cache should return for the first n tokens of a sequence."""
    K, V = k[:n].to(lc.dtype).clone(), v[:n].to(lc.dtype).clone()
    full = n // BLOCK_TOKENS
    if full > 1:
        sl = slice(BLOCK_TOKENS, full * BLOCK_TOKENS)
        pos = torch.arange(BLOCK_TOKENS, full * BLOCK_TOKENS)
        pre = lc.rope.invert(k[sl].to(lc.dtype), pos).to(lc.dtype)
        K[sl] = lc.rope.apply(lc.k.decode(lc.k.encode(pre), len(pos), torch.float32), pos).to(lc.dtype)
        V[sl] = lc.v.roundtrip(v[sl].to(lc.dtype))
    return K, V

# ---- a cache streamed against its definition (tests/test_recent_window.py, tests/test_qjl_served.py) ----------

H, BS = 2, 32  # KV heads and page size of stream_and_check's caches


def stream_and_check(lc, reference, seed: int, n: int = 107):
    """Stream n random tokens through lc's pages in three chunkings (whole, uneven, token by token) - after every
    step gather_kv must equal ``reference(lc, k, v, b)``, the outputs must not depend on the chunking, and the last
    query must match dense attention over the reference K/V.  Returns the reference K of the first n - 1 tokens and
    the exact keys, for checks of what was compressed."""
    head_dim = lc.layout.head_dim
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, H, head_dim, generator=g) * 2, torch.randn(n, H, head_dim, generator=g)
    q = torch.randn(n, 2 * H, head_dim, generator=g)
    table = torch.tensor([5, 2, 7, 0])
    outs = []
    for cuts in ([0, n], [0, 3, 11, 12, 45, 90] + list(range(91, n + 1)), list(range(n + 1))):
        pages = torch.zeros(8, H, lc.layout.bytes, dtype=torch.uint8)
        out = torch.empty(n, 2 * H, head_dim)
        for a, b in zip(cuts, cuts[1:]):
            pos = torch.arange(a, b)
            forward(lc, pages, q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), torch.tensor([b]), table[None],
                    pos, table[pos // BS], 0.25, out=out[a:b], batch_invariant=False)
            K, V = gather_kv(lc, pages, table, b)
            EK, EV = reference(lc, k, v, b)
            assert torch.equal(K, EK) and torch.equal(V, EV), (a, b)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # dense attention for the last query over what it sees: the reference K/V before it, itself exact
    K0, V = reference(lc, k, v, n - 1)
    K = torch.cat([K0, lc.exact(k[n - 1:])]).float().repeat_interleave(2, 1)
    V = torch.cat([V, lc.exact(v[n - 1:])]).float().repeat_interleave(2, 1)
    p = torch.softmax(torch.einsum("hd,thd->ht", q[n - 1], K) * 0.25, -1)
    torch.testing.assert_close(outs[0][n - 1], torch.einsum("ht,thd->hd", p, V), rtol=1e-4, atol=1e-4)
    return K0, lc.exact(k[:n - 1])


# ---- benchmarks, run as programs ----------------------------------------------------------------------------


def headline_bytes() -> bytes | None:
    """benchmarks/results/headline.json as it is now (None where missing): read before and after a benchmark's
    --smoke run, which must leave it untouched."""
    path = ROOT / "benchmarks" / "results" / "headline.json"
    return path.read_bytes() if path.is_file() else None


def bench_env() -> dict:
    """The environment of a benchmark run from a test: this checkout first on the path."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def run_bench(module: str, *args, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` from the checkout's root, as a user runs it; output captured (shown on failure)."""
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=bench_env(),
                       capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"python -m {module} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def bench_call(code: str, *args, timeout: float = 1800):
    """A benchmark's own functions, called in a subprocess (``code`` imports them and prints one JSON value last;
    ``sys.argv[1:]`` are ``args``): what a check of a helper needs without importing ``benchmarks`` into pytest."""
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=bench_env(), capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"{code}\nexited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])
