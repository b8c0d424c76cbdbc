"""benchmarks.kernels' driver: every shape, batch, context and format measured, the results written."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from vllm_temporalkv.ops import triton_encode

from ..common import merge_headline, run_record, write_json
from ..kernel_common import check_block_geometry, make_layer_cache
from ..kernel_common import fmt_opt as _f
from ..timers import GpuTimer, copy_bandwidth
from .measure import bench_baselines, bench_decode, bench_encode
from .report import device_tag, headline_figures, markdown, plot


def run(a) -> dict:
    check_block_geometry()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no GPU)"
    tag = a.device_tag or (device_tag(name) if device.type == "cuda" else "cpu")
    timer = GpuTimer(device, a.reps, a.warmup, not a.no_graph)
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
