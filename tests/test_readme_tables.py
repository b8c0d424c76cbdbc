"""The README's results tables are generated from headline.json: every figure lands in its table."""

import json

from tests.helpers import bench_call

RENDER = "import json, sys\nfrom benchmarks.readme import render\nprint(json.dumps(render(json.loads(sys.argv[1]))))"


def test_render_places_every_kind_of_figure():
    h = {"quality.brown.bf16.ppl": 32.0, "quality.brown.temporalkv-2bit.ppl": 40.5,
         "quality.brown.temporalkv-2bit.bits_per_float": 2.08, "quality.brown.qjl.ppl": 33.1,
         "quality.brown.qjl.bits_per_float": 4.5,
         "capacity.smollm2-cpu.temporalkv-2bit.ratio_vs_auto": 7.1, "capacity.smollm2-cpu.fp8.ratio_vs_auto": 2.0,
         "retrieval.smollm2.auto.avg_accuracy": 0.8, "retrieval.smollm2.auto.avg_accuracy_4k_8k": 0.5,
         "retrieval.smollm2.temporalkv-2bit.avg_accuracy": 0.7, "retrieval.smollm2.temporalkv-2bit.avg_accuracy_4k_8k": 0.4,
         "retrieval.smollm2.auto.samples": 10, "retrieval.smollm2.temporalkv-2bit.samples": 10,
         "retrieval.smollm2.temporalkv-4bit.avg_accuracy": 0.75, "retrieval.smollm2.temporalkv-4bit.avg_accuracy_4k_8k": 0.45,
         "retrieval.smollm2.temporalkv-4bit.ratio_vs_auto_4k_8k": 0.95,
         "retrieval.smollm2.temporalkv-4bit.ratio_vs_auto_4k_8k_ci_low": 0.81,
         "retrieval.smollm2.temporalkv-4bit.ratio_vs_auto_4k_8k_ci_high": 1.02,
         "retrieval.smollm2.temporalkv-4bit.ratio_vs_auto": 0.93, "retrieval.smollm2.temporalkv-4bit.ratio_vs_auto_ci_low": 0.85,
         "retrieval.smollm2.temporalkv-4bit.ratio_vs_auto_ci_high": 1.0,
         "throughput.h100-l8b.8192-512.auto.output_tok_s": 1234.5,
         "fisher.wiki-leads-8w.temporalkv-2bit@fisher.proxy_in_sample": 0.0957,
         "fisher.wiki-leads-8w.temporalkv-2bit@fisher.proxy_held_out": 0.3232,
         "fisher.wiki-leads-8w.temporalkv-2bit@fisher.ppl_held_out": 40.42}
    text = bench_call(RENDER, json.dumps(h))
    assert "| 16 (bf16) | 32.00 |" in text and "40.50" in text
    pareto = [ln for ln in text.splitlines() if ln.startswith(("| qjl |", "| temporalkv-2bit | 2.08"))]
    assert pareto == ["| qjl | 4.50 | 33.10 | 1.03 |", "| temporalkv-2bit | 2.08 | 40.50 | 1.27 |"]
    assert "7.10" in text and "fp8 2.00×" in text
    lines = text.splitlines()
    auto = next(i for i, ln in enumerate(lines) if ln.startswith("| auto |"))
    assert lines[auto] == "| auto | 10 | 0.800 | 1.00 | 0.500 | 1.00 |"
    assert lines[auto + 1] == "| temporalkv-2bit | 10 | 0.700 | – | 0.400 | 0.80 |"
    # a paired ratio (on the prompts both answered) is shown as measured, not as a ratio of the means
    # (both: over every length, and at 4k-8k)
    assert lines[auto + 2] == "| temporalkv-4bit | – | 0.750 | 0.93 [0.85, 1.00] | 0.450 | 0.95 [0.81, 1.02] |"
    assert "| wiki-leads-8w | temporalkv-2bit | fisher | 0.096 | 0.323 | 40.42 |" in lines
    assert "throughput.h100-l8b.8192-512.auto.output_tok_s" in text and "1234.500" in text


