"""The calibration artifact: round trip, and a clear error for every way it can be wrong."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import CFG, FORMATS, bench_call, synthetic_artifact
from vllm_temporalkv.cache import layer_quantizers, model_quantizers
from vllm_temporalkv.artifact import (DIGEST_KEY, SCHEMA_VERSION, Artifact, ArtifactError, content_digest,
                                      model_fingerprint)
from vllm_temporalkv.harness.artifacts import load_all


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
    qs = model_quantizers("temporalkv-2bit", back)
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
    """The artifact as a writer would have written it with these metadata values (checksum included)."""
    tensors, meta = load_all(path)
    meta.update(changes)
    meta[DIGEST_KEY] = content_digest(meta, tensors)
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
    with pytest.raises(ArtifactError, match=r"is inconsistent: .*shape"):
        Artifact.load(path)


def test_checksum(saved):
    """A flipped bit in the data, or two layers' codebooks swapped, no longer match the checksum written with
    the file; a file from before the checksum existed still loads."""
    art, path = saved
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"is corrupt: its content does not match the checksum.*temporalkv-calibrate"):
        Artifact.load(path)
    art.save(path)
    tensors, meta = load_all(path)
    a, b = "codebook.0.k.temporal-l4-k256", "codebook.1.k.temporal-l4-k256"
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ArtifactError, match="does not match the checksum"):
        Artifact.load(path)
    tensors[a], tensors[b] = tensors[b], tensors[a]
    del meta[DIGEST_KEY]
    save_file(tensors, str(path), metadata=meta)
    assert Artifact.load(path, formats=FORMATS).fingerprint == art.fingerprint


@pytest.mark.parametrize("meta,why", [
    (dict(layer_methods=lambda m: {**m, "kvquant-2bit": {"k": ["scalar", "bogus"], "v": m["kvquant-2bit"]["v"]}}),
     r"corrupt metadata .*'bogus'"),
    (dict(formats=lambda f: f + ["temporalkv-3bit"]), r"corrupt metadata .*temporalkv-3bit"),
    (dict(fingerprint=lambda fp: [fp]), r"corrupt metadata .*fingerprint is list"),
    (dict(layer_methods=lambda m: None), r"corrupt metadata .*layer_methods is NoneType"),
])
def test_bad_metadata_values(saved, meta, why):
    """Metadata a buggy writer could produce (valid JSON, checksum right): refused naming the file."""
    _, path = saved
    old = load_all(path)[1]
    (key, fn), = meta.items()
    _rewrite_meta(path, **{key: json.dumps(fn(json.loads(old[key])))})
    with pytest.raises(ArtifactError, match=why + r".*temporalkv-calibrate"):
        Artifact.load(path)


@pytest.mark.parametrize("edit,why", [
    (lambda t: t.update({"stats.0.k.std": torch.zeros_like(t["stats.0.k.std"])}), "standard deviation <= 0"),
    (lambda t: t.update({"stats.1.v.mean": t["stats.1.v.mean"].double()}), "float64, expected torch.float32"),
    (lambda t: t.update({"stats.0.v.hi": t["stats.0.v.hi"] * float("nan")}), "non-finite"),
    (lambda t: t.update({"codebook.7.k.temporal-l4-k256": t["codebook.0.k.temporal-l4-k256"].clone()}), "names layer '7'"),
    (lambda t: t.update({"extra": torch.zeros(1)}), "unexpected tensor 'extra'"),
])
def test_bad_tensors(saved, edit, why):
    """Tensors a buggy writer could produce (checksum right): refused naming the file."""
    _, path = saved
    tensors, meta = load_all(path)
    edit(tensors)
    meta[DIGEST_KEY] = content_digest(meta, tensors)
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ArtifactError, match=r"is inconsistent: .*" + why):
        Artifact.load(path)


FUZZ = """import json, sys
from pathlib import Path
from benchmarks.artifact_fuzz import fuzz
path, expect, workdir = Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
print(json.dumps(fuzz(path, expect, "temporalkv-2bit", 80, seed=1, workdir=workdir)))"""


def test_fuzz_slice(saved, tmp_path):
    """CI's slice of the artifact fuzzer (benchmarks/artifact_fuzz.py runs hundreds on the real artifact):
    every mutation refused with the file and the fix named, or harmless."""
    _, path = saved
    r = bench_call(FUZZ, path, json.dumps(model_fingerprint(CFG)), tmp_path / "fuzz")
    assert r["unclean"] == [], r["unclean"][:5]
    assert r["outcomes"].get("refused", 0) >= 60, r["outcomes"]


def test_format_not_covered(saved):
    _, path = saved
    with pytest.raises(ArtifactError, match=r"no codebooks for temporalkv-1bit.*--formats temporalkv-1bit"):
        Artifact.load(path, formats=["temporalkv-1bit"])


def test_fingerprint_of_smollm2_like_config():
    fp = model_fingerprint(dict(CFG, rope_parameters=None, rope_theta=1e5, head_dim=64))
    assert fp["rope_theta"] == 1e5 and fp["head_dim"] == 64 and fp["rope_type"] == "default"


def test_quantizers_of_some_heads(saved):
    """A tensor-parallel rank's KV heads get their own codebooks and statistics, not the first ones."""
    art, _ = saved
    full_k, _ = layer_quantizers("temporalkv-2bit", 1, artifact=art)
    k1, v1 = layer_quantizers("temporalkv-2bit", 1, artifact=art, heads=[1])
    assert torch.equal(k1.codec.centroids[0], full_k.codec.centroids[1])
    assert torch.equal(k1.stats.std[0], full_k.stats.std[1]) and k1.stats.mean.shape[0] == 1
    assert v1.codec.centroids.shape[0] == 1
    with pytest.raises(ArtifactError, match="has 2 KV heads"):
        layer_quantizers("temporalkv-2bit", 1, artifact=art, heads=[2])


