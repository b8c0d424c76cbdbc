"""Prefix caching through the server: N requests sharing a P-token prefix, per KV format and page size.

    python -m benchmarks.prefix                                   # auto vs temporalkv-2bit (+ 1024 / 256 / 64-token pages)
    python -m benchmarks.prefix --configs auto temporalkv-2bit --prefix-lens 600 --requests 8
    python -m benchmarks.prefix --smoke                           # ~1-2 min, a temp dir, no headline

A shared-prefix workload as users send it: a P-token prefix of real text (Jane Austen, P in 256 / 600 / 2000 by
default) followed by N distinct questions, sent one after another over the OpenAI API (completions of token ids,
streamed, greedy) to a real `vllm serve` with prefix caching on; every configuration gets the same prompts in the
same order, after one unrelated warm-up request; the configurations take turns --rounds times (3 by default), a
fresh server each, and each one's requests are pooled over its rounds (a slow spell of a shared machine, which can
slow it ~1.5x for minutes, then falls on every configuration alike).  Per configuration and P: vLLM's own prefix-cache hit rate
(``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` from /metrics, over the N requests), the hit rate
whole pages of that size could give at most, time to first token (the first request, which cannot hit, and the
mean of the others, which can) and the total time; the KV capacity and page size the server reports.  A
configuration is a --kv-cache-dtype (on the CPU a codebook format's default pages are small pages: issue 34),
optionally ``@blockN`` (``--block-size N``: pages that carry their own sinks and tail), ``@small`` or ``@big``
(the ``temporalkv_small_pages`` serving option on / off: ``@big``, the 1024-token pages).  ``ttft_ratio_vs_auto``: the mean TTFT of the requests that could hit,
over auto's (auto runs every time; configurations of an earlier run with the same settings are kept unless
measured again, their command recorded).  Writes prefix.json / prefix.md / prefix.png (prefix-<name>.* for another
--name) under --out and, for the formats at their default pages, merges ``prefix.<name>.p<P>.<format>.hit_rate``
and ``.ttft_ratio_vs_auto`` into headline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path

from vllm_temporalkv.formats import FORMATS
from vllm_temporalkv.harness.server import ServerFailed, VLLMServer, scrape_metrics

from . import common

MODEL = "smollm2"
DEFAULT_NAME = "smollm2-cpu"  # the results files of another --name are prefix-<name>.*
HEADER = "The following is an excerpt from a novel by Jane Austen.\n\n"
FULL = {"configs": ["auto", "temporalkv-2bit", "temporalkv-2bit@big", "temporalkv-2bit@block256",
                    "temporalkv-2bit@block64"],
        "prefix_lens": [256, 600, 2000], "requests": 8, "question_tokens": 24, "max_tokens": 16,
        "max_model_len": 4096, "rounds": 3}
SMALL = {"configs": ["auto", "temporalkv-2bit"], "prefix_lens": [300], "requests": 3, "question_tokens": 12,
         "max_tokens": 4, "max_model_len": 1024, "rounds": 1}


def parse_config(name: str) -> tuple[str, list[str]]:
    """'temporalkv-2bit@block64' -> (format, extra server arguments)."""
    fmt, _, mod = name.partition("@")
    if not mod:
        return fmt, []
    if m := re.fullmatch(r"block(\d+)", mod):
        return fmt, ["--block-size", m[1]]
    if mod in ("small", "big"):
        return fmt, ["--additional-config", json.dumps({"temporalkv_small_pages": mod == "small"})]
    raise SystemExit(f"--configs {name!r}: expected FORMAT, FORMAT@blockN, FORMAT@small or FORMAT@big")


def prompts(model: str, prefix_lens: list[int], n: int, q_tokens: int) -> tuple[list[int], dict[int, list[list[int]]]]:
    """The warm-up prompt and, per P, n prompts: the P-token prefix (a header and Emma, from a different place per P)
    plus a distinct question (a passage of Persuasion, asked about)."""
    from vllm_temporalkv.corpora import load_austen
    from vllm_temporalkv.models import load_tokenizer

    tok = load_tokenizer(model)
    novels = load_austen()
    emma, pers = tok.encode(novels["Emma"]), tok.encode(novels["Persuasion"])
    head = tok.encode(HEADER)
    out = {}
    for j, P in enumerate(prefix_lens):
        prefix = (head + emma[30_000 * j: 30_000 * j + P])[:P]
        out[P] = [prefix + tok.encode(f"\n\nQuestion {i + 1}: what does this passage say: ")
                  + pers[2_000 * i: 2_000 * i + q_tokens] + tok.encode("\nAnswer:") for i in range(n)]
    return emma[-200:-100], out


def ask(url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: seconds to the first token and in all."""
    import openai

    c = openai.OpenAI(base_url=url, api_key="none", timeout=600)
    t0 = time.perf_counter()
    ttft, text = None, ""
    for chunk in c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      stream=True):
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - t0
        text += chunk.choices[0].text if chunk.choices else ""
    total = time.perf_counter() - t0
    return {"ttft_s": round(ttft if ttft is not None else total, 4), "total_s": round(total, 4),
            "prompt_tokens": len(prompt), "text": text}