def test_render_keeps_models_apart():
    """Another model's perplexities (quality.<data>.<model>.<format>.*, benchmarks.quality's model_tag) get their
    own tables, linked to their own files; the default model's tables are not touched by them."""
    smol = {"quality.brown.bf16.ppl": 32.0, "quality.brown.temporalkv-2bit.ppl": 40.5,
            "quality.brown.temporalkv-2bit.bits_per_float": 2.08}
    qwen = {"quality.brown.qwen2.5-1.5b.bf16.ppl": 10.0, "quality.brown.qwen2.5-1.5b.temporalkv-2bit.ppl": 11.0,
            "quality.brown.qwen2.5-1.5b.temporalkv-2bit.bits_per_float": 2.05}
    alone, both = bench_call(RENDER, json.dumps(smol)), bench_call(RENDER, json.dumps({**smol, **qwen}))
    lines = both.splitlines()
    assert all(ln in lines for ln in alone.splitlines())  # SmolLM2's tables as they were
    assert "**Perplexity, brown, qwen2.5-1.5b**" in both and "benchmarks/results/quality-qwen2.5-1.5b.md" in both
    assert "| 16 (bf16) | 10.00 |" in both and "benchmarks/results/quality-qwen2.5-1.5b_pareto.png" in both
    pareto = [ln for ln in both.splitlines() if ln.startswith("| temporalkv-2bit |")]
    assert pareto == ["| temporalkv-2bit | 2.08 | 40.50 | 1.27 |", "| temporalkv-2bit | 2.05 | 11.00 | 1.10 |"]
    assert "qwen2.5-1.5b.temporalkv-2bit" not in both  # never a row of the default model's tables


def test_quality_model_tag():
    """SmolLM2 keeps its keys and files (no model part); Qwen's are quality-qwen2.5-1.5b.*, other models' the
    folder / GGUF name."""
    code = ("import json, sys\nfrom benchmarks.quality import model_tag\n"
            "print(json.dumps([model_tag(m or None) for m in sys.argv[1:]]))")
    assert bench_call(code, "", "smollm2", "qwen2.5-coder-1.5b", "/x/My Model.gguf", "/m/llama-3.1-8b/") == [
        "", "", "qwen2.5-1.5b", "my-model", "llama-3.1-8b"]


def test_choice_table_and_wall_ratios():
    """The per-model choice table joins a model's quality and retrieval figures (SmolLM2's quality keys carry no
    model part); a retrieval run named for a machine gets no row there, and its wall-time ratios a column of
    their own in its retrieval table."""
    h = {"quality.brown.bf16.ppl": 32.0, "quality.brown.temporalkv-2bit.ppl": 40.0,
         "quality.brown.temporalkv-2bit.bits_per_float": 2.08,
         "retrieval.smollm2.auto.avg_accuracy": 0.8, "retrieval.smollm2.temporalkv-2bit.avg_accuracy": 0.4,
         "retrieval.smollm2.temporalkv-2bit.ratio_vs_auto_4k_8k": 0.5,
         "retrieval.smollm2.temporalkv-2bit.ratio_vs_auto_4k_8k_ci_low": 0.4,
         "retrieval.smollm2.temporalkv-2bit.ratio_vs_auto_4k_8k_ci_high": 0.6,
         "retrieval.smollm2-cpu-amx.auto.avg_accuracy": 0.5,
         "retrieval.smollm2-cpu-amx.temporalkv-2bit.avg_accuracy": 0.4,
         "retrieval.smollm2-cpu-amx.temporalkv-2bit.wall_ratio_vs_auto": 1.25}
    lines = bench_call(RENDER, json.dumps(h)).splitlines()
    assert "| smollm2 | auto | – | 1.00 | 1.00 |" in lines  # (no bits: the headline has no bf16 bits figure)
    assert "| smollm2 | temporalkv-2bit | 2.08 | 1.25 | 0.50 [0.40, 0.60] |" in lines
    assert not any(ln.startswith("| smollm2-cpu-amx |") for ln in lines)
    amx = lines.index(next(ln for ln in lines if "retrieval through the server, smollm2-cpu-amx" in ln))
    assert lines[amx + 2].endswith("| 4k-8k ÷ auto | wall ÷ auto |")
    assert "| auto | – | 0.500 | 1.00 | – | – | 1.00 |" in lines[amx:]
    assert "| temporalkv-2bit | – | 0.400 | – | – | – | 1.25 |" in lines[amx:]
    smol = lines.index(next(ln for ln in lines if "retrieval through the server, smollm2**" in ln))
    assert lines[smol + 2].endswith("| 4k-8k ÷ auto |")  # no wall column where nothing was timed


