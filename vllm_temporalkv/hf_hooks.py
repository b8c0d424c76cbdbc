"""Where K and V live in a HuggingFace decoder, before RoPE.

Calibration (collecting K/V and their gradients) and the quality harness (simulated compression)
both work by hooking the module whose output is the pre-RoPE key - ``k_norm`` where the model
has QK-norm (Qwen3), else ``k_proj`` - and ``v_proj``.  Only standard RoPE decoders with full
attention are supported; anything else gets a clear error instead of silently wrong numbers.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class UnsupportedModelError(ValueError):
    pass


def check_supported(config) -> None:
    archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"model architecture {archs[0]} is not supported: vllm-temporalkv supports decoders "
            f"with rotary full attention ({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or not layer_types:
            raise UnsupportedModelError(
                f"{archs[0]} uses sliding-window attention (sliding_window={config.sliding_window}), "
                "which vllm-temporalkv does not support yet"
            )


def kv_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """Per decoder layer: (module whose output is the pre-RoPE key, v_proj)."""
    check_supported(model.config)
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        k = getattr(attn, "k_norm", None) or attn.k_proj
        out.append((k, attn.v_proj))
    return out


def head_shape(model: torch.nn.Module) -> tuple[int, int]:
    cfg = model.config
    heads = cfg.num_attention_heads
    return cfg.num_key_value_heads or heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


@contextlib.contextmanager
def kv_output_hooks(
    model: torch.nn.Module, fn: Callable[[int, str, torch.Tensor], torch.Tensor | None]
) -> Iterator[None]:
    """Call ``fn(layer, "k"|"v", out)`` on every pre-RoPE K / V projection output, with ``out``
    viewed as [B, T, H, D]; a returned tensor replaces the output."""
    H, D = head_shape(model)
    handles = []

    def make(layer: int, kind: str):
        def hook(_mod, _inp, out):
            shape = out.shape
            r = fn(layer, kind, out.reshape(*shape[:-1], H, D) if shape[-1] == H * D else out)
            return None if r is None else r.reshape(shape)

        return hook

    for i, (k, v) in enumerate(kv_modules(model)):
        handles.append(k.register_forward_hook(make(i, "k")))
        handles.append(v.register_forward_hook(make(i, "v")))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
