"""SmolLM2's real weights served by vLLM on a GPU against the oracle (issue 31): greedy tokens and first-token top-5
logprobs of the same prompts, per format and per attention path.

    python -m benchmarks.gpu.oracle_match --reference benchmarks/gpu/smollm2-reference.json   # here: vLLM on the CPU
    python -m benchmarks.gpu.oracle_match --check REF.json --model DIR --artifact A --out $OUT  # the box: vLLM 0.26
    python -m benchmarks.gpu.oracle_match --rescore BOX.json [MORE.json]   # here: score the box's reports, commit
    python -m benchmarks.gpu.oracle_match --sensitivity 0.0005 0.002       # here: perturbed weights vs the reference

Each configuration is one offline vLLM engine (``LLM``) in its own process: bf16, enforce_eager, no prefix cache,
4 prompts of 1,000 Austen tokens (their token ids travel in the reference, so the box needs no corpus), 32 greedy
tokens each with the top-5 logprobs of every step.  Paths: ``default`` (what serves: C++ on the CPU, the CUDA decode
on a GPU), ``triton`` (VLLM_TEMPORALKV_CUDA_DECODE=0), ``torch`` (VLLM_TEMPORALKV_OPS=torch: the oracle codec) and
``graphs`` (the default path with full CUDA graphs: VLLM_TEMPORALKV_CUDA_GRAPHS=1, not eager).  The comparisons and
the report live in oracle_report.py.

The check compares, per format: (1) each GPU path with the GPU torch path - the same model math, only the attention
kernels differ: the first token's top-1 must agree on every prompt and its top-5 logprobs within ``--tol``;
(2) the GPU's default path with the CPU reference, against ``auto``'s own GPU-vs-CPU difference measured in the
same run (the platforms' GEMMs differ): within max(``--tol``, 2 x auto's).  Both weight sets are hashed: the check
refuses a model whose dequantized weights differ from the reference's.  Exit status 1 when a comparison fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from vllm_temporalkv.harness.server import run_logged, stop_on_sigterm

from ..common import error_line

from .oracle_report import FORK_BUG, GPU_PATHS, MAX_TOKENS, N_PROMPTS, PROMPT_TOKENS, TOP, compare, report

FORMATS = ["auto", "temporalkv-2bit", "selective-int4"]
PATHS = {"default": {}, "triton": {"VLLM_TEMPORALKV_CUDA_DECODE": "0"}, "torch": {"VLLM_TEMPORALKV_OPS": "torch"},
         # the default path with full CUDA graphs of the decode steps (opt-in; the engine then runs without
         # enforce_eager): --paths graphs, compared with the eager default
         "graphs": {"VLLM_TEMPORALKV_CUDA_GRAPHS": "1"}}


def weights_hash(model_dir: str) -> str:
    """sha256 over the model's tensors in name order (names, dtypes, shapes, bytes): equal dequantized weights give
    equal hashes whatever library wrote the file."""
    from safetensors import safe_open

    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in sorted(st.keys()):
                t = st.get_tensor(k).contiguous()
                h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def file_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def prompts(model_dir: str) -> list[list[int]]:
    from vllm_temporalkv.corpora import load_austen
    from vllm_temporalkv.models import load_tokenizer

    tok, books = load_tokenizer(model_dir), load_austen()
    titles = sorted(books)[:N_PROMPTS]
    return [tok.encode(books[t])[40_000:40_000 + PROMPT_TOKENS] for t in titles]


def run_one(model_dir: str, fmt: str, artifact: str | None, ids: list[list[int]], gpu: bool) -> dict:
    """One engine, in this process (the caller's subprocess): greedy tokens and top-5 logprobs per prompt."""
    from vllm import LLM, SamplingParams

    kw = dict(gpu_memory_utilization=0.3) if gpu else {}
    extra = {"temporalkv_artifact": artifact} if artifact and fmt != "auto" else {}
    t = time.time()
    eager = os.environ.get("VLLM_TEMPORALKV_CUDA_GRAPHS") != "1"
    llm = LLM(model=model_dir, kv_cache_dtype=fmt, dtype="bfloat16", max_model_len=2048, enforce_eager=eager,
              enable_prefix_caching=False, additional_config=extra, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP),
                        use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        steps = [{str(tid): float(lp.logprob) for tid, lp in step.items()} for step in (c.logprobs or [])]
        res.append(dict(tokens=list(c.token_ids), logprobs=steps))
    return dict(format=fmt, seconds=round(time.time() - t, 1), prompts=res)


def launch(model_dir: str, fmt: str, path: str, artifact: str | None, ids_file: Path, out: Path, gpu: bool,
           timeout: float) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", **PATHS[path])
    if not gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # the engine's process is told it is on a GPU rather than asking torch: torch.cuda.is_available() would make
    # vLLM's fork of its engine core fail ("Cannot re-initialize CUDA in forked subprocess"; vllm_temporalkv.accel)
    cmd = [sys.executable, "-m", "benchmarks.gpu.oracle_match", "--one", fmt, "--model", model_dir,
           "--ids", str(ids_file), "--json", str(out)] + (["--artifact", artifact] if artifact else []) + \
        (["--gpu"] if gpu else [])
    # run_logged: past the timeout the engine's whole process group stops (its engine core would otherwise keep the
    # GPU's memory and fail every later engine of the stage) and the log so far says how far it got
    log = out.with_suffix(".log")
    rc, text = run_logged(cmd, env, timeout, log)
    fork_bug = None
    if (rc or not out.is_file()) and FORK_BUG in text and "VLLM_WORKER_MULTIPROC_METHOD" not in env:
        # something in the engine's parent touched CUDA again: record it (a user's engine would fail the same way)
        # and still measure, with spawn - device minutes are too few to come back for the numbers
        fork_bug = error_cause(text)
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        rc, text = run_logged(cmd, env, timeout, log)
    if rc is None:
        return dict(format=fmt, path=path, error=error_line(text, None, timeout),
                    cause=[f"TimeoutError: the engine ran past {timeout:g} s"], fork_bug=fork_bug)
    if rc or not out.is_file():
        return dict(format=fmt, path=path, error=text[-3000:], cause=error_cause(text), fork_bug=fork_bug)
    rec = json.loads(out.read_text())
    rec["path"] = path
    if fork_bug:
        rec["fork_bug"] = fork_bug
    return rec


def error_cause(text: str) -> list[str]:
    """The distinct exception lines of a failed engine, in order: vLLM's engine core logs its root cause long
    before the launcher's own traceback, which is all a tail of stderr shows."""
    seen: list[str] = []
    for line in text.splitlines():
        m = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.*)", line)
        if m and (c := f"{m.group(1)}: {m.group(2).strip()}"[:400]) not in seen:
            seen.append(c)
    return seen[-6:]


