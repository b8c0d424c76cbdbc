"""One configuration of benchmarks.kernels_cpu measured: vLLM's op and SDPA (the baselines), then the C++ kernels
and the torch path on the same B x L, each checked before it is timed."""

from __future__ import annotations

import gc
import time

import torch

from vllm_temporalkv.layout import exact_from
from vllm_temporalkv.ops import cpu as cpu_ops
from vllm_temporalkv.ops import paged_torch

from ..kernel_common import BLOCK, SINKS, SHAPES, dense_bytes, fill_pages, sdpa_decode
from ..kernel_common import gbps as _gbps
from ..kernel_common import ratio as _ratio
from .config import TOL
from .vllm_op import VllmBf16, check_vllm

def compressed_bytes(lc, B: int, L: int, H: int, HQ: int, Q: int = 1) -> dict:
    """Bytes a step of B requests reading L - Q cached tokens each (+ Q new tokens) must read at least
    once: encoded blocks [8, cend) as codes (+ outliers), the sinks and the incomplete block from the
    half-precision region, the new K/V and queries, block table, fp16 centroids and channel statistics
    once, and the C++ kernel's RoPE tables (tile starts, offsets in a tile)."""
    lay = lc.layout
    D, half = lay.head_dim, 2
    ctx = L - Q
    cend = exact_from(ctx, lay.window) if ctx >= SINKS else 0  # a recent window's tokens stay exact too
    blocks = max(0, cend - SINKS) // BLOCK
    exact = min(SINKS, ctx) + (ctx - cend if ctx >= SINKS else 0)
    tile = cpu_ops.DECODE_TILE  # the decode kernel's tile (its rope tables)
    parts = {
        "codes": B * blocks * H * block_code_bytes(lay),
        "outliers": B * blocks * H * 2 * lay.cap * 4,  # int16 position + half value
        "region": B * exact * H * 2 * D * half,
        "new_kv_q": B * Q * (2 * H + HQ) * D * half,
        "block_table": B * -(-L // lay.block_size) * 4,
        "centroids": sum(table_bytes(q) for q in (lc.k, lc.v)),  # the kernel's tables
        "stats": 2 * 5 * H * D * 4,  # mean, std, 1/std, lo, hi per K/V
        "rope": (-(-L // tile) * D + D * tile) * 4,  # cos+sin at tile starts (D/2 each) and offsets
    }
    parts["total"] = sum(parts.values())
    return parts


def block_code_bytes(lay) -> int:
    """K + V bytes of one encoded block of one KV head: codes, and the scaled formats' fp16 scales (and TaDA's share
    of the head mean); QJL's keys: their sketch bytes."""
    rows = BLOCK * (lay.kind_scales_per_row["k"] + lay.kind_scales_per_row["v"]) * 2
    return lay.kind_code_bytes["k"] + lay.kind_code_bytes["v"] + rows + 2 * lay.mean_bytes


def table_bytes(q) -> int:
    """The decode kernel's lookup tables of one quantizer: fp16 centroids, QJL's float32 S^T, none for scaled codes."""
    centroids = getattr(getattr(q, "codec", None), "centroids", None)
    if centroids is not None:
        return centroids.numel() * 2
    S = getattr(q, "S", None)
    return S.numel() * 4 if S is not None else 0


# ---- one configuration -------------------------------------------------------------------------------


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
    # (a prefill chunk's context: the L - Q tokens before it, its own written by the timed call)
    pages, bt = fill_pages(lc, B, L, H, D, torch.device("cpu"), written=L - Q if Q > 1 else L)
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
    if Q > 1:  # the timed prefill is the served chunk's (ops.cpu.forward: write, then attend): checked the same way
        pos = torch.arange(n - cq, n)
        fwd = cpu_ops.forward(lc, pages.clone(), q[sel], key[sel], val[sel], qsl, sl, bt[:c], pos,
                              bt[0, pos // lay.block_size].long(), scale, batch_invariant=False).float()
        ferr = float((fwd - want).abs().max())
        row.update(served_max_abs_err=ferr, check_ok=row["check_ok"] and ferr <= tol)
        del fwd
    del want, got

    qsl = torch.arange(0, B * Q + 1, Q, dtype=torch.int32)
    sl = torch.full((B,), L, dtype=torch.int32)
    out = torch.empty_like(q)
    if Q == 1:  # decode: the fused kernel (the step's cache update not timed)
        cpp = timer(lambda: cpu_ops.paged_attention(lc, pages, q, key, val, qsl, sl, bt, scale, out=out,
                                                    batch_invariant=False))
    else:  # prefill: a served chunk writes its tokens, then attends over the decoded context (ops.cpu.forward);
        # paged_attention would encode and decode the chunk's own keys in torch first (the torch path's
        # attend-first order: 2x the served chunk's time for a codebook format on the AMX Xeon)
        pos = (L - Q + torch.arange(Q)).repeat(B)
        pid = bt[torch.arange(B).repeat_interleave(Q), pos // lay.block_size].long()
        cpp = timer(lambda: cpu_ops.forward(lc, pages, q, key, val, qsl, sl, bt, pos, pid, scale, out=out,
                                            batch_invariant=False))
        # the chunk's write alone (its blocks encoded, the rest stored exact), timed the same way: the part of the
        # served chunk that vLLM's prefill rows leave out (their cache write is not timed), and on a CPU whose
        # attention runs on AMX tiles the part no tile speeds up.  Writing the same tokens again stores the same
        # pages (the forward above wrote them already).
        if lc.layout.window:
            wr = timer(lambda: cpu_ops.write_kv_window(lc, pages, key, val, qsl, sl, bt))
        else:
            wr = timer(lambda: cpu_ops.write_kv(lc, pages, key, val, pos, pid))
        row.update(write_ms=wr["ms"], write_fraction=wr["ms"] / cpp["ms"])
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
        code_bytes_per_token=H * block_code_bytes(lay) / BLOCK,  # asymptotic: codes (K and V) only
        dense_bytes_per_token=2 * H * D * dtype.itemsize,
        dense_bytes=base["dense_bytes"], cpp_gbps=gbps, vllm_gbps=vgbps,
        cpp_bw_fraction=gbps / bw["copy_gbps"], vllm_bw_fraction=vgbps and vgbps / bw["copy_gbps"],
        tokens_per_s=B * Q / (ms * 1e-3),
    )
    if Q == 1 and cpp_ops_has_splits():
        row["cpp_splits"] = cpu_ops.num_splits(-(-L // cpu_ops.DECODE_TILE))
    for k in ("vllm_check_err", "vllm_check_tol", "vllm_check_ok", "vllm_check", "vllm_isa", "vllm_block_size",
              "vllm_metadata_ms", "vllm_reps", "sdpa_reps"):
        if k in base:
            row[k] = base[k]
    return row


def cpp_ops_has_splits() -> bool:
    return cpu_ops._C is not None and hasattr(cpu_ops, "num_splits")
