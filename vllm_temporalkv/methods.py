"""The methods: what each one is, in one place, and how it cuts K or V into vectors and lays out their codes.

Pure arithmetic, no torch: the registry of formats (formats.py), the page layout (layout.py), the codecs
(codecs/) and the kernels (ops/, csrc/) all read a method from here, so a method's constants are written once.
A format (formats.py) is a method at some bits with a chunk length; adding a method is its ``Method`` here, its
codec module under codecs/, and its formats in formats.py (README, "Adding a KV format").

Shared by every method (so they are compared on equal terms):
* ``SINK_TOKENS`` first tokens of every sequence stay in half precision (attention sinks);
* tokens are encoded in blocks of ``BLOCK_TOKENS`` (every chunk length divides it); the newest, incomplete
  block waits in half precision;
* optional dense-and-sparse outliers: at most ``outlier_cap(head_dim)`` exact values per (block, KV head, K/V).

How a method cuts K or V into vectors and lays out their codes (``CodeLayout``): a vector covers ``vec_tokens``
consecutive tokens of ``vec_channels`` adjacent channels (one of the two is 1); its floats are ordered along
whichever axis has length > 1.  Codes of one block of BLOCK_TOKENS tokens and one KV head form a [rows, cols]
grid - code (r, c) covers tokens r*vec_tokens.. and channels c*vec_channels.. - stored row-major,
``8 // code_bits`` codes per byte (lowest column in the lowest bits).  Codebooks are per KV head and *group* of
``group_channels`` adjacent channels: column c uses group c * vec_channels // group_channels.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

SINK_TOKENS = 8
BLOCK_TOKENS = 8
OUTLIER_FRACTION = 0.01
OUTLIER_QUANTILES = (0.005, 0.995)


def outlier_fraction(outliers: bool | float) -> float:
    """The share of values an ``outliers`` setting keeps exact: False / 0 none, True OUTLIER_FRACTION (1%), a float
    that share - at most OUTLIER_FRACTION, as the calibration's thresholds (OUTLIER_QUANTILES) single out ~1% of the
    values as candidates; a smaller share keeps the farthest of them (0.5%: a 2-bit format within 2.25 bits)."""
    if outliers is True:
        return OUTLIER_FRACTION
    if not outliers:
        return 0.0
    f = float(outliers)
    if not 0.0 < f <= OUTLIER_FRACTION:
        raise ValueError(f"an outlier share of {f:g} is outside (0, {OUTLIER_FRACTION:g}]")
    return f


def outlier_cap(head_dim: int, outliers: bool | float = True) -> int:
    """Most values kept exact per (block of BLOCK_TOKENS tokens, KV head, K or V): <= 1% (``outlier_fraction``)."""
    f = outlier_fraction(outliers)
    return max(1, int(f * BLOCK_TOKENS * head_dim + 1e-9)) if f else 0


# ---- the constants of the seed methods (their papers' / official code's values) ---------------------------------
SELECTIVE_WINDOW = 128  # seed 003 leaves its recent window open; the quality harness's too
SELECTIVE_QMAX = {8: 127, 4: 7}  # symmetric int8 (the paper) / int4 (its future work, section 6)
TADA_WINDOW = 128  # seed 004's residual buffer R on LongBench (section 4.1; GSM8K used 32)
TADA_GROUP = 128  # TaDA's scale / min group of channels (the whole head when head_dim < 128)
QJL_WINDOW = 128  # seed 002's buffer_size in the official code: recent tokens kept exact
QJL_VALUE_BITS = 2  # value_quantization_bits
QJL_VALUE_GROUP = 32  # channels per value scale / min
QJL_INITIAL_LAYERS = 15  # initial_layers_count: these layers get a larger key sketch (qjl_sketch_dims)
QJL_OUTLIERS = 8  # outlier channels per group of tokens (outlier_count_general = outlier_count_initial_layers)
QJL_OUTLIER_GROUP = 32  # tokens per outlier-channel selection


def qjl_sketch_dims(head_dim: int, layer: int | None = None, initial_layers: int = QJL_INITIAL_LAYERS) -> tuple[int, int]:
    """QJL's sketch sizes (m, m_outlier).  The official code at D=128: (256, 256) in general layers and (512, 128)
    in the first 15; other head dims keep the same sign bits per channel [our inference]: (2D, 2D) and (4D, D)."""
    if layer is not None and layer < initial_layers:
        return 4 * head_dim, head_dim
    return 2 * head_dim, 2 * head_dim


def qjl_key_block_bytes(head_dim: int, layer: int) -> int:
    """Page bytes of one block of BLOCK_TOKENS QJL keys of one KV head: sign bits of the inlier sketch (m) and of
    the outlier sketch (m_o) per token, ||k|| and ||k_out|| in fp16 per token, the block's outlier channels
    (codecs/qjl.py QJLKeyQuantizer lays them out)."""
    m, m_o = qjl_sketch_dims(head_dim, layer)
    return BLOCK_TOKENS * (m // 8 + m_o // 8 + 4) + QJL_OUTLIERS


# ---- code layouts ----------------------------------------------------------------------------------------------

KERNEL_TOKEN_VECTOR, KERNEL_CHANNEL_VECTOR, KERNEL_SCALAR = 0, 1, 2  # the kernels' code paths (csrc/common.h)


@dataclasses.dataclass(frozen=True)
class CodeLayout:
    method: str
    vec_tokens: int
    vec_channels: int
    group_channels: int
    n_centroids: int  # codebook size, or the 2**bits levels of a scaled integer code
    # scaled integer codes: fp16 parameters per code row (token) of a KV head and group of ``scale_group``
    # channels (0: the whole head) - selective 1 (absmax scale), TaDA 2 (scale, min)
    row_scales: int = 0
    scale_group: int = 0
    # per token, the mean over the KV heads in 16 bits (TaDA): codes are deviations from it; its channels are
    # split across the heads' records (head h keeps channels h*c .. h*c + c - 1, c = ceil(D / H))
    head_mean: bool = False

    @property
    def vec_dim(self) -> int:
        """Floats per vector."""
        return self.vec_tokens * self.vec_channels

    @property
    def code_bits(self) -> int:
        return (self.n_centroids - 1).bit_length()

    @property
    def rows(self) -> int:
        """Code rows per block of BLOCK_TOKENS tokens."""
        return BLOCK_TOKENS // self.vec_tokens

    def cols(self, head_dim: int) -> int:
        return head_dim // self.vec_channels

    def groups(self, head_dim: int) -> int:
        """Codebooks per KV head."""
        return head_dim // self.group_channels

    def block_bytes(self, head_dim: int) -> int:
        """Code bytes of one block of BLOCK_TOKENS tokens of one KV head."""
        return self.rows * self.cols(head_dim) * self.code_bits // 8

    @property
    def kernel_variant(self) -> int | None:
        """Which code path of the C++ and Triton kernels decodes these codes, from the geometry alone:
        0 = a vector along tokens (one channel), 1 = a vector along channels (one token), 2 = one value with a
        codebook per channel; None = no kernel (scaled integer codes: the torch path)."""
        if self.row_scales or self.head_mean:
            return None
        if self.vec_tokens > 1 and self.vec_channels == 1 and self.group_channels == self.vec_tokens:
            return KERNEL_TOKEN_VECTOR
        if self.vec_tokens == 1 and self.vec_channels > 1 and self.group_channels == self.vec_channels:
            return KERNEL_CHANNEL_VECTOR
        if self.vec_tokens == self.vec_channels == self.group_channels == 1:
            return KERNEL_SCALAR
        return None

    @property
    def cpu_scaled(self) -> str | None:
        """Which scaled integer codes the C++ kernels decode (csrc methods SCALED, TADA, AFFINE), None for others:
        "selective", one 8- or 4-bit value per float and one fp16 scale per token and KV head; "tada", 8/4/2-bit
        deviations from the per-token head mean with a scale and a min per group of channels; "affine", 8/4/2-bit
        values with a scale and a min per group of channels (QJL's values)."""
        if self.vec_tokens != 1 or self.vec_channels != 1 or self.group_channels != 1:
            return None
        if self.row_scales == 1 and not self.scale_group and not self.head_mean and self.code_bits in (4, 8):
            return "selective"
        if self.row_scales == 2 and self.head_mean and self.code_bits in (2, 4, 8):
            return "tada"
        if self.row_scales == 2 and self.scale_group and not self.head_mean and self.code_bits in (2, 4, 8):
            return "affine"
        return None

    def scales_per_row(self, head_dim: int) -> int:
        """fp16 parameters per code row of one KV head."""
        if not self.row_scales:
            return 0
        g = min(self.scale_group, head_dim) if self.scale_group else head_dim
        return self.row_scales * (head_dim // g)

    def scale_bytes(self, head_dim: int) -> int:
        """Scale bytes of one block of one KV head (fp16)."""
        return self.rows * self.scales_per_row(head_dim) * 2

    def mean_channels(self, head_dim: int, num_kv_heads: int | None) -> int:
        """Channels of the per-token head mean each KV head's record keeps (0: no mean)."""
        if not self.head_mean:
            return 0
        if not num_kv_heads:
            raise ValueError(f"{self.method} shares a per-token mean across the KV heads: pass num_kv_heads")
        return -(-head_dim // num_kv_heads)

    def code_bits_per_float(self) -> float:
        """Code bits per float (the codes alone: no scales, means, outliers, sinks or tail)."""
        return self.code_bits / self.vec_dim

    def scale_bits_per_float(self, head_dim: int) -> float:
        return 8 * self.scale_bytes(head_dim) / (BLOCK_TOKENS * head_dim)

    def mean_bits_per_float(self, head_dim: int, num_kv_heads: int | None) -> float:
        return 16 * self.mean_channels(head_dim, num_kv_heads) / head_dim


# ---- the methods -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Method:
    """One method: how it cuts K / V into vectors (``geometry``: chunk length l -> (vec_tokens, vec_channels,
    group_channels)), what its codes carry besides (row scales, a head mean), whether its codebooks come from a
    calibration artifact, its formats' default recent window, and whether its keys are quantized as served
    (post-RoPE sketches: QJL) rather than un-rotated first."""

    name: str
    calibrated: bool
    geometry: Callable[[int], tuple[int, int, int]]
    row_scales: int = 0
    scale_group: int = 0
    head_mean: bool = False
    window: int = 0
    post_rope_keys: bool = False
    # what a head dim must satisfy beyond the code layout's packing: (chunk, head_dim) -> the problem, or None
    head_dim_rule: Callable[[int, int], str | None] = lambda l, d: None

    def head_dim_problem(self, chunk: int, n_centroids: int, head_dim: int) -> str | None:
        """Why this method cannot lay out a head of ``head_dim`` at this chunk / code size (None: it can)."""
        problem = self.head_dim_rule(chunk, head_dim)
        per_byte = 8 // self.code_layout(chunk, n_centroids).code_bits
        if problem is None and self.row_scales and head_dim % per_byte:
            problem = f"packs {per_byte} codes per byte and needs a head_dim divisible by {per_byte}, got {head_dim}"
        return problem

    def code_layout(self, chunk: int, n_centroids: int) -> CodeLayout:
        vt, vc, gc = self.geometry(chunk)
        return CodeLayout(self.name, vt, vc, gc, n_centroids, row_scales=self.row_scales,
                          scale_group=self.scale_group, head_mean=self.head_mean)


def _groups_channels(l: int, d: int) -> str | None:
    if d % l:
        return (f"groups {l} channels per vector, which does not divide head_dim={d}; choose a format with a chunk "
                f"length dividing {d}")
    return None


def _temporal_rule(l: int, d: int) -> str | None:
    if BLOCK_TOKENS % l:
        return f"chunk {l} must divide BLOCK_TOKENS={BLOCK_TOKENS}"
    return _groups_channels(l, d)  # its codebooks group l channels


METHODS: dict[str, Method] = {m.name: m for m in (
    # TemporalKV (the thesis): l tokens of one channel; codebooks shared by l adjacent channels
    Method("temporal", True, lambda l: (l, 1, l), head_dim_rule=_temporal_rule),
    # ChannelKV = Coupled Quantization (seed 001): l adjacent channels of one token
    Method("channel", True, lambda l: (1, l, l), head_dim_rule=_groups_channels),
    # KVQuant-style non-uniform scalar codes: one value, a codebook per channel
    Method("scalar", True, lambda l: (1, 1, 1)),
    # selective (seed 003): one value, an absmax scale per (token, KV head)
    Method("selective", False, lambda l: (1, 1, 1), row_scales=1, window=SELECTIVE_WINDOW),
    # TaDA (seed 004): one value, its deviation from the token's head mean; a scale and a min per (token, KV head,
    # 128 channels)
    Method("tada", False, lambda l: (1, 1, 1), row_scales=2, scale_group=TADA_GROUP, head_mean=True,
           window=TADA_WINDOW, head_dim_rule=lambda l, d: (
               f"keeps a scale and a min per {TADA_GROUP} channels: head_dim {d} must be a multiple of {TADA_GROUP} "
               f"(or at most {TADA_GROUP})" if d > TADA_GROUP and d % TADA_GROUP else None)),
    # QJL (seed 002): these are its values' codes - one value, a scale and a min per (token, KV head, 32 channels);
    # its keys are post-RoPE sketches laid out by their quantizer (qjl_key_block_bytes)
    Method("qjl", False, lambda l: (1, 1, 1), row_scales=2, scale_group=QJL_VALUE_GROUP, window=QJL_WINDOW,
           post_rope_keys=True, head_dim_rule=lambda l, d: (
               f"quantizes values in groups of {QJL_VALUE_GROUP} channels: head_dim {d} must be a multiple of "
               f"{QJL_VALUE_GROUP}" if d % QJL_VALUE_GROUP else None)),
)}
CODEBOOK_METHODS = tuple(n for n, m in METHODS.items() if m.calibrated)  # calibrated: codebooks in an artifact


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}") from None


def code_layout(method: str, chunk: int, n_centroids: int) -> CodeLayout:
    return get_method(method).code_layout(chunk, n_centroids)
