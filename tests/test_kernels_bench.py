"""The kernel benchmark's plumbing: ``python -m benchmarks.kernels --smoke`` end to end.

Without a GPU the smoke run goes through Triton's interpreter (tiny shapes, ~30 s); it must check
the decode kernel against the torch reference, write its results only to --out, and never touch
the headline file.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import headline_bytes

# find_spec, not importorskip: importing triton here (collected before test_triton_kernels.py) would
# build its standard library as compiled JITFunctions before TRITON_INTERPRET is set for that module
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # main() sets it too; the interpreter is the point here
        env.setdefault("OMP_NUM_THREADS", "1")  # tiny tensors: threads only add contention
    before = headline_bytes()
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--smoke", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    rep = json.loads((out / "kernels.json").read_text())
    assert rep["smoke"] and rep["headline"] is None
    rows = rep["rows"]
    assert rows and all(x.get("time_ms") is not None for x in rows)
    for x in rows:  # bf16 tolerance, as in tests/test_triton_kernels.py
        assert x["max_abs_err"] <= 6e-2 * max(1.0, x["ref_absmax"]), x
        assert x["check_ok"] and x["fp16_paged_err"] <= 6e-2, x
        assert x["bytes_read"] > 0 and x["speedup_vs_sdpa"] > 0
    assert rep["encode"] and all(e["bit_exact"] and e["gather_bit_exact"] for e in rep["encode"])
    assert (out / "kernels.md").is_file() and (out / "kernels.png").is_file()
    assert "SMOKE" in (out / "kernels.md").read_text()

    # no headline anywhere: not next to the results, not in benchmarks/results
    assert not (out / "headline.json").exists()
    assert headline_bytes() == before


def test_kernels_needs_gpu_without_smoke():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernels"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "needs a CUDA GPU" in r.stderr and "--smoke" in r.stderr


def test_decode_sweep_smoke(tmp_path):
    """benchmarks/gpu/decode_sweep.py (launch settings side by side on the GPU box): the plumbing, in the
    interpreter - each setting is checked against the torch reference before it is timed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = tmp_path / "sweep.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.decode_sweep", "--smoke", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [x["setting"] for x in rows] == ["default", "w8+cg"]
    assert all(x["check_ok"] and x["time_ms"] for x in rows), rows
