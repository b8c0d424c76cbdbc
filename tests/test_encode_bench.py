"""The encode benchmark's plumbing: ``python -m benchmarks.encode_cpu --smoke`` end to end (a random artifact, two
layers, two sizes): both tables timed side by side, the pages they write identical, results only in --out, the
headline untouched."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import headline_bytes
from vllm_temporalkv.ops import cpu

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not cpu.available(), reason="the C++ extension (the encode timed) is not built")
def test_encode_cpu_smoke(tmp_path):
    before = headline_bytes()
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "benchmarks.encode_cpu", "--smoke", "--out", str(out)], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "encode-cpu-smoke.json").read_text())
    assert rep["smoke"] and rep["layers"] == 2 and rep["default_f32_blocks"] == cpu.encode_f32_blocks()
    assert [t["tokens"] for t in rep["tables"]] == [64, 320]
    for t in rep["tables"]:
        assert t["same_pages"] and len(t["float16_all"]) == len(t["float32_all"]) == rep["reps"]
        assert t["float16_ms"] > 0 and t["float32_ms"] > 0 and t["ratio"] == t["float32_ms"] / t["float16_ms"]
    assert rep["pruning"] == [] and rep["machine"]["cpu_class"]
    md = (out / "encode-cpu-smoke.md").read_text()
    assert "| 320 |" in md and rep["run"]["command"] in md
    assert (out / "encode-cpu-smoke.png").stat().st_size > 0
    assert headline_bytes() == before