def reference(a) -> int:
    from vllm_temporalkv.models import resolve_model

    model = str(resolve_model(a.model))
    artifact = a.artifact or "runs/oracle/calibration.safetensors"
    if not Path(artifact).is_file():  # the first-use size of `vllm-temporalkv serve` (4 x 1024 tokens)
        subprocess.run([sys.executable, "-m", "calibrate", "--model", model, "--formats", "temporalkv-2bit",
                        "--num-samples", "4", "--seq-len", "1024", "--output", artifact], check=True)
    ids = prompts(model)
    work = Path(a.out or "/tmp/oracle-ref")
    work.mkdir(parents=True, exist_ok=True)
    # an engine's record is reused when the work folder holds one for the same prompts and calibration (resume)
    stamp = work / "inputs.json"
    inputs = dict(ids=ids, artifact_sha256=file_hash(artifact))
    fresh = not stamp.is_file() or json.loads(stamp.read_text()) != inputs
    stamp.write_text(json.dumps(inputs))
    (work / "ids.json").write_text(json.dumps(ids))
    runs = {}
    for fmt in a.formats:
        for path in ("default", "torch") if fmt != "auto" else ("default",):
            rec = work / f"{fmt}-{path}.json"
            if not fresh and rec.is_file():
                runs[f"{fmt}/{path}"] = dict(json.loads(rec.read_text()), path=path)
                continue
            print(f"CPU {fmt} {path} ...", flush=True)
            runs[f"{fmt}/{path}"] = launch(model, fmt, path, artifact, work / "ids.json", rec, False, a.timeout)
    from benchmarks.common import run_record

    ref = dict(model=Path(model).name, weights_sha256=weights_hash(model), artifact_sha256=file_hash(artifact),
               prompt_ids=ids, runs=runs, run=run_record(),
               cpu_vs_torch={k: compare(v, runs[k.split("/")[0] + "/torch"]) for k, v in runs.items()
                             if k.endswith("/default") and not k.startswith("auto") and "error" not in v})
    Path(a.reference).write_text(json.dumps(ref, indent=1))
    bad = [k for k, v in runs.items() if "error" in v]
    print(json.dumps(ref["cpu_vs_torch"], indent=1)[:3000])
    print(f"reference written to {a.reference}" + (f"; FAILED: {bad}" if bad else ""))
    return 1 if bad else 0