def run_config(a, name: str, workload: dict[int, list[list[int]]], warm: list[int]) -> dict:
    fmt, extra = parse_config(name)
    env = {"VLLM_TEMPORALKV_ARTIFACT": str(a.artifact)} if a.artifact and fmt in FORMATS else {}
    args = ["--kv-cache-dtype", fmt, "--served-model-name", MODEL, "--dtype", a.dtype, "--max-model-len",
            str(a.max_model_len), "--enable-prefix-caching", *(["--enforce-eager"] if a.enforce_eager else []), *extra]
    s = VLLMServer(a.model, *args, kv_space_gib=a.kv_space_gib, env=env, log_path=Path(a.out) / "prefix-runs" /
                   f"{name}.log")
    s.log_path.parent.mkdir(parents=True, exist_ok=True)
    rec = {"format": fmt, "server_args": args, "load_before": os.getloadavg()[0]}
    t0 = time.time()
    try:
        s.start()
    except ServerFailed as e:
        return {**rec, "error": common.error_line(e.log, -1)}
    try:
        rec["start_s"] = round(time.time() - t0, 1)
        rec["kv_capacity_tokens"] = s.kv_capacity_tokens()
        rec["warmup"] = ask(s.url, warm, a.max_tokens)
        _, info = scrape_metrics(s.port)
        rec["block_size"] = int(info["block_size"]) if info.get("block_size", "").isdigit() else None
        bs = rec["block_size"] or 1
        rec["prefixes"] = {}
        for P, reqs in workload.items():
            m0, _ = scrape_metrics(s.port)
            t1 = time.perf_counter()
            done = [ask(s.url, p, a.max_tokens) for p in reqs]
            wall = time.perf_counter() - t1
            m1, _ = scrape_metrics(s.port)
            q = m1.get("vllm:prefix_cache_queries_total", 0) - m0.get("vllm:prefix_cache_queries_total", 0)
            h = m1.get("vllm:prefix_cache_hits_total", 0) - m0.get("vllm:prefix_cache_hits_total", 0)
            # the most whole pages could give: after the first request, every full page of the shared prefix (vLLM
            # matches at most prompt - 1 tokens)
            best = sum(min(P, len(p) - 1) // bs * bs for p in reqs[1:])
            warm_ttft = [r["ttft_s"] for r in done[1:]]
            rec["prefixes"][str(P)] = {
                "queries": q, "hits": h, "hit_rate": h / q if q else 0.0,
                "max_hit_rate": best / sum(len(p) for p in reqs),
                "ttft_first_s": done[0]["ttft_s"], "ttft_warm_mean_s": statistics.mean(warm_ttft),
                "ttft_warm_median_s": statistics.median(warm_ttft), "total_s": round(wall, 3),
                "requests": [{k: v for k, v in r.items() if k != "text"} for r in done],
                "answers": [r["text"] for r in done]}
            print(f"{name:30} P={P:5} hit rate {h / q if q else 0:.3f} (at most {rec['prefixes'][str(P)]['max_hit_rate']:.3f}) "
                  f"TTFT first {done[0]['ttft_s']:.3f} s, later {statistics.mean(warm_ttft):.3f} s, total {wall:.1f} s",
                  flush=True)
    finally:
        s.stop()
        rec["load_after"] = os.getloadavg()[0]
    return rec


def merge_rounds(recs: list[dict]) -> dict:
    """One configuration's record over its rounds (each a fresh server): the requests of every round pooled - hits and
    queries summed, TTFTs averaged over all of them, each round's own later-request mean kept beside."""
    if len(recs) == 1 or any("prefixes" not in r for r in recs):
        return next((r for r in recs if "prefixes" not in r), recs[0])
    out = {**recs[0], "rounds": len(recs), "start_s": max(r["start_s"] for r in recs),
           "load_before": recs[0]["load_before"], "load_after": recs[-1]["load_after"], "prefixes": {}}
    for P, x0 in recs[0]["prefixes"].items():
        xs = [r["prefixes"][P] for r in recs]
        q, h = sum(x["queries"] for x in xs), sum(x["hits"] for x in xs)
        warm = [r["ttft_s"] for x in xs for r in x["requests"][1:]]
        out["prefixes"][P] = {
            "queries": q, "hits": h, "hit_rate": h / q if q else 0.0, "max_hit_rate": x0["max_hit_rate"],
            "ttft_first_s": statistics.mean(x["ttft_first_s"] for x in xs),
            "ttft_warm_mean_s": statistics.mean(warm), "ttft_warm_median_s": statistics.median(warm),
            "ttft_warm_mean_s_rounds": [x["ttft_warm_mean_s"] for x in xs],
            "total_s": round(statistics.mean(x["total_s"] for x in xs), 3),
            "requests": [r for x in xs for r in x["requests"]], "answers": x0["answers"]}
    return out


def add_ratios(rep: dict) -> None:
    auto = rep["configs"].get("auto", {}).get("prefixes", {})
    for r in rep["configs"].values():
        for P, x in r.get("prefixes", {}).items():
            if P in auto and auto[P]["ttft_warm_mean_s"] > 0:
                x["ttft_ratio_vs_auto"] = x["ttft_warm_mean_s"] / auto[P]["ttft_warm_mean_s"]
                x["total_ratio_vs_auto"] = x["total_s"] / auto[P]["total_s"]


def write_markdown(rep: dict, path: Path) -> None:
    s, run = rep["settings"], rep["run"]
    lines = [f"# Prefix caching through the server ({s['name']})", "",
             *[f"Command: `{c}`  " for c in sorted({r.get("command", run["command"]) for r in rep["configs"].values()})],
             f"Machine: {run['machine']['cpu']}, {run['machine']['cpu_count']} CPUs, "
             f"{run['time']}; model dtype {s['dtype']}; {s['requests']} requests per prefix, one after another, "
             f"{s['max_tokens']} tokens each, streamed; {s['kv_space_gib']} GiB of KV memory; "
             f"{s.get('rounds', 1)} round(s) over the configurations in turn, a fresh server each", "",
             "| config | page | KV tokens | P | hit rate | at most | TTFT first (s) | TTFT later (s) | ÷ auto | total (s) | "
             "load 1-min |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rep["configs"].items():
        if "error" in r:
            lines.append(f"| {name} | | | | refused: {r['error'][:160].replace('|', '/')} | | | | | | |")
            continue
        for P, x in r["prefixes"].items():
            lines.append(f"| {name} | {r['block_size']} | {r['kv_capacity_tokens'] or 0:,} | {P} | {x['hit_rate']:.3f} | "
                         f"{x['max_hit_rate']:.3f} | {x['ttft_first_s']:.3f} | {x['ttft_warm_mean_s']:.3f} | "
                         f"{x.get('ttft_ratio_vs_auto', float('nan')):.2f} | {x['total_s']:.1f} | "
                         f"{r['load_before']:.1f} → {r['load_after']:.1f} |")
    lines += ["", "hit rate: vLLM's prefix-cache hits ÷ queries (prompt tokens) over the P's requests, the first "
              "included; at most: what whole pages of that size could hit. TTFT later: the mean over the requests after "
              "the first (those that can hit), over every round; ÷ auto: that mean over auto's. A page is reused only when "
              "whole: a prefix shorter than one page never hits."]
    path.write_text("\n".join(lines) + "\n")


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = [n for n, r in rep["configs"].items() if "prefixes" in r]
    Ps = rep["settings"]["prefix_lens"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.8 / max(1, len(cfgs))
    for i, n in enumerate(cfgs):
        xs = [j + i * w for j in range(len(Ps))]
        pre = rep["configs"][n]["prefixes"]
        axes[0].bar(xs, [pre[str(P)]["hit_rate"] for P in Ps], w, label=n)
        axes[1].bar(xs, [pre[str(P)]["ttft_warm_mean_s"] for P in Ps], w, label=n)
    for ax, t in zip(axes, ("prefix-cache hit rate", "mean TTFT of the later requests (s)")):
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(Ps))], [f"P={P}" for P in Ps])
        ax.set_title(t, fontsize=9)
    axes[0].set_ylim(0, 1.25)  # room for the legend above the bars
    axes[0].legend(fontsize=7, ncol=2, loc="upper left")
    fig.suptitle(f"Shared-prefix requests through the server, {rep['settings']['name']} "
                 f"({rep['run']['machine']['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    from vllm_temporalkv.models import resolve_model

    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--name", default=DEFAULT_NAME, help="model-and-device tag in the headline keys and the results "
                   "files (prefix-<name>.*; the default's: prefix.*)")
    p.add_argument("--configs", nargs="+", default=None, help="FORMAT, FORMAT@blockN, FORMAT@small or FORMAT@big (auto is "
                   "added)")
    p.add_argument("--prefix-lens", nargs="+", type=int, default=None)
    p.add_argument("--requests", type=int, default=None, help="requests per prefix (the first cannot hit)")
    p.add_argument("--question-tokens", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None, help="rounds over the configurations, in turn (a fresh server "
                   "each): a machine's slow spells then fall on every configuration alike (default 3; --smoke 1)")
    p.add_argument("--kv-space-gib", type=int, default=1)
    p.add_argument("--artifact", default=None, help="calibration artifact (default: the model's, calibrated on "
                   "first use as `vllm-temporalkv serve` does)")
    p.add_argument("--compile", dest="enforce_eager", action="store_false",
                   help="let vLLM compile the model (default: --enforce-eager, every configuration alike)")
    common.add_dtype_arg(p)
    common.add_smoke_args(p, "auto and temporalkv-2bit, one 300-token prefix, 3 requests: ~1-2 min")
    a = p.parse_args(argv)
    common.apply_sizes(a, FULL, SMALL, "prefix-smoke-")
    if "auto" not in a.configs:
        a.configs = ["auto"] + a.configs
    a.model = str(resolve_model(a.model))
    a.dtype = common.model_dtype(a.dtype)
    for name in a.configs:
        fmt = parse_config(name)[0]
        if fmt in FORMATS and not a.artifact:
            common.ensure_calibrated(a.model, fmt)
    warm, workload = prompts(a.model, a.prefix_lens, a.requests, a.question_tokens)
    settings = {k: getattr(a, k) for k in ("name", "prefix_lens", "requests", "question_tokens", "max_tokens",
                                           "max_model_len", "kv_space_gib", "dtype", "enforce_eager", "rounds")}
    out = Path(a.out)
    stem = "prefix" if a.name == DEFAULT_NAME else f"prefix-{a.name}"  # each machine / model its own files
    rep = {"settings": settings, "configs": {}}
    if (out / f"{stem}.json").is_file() and not a.smoke:  # an earlier run's configurations, unless measured again
        prev = json.loads((out / f"{stem}.json").read_text())
        if prev.get("settings") == settings:
            rep["configs"] = {n: {"command": prev["run"]["command"], **r} for n, r in prev["configs"].items()
                              if "error" not in r and n not in a.configs}
    runs = {name: [] for name in a.configs}
    for _ in range(a.rounds):  # every configuration once per round, in turn
        for name in a.configs:
            runs[name].append(run_config(a, name, workload, warm))
    for name in a.configs:
        rep["configs"][name] = {**merge_rounds(runs[name]), "command": common.run_record()["command"]}
    rep["run"] = common.run_record()
    add_ratios(rep)
    common.write_json(out / f"{stem}.json", rep)
    write_markdown(rep, out / f"{stem}.md")
    plot(rep, out / f"{stem}.png")
    figures = {}
    for name, r in rep["configs"].items():
        for P, x in r.get("prefixes", {}).items():
            if "@" not in name or name.endswith(("@small", "@big")):  # @blockN rows are diagnostics; these layouts
                figures[f"prefix.{a.name}.p{P}.{name}.hit_rate"] = x["hit_rate"]
                if "ttft_ratio_vs_auto" in x:
                    figures[f"prefix.{a.name}.p{P}.{name}.ttft_ratio_vs_auto"] = x["ttft_ratio_vs_auto"]
    rep["headline"] = None if a.smoke or a.no_headline or not common.is_results(out) else figures
    common.write_json(out / f"{stem}.json", rep)
    if rep["headline"]:
        common.merge_headline(figures)
    print((out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
