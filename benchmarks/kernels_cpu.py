"""CPU benchmark of the C++ kernels (``vllm_temporalkv.ops.cpu``) against the torch path and vLLM's own
CPU attention on a bf16 cache (issue 13).

    python -m benchmarks.kernels_cpu                                   # the full grid, both shapes
    python -m benchmarks.kernels_cpu --shapes llama8b --batch 8 --context 8192 --formats temporalkv-2bit
    python -m benchmarks.kernels_cpu --smoke --out /tmp/kc             # tiny configs: the plumbing (~30 s)

One layer, the step's attention only (the cache update is not timed).  For each shape (``llama8b``:
32 query / 8 KV heads, head_dim 128; ``smollm2``: 9 / 3, head_dim 64):

* **decode** (one query token per request) at batch B and context L (``--batch``, ``--context``;
  default B in {1, 8}, L in {2k, 8k, 32k}); each request sees L tokens (L - 1 cached + its new one);
* **prefill**: one request's chunk of Q queries at offset O (``--prefill Q@O``, default 2048@6144:
  it attends to O cached tokens and causally to itself).

Timed side by side in the same run, on caches of the same B x L:

* ``cpp``: ``ops.cpu.paged_attention(..., batch_invariant=False)`` (what the vLLM backend calls on the
  CPU; decode goes to the fused C++ kernel straight from the codes, a prefill chunk to the torch
  attention on K/V gathered by the C++ decoder) on pages full of random codes (``kernels.fill_pages``);
* ``torch``: ``ops.paged_torch.paged_attention(..., batch_invariant=False)``, the float32 serving path
  the C++ kernels replace, on the same pages;
* ``vllm_bf16``: vLLM's CPU attention op, ``torch.ops._C.cpu_attention_with_kv_cache``, called exactly
  as ``vllm/v1/attention/backends/cpu_attn.py`` calls it (through ``vllm._custom_ops``): a bf16 cache
  ``[num_blocks, Hkv, block_size, 2 D]`` viewed as K and V halves, vLLM's CPU block size (128), pages
  scattered by a random block table, scheduler metadata from ``cpu_attn_get_scheduler_metadata`` with
  the ISA vLLM's backend would pick (``_get_attn_isa``) and ``VLLM_CPU_ATTN_SPLIT_KV``.  The metadata is
  built once per configuration outside the timing (vLLM builds it once per step for all layers).  If
  the op is missing (a non-CPU vLLM build, no vLLM), the reason is recorded and the ratios use
  ``sdpa_bf16`` instead;
* ``sdpa_bf16`` (``--no-sdpa`` skips it): torch SDPA on dense contiguous bf16 K/V (decode: the GQ query
  heads of a KV head as GQ rows, exact GQA without K/V copies; prefill: causal with ``enable_gqa``).

Before a configuration is timed, the C++ output is compared with the torch path on a slice of it
(the first ``--check-requests`` requests at up to ``--check-tokens`` tokens; for the prefill, the first
``--check-queries`` queries of the chunk at the same offset), and vLLM's op with a float32 dense
attention on a small cache written by vLLM's own ``cpu_attn_reshape_and_cache``.  Each row gives the
bytes the step must read (codes, sinks and tail, outliers, centroids once, RoPE tables, queries and
new K/V) per cached token and in total, the GB/s that implies for the C++ kernel and for vLLM's bf16
op (all of K and V: 2 Hkv D 2 bytes per token), and both as fractions of a STREAM-like copy measured
in the same run (``(bytes read + bytes written) / time`` of a ``--copy-mib`` tensor copy; a read-only
sum is recorded too).

Timing: wall clock, median of up to ``--reps`` runs after ``--warmup``, each behind a cache flush
(writing ``--flush-mib``, default twice the L3: in serving, the other layers evict a layer's cache
between two of its steps); slow paths (the torch path at long contexts) stop at ``--budget-s`` seconds
per measurement, never under ``--min-reps`` runs.  All torch threads (recorded with the CPU model,
its SIMD flags and the C++ kernel variant ``ops.cpu.isa()``).

Results: ``benchmarks/results/kernels-cpu.{json,md,png}``; headline figures
``kernels.cpu.<b{B}-l{L} | smollm2-b{B}-l{L} | prefill{Q}-at{O} | smollm2-prefill{Q}-at{O}>.<format>.
speedup_vs_vllm`` and ``.speedup_vs_torch`` for the formats in HEADLINE_FORMATS at HEADLINE_POINTS
and the prefill, merged into headline.json.  ``--smoke``: tiny configurations through the same code,
written to ``--out`` (a temp dir by default, never benchmarks/results), no headline; timings meaningless.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from vllm_temporalkv.cpu_isa import cpu_class, request_amx, simd_flags

from .common import RESULTS, merge_headline, plot_decode_grid, run_record, write_json
from .kernels import SHAPES, fill_pages, make_layer_cache, parse_format, shape_key

DEFAULT_FORMATS = ["temporalkv-2bit", "temporalkv-4bit", "temporalkv-1bit", "channelkv-2bit", "kvquant-2bit"]
DEFAULT_BLOCK_SIZE = 1024  # the plugin's default page size (vllm/plugin.py)
VLLM_BLOCK_SIZE = 128  # vLLM's CPU default (platforms/cpu.py: block_size = 128 unless the user sets one)
DEFAULT_PREFILL = "2048@6144"
HEADLINE_POINTS = {(1, 8192), (8, 8192), (8, 32768)}  # decode (B, L) rows merged into headline.json
HEADLINE_FORMATS = {"temporalkv-2bit"}
TOL = 2e-2  # |C++ - torch| <= TOL * max(1, |torch|max): bf16 outputs, loosely (tests/test_cpu_kernels.py is tight)
VLLM_TOL = 2e-2  # vLLM's bf16 op vs float32 dense attention, same scaling
BLOCK, SINKS = 8, 8  # formats.BLOCK_TOKENS, SINK_TOKENS (asserted in run())

cpu_ops = paged_torch = None  # vllm_temporalkv.ops.{cpu, paged_torch}, imported by run()


# ---- the machine -----------------------------------------------------------------------------------


def cpu_facts() -> dict:
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    caches = {}
    for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            lvl, kind = (idx / "level").read_text().strip(), (idx / "type").read_text().strip()
            caches[f"L{lvl}{'' if kind == 'Unified' else kind[0].lower()}"] = (idx / "size").read_text().strip()
        except OSError:
            pass
    return dict(model=model, cpu_class=cpu_class(), simd=simd_flags(), caches=caches, cpu_count=os.cpu_count(),
                affinity=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                torch_threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"))


def _size_bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s.rstrip("KMG")) * mult


def l3_bytes() -> int:
    sizes = [_size_bytes(v) for k, v in cpu_facts()["caches"].items() if k.startswith("L3")]
    return max(sizes) if sizes else 32 << 20


# ---- timing ----------------------------------------------------------------------------------------


class Timer:
    """Wall-clock median (ms) of fn: warm-up runs, then up to ``reps`` runs, each after writing a
    flush buffer (so the measured run reads its data from memory, as a layer does in serving), and
    no more than ``budget_s`` seconds of runs unless fewer than ``min_reps``."""

    def __init__(self, reps: int, warmup: int, flush_bytes: int, budget_s: float, min_reps: int):
        self.reps, self.warmup, self.budget_s, self.min_reps = reps, warmup, budget_s, min_reps
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8) if flush_bytes else None
        self.mode = f"wall-clock, {flush_bytes >> 20} MiB flush" if flush_bytes else "wall-clock, no flush"
        self._i = 0

    def _flush(self):
        if self.flush is not None:
            self._i += 1
            self.flush.fill_(self._i & 0x7F)

    def __call__(self, fn) -> dict:
        t0 = time.perf_counter()
        for _ in range(max(1, self.warmup)):
            self._flush()
            t = time.perf_counter()
            fn()
            first = time.perf_counter() - t
            if time.perf_counter() - t0 > self.budget_s:
                break
        n = max(self.min_reps, min(self.reps, int(self.budget_s / max(first, 1e-6))))
        ts = []
        for _ in range(n):
            self._flush()
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return dict(ms=statistics.median(ts), min_ms=min(ts), reps=n)


def bandwidth(nbytes: int, reps: int) -> dict:
    """STREAM-like copy: (bytes read + bytes written) / time of a large uint8 tensor copy (torch's
    parallel copy, all threads; write-allocate traffic not counted, as STREAM); and a read-only float32
    sum of the same bytes."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    t = Timer(max(3, reps), 1, 0, 30.0, 3)
    copy = t(lambda: y.copy_(x))
    read = t(lambda: x.sum())
    return dict(copy_gbps=2 * nbytes / (copy["ms"] * 1e-3) / 1e9, read_gbps=nbytes / (read["ms"] * 1e-3) / 1e9,
                copy_bytes=nbytes, copy_ms=copy["ms"], read_ms=read["ms"])


