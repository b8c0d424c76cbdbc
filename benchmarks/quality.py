"""Quality harness: perplexity with simulated KV compression (the thesis protocol).

Inside a HuggingFace model, the pre-RoPE K and V of every layer are replaced by their quantized-
then-decoded values (hooks on the projections, so RoPE is applied after decoding, as in the thesis);
the first SINK_TOKENS tokens stay in half precision.  Every query then attends over the decoded
K/V.  This is the thesis's simulation: a token also sees the decoded values of the rest of its own
chunk (the server instead keeps an incomplete chunk in half precision); see the note in README.  The simulation
itself is vllm_temporalkv/harness/simulate.py (shared with the tests); this module runs and reports it.

    python -m benchmarks.quality --artifact A [--ablation-artifact B] [--windows 8] [--data brown]

Configurations: ``bf16`` (the uncompressed KV cache: K/V rounded to bf16), every format with and
without 1% outliers (``<format>-o1``; the calibration-free ``selective-int8`` / ``-int4`` and ``tada-4bit`` /
``-2bit`` with their recent window, as served), the seed configurations not served (``tada-mixed-3bit``, ``qjl``:
vllm_temporalkv/harness/seeds.py, thesis protocol), and the ablations: Fisher vs unweighted k-means
(``<format>@unweighted``, needs ``--ablation-artifact`` calibrated with ``--no-fisher``), sinks
compressed (``@sinks-compressed``), pure temporal chunking instead of the hybrid
(``@pure-temporal``; ``@keys-channel`` / ``@values-channel``: one half channel-chunked in every layer), only the keys or only the values compressed (``@keys-only``, ``@values-only``: where
a format's loss comes from), a recent window of N half-precision tokens (``@windowN``, the serving option
``temporalkv_recent_window``; its tokens are counted in the bits), and only layers A..B compressed (``@layersA-B``,
per-layer sensitivity; its bits are the format's); parts combine with ``+`` (``@keys-only+layers0-5``).  ``--formats`` also takes any of these by name
(``temporalkv-2bit@window32``; with ``--no-ablations``, only those).  Results go to benchmarks/results/quality.{json,md} and PNG plots; each
configuration is saved as soon as it is done, and a rerun with the same settings skips it.  A model other than the
default SmolLM2 (``--model qwen2.5-coder-1.5b``) has its own files and headline keys beside SmolLM2's
(quality-qwen2.5-1.5b.json, ``quality.brown.qwen2.5-1.5b.<format>.ppl``: ``model_tag``).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_temporalkv.artifact import Artifact, default_artifact_path
from vllm_temporalkv.formats import FORMATS, get_format
from vllm_temporalkv.harness.seeds import SEED_CONFIGS, SeedSimulator, is_mixed, is_seed_config, tada_layer_bits
from vllm_temporalkv.harness.simulate import (KV_DTYPE, Simulator, ablation_parts, parse_config, sinks_of,
                                              window_nll, window_of)
from vllm_temporalkv.layout import bits_per_float

from .common import add_headline_arg, add_out_arg, merge_headline, run_record, write_json

ABLATION_FORMATS = ("temporalkv-2bit", "temporalkv-1bit")
MODEL_TAGS = {"qwen2.5-coder-1.5b": "qwen2.5-1.5b"}  # embedded models' short names in headline keys and files


def model_tag(model: str | None) -> str:
    """The model's part of headline keys and file names: "" for the default SmolLM2 (its keys and files as they
    always were: quality.brown.<format>.ppl, quality.json), else a short name (quality.brown.qwen2.5-1.5b.<format>.ppl,
    quality-qwen2.5-1.5b.json) so that models' results live side by side."""
    if model is None or model == "smollm2":
        return ""
    if model in MODEL_TAGS:
        return MODEL_TAGS[model]
    name = Path(model.rstrip("/")).name.removesuffix(".gguf").lower()
    return "".join(c if c.isalnum() or c in ".-_" else "-" for c in name)


def config_names(formats: list[str], ablations: bool, have_unweighted: bool, seeds: tuple[str, ...] = (),
                 outliers: bool = True) -> list[str]:
    names = ["bf16"]
    for f in formats:
        names += [f, f"{f}-o1"] if get_format(f).needs_calibration and outliers else [f]
    names += list(seeds)
    if ablations:
        for f in ABLATION_FORMATS:
            if f not in formats:
                continue
            if have_unweighted:
                names.append(f"{f}@unweighted")
            names.append(f"{f}@sinks-compressed")
            names.append(f"{f}@pure-temporal")
            names += [f"{f}@keys-only", f"{f}@values-only"]
    return names


