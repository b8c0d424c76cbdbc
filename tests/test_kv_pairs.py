"""K/V pairs (``KVFormat.kv``): keys served as one format, values as another - ``temporalkv-k4v2`` keeps keys at 4 bits
and values at 2, where issue 16's diagnosis found the 2-bit needle loss (the keys).  Served from the codebooks of
its parts; the records hold K and V codes of different sizes (the C++ kernels on them: test_cpu_kernels)."""

import pytest
import torch

from tests.helpers import CFG, synthetic_artifact
from vllm_temporalkv.cache import layer_quantizers
from vllm_temporalkv.artifact import Artifact, ArtifactError, model_fingerprint
from vllm_temporalkv.formats import FORMATS, FormatError, calibrated_formats, check_head_dim, get_format
from vllm_temporalkv.layout import PageLayout, bits_per_float

PAIR = "temporalkv-k4v2"
K, V = "temporalkv-4bit", "temporalkv-2bit"


def test_pair_format_is_its_halves():
    f = get_format(PAIR)
    assert f.kv == (K, V) and f.part("k") is FORMATS[K] and f.part("v") is FORMATS[V]
    assert f.calibrated_formats == [K, V] and PAIR not in calibrated_formats()  # nothing of its own to fit
    assert f.nominal_bits == 3 and get_format("temporalkv-k4v1").nominal_bits == 2.5
    with pytest.raises(ValueError, match="use part"):
        f.code_layout  # noqa: B018 - K and V differ: no one layout to misread
    check_head_dim(f, 64)
    with pytest.raises(FormatError, match="temporalkv-2bit groups 4 channels"):
        check_head_dim(f, 66)  # the value half's chunk does not divide it


@pytest.mark.parametrize("D,block", [(64, 16), (128, 1024)])
def test_pair_pages_and_bits(D, block):
    f = get_format(PAIR)
    lay, lk, lv = (PageLayout(get_format(n), D, block, True) for n in (PAIR, K, V))
    assert lay.kind_code_bytes == {"k": lk.kind_code_bytes["k"], "v": lv.kind_code_bytes["v"]}
    assert lay.kind_code_bytes["k"] == 2 * lay.kind_code_bytes["v"] and lay.code_bytes is None
    assert lay.bytes == pytest.approx((lk.bytes + lv.bytes) / 2, abs=16)  # everything else alike
    for ctx in (100, 10**6):
        b, bk, bv = (bits_per_float(get_format(n), D, ctx, True) for n in (PAIR, K, V))
        assert b["codes"] == pytest.approx((bk["codes"] + bv["codes"]) / 2)
        assert b["total"] == pytest.approx((bk["total"] + bv["total"]) / 2)
    assert bits_per_float(f, D, 10**9)["codes"] == pytest.approx(3.0, rel=1e-6)


def test_pair_quantizers_come_from_the_parts(tmp_path):
    art = synthetic_artifact(CFG, [K, V])
    art.layer_methods[V]["v"] = ["channel", "temporal"]  # V's hybrid choice differs from K's part's
    path = art.save(tmp_path / "a.safetensors")
    back = Artifact.load(path, expect=model_fingerprint(CFG), formats=[PAIR])
    for layer in range(back.num_layers):
        kq, vq = layer_quantizers(PAIR, layer, artifact=back)
        want_k, want_v = layer_quantizers(K, layer, artifact=back)[0], layer_quantizers(V, layer, artifact=back)[1]
        for got, want in ((kq, want_k), (vq, want_v)):
            assert got.codec.method == want.codec.method and got.codec.chunk == want.codec.chunk
            assert torch.equal(got.codec.centroids, want.codec.centroids)
        assert back.method_of(get_format(PAIR), layer, "v") == art.layer_methods[V]["v"][layer]
    assert back.centroid_bytes(PAIR) == (back.centroid_bytes(K) + back.centroid_bytes(V)) // 2
    # an artifact without one half: refused with the command that adds it
    only_k = synthetic_artifact(CFG, [K]).save(tmp_path / "k.safetensors")
    with pytest.raises(ArtifactError, match=f"no codebooks for {V} \\(a part of {PAIR}\\).*--formats {PAIR}"):
        Artifact.load(only_k, formats=[PAIR])
    with pytest.raises(ArtifactError, match=f"no codebooks for {V} \\(needed by {PAIR}\\).*--formats {V}"):
        layer_quantizers(PAIR, 0, artifact=Artifact.load(only_k))


def test_channel_values_pair(tmp_path):
    """``temporalkv-2bit-cv``: the hybrid's 2-bit keys, ChannelKV's 2-bit values (the same channel codebooks the
    hybrid holds) - in every layer, whatever the hybrid chose for the values; the same pages as temporalkv-2bit."""
    f = get_format("temporalkv-2bit-cv")
    assert f.calibrated_formats == ["temporalkv-2bit", "channelkv-2bit"] and f.nominal_bits == 2
    art = synthetic_artifact(CFG, f.calibrated_formats)
    art.layer_methods["temporalkv-2bit"]["v"] = ["temporal"] * art.num_layers  # the hybrid's values: temporal
    back = Artifact.load(art.save(tmp_path / "a.safetensors"), formats=[f.name])
    for layer in range(back.num_layers):
        kq, vq = layer_quantizers(f, layer, artifact=back)
        hk = layer_quantizers("temporalkv-2bit", layer, artifact=back)[0]
        cv = layer_quantizers("channelkv-2bit", layer, artifact=back)[1]
        assert vq.codec.method == "channel" and torch.equal(vq.codec.centroids, cv.codec.centroids)
        assert kq.codec.method == hk.codec.method and torch.equal(kq.codec.centroids, hk.codec.centroids)
    for D in (64, 128):
        assert PageLayout(f, D, 1024, True).bytes == PageLayout(get_format("temporalkv-2bit"), D, 1024, True).bytes
