"""TaDA (seed 004): per token, the mean across KV heads is kept in 16 bits, and each head's deviation
from it is quantized asymmetrically (scale + min).  A residual buffer of recent tokens stays exact, and
the deviation bits are chosen per layer by a search under an average-bits budget.

For one (layer, K-or-V) cache x [T, H, D], with H the number of KV heads:

    m[t, d]    = mean_h x[t, h, d]                   (Eq. 1/2 print a sum; "mean" and the 1/H memory term
                                                      make it a mean: notes §4.1)  -> stored in 16 bits
    dev[t,h,d] = m[t, d] - x[t, h, d]                (Eq. 3/4)
    x̂[t,h,d]   = m[t, d] - deq(quant(dev))[t, h, d]   (Eq. 7/8)

Where each value comes from.  [P] = the paper, [D] = arithmetic on the paper's numbers, [I] = our
inference; the official code was not available.

* The mean is over the H KV heads, per token and per channel [P §3.1; for GQA "H" = KV heads, I].  It
  is stored in the model's 16-bit dtype [P "16 bits"; the dtype itself is I].  The deviation is taken
  from the *stored* mean, so the only error is the deviation's quantization error [I].
* Asymmetric uniform quantization with a scale S and a min M [P Alg. 1]: codes = clip(round((dev -
  M) / S), 0, 2**b - 1), deq = codes * S + M, with M = min and S = (max - M) / (2**b - 1) over a group
  [I: the standard form].  S and M are fp16, and each is rounded before the codes are computed [I].
* Group: GROUP_SIZE = 128 contiguous channels of one (token, head), or the whole head vector when
  head_dim < 128 [D from the memory term 2/128: one 16-bit pair per 128 values; the axis is I].  We
  group per token rather than per channel across tokens (KIVI-style), because the paper fuses
  compression into the RoPE and v_proj kernels, which see one token at a time, and because R = 32 on
  GSM8K is too short for 128-token channel groups.
* Bits: CANDIDATE_BITS = (2, 4, 8) per layer [P §4.1, App. B], chosen by ``search_layer_bits``.
* Residual: RESIDUAL_TOKENS = 128, as on LongBench [P §4.1; GSM8K used 32].  See ``tada_mask``.
* Keys: the paper compresses post-RoPE keys (fused into RoPE, §3.4).  We compress pre-RoPE keys, like
  every method here, and rotate the decoded key.  The head mean commutes with RoPE: all heads of a
  token get the same rotation.  So only the deviation's min/max, hence its grid, differ.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Mapping, TypeVar

import torch

from ..methods import TADA_GROUP, TADA_WINDOW, CodeLayout, code_layout
from ..page_views import store_half
from .quantizer import BaseQuantizer, Encoded

GROUP_SIZE = TADA_GROUP  # 128
CANDIDATE_BITS = (2, 4, 8)
RESIDUAL_TOKENS = TADA_WINDOW  # 128
EPS = 2.0**-24  # smallest positive fp16: the floor of a scale, so a constant group divides safely

U = TypeVar("U", bound=Hashable)


def _half(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype the mean is kept in: the model's own, or fp16 for a float32 input."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


def _group(head_dim: int, group_size: int) -> int:
    g = min(group_size, head_dim)
    if head_dim % g:
        raise ValueError(f"head_dim {head_dim} is not a multiple of the group size {g}")
    return g


def bits_per_float(head_dim: int, bits: int, num_kv_heads: int, group_size: int = GROUP_SIZE) -> float:
    """All-in bits per cached value of a compressed token: the deviation code, plus the fp16 scale and
    min of its group, plus the 16-bit mean, which is per (token, channel) and shared by the H heads.
    b + 32/G + 16/H is the paper's 16 * (1/H + b/16 + 2/128) when G = 128 (§3)."""
    return bits + 32 / _group(head_dim, group_size) + 16 / num_kv_heads


def budget_bits_from_fraction(fraction: float, num_kv_heads: int, head_dim: int,
                              group_size: int = GROUP_SIZE) -> float:
    """Average deviation bits that give a cache of ``fraction`` x its 16-bit size: the inverse of
    ``bits_per_float``.  For example, 0.35 with 8 KV heads and head_dim 128 gives 3.35 (notes §4.3)."""
    return 16 * fraction - 32 / _group(head_dim, group_size) - 16 / num_kv_heads


