"""What every benchmark shares: where results go, how a run is recorded, the headline file."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HEADLINE = RESULTS / "headline.json"


def machine() -> dict:
    import torch

    from vllm_temporalkv.cpu_isa import cpu_class, simd_flags

    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_class": cpu_class(),  # amx / avx512bf16 / avx512 / avx2 / scalar: figures differ by class
        "cpu_simd": simd_flags(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_record() -> dict:
    """Command line, machine and time of this run, stored next to every result."""
    return {
        "command": "python -m " + __import__("__main__").__spec__.name + " " + shlex.join(sys.argv[1:])
        if getattr(__import__("__main__"), "__spec__", None)
        else shlex.join(sys.argv),
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def merge_headline(figures: dict[str, float], path: Path = HEADLINE) -> None:
    """Merge ``"<bench>.<data-or-shape>.<format>.<metric>": number`` figures into the flat file."""
    cur = json.loads(path.read_text()) if path.is_file() else {}
    for k, v in figures.items():
        if len(k.split(".")) < 4:
            raise ValueError(f"headline key {k!r} is not <bench>.<data-or-shape>.<format>.<metric>")
        cur[k] = float(v)
    write_json(path, dict(sorted(cur.items())))


DTYPE_HELP = ("the model's dtype (vLLM's --dtype), every format alike (default: what `vllm-temporalkv serve` "
              "picks: float32 on a CPU without bf16 units, else bfloat16)")


def model_dtype(requested: str | None) -> str:
    """The --dtype every server of a benchmark runs with: the requested one, else what `vllm-temporalkv serve`
    picks for this machine (float32 on a CPU without bf16 units: ~4x faster there), else bfloat16."""
    if requested:
        return requested
    import torch

    from vllm_temporalkv.cpu_tuning import default_dtype

    return (None if torch.cuda.is_available() else default_dtype()) or "bfloat16"


def plot_decode_grid(rows: list[dict], shapes: list[str], path: Path, *, time_series, speedup_series, baselines,
                     panel_title: str, time_label: str, speedup_label: str, title: str, width: float = 4.2) -> None:
    """Decode timings over the context L (log2), per model shape two rows of panels (time per call, speedup),
    one column per batch size.  time_series / speedup_series: (row key, style, label with {f}, plot kwargs) per
    format; baselines: (row key, style, name) drawn once per panel from the rows' baseline columns.  A series
    without any value is left out."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in shapes if any(r["shape"] == s for r in rows)]
    if not shapes:
        return
    batches = sorted({r["B"] for r in rows})
    fmts = list(dict.fromkeys(r["format"] for r in rows))
    fig, axes = plt.subplots(2 * len(shapes), len(batches), figsize=(width * len(batches), 3.4 * 2 * len(shapes)),
                             squeeze=False)

    def line(ax, xs, ys, style, **kw):
        ys = [math.nan if y is None else y for y in ys]
        if not all(math.isnan(y) for y in ys):
            ax.plot(xs, ys, style, **kw)

    for i, shape in enumerate(shapes):
        for j, B in enumerate(batches):
            at, asp = axes[2 * i][j], axes[2 * i + 1][j]
            sel = sorted((r for r in rows if r["shape"] == shape and r["B"] == B), key=lambda r: r["L"])
            for k, f in enumerate(fmts):
                pts = [r for r in sel if r["format"] == f]
                for ax, series in ((at, time_series), (asp, speedup_series)):
                    for key, style, label, kw in series:
                        line(ax, [r["L"] for r in pts], [r.get(key) for r in pts], style, color=f"C{k}",
                             label=label.format(f=f), **kw)
            base = {r["L"]: r for r in sel}
            for key, style, name in baselines:
                line(at, sorted(base), [base[x].get(key) for x in sorted(base)], style, label=name)
            asp.axhline(1.0, color="gray", lw=1)
            for ax in (at, asp):
                ax.set_xscale("log", base=2)
                ax.grid(alpha=0.3, which="both")
            at.set_yscale("log")
            at.set_title(panel_title.format(shape=shape, B=B))
            asp.set_xlabel("context L (tokens)")
            if j == 0:
                at.set_ylabel(time_label)
                asp.set_ylabel(speedup_label)
        axes[2 * i][0].legend(fontsize=6)
        axes[2 * i + 1][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