def perturbed_copy(model_dir: str, rel: float, seed: int, dest: Path) -> Path:
    """The model with every matrix but the embedding scaled by (1 + rel * N(0, 1)) per weight, rounded back to its
    dtype: a stand-in, on one machine, for what another platform's arithmetic does to the activations."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(model_dir, dest)
    g = torch.Generator().manual_seed(seed)
    for f in sorted(dest.glob("*.safetensors")):
        w = load_file(str(f))
        for k, t in w.items():
            if t.dim() == 2 and "embed" not in k:
                w[k] = (t.float() * (1 + rel * torch.randn(t.shape, generator=g))).to(t.dtype)
        save_file(w, str(f), metadata={"format": "pt"})
    return dest


def sensitivity(a) -> int:
    """How far do platform-sized perturbations move each format's logprobs, here on the CPU? The oracle check
    compares a GPU with this CPU through a quantizer: a nearest-centroid choice flips on a near tie, so a
    compressed cache can amplify the platforms' rounding differences where a bf16 cache does not."""
    from benchmarks.common import run_record, write_json
    from vllm_temporalkv.models import resolve_model

    ref = json.loads(Path(a.reference_for).read_text())
    model = str(resolve_model(a.model))
    artifact = a.artifact or "runs/oracle/calibration.safetensors"
    if weights_hash(model) != ref["weights_sha256"] or file_hash(artifact) != ref["artifact_sha256"]:
        print("the model or the calibration is not the reference's")
        return 1
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "ids.json").write_text(json.dumps(ref["prompt_ids"]))
    formats = [f for f in a.formats if f"{f}/default" in ref["runs"]]
    rows = []
    for rel in a.sensitivity:
        for seed in a.seeds:
            m = perturbed_copy(model, rel, seed, work / f"perturbed-{rel}-{seed}")
            for fmt in formats:
                print(f"CPU {fmt}, weights x (1 + {rel} N(0,1)), seed {seed} ...", flush=True)
                run = launch(str(m), fmt, "default", artifact, work / "ids.json", work / f"{fmt}-{rel}-{seed}.json",
                             False, a.timeout)
                row = dict(rel=rel, seed=seed, format=fmt, seconds=run.get("seconds"))
                row.update({"error": run["error"][-500:]} if "error" in run else
                           {k: v for k, v in compare(run, ref["runs"][f"{fmt}/default"]).items() if k != "prompts"})
                rows.append(row)
    out = Path(a.out or "benchmarks/results/gpu-oracle")
    write_json(out / "sensitivity.json", dict(reference=a.reference_for, rows=rows, run=run_record()))
    lines = ["# How far platform-sized perturbations move the logprobs (CPU, SmolLM2-135M, vLLM CPU)\n",
             "Every weight matrix but the embedding scaled by (1 + rel x N(0,1)) per weight, then the oracle's prompts "
             "and comparison (`benchmarks/gpu/oracle_match.py`) against the unperturbed CPU reference.\n",
             "| rel | seed | format | first-token top-1 equal | max abs dlogprob, first token | greedy prefix (min of 32) "
             "| max abs dlogprob, decode steps in the shared prefix |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rel']} | {r['seed']} | {r['format']} | " + (f"error: {r['error'][-120:]} | | | |" if "error" in r else
                     f"{r['top1_equal']} | {r['max_dlogprob']:.3f} | {r['min_greedy_prefix']} | {r['decode_max_dlogprob']:.3f} |"))
    (out / "sensitivity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any("error" in r for r in rows) else 0


def check(a) -> int:
    ref = json.loads(Path(a.check).read_text())
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)  # per-engine files: the box returns at most 8 files, the report holds all
    rep = dict(reference=a.check, model=a.model, weights_sha256=weights_hash(a.model), tol=a.tol, gpu=gpu_name(),
               runs={}, checks=[])
    if rep["weights_sha256"] != ref["weights_sha256"]:
        rep["error"] = "the model's dequantized weights differ from the reference's: not the same model"
    elif not a.artifact or file_hash(a.artifact) != ref.get("artifact_sha256"):
        rep["error"] = "--artifact is not the calibration the reference was made with (sha256 differs)"
    if "error" in rep:
        (out / "oracle_match.json").write_text(json.dumps(rep, indent=1))
        print(rep["error"])
        return 1
    (work / "ids.json").write_text(json.dumps(ref["prompt_ids"]))
    formats = [f for f in a.formats if f"{f}/default" in ref["runs"]]
    rep["formats"] = formats
    for fmt in formats:
        for path in a.paths or GPU_PATHS.get(fmt, ("default", "torch")):
            if fmt == "auto" and path != "default":
                continue
            print(f"GPU {fmt} {path} ...", flush=True)
            rep["runs"][f"{fmt}/{path}"] = launch(a.model, fmt, path, a.artifact, work / "ids.json",
                                                  work / f"{fmt}-{path}.json", True, a.timeout)
            (out / "oracle_match.json").write_text(json.dumps(rep, indent=1))  # what ran survives a timeout
    return report(rep, ref, out, a.tol, headline=False)