def tada_mask(T: int, residual: int = RESIDUAL_TOKENS) -> torch.Tensor:
    """bool[T]: which of the T tokens written so far are compressed.  The buffer holds r in [1, R] recent
    tokens [P §3.3: r in [0, R]; r = 0 only at T = 0].  When token R+1 arrives, the R buffered tokens
    are compressed and a new buffer starts [P: "once the number ... exceeds R"].  The result depends
    only on T, so prefill and decoding agree.  residual = 0 compresses everything."""
    if residual < 0:
        raise ValueError(f"residual must be >= 0, got {residual}")
    mask = torch.zeros(T, dtype=torch.bool)
    if residual == 0:
        mask[:] = True
    elif T > 0:
        mask[: residual * ((T - 1) // residual)] = True
    return mask


@dataclasses.dataclass
class TadaEncoded:
    mean: torch.Tensor  # [T, D], 16-bit (the model dtype)
    codes: torch.Tensor  # [T, H, D] uint8, < 2**bits (packing is the page layout's business)
    scale: torch.Tensor  # [T, H, D // G] fp16
    minimum: torch.Tensor  # [T, H, D // G] fp16


class TadaCodec:
    """Mean-centering across KV heads + asymmetric deviation quantization for one (layer, K-or-V)."""

    def __init__(self, bits: int = 4, group_size: int = GROUP_SIZE, mean_dtype=None):
        if not 1 <= bits <= 8:
            raise ValueError(f"deviation bits must be in 1..8, got {bits}")
        self.bits = bits
        self.qmax = 2**bits - 1
        self.group_size = group_size
        self.mean_dtype = mean_dtype  # a function of the input dtype -> the mean's 16-bit dtype (default _half)
        # in pages: codes of ``bits`` bits, scale + min per (token, head, group), the head mean split across heads
        self.layout: CodeLayout = code_layout("tada", 1, 2**bits)

    def encode(self, x: torch.Tensor) -> TadaEncoded:
        T, H, D = x.shape
        g = _group(D, self.group_size)
        mean = x.float().mean(1).to((self.mean_dtype or _half)(x.dtype))
        dev = (mean.float()[:, None, :] - x.float()).reshape(T, H, D // g, g)
        mn = dev.amin(-1).to(torch.float16)
        scale = ((dev.amax(-1) - mn.float()) / self.qmax).clamp_min(EPS).to(torch.float16)
        codes = torch.round((dev - mn.float()[..., None]) / scale.float()[..., None]).clamp_(0, self.qmax)
        return TadaEncoded(mean, codes.to(torch.uint8).reshape(T, H, D), scale, mn)

    def decode(self, enc: TadaEncoded, dtype: torch.dtype) -> torch.Tensor:
        T, H, D = enc.codes.shape
        G = enc.scale.shape[-1]
        codes = enc.codes.float().reshape(T, H, G, D // G)
        dev = codes * enc.scale.float()[..., None] + enc.minimum.float()[..., None]
        return (enc.mean.float()[:, None, :] - dev.reshape(T, H, D)).to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x), x.dtype)

    def fake_quant(self, x: torch.Tensor, residual: int = RESIDUAL_TOKENS) -> torch.Tensor:
        """Simulated compression of one sequence [T, H, D]: the tokens ``tada_mask`` marks are
        compressed and decompressed, the residual buffer stays exact."""
        mask = tada_mask(x.shape[0], residual).to(x.device)
        if not mask.any():
            return x
        out = x.clone()
        out[mask] = self.roundtrip(x[mask])
        return out

    def bits_per_float(self, head_dim: int, num_kv_heads: int) -> float:
        return bits_per_float(head_dim, self.bits, num_kv_heads, self.group_size)


class TadaQuantizer(BaseQuantizer):
    """TaDA behind the serving quantizer interface (``KVQuantizer``'s encode / decode, what the paged cache calls):
    whole blocks of all KV heads in; codes (< 2**bits, one per value), scale + min per (token, head, group) as
    ``Encoded.scales`` [T, H, 2G] (scales first), and the per-token head mean as ``Encoded.mean``.  The mean is
    kept in the half dtype the cache stores exact values in (``layout.store_half``: bfloat16 for a float32
    model), so a decode from the pages is this codec's decode.  Under tensor parallelism it is the mean over
    the KV heads a rank holds.  No calibration, no normalization, no outliers; the recent window (the paper's
    residual) and the sinks are the page layout's."""

    def __init__(self, bits: int):
        self.codec = TadaCodec(bits, mean_dtype=store_half)
        self.code_layout = self.codec.layout

    def encode(self, x: torch.Tensor) -> Encoded:
        e = self.codec.encode(x)
        return Encoded(e.codes, None, None, torch.cat([e.scale, e.minimum], -1), e.mean)

    def decode(self, enc, T: int, dtype: torch.dtype) -> torch.Tensor:
        G = enc.scales.shape[-1] // 2
        s = enc.scales[:T]
        return self.codec.decode(TadaEncoded(enc.mean[:T], enc.codes[:T], s[..., :G], s[..., G:]), dtype)


def search_layer_bits(errors: Mapping[U, Mapping[int, float]], avg_bits: float) -> dict[U, int]:
    """Bits per unit (a layer, or a (layer, K/V) pair: the paper does not say whether K and V share)
    with the lowest total error such that the mean bits over units is <= ``avg_bits``.

    ``errors[unit][bits]`` is what compressing that unit alone at ``bits`` costs on held-out
    calibration text, e.g. the NLL increase or a Fisher-weighted reconstruction error.  The paper
    instead runs a random search scored by task accuracy on train data (§3.3, App. B).  We take the
    per-unit costs as additive [I] and solve exactly (a multiple-choice knapsack by dynamic
    programming over total bits).  Ties go to fewer total bits."""
    units = list(errors)
    if not units:
        return {}
    cap = math.floor(avg_bits * len(units) + 1e-9)
    if sum(min(errors[u]) for u in units) > cap:
        raise ValueError(f"average budget {avg_bits} bits is below the smallest candidate of every unit")
    # total bits -> (total error, bits chosen so far); states above the cap can never come back
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for u in units:
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for total, (err, chosen) in best.items():
            for b in sorted(errors[u]):
                t = total + b
                if t > cap:
                    continue
                e = err + float(errors[u][b])
                if t not in nxt or e < nxt[t][0]:
                    nxt[t] = (e, chosen + (b,))
        best = nxt
    _, (_, chosen) = min(best.items(), key=lambda kv: (kv[1][0], kv[0]))
    return dict(zip(units, chosen))
