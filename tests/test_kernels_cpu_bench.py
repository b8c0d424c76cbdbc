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

from tests.helpers import headline_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_cpu_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny tensors: threads only add contention
    before = headline_bytes()
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels_cpu", "--smoke", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    rep = json.loads((out / "kernels-cpu.json").read_text()) if (out / "kernels-cpu.json").is_file() else None
    # the files are named by the machine's class but on the AVX2 class of the first figures (kernels-cpu.*)
    cls = "" if rep else "-" + next(out.glob("kernels-cpu-*.json")).stem.split("kernels-cpu-")[1]
    rep = rep or json.loads((out / f"kernels-cpu{cls}.json").read_text())
    assert cls == ("" if rep["machine"]["cpu_class"] == "avx2" else "-" + rep["machine"]["cpu_class"])
    assert rep["smoke"] and rep["headline"] is None
    assert rep["bandwidth"]["copy_gbps"] > 0 and rep["machine"]["torch_threads"] >= 1
    rows = rep["rows"]
    assert {x["kind"] for x in rows} == {"decode", "prefill"}
    assert sorted(x["B"] for x in rows if x["kind"] == "decode") == [1, 2]
    vllm_ok = "error" not in rep["vllm"]
    # the machine is named (a failure on one CPU class must say which), and on an AMX CPU the benchmark asked
    # for the tile state before calling vLLM's AMX op (without it: SIGILL, issue 36); elsewhere it asks nothing
    assert rep["machine"]["cpu_class"] in ("amx", "avx512bf16", "avx512", "avx2", "scalar")
    if vllm_ok:
        assert rep["vllm"]["amx_requested"] == (rep["machine"]["cpu_class"] == "amx"), rep["vllm"]
    for x in rows:
        assert x["check_ok"] and x["max_abs_err"] <= x["tol"], x  # C++ vs the torch path
        if x["kind"] == "prefill":  # the timed chunk is the served one (ops.cpu.forward: write, then attend)
            assert x["served_max_abs_err"] <= x["tol"], x
            # and its write alone is timed beside it (the encoding share of the chunk)
            assert x["write_ms"] > 0 and x["write_fraction"] == x["write_ms"] / x["cpp_ms"], x
        assert x["cpp_ms"] > 0 and x["torch_ms"] > 0 and x["speedup_vs_torch"] > 0
        assert x["bytes_read"] > 0 and x["cpp_gbps"] > 0 and x["cpp_bw_fraction"] > 0
        # temporalkv-2bit: the codes are 1/8 of bf16 K+V
        assert x["code_bytes_per_token"] * 8 == x["dense_bytes_per_token"]
        if vllm_ok:
            assert x["vllm_check_ok"], x  # vLLM's op vs float32 dense attention
            assert x["vllm_ms"] > 0 and x["speedup_vs_vllm"] > 0 and x["vllm_gbps"] > 0
        else:  # the reason is recorded; SDPA on dense bf16 K/V stands in
            assert rep["vllm"]["error"] and x["speedup_vs_sdpa"] > 0
    assert (out / f"kernels-cpu{cls}.md").is_file() and (out / f"kernels-cpu{cls}.png").is_file()
    assert "SMOKE" in (out / f"kernels-cpu{cls}.md").read_text()
    assert "its write alone" in (out / f"kernels-cpu{cls}.md").read_text()

    # no headline anywhere: not next to the results, not in benchmarks/results
    assert not (out / "headline.json").exists()
    assert headline_bytes() == before


def test_kernels_cpu_smoke_calibration_free_formats(tmp_path):
    """selective, TaDA and QJL through the kernel benchmark (no artifact; pages written by their encoder, where random
    bytes would be NaN scales and channels past the head): each checked against the torch path before it is timed,
    its encoded blocks counted with their scales / head-mean shares / sketches."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels_cpu", "--smoke", "--out", str(out), "--formats",
                        "selective-int4", "tada-4bit", "qjl", "--context", "400", "--block-size", "256",
                        "--prefill", "none", "--batch", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(next(out.glob("kernels-cpu*.json")).read_text())
    rows = {x["format"]: x for x in rep["rows"]}
    assert set(rows) == {"selective-int4", "tada-4bit", "qjl"}
    for f, x in rows.items():
        assert x["check_ok"] and x["max_abs_err"] <= x["tol"], x  # C++ vs the torch path, on encoded blocks
        assert x["bytes_breakdown"]["codes"] > 0 and x["code_bytes_per_token"] < x["dense_bytes_per_token"], f
    # selective-int4: 4-bit codes + one fp16 scale per token, K and V; TaDA adds its share of the head mean
    D, H = 64, 3
    assert rows["selective-int4"]["code_bytes_per_token"] == H * 2 * (D // 2 + 2)
    assert rows["tada-4bit"]["code_bytes_per_token"] > rows["selective-int4"]["code_bytes_per_token"]


def test_kernels_cpu_smoke_never_writes_results():
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels_cpu", "--smoke", "--out",
                        str(ROOT / "benchmarks" / "results")], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "never writes to benchmarks/results" in r.stderr


def test_vllm_op_loader_asks_for_amx_tiles_as_vllm_worker_holds_them():
    """A fresh process that loads vLLM's CPU attention op the benchmark's way holds the AMX tile permission
    afterwards on an AMX CPU (Linux: ARCH_GET_XCOMP_PERM), and asks for nothing on a CPU without AMX."""
    code = (
        "import json, torch\n"
        "from vllm_temporalkv.cpu_isa import amx_permitted, cpu_class\n"
        "from benchmarks.kernels_cpu.vllm_op import load_vllm_op\n"
        "before = amx_permitted()\n"
        "v = load_vllm_op(torch.bfloat16, 64, 128)\n"
        "print(json.dumps(dict(cls=cpu_class(), before=before, after=amx_permitted(), error=v.get('error'),\n"
        "                      requested=v.get('amx_requested'))))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if got["error"]:
        return  # no CPU op in this vLLM build: nothing is called, nothing to ask for
    if got["cls"] == "amx":
        assert got["requested"] is True and got["after"] in (True, None), got
    else:
        assert got["requested"] is False and got["after"] in (False, None), got


def test_batch_variance_measures_vllm_gemms(tmp_path):
    """benchmarks.batch_variance (the measurement behind the concurrency tests' float32): it builds the
    projections through vLLM's own CPU dispatch and compares a row alone with the same row in batches; a batch of
    one row is the row alone (the comparison is sound), the machine is named, and nothing reaches the headline."""
    before = headline_bytes()
    r = subprocess.run([sys.executable, "-m", "benchmarks.batch_variance", "--rows", "1", "5", "--out", str(tmp_path),
                        "--no-headline"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(next(tmp_path.glob("batch-variance-*.json")).read_text())
    assert rep["cpu_class"] == rep["machine"]["cpu_class"]
    for dt in ("bfloat16", "float32"):
        for proj in rep["dtypes"][dt].values():
            assert proj["kernel"] in ("sgl", "onednn", "torch")
            one = proj["per_m"]["1"]
            assert one["rows_changed"] == 0 and one["max_rel_diff"] == 0.0, proj
            assert proj["per_m"]["5"]["rows"] == 5
    assert headline_bytes() == before