# ---- vLLM's CPU attention (the bf16 baseline) -----------------------------------------------------


def load_vllm_op(dtype, D: int, block_size: int) -> dict:
    """{'ops': vllm._custom_ops, 'isa': ..., 'split_kv': ...} or {'error': why it cannot be called}."""
    try:
        import vllm
        from vllm import _custom_ops as ops  # loads vllm._C (registers torch.ops._C.*)
    except Exception as e:  # noqa: BLE001
        return dict(error=f"vLLM not importable: {type(e).__name__}: {e}")
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        return dict(error=f"vLLM {vllm.__version__} has no torch.ops._C.cpu_attention_with_kv_cache (not a CPU build)")
    try:
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, D, "auto")
        split = bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
    except Exception as e:  # noqa: BLE001
        return dict(error=f"vLLM's CPU backend helpers failed: {type(e).__name__}: {e}")
    # vLLM's op runs AMX tiles on an AMX CPU (isa "amx"); outside vLLM's worker nothing has asked Linux for the
    # tile state yet, and the first tile instruction was a SIGILL (an Intel AMX Xeon, issue 36): ask as the worker
    # does (cpu_isa.request_amx; a no-op without AMX)
    amx = request_amx()
    return dict(ops=ops, isa=isa, split_kv=split, version=vllm.__version__, amx_requested=amx)


