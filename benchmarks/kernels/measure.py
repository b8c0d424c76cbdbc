"""One configuration of benchmarks.kernels measured: the baselines, the Triton decode from the codes, the fused
encode; each checked against the torch reference before it is timed.  Imported once TRITON_INTERPRET is decided."""

from __future__ import annotations

import math

import torch
import triton

from vllm_temporalkv.ops import paged_torch as reference
from vllm_temporalkv.ops import triton_decode, triton_encode

from ..kernel_common import BLOCK, SINKS, SHAPES, dense_bytes, fill_pages, sdpa_decode
from ..kernel_common import gbps as _gbps
from ..kernel_common import ratio as _ratio
from .fp16_paged import Fp16Paged

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
