"""The configurations the quality harness simulates beside this plugin's formats, in its thesis protocol, on equal
terms with them: the seed configuration not served - TaDA with per-layer bits (seed 004; selective sink+recent
quantization, seed 003, TaDA at uniform bits and QJL, seed 002, are served: formats, simulated by the harness's format
Simulator) - and vLLM's own ``--kv-cache-dtype fp8``, the peer every format is measured against.

fp8 as vLLM serves it without calibrated scales (vllm/v1/attention/backends/cpu_attn.py: e4m3 with k_scale = v_scale =
1.0): every token's post-RoPE key and value rounded to float8 e4m3 (saturating at +-448, where vLLM's cast would give
NaN), no exact tokens; the keys are rotated back, as the other formats' hooks hand back pre-RoPE keys.

As for the formats, every query sees the cache as it stands once the whole window has been written: what the
method keeps exact at that point (sinks, recent window) stays exact, the rest is compressed and decompressed in
place of the model's pre-RoPE K / V (hooks on the projections; RoPE is applied after).

Bits per float are all-in at the window's length: codes, scales, minimums, means, and the exact tokens (sinks,
windows) in 16 bits.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_temporalkv.codecs.tada import CANDIDATE_BITS, TadaQuantizer, search_layer_bits
from vllm_temporalkv.formats import get_format
from vllm_temporalkv.methods import TADA_WINDOW
from vllm_temporalkv.layout import bits_per_float

# name -> (method, average bits of the compressed values)
SEED_CONFIGS: dict[str, tuple[str, int]] = {
    "tada-mixed-3bit": ("tada", 3),  # per-layer bits in {2, 4, 8}, 3 on average: the paper's search (layer_bits)
    "fp8": ("fp8", 8),  # vLLM's fp8 KV cache: e4m3, scale 1 (module docstring)
}
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3 (round to nearest even, saturating), float32."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def tada_format(bits: int):
    """The served TaDA format's description at any deviation bits (tada-4bit / -2bit are the served ones)."""
    return dataclasses.replace(get_format("tada-4bit"), name=f"tada-{bits}bit", nominal_bits=bits,
                               n_centroids=2**bits)


def is_seed_config(name: str) -> bool:
    return name in SEED_CONFIGS


def is_mixed(name: str) -> bool:
    return "-mixed-" in name


def tada_layer_bits(name: str, hf_config, kv_dtype: torch.dtype, nll) -> tuple[list[int], dict]:
    """TaDA's per-layer bits for a mixed configuration: the paper searches them by task accuracy on train
    data (App. B); we measure what this project can, the NLL increase (nats per token) of compressing one
    layer's K and V alone at each candidate, on held-out calibration text (``nll(hook)`` -> mean NLL), and
    solve for the least total increase at the average budget (codecs.tada.search_layer_bits)."""
    L = hf_config.num_hidden_layers
    base = nll(lambda layer, kind, out: out.to(kv_dtype).to(out.dtype))
    cost: dict[int, dict[int, float]] = {}
    for layer in range(L):
        cost[layer] = {}
        for b in CANDIDATE_BITS:
            sim = SeedSimulator(name, hf_config, kv_dtype, layer_bits=[b] * L)
            cost[layer][b] = nll(lambda lay, kind, out, sim=sim, layer=layer:
                                 sim(lay, kind, out) if lay == layer else out.to(kv_dtype).to(out.dtype)) - base
    bits = search_layer_bits(cost, float(SEED_CONFIGS[name][1]))
    return [bits[i] for i in range(L)], {str(i): {str(b): c for b, c in cost[i].items()} for i in range(L)}


class SeedSimulator:
    """Fake-quant hook (harness.simulate.Simulator's interface) for one seed-method configuration."""

    protocol = "thesis"

    def __init__(self, name: str, hf_config, kv_dtype: torch.dtype, layer_bits: list[int] | None = None):
        from vllm_temporalkv.hf_hooks import check_supported

        check_supported(hf_config)
        self.method, bits = SEED_CONFIGS[name]
        self.kv_dtype = kv_dtype
        heads = hf_config.num_attention_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        self.kv_heads = hf_config.num_key_value_heads or heads
        self.layers = hf_config.num_hidden_layers
        if self.method == "fp8":
            from vllm_temporalkv.rope import Rope

            self.rope, self.layer_bits, self.codecs = Rope(hf_config), [bits] * self.layers, {}
            return
        if is_mixed(name) and layer_bits is None:
            raise ValueError(f"{name} needs its per-layer bits (tada_layer_bits)")
        self.layer_bits = layer_bits or [bits] * self.layers
        self.codecs = {b: TadaQuantizer(b) for b in set(self.layer_bits)}

    def __call__(self, layer: int, kind: str, out: torch.Tensor) -> torch.Tensor:
        x = out.to(self.kv_dtype)  # the cache's half precision, as for the formats
        return torch.stack([self._one(layer, kind, x[b]) for b in range(x.shape[0])]).to(out.dtype)

    def _one(self, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        """One sequence [T, H, D] of pre-RoPE keys or values -> what attention sees, float32."""
        if self.method == "fp8":
            if kind == "v":
                return e4m3(x)
            pos = torch.arange(x.shape[0], device=x.device)  # the key as the cache holds it: post-RoPE, model dtype
            return self.rope.invert(e4m3(self.rope.apply(x, pos).to(self.kv_dtype)), pos)
        return self.codecs[self.layer_bits[layer]].fake_quant(x, window=TADA_WINDOW).float()

    def bits(self, seq_len: int) -> dict[str, float]:
        """All-in bits per float at seq_len tokens (module docstring); 'total' as for the formats."""
        D, H, T = self.head_dim, self.kv_heads, seq_len
        if self.method == "fp8":  # one byte per value, nothing else (scales 1.0: none stored)
            return {"k": 8.0, "v": 8.0, "total": 8.0}
        # as the served formats count (sinks and the window in 16 bits)
        k = v = sum(bits_per_float(tada_format(b), D, T, num_kv_heads=H)["total"] for b in self.layer_bits) / self.layers
        return {"k": k, "v": v, "total": (k + v) / 2}
