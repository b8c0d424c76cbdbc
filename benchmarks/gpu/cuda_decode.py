"""The CUDA decode kernel (csrc/cuda/, issue 32) on a GPU for the first time: check, then time.  One process:

    python -m benchmarks.gpu.cuda_decode --out $OUT/cuda          # the GPU box (bash benchmarks/gpu/h100.sh cuda)
    python -m benchmarks.gpu.cuda_decode --dry-run --out /tmp/c   # no GPU: the same steps, the CPU emulator standing
                                                                  # in for the kernel, tiny contexts, no timings

1. probe   mma.m16n8k16 and movmatrix on random fragments (csrc/cuda/probe.cu) against the layouts the kernel and
           its emulator assume (ops/cuda_emulator.py mma16816 / movmatrix_trans): if this fails, nothing else is
           meaningful, and it says which instruction;
2. build   every variant the run needs, nvcc's resource usage (registers, spills) and the loaded registers;
3. check   the 10 format cases of tests/test_triton_kernels.py (real encodes, scattered pages) and random
           configurations (lengths, page sizes, splits, units), the output poisoned with NaN before each launch,
           against paged_torch.paged_attention on the GPU, and on the cases against the CPU emulator (the same
           program: a difference there and not against the oracle would point at the GPU, not the design); one
           launch captured in a CUDA graph and replayed;
4. time    Llama-3.1-8B shapes (32 / 8 heads, D = 128, bf16, 1024-token pages), B x L: the CUDA kernel, the Triton
           decode, torch SDPA on dense K/V and the fp16 paged Triton kernel (benchmarks.kernels), each from a CUDA
           graph behind an L2 flush, after a check of each configuration's first requests against the oracle;
           bytes read and their fraction of the copy bandwidth measured in the same run.
Writes cuda_decode.json (and .md) to --out; the issue's headline keys (kernels.<card>.b8-l32768.temporalkv-2bit.
speedup_vs_sdpa, ...) are in its "headline" for the CUDA kernel, not merged into benchmarks/results/headline.json
(the kernel serves only when asked).  Exit status 1 when a check fails (results still written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

DEFAULT_FORMATS = ["temporalkv-2bit", "temporalkv-1bit", "temporalkv-4bit"]


def _f(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


# ---- 1. probe ------------------------------------------------------------------------------------------------------

def probe(report: dict, dry: bool) -> bool:
    from vllm_temporalkv.ops import cuda_emulator as emu

    g = torch.Generator().manual_seed(7)
    halves = (torch.randn(32, 14, generator=g) * 2).half()  # 7 words of 2 halves per lane
    words = (halves.view(torch.int16).to(torch.int64) & 0xFFFF).view(32, 7, 2)
    w = words[..., 0] | (words[..., 1] << 16)  # [32, 7]
    want_d = emu.mma16816(torch.zeros(32, 4), [w[:, i] for i in range(4)], w[:, 4], w[:, 5])
    want_m = emu.movmatrix_trans(w[:, 6])
    res = dict(ran=not dry)
    if dry:  # no GPU: the model against plain matrices (catches an emulator bug, not a hardware difference)
        A = torch.zeros(16, 16)
        for lane in range(32):
            n, t = lane // 4, lane % 4
            for r, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                lo, hi = emu._h(w[lane:lane + 1, r])
                A[n + dr, 2 * t + dc], A[n + dr, 2 * t + 1 + dc] = float(lo), float(hi)
        res["model_self_check"] = bool(torch.isfinite(want_d).all()) and A.abs().sum() > 0
        report["probe"] = res
        return True
    from vllm_temporalkv.ops import cuda

    dev = torch.device("cuda")
    cubin = cuda.build_source("probe.cu", torch.cuda.get_device_capability(dev))
    drv = cuda.driver()
    torch.empty(1, device=dev)
    fn = drv.function(drv.load(cubin.read_bytes()), "tkv_probe")
    inp = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32).contiguous().to(dev)  # the same 32 bits
    dout = torch.full((32, 4), float("nan"), device=dev)
    mout = torch.zeros(32, dtype=torch.int32, device=dev)
    import ctypes

    args = [ctypes.c_uint64(t.data_ptr()) for t in (inp, dout, mout)]
    drv.launch(fn, (1, 1, 1), (32, 1, 1), 0, torch.cuda.current_stream(dev).cuda_stream, *args)
    torch.cuda.synchronize(dev)
    got_d, got_m = dout.cpu(), mout.cpu().to(torch.int64) & 0xFFFFFFFF
    res["mma_max_err"] = float((got_d - want_d).abs().max())
    res["mma_ok"] = bool(torch.allclose(got_d, want_d, rtol=1e-4, atol=1e-3))
    res["movmatrix_ok"] = bool(torch.equal(got_m, want_m))
    if not res["movmatrix_ok"]:  # which layout did the hardware use? (identity / transpose of the source)
        res["movmatrix_equals_source"] = bool(torch.equal(got_m, w[:, 6]))
    report["probe"] = res
    print(f"probe: mma {'ok' if res['mma_ok'] else 'MISMATCH'} (max err {res['mma_max_err']:.2e}), movmatrix "
          f"{'ok' if res['movmatrix_ok'] else 'MISMATCH'}")
    return res["mma_ok"] and res["movmatrix_ok"]


# ---- the kernel under test -------------------------------------------------------------------------------------------

def kernel(dry: bool):
    """cuda.paged_attention, or (dry run) the CPU emulator behind the same signature."""
    if not dry:
        from vllm_temporalkv.ops import cuda

        return cuda.paged_attention
    from vllm_temporalkv.ops import cuda_emulator as emu

    def emulated(lc, pages, query, key, value, qsl, seq_lens, block_tables, scale, out=None, *, splits=None,
                 units=None):
        res = emu.paged_attention(lc, pages, query, key, value, qsl, seq_lens, block_tables, scale, splits=splits,
                                  units=units)
        if out is None:
            return res.out
        out.copy_(res.out)
        return out

    return emulated


def poisoned_run(fn, lc, pages, q, key, val, qsl, sl, bt, scale, **kw):
    out = torch.full_like(q, float("nan"))
    fn(lc, pages, q, key, val, qsl, sl, bt, scale, out, **kw)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return out


def compare(out: torch.Tensor, ref: torch.Tensor, dtype, lens) -> dict:
    from tests.kernel_cases import _tol

    live = torch.tensor([n > 0 for n in lens], device=out.device)
    unwritten = int(torch.isnan(out[live]).any(-1).any(-1).sum())
    err = float((out.float() - ref.float()).abs()[live].nan_to_num(float("inf")).max()) if bool(live.any()) else 0.0
    tol = _tol(dtype) * max(1.0, float(ref.float().abs().max()))
    return dict(max_abs_err=err, tol=tol, unwritten_rows=unwritten, ok=unwritten == 0 and err <= tol)


# ---- 3. check --------------------------------------------------------------------------------------------------------

def check(report: dict, dry: bool, seeds: int) -> bool:
    from tests.kernel_cases import CASES, IDS, _batch, _decode_setup
    from vllm_temporalkv.ops import cuda_emulator as emu, paged_torch as reference

    fn = kernel(dry)
    rows, ok = [], True
    lens = [1, 5, 8, 9, 16, 17, 40, 75]
    for case, cid in zip(CASES, IDS):
        lc, pages, tables, kv, q = _decode_setup(case, lens)
        ctx = {r: (0, n - 1) for r, n in enumerate(lens) if n > 1}
        reference.write_kv(lc, pages, *_batch(kv, ctx, tables, lc.block_size))
        key = torch.stack([kv[r][0][-1] for r in range(len(lens))]).to(lc.dtype)
        val = torch.stack([kv[r][1][-1] for r in range(len(lens))]).to(lc.dtype)
        qsl, sl = torch.arange(len(lens) + 1, device=q.device), torch.tensor(lens, device=q.device)
        scale = case[1] ** -0.5
        ref = reference.paged_attention(lc, pages, q, key, val, qsl, sl, tables, scale)
        for kw in (dict(), dict(splits=3, units=2)):
            row = dict(case=cid, **kw, **compare(poisoned_run(fn, lc, pages, q, key, val, qsl, sl, tables, scale,
                                                              **kw), ref, lc.dtype, lens))
            if kw and not dry:  # the same program on the CPU: the GPU should agree with it to rounding
                e = emu.paged_attention(lc, pages.cpu(), q.cpu(), key.cpu(), val.cpu(), qsl.cpu(), sl.cpu(),
                                        tables.cpu(), scale, **kw).out
                got = poisoned_run(fn, lc, pages, q, key, val, qsl, sl, tables, scale, **kw)
                row["vs_emulator_max_abs"] = float((got.cpu().float() - e.float()).abs().max())
            rows.append(row)
            ok &= row["ok"]
            print(f"check {cid} {kw or 'default'}: err {row['max_abs_err']:.2e} (tol {row['tol']:.1e}), unwritten "
                  f"{row['unwritten_rows']}{', vs emulator %.1e' % row['vs_emulator_max_abs'] if 'vs_emulator_max_abs' in row else ''}"
                  f"{'' if row['ok'] else '  FAIL'}")
    # random configurations: lengths up to several tiles, page sizes, split and unit counts
    g = torch.Generator().manual_seed(11)
    for seed in range(seeds):
        case = CASES[int(torch.randint(len(CASES), (1,), generator=g))]
        n_req = int(torch.randint(1, 6, (1,), generator=g))
        rl = [int(x) for x in torch.randint(1, 40 if dry else 400, (n_req,), generator=g)]
        bs = [16, 32, 64][int(torch.randint(3, (1,), generator=g))]
        lc, pages, tables, kv, q = _decode_setup(case, rl, block_size=bs, seed=100 + seed)
        ctx = {r: (0, n - 1) for r, n in enumerate(rl) if n > 1}
        reference.write_kv(lc, pages, *_batch(kv, ctx, tables, lc.block_size))
        key = torch.stack([kv[r][0][-1] for r in range(n_req)]).to(lc.dtype)
        val = torch.stack([kv[r][1][-1] for r in range(n_req)]).to(lc.dtype)
        qsl, sl = torch.arange(n_req + 1, device=q.device), torch.tensor(rl, device=q.device)
        scale = case[1] ** -0.5
        ref = reference.paged_attention(lc, pages, q, key, val, qsl, sl, tables, scale)
        kw = dict(splits=int(torch.randint(1, 6, (1,), generator=g)), units=int(torch.randint(1, 3, (1,), generator=g)))
        row = dict(case=f"random{seed}:{case[0]}-d{case[1]}", lens=rl, block_size=bs, **kw,
                   **compare(poisoned_run(fn, lc, pages, q, key, val, qsl, sl, tables, scale, **kw), ref, lc.dtype, rl))
        rows.append(row)
        ok &= row["ok"]
        print(f"check {row['case']} lens {rl} pages {bs} {kw}: err {row['max_abs_err']:.2e}"
              f"{'' if row['ok'] else '  FAIL'}")
    if not dry:  # a CUDA graph of one decode (what vLLM replays): no host sync inside, same output
        case = CASES[1]
        lc, pages, tables, kv, q = _decode_setup(case, lens)
        reference.write_kv(lc, pages, *_batch(kv, {r: (0, n - 1) for r, n in enumerate(lens) if n > 1}, tables,
                                              lc.block_size))
        key = torch.stack([kv[r][0][-1] for r in range(len(lens))]).to(lc.dtype)
        val = torch.stack([kv[r][1][-1] for r in range(len(lens))]).to(lc.dtype)
        qsl, sl = torch.arange(len(lens) + 1, device=q.device), torch.tensor(lens, device=q.device, dtype=torch.int32)
        out = torch.empty_like(q)
        fn(lc, pages, q, key, val, qsl, sl, tables.to(torch.int32), 0.125, out)  # build + warm outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(lc, pages, q, key, val, qsl, sl, tables.to(torch.int32), 0.125, out)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.paged_attention(lc, pages, q, key, val, qsl, sl, tables, 0.125)
        row = dict(case="cuda-graph replay", **compare(out, ref, lc.dtype, lens))
        rows.append(row)
        ok &= row["ok"]
        print(f"check cuda graph replay: err {row['max_abs_err']:.2e}{'' if row['ok'] else '  FAIL'}")
    report["check"] = rows
    return ok


def _kernels() -> types.SimpleNamespace:
    """The pieces of benchmarks.kernels this run reuses (baselines, pages, bytes, timer), under one name."""
    from benchmarks import kernel_common as C, timers
    from benchmarks.kernels import measure

    return types.SimpleNamespace(SHAPES=C.SHAPES, make_layer_cache=C.make_layer_cache, fill_pages=C.fill_pages,
                                 _ratio=C.ratio, Timer=timers.GpuTimer, copy_bandwidth=timers.copy_bandwidth,
                                 bench_baselines=measure.bench_baselines, compressed_bytes=measure.compressed_bytes,
                                 reference=measure.reference, triton_decode=measure.triton_decode)


# ---- 4. time ---------------------------------------------------------------------------------------------------------

def timings(a, report: dict, dry: bool) -> bool:
    K = _kernels()
    from vllm_temporalkv.ops import cuda_plan as P

    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.bfloat16
    sh = K.SHAPES[a.shape]
    H, HQ, D = sh["h"], sh["hq"], sh["d"]
    scale = D ** -0.5
    timer = K.Timer(device, a.reps, a.warmup, True)
    ns = types.SimpleNamespace(headroom=a.headroom_gib * 2 ** 30, check_requests=a.check_requests,
                               check_tokens=a.check_tokens)
    copy_gbps = None if dry else K.copy_bandwidth(timer, device, 1 << 30)
    report.update(timer=timer.mode, copy_gbps=copy_gbps)
    if copy_gbps:
        print(f"copy bandwidth {copy_gbps:.0f} GB/s ({timer.mode})")
    fn = kernel(dry)
    if dry:
        sms, smem = 132, P.SMEM_LIMITS[(9, 0)]
    else:
        from vllm_temporalkv.ops import cuda

        _, sms, smem = cuda._device_limits(device)  # what cuda.paged_attention will plan with
    rows, ok = [], True
    caches = {f: K.make_layer_cache(a.shape, f, dtype, a.block_size, False, device, a.seed) for f in a.formats}
    for B in a.batch:
        for L in a.context:
            Lr = min(L, 64) if dry else L  # dry run: the same code on a context the emulator replays in seconds
            base = {} if dry else K.bench_baselines(ns, a.shape, B, Lr, dtype, device, timer)
            for f, lc in caches.items():
                row = dict(shape=a.shape, B=B, L=Lr, format=f, dtype="bf16", block_size=a.block_size)
                try:
                    torch.manual_seed(a.seed)
                    pages, bt = K.fill_pages(lc, B, Lr, H, D, device)
                    q = torch.randn(B, HQ, D, dtype=dtype, device=device)
                    key = torch.randn(B, H, D, dtype=dtype, device=device)
                    val = torch.randn(B, H, D, dtype=dtype, device=device)
                    launch = P.make_launch(lc, B, HQ, bt.shape[1] * lc.layout.block_size, sms=sms, smem_limit=smem)
                    row.update(splits=launch.S, units=launch.plan.units, smem=launch.plan.bytes,
                               variant=launch.variant.name)
                    c, n = min(B, a.check_requests), min(Lr, a.check_tokens)
                    qsl = torch.arange(c + 1, dtype=torch.int32, device=device)
                    sl = torch.full((c,), n, dtype=torch.int32, device=device)
                    args = (lc, pages, q[:c], key[:c], val[:c], qsl, sl, bt[:c], scale)
                    ref = K.reference.paged_attention(*args)
                    chk = compare(poisoned_run(fn, *args), ref, dtype, [n] * c)
                    row.update(check_requests=c, check_tokens=n, **{f"check_{k}": v for k, v in chk.items()})
                    ok &= chk["ok"]
                    if not dry:
                        tri = K.triton_decode.paged_attention(*args)
                        row["triton_max_abs_err"] = float((tri.float() - ref.float()).abs().max())
                        qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
                        sl = torch.full((B,), Lr, dtype=torch.int32, device=device)
                        out = torch.empty_like(q)
                        full = (lc, pages, q, key, val, qsl, sl, bt, scale)
                        row["cuda_ms"] = timer(lambda: fn(*full, out))
                        row["triton_ms"] = timer(lambda: K.triton_decode.paged_attention(*full, out=out))
                    del pages, bt
                except torch.cuda.OutOfMemoryError:
                    row["skipped"] = "out of memory"
                    rows.append(row)
                    continue
                parts = K.compressed_bytes(lc, B, Lr, H, HQ)
                ms = row.get("cuda_ms")
                row.update(bytes_read=parts["total"], sdpa_ms=base.get("sdpa_ms"), fp16_paged_ms=base.get("fp16_paged_ms"),
                           speedup_vs_sdpa=K._ratio(base.get("sdpa_ms"), ms),
                           speedup_vs_fp16_paged=K._ratio(base.get("fp16_paged_ms"), ms),
                           speedup_vs_triton=K._ratio(row.get("triton_ms"), ms),
                           gbps=None if ms is None else parts["total"] / (ms * 1e-3) / 1e9)
                row["bw_fraction"] = None if row["gbps"] is None or not copy_gbps else row["gbps"] / copy_gbps
                rows.append(row)
                print(f"{a.shape} B={B} L={Lr} {f}: cuda {_f(ms)} ms, triton {_f(row.get('triton_ms'))}, sdpa "
                      f"{_f(row['sdpa_ms'])}, fp16 paged {_f(row['fp16_paged_ms'])}; x{_f(row['speedup_vs_sdpa'], '.2f')} "
                      f"SDPA, x{_f(row['speedup_vs_fp16_paged'], '.2f')} fp16 paged, bw {_f(row['bw_fraction'], '.2f')}; "
                      f"S={row['splits']} units={row['units']} smem={row['smem']}; err {row['check_max_abs_err']:.1e}"
                      f"{'' if row['check_ok'] else ' FAIL'}")
                write_report(a, report | dict(rows=rows))
    report["rows"] = rows
    return ok


def headline(report: dict) -> dict:
    from benchmarks.kernel_common import shape_key

    out = {}
    for r in report.get("rows", []):
        if (r["B"], r["L"]) not in ((1, 32768), (8, 32768)) or not r.get("check_ok") or r.get("cuda_ms") is None:
            continue
        for m in ("speedup_vs_sdpa", "speedup_vs_fp16_paged", "bw_fraction", "speedup_vs_triton"):
            if r.get(m) is not None:
                out[f"kernels.{report['device_tag']}.{shape_key(r['shape'], r['B'], r['L'])}.{r['format']}.{m}"] = r[m]
    return out


def markdown(report: dict) -> str:
    lines = [f"# CUDA decode kernel: {report['device']} ({report.get('timer')}, copy {_f(report.get('copy_gbps'), '.0f')} GB/s)",
             "", "| B | L | format | CUDA ms | Triton ms | SDPA ms | fp16 paged ms | x SDPA | x fp16 paged | x Triton | "
             "bw frac | splits | units | err |", "|" + "---|" * 14]
    for r in report.get("rows", []):
        lines.append(f"| {r['B']} | {r['L']} | {r['format']} | {_f(r.get('cuda_ms'))} | {_f(r.get('triton_ms'))} | "
                     f"{_f(r.get('sdpa_ms'))} | {_f(r.get('fp16_paged_ms'))} | {_f(r.get('speedup_vs_sdpa'), '.2f')} | "
                     f"{_f(r.get('speedup_vs_fp16_paged'), '.2f')} | {_f(r.get('speedup_vs_triton'), '.2f')} | "
                     f"{_f(r.get('bw_fraction'), '.2f')} | {r.get('splits', '-')} | {r.get('units', '-')} | "
                     f"{_f(r.get('check_max_abs_err'), '.1e')} |")
    return "\n".join(lines) + "\n"


def write_report(a, report: dict) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_decode.json").write_text(json.dumps(report, indent=1, default=str))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.cuda_decode", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results folder ($OUT/cuda on the box)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: the emulator stands in for the kernel, tiny contexts")
    p.add_argument("--shape", default="llama8b", choices=("llama8b", "smollm2"))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--context", nargs="+", type=int, default=[8192, 32768])
    p.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--check-requests", type=int, default=2)
    p.add_argument("--check-tokens", type=int, default=32768)
    p.add_argument("--random-checks", type=int, default=12)
    p.add_argument("--headroom-gib", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", nargs="*", default=[], choices=("probe", "build", "check", "time"))
    p.add_argument("--ncu-one", default=None, metavar="FORMAT:B:L",
                   help="launch the CUDA kernel on one configuration twice and exit (for ncu --launch-skip 1)")
    a = p.parse_args(argv)
    dry = a.dry_run
    if not dry and not torch.cuda.is_available():
        p.error("no CUDA device (use --dry-run on a machine without one)")
    if a.ncu_one:
        return ncu_one(a)
    from benchmarks.common import run_record
    from benchmarks.kernels.report import device_tag

    name = "CPU (dry run)" if dry else torch.cuda.get_device_name()
    report = dict(device=name, device_tag="cpu" if dry else device_tag(name), dry_run=dry, settings=vars(a),
                  run=run_record(), torch=torch.__version__)
    ok = True
    t0 = time.time()
    if "probe" not in a.skip:
        ok &= probe(report, dry)
        write_report(a, report)
    if "build" not in a.skip:
        report["build"] = build_all(a, dry)
        write_report(a, report)
    if "check" not in a.skip:
        ok &= check(report, dry, a.random_checks)
        write_report(a, report)
    if "time" not in a.skip:
        ok &= timings(a, report, dry)
    report["headline"] = headline(report)
    report["ok"], report["seconds"] = bool(ok), time.time() - t0
    write_report(a, report)
    md = markdown(report)
    (Path(a.out) / "cuda_decode.md").write_text(md)
    print(md)
    print(json.dumps(report["headline"], indent=1))
    print(f"{'OK' if ok else 'CHECK FAILED'} in {report['seconds']:.0f} s; results in {a.out}")
    return 0 if ok else 1


def build_all(a, dry: bool) -> dict:
    """Compile (or load) every variant the run uses; nvcc's resource usage and, on the GPU, the loaded registers."""
    from tests.kernel_cases import CASES, make_cache
    from vllm_temporalkv.ops import cuda, cuda_plan as P

    variants = {P.variant_of(make_cache(*c)) for c in CASES}
    variants |= {P.Variant(0, l, 0, l, 128, False, True) for l in (2, 4, 8)}  # the timed formats
    cap = (9, 0) if dry else torch.cuda.get_device_capability()
    out = {}
    if not dry and cuda.find_nvcc():  # nvcc in parallel first (the box has 16 cores); loading then hits the cache
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as ex:
            list(ex.map(lambda v: _try(cuda.build, v, cap), variants))
    for v in sorted(variants, key=lambda v: v.name):
        t = time.time()
        try:
            if dry:
                _, usage = cuda.build(v, cap) if cuda.find_nvcc() else (None, {"skipped": "no nvcc"})
            else:
                usage = cuda.module(v, torch.device("cuda"))[3]
            out[v.name] = dict(usage, seconds=round(time.time() - t, 2))
        except Exception as e:  # noqa: BLE001 - reported, and the checks then fail on this variant
            out[v.name] = dict(error=f"{type(e).__name__}: {e}")
        print(f"build {v.name}: {json.dumps(out[v.name])}")
    return out


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - build_all reports it when loading the variant
        return e


def ncu_one(a) -> int:
    K = _kernels()
    from vllm_temporalkv.ops import cuda

    fmt, B, L = a.ncu_one.split(":")
    B, L = int(B), int(L)
    dev = torch.device("cuda")
    sh = K.SHAPES[a.shape]
    lc = K.make_layer_cache(a.shape, fmt, torch.bfloat16, a.block_size, False, dev, a.seed)
    pages, bt = K.fill_pages(lc, B, L, sh["h"], sh["d"], dev)
    q = torch.randn(B, sh["hq"], sh["d"], dtype=torch.bfloat16, device=dev)
    kv = torch.randn(B, sh["h"], sh["d"], dtype=torch.bfloat16, device=dev)
    sl = torch.full((B,), L, dtype=torch.int32, device=dev)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
    for _ in range(2):
        cuda.paged_attention(lc, pages, q, kv, kv, qsl, sl, bt, sh["d"] ** -0.5)
    torch.cuda.synchronize()
    print(f"ncu-one {fmt} B={B} L={L}: launched twice")
    return 0


if __name__ == "__main__":
    sys.exit(main())
