"""Regenerate the README's results tables from benchmarks/results/headline.json (never by hand).

    python -m benchmarks.readme          # rewrites the block between the results markers
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from vllm_temporalkv.formats import FORMATS

from .common import HEADLINE
from .retrieval.report import results_stem

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
METHODS = ("kvquant", "channelkv", "temporalkv")


def _fmt(x: float | None, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


# a format's name in a headline key: no dots, but a fractional outlier share (temporalkv-2bit-cv-o0.5); the model part
# before it is matched lazily, as a model's name may hold dots too (qwen2.5-1.5b), and never ends in "-o<digit>"
FORMAT = r"([^.]+?-o\d+\.\d+|[^.]+)"


def _grouped(h: dict, pattern: str) -> dict[str, dict[str, dict[str, float]]]:
    """Headline keys matching pattern's three groups (where, name, metric) -> {where: {name: {metric: value}}}."""
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for k, v in h.items():
        m = re.fullmatch(pattern, k)
        if m:
            rows.setdefault(m.group(1), {}).setdefault(m.group(2), {})[m.group(3)] = v
    return rows


def _by_data_model(h: dict, bench: str, metrics: str) -> dict[tuple[str, str], dict[str, dict[str, float]]]:
    """<bench>.<data>[.<model>].<format>.<metric> (metric one of the alternatives `metrics`) -> {(data, model):
    {format: {metric: value}}}; the default SmolLM2's keys have no model part (model ""), another model's a short
    name with dots (qwen2.5-1.5b)."""
    rows: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
    for k, v in h.items():
        m = re.fullmatch(re.escape(bench) + r"\.([^.]+)\.(?:(.+?)(?<!-o\d)\.)?" + FORMAT + rf"\.({metrics})", k)
        if m:
            rows.setdefault((m.group(1), m.group(2) or ""), {}).setdefault(m.group(3), {})[m.group(4)] = v
    return dict(sorted(rows.items()))


def _quality(h: dict) -> dict[tuple[str, str], dict[str, dict[str, float]]]:
    return _by_data_model(h, "quality", "ppl|bits_per_float")


def _where(data: str, model: str) -> tuple[str, str]:
    """A table's title part and its results files' stem (benchmarks.quality's model_tag); the causal protocol's
    keys carry it after the data (quality.brown-causal.*), its files after the model (quality-<model>-causal)."""
    data, causal = data.removesuffix("-causal"), "-causal" if data.endswith("-causal") else ""
    return (f"{data}, {model}", f"quality-{model}{causal}") if model else (data, f"quality{causal}")


def _protocol(data: str) -> str:
    return "causal protocol" if data.endswith("-causal") else "thesis protocol"


