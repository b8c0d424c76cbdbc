"""Storage arithmetic of a compressed K/V cache: what each part costs, in bits per cached float.

Pure arithmetic, no torch: the honest accounting behind every "bits" column.  Per (layer, KV head,
K or V) a sequence of n tokens stores
* codes: one code per vector, ``bits`` per float on average (kvquant codes packed);
* scales (scaled integer codes: selective, TaDA): fp16 parameters per (token, KV head[, channel group]);
* means (TaDA): per token the mean over the KV heads, 16 bits per channel, shared by the H heads;
* outliers (optional): ``outlier_cap(D)`` fixed slots per block of BLOCK_TOKENS tokens, each a
  half-precision value plus a 16-bit position (the thesis counts only the value: +0.16 bits);
* sinks: the first SINK_TOKENS tokens in half precision;
* tail: the newest incomplete block in half precision (on average (BLOCK_TOKENS - 1) / 2 tokens);
* centroids: fixed per model, not per token: reported separately (``Artifact.centroid_bytes``).
"""

from __future__ import annotations

import dataclasses

import torch

from .formats import (BLOCK_TOKENS, QJL_INITIAL_LAYERS, QJL_OUTLIERS, QJL_VALUE_GROUP, SINK_TOKENS, KVFormat,
                      outlier_cap)

HALF_BITS = 16
OUTLIER_SLOT_BITS = HALF_BITS + 16  # value + position inside the block


def outlier_bits_per_float(head_dim: int) -> float:
    return outlier_cap(head_dim) * OUTLIER_SLOT_BITS / (BLOCK_TOKENS * head_dim)


def bits_per_float(fmt: KVFormat, head_dim: int, context: int, outliers: bool = False,
                   window: int | None = None, num_kv_heads: int | None = None,
                   num_layers: int | None = None, layer_formats: list[KVFormat] | None = None) -> dict[str, float]:
    """Average bits per cached K/V float for one sequence of ``context`` tokens (the sequence's own
    cost: a page's fixed region is PageLayout's business).  ``num_kv_heads``: for formats that share a
    per-token mean across the KV heads (TaDA); ``num_layers``: for formats whose pages differ per layer (QJL:
    the average over the layers); ``layer_formats``: a mixed format's part in each layer (Artifact.layer_formats)."""
    window = fmt.window if window is None else window
    cl = fmt.part("k").code_layout  # (the head means of TaDA, whose K and V alike)
    n_sink = min(SINK_TOKENS, context)
    tail = min(window + (BLOCK_TOKENS - 1) / 2, max(0, context - n_sink))
    coded = max(0.0, context - n_sink - tail)
    if fmt.mix and not layer_formats:
        raise ValueError(f"{fmt.name} is one of its parts per layer: pass layer_formats")
    if layer_formats:
        num_layers = len(layer_formats)
    elif fmt.per_layer_pages and not num_layers:
        raise ValueError(f"{fmt.name}'s pages differ per layer: pass num_layers")
    layers = range(num_layers) if fmt.per_layer_pages else [None]
    code = scale = 0.0
    for layer in layers:
        for kind in "kv":  # K and V hold the same number of floats
            nbytes, params = kind_geometry(layer_formats[layer] if layer_formats else fmt, kind, head_dim, layer)
            code += 8 * nbytes / (BLOCK_TOKENS * head_dim) / (2 * len(layers))
            scale += HALF_BITS * params / head_dim / (2 * len(layers))
    parts = {
        "codes": code * coded / context,
        "scales": scale * coded / context,
        "means": cl.mean_bits_per_float(head_dim, num_kv_heads) * coded / context,
        "outliers": (outlier_bits_per_float(head_dim) * coded / context) if outliers else 0.0,
        "sinks": HALF_BITS * n_sink / context,
        "tail": HALF_BITS * tail / context,
    }
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------------------------
# How a method cuts K or V into vectors and lays out their codes: ONE description per method,
# read by the codecs (to_vectors / from_vectors), code packing, the torch path and the kernels.
#
# A vector covers ``vec_tokens`` consecutive tokens of ``vec_channels`` adjacent channels (one of
# the two is 1); its floats are ordered along whichever axis has length > 1.  Codes of one block of
# BLOCK_TOKENS tokens and one KV head form a [rows, cols] grid - code (r, c) covers tokens
# r*vec_tokens.. and channels c*vec_channels.. - stored row-major, ``8 // code_bits`` codes per
# byte (lowest column in the lowest bits).  Codebooks are per KV head and *group* of
# ``group_channels`` adjacent channels: column c uses group c * vec_channels // group_channels.


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

    def bits_per_float(self) -> float:
        return self.code_bits / self.vec_dim

    def scale_bits_per_float(self, head_dim: int) -> float:
        return 8 * self.scale_bytes(head_dim) / (BLOCK_TOKENS * head_dim)

    def mean_bits_per_float(self, head_dim: int, num_kv_heads: int | None) -> float:
        return 16 * self.mean_channels(head_dim, num_kv_heads) / head_dim


