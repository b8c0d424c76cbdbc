"""Calibration on first use: what ``vllm-temporalkv serve`` does before vLLM starts when a format served from
codebooks has no artifact yet (decide, estimate, calibrate or extend the model's default artifact).  Reads a
``serve.ServePlan``; imports no vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .messages import UsageError, say

# first-use calibration size: 4 x 1024 tokens (a quarter of the CPU default 8 x 2048), 25 Lloyd
# iterations (half): ~4-5 min for SmolLM2 temporalkv-2bit on an idle 2-core CPU (collect ~2 min, k-means
# ~2.5 min: 120 fits of two 256-centroid families), 16 vectors per centroid still
FIRST_USE = {"num_samples": 4, "seq_len": 1024, "iters": 25}
CALIBRATE_EXTRA = ("transformers", "gguf", "fast_pytorch_kmeans", "numba", "accelerate", "tqdm")
INSTALL_HINT = "pip install 'vllm-temporalkv[calibrate]'"


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


def decide_calibration(plan) -> Decision:
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


def run_first_use(plan, decision: Decision) -> float:
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

    from ..accel import has_cuda

    cuda = has_cuda()  # NVML: `vllm serve` runs in this process next and forks its engine core
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
