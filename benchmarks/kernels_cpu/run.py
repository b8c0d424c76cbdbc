"""benchmarks.kernels_cpu's driver: every shape and configuration measured, the results written."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from vllm_temporalkv.ops import cpu as cpu_ops

from ..common import is_results, merge_headline, run_record, write_json
from ..kernel_common import SHAPES, check_block_geometry, make_layer_cache
from ..timers import CpuTimer, bandwidth
from .config import DTYPES, cpu_facts
from .measure import bench_baselines, bench_format
from .report import _print_row, headline_figures, markdown, plot
from .vllm_op import load_vllm_op

def run(a) -> dict:
    check_block_geometry()
    if a.threads:
        torch.set_num_threads(a.threads)
    cpp = cpu_ops.available()
    if not cpp and not a.smoke:
        sys.exit(f"the C++ CPU kernels did not load ({cpu_ops._LOAD_ERROR}); build them "
                 "(pip install --no-build-isolation -e . --no-deps) or use --smoke")
    dtype = DTYPES[a.dtype]
    vops = {}
    timer = CpuTimer(a.reps, a.warmup, a.flush_bytes, a.budget_s, a.min_reps)
    bw = bandwidth(a.copy_bytes, a.reps)
    machine = cpu_facts()
    print(f"{machine['model']}: {machine['torch_threads']} threads, SIMD {' '.join(machine['simd'])}, C++ "
          f"{cpu_ops.isa()}; copy {bw['copy_gbps']:.1f} GB/s, read {bw['read_gbps']:.1f} GB/s", flush=True)
    settings = dict(shapes=a.shapes, batch=a.batch, context=a.context, prefill=a.prefill, formats=a.formats,
                    dtype=a.dtype, block_size=a.block_size, vllm_block_size=a.vllm_block_size, hybrid_k=a.hybrid_k,
                    reps=a.reps, warmup=a.warmup, min_reps=a.min_reps, budget_s=a.budget_s,
                    check_requests=a.check_requests, check_tokens=a.check_tokens, check_queries=a.check_queries,
                    flush_bytes=a.flush_bytes, copy_bytes=a.copy_bytes, torch_path=a.torch_path, sdpa=a.sdpa,
                    seed=a.seed,
                    prefill_attention="torch's flash kernel (ops.cpu_flash)" if cpu_ops.use_flash_prefill(dtype)
                    else "the C++ prefill kernel")
    report = dict(settings=settings, smoke=a.smoke, machine=machine, cpp_available=cpp, cpp_isa=cpu_ops.isa(),
                  cpp_supported_isas=cpu_ops.supported_isas(), cpp_load_error=cpu_ops._LOAD_ERROR,
                  vllm=None, timer=timer.mode, bandwidth=bw, rows=[], run=run_record())
    out = Path(a.out)
    # the first figures came from an AVX2 machine (kernels-cpu.*, headline kernels.cpu.*); another class's run
    # keeps its own files and keys (kernels-cpu-avx512bf16.*, kernels.cpu-avx512bf16.*)
    cls = "" if machine.get("cpu_class") == "avx2" else f"-{machine.get('cpu_class')}"
    stem = f"kernels-cpu{cls}" + ("" if a.dtype == "bf16" else f"-{a.dtype}")
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
    report["headline"] = (None if a.smoke or a.no_headline or not is_results(out)
                          else headline_figures(report, "cpu" + cls))
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
