"""benchmarks.retrieval's report: retrieval.json / .md / .png and the headline figures."""

from __future__ import annotations

from pathlib import Path

from ..common import HEADLINE, is_results, merge_headline, write_json
from .stats import BOOT, CI, intervals, samples_per_cell

def _ci(x) -> str:
    return f" [{x[0]:.2f}, {x[1]:.2f}]" if x else ""


def write_markdown(rep: dict, path: Path) -> None:
    st = rep["settings"]
    res = rep["formats"]
    lengths = [str(n) for n in st["lengths"]]
    lines = [f"# Long-context retrieval through the server ({st['name']})", "",
             *[f"Command: `{c}`  " for c in dict.fromkeys(r.get("command", rep["run"]["command"])
                                                          for r in rep["formats"].values())],
             f"Machine (the latest run): {rep['run']['machine']['cpu']}, {rep['run']['time']}  ",
             f"Seed {st['seed']}, greedy, --dtype {st.get('dtype', 'bfloat16')}; haystacks from Jane Austen's "
             "novels; accuracy = share of reference strings in the answer (RULER's string match). Prompts: samples "
             "per task and length (a format run with more samples answers the fewer-sample suite's prompts too).", "",
             f"Brackets: {CI:.0%} bootstrap intervals ({BOOT} resamples of the prompts at each length). The ratio and "
             "difference to auto are paired: on the prompts both answered, with the same draws. With few samples "
             "the intervals are wide.", "",
             "## Average accuracy by length", "",
             "| --kv-cache-dtype | prompts | " + " | ".join(lengths)
             + " | average | ÷ auto | 4k-8k | 4k-8k ÷ auto | 4k-8k - auto |",
             "|---|---|" + "---|" * (len(lengths) + 5)]
    for f, r in res.items():
        if "error" in r:
            lines.append(f"| {f} | | " + " | ".join("–" for _ in lengths) + f" | refused: {r['error'][:120]} | | | |")
            continue
        ratio = f"{r['long_ratio']:.2f}{_ci(r.get('long_ratio_ci'))}" if r.get("long_ratio") is not None else "–"
        avg_ratio = f"{r['ratio']:.2f}{_ci(r.get('ratio_ci'))}" if r.get("ratio") is not None else "–"
        la = "–" if r.get("long_avg") is None else f"{r['long_avg']:.3f}{_ci(r.get('long_ci'))}"
        diff = f"{r['long_diff']:+.3f}{_ci(r.get('long_diff_ci'))}" if r.get("long_diff") is not None else "–"
        lines.append(f"| {f} | {samples_per_cell(r['records'])} | "
                     + " | ".join(f"{r['per_length'].get(n, float('nan')):.3f}" for n in lengths)
                     + f" | {r['avg_accuracy']:.3f}{_ci(r.get('avg_ci'))} | {avg_ratio} | {la} | {ratio} | {diff} |")
    lines += ["", "## Per task (all lengths)", "", "| --kv-cache-dtype | " + " | ".join(st["tasks"]) + " |",
              "|---|" + "---|" * len(st["tasks"])]
    for f, r in res.items():
        if "error" not in r:
            lines.append(f"| {f} | " + " | ".join(f"{r['per_task'].get(t, float('nan')):.3f}" for t in st["tasks"]) + " |")
    lines += ["", "## Per task and length", "", "| --kv-cache-dtype | " + " | ".join(
        f"{t}@{n}" for t in st["tasks"] for n in lengths) + " |", "|---|" + "---|" * (len(st["tasks"]) * len(lengths))]
    for f, r in res.items():
        if "error" not in r:
            lines.append(f"| {f} | " + " | ".join(f"{r['cells'].get(f'{t}@{n}', float('nan')):.2f}"
                                                  for t in st["tasks"] for n in lengths) + " |")
    lines += ["", "## Wall time", "", "÷ auto only where auto's suite ran on the same machine (a resumed file may hold "
              "formats timed on others; \"earlier run\": a format scored before the machine was recorded).  Output "
              "tokens: what the greedy answers generated (each stops at its own end of text, so formats do different "
              "amounts of decode work; – where the records predate the count).", "",
              "| --kv-cache-dtype | machine | server start-up s | prompts timed | suite s | s per prompt | output tokens "
              "| ÷ auto |",
              "|---|---|---|---|---|---|---|---|"]
    ratios = wall_ratios(res)
    for f, r in res.items():
        if "error" not in r and r.get("suite_s") is not None:
            ratio = f"{ratios[f]:.2f}" if f in ratios else "–"
            lines.append(f"| {f} | {r.get('machine', 'earlier run')} | {r.get('startup_s', '–')} | "
                         f"{r.get('suite_prompts', len(r['records']))} | {r['suite_s']} | {_per_prompt(r):.1f} | "
                         f"{_output_tokens(r)} | {ratio} |")
    path.write_text("\n".join(lines) + "\n")


def _output_tokens(r: dict) -> str:
    n = [x.get("completion_tokens") for x in r["records"]]
    return str(sum(n)) if n and None not in n else "–"


def _per_prompt(r: dict) -> float:
    return r["suite_s"] / r.get("suite_prompts", len(r["records"]))


