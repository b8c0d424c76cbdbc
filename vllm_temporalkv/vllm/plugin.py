"""The ``vllm.general_plugins`` entry point: runs in every vLLM process (API server, engine core,
workers) before configs are parsed, and makes ``--kv-cache-dtype temporalkv-2bit`` (and the other
formats) work - leaving every other dtype to vLLM.  Its serving options: options.py.
"""

from __future__ import annotations

from ..artifact import ArtifactError
from ..formats import FORMATS, get_format
from .options import (DEFAULT_BLOCK_SIZE, TemporalKVConfigError, load_artifact, logger, serving_options,
                      small_block_size, small_pages_requested)

BACKEND_PATH = "vllm_temporalkv.vllm.backend.TemporalKVBackend"


def register() -> None:
    from . import compat

    names = tuple(FORMATS)
    compat.add_kv_cache_dtypes(names)
    compat.register_custom_backend(BACKEND_PATH)
    compat.route_kv_cache_dtypes(names, BACKEND_PATH, _validate_selection)
    compat.describe_layer_pages(is_ours, _record_bytes)
    if compat.SMALL_PAGES_SUPPORTED:  # else temporalkv_small_pages is refused (_check_model)
        compat.register_exact_slots()
        compat.attach_exact_layers(_serves_small_pages)
    compat.hook_platform_config(_on_config)
    compat.skip_cpu_generator_rewind()


def is_ours(kv_cache_dtype) -> bool:
    return kv_cache_dtype in FORMATS


def _serves_small_pages(attention_layer) -> bool:
    """Whether an attention layer is ours and keeps its exact tokens apart (temporalkv_small_pages)."""
    return is_ours(getattr(attention_layer, "kv_cache_dtype", None)) and \
        bool(getattr(getattr(attention_layer, "impl", None), "_small_pages", False))


def _record_bytes(attention_layer, index: int, spec) -> int:
    """One layer's page record per KV head, from its own Impl (format, options, artifact: this engine's)."""
    return attention_layer.impl.page_layout(index, spec.block_size).bytes


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
    if serving_options(vllm_config)["small_pages"]:
        if not compat.SMALL_PAGES_SUPPORTED:
            problems.append(f"temporalkv_small_pages needs vLLM >= 0.27 (its KV specs sized by customize_spec); this "
                            f"is {'.'.join(map(str, compat.VLLM_VERSION))}")
        if getattr(vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager", False):
            problems.append("temporalkv_small_pages keeps the exact tokens in a second KV-cache group: drop "
                            "--disable-hybrid-kv-cache-manager")
        if vllm_config.kv_transfer_config is not None:
            problems.append("temporalkv_small_pages does not support KV connectors yet: drop --kv-transfer-config")
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
        # (not serving_options: it checks the recent window against the platform's default block size, which a
        # selective format's default window of 128 does not fit)
        if small_pages_requested(vllm_config):
            cc.block_size = small_block_size(vllm_config)
            logger.info("%s: small pages of %d tokens (codes only; each request's sinks and incomplete block in two "
                        "pages of a second KV-cache group: prefixes of %d tokens and more hit the prefix cache); "
                        "--additional-config '{\"temporalkv_small_pages\": false}' or --block-size N keeps pages "
                        "that carry their own sinks and tail", cc.cache_dtype, cc.block_size, cc.block_size)
        else:
            if cc.block_size != DEFAULT_BLOCK_SIZE:
                logger.info("%s: using KV block size %d (each page keeps its sinks and incomplete block, 16 "
                            "tokens, and any recent window in half precision; large pages amortize them); pass "
                            "--block-size to override", cc.cache_dtype, DEFAULT_BLOCK_SIZE)
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
