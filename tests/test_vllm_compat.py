"""vLLM-version differences (vllm/compat.py) that CI's vLLM 0.32 does not take by itself.

vLLM 0.26 (the GPU box's release) has no ``customize_spec`` hook: a page's size comes from the spec's
``real_page_size_bytes`` and the backend's ``get_kv_cache_shape`` views the allocation.  Here the 0.26
branch runs against 0.32's spec classes: the spec our layers hand vLLM, the view of its pages, and that
the two agree byte for byte.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from vllm_temporalkv.formats import get_format  # noqa: E402
from vllm_temporalkv.layout import PageLayout  # noqa: E402
from vllm_temporalkv.vllm import backend, compat  # noqa: E402
from vllm_temporalkv.vllm.options import TemporalKVConfigError  # noqa: E402


def full_spec(block_size=1024, heads=3, head_size=64):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.uint8)


class FakeLayer:
    """What describe_spec reads of vLLM's Attention layer: its name (the decoder-layer index)."""

    def __init__(self, index):
        self.layer_name = f"model.layers.{index}.self_attn.attn"


def record_of(fmt, outliers=False):
    def record_bytes_of(layer, index, spec):
        return PageLayout(get_format(fmt), spec.head_size, spec.block_size, outliers, 0,
                          num_kv_heads=spec.num_kv_heads, layer=index).bytes
    return record_bytes_of


@pytest.fixture
def records(monkeypatch):
    """The 0.26 shape registry, empty for the test."""
    r = {}
    monkeypatch.setattr(compat, "_RECORDS", r)
    return r


@pytest.mark.parametrize("fmt,outliers", [("temporalkv-2bit", False), ("temporalkv-1bit", True),
                                          ("kvquant-2bit", False)])
def test_vllm026_pages_are_sized_and_viewed_as_one_record_per_head(records, fmt, outliers):
    spec = full_spec()
    lay = PageLayout(get_format(fmt), spec.head_size, spec.block_size, outliers, 0, num_kv_heads=spec.num_kv_heads)
    out = compat.describe_spec(spec, FakeLayer(4), record_of(fmt, outliers), record_pages=True)
    assert isinstance(out, compat.RecordPageSpec) and isinstance(out, FullAttentionSpec)
    assert out.real_page_size_bytes == spec.num_kv_heads * lay.bytes and compat.spec_layer(out) == 4
    # far smaller than the half-precision page vLLM would size for these heads
    assert out.real_page_size_bytes * 3 < 2 * spec.block_size * spec.num_kv_heads * spec.head_size * 2
    # the same fields otherwise (vLLM's merge and grouping compare them)
    for f in dataclasses.fields(spec):
        assert getattr(out, f.name) == getattr(spec, f.name), f.name
    # the view of n pages covers exactly the bytes vLLM allocates for them, in the layout the kernels read
    n = 5
    shape = backend.TemporalKVBackend.get_kv_cache_shape(n, spec.block_size, spec.num_kv_heads, spec.head_size, fmt)
    assert shape == (n, spec.num_kv_heads, lay.bytes)
    raw = torch.zeros(n * out.real_page_size_bytes, dtype=torch.uint8)
    assert compat.pages_view(raw.view(shape)).shape == (n, spec.num_kv_heads, lay.bytes)


def test_vllm026_record_specs_merge_only_when_equal(records):
    a = compat.describe_spec(full_spec(), FakeLayer(0), lambda *_: 1000, record_pages=True)
    b = compat.describe_spec(full_spec(), FakeLayer(1), lambda *_: 1000, record_pages=True)
    merged = compat.RecordPageSpec.merge([a, b])
    assert merged.record_bytes == 1000 and merged.real_page_size_bytes == 3000
    c = dataclasses.replace(b, record_bytes=2000)
    # AssertionError: vLLM's "not uniform" signal (it then keeps one spec per layer), also beside a plain layer
    with pytest.raises(AssertionError, match="different page records"):
        compat.RecordPageSpec.merge([a, c])
    with pytest.raises(AssertionError, match="different page records"):
        compat.RecordPageSpec.merge([a, full_spec()])


def test_vllm026_refuses_what_it_cannot_size(records):
    with pytest.raises(TemporalKVConfigError, match="before any layer described them"):
        backend.TemporalKVBackend.get_kv_cache_shape(4, 1024, 3, 64, "auto")


def test_each_layer_sizes_its_own_pages():
    """0.27+: the spec a layer hands vLLM carries its own record (from its Impl: this engine's format and options),
    which customize_spec sizes; equal records stay one spec (one builder), a spec no layer of ours described is
    refused with the fix."""
    a2 = compat.describe_spec(full_spec(), FakeLayer(0), record_of("temporalkv-2bit"), record_pages=False)
    b2 = compat.describe_spec(full_spec(), FakeLayer(7), record_of("temporalkv-2bit"), record_pages=False)
    a4 = compat.describe_spec(full_spec(), FakeLayer(0), record_of("temporalkv-4bit"), record_pages=False)
    assert compat.spec_layer(b2) == 7 and compat.spec_record_bytes(a4) > compat.spec_record_bytes(a2) > 0
    assert a2 == b2 and hash(a2) == hash(b2)
    if not compat.HAS_CUSTOMIZE_SPEC:
        pytest.skip("vLLM < 0.27 has no customize_spec hook")
    s2, t2, s4 = (backend.TemporalKVBackend.customize_spec(s) for s in (a2, b2, a4))
    assert s2 == t2 and s2 != s4
    assert s4.page_size_bytes == 3 * compat.spec_record_bytes(a4)
    assert s2.page_size_bytes == 3 * compat.spec_record_bytes(a2)
    with pytest.raises(TemporalKVConfigError, match="no vllm-temporalkv attention layer described"):
        backend.TemporalKVBackend.customize_spec(full_spec())


def test_current_vllm_keeps_its_own_hook():
    """On 0.27+ the spec keeps vLLM's class (customize_spec sizes it)."""
    if not compat.HAS_CUSTOMIZE_SPEC:
        pytest.skip("vLLM < 0.27")
    out = compat.customize_spec(full_spec(), block_size=1024, record_bytes=1000, num_heads=3)
    assert not isinstance(out, compat.RecordPageSpec)


def test_host_seq_lens_without_a_device_copy():
    """The builder's host seq_lens: vLLM's host upper bound (exact without speculative decoding) when it covers the
    step's requests, else a copy of the device tensor."""
    from types import SimpleNamespace

    class NoCopy(torch.Tensor):
        def cpu(self):  # the device copy the upper bound spares
            raise AssertionError("copied")

    dev = torch.tensor([5, 9, 0], dtype=torch.int32).as_subclass(NoCopy)
    ub = torch.tensor([5, 9, 0, 7], dtype=torch.int32)
    got = compat.host_seq_lens(SimpleNamespace(seq_lens=dev, seq_lens_cpu_upper_bound=ub), 3)
    assert got.tolist() == [5, 9, 0] and got.dtype == torch.int64
    plain = torch.tensor([5, 9], dtype=torch.int32)
    assert compat.host_seq_lens(SimpleNamespace(seq_lens=plain, seq_lens_cpu_upper_bound=None), 2).tolist() == [5, 9]
    assert compat.host_seq_lens(SimpleNamespace(seq_lens=plain, seq_lens_cpu_upper_bound=ub[:1]), 2).tolist() == [5, 9]
