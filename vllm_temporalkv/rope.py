"""Rotary position embedding tables, to undo RoPE before encoding keys and redo it after decoding.

The cache stores *pre-RoPE* keys (thesis sec. 4.2): vLLM hands the backend rotated keys, so the
backend rotates them back by their positions, encodes, and rotates decoded keys forward again.
Frequencies come from transformers' own RoPE initializers (default, llama3, yarn, ...), so any
scaling the model uses is reproduced.  Rotation is GPT-NeoX style (``rotate_half``), as in Llama.
"""

from __future__ import annotations

import torch


class Rope:
    def __init__(self, hf_config, device: str | torch.device = "cpu"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            heads = hf_config.num_attention_heads
            dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
            inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scale = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS and rope_type != "dynamic":
            inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
        else:
            raise ValueError(f"RoPE type {rope_type!r} is not supported by vllm-temporalkv")
        self.inv_freq = inv.float().to(device)
        self.scale = float(scale)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] positions -> cos, sin of shape [N, 1, D] (float32), broadcast over heads."""
        f = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq
        emb = torch.cat((f, f), -1)
        return (emb.cos() * self.scale)[:, None, :], (emb.sin() * self.scale)[:, None, :]

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate pre-RoPE keys [N, H, D] forward (float32 result)."""
        cos, sin = self.cos_sin(positions)
        x = x.float()
        return x * cos + self._rotate_half(x) * sin

    def invert(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo the rotation of post-RoPE keys [N, H, D] (float32 result; exact up to rounding,
        since the rotation is orthogonal up to ``scale``)."""
        cos, sin = self.cos_sin(positions)
        x = x.float()
        s2 = self.scale * self.scale
        return (x * cos - self._rotate_half(x) * sin) / s2
