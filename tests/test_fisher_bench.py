"""benchmarks.fisher: the Fisher-vs-plain k-means investigation, on a small real calibration.  The benchmark runs
as a program (tests never import benchmarks); its resume and its statistics are checked in a subprocess."""

import json
import math

import pytest

from tests.helpers import bench_call, run_bench
from vllm_temporalkv.cache import model_quantizers
from vllm_temporalkv.artifact import Artifact
from vllm_temporalkv.calibration import run_calibration
from vllm_temporalkv.calibration.collect import load_collected


@pytest.fixture(scope="module")
def unweighted_artifact(tmp_path_factory, smollm2_dir):
    out = tmp_path_factory.mktemp("calib") / "unweighted.safetensors"
    run_calibration(model=str(smollm2_dir), formats=["temporalkv-2bit"], num_samples=2, seq_len=256,
                    iters=5, fisher=False, output=out, progress=False, log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def fisher_run(tiny_artifact, unweighted_artifact, tmp_path_factory):
    """`python -m benchmarks.fisher` on the tiny (Fisher) and unweighted calibrations, one held-out window: its
    folder, its command line and the report it wrote."""
    out = tmp_path_factory.mktemp("fisher")
    argv = ["--artifact", f"fisher={tiny_artifact}", "--artifact", f"plain={unweighted_artifact}",
            "--formats", "temporalkv-2bit", "--heldout-windows", "1", "--out", str(out), "--no-headline",
            "--cache", str(out / "cache")]
    run_bench("benchmarks.fisher", *argv)
    return out, argv, json.loads((out / "fisher.json").read_text())


def test_objective_is_the_fisher_weighted_error_of_the_served_quantizer(fisher_run, tiny_artifact):
    out, _, rep = fisher_run
    art = Artifact.load(tiny_artifact)
    # the K/V and gradients the benchmark collected on its held-out split (one Brown window; the calibration split has
    # two), kept by --cache
    acts, grads = min((load_collected(p) for p in (out / "cache").glob("collected-*.safetensors")),
                      key=lambda c: c[0][0]["k"].shape[0])
    obj = rep["results"]["heldout"]["objective"]["fisher/temporalkv-2bit"]
    # independently, in raw space through the full quantizer: 1/2 sum g^2 (x - roundtrip(x))^2
    layer = 7
    q = model_quantizers("temporalkv-2bit", art)[layer][1]
    x, g = acts[layer]["v"], grads[layer]["v"]
    want = float(0.5 * (g**2 * (x - q.roundtrip(x)) ** 2).sum()) / x.shape[0]
    assert obj["per_layer"]["v"][layer] == pytest.approx(want, rel=1e-3)
    assert obj["fisher_proxy"] == pytest.approx(sum(obj["per_layer"]["k"]) + sum(obj["per_layer"]["v"]))
    assert obj["fisher_proxy"] > 0 and 0 < obj["mse"] < 1
    w = rep["results"]["heldout"]["weights"]["temporalkv-2bit"]  # of the first artifact: the tiny (Fisher) one
    for kv in "kv":
        assert all(0 < e <= 1 for e in w[kv]["ess_fraction"])
        assert all(0 < s <= 1 for s in w[kv]["top1pct_share"])


def test_paired():
    p = bench_call("import json\nfrom benchmarks.fisher import paired\n"
                   "print(json.dumps(paired([1.0, 2.0, 3.0], [1.5, 1.0, 3.5])))")
    assert p["mean_delta"] == pytest.approx(0.0) and (p["a_better"], p["b_better"]) == (2, 1)
    assert p["se"] == pytest.approx(math.sqrt(0.75) / math.sqrt(3))


RERUN = """import json, sys
import benchmarks.fisher as fb
import vllm_temporalkv.calibration.collect as collect
out, argv, art = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
first = json.loads(open(out + "/fisher.json").read())

def boom(*a, **k):
    raise AssertionError("recomputed")

# a rerun with the same settings measures nothing again
fb.window_nlls = boom
collect.collect_kv_grads = boom
fb.main(argv)
# a new artifact reuses the cached K/V + gradients: only its own objective is computed
fb.window_nlls = lambda *a: [0.0]
rep2 = fb.main(argv + ["--artifact", f"fisher2={art}"])
print(json.dumps({"headline": fb.headline(first, ["temporalkv-2bit"]), "results2": rep2["results"]}))"""


def test_runner_end_to_end_and_resume(fisher_run, tiny_artifact):
    out, argv, rep = fisher_run
    res = rep["results"]
    assert {n: (a["fisher"], a["seed"]) for n, a in rep["artifacts"].items()} == {"fisher": (True, 0), "plain": (False, 0)}
    for split in ("calibration", "heldout"):
        assert set(res[split]["objective"]) == {"fisher/temporalkv-2bit", "plain/temporalkv-2bit"}
    nll = res["heldout"]["nll"]
    assert set(nll) == {"bf16", "fisher/temporalkv-2bit", "plain/temporalkv-2bit"}
    assert all(len(v) == 1 for v in nll.values())
    assert nll["fisher/temporalkv-2bit"][0] > nll["bf16"][0]
    assert "nll" not in res["calibration"]  # only where asked
    assert len(list((out / "cache").glob("collected-*.safetensors"))) == 2  # one per split
    md = (out / "fisher.md").read_text()
    assert "| temporalkv-2bit | fisher | plain |" in md and "effective sample size" in md
    assert (out / "fisher.png").stat().st_size > 10_000

    r = bench_call(RERUN, out, json.dumps(argv), tiny_artifact)
    h = r["headline"]
    assert h["fisher.wiki-leads-2w.temporalkv-2bit@plain.proxy_held_out"] == res["heldout"]["objective"]["plain/temporalkv-2bit"]["fisher_proxy"]
    assert h["fisher.wiki-leads-2w.temporalkv-2bit@fisher.ppl_held_out"] == pytest.approx(math.exp(nll["fisher/temporalkv-2bit"][0]))
    # what main returns is what it wrote
    assert json.loads((out / "fisher.json").read_text())["results"] == r["results2"]
    rep2 = r["results2"]
    assert rep2["heldout"]["nll"]["fisher/temporalkv-2bit"] == nll["fisher/temporalkv-2bit"]  # kept
    assert rep2["heldout"]["nll"]["fisher2/temporalkv-2bit"] == [0.0]
    for split in ("calibration", "heldout"):
        o = rep2[split]["objective"]
        assert o["fisher2/temporalkv-2bit"]["fisher_proxy"] == pytest.approx(o["fisher/temporalkv-2bit"]["fisher_proxy"])


def test_artifacts_from_different_calibrations_are_refused(tiny_artifact, tmp_path):
    art = Artifact.load(tiny_artifact)
    art.calibration = dict(art.calibration, num_samples=art.calibration["num_samples"] + 1)
    other = art.save(tmp_path / "other.safetensors")
    r = run_bench("benchmarks.fisher", "--artifact", f"a={tiny_artifact}", "--artifact", f"b={other}", "--out",
                  tmp_path, check=False)
    assert r.returncode != 0 and "num_samples" in r.stderr  # SystemExit naming the setting that differs
