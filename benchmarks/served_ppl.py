"""Perplexity through the server: each format's own scoring of held-out text, over HTTP.

    python -m benchmarks.served_ppl                      # 8 x 2048 Brown tokens; auto, fp8 and the served formats
    python -m benchmarks.served_ppl --formats auto temporalkv-2bit --windows 4

The quality harness (benchmarks.quality) simulates compression inside a float32 transformers model.  This measures
what a user of the server gets: per format one real `vllm serve` (the --dtype `vllm-temporalkv serve` picks, its
chunked prefill, this machine's kernels: C++ on the CPU), every window sent as token ids to /v1/completions with
echo and logprobs (max_tokens 1), and the next-token NLL of every token but the first read from the server's own
scores.  Beside it, per format, the same windows scored by its reference - the quality harness's causal protocol
(what a served query sees: earlier blocks decoded, its own block and the recent window exact, 8 sinks exact), float32
transformers, the same artifact - so a served format whose kernels, paging or prefill lost quality shows as a gap to
its reference, and auto's gap (bf16 serving against the float32 model) is the yardstick for the others' (vLLM's fp8
has no reference here).  Paired with auto window by window: the mean NLL difference and its 95% bootstrap interval.

Each format's row is saved as soon as it is measured, and a rerun with the same settings reuses the rows it finds
(``--rerun`` measures them again).  Writes served-ppl[-<model>].json / .md / .png to --out and merges
``served_ppl.<data>[.<model>].<format>.ppl``, ``.ratio_vs_auto`` (perplexity / auto's, same windows) and
``.reference_ppl`` into headline.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .common import add_dtype_arg, add_smoke_args, apply_sizes, error_line, merge_headline, model_dtype, run_record, \
    write_json
from .quality import model_tag

DEFAULT_FORMATS = ["auto", "fp8", "temporalkv-4bit", "temporalkv-k4v2", "temporalkv-2bit", "channelkv-2bit",
                   "kvquant-2bit", "selective-int4", "tada-4bit", "qjl"]
BOOT = 2000


def windowed(nlls: list[list[float]]) -> dict:
    """Per-token NLLs of each window -> what the report keeps of them: each window's summed NLL and token count."""
    return {"sums": [math.fsum(w) for w in nlls], "tokens": [len(w) for w in nlls]}


def served_nlls(url: str, windows: list[list[int]], concurrency: int) -> list[list[float]]:
    """The server's NLL of tokens 1 .. T-1 of every window (echo + logprobs: its prompt logprobs, in order)."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="none", timeout=3600, max_retries=0)

    def one(ids: list[int]) -> list[float]:
        r = client.completions.create(model="model", prompt=ids, max_tokens=1, echo=True, logprobs=0, temperature=0)
        lp = r.choices[0].logprobs.token_logprobs[1 : len(ids)]
        if len(lp) != len(ids) - 1 or any(x is None or not math.isfinite(x) for x in lp):
            raise RuntimeError(f"the server scored {sum(x is not None for x in lp)} of {len(ids) - 1} prompt tokens")
        return [-x for x in lp]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, windows))


def reference_nlls(model_dir, art, name: str, windows) -> list[list[float]] | None:
    """The causal protocol's NLL of tokens 1 .. T-1 per window (float32 transformers), None where a format has
    no reference (vLLM's own fp8)."""
    import torch

    from vllm_temporalkv.formats import FORMATS
    from vllm_temporalkv.harness.simulate import Simulator, token_nlls

    if name == "auto":
        name = "bf16"
    elif name not in FORMATS:
        return None
    model = _float32_model(str(model_dir))
    sim = Simulator(name, art, None, "causal")
    return [token_nlls(model, torch.tensor(w), sim).tolist() for w in windows]


@functools.cache
def _float32_model(model_dir: str):  # loaded once for every format's reference
    import torch

    from vllm_temporalkv.models import load_hf_model

    return load_hf_model(model_dir, dtype=torch.float32)


def paired(a: dict, b: dict, rounds: int = BOOT, seed: int = 0) -> dict:
    """Mean per-token NLL of b minus a's over the same windows (``windowed``), with a 95% bootstrap interval over
    the windows."""
    sa, sb, n = np.array(a["sums"]), np.array(b["sums"]), np.array(a["tokens"])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(n), size=(rounds, len(n)))
    boot = (sb[idx].sum(1) - sa[idx].sum(1)) / n[idx].sum(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"mean": float((sb.sum() - sa.sum()) / n.sum()), "ci95": [float(lo), float(hi)]}


def mean_nll(w: dict) -> float:
    return math.fsum(w["sums"]) / sum(w["tokens"])


