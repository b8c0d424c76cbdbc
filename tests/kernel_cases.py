"""The kernel tests' shared cases (tests/test_triton_kernels.py, tests/test_cuda_kernel.py): every codebook method
and chunk length, the hybrid, both head dims and dtypes, outliers on and off, K/V pairs - and the random caches,
pages and batches they run on.  On the GPU where there is one, else the CPU (Triton's interpreter)."""

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import synthetic_artifact  # noqa: E402
from vllm_temporalkv.cache import LayerCache  # noqa: E402
from vllm_temporalkv.formats import get_format  # noqa: E402
from vllm_temporalkv.rope import Rope  # noqa: E402

H, GQ = 2, 3  # KV heads, query heads per KV head


def make_cache(fmt, D, outliers, dtype, layer, block_size=16):
    """A LayerCache of a synthetic artifact (layer 0: the hybrid's K is channel-chunked)."""
    from transformers import LlamaConfig

    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": H * GQ,
           "num_key_value_heads": H, "hidden_size": H * GQ * D, "vocab_size": 100,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    art = synthetic_artifact(cfg, formats=get_format(fmt).calibrated_formats)  # a K/V pair: its parts
    rope = Rope(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}), DEVICE)
    return LayerCache.build(fmt, layer, head_dim=D, block_size=block_size, dtype=dtype, rope=rope, artifact=art,
                            outliers=outliers, device=DEVICE)


# (format, head_dim, outliers, dtype, layer): every method and chunk length, the hybrid, both
# head dims and dtypes, outliers on and off - a covering set rather than the full product
CASES = [
    ("temporalkv-4bit", 64, True, torch.bfloat16, 1),  # l = 2
    ("temporalkv-2bit", 128, False, torch.float16, 1),  # l = 4
    ("temporalkv-1bit", 64, True, torch.float16, 1),  # l = 8
    ("temporalkv-2bit", 64, True, torch.float16, 0),  # hybrid: K channel, V temporal
    ("temporalkv-1bit", 128, False, torch.bfloat16, 0),  # hybrid, l = 8
    ("channelkv-2bit", 128, True, torch.bfloat16, 1),
    ("kvquant-4bit", 64, False, torch.bfloat16, 1),
    ("kvquant-2bit", 128, True, torch.float16, 1),
    ("kvquant-1bit", 64, True, torch.float16, 1),
    ("temporalkv-k4v2", 64, True, torch.bfloat16, 0),  # a K/V pair: K (channel, l = 2) and V (l = 4) codes differ
]
IDS = [f"{f}-d{d}-{'o1' if o else 'o0'}-{str(t)[6:]}-L{layer}" for f, d, o, t, layer in CASES]


def _randn(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def _batch(kv, calls, tables, block_size):
    """Concatenate one call's rows: {request: (start, end)} -> key, value, positions, page ids."""
    ks, vs, ps, ids = [], [], [], []
    for r, (a, b) in calls.items():
        pos = torch.arange(a, b, device=DEVICE)
        ks.append(kv[r][0][a:b])
        vs.append(kv[r][1][a:b])
        ps.append(pos)
        ids.append(tables[r][pos // block_size])
    return torch.cat(ks), torch.cat(vs), torch.cat(ps), torch.cat(ids)


def _decode_setup(case, lens, block_size=16, seed=2):
    fmt, D, outliers, dtype, layer = case
    lc = make_cache(fmt, D, outliers, dtype, layer, block_size)
    g = torch.Generator().manual_seed(seed)
    R = len(lens)
    per = -(-max(lens) // block_size)
    tables = torch.randperm(R * per, generator=g).reshape(R, per).to(DEVICE)  # scattered pages
    pages = torch.zeros(R * per, H, lc.layout.bytes, dtype=torch.uint8, device=DEVICE)
    kv = {r: (_randn(g, n, H, D, scale=2.0), _randn(g, n, H, D)) for r, n in enumerate(lens)}
    q = _randn(g, R, H * GQ, D).to(dtype)
    return lc, pages, tables, kv, q


def _tol(dtype):
    # the interpreter's bf16 casts truncate; on a GPU the dot products take half-precision inputs
    return 6e-2 if dtype == torch.bfloat16 else 6e-3
