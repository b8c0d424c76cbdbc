"""What the kernel benchmarks share (benchmarks/kernels: Triton on a GPU, benchmarks/kernels_cpu: C++ on the
CPU, benchmarks/gpu/decode_sweep.py): the model shapes, synthetic paged caches full of random codes, the dense
baselines' arithmetic, and the decode-grid plot."""

from __future__ import annotations

import types
from pathlib import Path

import torch

SHAPES = {  # query heads, KV heads, head_dim, RoPE theta
    "llama8b": dict(hq=32, h=8, d=128, theta=500000.0),
    "smollm2": dict(hq=9, h=3, d=64, theta=100000.0),
}
DEFAULT_BLOCK_SIZE = 1024  # the plugin's default page size (vllm/plugin.py)
BLOCK, SINKS = 8, 8  # formats.BLOCK_TOKENS, SINK_TOKENS (asserted by check_block_geometry)


def check_block_geometry() -> None:
    from vllm_temporalkv.formats import BLOCK_TOKENS, SINK_TOKENS

    assert (BLOCK, SINKS) == (BLOCK_TOKENS, SINK_TOKENS)


# ---- synthetic caches ----------------------------------------------------------------------------


def parse_format(name: str) -> tuple[str, bool]:
    """'temporalkv-2bit-o1' -> ('temporalkv-2bit', True): "-o1" turns on the 1% outliers."""
    return name.removesuffix("-o1"), name.endswith("-o1")


def make_layer_cache(shape: str, fmt_name: str, dtype, block_size: int, hybrid_k: bool, device, seed: int):
    """A layer cache built by the factory (``LayerCache.build``) from a one-layer synthetic artifact: random fp16
    centroids and channel statistics (timing does not depend on their values).  hybrid_k: K channel-chunked, as on
    the layers where the hybrid TemporalKV picks channel chunking."""
    from vllm_temporalkv.artifact import Artifact, model_fingerprint
    from vllm_temporalkv.cache import LayerCache
    from vllm_temporalkv.calibration import codebook_keys
    from vllm_temporalkv.codecs import make_codec
    from vllm_temporalkv.codecs.quantizer import ChannelStats
    from vllm_temporalkv.formats import check_head_dim, get_format, parse_codebook_key
    from vllm_temporalkv.rope import Rope

    sh = SHAPES[shape]
    H, D = sh["h"], sh["d"]
    base, outliers = parse_format(fmt_name)
    fmt = get_format(base)
    check_head_dim(fmt, D)
    g = torch.Generator().manual_seed(seed)
    cfg = types.SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=1, num_attention_heads=sh["hq"],
                                num_key_value_heads=H, head_dim=D, hidden_size=sh["hq"] * D, vocab_size=1,
                                rope_parameters={"rope_type": "default", "rope_theta": sh["theta"]})
    if not fmt.needs_calibration:  # selective, TaDA, QJL: no artifact; layer 0 (QJL: the first layers' larger sketch)
        if outliers:
            raise ValueError(f"{base} keeps no outliers (no '-o1')")
        return LayerCache.build(base, 0, head_dim=D, block_size=block_size, dtype=dtype, rope=Rope(cfg, device),
                                num_kv_heads=H, device=device)
    parts = fmt.calibrated_formats
    books = {(0, kv, key): torch.randn(make_codec(*parse_codebook_key(key)).codebook_shape(H, D), generator=g).half()
             for key in codebook_keys(parts) for kv in "kv"}
    stats = {}
    for kv in "kv":
        mean, std = torch.randn(H, D, generator=g) * 0.5, torch.rand(H, D, generator=g) + 0.5
        stats[(0, kv)] = ChannelStats(mean, std, mean - 2.5 * std, mean + 2.5 * std)
    methods = {p: {"k": ["channel" if hybrid_k and get_format(p).hybrid else get_format(p).method],
                   "v": [get_format(p).method]} for p in parts}
    art = Artifact(model_fingerprint(cfg), parts, methods, {"data": "random (speed only)"}, stats, books)
    return LayerCache.build(base, 0, head_dim=D, block_size=block_size, dtype=dtype, rope=Rope(cfg, device),
                            num_kv_heads=H, artifact=art, outliers=outliers, device=device)