def serve_format(args, model_dir, fmt: str, windows: list[list[int]]) -> dict:
    from vllm_temporalkv.formats import FORMATS
    from vllm_temporalkv.harness.server import ServerFailed, VLLMServer

    extra = (["--additional-config", json.dumps({"temporalkv_artifact": str(args.artifact)})]
             if args.artifact and fmt in FORMATS and FORMATS[fmt].needs_calibration else [])
    s = VLLMServer(model_dir, "--kv-cache-dtype", fmt, "--served-model-name", "model", "--dtype", args.dtype,
                   "--max-model-len", str(args.seq_len + 16), "--max-num-batched-tokens",
                   str(args.max_num_batched_tokens), "--max-num-seqs", str(args.concurrency), "--enforce-eager",
                   *extra, timeout=args.server_timeout)
    t0 = time.time()
    try:
        s.start()
    except ServerFailed as e:
        return {"error": error_line(e.log, s.proc.returncode if s.proc else None)}
    try:
        t1 = time.time()
        try:
            nlls = served_nlls(s.url, windows, args.concurrency)
        except Exception as e:  # a failed request (the server died, refused, scored too few tokens): this format's row
            return {"error": f"scoring failed: {type(e).__name__}: {str(e)[:300]}; server: "
                             f"{error_line(s.log(), s.proc.poll() if s.proc else None)}"}
        return {"served": windowed(nlls), "startup_s": round(t1 - t0, 1), "score_s": round(time.time() - t1, 1)}
    finally:
        s.stop()


def run(args) -> dict:
    from vllm_temporalkv.artifact import Artifact, default_artifact_path
    from vllm_temporalkv.corpora import load_corpus, token_windows
    from vllm_temporalkv.formats import FORMATS
    from vllm_temporalkv.models import load_tokenizer, resolve_model

    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    windows = token_windows(tok, load_corpus(args.data), args.seq_len, args.windows).tolist()
    needs = [f for f in args.formats if f in FORMATS and FORMATS[f].needs_calibration]
    art_path = Path(args.artifact) if args.artifact else default_artifact_path(model_dir)
    art = None
    if needs:
        if not art_path.is_file():
            raise SystemExit(f"{', '.join(needs)} need a calibration artifact and {art_path} does not exist: "
                             f"run `python -m calibrate --formats {' '.join(needs)}` or pass --artifact")
        art = Artifact.load(art_path)
        missing = [f for f in needs if not all(p in art.formats for p in FORMATS[f].calibrated_formats)]
        if missing:
            raise SystemExit(f"{art_path} holds no codebooks for {', '.join(missing)} (it has "
                             f"{', '.join(art.formats)}): calibrate them or leave them out of --formats")
        args.artifact = str(art_path)
    if "auto" not in args.formats:
        args.formats = ["auto", *args.formats]
    args.dtype = model_dtype(args.dtype)
    tag = model_tag(args.model)
    settings = dict(data=args.data, windows=args.windows, seq_len=args.seq_len, model=str(args.model or "smollm2"),
                    dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, concurrency=args.concurrency,
                    reference=not args.no_reference,
                    artifact=str(art_path) if art else None, artifact_calibration=art.calibration if art else None)
    stem = "served-ppl" + (f"-{tag}" if tag else "")
    out = Path(args.out)
    res = reusable(out / f"{stem}.json", settings, args)
    if res:
        print(f"reusing {', '.join(res)} from {out / f'{stem}.json'} (same settings; --rerun measures them again)")
    for fmt in args.formats:
        if fmt in res:
            continue
        t0 = time.time()
        r = serve_format(args, model_dir, fmt, windows)
        if "error" not in r and not args.no_reference:
            ref = reference_nlls(model_dir, art, fmt, windows)
            if ref is not None:
                r["reference"] = windowed(ref)
        r["seconds"] = round(time.time() - t0, 1)
        res[fmt] = r
        print(f"{fmt:20} " + (f"error: {r['error']}" if "error" in r else
                              f"served nll {mean_nll(r['served']):.4f}" +
                              (f", reference {mean_nll(r['reference']):.4f}" if "reference" in r else "")),
              flush=True)
        write_json(out / f"{stem}.json", {**summarize(settings, res), "run": run_record()})  # each format when done
    report = summarize(settings, res)
    report["run"] = run_record()
    write_markdown(report, out / f"{stem}.md")
    plot(report, out / f"{stem}.png")
    where = f"served_ppl.{args.data}." + (f"{tag}." if tag else "")
    figures = {}
    for fmt, c in report["configs"].items():
        if "error" in c:
            continue
        figures[f"{where}{fmt}.ppl"] = c["ppl"]
        if "ppl_ratio_vs_auto" in c:
            figures[f"{where}{fmt}.ratio_vs_auto"] = c["ppl_ratio_vs_auto"]
        if "reference_ppl" in c:
            figures[f"{where}{fmt}.reference_ppl"] = c["reference_ppl"]
    report["headline"] = None if args.smoke or args.no_headline else figures
    if report["headline"]:
        merge_headline(figures)
    write_json(out / f"{stem}.json", report)
    print(out / f"{stem}.md")
    return report


def reusable(path: Path, settings: dict, args) -> dict:
    """The formats an earlier run at path measured under the same settings (data, windows, dtype, artifact and its
    calibration, ...): reused, as the quality harness reuses its configurations, unless --rerun; failed ones are
    measured again."""
    if args.rerun or not path.is_file():
        return {}
    prev = json.loads(path.read_text())
    if prev.get("settings") != settings:
        return {}
    return {f: c["raw"] for f, c in prev.get("configs", {}).items() if f in args.formats and "raw" in c}


