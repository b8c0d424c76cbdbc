"""The ``vllm.general_plugins`` entry point: runs in every vLLM process (API server, engine core,
workers) before configs are parsed, and makes ``--kv-cache-dtype temporalkv-2bit`` (and the other
formats) work - leaving every other dtype to vLLM.

Serving options (``--additional-config`` JSON or environment):
    temporalkv_artifact  / VLLM_TEMPORALKV_ARTIFACT   calibration artifact (default:
                                                      <model folder>/temporalkv/calibration.safetensors)
    temporalkv_outliers  / VLLM_TEMPORALKV_OUTLIERS   keep 1% outliers exact (default false)
    temporalkv_batch_invariant / VLLM_TEMPORALKV_BATCH_INVARIANT
                                                      outputs independent of chunking and batching
                                                      (float64 attention on the CPU, ~5x slower;
                                                      default: vLLM's VLLM_BATCH_INVARIANT)
    temporalkv_recent_window / VLLM_TEMPORALKV_RECENT_WINDOW
                                                      the newest tokens kept in half precision, a
                                                      multiple of 8 (default: the format's - 0 for the
                                                      codebook formats, 128 for selective-int8/int4,
                                                      tada-4bit/2bit and qjl)
Formats that need no calibration (selective-int8 / -int4, tada-4bit / -2bit, qjl) ignore the artifact.
An unknown ``temporalkv_*`` key or a value that is not a boolean stops the server with the option's name.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

from ..artifact import ENV_ARTIFACT, Artifact, ArtifactError, default_artifact_path, model_fingerprint
from ..formats import FORMATS, FormatError, check_window, get_format

logger = logging.getLogger("vllm.temporalkv")  # under vLLM's logger, so its handlers print it

BACKEND_PATH = "vllm_temporalkv.vllm.backend.TemporalKVBackend"
DEFAULT_BLOCK_SIZE = 1024  # large pages amortize the 16 half-precision tokens each page keeps
ENV_OUTLIERS = "VLLM_TEMPORALKV_OUTLIERS"
ENV_BATCH_INVARIANT = "VLLM_TEMPORALKV_BATCH_INVARIANT"
ENV_WINDOW = "VLLM_TEMPORALKV_RECENT_WINDOW"


class TemporalKVConfigError(ValueError):
    """A serving configuration the plugin cannot run correctly."""


def register() -> None:
    from . import compat

    names = tuple(FORMATS)
    compat.add_kv_cache_dtypes(names)
    compat.register_custom_backend(BACKEND_PATH)
    compat.route_kv_cache_dtypes(names, BACKEND_PATH, _validate_selection)
    compat.describe_layer_pages(is_ours, _record_bytes)
    compat.hook_platform_config(_on_config)
    compat.skip_cpu_generator_rewind()


def is_ours(kv_cache_dtype) -> bool:
    return kv_cache_dtype in FORMATS


def _record_bytes(attention_layer, index: int, spec) -> int:
    """One layer's page record per KV head, from its own Impl (format, options, artifact: this engine's)."""
    return attention_layer.impl.page_layout(index, spec.block_size).bytes


# ---------------------------------------------------------------------------------------------
# configuration


OPTIONS = ("temporalkv_artifact", "temporalkv_outliers", "temporalkv_batch_invariant",
           "temporalkv_recent_window")  # --additional-config keys
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _flag(value, where: str) -> bool:
    """A boolean option: a misspelt value is an error, never a silent false."""
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise TemporalKVConfigError(f"{where}={value!r} is not a boolean: use true or false (or 1 / 0)")


def _option(extra: dict, key: str, env: str, default: str) -> tuple[object, str]:
    """(value, where it came from, for messages): --additional-config, else the environment, else default."""
    if key in extra:
        return extra[key], f"--additional-config {key}"
    if env in os.environ:
        return os.environ[env], env
    return default, key


def serving_options(vllm_config) -> dict:
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    unknown = sorted(k for k in extra if str(k).startswith("temporalkv") and k not in OPTIONS)
    if unknown:
        raise TemporalKVConfigError(f"--additional-config: unknown option(s) {', '.join(unknown)}; the plugin's "
                                    f"options are {', '.join(OPTIONS)}")
    model = vllm_config.model_config.model
    fmt = get_format(vllm_config.cache_config.cache_dtype)
    path = extra.get("temporalkv_artifact") or os.environ.get(ENV_ARTIFACT)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TemporalKVConfigError(f"--additional-config temporalkv_artifact={path!r}: expected a file path (a string)")
    if not fmt.needs_calibration:
        path = None
    elif not path:
        if not Path(model).is_dir():
            raise TemporalKVConfigError(
                f"--kv-cache-dtype {vllm_config.cache_config.cache_dtype} needs a calibration artifact, and "
                f"model {model!r} is not a local folder to look in; pass "
                f"--additional-config '{{\"temporalkv_artifact\": \"PATH\"}}' or set {ENV_ARTIFACT}"
            )
        path = str(default_artifact_path(model))
    outliers = _flag(*_option(extra, "temporalkv_outliers", ENV_OUTLIERS, "0"))
    if outliers and not fmt.needs_calibration:
        raise TemporalKVConfigError(f"temporalkv_outliers: {fmt.name} keeps no outliers (its scales are per token); "
                                    "drop the option")
    invariant = _flag(*_option(extra, "temporalkv_batch_invariant", ENV_BATCH_INVARIANT,
                               os.environ.get("VLLM_BATCH_INVARIANT", "0")))
    value, where = _option(extra, "temporalkv_recent_window", ENV_WINDOW, str(fmt.window))
    try:
        window = check_window(value, vllm_config.cache_config.block_size, where)
    except FormatError as e:
        raise TemporalKVConfigError(str(e)) from None
    return {"format": fmt.name, "artifact": path, "outliers": outliers, "batch_invariant": invariant,
            "window": window, "model": model}


@functools.lru_cache(maxsize=4)
def _load(path: str, fingerprint_json: str, fmt: str, model: str) -> Artifact:
    return Artifact.load(path, expect=json.loads(fingerprint_json), formats=[fmt], model_hint=model)


def load_artifact(vllm_config) -> Artifact | None:
    """The artifact for this server, checked against the model (cached per process); None for a format
    that needs no calibration."""
    opts = serving_options(vllm_config)
    if opts["artifact"] is None:
        return None
    fp = json.dumps(model_fingerprint(vllm_config.model_config.hf_config), sort_keys=True)
    return _load(opts["artifact"], fp, opts["format"], opts["model"])


def _check_model(vllm_config) -> None:
    """Model-level refusals, in the engine process before any worker starts; the per-layer rules
    (head size, dtype, block size, attention type) are the backend's own ``supports_*`` hooks,
    asked here with the model's values and again by every worker's backend selection."""
    from ..hf_hooks import UnsupportedModelError, check_supported
    from . import compat
    from .backend import TemporalKVBackend

    mc = vllm_config.model_config
    fmt = get_format(vllm_config.cache_config.cache_dtype)
    problems = []
    try:
        check_supported(mc.hf_config)
    except UnsupportedModelError as e:
        problems.append(str(e))
    if getattr(mc, "use_mla", False):
        problems.append("MLA attention is not supported")
    if getattr(mc, "is_hybrid", False):
        problems.append("hybrid (attention + state-space) models are not supported")
    try:
        window = mc.get_sliding_window()
    except Exception:
        window = None
    if window:
        problems.append(f"sliding-window attention (window {window}) is not supported")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding is not supported yet: drop --speculative-config")
    if fmt.per_layer_pages and not compat.HAS_CUSTOMIZE_SPEC:  # refused here, before the weights load
        problems.append(f"its pages differ per layer, which vLLM {'.'.join(map(str, compat.VLLM_VERSION))} "
                        "cannot size; use vLLM >= 0.27 or another format")
    sel = compat.selector_config(head_size=mc.get_head_size(), dtype=mc.dtype, kv_cache_dtype=fmt.name,
                                 block_size=vllm_config.cache_config.block_size,
                                 use_mla=bool(getattr(mc, "use_mla", False)), has_sliding_window=bool(window))
    why = TemporalKVBackend.refusal(sel)
    if why:
        problems.append(why)
    if problems:
        raise TemporalKVConfigError(f"--kv-cache-dtype {fmt.name}: " + "; ".join(problems))


def _on_config(vllm_config) -> None:
    """After the platform set its defaults: our block size, and refuse bad setups before any
    worker starts (the same checks run again in each worker)."""
    from . import compat

    cc = vllm_config.cache_config
    if not is_ours(cc.cache_dtype) or vllm_config.model_config is None:
        return
    if not compat.user_specified_block_size(cc):
        if cc.block_size != DEFAULT_BLOCK_SIZE:
            logger.info("%s: using KV block size %d (pages keep 16 half-precision tokens; large pages "
                        "amortize them); pass --block-size to override", cc.cache_dtype, DEFAULT_BLOCK_SIZE)
        cc.block_size = DEFAULT_BLOCK_SIZE
    _check_model(vllm_config)  # after the block size is final
    art = load_artifact(vllm_config)
    if art is None:
        logger.info("%s: no calibration needed (recent window %d tokens)", cc.cache_dtype,
                    serving_options(vllm_config)["window"])
        return
    logger.info("%s: calibration artifact %s (calibrated on %s, %s x %s tokens)", cc.cache_dtype, art.path,
                art.calibration.get("data"), art.calibration.get("num_samples"), art.calibration.get("seq_len"))


def _validate_selection(sel) -> None:
    """Per-layer check at backend selection (in the workers): the backend's supports_* hooks."""
    from .backend import TemporalKVBackend

    why = TemporalKVBackend.refusal(sel)
    if why:
        raise TemporalKVConfigError(f"--kv-cache-dtype {sel.kv_cache_dtype}: {why}")


__all__ = ["ArtifactError", "TemporalKVConfigError", "register"]
