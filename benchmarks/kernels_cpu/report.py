"""benchmarks.kernels_cpu's report: kernels-cpu[-f32].md / .png, the headline figures, the progress lines."""

from __future__ import annotations

from pathlib import Path

from ..kernel_common import plot_decode_grid, shape_key, shape_sections
from ..kernel_common import fmt_opt as _f
from .config import HEADLINE_FORMATS, HEADLINE_POINTS, _isz

def row_key(r: dict, dt: str = "bf16") -> str:
    """The headline's shape key; a float32 run's keys start with f32- (bf16 keys as before)."""
    if r["kind"] == "decode":
        k = shape_key(r["shape"], r["B"], r["L"])
    else:
        k = f"prefill{r['Q']}-at{r['offset']}"
        k = k if r["shape"] == "llama8b" else f"{r['shape']}-{k}"
    return k if dt == "bf16" else f"{dt}-{k}"


def headline_figures(report: dict, prefix: str = "cpu") -> dict:
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
                out[f"kernels.{prefix}.{row_key(r, dt)}.{r['format']}.{name}"] = r[metric]
    return out


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
        "One layer, the step's attention.  C++: decode = `ops.cpu.paged_attention`, the fused kernel from the codes "
        "(the step's cache update not timed); prefill = the served chunk, `ops.cpu.forward`: its tokens written "
        f"(encoded in C++), then {s.get('prefill_attention', 'the C++ prefill kernel')} on C++-gathered K/V (vLLM's "
        "and SDPA's prefill rows: the attention alone).  torch = "
        f"`ops.paged_torch.paged_attention`, both `batch_invariant=False`; vLLM {dt} = "
        f"`torch.ops._C.cpu_attention_with_kv_cache` on a {dt} paged cache of the same B x L; SDPA = torch SDPA on "
        f"dense {dt} K/V.  x = baseline ms / C++ ms.  B/tok = bytes read per cached token and layer (codes + "
        f"sinks/tail + centroids once + ..., all included; codes alone in brackets) vs {dt} K+V = 2·Hkv·D·{_isz(dt)}.  "
        "GB/s = those bytes / time; frac = of the copy bandwidth.  err = max |C++ - torch| on the check slice.",
        "",
    ]
    for heading, rows in shape_sections(report):
        lines += [heading, "",
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
            wr = [r for r in pre if r.get("write_ms") is not None]
            if wr:  # (runs before 2026-12-01 did not time it)
                lines += ["", "Of the served chunk's C++ ms, its write alone (the chunk's blocks encoded; vLLM's rows "
                          "leave their cache write out): " + ", ".join(
                              f"{r['format']} {r['write_ms']:.3f} ms ({100 * r['write_fraction']:.0f}%)" for r in wr)
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


def _print_row(r: dict) -> None:
    step = "decode" if r["kind"] == "decode" else f"prefill {r['Q']}@{r['offset']}"
    print(f"{r['shape']} {step} B={r['B']} L={r['L']} {r['format']}: C++ {r['cpp_ms']:.3f} ms, "
          f"torch {_f(r['torch_ms'], '.3f')}, vLLM {_f(r['vllm_ms'], '.3f')}, "
          f"x{_f(r['speedup_vs_vllm'], '.2f')} vLLM, x{_f(r['speedup_vs_torch'], '.2f')} torch, "
          f"{r['cpp_gbps']:.1f} GB/s, err {r['max_abs_err']:.1e}{'' if r['check_ok'] else ' FAIL'}"
          + ("" if r.get("vllm_check_ok", True) else " (vLLM check FAIL)"), flush=True)