@pytest.mark.parametrize("total,local,tp,rank,want", [
    (8, 2, 4, 3, [6, 7]),  # heads split across ranks
    (3, 3, 1, 0, [0, 1, 2]),  # one process
    (3, 1, 3, 2, [2]),  # SmolLM2 at TP=3
    (2, 1, 4, 3, [1]),  # more ranks than heads: each head on tp / total ranks (vLLM's QKVParallelLinear)
])
def test_local_kv_heads(monkeypatch, total, local, tp, rank, want):
    pytest.importorskip("vllm")
    import vllm.distributed as dist

    from vllm_temporalkv.vllm import compat

    monkeypatch.setattr(dist, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(dist, "get_tensor_model_parallel_rank", lambda: rank)
    assert compat.local_kv_heads(total, local) == want


FULL_CALIBRATION = """import json, sys
from pathlib import Path
from benchmarks.__main__ import _full_calibration
print(json.dumps([_full_calibration(Path(p)) for p in sys.argv[1:]]))"""


def test_full_calibration_is_every_codebook_format(tmp_path):
    """`python -m benchmarks` re-calibrates unless the default artifact holds every format that has codebooks of its
    own (not the calibration-free ones, mixes or K/V pairs, which no artifact holds)."""
    from vllm_temporalkv.formats import calibrated_formats

    full = synthetic_artifact(CFG, calibrated_formats()).save(tmp_path / "full.safetensors")
    one = synthetic_artifact(CFG, ["temporalkv-2bit"]).save(tmp_path / "one.safetensors")
    first = synthetic_artifact(CFG, calibrated_formats())
    first.calibration["first_use"] = True  # the small one `vllm-temporalkv serve` makes
    first = first.save(tmp_path / "first.safetensors")
    is_full = bench_call(FULL_CALIBRATION, full, one, first, tmp_path / "missing.safetensors")
    assert is_full[0]
    assert not is_full[1]
    assert not is_full[2]
    assert not is_full[3]
