"""Where a compressed cache loses a needle: the teacher-forced NLL of each answer token of retrieval prompts.

    python -m benchmarks.needle_nll --artifact A --configs bf16 temporalkv-2bit temporalkv-2bit@window16

The retrieval suite's prompts (benchmarks/retrieval.py, same seed), the reference answer appended, scored in
plain transformers (float32) under the quality harness's causal protocol - what a served query sees: its own
block and recent window exact, earlier blocks decoded.  A greedy server answer is one sample of this: a token
whose NLL rises above ~0.7 is where it may stop or go wrong.  Writes needle-nll.json / .md to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .common import RESULTS, run_record, write_json


def run(args) -> dict:
    from vllm_temporalkv.artifact import Artifact
    from vllm_temporalkv.models import load_hf_model, load_tokenizer, resolve_model

    from .quality import Simulator, token_nlls
    from .retrieval import SuiteBuilder

    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    art = Artifact.load(args.artifact) if args.artifact else None
    model = load_hf_model(model_dir, dtype=torch.float32)
    rows = []
    for s in SuiteBuilder(tok, seed=args.seed).build(tasks=args.tasks, lengths=args.lengths, samples=args.samples):
        prompt = tok.encode(s.prompt)
        answer = tok.encode(" " + s.answers[0] + ".", add_special_tokens=False)
        ids = torch.tensor(prompt + answer)
        row = {"task": s.task, "length": s.length, "index": s.index, "answer": s.answers[0],
               "tokens": tok.convert_ids_to_tokens(answer), "nll": {}}
        for name in args.configs:
            nll = token_nlls(model, ids, Simulator(name, art, None, "causal"))[len(prompt) - 1:]
            row["nll"][name] = [round(float(x), 4) for x in nll]
        rows.append(row)
        print(s.task, s.length, {n: round(sum(v), 2) for n, v in row["nll"].items()})
    return {"settings": {"configs": args.configs, "tasks": args.tasks, "lengths": args.lengths,
                         "samples": args.samples, "seed": args.seed}, "rows": rows, "run": run_record()}


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
    path.write_text("\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.needle_nll", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--artifact", default=None, help="calibration artifact for the codebook formats")
    p.add_argument("--configs", nargs="+", default=["bf16", "temporalkv-2bit"],
                   help="quality-harness configurations (formats, -o1, @windowN, @keys-only, ...)")
    p.add_argument("--tasks", nargs="+", default=["niah_single", "niah_multikey"])
    p.add_argument("--lengths", nargs="+", type=int, default=[4096])
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    rep = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "needle-nll.json", rep)
    write_markdown(rep, out / "needle-nll.md")
    print((out / "needle-nll.md").read_text())


if __name__ == "__main__":
    main()
