"""Page layout arithmetic and code packing; RoPE tables against transformers' own."""

import pytest
import torch

from vllm_temporalkv.formats import FORMATS, get_format
from vllm_temporalkv.layout import PageLayout, bits_per_float
from vllm_temporalkv.page_views import (codes_view, outlier_views, pack_block_codes, region_view, scales_view,
                                        unpack_block_codes)
from vllm_temporalkv.rope import Rope


# QJL: test_qjl_served; K/V pairs: test_kv_pairs
@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if not f.per_layer_pages and not f.kv])
def test_pack_roundtrip_and_page_bytes(name):
    f = get_format(name)
    H, D = 3, 64
    rows = {"temporal": 16 // f.chunk, "channel": 16}.get(f.method, 16)
    width = {"channel": D // f.chunk}.get(f.method, D)
    codes = torch.randint(0, f.n_centroids, (rows, H, width), dtype=torch.uint8)
    packed = pack_block_codes(f.code_layout, codes)
    lay = PageLayout(f, D, 128, window=0, num_kv_heads=H)
    assert packed.shape == (2, H, lay.code_bytes)
    assert torch.equal(unpack_block_codes(f.code_layout, packed, D), codes)
    # bytes per page: codes at the nominal rate, + fp16 parameters per token (selective: a scale; TaDA: a scale
    # and a min) + TaDA's per-token head mean, this head's ceil(64 / 3) = 22 channels of it, + a fixed 16-token
    # half-precision region
    scales = 2 * 128 * 2 * {"selective": 1, "tada": 2}.get(f.method, 0)
    mean = 2 * 128 * 22 * 2 if f.method == "tada" else 0
    assert lay.bytes == 16 * 2 * D * 2 + 2 * 128 * D * f.nominal_bits // 8 + scales + mean
    extra = (scales + mean) * 8 / (2 * 128 * D)
    assert lay.ratio_vs_half() == pytest.approx(16 / (f.nominal_bits + 16 * 16 / 128 + extra), rel=1e-9)
    assert bits_per_float(f, D, 10**9, window=0, num_kv_heads=H)["total"] == pytest.approx(f.nominal_bits + extra,
                                                                                          rel=1e-6)
    # a recent window adds its tokens to every page's region
    if f.window:
        assert (PageLayout(f, D, 1024, num_kv_heads=H).bytes
                == PageLayout(f, D, 1024, window=0, num_kv_heads=H).bytes + f.window * 2 * D * 2)


def test_views_do_not_overlap():
    lay = PageLayout(get_format("temporalkv-2bit"), 64, 128, outliers=True)
    pages = torch.zeros(2, 3, lay.bytes, dtype=torch.uint8)
    region_view(lay, pages, torch.bfloat16).fill_(1.0)
    codes_view(lay, pages, "k").fill_(2)
    codes_view(lay, pages, "v").fill_(3)
    for kind, (a, b) in (("k", (4, 5.0)), ("v", (6, 7.0))):
        i, v = outlier_views(lay, pages, kind, torch.bfloat16)
        i.fill_(a)
        v.fill_(b)
    assert (region_view(lay, pages, torch.bfloat16) == 1.0).all()
    assert (codes_view(lay, pages, "k") == 2).all() and (codes_view(lay, pages, "v") == 3).all()
    assert (outlier_views(lay, pages, "k", torch.bfloat16)[0] == 4).all()
    sel = PageLayout(get_format("selective-int4"), 64, 256)  # window ring, codes, scales
    pages = torch.zeros(2, 3, sel.bytes, dtype=torch.uint8)
    region_view(sel, pages, torch.bfloat16).fill_(1.0)
    for kind, c, f in (("k", 2, 3.0), ("v", 4, 5.0)):
        codes_view(sel, pages, kind).fill_(c)
        scales_view(sel, pages, kind).fill_(f)
    assert (region_view(sel, pages, torch.bfloat16) == 1.0).all() and (codes_view(sel, pages, "k") == 2).all()
    assert (scales_view(sel, pages, "k") == 3.0).all() and (scales_view(sel, pages, "v") == 5.0).all()
    assert sel.v_scales + sel.blocks * sel.scale_bytes <= sel.bytes


def test_bits_accounting():
    b = bits_per_float(get_format("temporalkv-2bit"), 64, 2048, outliers=True)
    assert b["codes"] < 2 and b["sinks"] == pytest.approx(16 * 8 / 2048)
    assert b["outliers"] == pytest.approx(5 * 32 / 512 * (2048 - 8 - 3.5) / 2048)
    assert b["total"] == pytest.approx(sum(v for k, v in b.items() if k != "total"))


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 1e5},
                                  {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      rope_parameters=rope, max_position_embeddings=131072)
    pos = torch.tensor([0, 1, 7, 8, 1000, 70000])
    k = torch.randn(len(pos), 2, 64)
    cos, sin = LlamaRotaryEmbedding(cfg)(k, pos[None])
    _, ref = apply_rotary_pos_emb(k.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    r = Rope(cfg)
    assert torch.allclose(r.apply(k, pos), ref[0].transpose(0, 1), atol=1e-5)
    assert torch.allclose(r.invert(r.apply(k, pos), pos), k, atol=1e-5)


def test_kernel_variant_follows_the_geometry():
    """The C++ and Triton kernels pick their code path from a CodeLayout's geometry, not from a method's name:
    a new method laid out like an existing one runs on the same kernels; scaled integer codes have no variant (the
    C++ kernels decode the selective formats' by their own rule, CodeLayout.cpu_scaled)."""
    from vllm_temporalkv.methods import CodeLayout

    assert CodeLayout("new-token-vq", 4, 1, 4, 256).kernel_variant == get_format("temporalkv-2bit").code_layout.kernel_variant
    assert CodeLayout("new-channel-vq", 1, 2, 2, 256).kernel_variant == get_format("channelkv-4bit").code_layout.kernel_variant
    assert CodeLayout("new-scalar", 1, 1, 1, 4).kernel_variant == get_format("kvquant-2bit").code_layout.kernel_variant
    assert len({get_format(f).code_layout.kernel_variant for f in ("temporalkv-1bit", "channelkv-1bit", "kvquant-1bit")}) == 3
    assert get_format("selective-int8").code_layout.kernel_variant is None
    assert CodeLayout("tokens-sharing-wider-groups", 2, 1, 8, 256).kernel_variant is None  # no kernel for it


@pytest.mark.parametrize("fmt,head_dim,phrase", [
    ("temporalkv-2bit", 66, "does not divide head_dim=66"),
    ("selective-int4", 63, "divisible by 2"),
    ("tada-2bit", 66, "divisible by 4"),
    ("tada-4bit", 192, "multiple of 128"),
])
def test_head_dims_a_format_cannot_serve_are_refused(fmt, head_dim, phrase):
    """A model whose head size a format cannot lay out is refused with the reason (the backend's
    supports_combination says the same to vLLM's selector); the sizes it can serve pass."""
    from vllm_temporalkv.formats import FormatError, check_head_dim

    with pytest.raises(FormatError, match=phrase):
        check_head_dim(get_format(fmt), head_dim)
    for ok in (64, 128, 256):
        check_head_dim(get_format(fmt), ok)
