"""Key rotation (codecs/rotation.py, ``calibrate --key-rotation``) and more sinks (``@sinksN``): the two 2-bit
remedies the quality harness simulates on real calibrations of SmolLM2."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vllm_temporalkv.artifact import Artifact, ArtifactError, model_fingerprint
from vllm_temporalkv.calibration import run as calibrate
from vllm_temporalkv.codecs.rotation import rotate, rotation_matrix
from vllm_temporalkv.formats import SINK_TOKENS, get_format
from vllm_temporalkv.layout import bits_per_float


@pytest.mark.parametrize("dim", [64, 128, 96])
def test_rotation_is_orthogonal_and_fixed(dim):
    r = rotation_matrix("hadamard", dim)
    assert torch.allclose(r @ r.T, torch.eye(dim), atol=1e-5)
    assert torch.equal(r, rotation_matrix.__wrapped__("hadamard", dim))  # the same matrix in every process
    if dim & (dim - 1) == 0:  # a randomized Hadamard: every entry +-1/sqrt(D), signs not all equal
        assert torch.allclose(r.abs(), torch.full_like(r, dim**-0.5))
        assert (r[0] > 0).any() and (r[0] < 0).any()
    x = torch.randn(5, 3, dim)
    assert torch.allclose(rotate(rotate(x, "hadamard"), "hadamard", inverse=True), x, atol=1e-5)
    assert rotate(x, None) is x
    with pytest.raises(ValueError, match="not one of hadamard"):
        rotation_matrix("givens", dim)


def test_rotated_calibration_reuses_the_collection_and_rotates_keys_only(smollm2_dir, tmp_path, calibration_spy):
    """A stopped run's collection serves a rotated run (the rotation acts at the fit); the rotated artifact's key
    statistics are the plain ones rotated (the mean is linear), its value statistics the plain ones; the harness
    codes keys in the rotated coordinates and gives the sinks back to half precision; the server refuses the artifact."""
    from vllm_temporalkv.harness.simulate import Simulator
    from vllm_temporalkv.vllm import options

    calls, logs = calibration_spy.calls, []
    kw = dict(model=str(smollm2_dir), formats=["temporalkv-2bit"], num_samples=1, seq_len=128, iters=2,
              progress=False, log=logs.append, attention="sdpa")
    out = tmp_path / "rot.safetensors"
    calibration_spy.stop = 2
    with pytest.raises(KeyboardInterrupt):
        calibrate.run_calibration(output=out, **kw)
    calibration_spy.stop = None
    rot = calibrate.run_calibration(output=out, rotation={"k": "hadamard"}, **kw)
    assert len(calls) == 1, "the collection was redone for a key rotation"
    assert any("discarding its 2 fitted layers" in m for m in logs), logs
    plain = calibrate.run_calibration(output=tmp_path / "plain.safetensors", **kw)
    assert rot.rotation == {"k": "hadamard"} and plain.rotation == {}
    assert Artifact.load(out).rotation == {"k": "hadamard"}  # kept in the file
    r = rotation_matrix("hadamard", 64)
    for layer in (0, 17):
        assert torch.allclose(rot.stats[(layer, "k")].mean, plain.stats[(layer, "k")].mean @ r, atol=1e-4)
        assert torch.equal(rot.stats[(layer, "v")].mean, plain.stats[(layer, "v")].mean)
        assert not torch.allclose(rot.stats[(layer, "k")].std, plain.stats[(layer, "k")].std, rtol=1e-2)
    with pytest.raises(ValueError, match="--rotate"):
        calibrate.run_calibration(output=tmp_path / "x.safetensors", rotation={"k": "givens"}, **kw)

    # the harness: keys coded rotated and rotated back (close to the input, sinks exact), values as plain
    g = torch.Generator().manual_seed(0)
    x = plain.stats[(5, "k")].mean + plain.stats[(5, "k")].std * torch.randn(1, 64, 3, 64, generator=g)
    xb = x.bfloat16().float()
    y_rot = Simulator("temporalkv-2bit", rot, None)(5, "k", x)
    y_plain = Simulator("temporalkv-2bit", plain, None)(5, "k", x)
    # the exact tokens are held at the cache's half precision in the rotated coordinates: back within its rounding
    assert torch.allclose(y_rot[0, :SINK_TOKENS], xb[0, :SINK_TOKENS], rtol=4e-3, atol=4e-3 * float(xb.abs().max()))
    err_rot, err_plain = ((y_rot - xb)[0, SINK_TOKENS:] ** 2).mean(), ((y_plain - xb)[0, SINK_TOKENS:] ** 2).mean()
    # coded in the rotated coordinates and rotated back: an error of the plain codebooks' order, far below the
    # keys' own spread (what a decode left in the rotated coordinates would give)
    spread = ((xb - xb.mean(1, keepdim=True))[0, SINK_TOKENS:] ** 2).mean()
    assert 0 < err_rot < 3 * err_plain and err_rot < 0.5 * spread and not torch.equal(y_rot, y_plain), \
        (err_rot, err_plain, spread)
    v = torch.randn(1, 64, 3, 64, generator=g)
    rv = Simulator("temporalkv-2bit", rot, None)(5, "v", v)
    unrotated = dataclasses.replace(rot, calibration={})
    assert torch.equal(rv, Simulator("temporalkv-2bit", unrotated, None)(5, "v", v))
    values_rotated = dataclasses.replace(rot, calibration={"rotation": {"v": "hadamard"}})
    assert not torch.equal(rv, Simulator("temporalkv-2bit", values_rotated, None)(5, "v", v))

    fp = json.dumps(model_fingerprint(json.loads((smollm2_dir / "config.json").read_text())), sort_keys=True)
    with pytest.raises(ArtifactError, match="rotated keys .*--rotate"):
        options._load(str(out), fp, "temporalkv-2bit", str(smollm2_dir))
    options._load(str(tmp_path / "plain.safetensors"), fp, "temporalkv-2bit", str(smollm2_dir))


def test_cli_rotate_flag(monkeypatch):
    from vllm_temporalkv.calibration import cli

    seen = []
    monkeypatch.setattr(calibrate, "run_calibration", lambda **kw: seen.append(kw["rotation"]))
    for flag, want in ((["--rotate", "keys"], {"k": "hadamard"}), (["--rotate", "values"], {"v": "hadamard"}),
                       (["--rotate", "both"], {"k": "hadamard", "v": "hadamard"}), ([], {})):
        assert cli.main(["--quiet", *flag]) == 0 and seen.pop() == want


def test_more_sinks_in_the_bits_and_the_hook(tiny_artifact):
    """``@sinksN``: the first N tokens exact in the hook and counted at 16 bits in the all-in bits."""
    from vllm_temporalkv.harness.simulate import Simulator, sinks_of

    fmt = get_format("temporalkv-2bit")
    base, more = bits_per_float(fmt, 64, 2048), bits_per_float(fmt, 64, 2048, sinks=32)
    assert base["sinks"] == 16 * SINK_TOKENS / 2048 and more["sinks"] == 16 * 32 / 2048
    assert more["total"] > base["total"] and more["codes"] < base["codes"]
    assert sinks_of("sinks32+keys-only") == 32 and sinks_of("sinks-compressed") == 0 and sinks_of(None) is None
    art = Artifact.load(tiny_artifact)
    x = torch.randn(1, 96, 3, 64)
    xb = x.bfloat16().float()
    y = Simulator("temporalkv-2bit@sinks32", art, None)(4, "k", x)
    assert torch.equal(y[0, :32], xb[0, :32]) and not torch.equal(y[0, 32:48], xb[0, 32:48])


def test_one_half_channel_chunked(tiny_artifact):
    """``@keys-channel`` / ``@values-channel``: that half coded as ChannelKV codes it in every layer (the same
    channel codebooks and statistics), the other half as the hybrid chose."""
    from vllm_temporalkv.harness.simulate import Simulator

    art = Artifact.load(tiny_artifact)
    x = torch.randn(1, 64, 3, 64, generator=torch.Generator().manual_seed(1))
    hybrid, channel = Simulator("temporalkv-2bit", art, None), Simulator("channelkv-2bit", art, None)
    temporal_k = [i for i, m in enumerate(art.layer_methods["temporalkv-2bit"]["k"]) if m == "temporal"]
    assert temporal_k, "the tiny calibration chose channel keys everywhere: the test would prove nothing"
    for part, kind, other in (("keys-channel", "k", "v"), ("values-channel", "v", "k")):
        sim = Simulator(f"temporalkv-2bit@{part}", art, None)
        for layer in range(art.num_layers):
            assert torch.equal(sim(layer, kind, x), channel(layer, kind, x)), (part, layer)
            assert torch.equal(sim(layer, other, x), hybrid(layer, other, x)), (part, layer)
    assert not torch.equal(hybrid(temporal_k[0], "k", x), channel(temporal_k[0], "k", x))
    # served as a format of its own: temporalkv-2bit-cv is @values-channel
    cv, vc = Simulator("temporalkv-2bit-cv", art, None), Simulator("temporalkv-2bit@values-channel", art, None)
    assert all(torch.equal(cv(layer, kind, x), vc(layer, kind, x)) for layer in range(art.num_layers) for kind in "kv")


def test_outlier_shares(tiny_artifact):
    """``-o0.5``: half the outlier slots (2-bit TemporalKV within 2.25 bits per float), in the name, the bits, the
    slots per block and the hook; a share over 1% is refused (the thresholds single out ~1% of the values)."""
    from vllm_temporalkv.harness.simulate import Simulator, parse_config
    from vllm_temporalkv.methods import outlier_cap

    assert parse_config("temporalkv-2bit-o0.5@keys-only") == ("temporalkv-2bit", 0.005, "keys-only")
    assert parse_config("temporalkv-2bit-o1") == ("temporalkv-2bit", True, None)
    assert parse_config("temporalkv-2bit") == ("temporalkv-2bit", False, None)
    assert (outlier_cap(128), outlier_cap(128, 0.005), outlier_cap(64, 0.005), outlier_cap(64, False)) == (10, 5, 2, 0)
    fmt = get_format("temporalkv-2bit")
    half, full = bits_per_float(fmt, 128, 2048, 0.005), bits_per_float(fmt, 128, 2048, True)
    assert half["outliers"] == pytest.approx(full["outliers"] / 2) and half["total"] < 2.25 < full["total"]
    art = Artifact.load(tiny_artifact)
    x = torch.randn(1, 64, 3, 64, generator=torch.Generator().manual_seed(2)) * 4  # plenty beyond the thresholds
    y = {n: Simulator(n, art, None)(5, "k", x) for n in ("temporalkv-2bit", "temporalkv-2bit-o0.5", "temporalkv-2bit-o1")}
    exact = {n: int((v == x.bfloat16().float())[0, SINK_TOKENS:].sum()) for n, v in y.items()}
    assert exact["temporalkv-2bit"] < exact["temporalkv-2bit-o0.5"] < exact["temporalkv-2bit-o1"], exact
    with pytest.raises(ValueError, match="outside \\(0, 0.01\\]"):
        Simulator("temporalkv-2bit-o2", art, None)
