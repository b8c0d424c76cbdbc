"""One (layer, K-or-V) cache quantizer: normalization + codec + outliers + sinks + blocks.

This is the whole reference pipeline for raw (pre-RoPE for keys) values ``x`` of shape [T, H, D]:

    encode:  x -> [clamp + pick exact outliers] -> z = (x - mean) * inv_std -> codes
    decode:  codes -> centroids -> x = z * std + mean -> [restore exact outliers] -> cast

Sinks (the first SINK_TOKENS tokens of a sequence) and the tail (a last incomplete block) are not
encoded at all: they stay in the model's half precision.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import torch

from ..methods import BLOCK_TOKENS, SINK_TOKENS, CodeLayout, outlier_cap
from .base import Codec
from .outliers import merge_outliers, split_outliers


@dataclasses.dataclass
class ChannelStats:
    """Per-(KV head, channel) calibration statistics of one (layer, K-or-V), each [H, D] float32."""

    mean: torch.Tensor
    std: torch.Tensor
    lo: torch.Tensor  # outlier thresholds: 0.5% / 99.5% quantiles of the raw values
    hi: torch.Tensor

    def __post_init__(self):
        self.inv_std = torch.reciprocal(self.std.float())

    def to(self, device) -> "ChannelStats":
        return ChannelStats(*(t.to(device) for t in (self.mean, self.std, self.lo, self.hi)))


@dataclasses.dataclass
class Encoded:
    codes: torch.Tensor  # uint8, the codec's natural layout
    outlier_idx: torch.Tensor | None  # [nb, H, cap] int16, -1 = empty slot
    outlier_val: torch.Tensor | None  # [nb, H, cap], the model's dtype (exact)
    scales: torch.Tensor | None = None  # [T, H, P] fp16 per-token parameters (scaled integer codes: selective, tada)
    mean: torch.Tensor | None = None  # [T, D] the per-token mean over the KV heads, half precision (tada)


@runtime_checkable
class Quantizer(Protocol):
    """What the paged cache, the kernel selection and the quality harness may ask of one (layer, K-or-V) quantizer:
    every served quantizer declares these (``BaseQuantizer`` holds the defaults), and nothing probes for others.

    * ``code_layout``: the geometry of its codes (``methods.CodeLayout``; its ``kernel_variant`` says which code
      path of the C++ / Triton kernels decodes them, None = none does); None when what it stores are not codes of
      a layout (QJL's key sketches);
    * ``post_rope``: it takes keys as served, post-RoPE (QJL's sketches), so the cache does not un-rotate them;
    * ``packs_blocks``: ``encode`` returns each block's page bytes itself (else the cache packs the codes by
      ``code_layout``);
    * ``outliers``: exact outliers ride along (``Encoded.outlier_idx`` / ``outlier_val``);
    * ``encode`` whole blocks of K or V [nb * BLOCK_TOKENS, H, D] -> ``Encoded``; ``decode`` (enc, T, dtype) ->
      [T, H, D]; ``roundtrip``; ``fake_quant`` (one sequence as the server holds it after its T tokens)."""

    code_layout: CodeLayout | None
    post_rope: bool
    packs_blocks: bool
    outliers: bool

    def encode(self, x: torch.Tensor) -> "Encoded": ...

    def decode(self, enc: "Encoded", T: int, dtype: torch.dtype) -> torch.Tensor: ...

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor: ...

    def fake_quant(self, x: torch.Tensor, sinks: int = SINK_TOKENS, window: int = 0) -> torch.Tensor: ...


class BaseQuantizer:
    """The ``Quantizer`` defaults - codes of a code layout, of pre-RoPE keys, packed by the cache, no outliers -
    and what follows from encode / decode."""

    code_layout: CodeLayout | None = None
    post_rope = False
    packs_blocks = False
    outliers = False

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x), x.shape[0], x.dtype)

    def fake_quant(self, x: torch.Tensor, sinks: int = SINK_TOKENS, window: int = 0) -> torch.Tensor:
        return fake_quant(self, x, sinks, window)


class KVQuantizer(BaseQuantizer):
    """A codebook method's quantizer: per-channel normalization (calibration statistics), its codec, outliers."""

    def __init__(self, codec: Codec, stats: ChannelStats, outliers: bool | float = False):
        self.codec = codec
        self.stats = stats
        self.outliers = outliers

    @property
    def code_layout(self) -> CodeLayout:
        return self.codec.layout

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stats
        return (x.float() - s.mean) * s.inv_std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        s = self.stats
        return z * s.std + s.mean

    def encode(self, x: torch.Tensor) -> Encoded:
        """x [T, H, D] (T a multiple of BLOCK_TOKENS), any float dtype."""
        T, H, D = x.shape
        if T % BLOCK_TOKENS:
            raise ValueError(f"encode takes whole blocks of {BLOCK_TOKENS} tokens, got T={T}")
        xf = x.float()
        idx = val = None
        if self.outliers:
            s = self.stats
            xf, idx, val = split_outliers(xf, s.lo, s.hi, s.inv_std, outlier_cap(D, self.outliers))
            val = val.to(x.dtype)
        return Encoded(self.codec.encode(self.normalize(xf)), idx, val)

    def decode(self, enc: Encoded, T: int, dtype: torch.dtype) -> torch.Tensor:
        x = self.denormalize(self.codec.decode(enc.codes, T))
        if enc.outlier_idx is not None:
            x = merge_outliers(x, enc.outlier_idx, enc.outlier_val.float())
        return x.to(dtype)


def fake_quant(q, x: torch.Tensor, sinks: int = SINK_TOKENS, window: int = 0) -> torch.Tensor:
    """Simulated compression of one sequence [T, H, D] by quantizer ``q``: the sinks, the incomplete tail
    block and the recent window before it (``window`` tokens) stay exact; every whole block between the
    sinks and them is encoded and decoded - the cache as the server holds it after T tokens."""
    T = x.shape[0]
    start = min(sinks, T)
    n = max(0, T - start - window) // BLOCK_TOKENS * BLOCK_TOKENS
    if n == 0:
        return x
    out = x.clone()
    out[start : start + n] = q.roundtrip(x[start : start + n])
    return out