def test_fractional_outlier_share_in_keys():
    """A format named with a fractional outlier share (temporalkv-2bit-cv-o0.5: 0.5% outliers) holds a dot, as a
    model's name may (qwen2.5-1.5b): its figures land in its own rows, for the default model and another one."""
    h = {"quality.brown.bf16.ppl": 32.0, "quality.brown.temporalkv-2bit-o0.5.ppl": 36.0,
         "quality.brown.temporalkv-2bit-o0.5.bits_per_float": 2.23,
         "quality.brown.qwen2.5-1.5b.bf16.ppl": 20.0, "quality.brown.qwen2.5-1.5b.temporalkv-2bit-cv-o0.5.ppl": 21.0,
         "quality.brown.qwen2.5-1.5b.temporalkv-2bit-cv-o0.5.bits_per_float": 2.23,
         "retrieval.qwen2.5-1.5b.auto.avg_accuracy": 0.9,
         "retrieval.qwen2.5-1.5b.temporalkv-2bit-cv-o0.5.avg_accuracy": 0.8,
         "retrieval.qwen2.5-1.5b.temporalkv-2bit-cv-o0.5.ratio_vs_auto_4k_8k": 0.85,
         "retrieval.qwen2.5-1.5b.temporalkv-2bit-cv-o0.5.ratio_vs_auto_4k_8k_ci_low": 0.7,
         "retrieval.qwen2.5-1.5b.temporalkv-2bit-cv-o0.5.ratio_vs_auto_4k_8k_ci_high": 0.95}
    text = bench_call(RENDER, json.dumps(h))
    lines = text.splitlines()
    assert "| qwen2.5-1.5b | temporalkv-2bit-cv-o0.5 | 2.23 | 1.05 | 0.85 [0.70, 0.95] |" in lines
    assert "| temporalkv-2bit-o0.5 | 2.23 | 36.00 | 1.12 |" in lines  # the default model's every-method table
    assert "| temporalkv-2bit-cv-o0.5 | 2.23 | 21.00 | 1.05 |" in lines
    assert "| temporalkv-2bit-cv-o0.5 | – | 0.800 | – | – | 0.85 [0.70, 0.95] |" in lines
    assert "temporalkv-2bit-o0" + "|" not in text.replace(" ", "") and "| 5 |" not in text


def test_causal_protocol_tables():
    """benchmarks.quality --protocol causal writes quality.<data>-causal.* keys and quality[-<model>]-causal.* files:
    its tables say so and link those files; the thesis tables keep their titles."""
    h = {"quality.brown.bf16.ppl": 32.0, "quality.brown.temporalkv-2bit.ppl": 40.0,
         "quality.brown-causal.qwen2.5-1.5b.bf16.ppl": 20.0,
         "quality.brown-causal.qwen2.5-1.5b.temporalkv-2bit.ppl": 21.0,
         "quality.brown-causal.qwen2.5-1.5b.temporalkv-2bit.bits_per_float": 2.08}
    lines = bench_call(RENDER, json.dumps(h)).splitlines()
    causal = [ln for ln in lines if ln.startswith("**") and "causal" in ln]
    assert len(causal) == 2 and all("brown, qwen2.5-1.5b** (" in ln for ln in causal)
    assert "benchmarks/results/quality-qwen2.5-1.5b-causal.md" in causal[0]
    assert "benchmarks/results/quality-qwen2.5-1.5b-causal_pareto.png" in causal[1]
    assert any(ln.startswith("**Perplexity, brown** (simulated compression, thesis protocol;") for ln in lines)


