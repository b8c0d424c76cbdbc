"""Selective KV quantization (seed 003, "Don't Drop It, Compress It"): sinks and a recent window stay
in half precision, every token in between is quantized per token with a symmetric absmax scale.

The quantizer (paper §4.4), per (token, KV head) over the head dim:

    scale = max_d |x_d| / qmax + eps,   q_d = clip(round(x_d / scale), -qmax, qmax),   x̂_d = q_d * scale

with qmax = 127 (int8, the paper) or 7 (int4, the paper's future work, §6).  Choices the paper leaves
open, and ours:

* scale dtype: fp16 (16 bits, the natural pairing with an fp16 cache).  The scale is rounded to fp16
  *before* quantizing, so encode and decode use the very same scale.
* eps: the paper gives no value.  We use 2**-24, the smallest positive fp16.  A common 1e-8 would
  underflow to 0 once the scale is stored in fp16, and an all-zero token would then give 0/0.
  2**-24 is the smallest eps that survives that rounding; it moves a nonzero scale by at most one
  fp16 ulp, and only when the scale sits on an fp16 rounding boundary.
* pre- vs post-RoPE keys: GPT-Fast caches post-RoPE keys, so the paper most likely quantized those.
  We quantize pre-RoPE keys, like every other method in this project, and apply RoPE to the decoded
  key.  RoPE rotates channel pairs, so the per-token absmax over D (hence the scale) is what changes.
* which tokens are compressed (sink S, window L): the paper leaves S and L as task-specific
  hyperparameters without values.  ``selective_mask`` implements the FIFO of the paper's text
  (§4.4.3): a token leaves the window into the int8 buffer once L newer tokens exist.  The "if
  step < mid" branch of Alg. 2 contradicts that text, so we do not follow it.
"""

from __future__ import annotations

import torch

from ..methods import SELECTIVE_QMAX, CodeLayout, code_layout
from .quantizer import BaseQuantizer, Encoded

EPS = 2.0**-24  # smallest positive fp16 (subnormal); see the module docstring
QMAX = SELECTIVE_QMAX


def selective_mask(T: int, sinks: int, window: int) -> torch.Tensor:
    """bool[T]: which of the T tokens written so far are compressed.  The first ``sinks`` and the last
    ``window`` stay exact; when T <= sinks + window nothing is compressed (Alg. 1).  This depends only
    on T, so prefill and token-by-token decoding agree, and a compressed token stays compressed (FIFO)."""
    if sinks < 0 or window < 0:
        raise ValueError(f"sinks and window must be >= 0, got {sinks}, {window}")
    mask = torch.zeros(T, dtype=torch.bool)
    if T > sinks + window:
        mask[sinks : T - window] = True
    return mask


class SelectiveCodec:
    """Per-token symmetric quantization of one (layer, K-or-V) cache ``[T, H, D]``."""

    def __init__(self, bits: int = 8):
        if bits not in QMAX:
            raise ValueError(f"selective quantization supports {sorted(QMAX)} bits, got {bits}")
        self.bits = bits
        self.qmax = QMAX[bits]
        # in pages: q + qmax + 1 as an unsigned code of ``bits`` bits, one fp16 scale per (token, head)
        self.layout: CodeLayout = code_layout("selective", 1, 2**bits)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> fp16 scale [T, H]: absmax / qmax + eps, rounded to fp16."""
        return (x.float().abs().amax(-1) / self.qmax + EPS).to(torch.float16)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H, D] -> (q int8 [T, H, D] in [-qmax, qmax], scale fp16 [T, H]).  int4 codes are
        returned one per int8; packing two per byte is the page layout's business."""
        s = self.scale(x)
        q = torch.round(x.float() / s.float()[..., None]).clamp_(-self.qmax, self.qmax)
        return q.to(torch.int8), s

    def decode(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # q (<= 7 bits of magnitude) times an fp16 scale (11 bits) is exact in float32
        return (q.float() * scale.float()[..., None]).to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(*self.encode(x), x.dtype)

    def fake_quant(self, x: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
        """Simulated compression of one sequence [T, H, D]: the tokens ``selective_mask`` marks are
        quantized and dequantized, the sinks and the window stay exact."""
        mask = selective_mask(x.shape[0], sinks, window).to(x.device)
        if not mask.any():
            return x
        out = x.clone()
        out[mask] = self.roundtrip(x[mask])
        return out

    def bits_per_float(self, head_dim: int) -> float:
        """All-in bits per value of a compressed token: the code (int4 packed two per byte) plus the
        fp16 scale shared by the head_dim values of one (token, head)."""
        return self.bits + 16 / head_dim


class SelectiveQuantizer(BaseQuantizer):
    """A selective codec behind the serving quantizer interface (``quantizer.Quantizer``, what the paged cache
    calls): whole blocks in, unsigned codes + fp16 scales out.  No calibration, no normalization, no outliers; the
    recent window is the page layout's (``formats.KVFormat.window``)."""

    def __init__(self, bits: int):
        self.codec = SelectiveCodec(bits)
        self.code_layout = self.codec.layout

    def encode(self, x: torch.Tensor) -> Encoded:
        q, s = self.codec.encode(x)
        return Encoded((q.to(torch.int16) + (self.codec.qmax + 1)).to(torch.uint8), None, None, s[..., None])

    def decode(self, enc, T: int, dtype: torch.dtype) -> torch.Tensor:
        q = enc.codes[:T].to(torch.int16) - (self.codec.qmax + 1)
        return self.codec.decode(q, enc.scales[:T, :, 0], dtype)
