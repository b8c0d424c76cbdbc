"""benchmarks.fisher: the Fisher-vs-plain k-means investigation, on a small real calibration."""

import json
import math

import pytest

import benchmarks.fisher as fb
from vllm_temporalkv.cache import model_quantizers
from vllm_temporalkv.calibration import run_calibration
from vllm_temporalkv.calibration.collect import collect_kv_grads
from tests.conftest import TINY_FORMATS
from vllm_temporalkv.artifact import Artifact
from vllm_temporalkv.corpora import load_corpus, token_windows
from vllm_temporalkv.models import load_hf_model, load_tokenizer


@pytest.fixture(scope="module")
def unweighted_artifact(tmp_path_factory, smollm2_dir):
    out = tmp_path_factory.mktemp("calib") / "unweighted.safetensors"
    run_calibration(model=str(smollm2_dir), formats=["temporalkv-2bit"], num_samples=2, seq_len=256,
                    iters=5, fisher=False, output=out, progress=False, log=lambda *a: None)
    return out


def test_objective_is_the_fisher_weighted_error_of_the_served_quantizer(tiny_artifact, smollm2_dir):
    art = Artifact.load(tiny_artifact)
    model = load_hf_model(smollm2_dir)
    ids = token_windows(load_tokenizer(smollm2_dir), load_corpus("brown"), 136, 1)
    acts, grads = collect_kv_grads(model, ids, progress=False)
    obj = fb.fisher_objective(art, "temporalkv-2bit", acts, grads)
    # independently, in raw space through the full quantizer: 1/2 sum g^2 (x - roundtrip(x))^2
    layer = 7
    q = model_quantizers("temporalkv-2bit", art)[layer][1]
    x, g = acts[layer]["v"], grads[layer]["v"]
    want = float(0.5 * (g**2 * (x - q.roundtrip(x)) ** 2).sum()) / x.shape[0]
    assert obj["per_layer"]["v"][layer] == pytest.approx(want, rel=1e-3)
    assert obj["fisher_proxy"] == pytest.approx(sum(obj["per_layer"]["k"]) + sum(obj["per_layer"]["v"]))
    assert obj["fisher_proxy"] > 0 and 0 < obj["mse"] < 1
    w = fb.weight_concentration(art, "temporalkv-2bit", acts, grads)
    for kv in "kv":
        assert all(0 < e <= 1 for e in w[kv]["ess_fraction"])
        assert all(0 < s <= 1 for s in w[kv]["top1pct_share"])


def test_paired():
    p = fb.paired([1.0, 2.0, 3.0], [1.5, 1.0, 3.5])
    assert p["mean_delta"] == pytest.approx(0.0) and (p["a_better"], p["b_better"]) == (2, 1)
    assert p["se"] == pytest.approx(math.sqrt(0.75) / math.sqrt(3))


def test_runner_end_to_end_and_resume(tiny_artifact, unweighted_artifact, tmp_path, monkeypatch, capsys):
    argv = ["--artifact", f"fisher={tiny_artifact}", "--artifact", f"plain={unweighted_artifact}",
            "--formats", "temporalkv-2bit", "--heldout-windows", "1", "--out", str(tmp_path), "--no-headline",
            "--cache", str(tmp_path / "cache")]
    rep = fb.main(argv)
    assert json.loads((tmp_path / "fisher.json").read_text())["results"] == rep["results"]
    res = rep["results"]
    assert {n: (a["fisher"], a["seed"]) for n, a in rep["artifacts"].items()} == {"fisher": (True, 0), "plain": (False, 0)}
    for split in ("calibration", "heldout"):
        assert set(res[split]["objective"]) == {"fisher/temporalkv-2bit", "plain/temporalkv-2bit"}
    nll = res["heldout"]["nll"]
    assert set(nll) == {"bf16", "fisher/temporalkv-2bit", "plain/temporalkv-2bit"}
    assert all(len(v) == 1 for v in nll.values())
    assert nll["fisher/temporalkv-2bit"][0] > nll["bf16"][0]
    assert "nll" not in res["calibration"]  # only where asked
    h = fb.headline(rep, ["temporalkv-2bit"])
    assert h["fisher.wiki-leads-2w.temporalkv-2bit@plain.proxy_held_out"] == res["heldout"]["objective"]["plain/temporalkv-2bit"]["fisher_proxy"]
    assert h["fisher.wiki-leads-2w.temporalkv-2bit@fisher.ppl_held_out"] == pytest.approx(math.exp(nll["fisher/temporalkv-2bit"][0]))
    assert len(list((tmp_path / "cache").glob("collected-*.safetensors"))) == 2  # one per split
    md = (tmp_path / "fisher.md").read_text()
    assert "| temporalkv-2bit | fisher | plain |" in md and "effective sample size" in md
    assert (tmp_path / "fisher.png").stat().st_size > 10_000

    # a rerun with the same settings measures nothing again
    def boom(*a, **k):
        raise AssertionError("recomputed")

    monkeypatch.setattr(fb, "window_nlls", boom)
    monkeypatch.setattr("vllm_temporalkv.calibration.collect.collect_kv_grads", boom)
    fb.main(argv)
    # a new artifact reuses the cached K/V + gradients: only its own objective is computed
    monkeypatch.setattr(fb, "window_nlls", lambda *a: [0.0])
    rep2 = fb.main(argv + ["--artifact", f"fisher2={tiny_artifact}"])
    assert rep2["results"]["heldout"]["nll"]["fisher/temporalkv-2bit"] == nll["fisher/temporalkv-2bit"]  # kept
    assert rep2["results"]["heldout"]["nll"]["fisher2/temporalkv-2bit"] == [0.0]
    for split in ("calibration", "heldout"):
        o = rep2["results"][split]["objective"]
        assert o["fisher2/temporalkv-2bit"]["fisher_proxy"] == pytest.approx(o["fisher/temporalkv-2bit"]["fisher_proxy"])


def test_artifacts_from_different_calibrations_are_refused(tiny_artifact, tmp_path):
    art = Artifact.load(tiny_artifact)
    art.calibration = dict(art.calibration, num_samples=art.calibration["num_samples"] + 1)
    other = art.save(tmp_path / "other.safetensors")
    with pytest.raises(SystemExit, match="num_samples"):
        fb.main(["--artifact", f"a={tiny_artifact}", "--artifact", f"b={other}", "--out", str(tmp_path)])