def wall_ratios(res: dict) -> dict:
    """Each format's seconds per prompt ÷ auto's, for the formats timed on auto's machine (none when auto is missing,
    failed, or mixes machines): wall times of two machines, or of a VM's different hours, are not a ratio."""
    auto = res.get("auto", {})
    if "error" in auto or not auto.get("suite_s") or auto.get("machine") in (None, "mixed"):
        return {}
    base = _per_prompt(auto)
    return {f: _per_prompt(r) / base for f, r in res.items()
            if "error" not in r and r.get("suite_s") is not None and r.get("machine") == auto["machine"]}


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st, res = rep["settings"], rep["formats"]
    ok = {f: r for f, r in res.items() if "error" not in r}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for f, r in ok.items():
        xs = [int(n) for n in r["per_length"]]
        style = "-" if f.startswith("temporalkv") else ("--" if f in ("auto", "fp8") else ":")
        line, = axes[0].plot(xs, list(r["per_length"].values()), style, marker="o", label=f)
        if "per_length_ci" in r:  # the bootstrap interval as a band
            lo, hi = zip(*(r["per_length_ci"][n] for n in r["per_length"]))
            axes[0].fill_between(xs, lo, hi, color=line.get_color(), alpha=0.08)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(st["lengths"], [str(n) for n in st["lengths"]])
    axes[0].set_xlabel("context length (tokens)")
    axes[0].set_ylabel("average accuracy over tasks")
    axes[0].legend(fontsize=7, ncol=2)
    tasks = st["tasks"]
    w = 0.8 / max(1, len(ok))
    for i, (f, r) in enumerate(ok.items()):
        axes[1].bar([j + i * w for j in range(len(tasks))], [r["per_task"].get(t, 0) for t in tasks], w, label=f)
    axes[1].set_xticks([j + 0.4 - w / 2 for j in range(len(tasks))], tasks, rotation=20, fontsize=8)
    axes[1].set_ylabel("accuracy (all lengths)")
    fig.suptitle(f"Retrieval through the server, {st['name']} ({rep['run']['machine']['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def results_stem(name: str) -> str:
    """The results files' stem: `retrieval` for the default model (smollm2), `retrieval-<name>` for another, so
    that each model's suite keeps its own files (and --resume) in one --out."""
    return "retrieval" if name == "smollm2" else f"retrieval-{name}"


def report(rep: dict, out: Path, stem: str = "retrieval") -> dict:
    """Averages, intervals, <stem>.{json,md,png}; the headline when --out is the results folder."""
    st, results = rep["settings"], rep["formats"]
    long = [str(n) for n in st["lengths"] if n >= 4096]
    for r in results.values():
        if "error" not in r:
            r["long_avg"] = sum(r["per_length"][n] for n in long) / len(long) if long else None
            r["samples"] = samples_per_cell(r["records"])
    intervals(results, st["lengths"])
    ratios = wall_ratios(results)
    for f, r in results.items():  # recomputed on every render: a top-up on another machine withdraws it
        r.pop("wall_ratio_vs_auto", None)
        if f in ratios and f != "auto":
            r["wall_ratio_vs_auto"] = ratios[f]
    write_json(out / f"{stem}.json", rep)
    write_markdown(rep, out / f"{stem}.md")
    plot(rep, out / f"{stem}.png")
    if is_results(out):
        figs = {f"retrieval.{st['name']}.{f}.wall_ratio_vs_auto": r["wall_ratio_vs_auto"]
                for f, r in results.items() if "wall_ratio_vs_auto" in r}  # seconds per prompt ÷ auto's
        for f, r in results.items():
            if "error" not in r:
                p = f"retrieval.{st['name']}.{f}."
                figs[p + "avg_accuracy"] = r["avg_accuracy"]
                figs[p + "samples"] = r["samples"]  # prompts per task and length
                if "avg_ci" in r:
                    figs[p + "avg_accuracy_ci_low"], figs[p + "avg_accuracy_ci_high"] = r["avg_ci"]
                if r.get("ratio") is not None:  # every length, paired with auto on the prompts both answered
                    figs[p + "ratio_vs_auto"] = r["ratio"]
                    if "ratio_ci" in r:
                        figs[p + "ratio_vs_auto_ci_low"], figs[p + "ratio_vs_auto_ci_high"] = r["ratio_ci"]
                if r.get("long_avg") is not None:  # the lengths >= 4096 (the issue's 4k-8k criterion)
                    figs[p + "avg_accuracy_4k_8k"] = r["long_avg"]
                    if "long_ci" in r:
                        figs[p + "avg_accuracy_4k_8k_ci_low"], figs[p + "avg_accuracy_4k_8k_ci_high"] = r["long_ci"]
                if r.get("long_ratio") is not None:  # paired with auto on the prompts both answered
                    figs[p + "ratio_vs_auto_4k_8k"] = r["long_ratio"]
                    if "long_ratio_ci" in r:
                        figs[p + "ratio_vs_auto_4k_8k_ci_low"], figs[p + "ratio_vs_auto_4k_8k_ci_high"] = r["long_ratio_ci"]
        merge_headline(figs, HEADLINE)
    print((out / f"{stem}.md").read_text())
    return rep
