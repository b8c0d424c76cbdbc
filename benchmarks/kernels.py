"""GPU benchmark of the Triton kernels: paged decode straight from the codes, and the fused encode.

    python -m benchmarks.kernels                         # H100: both shapes, the full grid
    python -m benchmarks.kernels --shape llama8b --batch 8 --context 32768 --formats temporalkv-2bit
    python -m benchmarks.kernels --smoke --out /tmp/k    # no GPU: interpreter check of the plumbing
    python -m benchmarks.kernels --device cpu ...        # the C++ CPU kernels: benchmarks/kernels_cpu.py

Decode (one query token per request, one layer): for each shape (``llama8b``: 32 query / 8 KV
heads, head_dim 128; ``smollm2``: 9 / 3, head_dim 64), batch B, context L and format, the time of
``triton_decode.paged_attention`` on pages full of random codes, against two baselines measured in
the same run on random K/V of the same B x L: torch SDPA on contiguous half-precision K/V, and a
simple fp16/bf16 *paged* flash-decoding Triton kernel (below; the repo has none).  Each row also
gives the bytes the compressed kernel must read (codes, sinks and tail, outliers, centroids once,
...), the bandwidth that implies, and its fraction of the device's copy bandwidth measured once in
the run.  Before a configuration is timed, the kernel's output on a slice of it (the first
``--check-requests`` requests, up to ``--check-tokens`` tokens) is compared with
``reference.paged_attention``, and the baseline kernel with a float32 dense attention.

Encode: ``triton_encode.write_kv`` on an 8192-token prefill (one layer), tokens/s, and its cost
next to that layer's causal prefill attention (see ``bench_encode``); checked bit-exact against
``reference.write_kv`` on the prefill's first tokens.

Timing: median of ``--reps`` runs after ``--warmup``, each behind an L2 flush (a 256 MiB memset),
the step replayed from a CUDA graph (no Python launch overhead, as vLLM serves decode) unless
``--no-graph``.  Results: benchmarks/results/kernels.{json,md,png}; headline figures (B = 1 and 8
at 32k, and the encode overhead) are merged into headline.json under the device tag.

``--smoke`` (no GPU needed): runs one or two tiny configurations through the same code, in Triton's
interpreter when CUDA is absent, writes to ``--out`` (a temp dir by default, never
benchmarks/results) and merges no headline.  Its timings are meaningless.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from .common import RESULTS, merge_headline, plot_decode_grid, run_record, write_json

# triton and the kernel modules are imported by _load_kernels(), after main() has decided on
# TRITON_INTERPRET: triton_encode reads it at import, and triton.jit decides at decoration.
triton = tl = triton_decode = triton_encode = reference = None

SHAPES = {  # query heads, KV heads, head_dim, RoPE theta
    "llama8b": dict(hq=32, h=8, d=128, theta=500000.0),
    "smollm2": dict(hq=9, h=3, d=64, theta=100000.0),
}
DEFAULT_FORMATS = ["temporalkv-2bit", "temporalkv-1bit", "temporalkv-4bit"]
DEFAULT_BLOCK_SIZE = 1024  # the plugin's default page size (vllm/plugin.py)
FP16_PAGE = 16  # vLLM's default block size, for the half-precision paged baseline
FP16_TILE = 64  # tokens per tile of the baseline kernel
HEADLINE_POINTS = {(1, 32768), (8, 32768)}  # (B, L) rows merged into headline.json
L2_FLUSH_BYTES = 256 << 20
BLOCK, SINKS = 8, 8  # formats.BLOCK_TOKENS, SINK_TOKENS (asserted in run())


def _load_kernels() -> None:
    global triton, tl, triton_decode, triton_encode, reference, _fp16_decode_kernel
    import triton as _triton
    import triton.language as _tl

    from vllm_temporalkv.ops import paged_torch as _ref
    from vllm_temporalkv.ops import triton_decode as _dec
    from vllm_temporalkv.ops import triton_encode as _enc

    triton, tl, triton_decode, triton_encode, reference = _triton, _tl, _dec, _enc, _ref
    # jit applied here, not as a decorator, so that it honours TRITON_INTERPRET set by main()
    _fp16_decode_kernel = triton.jit(_fp16_paged_decode)


# ---- the half-precision paged baseline -----------------------------------------------------------
#
# BASELINE, not part of the plugin: a deliberately simple paged flash-decoding kernel over an
# uncompressed cache k/v [num_pages, H, PAGE, D] (head-major pages, so each head's rows are
# contiguous), with the same grid (request, KV head, split), split heuristic and reduce kernel as
# triton_decode, so the comparison isolates "read half-precision K/V" vs "decode the codes".

_fp16_decode_kernel = None


def _fp16_paged_decode(q_ptr, k_ptr, v_ptr, bt_ptr, bt_stride, seq_lens_ptr, acc_ptr, ml_ptr, qk_scale,
                       tiles_per_split, H: tl.constexpr, GQ: tl.constexpr, GQ_P: tl.constexpr,
                       D: tl.constexpr, PAGE: tl.constexpr, BT: tl.constexpr, F32: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    S = tl.num_programs(2)
    DT: tl.constexpr = q_ptr.dtype.element_ty
    n = tl.load(seq_lens_ptr + r)
    t_lo = s * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, tl.cdiv(n, BT))
    bt_row = bt_ptr + r.to(tl.int64) * bt_stride
    g = tl.arange(0, GQ_P)  # the GQ query heads of KV head h, padded to tensor-core rows
    hq = h * GQ + g
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + (r.to(tl.int64) * H * GQ + hq[:, None]) * D + dd[None, :], mask=g[:, None] < GQ, other=0.0)
    m_i = tl.full([GQ_P], -float("inf"), tl.float32)
    l_i = tl.zeros([GQ_P], tl.float32)
    acc = tl.zeros([GQ_P, D], tl.float32)
    for tile in range(t_lo, t_hi):
        tok = tile * BT + tl.arange(0, BT)
        ok = tok < n
        page = tl.load(bt_row + tok // PAGE, mask=ok, other=0).to(tl.int64)
        row = ((page * H + h) * PAGE + tok % PAGE) * D
        k = tl.load(k_ptr + row[:, None] + dd[None, :], mask=ok[:, None], other=0.0)
        if F32:  # the interpreter's half-precision dot is wrong (see triton_decode._dot)
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(ok[None, :], sc * qk_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + dd[None, :], mask=ok[:, None], other=0.0)
        if F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(DT), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    part = (r.to(tl.int64) * H * GQ + hq) * S + s
    gm = g < GQ
    tl.store(acc_ptr + part[:, None] * D + dd[None, :], acc, mask=gm[:, None])
    tl.store(ml_ptr + part * 2, m_i, mask=gm)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=gm)


class Fp16Paged:
    """The baseline's cache and its launch; the reduce is triton_decode's, with identity V stats."""

    def __init__(self, B: int, L: int, H: int, HQ: int, D: int, dtype, device, page: int = FP16_PAGE):
        self.H, self.GQ, self.D, self.page = H, HQ // H, D, page
        per = -(-L // page)
        n = B * per
        self.k = torch.randn(n, H, page, D, dtype=dtype, device=device)
        self.v = torch.randn(n, H, page, D, dtype=dtype, device=device)
        self.bt = torch.randperm(n, device=device).reshape(B, per).to(torch.int32)  # scattered pages
        self.zero = torch.zeros(H, D, device=device)
        self.one = torch.ones(H, D, device=device)

    def splits(self, R: int) -> int:
        tiles = triton.cdiv(self.bt.shape[1] * self.page, FP16_TILE)
        return triton_decode.num_splits(R * self.H, tiles, self.k.device)

    def __call__(self, q, seq_lens, bt, scale, out):
        R, HQ, D = q.shape
        S = self.splits(R)
        acc = torch.empty(R, HQ, S, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(R, HQ, S, 2, dtype=torch.float32, device=q.device)
        tiles = triton.cdiv(bt.shape[1] * self.page, FP16_TILE)
        _fp16_decode_kernel[(R, self.H, S)](
            q, self.k, self.v, bt, bt.stride(0), seq_lens, acc, ml, float(scale) * triton_decode.LOG2E,
            triton.cdiv(tiles, S), H=self.H, GQ=self.GQ, GQ_P=max(16, triton.next_power_of_2(self.GQ)), D=D,
            PAGE=self.page, BT=FP16_TILE, F32=triton_encode.INTERPRET,
        )
        triton_decode._reduce_kernel[(R, HQ)](acc, ml, out, self.zero, self.one, S, HQ=HQ, GQ=self.GQ, D=D,
                                              S_P=triton.next_power_of_2(S))
        return out

    def dense_reference(self, q, r: int, n: int, scale) -> torch.Tensor:
        """float32 attention of request r's query over its first n cached tokens -> [HQ, D]."""
        pg = self.bt[r, : -(-n // self.page)].long()
        k = self.k[pg].permute(1, 0, 2, 3).reshape(self.H, -1, self.D)[:, :n].float()
        v = self.v[pg].permute(1, 0, 2, 3).reshape(self.H, -1, self.D)[:, :n].float()
        qh = q[r].float().view(self.H, self.GQ, self.D)
        p = torch.softmax(qh @ k.transpose(1, 2) * scale, -1)
        return (p @ v).reshape(-1, self.D)


def sdpa_decode(q, k, v, scale):
    """torch SDPA baseline: q [B, HQ, D], contiguous k/v [B, H, L, D].  With one query token, the GQ
    query heads of a KV head are GQ rows of one non-causal query block: exact GQA, K/V read once
    per KV head and never repeated (what enable_gqa would do, on every SDPA backend)."""
    B, HQ, D = q.shape
    H = k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(q.view(B, H, HQ // H, D), k, v, scale=scale)
    return o.reshape(B, HQ, D)


# ---- synthetic caches ----------------------------------------------------------------------------


def parse_format(name: str) -> tuple[str, bool]:
    """'temporalkv-2bit-o1' -> ('temporalkv-2bit', True): "-o1" turns on the 1% outliers."""
    return name.removesuffix("-o1"), name.endswith("-o1")


def make_layer_cache(shape: str, fmt_name: str, dtype, block_size: int, hybrid_k: bool, device, seed: int):
    """A LayerCache with artifact-like quantizers: random fp16 centroids and channel statistics
    (timing does not depend on their values).  hybrid_k: K channel-chunked, as on the layers
    where the hybrid TemporalKV picks channel chunking."""
    from vllm_temporalkv.codecs import make_codec
    from vllm_temporalkv.codecs.quantizer import ChannelStats, KVQuantizer
    from vllm_temporalkv.formats import check_head_dim, get_format
    from vllm_temporalkv.layout import PageLayout
    from vllm_temporalkv.rope import Rope

    sh = SHAPES[shape]
    H, D = sh["h"], sh["d"]
    base, outliers = parse_format(fmt_name)
    fmt = get_format(base)
    check_head_dim(fmt, D)
    g = torch.Generator().manual_seed(seed)

    def quantizer(method: str):
        codec = make_codec(method, fmt.chunk, fmt.n_centroids)
        codec.centroids = torch.randn(codec.codebook_shape(H, D), generator=g).half().float().to(device)
        mean, std = torch.randn(H, D, generator=g) * 0.5, torch.rand(H, D, generator=g) + 0.5
        stats = ChannelStats(mean, std, mean - 2.5 * std, mean + 2.5 * std).to(device)
        return KVQuantizer(codec, stats, outliers)

    kq = quantizer("channel" if hybrid_k and fmt.hybrid else fmt.method)
    vq = quantizer(fmt.method)
    cfg = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": sh["theta"]},
                                num_attention_heads=sh["hq"], head_dim=D, hidden_size=sh["hq"] * D)
    lay = PageLayout(fmt, D, block_size, outliers)
    from vllm_temporalkv.ops.paged_torch import LayerCache

    return LayerCache(fmt, lay, kq, vq, Rope(cfg, device), dtype)


def fill_pages(lc, B: int, L: int, H: int, D: int, device):
    """Pages of B requests x L tokens, as a served cache would hold them: random code bytes (every
    byte is a valid code of every format), finite random half values in the sinks/tail region,
    distinct in-range outlier positions; pages scattered by a random block table."""
    from vllm_temporalkv.page_views import outlier_views, region_view

    lay = lc.layout
    per = -(-L // lay.block_size)
    n = B * per
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


def compressed_bytes(lc, B: int, L: int, H: int, HQ: int) -> dict:
    """HBM bytes the compressed decode of B requests x L tokens must read (each at least once).
    Per request, with p = L - 1 the query's position: encoded blocks [8, cend), cend = p // 8 * 8;
    the sinks and the own block's earlier tokens from the region; the step's new K/V and query."""
    lay = lc.layout
    D, half = lay.head_dim, 2
    p = L - 1
    cend = p // BLOCK * BLOCK
    blocks = max(0, cend - SINKS) // BLOCK
    exact = min(SINKS, p) + (p - cend if p >= SINKS else 0)
    cb = sum(q.codec.centroids.numel() for q in (lc.k, lc.v)) * 2  # fp16 codebooks, once per step
    tiles = -(-L // triton_decode.TILE_TOKENS)
    parts = {
        "codes": B * blocks * H * 2 * lay.code_bytes,
        "outliers": B * blocks * H * 2 * lay.cap * 4,  # int16 position + half value
        "region": B * exact * H * 2 * D * half,
        "new_kv_q": B * (2 * H + HQ) * D * half,
        "block_table": B * -(-L // lay.block_size) * 4,
        "centroids": cb,
        "stats": 4 * H * D * 4,
        "rope_rows": tiles * D * 4,  # cos and sin of each tile start (D/2 each), shared by all requests
    }
    parts["total"] = sum(parts.values())
    return parts


def dense_bytes(B: int, L: int, H: int, HQ: int, D: int) -> int:
    """What a half-precision decode must read: all K and V, plus the queries."""
    return B * (2 * H * L + HQ) * D * 2


# ---- timing --------------------------------------------------------------------------------------


class Timer:
    """Median time (ms) of fn.  GPU: each run behind an L2 flush, from a CUDA graph when it can be
    captured.  Otherwise (smoke, interpreter): wall clock, meaningless for performance."""

    def __init__(self, device, reps: int, warmup: int, graph: bool):
        self.cuda = device.type == "cuda" and not triton_encode.INTERPRET
        self.reps, self.warmup, self.graph = reps, warmup, graph and self.cuda
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if self.cuda else None
        self.mode = ("cuda-graph" if self.graph else "cuda-events") + "+l2-flush" if self.cuda else "wall-clock"
        self.fallbacks = 0

    def __call__(self, fn) -> float:
        if not self.cuda:
            fn()  # compile / warm caches
            ts = []
            for _ in range(self.reps):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
            return statistics.median(ts)
        fn()  # compile, fill the kernels' per-device caches (codec params, RoPE tables)
        torch.cuda.synchronize()
        run, g = fn, None
        if self.graph:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                run = g.replay
            except RuntimeError as e:  # not capturable: time it eagerly (counted in the report)
                print(f"  (CUDA graph capture failed, timing eagerly: {e})", file=sys.stderr)
                self.fallbacks += 1
                torch.cuda.synchronize()
        for _ in range(self.warmup):
            self.flush.zero_()
            run()
        start = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(self.reps):
            self.flush.zero_()  # also keeps the GPU busy while the host enqueues the step
            start[i].record()
            run()
            end[i].record()
        torch.cuda.synchronize()
        del g
        return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def copy_bandwidth(timer: Timer, device, nbytes: int) -> float:
    """Device copy bandwidth, GB/s: (bytes read + written) / time of one large tensor copy."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = timer(lambda: y.copy_(x))
    del x, y
    return 2 * nbytes / (ms * 1e-3) / 1e9


def free_bytes(device) -> float:
    if device.type != "cuda":
        return math.inf
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _tol(dtype) -> float:
    # as tests/test_triton_kernels.py: bf16 rounding (and the interpreter's truncating bf16 casts)
    return 6e-2 if dtype == torch.bfloat16 else 6e-3


# ---- one decode configuration ----------------------------------------------------------------------


def bench_baselines(a, shape, B, L, dtype, device, timer) -> dict:
    """SDPA and the half-precision paged kernel on random K/V of B x L (allocated one at a time)."""
    sh = SHAPES[shape]
    H, HQ, D = sh["h"], sh["hq"], sh["d"]
    scale = D ** -0.5
    res = {"sdpa_ms": None, "fp16_paged_ms": None, "fp16_paged_err": None, "dense_bytes": dense_bytes(B, L, H, HQ, D)}
    need = 2 * B * H * L * D * 2
    q = torch.randn(B, HQ, D, dtype=dtype, device=device)
    if need * 1.05 + a.headroom > free_bytes(device):
        res["skipped"] = "baselines: out of memory"
        return res
    try:
        k = torch.randn(B, H, L, D, dtype=dtype, device=device)
        v = torch.randn_like(k)
        res["sdpa_ms"] = timer(lambda: sdpa_decode(q, k, v, scale))
        del k, v
        if need * 1.05 + a.headroom > free_bytes(device):
            raise torch.cuda.OutOfMemoryError("fp16 paged cache")
        base = Fp16Paged(B, L, H, HQ, D, dtype, device)
        c, n = min(B, a.check_requests), min(L, a.check_tokens)
        sl_c = torch.full((c,), n, dtype=torch.int32, device=device)
        got = base(q[:c].contiguous(), sl_c, base.bt[:c], scale, torch.empty_like(q[:c]))
        want = torch.stack([base.dense_reference(q, r, n, scale) for r in range(c)])
        res["fp16_paged_err"] = float((got.float() - want).abs().max())
        sl = torch.full((B,), L, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        res["fp16_paged_ms"] = timer(lambda: base(q, sl, base.bt, scale, out))
        res["fp16_paged_splits"] = base.splits(B)
        del base
    except torch.cuda.OutOfMemoryError:
        res["skipped"] = "baselines: out of memory"
    return res


def bench_decode(a, lc, shape, fmt, B, L, device, timer, base: dict, copy_gbps: float) -> dict:
    sh = SHAPES[shape]
    H, HQ, D = sh["h"], sh["hq"], sh["d"]
    dtype, scale = lc.dtype, D ** -0.5
    lay = lc.layout
    row = dict(shape=shape, B=B, L=L, format=fmt, block_size=lay.block_size, dtype=str(dtype)[6:])
    nbytes = B * -(-L // lay.block_size) * H * lay.bytes
    row["cache_bytes"] = nbytes
    if nbytes * 1.1 + a.headroom > free_bytes(device):
        return row | {"skipped": "out of memory"}
    torch.manual_seed(a.seed)
    try:
        pages, bt = fill_pages(lc, B, L, H, D, device)
        q = torch.randn(B, HQ, D, dtype=dtype, device=device)
        key = torch.randn(B, H, D, dtype=dtype, device=device)
        val = torch.randn(B, H, D, dtype=dtype, device=device)

        # correctness first: the first requests of the batch, up to check_tokens tokens
        c, n = min(B, a.check_requests), min(L, a.check_tokens)
        qsl = torch.arange(c + 1, dtype=torch.int32, device=device)
        sl = torch.full((c,), n, dtype=torch.int32, device=device)
        args = (lc, pages, q[:c], key[:c], val[:c], qsl, sl, bt[:c], scale)
        want = reference.paged_attention(*args).float()
        got = triton_decode.paged_attention(*args).float()
        err = float((got - want).abs().max())
        ref_max = float(want.abs().max())
        tol = _tol(dtype) * max(1.0, ref_max)
        row.update(check_requests=c, check_tokens=n, max_abs_err=err, ref_absmax=ref_max, tol=tol, check_ok=err <= tol)
        del want, got

        qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
        sl = torch.full((B,), L, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        ms = timer(lambda: triton_decode.paged_attention(lc, pages, q, key, val, qsl, sl, bt, scale, out=out))
        del pages, bt
    except torch.cuda.OutOfMemoryError:
        return row | {"skipped": "out of memory"}
    parts = compressed_bytes(lc, B, L, H, HQ)
    gbps = parts["total"] / (ms * 1e-3) / 1e9
    row.update(
        time_ms=ms, splits=triton_decode.num_splits(B * H, triton.cdiv(-(-L // lay.block_size) * lay.block_size,
                                                                     triton_decode.TILE_TOKENS), device),
        sdpa_ms=base.get("sdpa_ms"), fp16_paged_ms=base.get("fp16_paged_ms"), fp16_paged_err=base.get("fp16_paged_err"),
        speedup_vs_sdpa=_ratio(base.get("sdpa_ms"), ms), speedup_vs_fp16_paged=_ratio(base.get("fp16_paged_ms"), ms),
        bytes_read=parts["total"], bytes_breakdown=parts, gbps=gbps, bw_fraction=gbps / copy_gbps,
        dense_bytes=base["dense_bytes"],
        sdpa_gbps=_gbps(base["dense_bytes"], base.get("sdpa_ms")),
        fp16_paged_gbps=_gbps(base["dense_bytes"], base.get("fp16_paged_ms")),
    )
    if base.get("skipped"):
        row["baseline_note"] = base["skipped"]
    return row


def _ratio(num, den):
    return None if num is None or not den else num / den


def _gbps(nbytes, ms):
    return None if ms is None else nbytes / (ms * 1e-3) / 1e9


# ---- encode ----------------------------------------------------------------------------------------


def bench_encode(a, lc, shape, fmt, device, timer) -> dict:
    """write_kv of an N-token prefill (one layer), and what it adds to that layer's prefill.

    Compared: the layer's causal prefill *attention* alone (SDPA over N tokens, flash kernel),
    against the same plus write_kv of the N tokens.  encode_prefill_overhead = encode time /
    attention time, from separate timings; ..._measured times both back to back.  The
    projections and MLP of the layer are not counted, so this overstates the share of a whole
    prefill: an upper bound."""
    sh = SHAPES[shape]
    H, HQ, D = sh["h"], sh["hq"], sh["d"]
    N, dtype = a.encode_tokens, lc.dtype
    lay = lc.layout
    torch.manual_seed(a.seed + 1)
    key = torch.randn(N, H, D, dtype=dtype, device=device) * 2
    val = torch.randn(N, H, D, dtype=dtype, device=device)
    pos = torch.arange(N, device=device)
    per = -(-N // lay.block_size)
    table = torch.randperm(per, device=device)
    pid = table[pos // lay.block_size]
    row = dict(shape=shape, format=fmt, tokens=N, block_size=lay.block_size)

    # bit-exact against the reference on the prefill's first tokens (fresh pages for both)
    m = min(N, a.encode_check_tokens)
    got = torch.zeros(per, H, lay.bytes, dtype=torch.uint8, device=device)
    want = got.clone()
    triton_encode.write_kv(lc, got, key[:m], val[:m], pos[:m], pid[:m])
    reference.write_kv(lc, want, key[:m], val[:m], pos[:m], pid[:m])
    row.update(check_tokens=m, bit_exact=bool(torch.equal(got, want)), bytes_differing=int((got != want).sum()))
    del got, want

    pages = torch.zeros(per, H, lay.bytes, dtype=torch.uint8, device=device)
    enc = lambda: triton_encode.write_kv(lc, pages, key, val, pos, pid, max_position=N)  # noqa: E731
    q = torch.randn(1, HQ, N, D, dtype=dtype, device=device)
    # K/V repeated to the query heads outside the timing: every SDPA backend then takes them
    # (flash included) - a GQA-aware prefill reads less, so this leans towards a lower overhead
    # only by the K/V reads of a compute-bound op
    kr = key.transpose(0, 1).repeat_interleave(HQ // H, 0)[None]
    vr = val.transpose(0, 1).repeat_interleave(HQ // H, 0)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    attn = lambda: sdpa(q, kr, vr, is_causal=True, scale=D ** -0.5)  # noqa: E731
    t_enc = timer(enc)
    t_attn = timer(attn)
    t_both = timer(lambda: (attn(), enc()))
    row.update(encode_ms=t_enc, tokens_per_s=N / (t_enc * 1e-3), prefill_attn_ms=t_attn, attn_plus_encode_ms=t_both,
               encode_prefill_overhead=t_enc / t_attn, encode_prefill_overhead_measured=(t_both - t_attn) / t_attn)
    # the context read of a later prefill chunk: the N tokens decoded once (Triton kernel vs the torch decode it
    # replaces on the CUDA path), bit-exact
    enc()
    tk, tv = triton_decode.gather_kv(lc, pages, table, N)
    rk, rv = reference.gather_kv(lc, pages, table, N)
    t_g = timer(lambda: triton_decode.gather_kv(lc, pages, table, N))
    t_gt = timer(lambda: reference.gather_kv(lc, pages, table, N))
    row.update(gather_ms=t_g, gather_torch_ms=t_gt, gather_speedup_vs_torch=t_gt / t_g,
               gather_bit_exact=bool(torch.equal(tk, rk) and torch.equal(tv, rv)))
    return row


# ---- reporting -------------------------------------------------------------------------------------


def device_tag(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100': the first word of
    letters then digits, else a slug (never a '.', which separates headline key parts)."""
    words = re.split(r"[^a-z0-9]+", re.sub(r"\b(nvidia|geforce|tesla|amd|radeon)\b", " ", name.lower()))
    for w in words:
        if re.fullmatch(r"[a-z]+\d+[a-z0-9]*", w):
            return w
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def shape_key(shape: str, B: int, L: int) -> str:
    return f"b{B}-l{L}" if shape == "llama8b" else f"{shape}-b{B}-l{L}"


def headline_figures(report: dict) -> dict:
    tag = report["device_tag"]
    out = {}
    for r in report["rows"]:
        if (r["B"], r["L"]) not in HEADLINE_POINTS or r.get("time_ms") is None or not r["check_ok"]:
            continue
        for metric in ("speedup_vs_sdpa", "speedup_vs_fp16_paged", "bw_fraction"):
            if r.get(metric) is not None:
                out[f"kernels.{tag}.{shape_key(r['shape'], r['B'], r['L'])}.{r['format']}.{metric}"] = r[metric]
    for e in report["encode"]:
        # the one encode headline: TemporalKV 2-bit on the Llama-8B shape (all formats are in the JSON)
        if e["shape"] == "llama8b" and e["format"] == "temporalkv-2bit":
            out[f"kernels.{tag}.l8b-{e['tokens']}.encode_prefill_overhead"] = e["encode_prefill_overhead"]
    return out


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"# Triton kernels: paged decode from the codes, fused encode ({report['device']})", ""]
    if report["smoke"]:
        lines += ["**SMOKE RUN: tiny shapes" + (", Triton interpreter" if report["interpret"] else "")
                  + ". Timings are meaningless; only the checks count.**", ""]
    lines += [
        f"Command: `{report['run']['command']}`  ",
        f"Time: {report['run']['time']}; timer: {report['timer']}, median of {s['reps']} runs; "
        f"copy bandwidth {report['copy_gbps']:.0f} GB/s (read + write of a {s['copy_bytes'] >> 20} MiB copy)  ",
        f"Cache dtype {s['dtype']}, compressed pages of {s['block_size']} tokens, baseline pages of {FP16_PAGE}; "
        f"K {'channel-chunked (hybrid layers)' if s['hybrid_k'] else 'as the format'}.",
        "",
        "Decode = one query token per request, one layer.  bytes read = codes + outliers + sinks/tail + new K/V + "
        "query + block table + centroids and statistics once + RoPE rows; the baselines read all of K and V.  "
        "bw fraction = achieved GB/s / copy GB/s.  err = max |Triton - reference.paged_attention| on the first "
        "requests of the batch (check tokens each).",
        "",
    ]
    for shape in s["shapes"]:
        sh = SHAPES[shape]
        rows = [r for r in report["rows"] if r["shape"] == shape]
        if not rows:
            continue
        lines += [f"## {shape}: {sh['hq']} query / {sh['h']} KV heads, head_dim {sh['d']}", "",
                  "| B | L | format | ms | SDPA ms | fp16 paged ms | x SDPA | x fp16 paged | MB read | GB/s | bw frac"
                  " | err (tol) | check tokens |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("time_ms") is None:
                lines.append(f"| {r['B']} | {r['L']} | {r['format']} | skipped: {r.get('skipped')} |||||||||")
                continue
            ok = "" if r["check_ok"] else " **FAIL**"
            lines.append(
                f"| {r['B']} | {r['L']} | {r['format']} | {r['time_ms']:.4f} | {_f(r['sdpa_ms'], '.4f')} | "
                f"{_f(r['fp16_paged_ms'], '.4f')} | {_f(r['speedup_vs_sdpa'], '.2f')} | "
                f"{_f(r['speedup_vs_fp16_paged'], '.2f')} | {r['bytes_read'] / 1e6:.2f} | {r['gbps']:.0f} | "
                f"{r['bw_fraction']:.2f} | {r['max_abs_err']:.2e} ({r['tol']:.0e}){ok} | "
                f"{r['check_requests']}x{r['check_tokens']} |")
        errs = [r["fp16_paged_err"] for r in rows if r.get("fp16_paged_err") is not None]
        if errs:
            lines += ["", f"fp16 paged baseline vs float32 dense attention: max err {max(errs):.2e}."]
        lines.append("")
    if report["encode"]:
        lines += ["## Encode (write_kv of a prefill, one layer)", "",
                  "overhead = encode time / causal SDPA prefill attention time of the same layer and tokens "
                  "(the layer's GEMMs not counted: an upper bound on the share of a whole prefill); measured = "
                  "(attention + encode back to back - attention) / attention.", "",
                  "| shape | format | tokens | encode ms | tokens/s | attention ms | overhead | measured | bit-exact |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for e in report["encode"]:
            lines.append(
                f"| {e['shape']} | {e['format']} | {e['tokens']} | {e['encode_ms']:.3f} | {e['tokens_per_s']:.3g} | "
                f"{e['prefill_attn_ms']:.3f} | {e['encode_prefill_overhead']:.3f} | "
                f"{e['encode_prefill_overhead_measured']:.3f} | {e['bit_exact']} ({e['check_tokens']} tokens) |")
        lines += ["", "Context read of a later prefill chunk (the N tokens decoded once; `triton_decode.gather_kv` vs the "
                  "torch decode it replaces on the CUDA path):", "",
                  "| shape | format | tokens | Triton ms | torch ms | speedup | bit-exact |", "|---|---|---|---|---|---|---|"]
        for e in report["encode"]:
            if "gather_ms" in e:
                lines.append(f"| {e['shape']} | {e['format']} | {e['tokens']} | {e['gather_ms']:.3f} | "
                             f"{e['gather_torch_ms']:.3f} | {e['gather_speedup_vs_torch']:.2f} | {e['gather_bit_exact']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    plot_decode_grid(
        [r for r in report["rows"] if r.get("time_ms") is not None], report["settings"]["shapes"], path,
        time_series=[("time_ms", "o-", "{f}", {})],
        speedup_series=[("speedup_vs_sdpa", "o-", "{f} vs SDPA", {}), ("speedup_vs_fp16_paged", "s:", "{f} vs fp16 paged", {})],
        baselines=[("sdpa_ms", "kx--", "SDPA"), ("fp16_paged_ms", "k+:", "fp16 paged")],
        panel_title="{shape}, B = {B}", time_label="decode time (ms)", speedup_label="speedup", width=4,
        title=f"Paged decode from codes vs half-precision baselines, {report['device_tag']}"
              + (" (SMOKE: timings meaningless)" if report["smoke"] else ""))


# ---- driver ----------------------------------------------------------------------------------------


def run(a) -> dict:
    from vllm_temporalkv.formats import BLOCK_TOKENS, SINK_TOKENS

    assert (BLOCK, SINKS) == (BLOCK_TOKENS, SINK_TOKENS)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no GPU)"
    tag = a.device_tag or (device_tag(name) if device.type == "cuda" else "cpu")
    timer = Timer(device, a.reps, a.warmup, not a.no_graph)
    copy_gbps = copy_bandwidth(timer, device, a.copy_bytes)
    print(f"{name}: copy bandwidth {copy_gbps:.0f} GB/s ({timer.mode})")
    settings = dict(shapes=a.shape, batch=a.batch, context=a.context, formats=a.formats, dtype=a.dtype,
                    block_size=a.block_size, hybrid_k=a.hybrid_k, reps=a.reps, warmup=a.warmup,
                    check_requests=a.check_requests, check_tokens=a.check_tokens, encode_tokens=a.encode_tokens,
                    copy_bytes=a.copy_bytes, seed=a.seed)
    report = dict(settings=settings, smoke=a.smoke, interpret=triton_encode.INTERPRET, device=name, device_tag=tag,
                  timer=timer.mode, copy_gbps=copy_gbps, rows=[], encode=[], run=run_record())
    out = Path(a.out)
    for shape in a.shape:
        caches = {f: make_layer_cache(shape, f, dtype, a.block_size, a.hybrid_k, device, a.seed) for f in a.formats}
        if a.encode_tokens:
            for f, lc in caches.items():
                e = bench_encode(a, lc, shape, f, device, timer)
                report["encode"].append(e)
                print(f"{shape} encode {f}: {e['tokens_per_s']:.3g} tokens/s, "
                      f"overhead {e['encode_prefill_overhead']:.3f}, bit-exact {e['bit_exact']}; context read "
                      f"{e['gather_speedup_vs_torch']:.2f}x torch, bit-exact {e['gather_bit_exact']}")
        for B in a.batch:
            for L in a.context:
                base = bench_baselines(a, shape, B, L, dtype, device, timer)
                for f, lc in caches.items():
                    r = bench_decode(a, lc, shape, f, B, L, device, timer, base, copy_gbps)
                    report["rows"].append(r)
                    if r.get("time_ms") is None:
                        print(f"{shape} B={B} L={L} {f}: skipped ({r.get('skipped')})")
                    else:
                        print(f"{shape} B={B} L={L} {f}: {r['time_ms']:.4f} ms, "
                              f"x{_f(r['speedup_vs_sdpa'], '.2f')} SDPA, "
                              f"x{_f(r['speedup_vs_fp16_paged'], '.2f')} fp16 paged, bw {r['bw_fraction']:.2f}, "
                              f"err {r['max_abs_err']:.1e}{'' if r['check_ok'] else ' FAIL'}")
                write_json(out / "kernels.json", report)  # partial results survive an interruption
    report["timer_graph_fallbacks"] = timer.fallbacks
    report["headline"] = None if a.smoke or a.no_headline else headline_figures(report)
    write_json(out / "kernels.json", report)
    md = markdown(report)
    (out / "kernels.md").write_text(md)
    plot(report, out / "kernels.png")
    if report["headline"]:
        merge_headline(report["headline"])
    print()
    print(md)
    print(f"results in {out}")
    bad = [f"{r['shape']} B={r['B']} L={r['L']} {r['format']}" for r in report["rows"] if r.get("check_ok") is False]
    bad += [f"encode {e['shape']} {e['format']}" for e in report["encode"] if not e["bit_exact"]]
    if bad:  # results are written (and failing rows kept out of the headline), but the run fails
        sys.exit("CHECK FAILED vs the torch reference: " + "; ".join(bad))
    return report


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", choices=list(SHAPES), default=None, help="default: both (smoke: smollm2)")
    p.add_argument("--batch", nargs="+", type=int, default=None, help="default: 1 8 32 64 (smoke: 1 2)")
    p.add_argument("--context", nargs="+", type=int, default=None,
                   help="default: 4096 8192 32768 131072, each where memory fits (smoke: 64)")
    p.add_argument("--formats", nargs="+", default=None,
                   help=f"default: {' '.join(DEFAULT_FORMATS)}; a '-o1' suffix adds the 1%% outliers")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="the model's half dtype")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"compressed page size (default {DEFAULT_BLOCK_SIZE}; smoke: 16)")
    p.add_argument("--hybrid-k", action="store_true", help="K channel-chunked (the hybrid's channel layers)")
    p.add_argument("--reps", type=int, default=None, help="timed runs (default 100; smoke: 2)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-graph", action="store_true", help="time eager launches (Python overhead included)")
    p.add_argument("--check-requests", type=int, default=2)
    p.add_argument("--check-tokens", type=int, default=32768, help="context of the reference check")
    p.add_argument("--encode-tokens", type=int, default=None, help="prefill length (default 8192; smoke: 32; 0: skip)")
    p.add_argument("--encode-check-tokens", type=int, default=2048)
    p.add_argument("--copy-bytes", type=int, default=None, help="copy bandwidth tensor (default 1 GiB)")
    p.add_argument("--headroom-gib", type=float, default=2.0, help="GPU memory left free when sizing configurations")
    p.add_argument("--device-tag", default=None, help="headline key part (default: from the GPU name, e.g. h100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-headline", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny configurations through the same code; no GPU needed")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results; smoke: a temp dir)")
    if argv is None:
        argv = sys.argv[1:]
    if "--device" in argv:  # the CPU kernels have their own benchmark (wall clock, vLLM's CPU op)
        i = argv.index("--device")
        if argv[i + 1 : i + 2] == ["cpu"]:
            from . import kernels_cpu

            return kernels_cpu.main(argv[:i] + argv[i + 2 :])
    a = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        sys.exit("benchmarks.kernels needs a CUDA GPU; use --smoke for an interpreter check of the plumbing")
    if a.smoke:
        if not cuda:
            os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernel modules are imported
        if a.out is None:
            a.out = tempfile.mkdtemp(prefix="kernels-smoke-")
        if Path(a.out).resolve() == RESULTS.resolve():
            sys.exit("--smoke never writes to benchmarks/results: pass another --out")
        small = dict(shape=["smollm2"], batch=[1, 2], context=[64], formats=["temporalkv-2bit"], block_size=16,
                     reps=1, encode_tokens=32, copy_bytes=8 << 20)
        a.warmup = min(a.warmup, 1)
    else:
        small = {}
    full = dict(shape=list(SHAPES), batch=[1, 8, 32, 64], context=[4096, 8192, 32768, 131072],
                formats=DEFAULT_FORMATS, block_size=DEFAULT_BLOCK_SIZE, reps=100, encode_tokens=8192,
                copy_bytes=1 << 30)
    for k, v in full.items():
        if getattr(a, k) is None:
            setattr(a, k, small.get(k, v))
    if a.out is None:
        a.out = str(RESULTS)
    a.headroom = int(a.headroom_gib * 2**30) if cuda else 0
    _load_kernels()
    return run(a)


if __name__ == "__main__":
    main()
