"""The calibration artifact: round trip, and a clear error for every way it can be wrong."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from vllm_temporalkv.calibration import codebook_keys
from vllm_temporalkv.artifact import SCHEMA_VERSION, Artifact, ArtifactError, model_fingerprint
from vllm_temporalkv.codecs import make_codec
from vllm_temporalkv.codecs.quantizer import ChannelStats
from vllm_temporalkv.formats import get_format, parse_codebook_key

CFG = {
    "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "hidden_size": 64, "vocab_size": 100,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
FORMATS = ["temporalkv-2bit", "channelkv-1bit", "kvquant-2bit"]


def synthetic_artifact(cfg=CFG, formats=FORMATS) -> Artifact:
    fp = model_fingerprint(cfg)
    H, D, L = fp["num_kv_heads"], fp["head_dim"], fp["num_layers"]
    g = torch.Generator().manual_seed(0)
    stats = {(i, kv): ChannelStats(torch.randn(H, D, generator=g), torch.rand(H, D, generator=g) + 0.5,
                                   -torch.ones(H, D) * 3, torch.ones(H, D) * 3)
             for i in range(L) for kv in "kv"}
    books = {}
    for key in codebook_keys(formats):
        shape = make_codec(*parse_codebook_key(key)).codebook_shape(H, D)
        for i in range(L):
            for kv in "kv":
                books[(i, kv, key)] = torch.randn(shape, generator=g).half()
    methods = {}
    for f in formats:
        fmt = get_format(f)
        m = ["channel", "temporal"] if fmt.hybrid else [fmt.method] * L
        methods[f] = {"k": m, "v": [fmt.method] * L}
    return Artifact(fp, formats, methods, {"data": "synthetic"}, stats, books, {})


@pytest.fixture
def saved(tmp_path):
    art = synthetic_artifact()
    return art, art.save(tmp_path / "a.safetensors")


def test_round_trip(saved):
    art, path = saved
    back = Artifact.load(path, expect=model_fingerprint(CFG), formats=FORMATS)
    assert back.fingerprint == art.fingerprint and back.layer_methods == art.layer_methods
    for k, v in art.codebooks.items():
        assert torch.equal(back.codebooks[k], v)
    for k, s in art.stats.items():
        assert torch.equal(back.stats[k].std, s.std)
    # the hybrid choice reaches the quantizers: layer 0 K is channel-chunked
    qs = back.quantizers("temporalkv-2bit")
    assert [q[0].codec.method for q in qs] == ["channel", "temporal"]
    assert back.centroid_bytes("temporalkv-2bit") == back.centroid_bytes("channelkv-1bit")


def test_missing(tmp_path):
    with pytest.raises(ArtifactError, match=r"not found: .*nope.safetensors.*temporalkv-calibrate"):
        Artifact.load(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("cut", [4, 100, -1000])
def test_truncated(saved, cut):
    _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(ArtifactError, match=r"unreadable \(truncated or corrupt.*temporalkv-calibrate"):
        Artifact.load(path)


def test_corrupt_header(saved):
    _, path = saved
    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    data[8 : 8 + n] = b"{" + b"x" * (n - 1)
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="unreadable"):
        Artifact.load(path)


def test_not_an_artifact(tmp_path):
    p = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(p))
    with pytest.raises(ArtifactError, match="not a vllm-temporalkv calibration artifact"):
        Artifact.load(p)


def _rewrite_meta(path, **changes):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.update(changes)
    save_file(tensors, str(path), metadata=meta)


def test_wrong_schema(saved):
    _, path = saved
    _rewrite_meta(path, schema_version=str(SCHEMA_VERSION + 1))
    with pytest.raises(ArtifactError, match="schema version"):
        Artifact.load(path)


def test_wrong_model(saved):
    _, path = saved
    other = dict(CFG, vocab_size=49152, architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ArtifactError, match=r"different model.*architecture.*vocab_size"):
        Artifact.load(path, expect=model_fingerprint(other), model_hint="Qwen/x")


def test_wrong_head_count(saved):
    _, path = saved
    with pytest.raises(ArtifactError, match=r"num_kv_heads: artifact has 2, model has 4"):
        Artifact.load(path, expect=model_fingerprint(dict(CFG, num_key_value_heads=4)))


def test_inconsistent_shapes(saved):
    art, path = saved
    fp = dict(art.fingerprint, num_kv_heads=3)  # metadata claims 3 heads, tensors hold 2
    _rewrite_meta(path, fingerprint=json.dumps(fp))
    with pytest.raises(ArtifactError, match=r"inconsistent.*shape"):
        Artifact.load(path)


def test_format_not_covered(saved):
    _, path = saved
    with pytest.raises(ArtifactError, match=r"no codebooks for temporalkv-1bit.*--formats temporalkv-1bit"):
        Artifact.load(path, formats=["temporalkv-1bit"])


def test_fingerprint_of_smollm2_like_config():
    fp = model_fingerprint(dict(CFG, rope_parameters=None, rope_theta=1e5, head_dim=64))
    assert fp["rope_theta"] == 1e5 and fp["head_dim"] == 64 and fp["rope_type"] == "default"
