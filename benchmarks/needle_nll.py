"""Where a compressed cache loses a needle: the teacher-forced NLL of each answer token of retrieval prompts.

    python -m benchmarks.needle_nll --artifact A --configs bf16 temporalkv-2bit temporalkv-2bit@window16

The retrieval suite's prompts (benchmarks/retrieval/suite.py, same seed), the reference answer appended, scored in
plain transformers (float32) under the quality harness's causal protocol - what a served query sees: its own
block and recent window exact, earlier blocks decoded.  A greedy server answer is one sample of this: a token
whose NLL rises above ~0.7 is where it may stop or go wrong.  Also, for the query that predicts the answer's first
token, per layer and head: the attention mass on the needle's value tokens and their best rank among all keys,
with the keys as served and with that layer's keys exact (same query) - where the scores lose the needle.
Writes needle-nll.json / .md to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .common import add_out_arg, run_record, write_json


def run(args) -> dict:
    from vllm_temporalkv.artifact import Artifact, default_artifact_path
    from vllm_temporalkv.formats import get_format
    from vllm_temporalkv.harness.simulate import _ACTIVE, Simulator, parse_config, token_nlls
    from vllm_temporalkv.models import load_hf_model, load_tokenizer, resolve_model

    from .retrieval.suite import _NEEDLE, SuiteBuilder

    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    art = Artifact.load(args.artifact or default_artifact_path(model_dir)) if any(
        n != "bf16" and get_format(parse_config(n)[0]).needs_calibration for n in args.configs) else None
    model = load_hf_model(model_dir, dtype=torch.float32)
    rows = []
    for s in SuiteBuilder(tok, seed=args.seed).build(tasks=args.tasks, lengths=args.lengths, samples=args.samples):
        prompt = tok.encode(s.prompt)
        answer = tok.encode(" " + s.answers[0] + ".", add_special_tokens=False)
        ids = torch.tensor(prompt + answer)
        row = {"task": s.task, "length": s.length, "index": s.index, "answer": s.answers[0],
               "tokens": tok.convert_ids_to_tokens(answer), "nll": {}}
        span = needle_span(tok, s.prompt, prompt, _NEEDLE.format(key=s.meta["keys"][0], value=s.answers[0]),
                           s.answers[0])
        row["needle_tokens"] = span
        row["attention"] = {}
        for name in args.configs:
            # the query that predicts the answer's first token: where its attention finds the needle (or not)
            _ACTIVE["probe"] = {"query": len(prompt) - 1, "span": span, "layers": {}}
            try:
                nll = token_nlls(model, ids, Simulator(name, art, None, "causal"))[len(prompt) - 1:]
            finally:
                probe = _ACTIVE.pop("probe")
            row["nll"][name] = [round(float(x), 4) for x in nll]
            row["attention"][name] = {str(k): v for k, v in sorted(probe["layers"].items())}
        rows.append(row)
        print(s.task, s.length, {n: round(sum(v), 2) for n, v in row["nll"].items()})
    return {"settings": {"configs": args.configs, "tasks": args.tasks, "lengths": args.lengths,
                         "samples": args.samples, "seed": args.seed}, "rows": rows, "run": run_record()}


def needle_span(tok, text: str, ids: list[int], needle: str, value: str) -> list[int]:
    """Positions of the prompt tokens that spell the needle's value (``value`` inside the ``needle`` sentence)."""
    at = text.find(needle)
    if at < 0:
        raise ValueError(f"needle {needle!r} not in the prompt")
    lo = at + needle.rindex(value)
    hi = lo + len(value)
    enc = tok(text, return_offsets_mapping=True)
    if enc["input_ids"] != ids:
        raise ValueError("the tokenizer's offsets do not describe the prompt's tokens")
    span = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < hi and b > lo]
    if not span:
        raise ValueError(f"no token of {value!r} found at characters {lo}..{hi}")
    return span


def retrieval_heads(rep: dict, top: int = 4) -> list[dict]:
    """Per prompt and configuration: the ``top`` (layer, head) pairs with the most exact-key attention mass on the
    needle under bf16 (the model's retrieval heads for that prompt), and what each configuration's served and
    exact scores give them."""
    out = []
    for r in rep["rows"]:
        att = r.get("attention", {})
        if "bf16" not in att:
            continue
        ranked = sorted(((m, int(layer), h) for layer, a in att["bf16"].items()
                         for h, m in enumerate(a["exact"]["mass"])), reverse=True)[:top]
        for _, layer, h in ranked:
            cells = {c: {k: att[c][str(layer)][k]["mass"][h] for k in ("exact", "served")} |
                     {"rank_served": att[c][str(layer)]["served"]["rank"][h]} for c in att}
            out.append({"prompt": f"{r['task']}@{r['length']} #{r['index']}", "layer": layer, "head": h, **cells})
    return out


def write_markdown(rep: dict, path: Path) -> None:
    cfgs = rep["settings"]["configs"]
    lines = ["# Teacher-forced NLL of retrieval answers (causal protocol: what a served query sees)", "",
             f"Command: `{rep['run']['command']}`  ", f"Machine: {rep['run']['machine']['cpu']}, {rep['run']['time']}", "",
             "| prompt | answer | " + " | ".join(f"{c}: sum (per token)" for c in cfgs) + " |",
             "|---|---|" + "---|" * len(cfgs)]
    for r in rep["rows"]:
        cells = [f"{sum(r['nll'][c]):.2f} ({' '.join(f'{x:.2f}' for x in r['nll'][c])})" for c in cfgs]
        lines.append(f"| {r['task']}@{r['length']} #{r['index']} | {r['answer']} | " + " | ".join(cells) + " |")
    lines += ["", "Per-token NLL in nats, over the answer's tokens (a space, its digits, the final period)."]
    heads = retrieval_heads(rep)
    if heads:
        lines += ["", "## Where the first answer token's query finds the needle", "",
                  "The (layer, head) pairs that put the most attention on the needle's value tokens under bf16 (the "
                  "prompt's retrieval heads), and per configuration the attention mass they put there as served "
                  "(decoded keys before the query's block) / with that layer's keys exact (same query), and the "
                  "needle's rank among all keys as served (0 = top).", "",
                  "| prompt | layer.head | " + " | ".join(f"{c}: served / exact (rank)" for c in cfgs) + " |",
                  "|---|---|" + "---|" * len(cfgs)]
        for h in heads:
            cells = [f"{h[c]['served']:.3f} / {h[c]['exact']:.3f} ({h[c]['rank_served']})" for c in cfgs]
            lines.append(f"| {h['prompt']} | {h['layer']}.{h['head']} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.needle_nll", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--artifact", default=None, help="calibration artifact for the codebook formats (default: the "
                   "model folder's, where the server looks)")
    p.add_argument("--configs", nargs="+", default=["bf16", "temporalkv-2bit"],
                   help="quality-harness configurations (formats, -o1, @windowN, @keys-only, ...)")
    p.add_argument("--tasks", nargs="+", default=["niah_single", "niah_multikey"])
    p.add_argument("--lengths", nargs="+", type=int, default=[4096])
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    add_out_arg(p)
    args = p.parse_args(argv)
    rep = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "needle-nll.json", rep)
    write_markdown(rep, out / "needle-nll.md")
    print((out / "needle-nll.md").read_text())


if __name__ == "__main__":
    main()