TADA_GROUP = 128  # TaDA's scale / min group (codecs/tada.py GROUP_SIZE; the whole head when head_dim < 128)

# method -> (vec_tokens, vec_channels, group_channels, {extras}) for chunk length l; see formats.py
_GEOMETRY = {
    "temporal": lambda l: (l, 1, l, {}),  # l tokens of one channel; codebooks shared by l channels
    "channel": lambda l: (1, l, l, {}),  # l adjacent channels of one token
    "scalar": lambda l: (1, 1, 1, {}),  # one value; a codebook per channel
    "selective": lambda l: (1, 1, 1, dict(row_scales=1)),  # one value; an absmax scale per (token, KV head)
    # one value: its deviation from the token's head mean; a scale and a min per (token, KV head, 128 channels)
    "tada": lambda l: (1, 1, 1, dict(row_scales=2, scale_group=TADA_GROUP, head_mean=True)),
    # QJL's values (its keys are sketches, not codes: key_block_bytes): one value, a scale and a min per
    # (token, KV head, 32 channels)
    "qjl": lambda l: (1, 1, 1, dict(row_scales=2, scale_group=QJL_VALUE_GROUP)),
}


def code_layout(method: str, chunk: int, n_centroids: int) -> CodeLayout:
    try:
        vt, vc, gc, extras = _GEOMETRY[method](chunk)
    except KeyError:
        raise ValueError(f"no code layout for method {method!r}; known: {', '.join(_GEOMETRY)}") from None
    return CodeLayout(method, vt, vc, gc, n_centroids, **extras)


# ---------------------------------------------------------------------------------------------
# The paged layout served by vLLM: one flat byte record per (page, KV head)
#
#   region   [8 + R, 2 (K, V), D] half   slots 0..7: the sequence's sink tokens (page 0)
#                                        slots 8..8+R-1: the ring, R = window + BLOCK_TOKENS: token p
#                                        waits in slot 8 + p % R of its own page until its block leaves
#                                        the recent window (window 0: R = 8, the incomplete block - the tail)
#   k_codes  [nb = B / BLOCK_TOKENS, code_bytes = BLOCK_TOKENS * D * bits / 8] uint8
#   v_codes  [nb, code_bytes] uint8
#   (row scales only) k_scales [nb, 8, P] fp16, v_scales    P parameters per token (selective 1, TaDA 2 per group)
#   (head mean only) k_mean [nb, 8, c] half, v_mean           this head's share of the per-token head mean
#   (outliers only) k_idx [nb, cap] int16, k_val [nb, cap] half, v_idx, v_val
#
# A block (8b .. 8b+7) is encoded when the sequence reaches 8b + 8 + window tokens, so the tokens not yet
# encoded are the last window..window+7, a contiguous run of at most R positions: their slots p % R differ.
# (A full page keeps its ring: a prefix-cache hit on it reads the same exact tokens.)
#
# Everything a sequence needs lives in its own pages, so prefix caching (full pages are shared,
# their tail slots unused), chunked prefill (the tail persists in the page) and preemption by
# recompute need nothing outside vLLM's block manager.  The price is the fixed region per page:
# 16 half-precision tokens (+ the window), which large pages amortize (see DESIGN in README / capacity bench).

REGION_SLOTS = 2 * BLOCK_TOKENS  # sinks + tail, without a window
TAIL_SLOT0 = BLOCK_TOKENS  # the ring's first slot


