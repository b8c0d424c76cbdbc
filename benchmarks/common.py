"""What every benchmark shares: where results go, how a run is recorded, the headline file, the command-line
conventions (--out, --smoke, --no-headline, --dtype), first-use calibration and vLLM's error lines."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
import tempfile
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
        "cpu": cpu_model() or platform.processor(),
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


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo), None where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def run_record() -> dict:
    """Command line, machine and time of this run, stored next to every result (a benchmark that is a package runs
    as ``python -m benchmarks.X``: its ``__main__`` module is not named).  The command starts with the plugin's
    VLLM_TEMPORALKV_* variables set in the environment: they pick kernels and paths (the servers a benchmark starts
    inherit them), so a figure without them would not say what was measured."""
    main = __import__("__main__")
    cmd = ("python -m " + main.__spec__.name.removesuffix(".__main__") + " " + shlex.join(sys.argv[1:])
           if getattr(main, "__spec__", None) else shlex.join(sys.argv))
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("VLLM_TEMPORALKV_")]
    return {
        "command": " ".join(env + [cmd]),
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def is_results(out) -> bool:
    """Whether a --out is benchmarks/results (where the committed results and headline.json live)."""
    return Path(out).resolve() == RESULTS.resolve()


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
    from vllm_temporalkv.cpu_tuning import default_dtype

    from vllm_temporalkv.accel import has_cuda

    return (None if has_cuda() else default_dtype()) or "bfloat16"


# ---- command-line conventions ------------------------------------------------------------------------


def add_out_arg(p, **kw) -> None:
    """--out: the results folder (benchmarks/results by default, where the headline is merged)."""
    p.add_argument("--out", **{"default": str(RESULTS), "help": "results folder (default benchmarks/results)", **kw})


def add_dtype_arg(p) -> None:
    """--dtype of a benchmark that starts servers: vLLM's, every format alike (model_dtype)."""
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)


def add_headline_arg(p) -> None:
    p.add_argument("--no-headline", action="store_true", help="do not merge into headline.json")


def add_smoke_args(p, smoke_help: str) -> None:
    """--smoke (tiny configurations through the same code, never written to benchmarks/results) and --out."""
    add_headline_arg(p)
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results; smoke: a temp dir)")


def apply_sizes(a, full: dict, small: dict, smoke_prefix: str) -> None:
    """Arguments left at None take the full run's default, or with --smoke the small one's; --smoke writes to a
    temp dir (never to benchmarks/results), a full run to benchmarks/results unless --out says otherwise."""
    if a.smoke:
        if a.out is None:
            a.out = tempfile.mkdtemp(prefix=smoke_prefix)
        if is_results(a.out):
            sys.exit("--smoke never writes to benchmarks/results: pass another --out")
    for k, v in full.items():
        if getattr(a, k) is None:
            setattr(a, k, small.get(k, v) if a.smoke else v)
    if a.out is None:
        a.out = str(RESULTS)


# ---- vLLM ----------------------------------------------------------------------------------------------


def ensure_calibrated(model, fmt: str, environ: dict | None = None) -> None:
    """The model's default artifact covers fmt: what `vllm-temporalkv serve` does on first use (a small calibration,
    or an extension by the missing format)."""
    from vllm_temporalkv import cli
    from vllm_temporalkv.vllm.cli import serve_parser

    plan = cli.plan_serve(([str(model)] if model else []) + ["--kv-cache-dtype", fmt], parser=serve_parser(),
                          environ=dict(os.environ if environ is None else environ))
    decision = cli.decide_calibration(plan)
    if decision.action in ("calibrate", "extend"):
        cli.run_first_use(plan, decision)


def error_line(log: str, rc: int | None, timeout: float | None = None) -> str:
    """The root cause: the last error line that is not vLLM's "engine core initialization failed, see
    above" wrapper (e.g. fp8 on a CPU without AVX-512: 'FP8 KV cache on CPU requires x86 with AVX-512 or AMX.')."""
    if rc is None:  # run_logged stopped it: say so, with the last thing it logged (how far it got)
        last = [ln.strip() for ln in log.splitlines() if ln.strip()][-1:] or ["(no output)"]
        return f"timed out after {timeout:g} s; last output: {last[0]}"[-500:]
    lines = [ln for ln in log.splitlines() if re.search(r"\w(Error|Exception): |error:|refus", ln)]
    root = [ln for ln in lines if "See root cause" not in ln and "initialization failed" not in ln]
    return ((root or lines)[-1] if lines else f"exit code {rc}")[-500:]
