"""Long-context retrieval through a real server: a RULER-style suite scored over OpenAI requests.

    python -m benchmarks.retrieval                                   # every format, one server each
    python -m benchmarks.retrieval --formats auto temporalkv-2bit --lengths 4096 --samples 4
    python -m benchmarks.retrieval --url http://host:8000/v1 --served-model-name m --tokenizer MODEL_DIR

Tasks (after RULER, Hsieh et al. 2024; built here, deterministic for a --seed):
    niah_single      one "special magic number" needle in a haystack of Austen's prose
    niah_multikey    the same with 3 distractor needles under other keys
    niah_multivalue  4 numbers under one key: all must be found
    niah_multiquery  4 keys asked at once
    vt               variable tracking: a chain of 5 assignments "VAR A = 12345", "VAR B = VAR A", ...
    cwe              common-word extraction from a numbered word list (10 words x 30, the rest x 3)
at every --lengths (prompt + answer tokens; default 2k / 4k / 8k, SmolLM2's limit). A sample scores the
share of its reference strings found in the greedy answer (RULER's string match).

The suite only talks to an OpenAI-compatible /v1/completions endpoint, so it scores any server (--url).
The runner starts `vllm serve` (python -m vllm.entrypoints.openai.api_server) once per --kv-cache-dtype
in turn (``<format>-o1``: with 1% outliers, ``-o0.5`` with 0.5%; ``<format>@windowN``: with a recent window of N half-precision tokens). Results: retrieval.json / .md / .png in --out (retrieval-<name>.* for a --name other than smollm2); with the default --out the headline figures
``retrieval.<name>.<format>.avg_accuracy`` (mean over tasks and lengths, 0-1) are merged into
benchmarks/results/headline.json.
"""


from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from ..common import add_dtype_arg, add_out_arg, machine, model_dtype, run_record, write_json
from .report import report, results_stem
from .runner import CHECKPOINT_S, artifact_digest, reusable, run_suite, serve_and_score
from .stats import samples_per_cell, summarize
from .suite import LENGTHS, TASKS, SuiteBuilder, record_key


def machine_tag() -> str:
    """The CPU model and class: which wall times of a results file may be compared."""
    m = machine()
    return f"{m['cpu']} ({m['cpu_class']})"


