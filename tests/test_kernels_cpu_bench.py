"""The CPU kernel benchmark's plumbing: ``python -m benchmarks.kernels_cpu --smoke`` end to end (~30-40 s,
most of it importing vLLM).

It must check the C++ kernels against the torch path (and vLLM's op against dense attention), time the
three paths side by side, give ratios, bytes and bandwidths, write its results only to --out, and never
touch the headline file.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = ROOT / "benchmarks" / "results" / "headline.json"


def test_kernels_cpu_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny tensors: threads only add contention
    before = HEADLINE.read_bytes() if HEADLINE.is_file() else None
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels_cpu", "--smoke", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    rep = json.loads((out / "kernels-cpu.json").read_text())
    assert rep["smoke"] and rep["headline"] is None
    assert rep["bandwidth"]["copy_gbps"] > 0 and rep["machine"]["torch_threads"] >= 1
    rows = rep["rows"]
    assert {x["kind"] for x in rows} == {"decode", "prefill"}
    assert sorted(x["B"] for x in rows if x["kind"] == "decode") == [1, 2]
    vllm_ok = "error" not in rep["vllm"]
    for x in rows:
        assert x["check_ok"] and x["max_abs_err"] <= x["tol"], x  # C++ vs the torch path
        assert x["cpp_ms"] > 0 and x["torch_ms"] > 0 and x["speedup_vs_torch"] > 0
        assert x["bytes_read"] > 0 and x["cpp_gbps"] > 0 and x["cpp_bw_fraction"] > 0
        # temporalkv-2bit: the codes are 1/8 of bf16 K+V
        assert x["code_bytes_per_token"] * 8 == x["dense_bytes_per_token"]
        if vllm_ok:
            assert x["vllm_check_ok"], x  # vLLM's op vs float32 dense attention
            assert x["vllm_ms"] > 0 and x["speedup_vs_vllm"] > 0 and x["vllm_gbps"] > 0
        else:  # the reason is recorded; SDPA on dense bf16 K/V stands in
            assert rep["vllm"]["error"] and x["speedup_vs_sdpa"] > 0
    assert (out / "kernels-cpu.md").is_file() and (out / "kernels-cpu.png").is_file()
    assert "SMOKE" in (out / "kernels-cpu.md").read_text()

    # no headline anywhere: not next to the results, not in benchmarks/results
    assert not (out / "headline.json").exists()
    assert (HEADLINE.read_bytes() if HEADLINE.is_file() else None) == before


def test_kernels_cpu_smoke_never_writes_results():
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels_cpu", "--smoke", "--out",
                        str(ROOT / "benchmarks" / "results")], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "never writes to benchmarks/results" in r.stderr