def summarize(settings: dict, res: dict) -> dict:
    """Per format: served and reference perplexity, the served - reference gap, the paired difference with auto;
    "raw" keeps what they are computed from (each window's NLL sum and token count)."""
    configs = {}
    auto = res.get("auto", {}).get("served")
    for fmt, r in res.items():
        if "error" in r:
            configs[fmt] = {"error": r["error"]}
            continue
        w = r["served"]
        nll = mean_nll(w)
        c = {"nll": nll, "ppl": math.exp(nll), "tokens": sum(w["tokens"]),
             "window_nll": [x / n for x, n in zip(w["sums"], w["tokens"])]}
        if auto is not None:
            d = paired(auto, w)
            c.update(ppl_ratio_vs_auto=math.exp(d["mean"]), nll_vs_auto=d)
        if "reference" in r:
            ref = mean_nll(r["reference"])
            c.update(reference_nll=ref, reference_ppl=math.exp(ref), served_vs_reference=paired(r["reference"], w))
        configs[fmt] = {**c, "raw": r}
    return {"settings": settings, "configs": configs}


def write_markdown(rep: dict, path: Path) -> None:
    s = rep["settings"]
    lines = [f"# Perplexity through the server: {s['model']}, {s['data']} ({s['windows']} x {s['seq_len']} tokens)", "",
             f"`{rep['run']['command']}` on {rep['run']['machine']['cpu']} (cpu class "
             f"{rep['run']['machine']['cpu_class']}: {' '.join(rep['run']['machine']['cpu_simd'])}), "
             f"{rep['run']['time']}; servers: --dtype {s['dtype']}, --max-num-batched-tokens "
             f"{s['max_num_batched_tokens']}; artifact {s['artifact']}.", "",
             "Served: the server's own prompt logprobs (echo), NLL of every token but each window's first. Reference: "
             "the same windows under the quality harness's causal protocol in float32 transformers (auto: the "
             "uncompressed model, K / V rounded to bf16). Brackets: 95% bootstrap intervals over the windows, paired.", "",
             "| format | served ppl | x auto | NLL - auto's (nats) | reference ppl | served - reference (nats) |",
             "|---|---|---|---|---|---|"]
    for fmt, c in rep["configs"].items():
        if "error" in c:
            lines.append(f"| {fmt} | error: {c['error']} | | | | |")
            continue
        d, g = c.get("nll_vs_auto"), c.get("served_vs_reference")
        lines.append(f"| {fmt} | {c['ppl']:.3f} | {c.get('ppl_ratio_vs_auto', float('nan')):.4f} | "
                     + (f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]" if d else "–") + " | "
                     + (f"{c['reference_ppl']:.3f}" if "reference_ppl" in c else "–") + " | "
                     + (f"{g['mean']:+.4f} [{g['ci95'][0]:+.4f}, {g['ci95'][1]:+.4f}]" if g else "–") + " |")
    path.write_text("\n".join(lines) + "\n")


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f, c) for f, c in rep["configs"].items() if "error" not in c]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    ax.bar(x - 0.2, [c["ppl"] for _, c in rows], 0.4, label="served")
    ax.bar(x + 0.2, [c.get("reference_ppl", np.nan) for _, c in rows], 0.4, label="reference (causal protocol)")
    ax.set_xticks(x, [f for f, _ in rows], rotation=30, ha="right")
    ax.set_ylabel("perplexity")
    ax.set_ylim(bottom=0.95 * min(c["ppl"] for _, c in rows))  # the differences, not the common 30-odd
    s = rep["settings"]
    ax.set_title(f"{s['model']}, {s['data']}: {s['windows']} x {s['seq_len']} tokens through the server")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.served_ppl", description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=None, help=f"default: {' '.join(DEFAULT_FORMATS)} (auto is always run)")
    p.add_argument("--model", default=None, help="an embedded model (default smollm2) or a local HF folder")
    p.add_argument("--artifact", default=None, help="calibration artifact (default: the model's own)")
    p.add_argument("--data", default="brown")
    p.add_argument("--windows", type=int, default=None, help="windows of text (default 8; smoke 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per window (default 2048; smoke 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="vLLM's prefill chunk (default 2048; smoke 128, so the windows are prefilled in chunks)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--no-reference", action="store_true", help="skip the float32 reference scoring")
    p.add_argument("--rerun", action="store_true",
                   help="measure every format again (default: reuse those an earlier run with the same settings "
                        "measured)")
    p.add_argument("--server-timeout", type=float, default=900)
    add_dtype_arg(p)
    add_smoke_args(p, "2 windows of 256 tokens, auto and temporalkv-2bit, into a temp dir")
    a = p.parse_args(argv)
    apply_sizes(a, dict(formats=DEFAULT_FORMATS, windows=8, seq_len=2048, max_num_batched_tokens=2048),
                dict(formats=["auto", "temporalkv-2bit"], windows=2, seq_len=256, max_num_batched_tokens=128),
                "served-ppl-smoke-")
    return run(a)


if __name__ == "__main__":
    main()