class VllmBf16:
    """A bf16 paged cache of B requests x L tokens in vLLM's CPU layout, and its attention op."""

    def __init__(self, v: dict, B: int, L: int, H: int, HQ: int, D: int, dtype, block_size: int, fill: bool = True):
        self.v, self.H, self.HQ, self.D, self.dtype, self.bs = v, H, HQ, D, dtype, block_size
        per = -(-L // block_size)
        n = B * per
        # vLLM zero-fills its KV cache; its op multiplies masked (p = 0) slots' V by the weights, so
        # uninitialised memory (NaN bit patterns) in a page's unused slots would poison the check.
        self.kv = torch.zeros(n, H, block_size, 2 * D, dtype=dtype)
        if fill:  # random bf16 values (timing does not depend on them; the check writes through vLLM)
            self.kv.view(-1)[:].normal_()
        self.k, self.v_cache = self.kv.view(n, H, 2 * block_size, D).chunk(2, dim=2)  # as forward() does
        self.bt = torch.randperm(n).reshape(B, per).to(torch.int32)

    def write(self, key, value, r: int, start: int):
        """Write request r's tokens start.. (key/value [T, H, D]) with vLLM's own cache update."""
        pos = torch.arange(start, start + key.shape[0])
        slots = self.bt[r, pos // self.bs].long() * self.bs + pos % self.bs
        self.v["ops"].cpu_attn_reshape_and_cache(key, value, self.k, self.v_cache, slots, self.v["isa"])

    def metadata(self, qsl, seq_lens, causal: bool = True):
        return self.v["ops"].cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0], num_heads=self.HQ, num_kv_heads=self.H, head_dim=self.D, seq_lens=seq_lens,
            dtype=self.dtype, query_start_loc=qsl, causal=causal, sliding_window_size=-1, isa=self.v["isa"],
            enable_kv_split=self.v["split_kv"])

    def __call__(self, q, qsl, seq_lens, md, out, bt=None):
        self.v["ops"].cpu_attention_with_kv_cache(
            query=q, key_cache=self.k, value_cache=self.v_cache, output=out, query_start_loc=qsl, seq_lens=seq_lens,
            scale=self.D ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=self.bt if bt is None else bt, softcap=0.0, scheduler_metadata=md, s_aux=None)
        return out


def dense_attention(q, K, V, offset: int, scale: float) -> torch.Tensor:
    """float32 causal attention: q [T, HQ, D] at positions offset.., K/V [offset + T, H, D] -> [T, HQ, D]."""
    T, HQ, D = q.shape
    H = K.shape[1]
    g = HQ // H
    qh = q.float().view(T, H, g, D).permute(1, 2, 0, 3).reshape(H, g * T, D)
    k, v = K.float().transpose(0, 1), V.float().transpose(0, 1)
    s = (qh @ k.transpose(1, 2)).view(H, g, T, -1) * scale
    qpos = offset + torch.arange(T)
    s.masked_fill_(torch.arange(K.shape[0])[None, :] > qpos[:, None], -math.inf)
    o = torch.softmax(s, -1).view(H, g * T, -1) @ v
    return o.view(H, g, T, D).permute(2, 0, 1, 3).reshape(T, HQ, D)


def check_vllm(v: dict, shape: str, dtype, block_size: int, c: int, n: int, T: int) -> dict:
    """vLLM's op on a small cache it wrote itself (c requests of n tokens; the last T of each are its
    queries: T = 1 is a decode) against float32 dense attention."""
    sh = SHAPES[shape]
    H, HQ, D = sh["h"], sh["hq"], sh["d"]
    g = torch.Generator().manual_seed(7)
    base = VllmBf16(v, c, n, H, HQ, D, dtype, block_size, fill=False)
    K = torch.randn(c, n, H, D, generator=g).to(dtype)
    V = torch.randn(c, n, H, D, generator=g).to(dtype)
    for r in range(c):
        base.write(K[r], V[r], r, 0)
    q = torch.randn(c * T, HQ, D, generator=g).to(dtype)
    qsl = torch.arange(0, c * T + 1, T, dtype=torch.int32)
    sl = torch.full((c,), n, dtype=torch.int32)
    out = base(q, qsl, sl, base.metadata(qsl, sl), torch.empty_like(q))
    want = torch.cat([dense_attention(q[r * T:(r + 1) * T], K[r], V[r], n - T, D ** -0.5) for r in range(c)])
    err, ref = float((out.float() - want).abs().max()), float(want.abs().max())
    tol = VLLM_TOL * max(1.0, ref)
    return dict(vllm_check_err=err, vllm_check_tol=tol, vllm_check_ok=err <= tol, vllm_check=f"{c}x{n}, {T} queries")