def gpu_name() -> str | None:
    try:  # nvidia-smi, not torch: this process only launches the engines (see launch)
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def rescore(a) -> int:
    """Reports the box returned (a run may be cut short by its time limit), scored again here: the committed
    results.  Several reports merge, a later one's runs replacing an earlier one's (device time is 15 minutes a
    session: the engines one session missed can run in the next; each session reruns auto, the platforms' control)."""
    from benchmarks.common import RESULTS, is_results

    reports = [json.loads(Path(f).read_text()) for f in a.rescore]
    rep = dict(reports[0], runs={}, sources=list(a.rescore))
    for r in reports:
        rep["runs"].update(r["runs"])
        rep["formats"] = list(dict.fromkeys((rep.get("formats") or []) + (r.get("formats") or [])))
    ref = json.loads(Path(a.check or rep["reference"]).read_text())
    if a.gpu_name:
        rep["gpu"] = a.gpu_name
    out = Path(a.out or RESULTS / "gpu-oracle")
    return report(rep, ref, out, a.tol, headline=is_results(out.parent) and not a.no_headline)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.oracle_match", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--reference", metavar="REF.json", help="here: run the CPU configurations, write the reference")
    g.add_argument("--check", metavar="REF.json", help="on a GPU: run the GPU configurations, compare")
    g.add_argument("--rescore", metavar="REPORT.json", nargs="+",
                   help="here: score a report the box returned again and write it (default benchmarks/results/"
                        "gpu-oracle; --check names the reference when the report's path is not valid here)")
    g.add_argument("--sensitivity", metavar="REL", nargs="+", type=float,
                   help="here: perturb the weights by these relative sizes and compare with --reference-json's runs "
                        "(sensitivity.json/.md in --out, default benchmarks/results/gpu-oracle)")
    g.add_argument("--one", metavar="FORMAT", help=argparse.SUPPRESS)  # one engine (a subprocess of the above)
    p.add_argument("--model", default=None, help="model folder (reference: an embedded name too; default smollm2)")
    p.add_argument("--artifact", default=None,
                   help="calibration (reference: default runs/oracle/calibration.safetensors, made if missing)")
    p.add_argument("--formats", nargs="+", default=FORMATS)
    p.add_argument("--out", default=None, help="results folder (reference: its work folder)")
    p.add_argument("--work", default="/tmp/oracle-work", help="per-engine files (check)")
    p.add_argument("--reference-json", dest="ref_json", help="--rescore: the reference (default: the report's)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="--sensitivity: perturbation seeds")
    p.add_argument("--paths", nargs="+", choices=sorted(PATHS), help="check: only these attention paths")
    p.add_argument("--gpu-name", help="--rescore: the card, when the report does not name it")
    p.add_argument("--no-headline", action="store_true", help="--rescore: do not merge into headline.json")
    p.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)  # --one: the engine runs on a GPU
    p.add_argument("--tol", type=float, default=0.1, help="largest first-token top-5 logprob difference, nats")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        rec = run_one(a.model, a.one, a.artifact, json.loads(Path(a.ids).read_text()), a.gpu)
        Path(a.json).write_text(json.dumps(rec))
        return 0
    stop_on_sigterm()  # the stage's `timeout` then stops a running engine too (run_logged's cleanup)
    if a.reference:
        return reference(a)
    if a.rescore:
        a.check = a.ref_json
        return rescore(a)
    if a.sensitivity:
        a.reference_for = a.ref_json or "benchmarks/gpu/smollm2-reference.json"
        a.work = a.work if a.work != "/tmp/oracle-work" else "/tmp/oracle-sensitivity"
        return sensitivity(a)
    if not a.model or not a.out:
        p.error("--check needs --model DIR and --out DIR")
    return check(a)


if __name__ == "__main__":
    sys.exit(main())
