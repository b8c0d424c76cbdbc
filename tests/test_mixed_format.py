"""temporalkv-2bit-mixed: each layer served as temporalkv-4bit, -2bit or -1bit, chosen from the calibration's
per-layer Fisher estimate of the loss increase (``hybrid.<part>.cost``) under a 2-bit average (TaDA's search,
seed 004, applied to TemporalKV's chunk lengths).  The artifact side: the choice, its refusals, the quantizers and
pages it gives; the server side is in test_vllm_server."""

import pytest
import torch

from tests.helpers import CFG, synthetic_artifact
from vllm_temporalkv.cache import layer_quantizers
from vllm_temporalkv.artifact import Artifact, ArtifactError
from vllm_temporalkv.formats import get_format
from vllm_temporalkv.layout import PageLayout, bits_per_float

MIX = "temporalkv-2bit-mixed"
PARTS = ["temporalkv-4bit", "temporalkv-2bit", "temporalkv-1bit"]
L = 4


def mixed_artifact(per_layer: dict[str, list[float]] | None = None) -> Artifact:
    """4 layers; per part, each layer's K + V cost (split evenly; temporal and channel columns alike but for
    layer 1's K, where only the column of the layer's hybrid choice is cheap)."""
    art = synthetic_artifact({**CFG, "num_hidden_layers": L}, PARTS)
    per_layer = per_layer or {"temporalkv-4bit": [0.1, 0.01, 0.001, 0.001],
                              "temporalkv-2bit": [1.0, 0.02, 0.002, 0.002],
                              "temporalkv-1bit": [10.0, 0.05, 0.003, 0.003]}
    for p in PARTS:
        art.layer_methods[p] = {"k": ["temporal", "channel", "temporal", "channel"], "v": ["temporal"] * L}
        t = torch.tensor(per_layer[p])[:, None, None].expand(L, 2, 2) / 2
        art.cost[p] = t.contiguous().clone()
    return art


def test_bits_go_where_the_loss_is():
    art = mixed_artifact()
    # 8 bits over 4 layers: the sensitive layer 0 at 4 bits saves 0.9; what is left buys 2 bits for layer 1
    assert art.layer_formats(MIX) == ["temporalkv-4bit", "temporalkv-2bit", "temporalkv-1bit", "temporalkv-1bit"]
    assert art.layer_formats("temporalkv-2bit") == ["temporalkv-2bit"] * L  # a plain format: itself everywhere
    # the cost read is that of the layer's hybrid choice: layer 1's K is channel-chunked, so a cheap temporal
    # column does not count
    art = mixed_artifact()
    art.cost["temporalkv-1bit"][1, 0, 0] = 0.0  # K temporal at 1 bit: free, but layer 1's K is "channel"
    assert art.layer_formats(MIX)[1] == "temporalkv-2bit"
    art = mixed_artifact()
    art.cost["temporalkv-1bit"][1, 0, 1] = 0.0  # K channel at 1 bit: now layer 1 is cheap at 1 bit
    art.cost["temporalkv-1bit"][1, 1, :] = 0.0
    assert art.layer_formats(MIX)[1] == "temporalkv-1bit"


def test_mixed_quantizers_pages_and_bits(tmp_path):
    art = mixed_artifact()
    path = art.save(tmp_path / "mixed.safetensors")
    back = Artifact.load(path, formats=[MIX])
    assert all(torch.equal(back.cost[p], art.cost[p]) for p in PARTS)
    parts = back.layer_formats(MIX)
    assert parts == art.layer_formats(MIX)
    D = back.fingerprint["head_dim"]
    for layer, p in enumerate(parts):
        kq, vq = layer_quantizers(MIX, layer, artifact=back)
        want = layer_quantizers(p, layer, artifact=back)
        assert kq.codec.chunk == get_format(p).chunk and torch.equal(kq.codec.centroids, want[0].codec.centroids)
        assert type(vq.codec) is type(want[1].codec)
    assert back.centroid_bytes(MIX) == sum(back.centroid_bytes(p) for p in PARTS) // 3  # same size per family
    # pages: each layer its part's; bits: the average of the parts' at a 2-bit mean
    sizes = [PageLayout(get_format(p), D, 1024).bytes for p in parts]
    assert len(set(sizes)) == 3
    fmts = [get_format(p) for p in parts]
    b = bits_per_float(get_format(MIX), D, 10**9, layer_formats=fmts)
    assert b["codes"] == pytest.approx(sum(f.nominal_bits for f in fmts) / L, rel=1e-6) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="pass layer_formats"):
        bits_per_float(get_format(MIX), D, 2048)
    with pytest.raises(ValueError, match="resolve the layer's part"):
        PageLayout(get_format(MIX), D, 1024, layer=0)


def test_refusals(tmp_path):
    art = mixed_artifact()
    art.cost.pop("temporalkv-1bit")  # an artifact written before the loss estimates were recorded
    path = art.save(tmp_path / "old.safetensors")
    with pytest.raises(ArtifactError, match="no per-layer loss estimates for temporalkv-1bit.*--formats temporalkv-4bit"):
        Artifact.load(path, formats=[MIX])
    Artifact.load(path, formats=["temporalkv-1bit"])  # its parts still serve on their own
    art = mixed_artifact()
    art.formats.remove("temporalkv-4bit")
    art.layer_methods.pop("temporalkv-4bit")
    path = art.save(tmp_path / "part.safetensors")
    with pytest.raises(ArtifactError, match=r"no codebooks for temporalkv-4bit \(a part of temporalkv-2bit-mixed\)"):
        Artifact.load(path, formats=[MIX])
    for bad in (float("nan"), -1.0):
        art = mixed_artifact()
        art.cost["temporalkv-2bit"][2, 1, 0] = bad
        path = art.save(tmp_path / "bad.safetensors")
        with pytest.raises(ArtifactError, match="hybrid.temporalkv-2bit.cost must be finite"):
            Artifact.load(path)
