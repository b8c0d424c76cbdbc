"""One layer's cache, built in one place: ``LayerCache.build``.

    format name -> the layer's part (a mixed format's per-layer choice; a K/V pair's halves)
               -> its page layout (layout.PageLayout: block size, outliers, recent window, KV heads, layer)
               -> its (K, V) quantizers (codebooks from the calibration artifact, or calibration-free)
               -> whether the C++ / Triton kernels can decode its pages, and why not (``kernel_blocker``)

The vLLM backend, the benchmarks and the tests all build layer caches here; the ops (ops/: the torch oracle, C++,
Triton) read one and never assemble one.  What a kernel may ask of a quantizer is declared by
``codecs.quantizer.Quantizer``.
"""

from __future__ import annotations

import dataclasses

import torch

from .codecs import calibration_free_quantizers, make_codec
from .codecs.quantizer import KVQuantizer, Quantizer
from .formats import KVFormat, get_format
from .layout import PageLayout
from .page_views import store_half
from .rope import Rope


@dataclasses.dataclass(frozen=True, eq=False)  # one layer's cache is itself: identity, hashable
class LayerCache:
    """Everything needed to read and write one layer's pages.  Build it with ``LayerCache.build``."""

    fmt: KVFormat  # the format this layer serves (a mixed format's part for this layer)
    layout: PageLayout
    k: Quantizer
    v: Quantizer
    rope: Rope | None  # the model's RoPE (None: a cache whose keys are never rotated here, e.g. a unit test's)
    dtype: torch.dtype  # the model's dtype: decoded K/V are rounded to it

    @classmethod
    def build(cls, fmt: str | KVFormat, layer: int, *, head_dim: int, block_size: int, dtype: torch.dtype,
              rope: Rope | None, num_kv_heads: int | None = None, artifact=None, outliers: bool = False,
              window: int | None = None, heads: list[int] | None = None,
              device: str | torch.device = "cpu", exact_pages: bool = False) -> "LayerCache":
        """Layer ``layer``'s cache for format ``fmt``.  ``artifact`` (artifact.Artifact): the codebooks of a
        calibrated format (required for one, ignored by the calibration-free ones); ``heads``: the KV heads this
        cache holds, in order (a tensor-parallel rank's; default all of the artifact's); ``num_kv_heads``: the
        KV heads of this cache's pages (TaDA's head-mean shares); ``window``: a recent window overriding the
        format's default; ``outliers``: exact outliers in the pages (codebook formats); ``exact_pages``: small pages
        (the sinks and the incomplete block in exact pages of their own, layout.py)."""
        layout = layer_layout(fmt, layer, head_dim=head_dim, block_size=block_size, artifact=artifact,
                              outliers=outliers, window=window, num_kv_heads=num_kv_heads, exact_pages=exact_pages)
        kq, vq = layer_quantizers(layout.fmt, layer, head_dim=head_dim, artifact=artifact, outliers=outliers,
                                  heads=heads, rope=rope, device=device)
        return cls(layout.fmt, layout, kq, vq, rope, dtype)

    def replace(self, **changes) -> "LayerCache":
        """The same layer cache with some fields changed (e.g. another dtype for a float32 reference)."""
        return dataclasses.replace(self, **changes)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def store_dtype(self) -> torch.dtype:
        """The half dtype of the stored exact values (sinks, tail, outliers, head means): ``page_views.store_half``."""
        return store_half(self.dtype)

    def exact(self, x: torch.Tensor) -> torch.Tensor:
        """New K/V as the cache will hold them (stored half values) in the model dtype: what a query
        of this step sees of its own block, exactly what a later step reads back from the tail."""
        if x.dtype == self.dtype == self.store_dtype:  # (a bf16 / fp16 model: as it is, without two dispatches)
            return x
        return x.to(self.store_dtype).to(self.dtype)

    @property
    def kernel_blocker(self) -> str | None:
        """Why the C++ / Triton kernels cannot decode this layer's pages whatever the device (None: they can;
        the device's own limits are ops.select's): they decode codebook codes of a kernel variant
        (``CodeLayout.kernel_variant``) from thesis pages (no recent window: they read the tail from one page)."""
        return self.blocker()

    def blocker(self, scaled: bool = False, window: bool = False, sketches: bool = False) -> str | None:
        """``kernel_blocker`` for kernels that can do more: ``scaled``, decode the selective formats', TaDA's and QJL's
        values' scaled integer codes (``CodeLayout.cpu_scaled``); ``window``, read a recent window's ring;
        ``sketches``, score QJL's post-RoPE key sketches (the C++ decode attention does all three)."""
        for kind, q in (("K", self.k), ("V", self.v)):
            cl = q.code_layout
            if cl is None and sketches and kind == "K" and q.post_rope:
                continue
            if cl is None or (cl.kernel_variant is None and not (scaled and cl.cpu_scaled)):
                return (f"the kernels decode codebook codes{' and scaled ones' if scaled else ''}; "
                        f"{self.fmt.name}'s {kind} are " + ("sketches" if cl is None else "scaled integer codes"))
        if self.layout.window and not window:
            return "the kernels serve codebook codes without a recent window"
        if not self.k.outliers == self.layout.outliers == self.v.outliers:
            return "the quantizers' outliers differ from the page layout's"
        return None


