"""Why the calibration-free formats break on one model and not another: the channels of the pre-RoPE K / V.

    python -m benchmarks.kv_outliers                                   # SmolLM2 and Qwen2.5-Coder-1.5B, 1024 tokens
    python -m benchmarks.kv_outliers --models qwen2.5-coder-1.5b --tokens 512

On Qwen2.5-Coder-1.5B the per-token formats (selective-int4, QJL, TaDA-4bit) collapse (perplexity 1e3-1e6, issue 35)
while the per-channel codebook formats and selective-int8 hold.  A per-token quantizer shares one scale over a
token's head dim: when a few channels are far larger than the rest (a projection bias adds a constant per channel),
that scale is set by them and the other channels round to zero.  This measures, per model, layer and K / V, on one
window of Brown text (the real model, float32, vLLM not involved):

* channel ratio: the largest channel's mean |x| over the median channel's, per (layer, KV head);
* with the selective codec's own quantizer (``SelectiveCodec``, per-token absmax): the share of nonzero values
  int4 rounds to zero, and the relative error per channel ||x_c - x^_c|| / ||x_c|| over the tokens, averaged over
  (head, channel) so that every channel counts the same, at int4 and int8;
* the same int4 grid with one scale per channel instead (absmax over the window's tokens): what a per-channel scale,
  as KIVI and KVQuant use for keys, would leave.

Results: kv-outliers.json / .md / .png in --out; headline ``kv_outliers.brown.<model>.<k|v>.<metric>`` (the model as
benchmarks.quality names it: smollm2, qwen2.5-1.5b).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .common import add_headline_arg, add_out_arg, is_results, merge_headline, run_record, write_json
from .quality import model_tag

DEFAULT_MODELS = ("smollm2", "qwen2.5-coder-1.5b")


def per_channel_int4(x: torch.Tensor, qmax: int = 7) -> torch.Tensor:
    """x [T, H, D] on the int4 grid with one scale per (head, channel): absmax over the tokens."""
    s = x.abs().amax(0, keepdim=True) / qmax + 2.0**-24
    return torch.round(x / s).clamp(-qmax, qmax) * s


def layer_stats(x: torch.Tensor) -> dict[str, float]:
    """x [T, H, D] float32, one layer's K or V."""
    from vllm_temporalkv.codecs.selective import SelectiveCodec

    ch = x.abs().mean(0)  # [H, D]
    ratio = (ch.amax(-1) / ch.median(-1).values.clamp_min(1e-12)).amax().item()

    def rel(y):  # each (head, channel) weighs the same: a norm over all values would be the big channels' alone
        return ((x - y).norm(dim=0) / x.norm(dim=0).clamp_min(1e-12)).mean().item()

    q4 = SelectiveCodec(4)
    code, _ = q4.encode(x)
    nz = x != 0
    return dict(channel_ratio=ratio,
                int4_zeroed=((code == 0) & nz).sum().item() / max(1, nz.sum().item()),
                int4_rel_err=rel(q4.roundtrip(x)), int8_rel_err=rel(SelectiveCodec(8).roundtrip(x)),
                int4_per_channel_rel_err=rel(per_channel_int4(x)))


def measure(model_spec: str, tokens: int) -> dict:
    from vllm_temporalkv.corpora import load_corpus, token_windows
    from vllm_temporalkv.hf_hooks import kv_output_hooks
    from vllm_temporalkv.models import load_hf_model, load_tokenizer, resolve_model

    d = resolve_model(None if model_spec == "smollm2" else model_spec)
    model = load_hf_model(d, dtype=torch.float32)
    ids = token_windows(load_tokenizer(d), load_corpus("brown"), tokens, 1)[0]
    rows: list[dict] = []

    def grab(layer, kind, out):
        rows.append(dict(layer=layer, kind=kind, **layer_stats(out[0].detach().float())))

    with torch.no_grad(), kv_output_hooks(model, grab):
        model(ids[None])
    del model
    return dict(model=d.name, tokens=tokens, layers=rows)


