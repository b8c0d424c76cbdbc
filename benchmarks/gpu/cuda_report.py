"""The CUDA decode benchmark's report (benchmarks/gpu/cuda_decode.py): headline figures, markdown, JSON."""

from __future__ import annotations

import json
from pathlib import Path


def _f(x, spec=".4f"):
    return "-" if x is None else format(x, spec)



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