def layer_format(fmt: str | KVFormat, layer: int, artifact=None) -> KVFormat:
    """The format serving layer ``layer``: a mixed format's part there (the artifact's per-layer choice, mixed.py),
    else the format itself."""
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    if not f.mix:
        return f
    if artifact is None:
        raise ValueError(f"{f.name} chooses each layer's part from a calibration artifact: pass artifact")
    return get_format(artifact.layer_formats(f.name)[layer])


def layer_layout(fmt: str | KVFormat, layer: int, *, head_dim: int, block_size: int, artifact=None,
                 outliers: bool = False, window: int | None = None, num_kv_heads: int | None = None,
                 exact_pages: bool = False) -> PageLayout:
    """Layer ``layer``'s page layout (what its KV spec tells vLLM before any cache exists; ``LayerCache.build``'s
    layout): its format's (``layer_format``), with the serving options."""
    return PageLayout(layer_format(fmt, layer, artifact), head_dim, block_size, outliers, window,
                      num_kv_heads=num_kv_heads, layer=layer, exact_pages=exact_pages)


def layer_quantizers(fmt: str | KVFormat, layer: int, *, artifact=None, head_dim: int | None = None,
                     outliers: bool = False, heads: list[int] | None = None, methods: dict[str, list[str]] | None = None,
                     rope: Rope | None = None, device: str | torch.device = "cpu") -> tuple[Quantizer, Quantizer]:
    """The (K, V) quantizers of one layer: for a calibrated format the artifact's codebooks and statistics (a mixed
    format: its part for this layer; a K/V pair: each half's; ``methods`` overrides the hybrid's per-layer
    chunking, {"k": [...], "v": [...]} - the pure-temporal ablation; ``heads``: a tensor-parallel rank's KV heads),
    else the calibration-free ones (QJL's depend on the layer and ``head_dim``; ``rope`` lets its key quantizer's
    ``fake_quant`` take pre-RoPE keys)."""
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    if not f.needs_calibration:
        return calibration_free_quantizers(f, head_dim=head_dim, layer=layer, rope=rope)
    if artifact is None:
        raise ValueError(f"{f.name} is served from a calibration artifact: pass artifact")
    f = layer_format(f, layer, artifact)
    pair = []
    for kv in ("k", "v"):
        method, books, stats = artifact.codebook(f, layer, kv, heads, methods[kv][layer] if methods else None)
        part = f.part(kv)
        pair.append(KVQuantizer(make_codec(method, part.chunk, part.n_centroids, books.to(device)), stats.to(device),
                                outliers))
    return pair[0], pair[1]


def model_quantizers(fmt: str | KVFormat, artifact, **options) -> list[tuple[Quantizer, Quantizer]]:
    """``layer_quantizers`` of every layer of the artifact's model."""
    return [layer_quantizers(fmt, layer, artifact=artifact, **options) for layer in range(artifact.num_layers)]
