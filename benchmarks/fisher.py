"""The Fisher-weighting ablation, investigated: does Fisher-weighted k-means beat plain k-means, and why not?

    python -m benchmarks.fisher --artifact fisher=runs/fisher8.safetensors \\
        --artifact unweighted=runs/unweighted8.safetensors [--artifact fisher-s1=...] [--heldout-windows 8]

The artifacts must come from the same calibration text and settings except ``--no-fisher`` / ``--seed``.
On the calibration windows themselves (in-sample) and on held-out Brown windows (the quality
harness's), for every artifact and format it measures:

1. ``fisher_proxy``: the objective Fisher-weighted k-means minimizes, 1/2 sum g^2 (x - x^)^2 over all
   layers, K and V (g = d loss / d x from the summed LM loss), per token: a diagonal-Fisher estimate
   of the NLL increase in nats; and ``mse``, the plain mean squared error in normalized space.
2. per-window next-token NLL under simulated compression (the thesis protocol of
   ``benchmarks.quality``, vllm_temporalkv/harness/simulate.py), so artifacts can be compared window by window (paired), not only by
   one pooled perplexity.
3. how concentrated the Fisher weights are: per codebook, the effective sample size
   (sum w)^2 / (N sum w^2) of the per-vector weights and the share of weight held by the top 1%.

Writes benchmarks/results/fisher[-TAG].{json,md,png} and headline figures; each finished measurement
is saved at once and a rerun with the same settings skips it (``--cache DIR`` also keeps the collected
K/V + gradients, ~1.5 GB per 8 windows of 2048 tokens for SmolLM2).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import time
from pathlib import Path

import torch

from vllm_temporalkv.artifact import Artifact, model_fingerprint
from vllm_temporalkv.cache import model_quantizers

from .common import add_headline_arg, add_out_arg, merge_headline, run_record, write_json

FORMATS = ("temporalkv-2bit", "temporalkv-1bit")


def fisher_objective(art: Artifact, fmt: str, acts, grads) -> dict:
    """Diagonal-Fisher loss proxy and normalized MSE of one artifact's format on collected K/V."""
    qs = model_quantizers(fmt, art)
    tokens = acts[0]["k"].shape[0]
    per_layer = {kv: [] for kv in "kv"}
    mse = {kv: [] for kv in "kv"}
    for layer, pair in enumerate(qs):
        for q, kv in zip(pair, "kv"):
            x = acts[layer][kv]
            z = q.normalize(x)
            err = (q.codec.decode(q.codec.encode(z), z.shape[0]) - z) ** 2
            f = (grads[layer][kv] * q.stats.std) ** 2  # d loss / d z, squared
            per_layer[kv].append(float(0.5 * (f * err).sum()) / tokens)
            mse[kv].append(float(err.mean()))
    return {
        "fisher_proxy": sum(per_layer["k"]) + sum(per_layer["v"]),
        "fisher_proxy_k": sum(per_layer["k"]),
        "fisher_proxy_v": sum(per_layer["v"]),
        "mse": statistics.fmean(mse["k"] + mse["v"]),
        "per_layer": per_layer,
        "mse_per_layer": mse,
    }