def summary(rows: list[dict], kind: str) -> dict[str, float]:
    r = [x for x in rows if x["kind"] == kind]
    out = {"channel_ratio_max": max(x["channel_ratio"] for x in r),
           "channel_ratio_median": sorted(x["channel_ratio"] for x in r)[len(r) // 2]}
    for m in ("int4_zeroed", "int4_rel_err", "int8_rel_err", "int4_per_channel_rel_err"):
        out[m + "_mean"] = sum(x[m] for x in r) / len(r)
    out["int4_rel_err_max"] = max(x["int4_rel_err"] for x in r)
    return out


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for tag, m in rep["models"].items():
        for kind, ls in (("k", "-"), ("v", "--")):
            r = [x for x in m["layers"] if x["kind"] == kind]
            axes[0].semilogy([x["layer"] for x in r], [x["channel_ratio"] for x in r], ls, label=f"{tag} {kind}")
            axes[1].plot([x["layer"] for x in r], [x["int4_rel_err"] for x in r], ls, label=f"{tag} {kind} per token")
            if kind == "k":
                axes[1].plot([x["layer"] for x in r], [x["int4_per_channel_rel_err"] for x in r], ":",
                             label=f"{tag} k per channel")
    axes[0].set(xlabel="layer", ylabel="largest / median channel mean |x|", title="pre-RoPE channel spread")
    axes[1].set(xlabel="layer", ylabel="mean over channels of ||x_c - x^_c|| / ||x_c||", title="int4 round trip (selective's quantizer)")
    for a in axes:
        a.legend(fontsize=7)
    fig.suptitle(rep["run"]["command"], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_outliers", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS),
                   help="embedded names (smollm2, qwen2.5-coder-1.5b) or model folders")
    p.add_argument("--tokens", type=int, default=1024, help="one window of Brown text")
    add_out_arg(p)
    add_headline_arg(p)
    a = p.parse_args(argv)
    out = Path(a.out)
    rep = dict(run=run_record(), tokens=a.tokens, models={})
    for spec in a.models:
        tag = model_tag(spec) or "smollm2"
        m = measure(spec, a.tokens)
        m["summary"] = {k: summary(m["layers"], k) for k in ("k", "v")}
        rep["models"][tag] = m
        print(tag, {k: {n: round(v, 4) for n, v in s.items()} for k, s in m["summary"].items()}, flush=True)
    write_json(out / "kv-outliers.json", rep)
    lines = ["# Pre-RoPE K / V channels and per-token int4 (benchmarks.kv_outliers)\n",
             f"Command: `{rep['run']['command']}`  ", f"Machine: {rep['run']['machine'].get('cpu', '')}; one window of "
             f"{a.tokens} Brown tokens, float32 model; means over layers.\n",
             "| model | K/V | channel ratio (max / median over layers) | int4 per token: values zeroed | "
             "int4 per token: channel rel. error (mean / max) | int8 per token: channel rel. error | int4 per channel: channel rel. error |",
             "|---|---|---|---|---|---|---|"]
    for tag, m in rep["models"].items():
        for kind, s in m["summary"].items():
            lines.append(f"| {tag} | {kind.upper()} | {s['channel_ratio_max']:.1f} / {s['channel_ratio_median']:.1f} | "
                         f"{s['int4_zeroed_mean']:.1%} | {s['int4_rel_err_mean']:.3f} / {s['int4_rel_err_max']:.3f} | "
                         f"{s['int8_rel_err_mean']:.4f} | {s['int4_per_channel_rel_err_mean']:.3f} |")
    (out / "kv-outliers.md").write_text("\n".join(lines) + "\n")
    plot(rep, out / "kv-outliers.png")
    if is_results(out) and not a.no_headline:
        merge_headline({f"kv_outliers.brown.{tag}.{kind}.{n}": v for tag, m in rep["models"].items()
                        for kind, s in m["summary"].items() for n, v in s.items()})
    print("\n".join(lines))
    return rep


if __name__ == "__main__":
    main()
