"""The vLLM attention backend for the vector-quantized formats (Backend / MetadataBuilder / Impl).

Pages: one byte record per (page, KV head) as described in ``vllm_temporalkv.layout`` - codes for
whole blocks of 8 tokens, and a half-precision region for the sequence's 8 sink tokens (page 0)
and its incomplete newest block (the page that holds it).  ``customize_spec`` tells vLLM the
record size, so its block manager and its reported KV capacity see the true bytes per token.

A step (``ops.*.forward``): attention first - each request's cached context is read back from its
pages, and its new tokens attend to themselves exactly (fresh K/V) - then the new tokens are written
(sinks / tail, and a block is un-RoPE'd and encoded the moment its 8th token arrives).  Attending
first matters: writing a step's tokens can reuse the tail slots the context still needs (the C++
path writes a prefill chunk first, having read those slots, so that its blocks are encoded once).

``ops.select`` picks the kernels per layer: the C++ kernels of csrc/ on the CPU (ops/cpu.py), the Triton
kernels on CUDA (ops/triton_path.py: decodes in one Triton launch, prefill chunks on the torch attention, the
store by the Triton encoder; on the CPU too, in Triton's interpreter, when ``VLLM_TEMPORALKV_OPS=triton``), and
the torch path (ops/paged_torch.py: the oracle) as the fallback.  A uniform decode step on the Triton path reads
only device tensors and skips padded rows (what a CUDA graph replays); not yet: claiming CUDA graph support (see
benchmarks/gpu/NOTES.md), a Triton prefill kernel (issue "The CUDA path for real").
"""

from __future__ import annotations

import dataclasses
import time
from typing import ClassVar

import torch

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from .. import ops
from ..cache import LayerCache, layer_layout
from ..formats import BLOCK_TOKENS, FORMATS, FormatError, check_head_dim, get_format
from ..layout import PageLayout
from ..page_views import exact_view
from ..rope import Rope
from ..ops.paged_torch import ExactPages
from ..ops.triton_path import padding_requests
from . import compat
from .options import DEFAULT_BLOCK_SIZE, SMALL_BLOCK_SIZE, TemporalKVConfigError, load_artifact, logger, serving_options


class TemporalKVBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True  # so the step can attend before it writes
    # float32: CPUs without bf16 units (AVX2) run a small model ~4x faster in float32 than in bf16;
    # the cache then stores its exact values (sinks, tail, outliers) in bfloat16
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = list(FORMATS)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM maps the name back to AttentionBackendEnum.CUSTOM

    @staticmethod
    def get_impl_cls() -> type["TemporalKVImpl"]:
        return TemporalKVImpl

    @staticmethod
    def get_builder_cls() -> type["TemporalKVMetadataBuilder"]:
        return TemporalKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        # a page is one record per head: the kernel block must be the whole manager block
        return [MultipleOf(BLOCK_TOKENS)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return DEFAULT_BLOCK_SIZE

    # ---- what the backend serves: vLLM's own validation hooks, and ours through them ----------
    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or (block_size % BLOCK_TOKENS == 0 and block_size >= 2 * BLOCK_TOKENS)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                             use_sparse, use_mm_prefix, device_capability) -> str | None:
        if kv_cache_dtype not in FORMATS:
            return None
        try:
            check_head_dim(get_format(kv_cache_dtype), head_size)
        except FormatError as e:
            return str(e)
        return None

    @classmethod
    def refusal(cls, selector_config) -> str | None:
        """Why this backend cannot serve a layer (vLLM's AttentionSelectorConfig), as one message
        naming the fix, or None. The one place layer-level support is decided."""
        reasons = compat.validate_backend_configuration(cls, selector_config)
        if not reasons:
            return None
        fixes = {
            "block_size not supported": f"--block-size must be a multiple of {BLOCK_TOKENS} and at least "
                                        f"{2 * BLOCK_TOKENS} (leave it out: small pages on the CPU, {SMALL_BLOCK_SIZE} "
                                        f"tokens or 128 for 1-bit codes; else {DEFAULT_BLOCK_SIZE})",
            "dtype not supported": f"the model runs in {str(selector_config.dtype).removeprefix('torch.')}; "
                                   "use --dtype bfloat16, float16 or float32",
        }
        return "; ".join(fixes.get(r, r) for r in reasons)

    @classmethod
    def customize_spec(cls, spec):
        # the layer's own Impl described its record (compat.describe_layer_pages): nothing process-wide to guess
        record = compat.spec_record_bytes(spec)
        if not record:
            raise TemporalKVConfigError("vLLM asked the vllm-temporalkv backend to size a KV spec that no "
                                        "vllm-temporalkv attention layer described (is the plugin registered in "
                                        "this process? vllm.general_plugins entry point 'temporalkv')")
        return compat.customize_spec(spec, block_size=spec.block_size, record_bytes=record,
                                     num_heads=spec.num_kv_heads)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """vLLM 0.26 views a layer's pages through this (compat.RecordPageSpec sized them):
        [pages, KV heads, record bytes], uint8."""
        record = compat.described_record_bytes(block_size, num_kv_heads, head_size)
        if record is None:
            raise TemporalKVConfigError(f"vLLM asked for the shape of vllm-temporalkv pages ({num_kv_heads} KV heads "
                                        f"of {head_size}, block {block_size}) before any layer described them")
        return (num_blocks, num_kv_heads, record)

    @staticmethod
    def exact_backend() -> type["TemporalKVExactBackend"]:
        """The backend of the exact pages' group under small pages (compat.ExactSlotsLayer)."""
        return TemporalKVExactBackend