def weight_concentration(art: Artifact, fmt: str, acts, grads) -> dict:
    """Effective sample size and top-1% weight share of the per-vector Fisher weights, per layer."""
    qs = model_quantizers(fmt, art)
    out = {kv: {"ess_fraction": [], "top1pct_share": []} for kv in "kv"}
    for layer, pair in enumerate(qs):
        for q, kv in zip(pair, "kv"):
            f = (grads[layer][kv] * q.stats.std) ** 2
            w = q.codec.vector_weights(f).double()  # [H, G, N]
            N = w.shape[-1]
            ess = w.sum(-1) ** 2 / (N * (w**2).sum(-1))
            top = w.sort(-1, descending=True).values[..., : max(1, N // 100)].sum(-1) / w.sum(-1)
            out[kv]["ess_fraction"].append(float(ess.median()))
            out[kv]["top1pct_share"].append(float(top.median()))
    for kv in "kv":
        out[kv]["median_ess_fraction"] = statistics.median(out[kv]["ess_fraction"])
        out[kv]["median_top1pct_share"] = statistics.median(out[kv]["top1pct_share"])
    return out


def window_nlls(model, windows: torch.Tensor, art: Artifact | None, fmt: str | None) -> list[float]:
    """Mean next-token NLL of each window under simulated compression (bf16 when fmt is None)."""
    from vllm_temporalkv.harness.simulate import Simulator, token_nlls

    sim = Simulator(fmt or "bf16", art, None)
    return [float(token_nlls(model, w, sim).mean()) for w in windows]


def paired(a: list[float], b: list[float]) -> dict:
    """b - a per window: mean, standard error, and how many windows favour each."""
    d = [y - x for x, y in zip(a, b)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return {"mean_delta": statistics.fmean(d), "se": se, "b_better": sum(x < 0 for x in d),
            "a_better": sum(x > 0 for x in d), "n": len(d)}


def collected(model, windows: torch.Tensor, fp: dict, cache: str | None, collect):
    """K/V + gradients on windows; kept in ``cache`` (a folder) when given, keyed by text and model."""
    key = hashlib.sha256(windows.numpy().tobytes() + json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache) / f"collected-{key}.safetensors" if cache else None
    from vllm_temporalkv.calibration.collect import load_collected, save_collected

    if path is not None and path.is_file():
        return load_collected(path)
    t0 = time.time()
    acts, grads = collect(model, windows, progress=True)
    print(f"collected {windows.shape[0]} windows in {time.time() - t0:.0f} s")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_collected(path, acts, grads)
    return acts, grads


def run(args) -> dict:
    from vllm_temporalkv.calibration.collect import collect_kv_grads
    from vllm_temporalkv.corpora import load_corpus, token_windows
    from vllm_temporalkv.models import load_hf_model, load_tokenizer, resolve_model

    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    model = load_hf_model(model_dir, dtype=torch.float32, device="cpu")
    fp = model_fingerprint(model.config)
    arts = {}
    for spec in args.artifact:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--artifact takes NAME=PATH, got {spec!r}")
        arts[name] = Artifact.load(path, expect=fp)
    cals = {n: a.calibration for n, a in arts.items()}
    first = next(iter(cals.values()))
    for n, c in cals.items():
        for k in ("data", "num_samples", "seq_len", "iters"):
            if c[k] != first[k]:
                raise SystemExit(f"artifacts differ in calibration {k}: {n} has {c[k]}, expected {first[k]}")
    formats = [f for f in args.formats if all(f in a.formats for a in arts.values())]

    splits = {
        "calibration": token_windows(tok, load_corpus(first["data"]), first["seq_len"], first["num_samples"]),
        "heldout": token_windows(tok, load_corpus(args.heldout_data), first["seq_len"], args.heldout_windows),
    }
    settings = dict(calibration={k: first[k] for k in ("data", "num_samples", "seq_len", "iters")},
                    heldout=dict(data=args.heldout_data, windows=args.heldout_windows))
    infos = {n: dict(fisher=c["fisher"], seed=c["seed"], created=c.get("created"), path=str(arts[n].path))
             for n, c in cals.items()}
    stem = f"fisher-{args.tag}" if args.tag else "fisher"
    out_json = Path(args.out) / f"{stem}.json"
    res: dict = {}
    if out_json.is_file():
        prev = json.loads(out_json.read_text())
        if prev.get("settings") == settings:
            res = prev.get("results", {})
            # keep what was measured for an artifact only while its name still means the same file
            keep = {n for n, i in prev.get("artifacts", {}).items() if infos.get(n) == i}
            for r in res.values():
                for part in ("objective", "nll"):
                    for key in [k for k in r.get(part, {}) if k != "bf16" and k.split("/")[0] not in keep]:
                        del r[part][key]

    def save():
        write_json(out_json, {"settings": settings, "artifacts": infos, "results": res, "run": run_record()})

    for split, windows in splits.items():
        r = res.setdefault(split, {})
        need = [(n, f) for n in arts for f in formats if f"{n}/{f}" not in r.get("objective", {})]
        need_w = [f for f in formats if f not in r.get("weights", {})]
        if need or need_w:
            acts, grads = collected(model, windows, fp, args.cache, collect_kv_grads)
            for n, f in need:
                r.setdefault("objective", {})[f"{n}/{f}"] = fisher_objective(arts[n], f, acts, grads)
                o = r["objective"][f"{n}/{f}"]
                print(f"{split:12} {n:14} {f:16} fisher proxy {o['fisher_proxy']:.5f}  mse {o['mse']:.5f}")
            for f in need_w:
                r.setdefault("weights", {})[f] = weight_concentration(next(iter(arts.values())), f, acts, grads)
            del acts, grads
            save()
        if split not in args.nll_splits:
            continue
        nll = r.setdefault("nll", {})
        for n, f in [("bf16", None)] + [(n, f) for f in formats for n in arts]:
            key = "bf16" if f is None else f"{n}/{f}"
            if key in nll:
                continue
            t0 = time.time()
            nll[key] = window_nlls(model, windows, arts.get(n), f)
            print(f"{split:12} {key:32} ppl {math.exp(statistics.fmean(nll[key])):.3f} ({time.time() - t0:.0f} s)")
            save()
    report = {"settings": settings, "artifacts": infos, "results": res, "run": run_record()}
    write_json(out_json, report)
    if not args.no_headline:
        merge_headline(headline(report, formats))
    write_markdown(report, list(infos), formats, Path(args.out) / f"{stem}.md")
    plot(report, list(infos), formats, Path(args.out) / f"{stem}.png")
    return report


def headline(report: dict, formats: list[str]) -> dict[str, float]:
    """``fisher.<calibration text>-<windows>w.<format>@<artifact>.<metric>`` for the README table."""
    c, res = report["settings"]["calibration"], report["results"]
    data = f"{c['data']}-{c['num_samples']}w"
    out = {}
    for f in formats:
        for n in report["artifacts"]:
            key = f"fisher.{data}.{f}@{n}"
            for split, metric in (("calibration", "proxy_in_sample"), ("heldout", "proxy_held_out")):
                o = res.get(split, {}).get("objective", {}).get(f"{n}/{f}")
                if o:
                    out[f"{key}.{metric}"] = o["fisher_proxy"]
            nll = res.get("heldout", {}).get("nll", {}).get(f"{n}/{f}")
            if nll:
                out[f"{key}.ppl_held_out"] = math.exp(statistics.fmean(nll))
    return out


def write_markdown(report: dict, names: list[str], formats: list[str], path: Path) -> None:
    s, res = report["settings"], report["results"]
    c = s["calibration"]
    lines = [
        "# Fisher-weighted vs plain k-means, investigated",
        "",
        f"Command: `{report['run']['command']}`  ",
        f"Machine: {report['run']['machine']['cpu']}, {report['run']['time']}  ",
        f"Calibration: {c['data']} {c['num_samples']} x {c['seq_len']} tokens (in-sample); held out: "
        f"{s['heldout']['data']} {s['heldout']['windows']} x {c['seq_len']} tokens. Artifacts: "
        + ", ".join(f"{n} (Fisher={a['fisher']}, seed {a['seed']})" for n, a in report["artifacts"].items()),
        "",
        "## The k-means objective: diagonal-Fisher estimate of the NLL increase (nats/token) and plain MSE",
        "",
        "| format | artifact | Fisher proxy, in-sample | Fisher proxy, held out | MSE, in-sample | MSE, held out |",
        "|---|---|---|---|---|---|",
    ]
    for f in formats:
        for n in names:
            a = res.get("calibration", {}).get("objective", {}).get(f"{n}/{f}")
            b = res.get("heldout", {}).get("objective", {}).get(f"{n}/{f}")
            if a and b:
                lines.append(f"| {f} | {n} | {a['fisher_proxy']:.4f} | {b['fisher_proxy']:.4f} | {a['mse']:.4f} | {b['mse']:.4f} |")
    lines += ["", "## Measured NLL per window (simulated compression, thesis protocol)", ""]
    for split in ("calibration", "heldout"):
        nll = res.get(split, {}).get("nll", {})
        if not nll:
            continue
        lines += [f"### {split}", "", "| configuration | ppl | NLL - bf16 (nats/token) |", "|---|---|---|"]
        base = nll.get("bf16")
        for key, v in nll.items():
            d = statistics.fmean(v) - statistics.fmean(base) if base else float("nan")
            lines.append(f"| {key} | {math.exp(statistics.fmean(v)):.3f} | {d:+.4f} |")
        lines += ["", "| format | a | b | mean NLL(b) - NLL(a) ± s.e. | windows where b is better |", "|---|---|---|---|---|"]
        for f in formats:
            for i, a in enumerate(names):
                for b in names[i + 1 :]:
                    if f"{a}/{f}" in nll and f"{b}/{f}" in nll:
                        p = paired(nll[f"{a}/{f}"], nll[f"{b}/{f}"])
                        lines.append(f"| {f} | {a} | {b} | {p['mean_delta']:+.4f} ± {p['se']:.4f} | {p['b_better']} of {p['n']} |")
        lines.append("")
    w = res.get("calibration", {}).get("weights", {})
    if w:
        lines += ["## How concentrated the Fisher weights are (calibration windows, per codebook, median over layers)", "",
                  "| format | K: effective sample size | K: top-1% share | V: effective sample size | V: top-1% share |",
                  "|---|---|---|---|---|"]
        for f, d in w.items():
            lines.append(f"| {f} | {d['k']['median_ess_fraction']:.1%} | {d['k']['median_top1pct_share']:.1%} | "
                         f"{d['v']['median_ess_fraction']:.1%} | {d['v']['median_top1pct_share']:.1%} |")
    path.write_text("\n".join(lines) + "\n")


def plot(report: dict, names: list[str], formats: list[str], path: Path) -> None:
    """Per layer, K + V: the Fisher-weighted objective in-sample and held out, one line per artifact."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    fig, axes = plt.subplots(len(formats), 2, figsize=(11, 3.6 * len(formats)), squeeze=False, sharex=True, sharey="row")
    for row, f in zip(axes, formats):
        for ax, split, title in ((row[0], "calibration", "in-sample"), (row[1], "heldout", "held out")):
            for n in names:
                o = res.get(split, {}).get("objective", {}).get(f"{n}/{f}")
                if o:
                    y = [a + b for a, b in zip(o["per_layer"]["k"], o["per_layer"]["v"])]
                    ax.plot(range(len(y)), y, "o-" if "unweighted" not in n else "s--", ms=3,
                            label=f"{n} (total {o['fisher_proxy']:.3f})")
            ax.set_yscale("log")
            ax.set_title(f"{f}, {title}")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        row[0].set_ylabel("1/2 sum g^2 (x - x^)^2, nats/token")
    for ax in axes[-1]:
        ax.set_xlabel("layer")
    fig.suptitle("Fisher-weighted objective per layer (K + V): calibration text vs held-out text")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.fisher", description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", action="append", required=True, metavar="NAME=PATH",
                   help="an artifact to compare (repeat; same calibration text and settings)")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--formats", nargs="+", default=list(FORMATS))
    p.add_argument("--heldout-data", default="brown")
    p.add_argument("--heldout-windows", type=int, default=8)
    p.add_argument("--nll-splits", nargs="*", default=["heldout"], choices=("calibration", "heldout"),
                   help="where to measure per-window NLL (each split costs ~25 s per window and configuration on 2 CPU cores)")
    p.add_argument("--cache", default=None, help="a folder to keep the collected K/V + gradients in between runs")
    add_headline_arg(p)
    p.add_argument("--tag", default=None, help="write fisher-TAG.{json,md} instead of fisher.{json,md}")
    add_out_arg(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
