"""Launch settings of the Triton paged decode, side by side on one GPU (one device call).

    python -m benchmarks.gpu.decode_sweep --out $OUT/sweep.json     # on the GPU box

For each setting (module attributes of ops/triton_decode.py: warps, pipeline stages, tile tokens,
split waves, the code loads' cache modifier, the codebook loads' eviction policy), a check against
reference.paged_attention (one request, --check-tokens), then the decode time at each (B, L) with
the same timer as benchmarks/kernels (timers.GpuTimer: CUDA graph, L2 flush, median), with the fp16 paged
baseline of that module timed once per (B, L) in the same run.  Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import types

import torch

from ..common import run_record
from ..kernel_common import DEFAULT_BLOCK_SIZE, SHAPES, make_layer_cache

SETTINGS = {  # name: attributes of triton_decode (the first is the committed default), likeliest first
    "default": {},
    "w8+cg": dict(DECODE_WARPS=8, CODES_CACHE=".cg"),
    "cg": dict(CODES_CACHE=".cg"),
    "w8": dict(DECODE_WARPS=8),
    "w8+cg+bt64": dict(DECODE_WARPS=8, CODES_CACHE=".cg", TILE_TOKENS=64),
    "w4+cg+bt64": dict(CODES_CACHE=".cg", TILE_TOKENS=64),
    "cg+evl": dict(CODES_CACHE=".cg", CB_EVICT="evict_last"),
    "w8+cg+s1": dict(DECODE_WARPS=8, CODES_CACHE=".cg", DECODE_STAGES=1),
    "w8+cg+waves1": dict(DECODE_WARPS=8, CODES_CACHE=".cg", WAVES=1),
    "w16+cg+bt64": dict(DECODE_WARPS=16, CODES_CACHE=".cg", TILE_TOKENS=64),
    "w8+cg+waves4": dict(DECODE_WARPS=8, CODES_CACHE=".cg", WAVES=4),
    "w2+cg": dict(DECODE_WARPS=2, CODES_CACHE=".cg"),
    "w2": dict(DECODE_WARPS=2),
    "w1+cg": dict(DECODE_WARPS=1, CODES_CACHE=".cg"),
    "w2+cg+bt16": dict(DECODE_WARPS=2, CODES_CACHE=".cg", TILE_TOKENS=16),
    "w2+cg+bt64": dict(DECODE_WARPS=2, CODES_CACHE=".cg", TILE_TOKENS=64),
    "w2+cg+waves4": dict(DECODE_WARPS=2, CODES_CACHE=".cg", WAVES=4),
    "w1+cg+waves4": dict(DECODE_WARPS=1, CODES_CACHE=".cg", WAVES=4),
    "w2+cg+s1": dict(DECODE_WARPS=2, CODES_CACHE=".cg", DECODE_STAGES=1),
}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.decode_sweep")
    p.add_argument("--formats", nargs="+", default=["temporalkv-2bit"])
    p.add_argument("--points", nargs="+", default=["1x32768", "8x32768"], help="BxL")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--check-tokens", type=int, default=4096)
    p.add_argument("--out", default="decode_sweep.json")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if not torch.cuda.is_available() and not a.smoke:
        sys.exit("decode_sweep needs a CUDA GPU (--smoke: the interpreter, tiny points, meaningless times)")
    if a.smoke:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        a.points, a.settings, a.reps, a.check_tokens = ["1x64"], a.settings[:2], 1, 64
    from ..kernels import measure as K  # imports triton and the kernel modules: after TRITON_INTERPRET is decided
    from ..timers import GpuTimer

    dec = K.triton_decode
    base_attrs = {k: getattr(dec, k) for s in SETTINGS.values() for k in s}
    device, dtype = torch.device("cpu" if a.smoke else "cuda"), torch.bfloat16
    timer = GpuTimer(device, a.reps, 5, True)
    sh = SHAPES["llama8b"]
    H, HQ, D = sh["h"], sh["hq"], sh["d"]
    points = [tuple(int(x) for x in pt.split("x")) for pt in a.points]
    ns = types.SimpleNamespace(headroom=2 << 30, seed=0, check_requests=1, check_tokens=a.check_tokens)
    rep = {"device": "cpu" if a.smoke else torch.cuda.get_device_name(), "run": run_record(), "baselines": {}, "rows": []}
    for B, L in points:
        rep["baselines"][f"{B}x{L}"] = K.bench_baselines(ns, "llama8b", B, L, dtype, device, timer)
    for fmt in a.formats:
        lc = make_layer_cache("llama8b", fmt, dtype, 16 if a.smoke else DEFAULT_BLOCK_SIZE, False, device, 0)
        for name in a.settings:
            for k, v in base_attrs.items():
                setattr(dec, k, v)
            for k, v in SETTINGS[name].items():
                setattr(dec, k, v)
            for B, L in points:
                b = rep["baselines"][f"{B}x{L}"]
                try:
                    r = K.bench_decode(ns, lc, "llama8b", fmt, B, L, device, timer, b, 1.0)
                except Exception as e:  # noqa: BLE001  (a setting that does not compile is a result)
                    r = {"error": f"{type(e).__name__}: {e}"[:300]}
                r = {k: r.get(k) for k in ("time_ms", "max_abs_err", "check_ok", "error", "bytes_read", "skipped")}
                r.update(setting=name, format=fmt, B=B, L=L, fp16_paged_ms=b.get("fp16_paged_ms"), sdpa_ms=b.get("sdpa_ms"))
                rep["rows"].append(r)
                ms = r["time_ms"]
                print(f"{fmt:16} {name:14} B={B:<3} L={L:<6} " + (
                    f"{ms:.4f} ms  x{b['fp16_paged_ms'] / ms:.2f} fp16-paged  x{b['sdpa_ms'] / ms:.2f} sdpa  "
                    f"{r['bytes_read'] / ms / 1e6:.0f} GB/s  err {r['max_abs_err']:.1e} ok={r['check_ok']}"
                    if ms else f"failed: {r.get('error') or r.get('skipped')}"), flush=True)
                with open(a.out, "w") as f:
                    json.dump(rep, f, indent=1)
    return rep


if __name__ == "__main__":
    main()