def artifact_free(name: str) -> bool:
    """A configuration whose result does not depend on the calibration artifact."""
    fmt = parse_config(name)[0]
    return name == "bf16" or is_seed_config(name) or (fmt in FORMATS and not get_format(fmt).needs_calibration)


def _report(settings: dict, res: dict, art: Artifact | None, formats: list[str], prev: dict | None = None) -> dict:
    if art is None:  # a run of artifact-free configurations keeps what the last one said of the artifact
        prev = prev or {}
        return {"settings": settings, "configs": res, "run": run_record(),
                "hybrid": prev.get("hybrid", {}), "centroid_bytes": prev.get("centroid_bytes", {})}
    return {"settings": settings, "configs": res, "run": run_record(),
            "hybrid": {f: art.layer_methods[f] for f in formats if get_format(f).hybrid and not get_format(f).mix
                       and not get_format(f).kv},
            "centroid_bytes": {f: art.centroid_bytes(f) for f in formats if get_format(f).needs_calibration}}


def run(args) -> dict:
    from vllm_temporalkv.corpora import load_corpus, token_windows
    from vllm_temporalkv.models import load_hf_model, load_tokenizer, resolve_model

    model_dir = resolve_model(args.model)
    art_path = Path(args.artifact) if args.artifact else default_artifact_path(model_dir)
    tok = load_tokenizer(model_dir)
    model = load_hf_model(model_dir, dtype=torch.float32, device=args.device)
    from vllm_temporalkv.artifact import model_fingerprint

    fp = model_fingerprint(model.config)
    wanted = list(dict.fromkeys(args.formats or [*FORMATS, *SEED_CONFIGS]))
    # ablations asked for by name, e.g. temporalkv-2bit@window32, and other outlier shares (temporalkv-2bit-o0.5)
    named = [f for f in wanted if "@" in f or parse_config(f)[1]]
    wanted = [f for f in wanted if f not in named]
    bad = [f for f in wanted if f not in FORMATS and not is_seed_config(f)]
    bad += [f for f in named if parse_config(f)[0] not in FORMATS]
    for f in named:
        try:
            ablation_parts(parse_config(f)[2])
        except ValueError as e:
            raise SystemExit(f"--formats {f}: {e}") from None
    if bad:
        raise SystemExit(f"unknown --formats {bad}; known: {', '.join([*FORMATS, *SEED_CONFIGS])}")
    seeds = tuple(f for f in wanted if is_seed_config(f))
    if seeds and args.protocol != "thesis":
        raise SystemExit(f"{', '.join(seeds)}: simulated in the thesis protocol only (vllm_temporalkv/harness/seeds.py)")
    suffix = "" if args.protocol == "thesis" else f"-{args.protocol}"
    tag = model_tag(args.model)
    stem = f"quality-{tag}{suffix}" if tag else f"quality{suffix}"  # quality[-model][-protocol]
    out_json = Path(args.out) / f"{stem}.json"
    prev = {}
    if out_json.is_file():
        import json

        prev = json.loads(out_json.read_text())
    # the artifact only where a format asks for one: the seed methods need no calibration
    free = [f for f in wanted if f in FORMATS and not get_format(f).needs_calibration]
    need_art = any(f in FORMATS and get_format(f).needs_calibration for f in wanted + [parse_config(n)[0] for n in named])
    if need_art:
        art = Artifact.load(art_path, expect=fp, model_hint=args.model)
        covered = [f for f in wanted if f in FORMATS and get_format(f).needs_calibration
                   and all(p in art.formats for p in get_format(f).calibrated_formats)]  # a mixed format: its parts
        calibration, formats = art.calibration, covered + free
    else:
        art, formats = None, free
        calibration = prev.get("settings", {}).get("artifact_calibration")
    unweighted = Artifact.load(args.ablation_artifact, expect=fp) if args.ablation_artifact else None
    names = config_names(formats, not args.no_ablations and need_art, unweighted is not None, seeds,
                         not args.no_outliers)
    names += [n for n in named if n not in names]
    windows = token_windows(tok, load_corpus(args.data), args.seq_len, args.windows)

    settings = dict(protocol=args.protocol, data=args.data, windows=args.windows, seq_len=args.seq_len, model=str(args.model or "smollm2"),
                    artifact_calibration=calibration, fingerprint=fp)
    res = {}
    if prev:
        same = {k: v for k, v in settings.items() if k != "artifact_calibration"}
        if {k: v for k, v in prev.get("settings", {}).items() if k != "artifact_calibration"} == same:
            # configurations that use no artifact stay valid across calibrations
            res = {n: r for n, r in prev.get("configs", {}).items()
                   if prev["settings"].get("artifact_calibration") == calibration or artifact_free(n)}
    todo = [n for n in names if n not in res or (args.rerun and args.formats and n in args.formats)]
    print(f"{len(names)} configurations, {len(todo)} to run, {args.windows} x {args.seq_len} tokens of {args.data}")
    for name in tqdm(todo, desc="configs", unit="config"):
        t0 = time.time()
        extra = {}
        if is_seed_config(name):
            layer_bits = None
            if is_mixed(name):  # searched on held-out calibration text, not on the text measured here
                calib = token_windows(tok, load_corpus("wiki-leads"), 1024, 2, skip=128)

                def mean_nll(hook):
                    total, count = window_nll(model, calib, hook)
                    return total / count

                layer_bits, cost = tada_layer_bits(name, model.config, KV_DTYPE, mean_nll)
                extra = {"layer_bits": layer_bits, "layer_cost_nats": cost,
                         "search_text": "wiki-leads: 2 x 1024 tokens after the first 131072 (past a 64 x 2048 calibration)"}
            sim = SeedSimulator(name, model.config, KV_DTYPE, layer_bits=layer_bits)
            bits = sim.bits(args.seq_len)
        else:
            sim = Simulator(name, art, unweighted, args.protocol)
            fmt, outliers, ablation = parse_config(name)
            parts = [get_format(p) for p in art.layer_formats(fmt)] if fmt and get_format(fmt).mix else None
            bits = (bits_per_float(get_format(fmt), fp["head_dim"], args.seq_len, outliers, window_of(fmt, ablation),
                                   num_kv_heads=fp["num_kv_heads"], num_layers=fp["num_layers"], layer_formats=parts,
                                   sinks=sinks_of(ablation))
                    if fmt else {"total": 16.0})
            if parts:
                extra = {"layer_formats": [p.name for p in parts]}
        nll, n = window_nll(model, windows, sim)
        res[name] = {"ppl": math.exp(nll / n), "nll": nll / n, "tokens": n, "seconds": round(time.time() - t0, 1),
                     "bits": bits, "command": run_record()["command"], **extra}
        tqdm.write(f"{name:34} ppl {res[name]['ppl']:.3f}  ({res[name]['seconds']:.0f} s)")
        write_json(out_json, _report(settings, res, art, formats, prev))
    report = _report(settings, res, art, formats, prev)
    write_json(out_json, report)

    where = f"quality.{args.data}{suffix}." + (f"{tag}." if tag else "")
    figures = {f"{where}{name}.ppl": r["ppl"] for name, r in res.items() if "@" not in name}
    figures.update({f"{where}{name}.bits_per_float": r["bits"]["total"]
                    for name, r in res.items() if "@" not in name})
    if not args.no_headline:
        merge_headline(figures)
    write_markdown(report, Path(args.out) / f"{stem}.md")
    plot(report, art, Path(args.out), stem.removeprefix("quality"), f"-{tag}" if tag else "")
    return report