def test_served_ppl_table():
    """Perplexity through the server (benchmarks.served_ppl): a row per format, auto and fp8 first, its ratio to auto
    and its reference; another model's figures in a table of their own."""
    h = {"served_ppl.brown.auto.ppl": 32.5, "served_ppl.brown.auto.ratio_vs_auto": 1.0,
         "served_ppl.brown.auto.reference_ppl": 32.4, "served_ppl.brown.fp8.ppl": 33.0,
         "served_ppl.brown.fp8.ratio_vs_auto": 1.015, "served_ppl.brown.temporalkv-2bit.ppl": 39.9,
         "served_ppl.brown.temporalkv-2bit.ratio_vs_auto": 1.228, "served_ppl.brown.temporalkv-2bit.reference_ppl": 40.1,
         "served_ppl.brown.qwen2.5-1.5b.auto.ppl": 21.5}
    lines = bench_call(RENDER, json.dumps(h)).splitlines()
    at = lines.index("| --kv-cache-dtype | served ppl | ÷ auto | reference ppl |")
    assert lines[at + 2 : at + 5] == ["| auto | 32.50 | 1.000 | 32.40 |", "| fp8 | 33.00 | 1.015 | – |",
                                      "| temporalkv-2bit | 39.90 | 1.228 | 40.10 |"]
    assert any(ln.startswith("**Perplexity through the server, brown, qwen2.5-1.5b**") for ln in lines)
    assert "| auto | 21.50 | – | – |" in lines


def test_cpu_speed_table_marks_each_class_against_its_target():
    """Issue 33's figures per CPU class, from the keys of the machines that ran them: each against its target
    (≥ for throughput and kernels, ≤ for wall time), a figure a class never measured a dash, a figure no class
    measured no row."""
    h = {"throughput.smollm2-cpu-amx.decode-heavy.temporalkv-2bit.ratio_vs_auto": 0.83,
         "throughput.smollm2-cpu-xyz.decode-heavy.temporalkv-2bit.ratio_vs_auto": 1.1,
         "retrieval.smollm2-cpu-amx.qjl.wall_ratio_vs_auto": 1.34,
         "retrieval.smollm2-cpu-xyz.qjl.wall_ratio_vs_auto": 1.02,
         "kernels.cpu-xyz.b8-l8192.temporalkv-2bit.speedup_vs_vllm_bf16": 1.5,
         "kernels.cpu.b8-l8192.temporalkv-2bit.speedup_vs_vllm_bf16": 0.5,  # (no class: not this table's)
         "throughput.smollm2-cpu-xyz-short.short-128.temporalkv-2bit.ratio_vs_auto": 0.9}  # (no target's figure)
    lines = bench_call(RENDER, json.dumps(h)).splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("**CPU speed against bf16")))
    assert lines[head + 2] == "| figure | format | target | amx | xyz |"
    rows = lines[head + 4:lines.index("", head + 2)]
    assert rows == ["| decode-heavy throughput ÷ auto | temporalkv-2bit | ≥ 1.1 | 0.83 ✗ | 1.10 ✓ |",
                    "| retrieval suite's wall time ÷ auto's | qjl | ≤ 1.1 | 1.34 ✗ | 1.02 ✓ |",
                    "| decode kernel ÷ vLLM's bf16 op, batch 8 × 8k, Llama-8B shape | temporalkv-2bit | ≥ 1 | – | 1.50 ✓ |"]
    assert "CPU speed against bf16" not in bench_call(RENDER, json.dumps({"kernels.cpu.b8-l8192.x.speedup_vs_vllm_bf16": 1}))