def sdpa_decode(q, k, v, scale):
    """q [B, HQ, D], dense k/v [B, H, L, D]: the GQ query heads of a KV head as GQ rows (exact GQA)."""
    B, HQ, D = q.shape
    H = k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(q.view(B, H, HQ // H, D), k, v, scale=scale)
    return o.reshape(B, HQ, D)


# ---- bytes -------------------------------------------------------------------------------------------


def compressed_bytes(lc, B: int, L: int, H: int, HQ: int, Q: int = 1) -> dict:
    """Bytes a step of B requests reading L - Q cached tokens each (+ Q new tokens) must read at least
    once: encoded blocks [8, cend) as codes (+ outliers), the sinks and the incomplete block from the
    half-precision region, the new K/V and queries, block table, fp16 centroids and channel statistics
    once, and the C++ kernel's RoPE tables (tile starts, offsets in a tile)."""
    lay = lc.layout
    D, half = lay.head_dim, 2
    ctx = L - Q
    cend = ctx // BLOCK * BLOCK
    blocks = max(0, cend - SINKS) // BLOCK
    exact = min(SINKS, ctx) + (ctx - cend if ctx >= SINKS else 0)
    tile = cpu_ops._C.TILE if cpu_ops is not None and cpu_ops._C is not None else 32
    parts = {
        "codes": B * blocks * H * 2 * lay.code_bytes,
        "outliers": B * blocks * H * 2 * lay.cap * 4,  # int16 position + half value
        "region": B * exact * H * 2 * D * half,
        "new_kv_q": B * Q * (2 * H + HQ) * D * half,
        "block_table": B * -(-L // lay.block_size) * 4,
        "centroids": sum(q.codec.centroids.numel() for q in (lc.k, lc.v)) * 2,  # the kernel's fp16 tables
        "stats": 2 * 5 * H * D * 4,  # mean, std, 1/std, lo, hi per K/V
        "rope": (-(-L // tile) * D + D * tile) * 4,  # cos+sin at tile starts (D/2 each) and offsets
    }
    parts["total"] = sum(parts.values())
    return parts


DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def _isz(dt: str) -> int:
    return DTYPES[dt].itemsize


def dense_bytes(B: int, L: int, H: int, HQ: int, D: int, Q: int = 1, size: int = 2) -> int:
    """An uncompressed cache read (size bytes per value): all K and V of L tokens, plus the queries."""
    return B * (2 * H * L + Q * HQ) * D * size


# ---- one configuration -------------------------------------------------------------------------------


def _ratio(num, den):
    return None if num is None or not den else num / den


def _gbps(nbytes, ms):
    return None if ms is None else nbytes / (ms * 1e-3) / 1e9


def bench_baselines(a, vop: dict, shape: str, B: int, L: int, Q: int, dtype, timer) -> dict:
    """vLLM's bf16 op and SDPA on dense bf16 K/V at B x L (B requests, Q queries each at L - Q),
    their checks; one cache at a time."""
    sh = SHAPES[shape]
    H, HQ, D = sh["h"], sh["hq"], sh["d"]
    scale = D ** -0.5
    res = dict(dense_bytes=dense_bytes(B, L, H, HQ, D, Q, dtype.itemsize), vllm_ms=None, sdpa_ms=None)
    torch.manual_seed(a.seed + 3)
    q = torch.randn(B * Q, HQ, D).to(dtype)
    qsl = torch.arange(0, B * Q + 1, Q, dtype=torch.int32)
    sl = torch.full((B,), L, dtype=torch.int32)
    if "error" not in vop:
        # decode: the first requests at up to check_tokens; prefill: check_queries queries after up to
        # check_tokens cached tokens
        c, T = min(B, a.check_requests), min(Q, a.check_queries)
        n = min(L, a.check_tokens) if Q == 1 else min(L - Q, a.check_tokens) + T
        res.update(check_vllm(vop, shape, dtype, a.vllm_block_size, c, n, T))
        base = VllmBf16(vop, B, L, H, HQ, D, dtype, a.vllm_block_size)
        t = time.perf_counter()
        md = base.metadata(qsl, sl)
        res["vllm_metadata_ms"] = (time.perf_counter() - t) * 1e3
        out = torch.empty_like(q)
        tm = timer(lambda: base(q, qsl, sl, md, out))
        res.update(vllm_ms=tm["ms"], vllm_min_ms=tm["min_ms"], vllm_reps=tm["reps"],
                   vllm_block_size=a.vllm_block_size, vllm_isa=vop["isa"])
        del base, md, out
        gc.collect()
    if a.sdpa:
        k = torch.randn(B, H, L, D).to(dtype)
        v = torch.randn(B, H, L, D).to(dtype)
        if Q == 1:
            tm = timer(lambda: sdpa_decode(q, k, v, scale))
        else:  # one request: its chunk of Q queries at L - Q, causal (bottom-right aligned by an explicit mask)
            qh = q.view(Q, HQ, D).transpose(0, 1)[None]
            mask = torch.arange(L)[None, :] <= (L - Q + torch.arange(Q))[:, None]
            tm = timer(lambda: torch.nn.functional.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale,
                                                                                enable_gqa=True))
        res.update(sdpa_ms=tm["ms"], sdpa_reps=tm["reps"])
        del k, v
        gc.collect()
    return res


def bench_format(a, lc, shape: str, fmt: str, B: int, L: int, Q: int, timer, base: dict, bw: dict) -> dict:
    """The C++ kernels and the torch path on B requests x L tokens of fmt (Q queries each at L - Q)."""
    sh = SHAPES[shape]
    H, HQ, D = sh["h"], sh["hq"], sh["d"]
    dtype, scale = lc.dtype, D ** -0.5
    lay = lc.layout
    kind = "decode" if Q == 1 else "prefill"
    row = dict(kind=kind, shape=shape, B=B, L=L, Q=Q, offset=L - Q, format=fmt, block_size=lay.block_size,
               dtype=str(dtype)[6:])
    torch.manual_seed(a.seed)
    pages, bt = fill_pages(lc, B, L, H, D, torch.device("cpu"))
    row["cache_bytes"] = pages.numel()
    q = torch.randn(B * Q, HQ, D).to(dtype)
    key = torch.randn(B * Q, H, D).to(dtype)
    val = torch.randn(B * Q, H, D).to(dtype)

    # correctness first, on a slice: decode: the first requests at up to check_tokens tokens; prefill:
    # the chunk's first check_queries queries at the same offset
    if Q == 1:
        c, n, cq = min(B, a.check_requests), min(L, a.check_tokens), 1
    else:
        c, cq = 1, min(Q, a.check_queries)
        n = L - Q + cq
    qsl = torch.arange(0, c * cq + 1, cq, dtype=torch.int32)
    sl = torch.full((c,), n, dtype=torch.int32)
    sel = torch.cat([torch.arange(r * Q, r * Q + cq) for r in range(c)])
    args = (lc, pages, q[sel], key[sel], val[sel], qsl, sl, bt[:c], scale)
    want = paged_torch.paged_attention(*args, batch_invariant=False).float()
    got = cpu_ops.paged_attention(*args, batch_invariant=False).float()
    err, ref = float((got - want).abs().max()), float(want.abs().max())
    tol = TOL * max(1.0, ref)
    row.update(check=f"{c}x{n}, {cq} queries", max_abs_err=err, ref_absmax=ref, tol=tol, check_ok=err <= tol)
    del want, got

    qsl = torch.arange(0, B * Q + 1, Q, dtype=torch.int32)
    sl = torch.full((B,), L, dtype=torch.int32)
    out = torch.empty_like(q)
    cpp = timer(lambda: cpu_ops.paged_attention(lc, pages, q, key, val, qsl, sl, bt, scale, out=out,
                                                batch_invariant=False))
    tp = None
    if a.torch_path:
        tp = timer(lambda: paged_torch.paged_attention(lc, pages, q, key, val, qsl, sl, bt, scale, out=out,
                                                       batch_invariant=False))
    ms = cpp["ms"]
    parts = compressed_bytes(lc, B, L, H, HQ, Q)
    vms, sms = base.get("vllm_ms"), base.get("sdpa_ms")
    gbps, vgbps = _gbps(parts["total"], ms), _gbps(base["dense_bytes"], vms)
    row.update(
        cpp_ms=ms, cpp_min_ms=cpp["min_ms"], cpp_reps=cpp["reps"],
        torch_ms=tp and tp["ms"], torch_reps=tp and tp["reps"],
        vllm_ms=vms, sdpa_ms=sms,
        speedup_vs_torch=_ratio(tp and tp["ms"], ms), speedup_vs_vllm=_ratio(vms, ms),
        speedup_vs_sdpa=_ratio(sms, ms),
        bytes_read=parts["total"], bytes_breakdown=parts,
        bytes_per_token=parts["total"] / (B * L),  # per cached token and layer, everything included
        code_bytes_per_token=2 * H * lay.code_bytes / BLOCK,  # asymptotic: codes (K and V) only
        dense_bytes_per_token=2 * H * D * dtype.itemsize,
        dense_bytes=base["dense_bytes"], cpp_gbps=gbps, vllm_gbps=vgbps,
        cpp_bw_fraction=gbps / bw["copy_gbps"], vllm_bw_fraction=vgbps and vgbps / bw["copy_gbps"],
        tokens_per_s=B * Q / (ms * 1e-3),
    )
    if Q == 1 and cpp_ops_has_splits():
        row["cpp_splits"] = cpu_ops.num_splits(-(-L // cpu_ops._C.TILE))
    for k in ("vllm_check_err", "vllm_check_tol", "vllm_check_ok", "vllm_check", "vllm_isa", "vllm_block_size",
              "vllm_metadata_ms", "vllm_reps", "sdpa_reps"):
        if k in base:
            row[k] = base[k]
    return row


def cpp_ops_has_splits() -> bool:
    return cpu_ops._C is not None and hasattr(cpu_ops, "num_splits") and hasattr(cpu_ops._C, "TILE")


# ---- reporting ---------------------------------------------------------------------------------------


def row_key(r: dict, dt: str = "bf16") -> str:
    """The headline's shape key; a float32 run's keys start with f32- (bf16 keys as before)."""
    if r["kind"] == "decode":
        k = shape_key(r["shape"], r["B"], r["L"])
    else:
        k = f"prefill{r['Q']}-at{r['offset']}"
        k = k if r["shape"] == "llama8b" else f"{r['shape']}-{k}"
    return k if dt == "bf16" else f"{dt}-{k}"


def headline_figures(report: dict) -> dict:
    out = {}
    for r in report["rows"]:
        if r["format"] not in HEADLINE_FORMATS or not r["check_ok"]:
            continue
        if r["kind"] == "decode" and (r["B"], r["L"]) not in HEADLINE_POINTS:
            continue
        dt = report["settings"]["dtype"]
        for metric in ("speedup_vs_vllm", "speedup_vs_torch"):
            if r.get(metric) is not None and (metric != "speedup_vs_vllm" or r.get("vllm_check_ok")):
                name = f"speedup_vs_vllm_{dt}" if metric == "speedup_vs_vllm" else metric
                out[f"kernels.cpu.{row_key(r, dt)}.{r['format']}.{name}"] = r[metric]
    return out


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    s, m, bw = report["settings"], report["machine"], report["bandwidth"]
    dt = s["dtype"]
    lines = [f"# CPU kernels: C++ decode from the codes vs the torch path and vLLM's {dt} CPU attention", ""]
    if report["smoke"]:
        lines += ["**SMOKE RUN: tiny shapes. Timings are meaningless; only the checks count.**", ""]
    if not report["cpp_available"]:
        lines += [f"**The C++ extension did not load ({report['cpp_load_error']}): the `C++` column is the torch "
                  "fallback.**", ""]
    v = report["vllm"]
    lines += [
        f"Command: `{report['run']['command']}`  ",
        f"Time: {report['run']['time']}; CPU: {m['model']} ({m['cpu_count']} logical CPUs, caches "
        f"{', '.join(f'{k} {x}' for k, x in m['caches'].items())}); SIMD: {' '.join(m['simd'])}  ",
        f"torch {report['run']['machine']['torch']}, {m['torch_threads']} threads; C++ kernel variant: "
        f"{report['cpp_isa']}; vLLM: "
        + (f"{v['version']}, CPU attention ISA `{v['isa']}`, block size {s['vllm_block_size']}, "
           f"split-KV {v['split_kv']}"
           if "error" not in v else f"**not called: {v['error']}** (ratios vs SDPA on dense {dt} K/V)") + "  ",
        f"Timer: {report['timer']}, median of up to {s['reps']} runs (at most {s['budget_s']} s, at least "
        f"{s['min_reps']}); copy bandwidth {bw['copy_gbps']:.1f} GB/s (STREAM-like: read + write of a "
        f"{bw['copy_bytes'] >> 20} MiB copy), read-only {bw['read_gbps']:.1f} GB/s.  ",
        f"Model dtype {s['dtype']}; compressed pages of {s['block_size']} tokens; "
        f"K {'channel-chunked (hybrid layers)' if s['hybrid_k'] else 'as the format'}.",
        "",
        "One layer, the step's attention (cache update not timed).  C++ = `ops.cpu.paged_attention` (decode: the "
        "fused kernel from the codes; prefill: torch attention on C++-gathered K/V), torch = "
        f"`ops.paged_torch.paged_attention`, both `batch_invariant=False`; vLLM {dt} = "
        f"`torch.ops._C.cpu_attention_with_kv_cache` on a {dt} paged cache of the same B x L; SDPA = torch SDPA on "
        f"dense {dt} K/V.  x = baseline ms / C++ ms.  B/tok = bytes read per cached token and layer (codes + "
        f"sinks/tail + centroids once + ..., all included; codes alone in brackets) vs {dt} K+V = 2·Hkv·D·{_isz(dt)}.  "
        "GB/s = those bytes / time; frac = of the copy bandwidth.  err = max |C++ - torch| on the check slice.",
        "",
    ]
    for shape in s["shapes"]:
        sh = SHAPES[shape]
        rows = [r for r in report["rows"] if r["shape"] == shape]
        if not rows:
            continue
        lines += [f"## {shape}: {sh['hq']} query / {sh['h']} KV heads, head_dim {sh['d']}", "",
                  f"| step | B | L | format | C++ ms | torch ms | vLLM {dt} ms | SDPA ms | x vLLM {dt} | x torch | "
                  f"x SDPA | B/tok (codes) | {dt} B/tok | C++ GB/s (frac) | vLLM GB/s (frac) | err (tol) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ok = "" if r["check_ok"] else " **FAIL**"
            step = "decode" if r["kind"] == "decode" else f"prefill {r['Q']}@{r['offset']}"
            lines.append(
                f"| {step} | {r['B']} | {r['L']} | {r['format']} | {r['cpp_ms']:.3f} | {_f(r['torch_ms'], '.3f')} | "
                f"{_f(r['vllm_ms'], '.3f')} | {_f(r['sdpa_ms'], '.3f')} | "
                f"**{_f(r['speedup_vs_vllm'], '.2f')}** | {_f(r['speedup_vs_torch'], '.2f')} | "
                f"{_f(r['speedup_vs_sdpa'], '.2f')} | "
                f"{r['bytes_per_token']:.0f} ({r['code_bytes_per_token']:.0f}) | "
                f"{r['dense_bytes_per_token']} | {r['cpp_gbps']:.1f} ({r['cpp_bw_fraction']:.2f}) | "
                f"{_f(r['vllm_gbps'], '.1f')} ({_f(r['vllm_bw_fraction'], '.2f')}) | "
                f"{r['max_abs_err']:.1e} ({r['tol']:.0e}){ok} |")
        vc = [r for r in rows if r.get("vllm_check_err") is not None]
        if vc:
            worst = max(vc, key=lambda r: r["vllm_check_err"] / r["vllm_check_tol"])
            lines += ["", f"vLLM's op vs float32 dense attention on caches written by `cpu_attn_reshape_and_cache`: "
                          f"max err {max(r['vllm_check_err'] for r in vc):.1e} "
                          f"({'ok' if all(r['vllm_check_ok'] for r in vc) else '**FAIL**'}; worst slice "
                          f"{worst['vllm_check']})."]
        pre = [r for r in rows if r["kind"] == "prefill"]
        if pre:
            lines += ["", "Prefill, queries/s: " + ", ".join(
                f"C++ {r['format']} {r['tokens_per_s']:.0f}" for r in pre) + (
                f"; vLLM {dt} {pre[0]['Q'] / (pre[0]['vllm_ms'] * 1e-3):.0f}" if pre[0]["vllm_ms"] else "")
                + "."]
        lines.append("")
    if report.get("headline"):
        lines += ["Headline figures: " + ", ".join(f"`{k}` {v:.2f}" for k, v in report["headline"].items()), ""]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    dt, m = report["settings"]["dtype"], report["machine"]
    plot_decode_grid(
        [r for r in report["rows"] if r["kind"] == "decode"], report["settings"]["shapes"], path,
        time_series=[("cpp_ms", "o-", "C++ {f}", {}), ("torch_ms", "^:", "torch {f}", {"alpha": 0.6})],
        speedup_series=[("speedup_vs_vllm", "o-", "{f} vs vLLM " + dt, {})],
        baselines=[("vllm_ms", "kx--", f"vLLM {dt}"), ("sdpa_ms", "k+:", f"SDPA {dt}")],
        panel_title="{shape}, decode, B = {B}", time_label="time per layer (ms)",
        speedup_label=f"speedup vs vLLM {dt}",
        title=f"CPU decode from codes vs vLLM {dt}, {m['model']}, {m['torch_threads']} threads, C++ "
              f"{report['cpp_isa']}" + (" (SMOKE: timings meaningless)" if report["smoke"] else ""))


# ---- driver ------------------------------------------------------------------------------------------


def _print_row(r: dict) -> None:
    step = "decode" if r["kind"] == "decode" else f"prefill {r['Q']}@{r['offset']}"
    print(f"{r['shape']} {step} B={r['B']} L={r['L']} {r['format']}: C++ {r['cpp_ms']:.3f} ms, "
          f"torch {_f(r['torch_ms'], '.3f')}, vLLM {_f(r['vllm_ms'], '.3f')}, "
          f"x{_f(r['speedup_vs_vllm'], '.2f')} vLLM, x{_f(r['speedup_vs_torch'], '.2f')} torch, "
          f"{r['cpp_gbps']:.1f} GB/s, err {r['max_abs_err']:.1e}{'' if r['check_ok'] else ' FAIL'}"
          + ("" if r.get("vllm_check_ok", True) else " (vLLM check FAIL)"), flush=True)


def run(a) -> dict:
    global cpu_ops, paged_torch
    from vllm_temporalkv.formats import BLOCK_TOKENS, SINK_TOKENS
    from vllm_temporalkv.ops import cpu as _cpu
    from vllm_temporalkv.ops import paged_torch as _pt

    assert (BLOCK, SINKS) == (BLOCK_TOKENS, SINK_TOKENS)
    cpu_ops, paged_torch = _cpu, _pt
    if a.threads:
        torch.set_num_threads(a.threads)
    cpp = cpu_ops.available()
    if not cpp and not a.smoke:
        sys.exit(f"the C++ CPU kernels did not load ({cpu_ops._LOAD_ERROR}); build them "
                 "(pip install --no-build-isolation -e . --no-deps) or use --smoke")
    dtype = DTYPES[a.dtype]
    vops = {}
    timer = Timer(a.reps, a.warmup, a.flush_bytes, a.budget_s, a.min_reps)
    bw = bandwidth(a.copy_bytes, a.reps)
    machine = cpu_facts()
    print(f"{machine['model']}: {machine['torch_threads']} threads, SIMD {' '.join(machine['simd'])}, C++ "
          f"{cpu_ops.isa()}; copy {bw['copy_gbps']:.1f} GB/s, read {bw['read_gbps']:.1f} GB/s", flush=True)
    settings = dict(shapes=a.shapes, batch=a.batch, context=a.context, prefill=a.prefill, formats=a.formats,
                    dtype=a.dtype, block_size=a.block_size, vllm_block_size=a.vllm_block_size, hybrid_k=a.hybrid_k,
                    reps=a.reps, warmup=a.warmup, min_reps=a.min_reps, budget_s=a.budget_s,
                    check_requests=a.check_requests, check_tokens=a.check_tokens, check_queries=a.check_queries,
                    flush_bytes=a.flush_bytes, copy_bytes=a.copy_bytes, torch_path=a.torch_path, sdpa=a.sdpa,
                    seed=a.seed)
    report = dict(settings=settings, smoke=a.smoke, machine=machine, cpp_available=cpp, cpp_isa=cpu_ops.isa(),
                  cpp_supported_isas=cpu_ops.supported_isas(), cpp_load_error=cpu_ops._LOAD_ERROR,
                  vllm=None, timer=timer.mode, bandwidth=bw, rows=[], run=run_record())
    out = Path(a.out)
    stem = "kernels-cpu" if a.dtype == "bf16" else f"kernels-cpu-{a.dtype}"
    configs = [(B, L, 1) for B in a.batch for L in a.context]
    if a.prefill:
        Q, O = (int(x) for x in a.prefill.split("@"))
        configs.append((1, O + Q, Q))
    for shape in a.shapes:
        D = SHAPES[shape]["d"]
        vop = vops.setdefault(D, load_vllm_op(dtype, D, a.vllm_block_size))
        report["vllm"] = {k: v for k, v in vop.items() if k != "ops"}
        if "error" in vop:
            print(f"vLLM's CPU attention cannot be called: {vop['error']}; ratios vs SDPA {a.dtype}", flush=True)
        caches = {f: make_layer_cache(shape, f, dtype, a.block_size, a.hybrid_k, torch.device("cpu"), a.seed)
                  for f in a.formats}
        for B, L, Q in configs:
            base = bench_baselines(a, vop, shape, B, L, Q, dtype, timer)
            if base.get("vllm_check_ok") is False:
                print(f"  vLLM's op vs dense float32: err {base['vllm_check_err']:.1e} > {base['vllm_check_tol']:.0e}")
            for f, lc in caches.items():
                r = bench_format(a, lc, shape, f, B, L, Q, timer, base, bw)
                report["rows"].append(r)
                _print_row(r)
                write_json(out / f"{stem}.json", report)  # partial results survive an interruption
    report["headline"] = None if a.smoke or a.no_headline else headline_figures(report)
    write_json(out / f"{stem}.json", report)
    md = markdown(report)
    (out / f"{stem}.md").write_text(md)
    plot(report, out / f"{stem}.png")
    if report["headline"]:
        merge_headline(report["headline"])
    print()
    print(md)
    print(f"results in {out}")
    bad = [f"{r['shape']} {r['kind']} B={r['B']} L={r['L']} {r['format']}" for r in report["rows"] if not r["check_ok"]]
    bad += [f"vLLM op {r['shape']} {r['kind']} B={r['B']} L={r['L']}" for r in report["rows"]
            if r.get("vllm_check_ok") is False]
    if bad:  # results are written (failing rows kept out of the headline), but the run fails
        sys.exit("CHECK FAILED: " + "; ".join(dict.fromkeys(bad)))
    return report


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels_cpu", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None, help="default: both (smoke: smollm2)")
    p.add_argument("--batch", nargs="+", type=int, default=None, help="decode batch sizes (default 1 8; smoke: 1 2)")
    p.add_argument("--context", nargs="+", type=int, default=None,
                   help="decode contexts (default 2048 8192 32768; smoke: 100)")
    p.add_argument("--prefill", default=None,
                   help=f"prefill chunk Q@OFFSET (default {DEFAULT_PREFILL}; smoke: 24@40; 'none': skip)")
    p.add_argument("--formats", nargs="+", default=None,
                   help=f"default: {' '.join(DEFAULT_FORMATS)}; a '-o1' suffix adds the 1%% outliers")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"compressed page size (default {DEFAULT_BLOCK_SIZE}; smoke: 16)")
    p.add_argument("--vllm-block-size", type=int, default=VLLM_BLOCK_SIZE, help="vLLM cache block size")
    p.add_argument("--hybrid-k", action="store_true", help="K channel-chunked (the hybrid's channel layers)")
    p.add_argument("--reps", type=int, default=None, help="timed runs at most (default 30; smoke: 2)")
    p.add_argument("--min-reps", type=int, default=None, help="timed runs at least (default 3; smoke: 1)")
    p.add_argument("--warmup", type=int, default=None, help="default 3 (smoke: 1)")
    p.add_argument("--budget-s", type=float, default=20.0, help="seconds of timed runs per measurement, about")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--check-requests", type=int, default=2)
    p.add_argument("--check-tokens", type=int, default=2048, help="context of the decode checks")
    p.add_argument("--check-queries", type=int, default=128, help="prefill queries in the checks")
    p.add_argument("--flush-mib", type=int, default=None, help="cache flush between runs (default 2 x L3; 0: none)")
    p.add_argument("--copy-mib", type=int, default=None, help="copy bandwidth tensor (default 1024; smoke: 16)")
    p.add_argument("--no-torch-path", dest="torch_path", action="store_false", help="skip timing the torch path")
    p.add_argument("--no-sdpa", dest="sdpa", action="store_false", help="skip SDPA on dense K/V")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                   help="model dtype of both caches (f32: what serves fastest on CPUs without bf16 units); f32 "
                   "results go to kernels-cpu-f32.*, headline keys kernels.cpu.f32-...speedup_vs_vllm_f32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-headline", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny configurations through the same code")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results; smoke: a temp dir)")
    a = p.parse_args(argv)

    if a.smoke:
        if a.out is None:
            a.out = tempfile.mkdtemp(prefix="kernels-cpu-smoke-")
        if Path(a.out).resolve() == RESULTS.resolve():
            sys.exit("--smoke never writes to benchmarks/results: pass another --out")
        small = dict(shapes=["smollm2"], batch=[1, 2], context=[100], prefill="24@40", formats=["temporalkv-2bit"],
                     block_size=16, reps=2, min_reps=1, warmup=1, flush_mib=4, copy_mib=16)
    else:
        small = {}
    full = dict(shapes=list(SHAPES), batch=[1, 8], context=[2048, 8192, 32768], prefill=DEFAULT_PREFILL,
                formats=DEFAULT_FORMATS, block_size=DEFAULT_BLOCK_SIZE, reps=30, min_reps=3, warmup=3,
                flush_mib=max(64, 2 * l3_bytes() >> 20), copy_mib=1024)
    for k, v in full.items():
        if getattr(a, k) is None:
            setattr(a, k, small.get(k, v))
    if a.prefill in ("none", "0", ""):
        a.prefill = None
    elif a.prefill and (a.prefill.count("@") != 1 or not all(x.isdigit() for x in a.prefill.split("@"))):
        p.error("--prefill takes Q@OFFSET, e.g. 2048@6144")
    a.flush_bytes, a.copy_bytes = a.flush_mib << 20, a.copy_mib << 20
    if a.out is None:
        a.out = str(RESULTS)
    for f in a.formats:
        from vllm_temporalkv.formats import get_format

        get_format(parse_format(f)[0])  # fail early on a typo
    return run(a)


if __name__ == "__main__":
    main()