def fill_pages(lc, B: int, L: int, H: int, D: int, device, written: int | None = None):
    """Pages of B requests x L tokens, as a served cache would hold them: random code bytes (every
    byte is a valid code of every format), finite random half values in the sinks/tail region,
    distinct in-range outlier positions; pages scattered by a random block table.  The calibration-free formats
    (fp16 scales, head means, QJL's norms and channel indices: random bytes would be NaNs and channels past the
    head) are written by their encoder from random K/V instead: the first ``written`` tokens (default L) - a prefill
    chunk's context, whose recent window the chunk's write then reads from the ring as a served chunk does (pages
    written through L held other rows there: rows of zeros, which QJL's sign screen resolved in float64)."""
    from vllm_temporalkv.page_views import outlier_views, region_view

    lay = lc.layout
    per = -(-L // lay.block_size)
    n = B * per
    if not lay.fmt.needs_calibration:
        return _encoded_pages(lc, B, L if written is None else written, H, D, per, device)
    pages = torch.randint(0, 256, (n, H, lay.bytes), dtype=torch.uint8, device=device)
    region = region_view(lay, pages, lc.store_dtype)
    region.copy_(torch.randn(region.shape, dtype=lc.dtype, device=device))
    if lay.outliers:
        stride = BLOCK * D // lay.cap  # distinct positions per block (real encodes never repeat one)
        for kind in "kv":
            idx, val = outlier_views(lay, pages, kind, lc.store_dtype)
            start = torch.randint(0, stride, idx.shape[:-1] + (1,), device=device)
            idx.copy_((start + torch.arange(lay.cap, device=device) * stride).to(torch.int16))
            val.copy_(torch.randn(val.shape, dtype=lc.dtype, device=device) * 4)
    bt = torch.randperm(n, device=device).reshape(B, per).to(torch.int32)
    return pages, bt


def _encoded_pages(lc, B: int, L: int, H: int, D: int, per: int, device):
    """fill_pages for the calibration-free formats: each request's L random K/V tokens written by the torch path
    (into ``per`` pages per request)."""
    from vllm_temporalkv.ops import paged_torch

    pages = torch.zeros(B * per, H, lc.layout.bytes, dtype=torch.uint8, device=device)
    bt = torch.randperm(B * per, device=device).reshape(B, per).to(torch.int32)
    for r in range(B):  # one request at a time: QJL's projections of a long request are large
        k = (torch.randn(L, H, D, device=device) * 2).to(lc.dtype)
        v = torch.randn(L, H, D, device=device).to(lc.dtype)
        if lc.layout.window:
            paged_torch.write_kv_window(lc, pages, k, v, torch.tensor([0, L]), torch.tensor([L]), bt[r:r + 1].long())
        else:
            pos = torch.arange(L, device=device)
            paged_torch.write_kv(lc, pages, k, v, pos, bt[r].long()[pos // lc.block_size])
    return pages, bt


def shape_key(shape: str, B: int, L: int) -> str:
    return f"b{B}-l{L}" if shape == "llama8b" else f"{shape}-b{B}-l{L}"


# ---- dense baselines ------------------------------------------------------------------------------


def dense_bytes(B: int, L: int, H: int, HQ: int, D: int, Q: int = 1, size: int = 2) -> int:
    """An uncompressed cache read (size bytes per value): all K and V of L tokens, plus the queries."""
    return B * (2 * H * L + Q * HQ) * D * size


def sdpa_decode(q, k, v, scale):
    """torch SDPA baseline: q [B, HQ, D], contiguous k/v [B, H, L, D].  With one query token, the GQ
    query heads of a KV head are GQ rows of one non-causal query block: exact GQA, K/V read once
    per KV head and never repeated (what enable_gqa would do, on every SDPA backend)."""
    B, HQ, D = q.shape
    H = k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(q.view(B, H, HQ // H, D), k, v, scale=scale)
    return o.reshape(B, HQ, D)


# ---- reporting -------------------------------------------------------------------------------------


def ratio(num, den):
    return None if num is None or not den else num / den


def gbps(nbytes, ms):
    return None if ms is None else nbytes / (ms * 1e-3) / 1e9


def fmt_opt(x, spec):
    return "-" if x is None else format(x, spec)


def shape_sections(report: dict):
    """(markdown heading, rows) of each model shape of a kernel report that has rows, in the run's order."""
    for shape in report["settings"]["shapes"]:
        rows = [r for r in report["rows"] if r["shape"] == shape]
        if rows:
            sh = SHAPES[shape]
            yield f"## {shape}: {sh['hq']} query / {sh['h']} KV heads, head_dim {sh['d']}", rows


def plot_decode_grid(rows: list[dict], shapes: list[str], path: Path, *, time_series, speedup_series, baselines,
                     panel_title: str, time_label: str, speedup_label: str, title: str, width: float = 4.2) -> None:
    """Decode timings over the context L (log2), per model shape two rows of panels (time per call, speedup),
    one column per batch size.  time_series / speedup_series: (row key, style, label with {f}, plot kwargs) per
    format; baselines: (row key, style, name) drawn once per panel from the rows' baseline columns.  A series
    without any value is left out."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in shapes if any(r["shape"] == s for r in rows)]
    if not shapes:
        return
    batches = sorted({r["B"] for r in rows})
    fmts = list(dict.fromkeys(r["format"] for r in rows))
    fig, axes = plt.subplots(2 * len(shapes), len(batches), figsize=(width * len(batches), 3.4 * 2 * len(shapes)),
                             squeeze=False)

    def line(ax, xs, ys, style, **kw):
        ys = [math.nan if y is None else y for y in ys]
        if not all(math.isnan(y) for y in ys):
            ax.plot(xs, ys, style, **kw)

    for i, shape in enumerate(shapes):
        for j, B in enumerate(batches):
            at, asp = axes[2 * i][j], axes[2 * i + 1][j]
            sel = sorted((r for r in rows if r["shape"] == shape and r["B"] == B), key=lambda r: r["L"])
            for k, f in enumerate(fmts):
                pts = [r for r in sel if r["format"] == f]
                for ax, series in ((at, time_series), (asp, speedup_series)):
                    for key, style, label, kw in series:
                        line(ax, [r["L"] for r in pts], [r.get(key) for r in pts], style, color=f"C{k}",
                             label=label.format(f=f), **kw)
            base = {r["L"]: r for r in sel}
            for key, style, name in baselines:
                line(at, sorted(base), [base[x].get(key) for x in sorted(base)], style, label=name)
            asp.axhline(1.0, color="gray", lw=1)
            for ax in (at, asp):
                ax.set_xscale("log", base=2)
                ax.grid(alpha=0.3, which="both")
            at.set_yscale("log")
            at.set_title(panel_title.format(shape=shape, B=B))
            asp.set_xlabel("context L (tokens)")
            if j == 0:
                at.set_ylabel(time_label)
                asp.set_ylabel(speedup_label)
        axes[2 * i][0].legend(fontsize=6)
        axes[2 * i + 1][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
