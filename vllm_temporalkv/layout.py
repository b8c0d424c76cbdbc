"""Storage arithmetic of a compressed K/V cache: what each part costs, in bits per cached float.

Pure arithmetic, no torch (the torch views of a page tensor: page_views.py): the honest accounting behind every
"bits" column, and the byte offsets inside a page's record (``PageLayout``).  Per (layer, KV head,
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

from .formats import KVFormat, check_window
from .methods import BLOCK_TOKENS, SINK_TOKENS, code_layout, get_method, outlier_cap, qjl_key_block_bytes

HALF_BITS = 16
OUTLIER_SLOT_BITS = HALF_BITS + 16  # value + position inside the block


def outlier_bits_per_float(head_dim: int, outliers: bool | float = True) -> float:
    return outlier_cap(head_dim, outliers) * OUTLIER_SLOT_BITS / (BLOCK_TOKENS * head_dim)


def bits_per_float(fmt: KVFormat, head_dim: int, context: int, outliers: bool | float = False,
                   window: int | None = None, num_kv_heads: int | None = None,
                   num_layers: int | None = None, layer_formats: list[KVFormat] | None = None,
                   sinks: int | None = None) -> dict[str, float]:
    """Average bits per cached K/V float for one sequence of ``context`` tokens (the sequence's own
    cost: a page's fixed region is PageLayout's business).  ``num_kv_heads``: for formats that share a
    per-token mean across the KV heads (TaDA); ``num_layers``: for formats whose pages differ per layer (QJL:
    the average over the layers); ``layer_formats``: a mixed format's part in each layer (Artifact.layer_formats);
    ``sinks``: exact first tokens other than SINK_TOKENS (the quality harness's ``@sinksN``)."""
    window = fmt.window if window is None else window
    cl = fmt.part("k").code_layout  # (the head means of TaDA, whose K and V alike)
    n_sink = min(SINK_TOKENS if sinks is None else sinks, context)
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
        "outliers": (outlier_bits_per_float(head_dim, outliers) * coded / context) if outliers else 0.0,
        "sinks": HALF_BITS * n_sink / context,
        "tail": HALF_BITS * tail / context,
    }
    parts["total"] = sum(parts.values())
    return parts


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

# Small pages (serving option temporalkv_small_pages, issue 34): the record above without its region - codes only - and
# a second KV-cache group of vLLM's holding, per request, two *exact pages* of one record per KV head each:
#
#   exact    [8, 2 (K, V), D] half      the sink page: slot p = sink token p (prefix-cached with the first code page)
#                                       the ring page: slot p % 8 = the incomplete block's token p (private)
#
# Both groups' pages are one size (vLLM's block pool is shared): the larger of the two records.  At 2 bits a code page
# of 64 tokens (8 blocks x 256 bytes per head) is exactly one exact page (8 tokens x 256 bytes), so nothing is padded.

REGION_SLOTS = 2 * BLOCK_TOKENS  # sinks + tail, without a window
TAIL_SLOT0 = BLOCK_TOKENS  # the ring's first slot


def exact_record_bytes(head_dim: int) -> int:
    """One exact page's record per KV head: BLOCK_TOKENS K/V slots in half precision, 16-byte aligned."""
    return -(-(BLOCK_TOKENS * 2 * head_dim * 2) // 16) * 16


def exact_from(n: int, window: int) -> int:
    """First position kept exact (not yet encoded) once a sequence holds n tokens, and the first a query at
    position n sees exactly: blocks before it are encoded.  The sinks (block 0) are never encoded."""
    return max(SINK_TOKENS, (n - window) // BLOCK_TOKENS * BLOCK_TOKENS)


def code_bytes_per_block(fmt: KVFormat, head_dim: int) -> int:
    """Bytes of codes for one block of BLOCK_TOKENS tokens of one KV head, K or V (the same for a
    hybrid layer's channel-chunked codes: equal bits per float)."""
    return code_layout(fmt.method, fmt.chunk, fmt.n_centroids).block_bytes(head_dim)


def kind_geometry(fmt: KVFormat, kind: str, head_dim: int, layer: int | None = None) -> tuple[int, int]:
    """(code bytes per block, fp16 parameters per token) of K ("k") or V ("v") in one KV head's record.  The same
    for K and V but for a K/V pair (``KVFormat.kv``) and QJL, whose keys are sketches (qjl_key_block_bytes: larger in
    the first layers, so its pages need the layer)."""
    if fmt.mix:
        raise ValueError(f"{fmt.name} is laid out per layer as one of its parts ({', '.join(fmt.mix)}): resolve the "
                         "layer's part first (Artifact.layer_formats)")
    if get_method(fmt.method).post_rope_keys and kind == "k":  # QJL's keys: sketches, larger in the first layers
        if layer is None:
            raise ValueError(f"{fmt.name}'s key pages differ per layer: pass layer")
        return qjl_key_block_bytes(head_dim, layer), 0
    cl = fmt.part(kind).code_layout  # a K/V pair: that half's format
    return cl.block_bytes(head_dim), cl.scales_per_row(head_dim)


class PageLayout:
    """Byte offsets inside one (page, KV head) record; shared by the torch path and kernels.  ``layer``: for a
    format whose pages differ per layer (``KVFormat.per_layer_pages``: QJL).  ``exact_pages``: small pages - no
    region, the sinks and the incomplete block in exact pages of their own (above); ``bytes`` is then the record
    of both kinds of page."""

    def __init__(self, fmt: KVFormat, head_dim: int, block_size: int, outliers: bool = False,
                 window: int | None = None, num_kv_heads: int | None = None, layer: int | None = None,
                 exact_pages: bool = False):
        if block_size % BLOCK_TOKENS or block_size < 2 * BLOCK_TOKENS:
            raise ValueError(
                f"{fmt.name} needs a block size that is a multiple of {BLOCK_TOKENS} and at least "
                f"{2 * BLOCK_TOKENS}, got {block_size}"
            )
        self.fmt, self.head_dim, self.block_size, self.outliers = fmt, head_dim, block_size, outliers
        self.window = check_window(fmt.window if window is None else window, block_size)
        self.exact_pages = exact_pages
        if exact_pages and self.window:
            raise ValueError(f"{fmt.name}: small pages keep no recent window (the ring page holds one block)")
        self.ring = self.window + BLOCK_TOKENS
        self.region_slots = 0 if exact_pages else SINK_TOKENS + self.ring
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
        self.cap = outlier_cap(D, outliers) if outliers else 0
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
        self.exact_bytes = exact_record_bytes(D) if exact_pages else 0
        self.code_record_bytes = self.bytes
        if exact_pages:  # one page size for both groups
            self.bytes = max(self.bytes, self.exact_bytes)

    def ratio_vs_half(self) -> float:
        """Compression of one page against a bf16/fp16 page of the same tokens."""
        return self.block_size * 2 * self.head_dim * 2 / self.bytes

    def ring_slot(self, positions):
        """Region slot of tokens waiting to be encoded (positions >= SINK_TOKENS)."""
        return TAIL_SLOT0 + positions % self.ring