class TemporalKVExactBackend(TemporalKVBackend):
    """The exact pages' group under small pages (compat.ExactSlotsLayer): no attention of its own; its builder hands
    the attention layers each step's block table of the group, [request, (sink page, ring page)]."""

    @staticmethod
    def get_builder_cls() -> type["TemporalKVExactBuilder"]:
        return TemporalKVExactBuilder

    @classmethod
    def customize_spec(cls, spec):
        return spec  # sized by ExactSlotsLayer.get_kv_cache_spec


@dataclasses.dataclass
class ExactMetadata:
    block_table: torch.Tensor  # [R, >= 2]: (sink page, ring page) per request


class TemporalKVExactBuilder(AttentionMetadataBuilder[ExactMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.reorder_batch_threshold = 1  # as the code pages' builder

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> ExactMetadata | None:
        cam = common_attn_metadata
        sm = getattr(cam, "slot_mapping", None)
        if sm is not None and sm.numel() and int(sm[0]) < 0:  # a dummy batch (TemporalKVMetadataBuilder.build)
            return None
        return ExactMetadata(cam.block_table_tensor[: cam.num_reqs])


@dataclasses.dataclass
class TemporalKVMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [R + 1] (host)
    seq_lens: torch.Tensor  # [R] cached + new tokens (host)
    block_table: torch.Tensor  # [R, max pages]
    positions: torch.Tensor  # [num_actual_tokens]
    page_ids: torch.Tensor  # [num_actual_tokens]
    device_seq_lens: torch.Tensor | None = None  # vLLM's device copy of seq_lens (the requests' rows)
    block_size: int | None = None  # tokens per page (the Triton path finds a decode's page on the device)
    _plans: dict = dataclasses.field(default_factory=dict)  # (device, ops module) -> its StepPlan, once per step

    def plan(self, device, ops_module=None):
        """The step plan of a path's ops (``ops_module.plan_step``: the Triton / CUDA path's - which requests decode,
        their device tensors - or the C++ CPU path's host lists and int32 tables; default the Triton path's): built
        by the first layer that asks, shared by the others (the metadata object is the step's, for every layer)."""
        if ops_module is None:
            from ..ops import triton_path as ops_module
        key = (device, ops_module)  # (not str(device): every layer of every step asks)
        if key not in self._plans:
            self._plans[key] = ops_module.plan_step(self.query_start_loc, self.seq_lens, device,
                                                    self.block_table.device, self.device_seq_lens,
                                                    self.block_table, self.block_size)
        return self._plans[key]


ENV_CUDA_GRAPHS = "VLLM_TEMPORALKV_CUDA_GRAPHS"


def cuda_graphs_ok(vllm_config: VllmConfig, kv_cache_spec) -> bool:
    """Whether decode steps may be captured in full CUDA graphs: opted in, on CUDA, and where the GPU decode (not
    the torch path) serves every layer - what ops.select picks for a half-precision model with 64 / 128 / 256-dim
    heads, no recent window, no outliers, no small pages, not batch-invariant."""
    import os

    if os.environ.get(ENV_CUDA_GRAPHS) != "1" or os.environ.get(ops.ENV_PATH, "").lower() == "torch":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False
    opts = serving_options(vllm_config)
    return (vllm_config.model_config.dtype in (torch.bfloat16, torch.float16)
            and getattr(kv_cache_spec, "head_size", None) in (64, 128, 256)
            and not (opts["batch_invariant"] or opts["window"] or opts["outliers"] or opts["small_pages"]))


class TemporalKVMetadataBuilder(AttentionMetadataBuilder[TemporalKVMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    _capturing = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # decodes first (vLLM reorders the batch): a mixed step's decodes are one slice of rows for the Triton path
        self.reorder_batch_threshold = 1

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """Full CUDA graphs of decode-only steps, opt-in (VLLM_TEMPORALKV_CUDA_GRAPHS=1) until a GPU has checked
        them (benchmarks/gpu/NOTES.md: greedy text with graphs = without): where the GPU decode serves (CUDA or
        Triton: half-precision model, head size 64 / 128 / 256, no recent window, not batch-invariant), a uniform
        decode step reads only device tensors and skips padding rows; anything else keeps attention eager."""
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if cuda_graphs_ok(vllm_config, kv_cache_spec) \
            else AttentionCGSupport.NEVER

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> TemporalKVMetadata:
        """vLLM captures with a dummy batch whose slots are padding (-1): build real metadata for it anyway (build
        returns none for an all-padding batch), its writes landing in the null block 0 as vLLM's own backends' do."""
        self._capturing = True
        try:
            return self.build(0, common_attn_metadata)
        finally:
            self._capturing = False

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TemporalKVMetadata:
        cam = common_attn_metadata
        # vLLM's dummy batches (kernel autotuning, warm-up sizes, idle data-parallel ranks) mark every slot as
        # padding (-1) and may reuse stale block-table rows: nothing to attend to, nothing to write
        sm = getattr(cam, "slot_mapping", None)
        if sm is not None and sm.numel() and int(sm[0]) < 0 and not self._capturing:
            return None
        qsl = cam.query_start_loc_cpu.long()
        n = min(cam.num_actual_tokens, int(qsl[-1]))  # padded batches (full CUDA graphs): padding is no request's
        qlen = qsl[1:] - qsl[:-1]
        seq = compat.host_seq_lens(cam, len(qlen))
        req = torch.repeat_interleave(torch.arange(len(qlen)), qlen)[:n]
        # a request's new tokens are the last qlen positions of its sequence
        positions = (seq - qlen)[req] + (torch.arange(n) - qsl[:-1][req])
        bt = cam.block_table_tensor
        page_ids = bt[req.to(bt.device), (positions // self.block_size).to(bt.device)]
        if bt.device.type == "cpu":  # the C++ writes take int64 (converted here once, not by every layer)
            page_ids = page_ids.long()
        if len(qlen) > n and bool(((qlen == 1) | padding_requests(qlen, seq)).all()):
            # a decode batch padded to a captured CUDA-graph size: one row per request, padding rows included (the
            # Triton path's uniform plan reads positions and pages from the device and skips seq_len 0); the host
            # positions / pages of the padding rows say "nothing" (-1) to any other path
            fill = torch.full((len(qlen) - n,), -1, dtype=positions.dtype)
            positions = torch.cat([positions, fill])
            page_ids = torch.cat([page_ids, fill.to(page_ids.device, page_ids.dtype)])
            n = len(qlen)
        return TemporalKVMetadata(n, qsl, seq, bt, positions.to(bt.device), page_ids,
                                  device_seq_lens=cam.seq_lens[: len(qlen)], block_size=self.block_size)


_LOGGED_PATHS: set[str] = set()


class TemporalKVImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs) -> None:
        # what vLLM's selector config does not carry (the rest: TemporalKVBackend.refusal)
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("ALiBi")
        if logits_soft_cap:
            unsupported.append("logit soft-capping")
        if kv_sharing_target_layer_name is not None:
            unsupported.append("KV sharing across layers")
        if unsupported:
            raise TemporalKVConfigError(f"--kv-cache-dtype {kv_cache_dtype}: {', '.join(unsupported)} not supported")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        cfg = get_current_vllm_config()
        opts = serving_options(cfg)
        # everything later steps need, captured while the config is current (forward runs without)
        self._batch_invariant = opts["batch_invariant"]
        self._outliers = opts["outliers"]
        self._window = opts["window"]
        self._small_pages = opts["small_pages"]  # exact tokens in a second KV-cache group (compat.ExactSlotsLayer)
        self._block_size = cfg.cache_config.block_size
        self._dtype = cfg.model_config.dtype
        self._hf_config = cfg.model_config.hf_config
        self._artifact = load_artifact(cfg)  # immutable, cached per (path, model) in the process; None: not needed
        self._lc: LayerCache | None = None  # this layer's codebooks and page layout
        self._pages = None  # (vLLM's KV cache tensor of this layer, its pages view): built once
        self._exact_view = None  # small pages: (the companion's KV cache tensor, its exact-pages view)

    def page_layout(self, index: int, block_size: int | None = None) -> PageLayout:
        """Layer ``index``'s pages: a mixed format serves each layer as one of its parts (its codebooks, pages,
        kernels).  Also what this layer's KV spec tells vLLM (plugin._record_bytes)."""
        return layer_layout(self.kv_cache_dtype, index, head_dim=self.head_size,
                            block_size=block_size or self._block_size, artifact=self._artifact,
                            outliers=self._outliers, window=self._window, num_kv_heads=self.num_kv_heads,
                            exact_pages=self._small_pages)

    def _layer_cache(self, layer, device) -> LayerCache:
        """Built on the first forward, when the layer's name (hence its index) is known."""
        if self._lc is None:
            t0 = time.perf_counter()
            index = compat.layer_index(layer)
            # a tensor-parallel rank holds some of the KV heads: their codebooks, not the first ones
            heads = (None if self._artifact is None else
                     compat.local_kv_heads(self._artifact.fingerprint["num_kv_heads"], self.num_kv_heads))
            self._lc = LayerCache.build(self.kv_cache_dtype, index, head_dim=self.head_size,
                                        block_size=self._block_size, dtype=self._dtype,
                                        rope=Rope(self._hf_config, device), num_kv_heads=self.num_kv_heads,
                                        artifact=self._artifact, outliers=self._outliers, window=self._window,
                                        heads=heads, device=device, exact_pages=self._small_pages)
            self._ops, path = ops.select(self._lc, device)
            self._step_plans = hasattr(self._ops, "plan_step")  # the path derives a step plan (once per step)
            if self._batch_invariant:
                path += ", batch-invariant float64 attention"
            if path not in _LOGGED_PATHS:  # once per process and path: says which kernels serve
                _LOGGED_PATHS.add(path)
                # with the first layer's set-up time (codebooks to the device, kernels built or loaded): where an
                # engine's start goes is otherwise invisible in vLLM's log
                logger.info("vllm-temporalkv %s: attention and cache update on the %s path (first layer set up in "
                            "%.1f s)", self.kv_cache_dtype, path, time.perf_counter() - t0)
        return self._lc

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by vllm-temporalkv")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        m: TemporalKVMetadata = attn_metadata
        n = m.num_actual_tokens
        lc = self._layer_cache(layer, kv_cache.device)
        if self._pages is None or self._pages[0] is not kv_cache:  # (vLLM's KV cache tensor: one per layer, kept)
            self._pages = (kv_cache, compat.pages_view(kv_cache))
        pages = self._pages[1]
        if query.shape[0] != n:  # (padded: the real tokens' rows)
            query, key, value, output = query[:n], key[:n], value[:n], output[:n]
        q = query.view(n, self.num_heads, self.head_size)
        k = key.view(n, self.num_kv_heads, self.head_size)
        v = value.view(n, self.num_kv_heads, self.head_size)
        out = output.view(n, self.num_heads, self.head_size)
        plan = m.plan(pages.device, self._ops) if self._step_plans else None  # once per step
        extra = {"exact": self._exact_pages(layer, lc)} if self._small_pages else {}
        self._ops.forward(lc, pages, q, k, v, m.query_start_loc, m.seq_lens, m.block_table, m.positions,
                          m.page_ids, self.scale, out=out, batch_invariant=self._batch_invariant, plan=plan, **extra)
        return output

    def _exact_pages(self, layer, lc: LayerCache):
        """Small pages: this step's view of the companion layer's exact pages and their block table."""
        got = compat.exact_metadata(layer)
        if got is None or got[1] is None:
            raise TemporalKVConfigError(f"{layer.layer_name}: small pages, but vLLM built no exact-page metadata for "
                                        "this step (is the hybrid KV-cache manager on?)")
        ecache, meta = got
        if self._exact_view is None or self._exact_view[0] is not ecache:
            # the companion's KV cache tensor is kept once allocated: its view built once, not per layer step
            self._exact_view = (ecache, exact_view(lc.layout, compat.pages_view(ecache), lc.store_dtype))
        return ExactPages(self._exact_view[1], meta.block_table)