def exact_from(n: int, window: int) -> int:
    """First position kept exact (not yet encoded) once a sequence holds n tokens, and the first a query at
    position n sees exactly: blocks before it are encoded.  The sinks (block 0) are never encoded."""
    return max(SINK_TOKENS, (n - window) // BLOCK_TOKENS * BLOCK_TOKENS)


def code_bytes_per_block(fmt: KVFormat, head_dim: int) -> int:
    """Bytes of codes for one block of BLOCK_TOKENS tokens of one KV head, K or V (the same for a
    hybrid layer's channel-chunked codes: equal bits per float)."""
    return code_layout(fmt.method, fmt.chunk, fmt.n_centroids).block_bytes(head_dim)


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


def kind_geometry(fmt: KVFormat, kind: str, head_dim: int, layer: int | None = None) -> tuple[int, int]:
    """(code bytes per block, fp16 parameters per token) of K ("k") or V ("v") in one KV head's record.  The same
    for K and V but for a K/V pair (``KVFormat.kv``) and QJL, whose keys are sketches (qjl_key_block_bytes: larger in
    the first layers, so its pages need the layer)."""
    if fmt.mix:
        raise ValueError(f"{fmt.name} is laid out per layer as one of its parts ({', '.join(fmt.mix)}): resolve the "
                         "layer's part first (Artifact.layer_formats)")
    if fmt.method == "qjl" and kind == "k":
        if layer is None:
            raise ValueError(f"{fmt.name}'s key pages differ per layer: pass layer")
        return qjl_key_block_bytes(head_dim, layer), 0
    cl = fmt.part(kind).code_layout  # a K/V pair: that half's format
    return cl.block_bytes(head_dim), cl.scales_per_row(head_dim)


class PageLayout:
    """Byte offsets inside one (page, KV head) record; shared by the torch path and kernels.  ``layer``: for a
    format whose pages differ per layer (``KVFormat.per_layer_pages``: QJL)."""

    def __init__(self, fmt: KVFormat, head_dim: int, block_size: int, outliers: bool = False,
                 window: int | None = None, num_kv_heads: int | None = None, layer: int | None = None):
        from .formats import check_window

        if block_size % BLOCK_TOKENS or block_size < 2 * BLOCK_TOKENS:
            raise ValueError(
                f"{fmt.name} needs a block size that is a multiple of {BLOCK_TOKENS} and at least "
                f"{2 * BLOCK_TOKENS}, got {block_size}"
            )
        self.fmt, self.head_dim, self.block_size, self.outliers = fmt, head_dim, block_size, outliers
        self.window = check_window(fmt.window if window is None else window, block_size)
        self.ring = self.window + BLOCK_TOKENS
        self.region_slots = SINK_TOKENS + self.ring
        D = head_dim
        cl = fmt.part("k").code_layout  # the head mean: TaDA's, K and V alike
        self.blocks = block_size // BLOCK_TOKENS  # encode blocks per page
        self.layer = layer
        (kc, ks), (vc, vs) = (kind_geometry(fmt, kind, D, layer) for kind in "kv")
        self.kind_code_bytes = {"k": kc, "v": vc}
        self.kind_scales_per_row = {"k": ks, "v": vs}  # fp16 parameters per token (scaled integer codes)
        # K and V alike, else None (QJL, K/V pairs): readers take kind_code_bytes
        self.code_bytes = kc if kc == vc else None
        self.scales_per_row = ks if ks == vs else None
        self.scale_bytes = BLOCK_TOKENS * ks * 2 if ks == vs else None
        self.mean_channels = cl.mean_channels(D, num_kv_heads)  # 0 unless the format shares a head mean
        self.mean_bytes = BLOCK_TOKENS * self.mean_channels * 2
        self.cap = outlier_cap(D) if outliers else 0
        off = 0
        self.region = off
        off += self.region_slots * 2 * D * 2
        self.k_codes = off
        off += self.blocks * kc
        self.v_codes = off
        off += self.blocks * vc
        self.k_scales = off
        off += self.blocks * BLOCK_TOKENS * ks * 2
        self.v_scales = off
        off += self.blocks * BLOCK_TOKENS * vs * 2
        self.k_mean = off
        off += self.blocks * self.mean_bytes
        self.v_mean = off
        off += self.blocks * self.mean_bytes
        self.k_idx = off
        off += self.blocks * self.cap * 2
        self.k_val = off
        off += self.blocks * self.cap * 2
        self.v_idx = off
        off += self.blocks * self.cap * 2
        self.v_val = off
        off += self.blocks * self.cap * 2
        self.bytes = -(-off // 16) * 16  # 16-byte aligned records

    def ratio_vs_half(self) -> float:
        """Compression of one page against a bf16/fp16 page of the same tokens."""
        return self.block_size * 2 * self.head_dim * 2 / self.bytes

    # ---- torch views of a cache tensor [num_pages, H, bytes] uint8 ----------------------------
    def _slice(self, pages, start, nbytes):
        return pages[..., start : start + nbytes]

    def region_view(self, pages, dtype):
        """[num_pages, H, region_slots, 2, D] in the model's half dtype."""
        n = self.region_slots * 2 * self.head_dim * 2
        return self._slice(pages, self.region, n).view(dtype).unflatten(-1, (self.region_slots, 2, self.head_dim))

    def ring_slot(self, positions):
        """Region slot of tokens waiting to be encoded (positions >= SINK_TOKENS)."""
        return TAIL_SLOT0 + positions % self.ring

    def scales_view(self, pages, kind: str):
        """[num_pages, H, blocks, BLOCK_TOKENS, P] fp16 row scales for K ("k") or V ("v")."""
        start = self.k_scales if kind == "k" else self.v_scales
        P = self.kind_scales_per_row[kind]
        return self._slice(pages, start, self.blocks * BLOCK_TOKENS * P * 2).view(torch.float16).unflatten(
            -1, (self.blocks, BLOCK_TOKENS, P))

    def mean_view(self, pages, kind: str, dtype):
        """[num_pages, H, blocks, BLOCK_TOKENS, c] half: each head's channels of the per-token head mean."""
        start = self.k_mean if kind == "k" else self.v_mean
        n = self.blocks * self.mean_bytes
        return self._slice(pages, start, n).view(dtype).unflatten(-1, (self.blocks, BLOCK_TOKENS, self.mean_channels))

    def codes_view(self, pages, kind: str):
        """[num_pages, H, blocks, code bytes] uint8 for K ("k") or V ("v")."""
        start = self.k_codes if kind == "k" else self.v_codes
        n = self.kind_code_bytes[kind]
        return self._slice(pages, start, self.blocks * n).unflatten(-1, (self.blocks, n))

    def outlier_views(self, pages, kind: str, dtype):
        """([num_pages, H, blocks, cap] int16 positions, same-shape half values)."""
        i0, v0 = (self.k_idx, self.k_val) if kind == "k" else (self.v_idx, self.v_val)
        n = self.blocks * self.cap * 2
        idx = self._slice(pages, i0, n).view(torch.int16).unflatten(-1, (self.blocks, self.cap))
        val = self._slice(pages, v0, n).view(dtype).unflatten(-1, (self.blocks, self.cap))
        return idx, val


# ---- code bytes <-> the codec's natural code tensors (one block of BLOCK_TOKENS tokens) ---------


def pack_block_codes(cl: CodeLayout, codes: torch.Tensor) -> torch.Tensor:
    """Natural codes of nb whole blocks, [nb * rows, H, cols] -> [nb, H, block_bytes] uint8."""
    H, cols = codes.shape[1], codes.shape[2]
    nb = codes.shape[0] // cl.rows
    c = codes.to(torch.uint8).reshape(nb, cl.rows, H, cols).transpose(1, 2)  # [nb, H, rows, cols]
    if cl.code_bits < 8:
        per = 8 // cl.code_bits
        c = c.reshape(*c.shape[:-1], -1, per).to(torch.int32)
        shifts = torch.arange(per, device=c.device, dtype=torch.int32) * cl.code_bits
        c = (c << shifts).sum(-1).to(torch.uint8)
    return c.reshape(nb, H, -1)


def unpack_block_codes(cl: CodeLayout, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of pack_block_codes: [nb, H, block_bytes] -> [nb * rows, H, cols]."""
    nb, H, _ = packed.shape
    c = packed
    if cl.code_bits < 8:
        per = 8 // cl.code_bits
        shifts = torch.arange(per, device=c.device, dtype=torch.int32) * cl.code_bits
        c = ((c.to(torch.int32)[..., None] >> shifts) & ((1 << cl.code_bits) - 1)).to(torch.uint8)
    c = c.reshape(nb, H, cl.rows, cl.cols(head_dim)).transpose(1, 2)
    return c.reshape(nb * cl.rows, H, cl.cols(head_dim))


# ---- the per-token head mean (TaDA) <-> the heads' shares of it -------------------------------


def split_head_mean(mean: torch.Tensor, num_kv_heads: int, channels: int) -> torch.Tensor:
    """[T, D] -> [T, H, c]: head h's share is channels h*c .. h*c + c - 1 (zero-padded past D)."""
    pad = num_kv_heads * channels - mean.shape[-1]
    return torch.nn.functional.pad(mean, (0, pad)).unflatten(-1, (num_kv_heads, channels))


def join_head_mean(shares: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of split_head_mean: [..., H, c] -> [..., D]."""
    return shares.flatten(-2)[..., :head_dim]


def store_half(dtype: torch.dtype) -> torch.dtype:
    """The half dtype a cache stores exact values in (sinks, tail, outliers, head means): the model's own, or
    bfloat16 for a float32 model (a float32 region would cost ~12% of the pages' capacity)."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
