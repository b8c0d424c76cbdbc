"""The GPU oracle check's comparisons and report (benchmarks/gpu/oracle_match.py runs the engines): what is compared
with what, the bounds, the Markdown and the headline figures; also what a report the box returned is scored with
here (``--rescore``).  Runs are dicts of ``prompts`` (greedy tokens, top-5 logprobs per step) as ``--one`` writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

# which attention paths each format runs on a GPU (the codebook formats: CUDA = default, Triton, the torch oracle)
GPU_PATHS = {"auto": ("default",), "temporalkv-2bit": ("default", "triton", "torch")}
FORK_BUG = "Cannot re-initialize CUDA in forked subprocess"
PROMPT_TOKENS, N_PROMPTS, MAX_TOKENS, TOP = 1000, 4, 32, 5


def compare(a: dict, b: dict) -> dict:
    """Per prompt: first-token top-1 agreement, the largest top-5 logprob difference of the first token (tokens in
    both top-5s; the first token is the prefill's), the greedy prefix both share, and the largest difference over the
    decode steps inside that prefix (the same context on both sides: what tells two decode kernels apart)."""
    rows = []

    def dmax(la, lb):
        return max((abs(la[t] - lb[t]) for t in set(la) & set(lb)), default=float("inf"))

    for pa, pb in zip(a["prompts"], b["prompts"]):
        la, lb = pa["logprobs"][0], pb["logprobs"][0]
        prefix = next((i for i, (x, y) in enumerate(zip(pa["tokens"], pb["tokens"])) if x != y), len(pa["tokens"]))
        # step i's logprobs condition on tokens < i: steps 1..prefix see the same context on both sides
        steps = [dmax(x, y) for x, y in list(zip(pa["logprobs"], pb["logprobs"]))[1:prefix + 1]]
        rows.append(dict(top1_equal=max(la, key=la.get) == max(lb, key=lb.get), max_dlogprob=dmax(la, lb),
                         common_top5=len(set(la) & set(lb)), greedy_prefix=prefix,
                         decode_steps=len(steps), decode_max_dlogprob=max(steps, default=0.0)))
    return dict(top1_equal=all(r["top1_equal"] for r in rows), max_dlogprob=max(r["max_dlogprob"] for r in rows),
                min_greedy_prefix=min(r["greedy_prefix"] for r in rows),
                decode_max_dlogprob=max(r["decode_max_dlogprob"] for r in rows), prompts=rows)


def score(rep: dict, ref: dict, tol: float) -> bool:
    """The comparisons, from the runs a report holds (rep["checks"] rewritten); a run that failed or never ran
    fails the checks that need it.  (1) each GPU path against the GPU torch path (same platform, same model math:
    only the attention kernels differ): first-token top-1 on every prompt, top-5 logprobs within tol; (2) the two
    GPU decode kernels (CUDA = default, Triton) against each other, the same way; (3) the GPU's default path against
    the CPU reference, within max(tol, 2 x auto's own GPU-vs-CPU difference in the same run)."""
    runs, rep["checks"] = rep["runs"], []
    not_run = {"error": "not run"}
    ok, control = True, None
    if "error" not in runs.get("auto/default", not_run):
        control = compare(runs["auto/default"], ref["runs"]["auto/default"])
        rep["checks"].append(dict(what="auto: GPU vs CPU (the platforms' control)", **control))

    def pair(what, x, y, bound, top1_needed=True):
        nonlocal ok
        if "error" in x or "error" in y:
            why = x.get("error") or y.get("error")
            rep["checks"].append(dict(what=what, ok=False, error=why if why == "not run" else "a run failed"))
            ok = False
            return
        c = compare(x, y)
        c["ok"] = c["max_dlogprob"] <= bound and (c["top1_equal"] or not top1_needed)
        rep["checks"].append(dict(what=what, bound=round(bound, 4), **c))
        ok &= c["ok"]

    for fmt in rep.get("formats") or sorted({k.split("/")[0] for k in runs}):
        if fmt == "auto":
            continue
        got = {k.split("/")[1]: v for k, v in runs.items() if k.split("/")[0] == fmt}
        paths = [p for p in dict.fromkeys([*GPU_PATHS.get(fmt, ("default", "torch")), *got]) if p != "torch"]
        for p in paths:
            pair(f"{fmt}: GPU {p} vs GPU torch", got.get(p, not_run), got.get("torch", not_run), tol)
        if "default" in paths and "triton" in paths:
            pair(f"{fmt}: GPU default (CUDA decode) vs GPU triton", got.get("default", not_run),
                 got.get("triton", not_run), tol)
        if "graphs" in got:
            pair(f"{fmt}: GPU with CUDA graphs vs GPU eager", got["graphs"], got.get("default", not_run), tol)
        cpu = ref["runs"].get(f"{fmt}/default", not_run)
        if control is None:
            rep["checks"].append(dict(what=f"{fmt}: GPU default vs CPU reference", ok=False,
                                      error="auto's control did not run"))
            ok = False
        elif "error" not in cpu:
            pair(f"{fmt}: GPU default vs CPU reference", got.get("default", not_run), cpu,
                 max(tol, 2 * control["max_dlogprob"]), top1_needed=control["top1_equal"])
    forked = [k for k, v in runs.items() if v.get("fork_bug")]
    if forked:  # measured with spawn, but a user's engine would not have started
        rep["checks"].append(dict(what="engines start as vLLM launches them (fork)", ok=False,
                                  error=f"{FORK_BUG}: {', '.join(forked)}"))
        ok = False
    rep["ok"] = bool(ok)
    return rep["ok"]


def headline_figures(rep: dict) -> dict[str, float]:
    """`gpu_oracle.smollm2.<format>.<metric>`: each format's agreement with the CPU reference and between paths."""
    fig = {}
    for c in rep["checks"]:
        if "error" in c:
            continue
        fmt, what = c["what"].split(": ", 1)
        key = {"GPU vs CPU (the platforms' control)": "vs_cpu", "GPU default vs CPU reference": "vs_cpu",
               "GPU default vs GPU torch": "cuda_vs_gpu_torch", "GPU triton vs GPU torch": "triton_vs_gpu_torch",
               "GPU default (CUDA decode) vs GPU triton": "cuda_vs_triton",
               "GPU with CUDA graphs vs GPU eager": "graphs_vs_eager"}.get(what)
        if key:
            base = f"gpu_oracle.smollm2.{fmt}.{key}"
            fig[f"{base}_max_dlogprob"] = c["max_dlogprob"]
            fig[f"{base}_top1_agree"] = sum(r["top1_equal"] for r in c["prompts"]) / len(c["prompts"])
            fig[f"{base}_min_greedy_prefix"] = c["min_greedy_prefix"]
            fig[f"{base}_decode_max_dlogprob"] = c["decode_max_dlogprob"]
    return fig


def report(rep: dict, ref: dict, out: Path, tol: float, headline: bool) -> int:
    """Score, write oracle_match.json + .md into out (and the headline when out is benchmarks/results)."""
    ok = score(rep, ref, tol)
    out.mkdir(parents=True, exist_ok=True)
    (out / "oracle_match.json").write_text(json.dumps(rep, indent=1))
    lines = [f"# SmolLM2-135M's real weights: vLLM on a GPU ({rep.get('gpu') or 'GPU not recorded'}) vs the CPU "
             f"oracle\n", f"Reference: `{rep['reference']}`; tolerance {tol} nats (first-token top-5 logprobs); "
             f"{MAX_TOKENS} greedy tokens after {N_PROMPTS} prompts of {PROMPT_TOKENS} tokens.\n",
             "| engine | seconds | error |", "|---|---|---|"]
    for k, v in rep["runs"].items():
        err = ("; ".join(v.get("cause") or []) or v["error"][-200:]) if "error" in v else ""
        if v.get("fork_bug"):
            err = f"FORK BUG (ran again with spawn): {v['fork_bug'][0]} {err}"
        lines.append(f"| {k} | {v.get('seconds', '')} | {err} |".replace("\n", " "))
    lines += ["", "| check | top-1 equal (prompts) | max abs dlogprob, first token | bound | greedy prefix (min of 32) "
              "| max abs dlogprob, decode steps in the shared prefix | ok |", "|---|---|---|---|---|---|---|"]
    for c in rep["checks"]:
        if "error" in c:
            lines.append(f"| {c['what']} | | | | | | FAIL: {c['error']} |")
            continue
        agree = sum(r["top1_equal"] for r in c["prompts"])
        lines.append(f"| {c['what']} | {agree}/{len(c['prompts'])} | {c['max_dlogprob']:.4f} | {c.get('bound', '')} "
                     f"| {c['min_greedy_prefix']} | {c['decode_max_dlogprob']:.4f} | {'' if c.get('ok', True) else 'FAIL'} |")
    (out / "oracle_match.md").write_text("\n".join(lines) + "\n")
    if headline:
        from benchmarks.common import merge_headline

        merge_headline(headline_figures(rep))
    for c in rep["checks"]:
        print(f"{c['what']}: top1 {c.get('top1_equal')}, max |dlogprob| {c.get('max_dlogprob', float('nan')):.4f}, "
              f"greedy prefix >= {c.get('min_greedy_prefix')} of {MAX_TOKENS}{'' if c.get('ok', True) else '  FAIL'}")
    print("OK" if ok else "CHECK FAILED")
    return 0 if ok else 1
