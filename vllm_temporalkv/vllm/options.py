"""The plugin's serving options and errors: what every vLLM process of a server reads from its configuration.

Serving options (``--additional-config`` JSON or environment):
    temporalkv_artifact  / VLLM_TEMPORALKV_ARTIFACT   calibration artifact (default:
                                                      <model folder>/temporalkv/calibration.safetensors)
    temporalkv_outliers  / VLLM_TEMPORALKV_OUTLIERS   keep 1% outliers exact (default false); a number is
                                                      a percentage of values up to 1 (0.5: a 2-bit
                                                      format within 2.25 bits per float)
    temporalkv_batch_invariant / VLLM_TEMPORALKV_BATCH_INVARIANT
                                                      outputs independent of chunking and batching
                                                      (float64 attention on the CPU, ~5x slower;
                                                      default: vLLM's VLLM_BATCH_INVARIANT)
    temporalkv_recent_window / VLLM_TEMPORALKV_RECENT_WINDOW
                                                      the newest tokens kept in half precision, a
                                                      multiple of 8 (default: the format's - 0 for the
                                                      codebook formats, 128 for selective-int8/int4,
                                                      tada-4bit/2bit and qjl)
    temporalkv_small_pages / VLLM_TEMPORALKV_SMALL_PAGES
                                                      pages of 64 tokens (1-bit: 128; --block-size
                                                      overrides) that hold only codes: each request's 8
                                                      sinks and incomplete block live in
                                                      two pages of a second KV-cache group (the sinks' page is
                                                      prefix-cached with the first code page), so prefixes of 64
                                                      tokens and more hit the prefix cache (issue 34).  Default:
                                                      on where they are served (``small_pages_by_default``: vLLM
                                                      >= 0.27 on the CPU, a codebook format of one page size per
                                                      model, no recent window, no --block-size, the hybrid KV
                                                      manager on, no KV connector); false: 1024-token pages that
                                                      keep their own sinks and tail
Formats that need no calibration (selective-int8 / -int4, tada-4bit / -2bit, qjl) ignore the artifact.
An unknown ``temporalkv_*`` key or a value that is not a boolean stops the server with the option's name.

Read by the plugin's registration hooks (plugin.py) and by the attention backend (backend.py) alike; it imports
neither.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

from ..artifact import (ENV_ARTIFACT, Artifact, ArtifactError, calibrate_hint, default_artifact_path,
                        model_fingerprint)
from ..formats import FormatError, check_window, get_format
from ..methods import OUTLIER_FRACTION, outlier_fraction

logger = logging.getLogger("vllm.temporalkv")  # under vLLM's logger, so its handlers print it

DEFAULT_BLOCK_SIZE = 1024  # large pages amortize the 16 half-precision tokens each page keeps
# temporalkv_small_pages: code pages only (a 2-bit page of 64 tokens = one page of 8 exact tokens; 1-bit codes: 128,
# small_block_size)
SMALL_BLOCK_SIZE = 64
ENV_OUTLIERS = "VLLM_TEMPORALKV_OUTLIERS"
ENV_BATCH_INVARIANT = "VLLM_TEMPORALKV_BATCH_INVARIANT"
ENV_WINDOW = "VLLM_TEMPORALKV_RECENT_WINDOW"
ENV_SMALL_PAGES = "VLLM_TEMPORALKV_SMALL_PAGES"


class TemporalKVConfigError(ValueError):
    """A serving configuration the plugin cannot run correctly."""


OPTIONS = ("temporalkv_artifact", "temporalkv_outliers", "temporalkv_batch_invariant",
           "temporalkv_recent_window", "temporalkv_small_pages")  # --additional-config keys
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _flag(value, where: str) -> bool:
    """A boolean option: a misspelt value is an error, never a silent false."""
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise TemporalKVConfigError(f"{where}={value!r} is not a boolean: use true or false (or 1 / 0)")


def _outliers(value, where: str) -> bool | float:
    """temporalkv_outliers: a boolean (1% when true) or a percentage of values in (0, 1] (``methods.outlier_fraction``;
    "1" means 1% either way)."""
    v = str(value).strip().lower()
    if isinstance(value, bool) or v in _TRUE or v in _FALSE:
        return _flag(value, where)
    try:  # the range is outlier_fraction's
        share = outlier_fraction(float(v.removesuffix("%")) / 100)
    except ValueError:
        raise TemporalKVConfigError(f"{where}={value!r} is not a boolean or a percentage of values in (0, "
                                    f"{100 * OUTLIER_FRACTION:g}]: use true / false, or e.g. 0.5 for 0.5%") from None
    return True if share == OUTLIER_FRACTION else share


def _option(extra: dict, key: str, env: str, default: str) -> tuple[object, str]:
    """(value, where it came from, for messages): --additional-config, else the environment, else default."""
    if key in extra:
        return extra[key], f"--additional-config {key}"
    if env in os.environ:
        return os.environ[env], env
    return default, key


def small_pages_by_default(vllm_config, fmt, window) -> bool:
    """Whether a server that does not set temporalkv_small_pages gets small pages: wherever they are served as they
    are tested - vLLM >= 0.27 (its KV specs sized per layer), the CPU (the C++ kernels read them; the Triton ones do
    not yet), a codebook format of one page size per model without a recent window, vLLM's hybrid KV-cache manager
    (the exact tokens' group) and no KV connector - and the page size left to the plugin: ``--block-size N`` keeps
    the pages that carry their own sinks and tail, at N tokens.  The same answer in every process of a server (the
    block size the plugin sets is not the user's)."""
    from . import compat

    if not compat.SMALL_PAGES_SUPPORTED or window or not fmt.needs_calibration or fmt.per_layer_pages or fmt.mix:
        return False
    from vllm.platforms import current_platform

    sched = getattr(vllm_config, "scheduler_config", None)
    return (current_platform.is_cpu() and not compat.user_specified_block_size(vllm_config.cache_config)
            and not getattr(sched, "disable_hybrid_kv_cache_manager", False)
            and getattr(vllm_config, "kv_transfer_config", None) is None)


def small_block_size(vllm_config) -> int:
    """The default page of small pages: 64 tokens, or the fewest multiple of 64 whose codes fill a page of exact
    tokens (both KV-cache groups share one page size, so a 1-bit format's 64-token code page - half an exact page -
    would be padded to one and keep only 2-bit capacity: 128 tokens)."""
    from ..layout import PageLayout, exact_record_bytes

    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    fmt = get_format(vllm_config.cache_config.cache_dtype)
    outliers = _outliers(*_option(extra, "temporalkv_outliers", ENV_OUTLIERS, "0"))
    D = vllm_config.model_config.get_head_size()
    bs = SMALL_BLOCK_SIZE
    while bs < DEFAULT_BLOCK_SIZE and \
            PageLayout(fmt, D, bs, outliers=outliers, exact_pages=True).code_record_bytes < exact_record_bytes(D):
        bs *= 2
    return bs


def _small_pages(vllm_config, extra: dict, fmt, window) -> bool:
    value, where = _option(extra, "temporalkv_small_pages", ENV_SMALL_PAGES, None)
    if value is None:
        return small_pages_by_default(vllm_config, fmt, window)
    return _flag(value, where)


def small_pages_requested(vllm_config) -> bool:
    """Whether this server serves small pages - read alone, before the block size is final (the other options
    are checked against the final one by ``serving_options``; a recent window here only as the default's
    condition: a malformed one is its error)."""
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    fmt = get_format(vllm_config.cache_config.cache_dtype)
    value, _ = _option(extra, "temporalkv_recent_window", ENV_WINDOW, str(fmt.window))
    try:
        window = int(value)
    except (TypeError, ValueError):
        window = 1  # (refused by serving_options with the option's name)
    return _small_pages(vllm_config, extra, fmt, window)


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
    outliers = _outliers(*_option(extra, "temporalkv_outliers", ENV_OUTLIERS, "0"))
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
    small = _small_pages(vllm_config, extra, fmt, window)
    if small and (window or not fmt.needs_calibration or fmt.per_layer_pages or fmt.mix):
        raise TemporalKVConfigError(
            f"temporalkv_small_pages: {fmt.name}" + (f" with a recent window of {window} tokens" if window else "")
            + " is not served with small pages yet (the codebook formats of one page size per model, without a "
            "recent window, are); drop the option")
    return {"format": fmt.name, "artifact": path, "outliers": outliers, "batch_invariant": invariant,
            "window": window, "small_pages": small, "model": model}


@functools.lru_cache(maxsize=4)
def _load(path: str, fingerprint_json: str, fmt: str, model: str) -> Artifact:
    art = Artifact.load(path, expect=json.loads(fingerprint_json), formats=[fmt], model_hint=model)
    if art.rotation:  # the kernels decode in the calibration's own coordinates: keys / values would be wrong
        halves = " and ".join({"k": "keys", "v": "values"}[kv] for kv in art.rotation)
        raise ArtifactError(
            f"calibration artifact {path} was fitted on rotated {halves} (--rotate), a research option only the "
            "quality harness simulates: the served kernels do not rotate back. Serve an artifact calibrated without "
            f"it: {calibrate_hint(model, path)}")
    return art


def load_artifact(vllm_config) -> Artifact | None:
    """The artifact for this server, checked against the model (cached per process); None for a format
    that needs no calibration."""
    opts = serving_options(vllm_config)
    if opts["artifact"] is None:
        return None
    fp = json.dumps(model_fingerprint(vllm_config.model_config.hf_config), sort_keys=True)
    return _load(opts["artifact"], fp, opts["format"], opts["model"])
