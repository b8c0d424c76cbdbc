"""QJL (seed 002): 1-bit quantized JL sketches of keys, 2-bit per-token groups for values.

A reference baseline, not a ``Codec``: QJL never reconstructs a key.  It stores sign(S k) (m bits)
and ||k|| per key, and estimates a score with the paper's asymmetric estimator (Def. 3.1, eq. 4),
where the query is projected but not quantized (quantizing both sides would estimate an angle):

    <q, k>  ~=  sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>        (unbiased for Gaussian S, Lemma 3.2)

The paper leaves out m, outliers, values and the buffer; those follow the official code
(notes/baselines.md section 2.1, tagged [C] there; [I] = our inference):

* S is [m, D] float32, drawn N(0, 1) and orthogonalized in blocks [C]: S^T is cut into D-column
  chunks, each chunk QR'd and scaled by sqrt(D), so every block of D rows is orthogonal with row norm
  sqrt(D).  One S serves all heads and all layers with the same m [C].  Fixed-norm rows shift the
  mean to c_D <q, k>, c_D = sqrt(D) Gamma(D/2) / (sqrt(2) Gamma((D+1)/2)) ~ 1 + 1/(4D): +0.2% at
  D=128, +0.4% at D=64.  ``orthogonal=False`` gives the paper's exactly unbiased Gaussian S.
* Outliers [C]: per KV head and block of 32 tokens, the 8 channels with the largest L2 norm over
  those tokens (uint8 indices, ties to the lower channel).  Inliers are sketched with all m rows of S
  and outliers with its first m_o rows: the paper says "independent" quantizers, but the code shares
  S.  Each token stores ||k|| and ||k_out|| in the model dtype.  At score time
  ||k_in|| = sqrt(||k||^2 - ||k_out||^2), clamped at 0 here, where the kernel would produce a NaN.
* Keys are sketched as attention sees them, i.e. POST-RoPE [C].  Pass post-RoPE keys to
  ``encode_keys`` and post-RoPE queries to ``attention_logits``, not this project's pre-RoPE cache.
  Sketching pre-RoPE keys and rotating ``key_surrogate`` would also be unbiased, but it would pick
  outlier channels in another basis than the official code does.
* Values [C]: KIVI's per-token quantization over groups of 32 channels, asymmetric, 2 bits, with
  the scale and min stored in the model dtype.
* The recent buffer of 128 exact tokens [C] is a property of the page layout; see ``qjl_recent_mask``.

The estimator is linear in q, so a score is <q, k_hat> for a per-key surrogate
    k_hat = sqrt(pi/2)/m ||k_in|| (1-M) S^T sign(S k_in) + sqrt(pi/2)/m_o ||k_out|| M S_o^T sign(S_o k_out)
(M = outlier-channel mask, S_o = first m_o rows).  ``key_surrogate`` materializes it.  All logits then
take one matmul per head, and for Gaussian S, E[k_hat] = k.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import NamedTuple

import torch

from ..methods import (BLOCK_TOKENS, QJL_INITIAL_LAYERS, QJL_OUTLIER_GROUP, QJL_OUTLIERS, QJL_VALUE_BITS, QJL_VALUE_GROUP,
                       QJL_WINDOW, SINK_TOKENS, code_layout, qjl_key_block_bytes, qjl_sketch_dims)
from ..page_views import store_half
from .quantizer import BaseQuantizer, Encoded, fake_quant

INITIAL_LAYERS = QJL_INITIAL_LAYERS  # [C] initial_layers_count (15): these layers get a larger sketch
N_OUTLIERS = QJL_OUTLIERS  # [C] outlier_count_general = outlier_count_initial_layers (8)
OUTLIER_GROUP = QJL_OUTLIER_GROUP  # [C] group_size: tokens per outlier-channel selection (32)
VALUE_BITS = QJL_VALUE_BITS  # [C] value_quantization_bits (2)
VALUE_GROUP = QJL_VALUE_GROUP  # [C] group_size: channels per value scale/min (32)
WINDOW = QJL_WINDOW  # [C] buffer_size: recent tokens kept exact (128)
_C = math.sqrt(math.pi / 2)


def default_sketch_dims(head_dim: int, layer: int | None = None,
                        initial_layers: int = INITIAL_LAYERS) -> tuple[int, int]:
    """(m, m_outlier).  [C] at D=128: (256, 256) in general layers and (512, 128) in the first 15.
    Other head dims keep the same sign bits per channel [I]: (2D, 2D) and (4D, D).  (The page layout's rule.)"""
    return qjl_sketch_dims(head_dim, layer, initial_layers)


def sketch_matrix(head_dim: int, m: int, seed: int = 0, orthogonal: bool = True,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """S [m, D] float32, the same for a given (D, m, seed).  Built as the official ``QJLSketch`` does:
    proj [D, m] ~ N(0, 1) from a CPU generator; if ``orthogonal``, each D-column chunk becomes its
    reduced QR factor Q times sqrt(D); S = proj^T.  A last chunk narrower than D gives fewer rows."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(head_dim, m, generator=g, dtype=torch.float32)
    if orthogonal:
        chunks = [torch.linalg.qr(proj[:, s : s + head_dim], mode="reduced").Q for s in range(0, m, head_dim)]
        proj = torch.cat(chunks, dim=1) * math.sqrt(head_dim)
    return proj.t().contiguous().to(device)


def select_outlier_channels(k: torch.Tensor, n_outliers: int = N_OUTLIERS,
                            group_size: int = OUTLIER_GROUP) -> torch.Tensor:
    """k [T, H, D] -> uint8 [T / group_size, H, n_outliers]: per head and block of ``group_size``
    tokens, the channels with the largest L2 norm over those tokens, largest first, ties to the
    lower channel."""
    T, H, D = k.shape
    if T % group_size:
        raise ValueError(f"QJL keys come in whole groups of {group_size} tokens, got T={T}")
    if not 0 <= n_outliers <= min(D, 256):
        raise ValueError(f"n_outliers={n_outliers} must be in [0, min(D, 256)]")
    kd = k.double().reshape(T // group_size, group_size, H, D)
    # squared L2 norms [nG, H, D]: the norms' order (torch's norm over a dimension that is not the last one ran ~45x
    # slower on the CPU), in float64 (encode_keys' contract: exact squares, a sum that rounds at 2^-53, so the C++
    # encoder's order can change the choice only between channels tied to ~1e-16)
    sq = (kd * kd).sum(dim=1)
    order = torch.sort(sq, dim=-1, descending=True, stable=True).indices
    return order[..., :n_outliers].to(torch.uint8)


def outlier_mask(outlier_idx: torch.Tensor, head_dim: int, group_size: int = OUTLIER_GROUP) -> torch.Tensor:
    """uint8 [nG, H, n] -> bool [nG * group_size, H, D], True on each token's outlier channels."""
    nG, H, _ = outlier_idx.shape
    m = torch.zeros(nG, H, head_dim, dtype=torch.bool, device=outlier_idx.device)
    m.scatter_(-1, outlier_idx.long(), True)
    return m.repeat_interleave(group_size, dim=0)


_GATHER_BITS = 0x0102040810204080  # byte j (0 or 1) of a little-endian int64 times this: bit j of its top byte


def _pack(positive: torch.Tensor) -> torch.Tensor:
    """bool [..., m] -> uint8 [..., m/8]; bit j of byte i is entry 8i+j (the official kernel's order).  Each 8 bools
    are read as one little-endian int64 (bytes 0 / 1) and one multiply moves byte j's bit to bit 56 + j, with no
    carries (~10x faster than a weighted sum of uint8s on the CPU)."""
    v = positive.reshape(*positive.shape[:-1], -1, 8).contiguous().view(torch.uint8)
    if v.storage_offset() % 8:  # (a view of a larger tensor: int64 reads need 8-byte alignment)
        v = v.clone()
    if sys.byteorder != "little" or v.device.type not in ("cpu", "cuda"):
        w = (2 ** torch.arange(8, device=positive.device)).to(torch.uint8)
        return (v * w).sum(-1, dtype=torch.uint8)
    return ((v.view(torch.int64)[..., 0] * _GATHER_BITS) >> 56).to(torch.uint8)


def unpack_signs(bits: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m/8] -> float32 [..., m] of +-1 (bit 1 = positive projection, 0 = -1)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    b = (bits[..., None] >> shifts) & 1
    return b.reshape(*bits.shape[:-1], -1).float() * 2 - 1


@dataclasses.dataclass
class QJLKeys:
    bits: torch.Tensor  # [T, H, m/8] uint8: signs of S k_in (k with its outlier channels zeroed)
    outlier_bits: torch.Tensor  # [T, H, m_o/8] uint8: signs of S[:m_o] k_out
    norm: torch.Tensor  # [T, H] ||k||, the model dtype
    outlier_norm: torch.Tensor  # [T, H] ||k_out||, the model dtype
    outlier_idx: torch.Tensor  # [T / group_size, H, n_outliers] uint8
    group_size: int

    @property
    def m(self) -> int:
        return self.bits.shape[-1] * 8

    @property
    def m_outlier(self) -> int:
        return self.outlier_bits.shape[-1] * 8


def encode_keys(k: torch.Tensor, S: torch.Tensor, m_outlier: int | None = None,
                n_outliers: int = N_OUTLIERS, group_size: int = OUTLIER_GROUP) -> QJLKeys:
    """Post-RoPE keys [T, H, D] (T a multiple of ``group_size``) -> QJLKeys.  ``m_outlier`` defaults
    to all rows of S (the [C] general-layer setting), or 0 without outliers.

    Projections, norms and the outlier channels' sums of squares are float64 (the contract the C++ encoder keeps,
    csrc/kernels_impl.h encode_qjl_rows): products of float32 values are exact there and a sum rounds at 2^-53, so a
    sign differs from the exact one's only within ~1e-16 of 0, in any summation order - a float32 matmul's signs
    depend on its library's order (MKL's, per machine and thread count) ~1e-6 of the time.  Norms: float64, rounded
    to float32, then to the model dtype."""
    T, H, D = k.shape
    m = S.shape[0]
    m_o = (m if n_outliers else 0) if m_outlier is None else m_outlier
    if S.shape[1] != D or m % 8 or m_o % 8 or not 0 <= m_o <= m:
        raise ValueError(f"need S [m, {D}] with m % 8 == 0 and m_outlier <= m, multiple of 8; "
                         f"got S {tuple(S.shape)}, m_outlier={m_o}")
    if n_outliers and not m_o:
        raise ValueError("outlier channels need an outlier sketch (m_outlier > 0)")
    Sd = S.to(k.device, torch.float64)
    kd = k.double()
    idx = select_outlier_channels(k, n_outliers, group_size)
    M = outlier_mask(idx, D, group_size)
    k_in, k_out = kd.masked_fill(M, 0.0), kd.masked_fill(~M, 0.0)
    return QJLKeys(
        bits=_pack(k_in @ Sd.t() > 0),
        outlier_bits=_pack(k_out @ Sd[:m_o].t() > 0),
        norm=kd.norm(dim=-1).float().to(k.dtype),
        outlier_norm=k_out.norm(dim=-1).float().to(k.dtype),
        outlier_idx=idx,
        group_size=group_size,
    )


def key_surrogate(keys: QJLKeys, S: torch.Tensor) -> torch.Tensor:
    """[T, H, D] float32 k_hat with <q, k_hat> = the QJL estimate of <q, k> (module docstring)."""
    m, m_o = keys.m, keys.m_outlier
    S = S.to(keys.bits.device, torch.float32)
    D = S.shape[1]
    M = outlier_mask(keys.outlier_idx, D, keys.group_size)
    nu, nu_o = keys.norm.float(), keys.outlier_norm.float()
    nu_in = (nu * nu - nu_o * nu_o).clamp_min(0).sqrt()
    k_hat = (_C / m * nu_in)[..., None] * (unpack_signs(keys.bits) @ S).masked_fill(M, 0.0)
    if m_o:
        k_hat += (_C / m_o * nu_o)[..., None] * (unpack_signs(keys.outlier_bits) @ S[:m_o]).masked_fill(~M, 0.0)
    return k_hat


def attention_logits(q: torch.Tensor, keys: QJLKeys, S: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Post-RoPE queries [Tq, Hq, D] against encoded keys [T, H, D] -> float32 [Tq, Hq, T].
    GQA: query head h reads KV head h // (Hq / H).  ``scale`` defaults to 1/sqrt(D), as the official
    model applies it before the fp32 softmax; ``scale=1`` gives the raw inner-product estimates.
    No causal mask: the caller masks."""
    Tq, Hq, D = q.shape
    k_hat = key_surrogate(keys, S)
    T, H, _ = k_hat.shape
    if Hq % H:
        raise ValueError(f"query heads {Hq} not a multiple of KV heads {H}")
    qg = q.float().reshape(Tq, H, Hq // H, D)
    logits = torch.einsum("qhrd,thd->qhrt", qg, k_hat).reshape(Tq, Hq, T)
    return logits * (D ** -0.5 if scale is None else scale)


@dataclasses.dataclass
class QJLValues:
    codes: torch.Tensor  # [T, H, D] uint8 in [0, 2**bits), one code per byte here
    scale: torch.Tensor  # [T, H, D / group] (max - min) / (2**bits - 1), the model dtype
    zero: torch.Tensor  # [T, H, D / group] the group minimum, the model dtype
    bits: int


def encode_values(v: torch.Tensor, bits: int = VALUE_BITS, group_size: int = VALUE_GROUP,
                  param_dtype: torch.dtype | None = None) -> QJLValues:
    """Per token, per group of ``group_size`` channels: code = clamp(round((x - min) / scale), 0, 2^b - 1),
    scale = (max - min) / (2^b - 1) (KIVI, as the official code uses it).  The codes are computed in
    float32 against the scale and min as stored (``param_dtype``, default the model dtype), so decode matches
    them.  A constant group has scale 0 and decodes exactly to its value: the official division would give NaN."""
    T, H, D = v.shape
    param_dtype = param_dtype or v.dtype
    if D % group_size:
        raise ValueError(f"head_dim {D} not a multiple of the value group {group_size}")
    qmax = 2**bits - 1
    x = v.float().reshape(T, H, D // group_size, group_size)
    mn, mx = x.amin(-1), x.amax(-1)
    scale, zero = ((mx - mn) / qmax).to(param_dtype), mn.to(param_dtype)
    s, z = scale.float()[..., None], zero.float()[..., None]
    live = s > 0
    codes = ((x - z) / torch.where(live, s, torch.ones_like(s))).round().clamp(0, qmax)
    codes = torch.where(live, codes, torch.zeros_like(codes))
    return QJLValues(codes.reshape(T, H, D).to(torch.uint8), scale, zero, bits)


def decode_values(enc: QJLValues, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x = code * scale + min, computed in float32, cast to ``dtype`` (default: the scale's dtype)."""
    T, H, D = enc.codes.shape
    G = enc.scale.shape[-1]
    c = enc.codes.float().reshape(T, H, G, D // G)
    x = c * enc.scale.float()[..., None] + enc.zero.float()[..., None]
    return x.reshape(T, H, D).to(dtype or enc.scale.dtype)


def roundtrip_values(v: torch.Tensor, bits: int = VALUE_BITS, group_size: int = VALUE_GROUP) -> torch.Tensor:
    return decode_values(encode_values(v, bits, group_size), v.dtype)


def qjl_recent_mask(T: int, window: int = WINDOW, block: bool = False,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """bool [T]: True where a token is compressed, False where it stays exact.  With ``block=False``
    (values in the official code, and the paper's "recent buffer") the last ``window`` tokens stay
    exact.  With ``block=True`` (keys in the official code, flushed in whole blocks of ``window``)
    the first floor(T / window) * window tokens are compressed and 0..window-1 stay exact.  Use
    block=True for keys: ``encode_keys`` needs whole 32-token groups."""
    if window <= 0:
        n = T
    else:
        n = (T // window) * window if block else max(T - window, 0)
    mask = torch.zeros(T, dtype=torch.bool, device=device)
    mask[:n] = True
    return mask


class BitsPerFloat(NamedTuple):
    k: float
    v: float
    mean: float  # (k + v) / 2: K and V caches hold the same number of floats


def bits_per_float(head_dim: int, m: int | None = None, m_outlier: int | None = None,
                   n_outliers: int = N_OUTLIERS, outlier_group: int = OUTLIER_GROUP,
                   value_bits: int = VALUE_BITS, value_group: int = VALUE_GROUP,
                   norm_bits: int = 16, scale_bits: int = 16) -> BitsPerFloat:
    """All-in storage per cached float, for compressed tokens (the exact recent window and the shared
    S are not counted).  Per head and token:
        keys   = m + norm_bits + [n_outliers > 0] * (m_o + norm_bits + 8 * n_outliers / outlier_group)
        values = value_bits * D + 2 * scale_bits * D / value_group            (scale + min)
    notes/baselines.md section 2 [D]: keys ~4.27 bits/FPN in general layers (m = m_o = 256, D=128),
    ~5.27 in the first 15 (m = 512, m_o = 128); values 2 + 32/32 = 3.  The section 2.5 example
    (m=128, no outliers, 2-bit values, G=32) gives (128+16+256+128)/256 ~ 2.06 on average."""
    if m is None:
        m = default_sketch_dims(head_dim)[0]
    if m_outlier is None:
        m_outlier = m if n_outliers else 0
    keys = m + norm_bits + m_outlier + (norm_bits + 8 * n_outliers / outlier_group if n_outliers else 0)
    values = value_bits * head_dim + 2 * scale_bits * head_dim / value_group
    k, v = keys / head_dim, values / head_dim
    return BitsPerFloat(k, v, (k + v) / 2)


# ---------------------------------------------------------------------------------------------
# QJL served (``--kv-cache-dtype qjl``): the codecs above behind the paged cache's quantizer interface.
# What serving changes, all [I]:
# * outlier channels are picked per block of BLOCK_TOKENS = 8 tokens (the official code: per 32): the page
#   layout encodes a block the moment it leaves the recent window, and a 32-token group would span four blocks
#   encoded at different times.  It costs 8 index bytes per 8 tokens instead of per 32 (+0.09 bits per key
#   float at D = 64) and adapts the outlier set faster;
# * norms and value scales / minimums are fp16 (the official code: the model dtype; TaDA and selective store
#   their parameters in fp16 too);
# * exact tokens are the page layout's: the 8 sinks and the last 128-135 tokens (the official buffer is 128,
#   keys flushed 128 at a time, no sinks);
# * one S per sketch size m, drawn with seed m, shared by every layer and head using it (official: one S per
#   model config).


@functools.lru_cache(maxsize=8)
def served_sketch(head_dim: int, m: int) -> torch.Tensor:
    """The S [m, D] every served layer with sketch size m uses (seed m; float32, CPU)."""
    return sketch_matrix(head_dim, m, seed=m)


class QJLKeyQuantizer(BaseQuantizer):
    """QJL keys in the paged cache, one layer: ``encode`` takes whole blocks of POST-RoPE keys [nb * 8, H, D] (the
    cache does not un-rotate them: ``post_rope``) and returns each block's page bytes (``packs_blocks``: the bytes
    as stored, [nb, H, key_block_bytes]); ``decode`` gives the surrogate k_hat [T, H, D], post-RoPE, whose dot
    product with a query is QJL's estimate.  ``fake_quant`` (the quality harness: pre-RoPE keys of one sequence
    from position 0) rotates, runs the served semantics and rotates the surrogate back.  Sketches, not codes of a
    layout (``code_layout`` None): the C++ decode attention scores them in place (csrc method QJL, the same
    estimator without forming k_hat); the C++ gather decodes k_hat for a prefill chunk; no Triton kernel."""

    post_rope = True
    packs_blocks = True

    def __init__(self, head_dim: int, layer: int, rope=None):
        if head_dim % 8 or head_dim < N_OUTLIERS:
            raise ValueError(f"QJL keys need a head_dim that is a multiple of 8, got {head_dim}")
        self.head_dim, self.layer, self.rope = head_dim, layer, rope
        self.m, self.m_o = default_sketch_dims(head_dim, layer)
        self.S = served_sketch(head_dim, self.m)
        self.block_bytes = qjl_key_block_bytes(head_dim, layer)

    def encode(self, x: torch.Tensor) -> Encoded:
        T, H, D = x.shape
        nb = T // BLOCK_TOKENS
        k = encode_keys(x.float(), self.S, self.m_o, N_OUTLIERS, group_size=BLOCK_TOKENS)

        def per_block(t):  # [T, H, c] uint8 -> [nb, H, 8 * c]
            return t.reshape(nb, BLOCK_TOKENS, H, -1).transpose(1, 2).reshape(nb, H, -1)

        norms = torch.stack([k.norm, k.outlier_norm], -1).to(torch.float16).view(torch.uint8)  # [T, H, 4]
        packed = torch.cat([per_block(k.bits), per_block(k.outlier_bits), per_block(norms), k.outlier_idx], -1)
        return Encoded(packed.contiguous(), None, None)

    def keys(self, packed: torch.Tensor) -> QJLKeys:
        """Page bytes [nb, H, key_block_bytes] -> the QJLKeys they hold."""
        nb, H, _ = packed.shape
        a, b = BLOCK_TOKENS * self.m // 8, BLOCK_TOKENS * (self.m + self.m_o) // 8
        c = b + 4 * BLOCK_TOKENS

        def per_token(t):  # [nb, H, 8 * c] -> [nb * 8, H, c]
            return t.reshape(nb, H, BLOCK_TOKENS, -1).transpose(1, 2).reshape(nb * BLOCK_TOKENS, H, -1)

        norms = per_token(packed[..., b:c]).contiguous().view(torch.float16)  # [T, H, 2]
        return QJLKeys(per_token(packed[..., :a]), per_token(packed[..., a:b]), norms[..., 0], norms[..., 1],
                       packed[..., c:c + N_OUTLIERS], BLOCK_TOKENS)

    def decode(self, enc, T: int, dtype: torch.dtype) -> torch.Tensor:
        return key_surrogate(self.keys(enc.codes), self.S)[:T].to(dtype)

    def fake_quant(self, x: torch.Tensor, sinks: int = SINK_TOKENS, window: int = 0) -> torch.Tensor:
        """Pre-RoPE keys [T, H, D] of one sequence (positions 0..T-1) -> the pre-RoPE image of what the served
        cache holds after T tokens (float32): exact tokens rotated there and back, the rest k_hat rotated back."""
        if self.rope is None:
            raise ValueError("QJLKeyQuantizer.fake_quant rotates pre-RoPE keys: construct it with the model's Rope")
        pos = torch.arange(x.shape[0], device=x.device)
        post = self.rope.apply(x, pos).to(store_half(x.dtype)).float()  # what the cache would hold
        return self.rope.invert(fake_quant(self, post, sinks, window).float(), pos)


class QJLValueQuantizer(BaseQuantizer):
    """QJL values in the paged cache: per token and group of 32 channels, asymmetric 2-bit codes (one per value,
    packed by the page layout) with an fp16 scale and minimum (``Encoded.scales`` [T, H, 2G], scales first)."""

    code_layout = code_layout("qjl", 1, 2**VALUE_BITS)  # 2-bit codes packed 4 per byte, row scales

    def encode(self, x: torch.Tensor) -> Encoded:
        e = encode_values(x, VALUE_BITS, VALUE_GROUP, param_dtype=torch.float16)
        return Encoded(e.codes, None, None, torch.cat([e.scale, e.zero], -1))

    def decode(self, enc, T: int, dtype: torch.dtype) -> torch.Tensor:
        G = enc.scales.shape[-1] // 2
        s = enc.scales[:T]
        return decode_values(QJLValues(enc.codes[:T], s[..., :G], s[..., G:], VALUE_BITS), dtype)
