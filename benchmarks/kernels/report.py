"""benchmarks.kernels' report: kernels.md, kernels.png and the headline figures."""

from __future__ import annotations

import re
from pathlib import Path

from ..kernel_common import plot_decode_grid, shape_key, shape_sections
from ..kernel_common import fmt_opt as _f
from .fp16_paged import FP16_PAGE

HEADLINE_POINTS = {(1, 32768), (8, 32768)}  # (B, L) rows merged into headline.json

def device_tag(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100': the first word of
    letters then digits, else a slug (never a '.', which separates headline key parts)."""
    words = re.split(r"[^a-z0-9]+", re.sub(r"\b(nvidia|geforce|tesla|amd|radeon)\b", " ", name.lower()))
    for w in words:
        if re.fullmatch(r"[a-z]+\d+[a-z0-9]*", w):
            return w
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def headline_figures(report: dict) -> dict:
    tag = report["device_tag"]
    out = {}
    for r in report["rows"]:
        if (r["B"], r["L"]) not in HEADLINE_POINTS or r.get("time_ms") is None or not r["check_ok"]:
            continue
        # the Triton decode's figures; the unprefixed names are the decode that serves on the GPU, the CUDA kernel
        # (benchmarks/gpu/cuda_decode.py)
        for metric in ("speedup_vs_sdpa", "speedup_vs_fp16_paged", "bw_fraction"):
            if r.get(metric) is not None:
                out[f"kernels.{tag}.{shape_key(r['shape'], r['B'], r['L'])}.{r['format']}.triton_{metric}"] = r[metric]
    for e in report["encode"]:
        # the one encode headline: TemporalKV 2-bit on the Llama-8B shape (all formats are in the JSON)
        if e["shape"] == "llama8b" and e["format"] == "temporalkv-2bit":
            out[f"kernels.{tag}.l8b-{e['tokens']}.encode_prefill_overhead"] = e["encode_prefill_overhead"]
    return out


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
    for heading, rows in shape_sections(report):
        lines += [heading, "",
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