# ---------------------------------------------------------------------------------------------
# reporting


def write_markdown(report: dict, path: Path) -> None:
    s, res = report["settings"], report["configs"]
    ctx = s["seq_len"]
    lines = [
        f"# Perplexity with simulated KV compression, {s['protocol']} protocol ({s['model']}, {s['data']}, "
        f"{s['windows']} x {ctx} tokens)",
        "",
        f"Command: `{report['run']['command']}`  ",
        f"Machine: {report['run']['machine']['cpu']} ({report['run']['machine'].get('gpu', 'no GPU')}), {report['run']['time']}  ",
        f"Calibration: {s['artifact_calibration'].get('data')} "
        f"{s['artifact_calibration'].get('num_samples')} x {s['artifact_calibration'].get('seq_len')} tokens, "
        f"Fisher={s['artifact_calibration'].get('fisher')}",
        "",
        f"bits/float = codes + outliers (value + position) + {8} sink tokens + average tail at {ctx} tokens; "
        "centroids are per model, listed separately.",
        "",
        "| bits | method | ppl | ppl, 1% outliers | bits/float | bits/float, outliers | centroids |",
        "|---|---|---|---|---|---|---|",
    ]
    base = res.get("bf16")
    if base:
        lines.append(f"| 16 | bf16 (uncompressed) | {base['ppl']:.3f} | | 16 | | |")
    for bits in (4, 2, 1):
        for method in ("kvquant", "channelkv", "temporalkv"):
            f = f"{method}-{bits}bit"
            if f not in res:
                continue
            o = res.get(f"{f}-o1", {})
            cb = report["centroid_bytes"].get(f, 0) / 2**20
            lines.append(
                f"| {bits} | {f} | {res[f]['ppl']:.3f} | {o.get('ppl', float('nan')):.3f} | "
                f"{res[f]['bits']['total']:.3f} | {o.get('bits', {}).get('total', float('nan')):.3f} | {cb:.2f} MiB |"
            )
    pairs = [n for n in res if "@" not in n and parse_config(n)[0] in FORMATS and get_format(parse_config(n)[0]).kv]
    if pairs:
        lines += ["", "## K/V pairs: keys as one format, values as another (-oP: P% of values exact)", "",
                  "| format | keys | values | ppl | bits/float |", "|---|---|---|---|---|"]
        for n in pairs:
            k, v = get_format(parse_config(n)[0]).kv
            lines.append(f"| {n} | {k} | {v} | {res[n]['ppl']:.3f} | {res[n]['bits']['total']:.3f} |")
    mixed = [n for n in res if "layer_formats" in res[n]]
    if mixed:
        lines += ["", "## Mixed formats: each layer one of the parts, chosen by the calibration's per-layer loss "
                  "estimates (Artifact.layer_formats)", "", "| format | ppl | bits/float | bits per layer |",
                  "|---|---|---|---|"]
        for n in mixed:
            per_layer = [get_format(p).nominal_bits for p in res[n]["layer_formats"]]
            lines.append(f"| {n} | {res[n]['ppl']:.3f} | {res[n]['bits']['total']:.3f} | {per_layer} |")
    seeds = [n for n in res if is_seed_config(n) or (_family(n) in ("selective", "tada", "qjl") and "@" not in n)]
    if seeds:
        lines += ["", "## Seed methods: selective, TaDA and QJL (served, no calibration), TaDA with per-layer bits "
                  f"(simulated, vllm_temporalkv/harness/seeds.py); all-in bits at {ctx} tokens, windows included", "",
                  "| method | ppl | bits/float K | bits/float V | bits/float |", "|---|---|---|---|---|"]
        for n in sorted(seeds, key=lambda n: -res[n]["bits"]["total"]):
            b = res[n]["bits"]
            lines.append(f"| {n} | {res[n]['ppl']:.3f} | {b.get('k', b['total']):.3f} | {b.get('v', b['total']):.3f} | "
                         f"{b['total']:.3f} |")
        cmds = sorted({res[n]["command"] for n in seeds if "command" in res[n]})
        lines += [""] + [f"Command for these rows: `{c}`" for c in cmds]
        mixed = [n for n in seeds if "layer_bits" in res[n]]
        for n in mixed:
            lines.append(f"{n}: bits per layer {res[n]['layer_bits']} (searched on {res[n]['search_text']})")
    abl = [n for n in res if "@" in n or (parse_config(n)[1] not in (False, True) and n not in pairs)]
    if abl:
        lines += ["", "## Ablations and other outlier shares (-oP: P% of values exact)", "", "| configuration | ppl | bits/float | method as calibrated |",
                  "|---|---|---|---|"]
        for n in abl:
            base_name = n.split("@")[0]
            base_ppl = f"{res[base_name]['ppl']:.3f}" if base_name in res else ""
            lines.append(f"| {n} | {res[n]['ppl']:.3f} | {res[n]['bits']['total']:.3f} | {base_ppl} |")
    hyb = report.get("hybrid", {})
    if hyb:
        lines += ["", "## Hybrid: layers where channel chunking has the lower Fisher-weighted MSE", ""]
        for f, m in hyb.items():
            ks = [i for i, x in enumerate(m["k"]) if x == "channel"]
            vs = [i for i, x in enumerate(m["v"]) if x == "channel"]
            lines.append(f"- {f}: K layers {ks or 'none'}; V layers {vs or 'none'}")
    path.write_text("\n".join(lines) + "\n")