def default_formats() -> list[str]:
    from vllm_temporalkv.formats import FORMATS

    return ["auto", "fp8"] + list(FORMATS)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.retrieval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct; its "
                   "artifact must be in <model>/temporalkv/calibration.safetensors or given with --artifact)")
    p.add_argument("--name", default="smollm2", help="model tag in the headline keys")
    p.add_argument("--formats", nargs="+", default=None, help="--kv-cache-dtype values (default: auto, fp8 and "
                   "every format the plugin serves); <format>-o1 serves a plugin format with 1%% exact outliers, -o0.5 with 0.5%%")
    p.add_argument("--artifact", default=None, help="calibration artifact for the plugin's formats")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    p.add_argument("--samples", type=int, default=10, help="samples per task and length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (= --max-num-seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-space-gib", type=int, default=2)
    add_dtype_arg(p)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--server-timeout", type=float, default=900)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed on to every server (last)")
    p.add_argument("--url", default=None, help="score this running server instead of starting any")
    p.add_argument("--served-model-name", default=None, help="with --url: the model name to request")
    p.add_argument("--tokenizer", default=None, help="with --url: tokenizer folder for building prompts")
    p.add_argument("--resume", action="store_true", help="keep the formats an earlier run with the same tasks, "
                   "lengths, samples and seed already scored in --out/retrieval.json")
    add_out_arg(p)
    p.add_argument("--rerender", action="store_true", help="only recompute the summaries, intervals, tables, plot "
                   "and headline from --out/retrieval.json (no server)")
    args = p.parse_args(argv)
    if args.rerender:
        stem = results_stem(args.name)
        return report(json.loads((Path(args.out) / f"{stem}.json").read_text()), Path(args.out), stem)

    from vllm_temporalkv.models import load_tokenizer, resolve_model

    model = str(resolve_model(args.model)) if args.url is None or args.tokenizer is None else None
    tok = load_tokenizer(args.tokenizer or model)
    samples = SuiteBuilder(tok, args.seed).build(args.tasks, args.lengths, args.samples)
    print(f"{len(samples)} samples: {len(args.tasks)} tasks x {len(args.lengths)} lengths x {args.samples}")
    args.dtype = model_dtype(args.dtype)
    settings = {"name": args.name, "tasks": args.tasks, "lengths": args.lengths, "samples": args.samples,
                "seed": args.seed, "concurrency": args.concurrency, "max_num_batched_tokens": args.max_num_batched_tokens,
                "dtype": args.dtype}
    out = Path(args.out)
    results, partial = {}, {}
    saved = out / f"{results_stem(args.name)}.json"
    if args.resume and saved.is_file():  # keep what an earlier run with the same suite scored
        prev = json.loads(saved.read_text())
        # runs before --dtype existed served bfloat16; the sample count may differ (records are matched one by one)
        same = (all(prev["settings"].get(k) == settings[k] for k in ("tasks", "lengths", "seed"))
                and prev["settings"].get("dtype", "bfloat16") == settings["dtype"])
        if same:
            results = {f: r for f, r in prev["formats"].items() if "error" not in r}
            partial = prev.get("partial", {})
            print(f"resuming: {', '.join(results) or 'nothing'} scored"
                  + (f"; {', '.join(partial)} part-way" if partial else ""))
        else:
            print("not resuming: the earlier run had other tasks, lengths, seed or dtype")

    def save():
        write_json(saved, {"settings": settings, "formats": results, "run": run_record(),
                                            **({"partial": partial} if partial else {})})

    if args.url:
        recs = run_suite(args.url, args.served_model_name or "model", samples, args.concurrency)
        results[args.served_model_name or args.url] = {"records": recs, **summarize(recs)}
    else:
        fmts = args.formats or default_formats()
        here = machine_tag()
        for fmt in tqdm(fmts, desc="servers", unit="server"):
            digest = artifact_digest(model, fmt, args.artifact)
            old = results.get(fmt, {})
            if old.get("artifact_sha256") != digest and digest is not None:
                old = {}  # another calibration: nothing to reuse
            half = partial.get(fmt, {})
            if half.get("artifact_sha256") != digest:
                half = {}
            have = reusable(old.get("records", []) + half.get("records", []), samples)
            todo = [x for x in samples if (x.task, x.length, x.index) not in have]
            if not todo:
                continue
            # records of indices beyond this run's samples (an earlier, longer run) stay
            kept = [r for r in old.get("records", []) if record_key(r) not in have] + list(have.values())
            done, last = list(kept), [time.time()]

            def checkpoint(rec, done=done, last=last, fmt=fmt, digest=digest):
                done.append(rec)
                if time.time() - last[0] > CHECKPOINT_S:  # a long run can be stopped and resumed at any point
                    partial[fmt] = {"records": list(done), "artifact_sha256": digest, "machine": here}
                    save()
                    last[0] = time.time()

            if have:
                tqdm.write(f"{fmt}: {len(have)} prompts already scored, {len(todo)} to go")
            try:
                r = serve_and_score(model, fmt, todo, args, on_record=checkpoint)
                recs = sorted(kept + r.pop("records"), key=record_key)
                if old:  # the start-up of the first run
                    r["startup_s"] = old.get("startup_s", r["startup_s"])
                if old.get("suite_s") is not None and old.get("records"):  # time summed over the top-ups
                    r["suite_s"] = round(old["suite_s"] + r["suite_s"], 1)
                    r["suite_prompts"] = old.get("suite_prompts", len(old["records"])) + r["suite_prompts"]
                # wall times compare only within one machine (the report's ÷ auto): records scored elsewhere
                # (an earlier run's, kept) make them "mixed"
                prior = {x.get("machine") for x in (old, half) if x.get("records")}
                results[fmt] = {"records": recs, **summarize(recs), "samples": samples_per_cell(recs),
                                **r, "artifact_sha256": digest, "command": run_record()["command"],
                                "machine": here if prior <= {here} else "mixed"}
            except Exception as e:  # a refusing format is a result, not the end of the run
                if not old:
                    results[fmt] = {"error": f"{type(e).__name__}: {e}"[-600:]}
                else:
                    tqdm.write(f"{fmt}: the top-up failed ({type(e).__name__}: {e}); keeping the earlier records")
            partial.pop(fmt, None)
            r = results.get(fmt, {})
            tqdm.write(f"{fmt:20} " + (r["error"] if "error" in r else
                                        f"avg {r['avg_accuracy']:.3f} per length {r['per_length']}"))
            save()
    return report({"settings": settings, "formats": results, "run": run_record(),
                   **({"partial": partial} if partial else {})}, out, saved.stem)