def quality_table(h: dict) -> list[str]:
    out = []
    for (data, model), x in _quality(h).items():
        r = {n: m["ppl"] for n, m in x.items() if "ppl" in m}
        if not r:
            continue
        title, stem = _where(data, model)
        out += [f"**Perplexity, {title}** (simulated compression, {_protocol(data)}; lower is better; "
                f"details in [benchmarks/results/{stem}.md](benchmarks/results/{stem}.md))", "",
                "| bits | " + " | ".join(f"{m} | {m} +1% outliers" for m in METHODS) + " |",
                "|---|" + "---|" * (2 * len(METHODS))]
        if "bf16" in r:
            out.append(f"| 16 (bf16) | {_fmt(r['bf16'])} |" + " |" * (2 * len(METHODS) - 1))
        for bits in (4, 2, 1):
            cells = []
            for m in METHODS:
                cells += [_fmt(r.get(f"{m}-{bits}bit")), _fmt(r.get(f"{m}-{bits}bit-o1"))]
            out.append(f"| {bits} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def pareto_table(h: dict) -> list[str]:
    """Every method with a measured all-in bits per float, fewest bits last: the frontier a user picks from."""
    out = []
    for (data, model), r in _quality(h).items():
        pts = {n: x for n, x in r.items() if "bits_per_float" in x and "ppl" in x and n != "bf16"}
        if not pts:
            continue
        base = r.get("bf16", {}).get("ppl")
        title, stem = _where(data, model)
        out += [f"**Every method at its all-in bits per float, {title}** (codes, scales, norms, means, outliers, "
                "sinks and recent windows at 2048 tokens; every method as served but TaDA's per-layer mix, simulated, "
                f"{_protocol(data)}; "
                f"chart: [benchmarks/results/{stem}_pareto.png](benchmarks/results/{stem}_pareto.png))", "",
                "| method | bits/float | ppl | ppl ÷ bf16 |", "|---|---|---|---|"]
        for n, x in sorted(pts.items(), key=lambda kv: (-kv[1]["bits_per_float"], kv[1]["ppl"])):
            out.append(f"| {n} | {_fmt(x['bits_per_float'])} | {_fmt(x['ppl'])} | "
                       f"{_fmt(x['ppl'] / base) if base else '–'} |")
        out.append("")
    return out


def served_ppl_table(h: dict) -> list[str]:
    """served_ppl.<data>[.<model>].<format>.<metric> (benchmarks.served_ppl): one table per data and model."""
    out = []
    for (data, model), r in _by_data_model(h, "served_ppl", "ppl|ratio_vs_auto|reference_ppl").items():
        stem = "served-ppl" + (f"-{model}" if model else "")
        out += [f"**Perplexity through the server, {data}{', ' + model if model else ''}** (each format's own prompt "
                f"logprobs over HTTP; reference: the same windows under the causal protocol in float32 transformers, "
                f"the same artifact; paired intervals and the command in "
                f"[benchmarks/results/{stem}.md](benchmarks/results/{stem}.md))", "",
                "| --kv-cache-dtype | served ppl | ÷ auto | reference ppl |", "|---|---|---|---|"]
        for f, x in sorted(r.items(), key=lambda kv: (kv[0] != "auto", kv[0] != "fp8", kv[0])):
            out.append(f"| {f} | {_fmt(x.get('ppl'))} | {_fmt(x.get('ratio_vs_auto'), 3)} | "
                       f"{_fmt(x.get('reference_ppl'))} |")
        out.append("")
    return out


def capacity_table(h: dict) -> list[str]:
    rows: dict[str, dict[str, float]] = {}
    for k, v in h.items():
        m = re.fullmatch(r"capacity\.([^.]+)\.(.+)\.ratio_vs_auto", k)
        if m:
            rows.setdefault(m.group(1), {})[m.group(2)] = v
    out = []
    for where, r in sorted(rows.items()):
        out += [f"**KV capacity vLLM reports, {where}** (tokens that fit in the same KV memory ÷ those for "
                f"`--kv-cache-dtype auto`; details in [benchmarks/results/capacity.md](benchmarks/results/capacity.md))",
                "", "| bits | " + " | ".join(f"{m} | {m} +1% outliers" for m in METHODS) + " |",
                "|---|" + "---|" * (2 * len(METHODS))]
        ours = [n for n in r if not any(n.startswith(m + "-") for m in METHODS)]
        seeds = [f"{n} {_fmt(r[n])}×" for n in sorted(ours) if n in FORMATS]  # served here, not by vLLM
        others = [f"{n} {_fmt(r[n])}×" for n in sorted(ours) if n not in FORMATS]
        grid = set()
        for bits in (4, 2, 1):
            cells = []
            for m in METHODS:
                cells += [_fmt(r.get(f"{m}-{bits}bit")), _fmt(r.get(f"{m}-{bits}bit-o1"))]
                grid |= {f"{m}-{bits}bit", f"{m}-{bits}bit-o1"}
            out.append(f"| {bits} | " + " | ".join(cells) + " |")
        # bits spent unevenly (per layer, per K / V) and page options (@blockN, @windowN): in capacity.md
        variants = [f"{n} {_fmt(r[n])}×" for n in sorted(r) if n in FORMATS and n not in grid and n not in ours]
        if variants:
            out += ["", "Bits per layer or per K / V: " + ", ".join(variants)]
        if others:
            out += ["", "vLLM's own formats: " + ", ".join(others)]
        if seeds:
            out += ["", "Seed methods this plugin serves (their recent window of 128 half-precision tokens in every "
                        "page): " + ", ".join(seeds)]
        out.append("")
    return out


def retrieval_table(h: dict) -> list[str]:
    rows = _grouped(h, r"retrieval\.(.+?)\." + FORMAT + r"\.((?:avg_accuracy(?:_4k_8k)?|ratio_vs_auto(?:_4k_8k)?)(?:_ci_low|_ci_high)?"
                       r"|samples|wall_ratio_vs_auto)")
    out = []
    for name, r in sorted(rows.items()):
        base, stem = r.get("auto", {}), results_stem(name)
        wall = any("wall_ratio_vs_auto" in x for x in r.values())  # a run timed on one machine
        out += [f"**Long-context retrieval through the server, {name}** (RULER-style tasks, accuracy 0-1; details, "
                f"paired comparisons and the command in [benchmarks/results/{stem}.md](benchmarks/results/{stem}.md); "
                f"brackets: 95% bootstrap intervals over the prompts; prompts: samples per task and length; the ratios "
                f"(every length, and 4k-8k) are paired with auto on the prompts both answered"
                + ("; wall: the suite's seconds per prompt ÷ auto's, on one machine)" if wall else ")"), "",
                "| --kv-cache-dtype | prompts | average | ÷ auto | 4k-8k | 4k-8k ÷ auto |" + (" wall ÷ auto |" if wall else ""),
                "|---|---|---|---|---|---|" + ("---|" if wall else "")]
        def ci(x, metric):  # the 95% bootstrap interval, where the run measured one
            lo, hi = x.get(metric + "_ci_low"), x.get(metric + "_ci_high")
            return "" if lo is None or hi is None else f" [{lo:.2f}, {hi:.2f}]"

        for f, x in sorted(r.items(), key=lambda kv: (kv[0] != "auto", kv[0] != "fp8", kv[0])):
            long, bl = x.get("avg_accuracy_4k_8k"), base.get("avg_accuracy_4k_8k")
            if x.get("ratio_vs_auto_4k_8k") is not None:
                ratio = _fmt(x["ratio_vs_auto_4k_8k"]) + ci(x, "ratio_vs_auto_4k_8k")
            else:  # runs before the paired figure: unpaired means
                ratio = _fmt(long / bl) if long is not None and bl else "–"
            n = x.get("samples")
            every = "1.00" if f == "auto" else _fmt(x.get("ratio_vs_auto")) + (
                ci(x, "ratio_vs_auto") if x.get("ratio_vs_auto") is not None else "")
            out.append(f"| {f} | {'–' if n is None else int(n)} | {_fmt(x.get('avg_accuracy'), 3)}"
                       f"{ci(x, 'avg_accuracy')} | {every} | {_fmt(long, 3)}{ci(x, 'avg_accuracy_4k_8k')} | {ratio} |"
                       + (f" {_fmt(x.get('wall_ratio_vs_auto', 1.0 if f == 'auto' else None))} |" if wall else ""))
        out.append("")
    return out


def choice_table(h: dict, data: str = "brown") -> list[str]:
    """Per model, each format's bits, perplexity ÷ bf16 and needles ÷ auto side by side: what to serve.  Models
    with both a quality and a retrieval run (SmolLM2's quality keys carry no model part, its retrieval's
    `smollm2`; a retrieval run named for a machine, e.g. smollm2-cpu-amx, has no quality of its own)."""
    ret = _grouped(h, r"retrieval\.(.+?)\." + FORMAT + r"\.(ratio_vs_auto_4k_8k(?:_ci_low|_ci_high)?)")
    qual = _quality(h)
    out = []
    for name, r in sorted(ret.items()):
        q = qual.get((data, "" if name == "smollm2" else name), {})
        if not q or "bf16" not in q or "ppl" not in q["bf16"]:
            continue
        if not out:
            out += [f"**Which format, per model** ({data} perplexity ÷ bf16 from the quality tables, simulated, "
                    "thesis protocol; needles: the retrieval tables' 4k-8k accuracy ÷ auto, paired, 95% interval)", "",
                    "| model | format | bits/float | ppl ÷ bf16 | 4k-8k needles ÷ auto |", "|---|---|---|---|---|"]
        bits_of = lambda f: q.get(f, {}).get("bits_per_float", 8.0 if f == "fp8" else None)  # noqa: E731
        fmts = sorted(set(r) - {"auto"}, key=lambda f: (bits_of(f) or 99, f))
        for f in ["auto"] + fmts:
            x, m = r.get(f, {}), q.get("bf16" if f == "auto" else f, {})
            lo, hi = x.get("ratio_vs_auto_4k_8k_ci_low"), x.get("ratio_vs_auto_4k_8k_ci_high")
            needles = "1.00" if f == "auto" else _fmt(x.get("ratio_vs_auto_4k_8k")) + (
                f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else "")
            ppl = _fmt(m["ppl"] / q["bf16"]["ppl"]) if "ppl" in m else "–"
            bits = _fmt(bits_of("bf16" if f == "auto" else f))
            out.append(f"| {name} | {f} | {bits} | {ppl} | {needles} |")
    return out + [""] if out else out


def _fisher_order(row) -> tuple:
    (data, fmt, name), _ = row
    bits = re.search(r"(\d+)bit", fmt)
    windows = re.search(r"(\d+)w$", data)
    return (-int(bits.group(1)) if bits else 0, fmt, int(windows.group(1)) if windows else 0, data, name)


def fisher_table(h: dict) -> list[str]:
    rows: dict[tuple[str, str, str], dict[str, float]] = {}
    for k, v in h.items():
        m = re.fullmatch(r"fisher\.([^.]+)\.([^@]+)@([^.]+)\.(proxy_in_sample|proxy_held_out|ppl_held_out)", k)
        if m:
            rows.setdefault(m.groups()[:3], {})[m.group(4)] = v
    if not rows:
        return []
    out = ["**Fisher-weighted vs plain k-means** (the objective k-means minimizes, 1/2 Σ g² (x - x̂)² in nats per "
           "token, on the calibration text and on held-out Brown text, and the held-out perplexity; details in "
           "[benchmarks/results/fisher.md](benchmarks/results/fisher.md))", "",
           "| calibration | format | k-means | objective, in-sample | objective, held out | ppl, held out |",
           "|---|---|---|---|---|---|"]
    for (data, f, n), r in sorted(rows.items(), key=_fisher_order):
        out.append(f"| {data} | {f} | {n} | {_fmt(r.get('proxy_in_sample'), 3)} | "
                   f"{_fmt(r.get('proxy_held_out'), 3)} | {_fmt(r.get('ppl_held_out'))} |")
    return out + [""]


def cpu_kernels_table(h: dict) -> list[str]:
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for k, v in h.items():
        m = re.fullmatch(r"kernels\.cpu\.([^.]+)\.([^.]+)\.(speedup_vs_vllm_(?:bf16|f32)|speedup_vs_torch)", k)
        if m:
            step = m.group(1)
            dt = "f32" if step.startswith("f32-") else "bf16"
            metric = "vllm" if m.group(3).startswith("speedup_vs_vllm") else "torch"
            rows.setdefault((dt, step.removeprefix("f32-"), m.group(2)), {})[metric] = v
    if not rows:
        return []
    out = ["**CPU attention kernels, one layer** (C++ from the codes ÷ vLLM's own CPU attention on a cache of the "
           "model's dtype, and ÷ the torch path, timed side by side; Llama-3.1-8B shapes unless marked smollm2; "
           "details and the machine in [benchmarks/results/kernels-cpu.md](benchmarks/results/kernels-cpu.md) (bf16) "
           "and [kernels-cpu-f32.md](benchmarks/results/kernels-cpu-f32.md) (float32, what serves fastest on CPUs "
           "without bf16 units))", "",
           "| model dtype | step | format | speedup vs vLLM (same dtype) | speedup vs torch path |", "|---|---|---|---|---|"]
    for (dt, step, f), r in sorted(rows.items()):
        out.append(f"| {dt} | {step} | {f} | {_fmt(r.get('vllm'))} | {_fmt(r.get('torch'), 1)} |")
    return out + [""]


# Issue 33's targets for a CPU machine class, each run side by side with `auto` on one machine (scripts/cpu-figures.sh
# makes every figure): (row label, headline key with {model} / {cls} / {fmt} to fill, format, comparison, target)
CPU_TARGETS = (
    ("decode-heavy throughput ÷ auto", "throughput.{model}-cpu-{cls}.decode-heavy.{fmt}.ratio_vs_auto",
     "temporalkv-2bit", ">=", 1.1),
    ("prefill-heavy throughput ÷ auto", "throughput.{model}-cpu-{cls}.prefill-heavy.{fmt}.ratio_vs_auto",
     "temporalkv-2bit", ">=", 0.9),
    *(("retrieval suite's wall time ÷ auto's", "retrieval.{model}-cpu-{cls}.{fmt}.wall_ratio_vs_auto", f, "<=", 1.1)
      for f in ("temporalkv-2bit", "temporalkv-k4v2", "selective-int4", "tada-4bit", "qjl")),
    ("decode kernel ÷ vLLM's bf16 op, batch 8 × 8k, Llama-8B shape", "kernels.cpu-{cls}.b8-l8192.{fmt}.speedup_vs_vllm_bf16",
     "temporalkv-2bit", ">=", 1.0),
)


def cpu_speed_table(h: dict, model: str = "smollm2") -> list[str]:
    """Issue 33's figures per CPU class (the classes any of its keys name: amx, avx512bf16, ...), each against its
    target: what is met where, at a glance.  The figures are the tables' below (throughput, retrieval, kernels)."""
    found = set()
    for _, key, fmt, _, _ in CPU_TARGETS:  # the classes some target's figure was measured on
        pattern = re.escape(key).replace(re.escape("{cls}"), "([^.]+)")
        pattern = pattern.replace(re.escape("{model}"), re.escape(model)).replace(re.escape("{fmt}"), re.escape(fmt))
        found |= {m.group(1) for m in map(re.compile(pattern).fullmatch, h) if m}
    classes = sorted(found)
    rows = []
    for label, key, fmt, op, target in CPU_TARGETS:
        cells = []
        for cls in classes:
            v = h.get(key.format(model=model, cls=cls, fmt=fmt))
            met = v is not None and (v >= target if op == ">=" else v <= target)
            cells.append("–" if v is None else f"{v:.2f} {'✓' if met else '✗'}")
        if any(c != "–" for c in cells):
            rows.append(f"| {label} | {fmt} | {'≥' if op == '>=' else '≤'} {target:g} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [f"**CPU speed against bf16, per CPU class** (issue 33's targets, {model}, bf16 serving, each figure "
            "measured side by side with `--kv-cache-dtype auto` on one machine of the class - "
            "`scripts/cpu-figures.sh` runs every command; ✓ met, ✗ not; the figures and their runs in the tables "
            "below and [benchmarks/results/cpu-speed-log.md](benchmarks/results/cpu-speed-log.md))", "",
            "| figure | format | target | " + " | ".join(classes) + " |",
            "|---|---|---|" + "---|" * len(classes)] + rows + [""]


def generic_table(h: dict, bench: str, title: str, skip: str | None = None) -> list[str]:
    items = {k: v for k, v in h.items() if k.startswith(bench + ".") and not (skip and k.startswith(skip))}
    if not items:
        return []
    out = [f"**{title}**", "", "| figure | value |", "|---|---|"]
    # counts as whole numbers (mutations, KV tokens), tiny values (logprob differences) in scientific notation,
    # the rest to 3 decimals
    out += [f"| `{k}` | {int(v) if float(v).is_integer() and abs(v) >= 2 else f'{v:.1e}' if 0 < abs(v) < 1e-3 else _fmt(v, 3)} |"
            for k, v in sorted(items.items())]
    return out + [""]


def render(h: dict) -> str:
    lines = quality_table(h)
    lines += pareto_table(h)
    lines += served_ppl_table(h)
    lines += capacity_table(h)
    lines += fisher_table(h)
    lines += retrieval_table(h)
    lines += choice_table(h)
    lines += cpu_speed_table(h)
    lines += cpu_kernels_table(h)
    lines += generic_table(h, "kernels", "Kernels", skip="kernels.cpu.")
    lines += generic_table(h, "throughput", "Throughput")
    lines += generic_table(h, "encode", "A prompt's cache write, float32 ÷ float16 codebook tables (time; "
                                        "benchmarks/results/encode-cpu-<cpu class>.md)")
    lines += generic_table(h, "prefix", "Prefix caching (N requests sharing a P-token prefix through the server: "
                                        "benchmarks/results/prefix.md; "
                                        "prefix-<name>.md for another machine, e.g. smollm2-cpu-amx)")
    lines += generic_table(h, "stress", "Reliability (load and faults: benchmarks/results/stress.md; artifact "
                                            "fuzzing: benchmarks/results/artifact-fuzz.md)")
    return "\n".join(lines).strip() + "\n"


def main() -> None:
    h = json.loads(HEADLINE.read_text()) if HEADLINE.is_file() else {}
    text = README.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"README.md lacks the {START} / {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n<!-- generated by `python -m benchmarks.readme` from "
                      f"benchmarks/results/headline.json; do not edit -->\n\n{render(h)}\n{END}{tail}")
    print(f"updated {README}")


if __name__ == "__main__":
    main()