def plot(report: dict, art: Artifact | None, out: Path, suffix: str = "", model_part: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["configs"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, osuf, title in ((axes[0], "", "no outliers"), (axes[1], "-o1", "1% outliers")):
        for method, style in (("kvquant", "s--"), ("channelkv", "^-."), ("temporalkv", "o-")):
            pts = [(res[f"{method}-{b}bit{osuf}"]["bits"]["total"], res[f"{method}-{b}bit{osuf}"]["ppl"])
                   for b in (1, 2, 4) if f"{method}-{b}bit{osuf}" in res]
            if pts:
                ax.plot(*zip(*pts), style, label=method)
        if "bf16" in res:
            ax.axhline(res["bf16"]["ppl"], color="gray", lw=1, label="bf16")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bits per float (codes + outliers + sinks + tail)")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel(f"perplexity ({report['settings']['data']})")
    axes[0].legend()
    fig.suptitle(f"{report['settings']['model']}: simulated KV compression ({report['settings']['protocol']} protocol)")
    fig.tight_layout()
    fig.savefig(out / f"quality{suffix}_ppl.png", dpi=120)
    plt.close(fig)

    plot_pareto(report, out / f"quality{suffix}_pareto.png")
    tables = {} if art is None else {f: t for f, t in art.mse.items() if f in report.get("hybrid", {})}
    if tables:
        fig, axes = plt.subplots(1, len(tables), figsize=(5 * len(tables), 4), squeeze=False)
        for ax, (f, t) in zip(axes[0], sorted(tables.items())):
            L = t.shape[0]
            for j, kv in enumerate("KV"):
                ratio = (t[:, j, 0] / t[:, j, 1]).numpy()
                ax.plot(range(L), ratio, "o-" if kv == "K" else "s--", label=kv)
            ax.axhline(1.0, color="gray", lw=1)
            ax.set_yscale("log")
            ax.set_title(f"{f}: temporal / channel Fisher-MSE")
            ax.set_xlabel("layer")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("< 1: temporal chunking wins")
        axes[0][0].legend()
        fig.tight_layout()
        fig.savefig(out / f"quality{model_part}_layer_mse.png", dpi=120)
        plt.close(fig)


PARETO_STYLES = {"kvquant": "s", "channelkv": "^", "temporalkv": "o", "selective": "D", "tada": "v", "qjl": "P"}


def _family(name: str) -> str:
    return name.split("-")[0]


def plot_pareto(report: dict, path: Path) -> None:
    """Every method at its all-in bits per float vs perplexity: the picture a user chooses from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = {n: r for n, r in report["configs"].items() if "@" not in n and n != "bf16"}
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for fam, marker in PARETO_STYLES.items():
        for outl, fill in ((False, "full"), (True, "none")):
            pts = sorted((r["bits"]["total"], r["ppl"], n) for n, r in res.items()
                         if _family(n) == fam and n.endswith("-o1") == outl)
            if not pts:
                continue
            ax.plot([b for b, _, _ in pts], [q for _, q, _ in pts], marker=marker, fillstyle=fill, ls="-" if not outl else ":",
                    label=fam + (" +1% outliers" if outl else ""))
            for b, q, n in pts:
                ax.annotate(n.partition("-")[2].removesuffix("-o1") or n, (b, q), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if "bf16" in report["configs"]:
        ax.axhline(report["configs"]["bf16"]["ppl"], color="gray", lw=1, label="bf16 (16 bits)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bits per float, all-in (codes, scales, norms, means, outliers, sinks, windows)")
    ax.set_ylabel(f"perplexity ({report['settings']['data']})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"{report['settings']['model']}: every method, {report['settings']['windows']} x "
                 f"{report['settings']['seq_len']} tokens ({report['settings']['protocol']} protocol)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--artifact", default=None, help="default: temporalkv/calibration.safetensors in the model folder")
    p.add_argument("--ablation-artifact", default=None, help="an artifact calibrated with --no-fisher")
    p.add_argument("--data", default="brown")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--formats", nargs="+", default=None)
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--no-outliers", action="store_true", help="no <format>-o1 configurations (half the time)")
    p.add_argument("--rerun", action="store_true", help="measure the --formats configurations again even where a "
                   "saved result exists (after a change to how they are simulated)")
    p.add_argument("--protocol", choices=("thesis", "causal"), default="thesis",
                   help="thesis: every query sees decoded K/V; causal: a query's own block stays exact, "
                        "as in a decode step of the server")
    add_headline_arg(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_out_arg(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
