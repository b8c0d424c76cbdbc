"""The vLLM attention backend for the vector-quantized formats (Backend / MetadataBuilder / Impl).

Pages: one byte record per (page, KV head) as described in ``vllm_temporalkv.layout`` - codes for
whole blocks of 8 tokens, and a half-precision region for the sequence's 8 sink tokens (page 0)
and its incomplete newest block (the page that holds it).  ``customize_spec`` tells vLLM the
record size, so its block manager and its reported KV capacity see the true bytes per token.

A step: attention first - each request's cached context is read back from its pages, and its new
tokens attend to themselves exactly (fresh K/V) - then the new tokens are written (sinks / tail,
and a block is un-RoPE'd and encoded the moment its 8th token arrives).  Attending first matters:
writing a step's tokens can reuse the tail slots the context still needs.

The torch path (kernels/reference.py) runs everywhere; on CUDA the Triton kernels replace it when
they are available (kernels/triton_*.py), with the torch path as fallback and test oracle.
"""

from __future__ import annotations

import dataclasses
import re
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

from ..formats import BLOCK_TOKENS, FORMATS, get_format
from ..kernels import reference
from ..layout import PageLayout
from ..rope import Rope
from . import compat
from .plugin import DEFAULT_BLOCK_SIZE, TemporalKVConfigError, load_artifact, serving_options


class TemporalKVBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True  # so the step can attend before it writes
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
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

    @classmethod
    def customize_spec(cls, spec):
        # runs outside the config context: the layers' Impls recorded the options at model init
        if not _ACTIVE:
            raise TemporalKVConfigError("the vllm-temporalkv backend was asked for a KV spec before any layer was built")
        layout = PageLayout(get_format(_ACTIVE["format"]), spec.head_size, spec.block_size, _ACTIVE["outliers"])
        return compat.customize_spec(spec, block_size=spec.block_size, record_bytes=layout.bytes,
                                     num_heads=spec.num_kv_heads)


@dataclasses.dataclass
class TemporalKVMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [R + 1] (host)
    seq_lens: torch.Tensor  # [R] cached + new tokens (host)
    block_table: torch.Tensor  # [R, max pages]
    positions: torch.Tensor  # [num_actual_tokens]
    page_ids: torch.Tensor  # [num_actual_tokens]


class TemporalKVMetadataBuilder(AttentionMetadataBuilder[TemporalKVMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TemporalKVMetadata:
        cam = common_attn_metadata
        n = cam.num_actual_tokens
        qsl = cam.query_start_loc_cpu.long()
        seq = cam.seq_lens.cpu().long()
        qlen = qsl[1:] - qsl[:-1]
        req = torch.repeat_interleave(torch.arange(len(qlen)), qlen)[:n]
        # a request's new tokens are the last qlen positions of its sequence
        positions = (seq - qlen)[req] + (torch.arange(n) - qsl[:-1][req])
        bt = cam.block_table_tensor
        page_ids = bt[req.to(bt.device), (positions // self.block_size).to(bt.device)]
        return TemporalKVMetadata(n, qsl, seq, bt, positions.to(bt.device), page_ids)


_ACTIVE: dict = {}  # this process's serving options, recorded while the model is built
_CACHES: dict = {}  # (format, outliers, block size, device) -> every layer's LayerCache


def _layer_caches(setup: dict, device: torch.device) -> list[reference.LayerCache]:
    """All layers' LayerCache for this process (built once, shared by the layers' Impls)."""
    key = (setup["format"], setup["outliers"], setup["block_size"], str(device))
    if key not in _CACHES:
        art, f = setup["artifact"], get_format(setup["format"])
        rope = Rope(setup["hf_config"], device)
        layout = PageLayout(f, art.fingerprint["head_dim"], setup["block_size"], setup["outliers"])
        _CACHES[key] = [reference.LayerCache(f, layout, kq, vq, rope, setup["dtype"])
                        for kq, vq in art.quantizers(f.name, outliers=setup["outliers"], device=device)]
    return _CACHES[key]


_LAYER_RE = re.compile(r"layers\.(\d+)\.")


class TemporalKVImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs) -> None:
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("ALiBi")
        if sliding_window is not None:
            unsupported.append("sliding-window attention")
        if logits_soft_cap:
            unsupported.append("logit soft-capping")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"{attn_type} attention")
        if kv_sharing_target_layer_name is not None:
            unsupported.append("KV sharing across layers")
        if kwargs.get("sinks") is not None:
            unsupported.append("learned attention-sink logits")
        if unsupported:
            raise TemporalKVConfigError(f"--kv-cache-dtype {kv_cache_dtype}: {', '.join(unsupported)} not supported")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        cfg = get_current_vllm_config()
        opts = serving_options(cfg)
        # everything later steps need, captured while the config is current (forward runs without)
        self._batch_invariant = opts["batch_invariant"]
        self._setup = dict(format=kv_cache_dtype, outliers=opts["outliers"], block_size=cfg.cache_config.block_size,
                           dtype=cfg.model_config.dtype, hf_config=cfg.model_config.hf_config,
                           artifact=load_artifact(cfg))
        _ACTIVE.update(format=kv_cache_dtype, outliers=opts["outliers"])
        self._lc: reference.LayerCache | None = None

    def _layer_cache(self, layer, device) -> reference.LayerCache:
        if self._lc is None:
            m = _LAYER_RE.search(getattr(layer, "layer_name", ""))
            if m is None:
                raise TemporalKVConfigError(f"cannot tell the layer index of attention layer {layer!r}")
            self._lc = _layer_caches(self._setup, device)[int(m.group(1))]
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
        pages = compat.pages_view(kv_cache)
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        reference.paged_attention(lc, pages, q, k, v, m.query_start_loc, m.seq_lens, m.block_table,
                                  self.scale, out=out, batch_invariant=self._batch_invariant)
        reference.write_kv(lc, pages, k, v, m.positions, m.page_ids)
        return output
