"""SmolLM2's real weights served by vLLM on a GPU against the oracle (issue 31): greedy tokens and first-token top-5
logprobs of the same prompts, per format and per attention path.

    python -m benchmarks.gpu.oracle_match --reference benchmarks/gpu/smollm2-reference.json   # here: vLLM on the CPU
    python -m benchmarks.gpu.oracle_match --check REF.json --model DIR --artifact A --out $OUT  # the box: vLLM 0.26

Each configuration is one offline vLLM engine (``LLM``) in its own process: bf16, enforce_eager, no prefix cache,
4 prompts of 1,000 Austen tokens (their token ids travel in the reference, so the box needs no corpus), 32 greedy
tokens each with the top-5 logprobs of every step.  Paths: ``default`` (what serves: C++ on the CPU, the CUDA decode
on a GPU), ``triton`` (VLLM_TEMPORALKV_CUDA_DECODE=0) and ``torch`` (VLLM_TEMPORALKV_OPS=torch: the oracle codec).

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
import subprocess
import sys
import time
from pathlib import Path

FORMATS = ["auto", "temporalkv-2bit", "selective-int4"]
PATHS = {"default": {}, "triton": {"VLLM_TEMPORALKV_CUDA_DECODE": "0"}, "torch": {"VLLM_TEMPORALKV_OPS": "torch"}}
# on a GPU: the codebook formats have a CUDA (default) and a Triton decode; the others one fast path
GPU_PATHS = {"auto": ("default",), "temporalkv-2bit": ("default", "triton", "torch")}
PROMPT_TOKENS, N_PROMPTS, MAX_TOKENS, TOP = 1000, 4, 32, 5


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
    llm = LLM(model=model_dir, kv_cache_dtype=fmt, dtype="bfloat16", max_model_len=2048, enforce_eager=True,
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
    cmd = [sys.executable, "-m", "benchmarks.gpu.oracle_match", "--one", fmt, "--model", model_dir,
           "--ids", str(ids_file), "--json", str(out)] + (["--artifact", artifact] if artifact else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode or not out.is_file():
        return dict(format=fmt, path=path, error=(r.stderr or r.stdout)[-3000:])
    rec = json.loads(out.read_text())
    rec["path"] = path
    return rec


def compare(a: dict, b: dict) -> dict:
    """First-token top-1 agreement, the largest top-5 logprob difference (tokens in both top-5s) and the greedy
    prefix both share, per prompt."""
    rows = []
    for pa, pb in zip(a["prompts"], b["prompts"]):
        la, lb = pa["logprobs"][0], pb["logprobs"][0]
        common = set(la) & set(lb)
        prefix = next((i for i, (x, y) in enumerate(zip(pa["tokens"], pb["tokens"])) if x != y), len(pa["tokens"]))
        rows.append(dict(top1_equal=max(la, key=la.get) == max(lb, key=lb.get),
                         max_dlogprob=max((abs(la[t] - lb[t]) for t in common), default=float("inf")),
                         common_top5=len(common), greedy_prefix=prefix))
    return dict(top1_equal=all(r["top1_equal"] for r in rows), max_dlogprob=max(r["max_dlogprob"] for r in rows),
                min_greedy_prefix=min(r["greedy_prefix"] for r in rows), prompts=rows)


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


def check(a) -> int:
    ref = json.loads(Path(a.check).read_text())
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)  # per-engine files: the box returns at most 8 files, the report holds all
    rep = dict(reference=a.check, model=a.model, weights_sha256=weights_hash(a.model), tol=a.tol, runs={}, checks=[])
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
    for fmt in formats:
        for path in GPU_PATHS.get(fmt, ("default", "torch")):
            print(f"GPU {fmt} {path} ...", flush=True)
            rep["runs"][f"{fmt}/{path}"] = launch(a.model, fmt, path, a.artifact, work / "ids.json",
                                                  work / f"{fmt}-{path}.json", True, a.timeout)
            (out / "oracle_match.json").write_text(json.dumps(rep, indent=1))
    ok = True
    control = None
    if "error" not in rep["runs"].get("auto/default", {"error": 1}):
        control = compare(rep["runs"]["auto/default"], ref["runs"]["auto/default"])
        rep["checks"].append(dict(what="auto: GPU vs CPU (the platforms' control)", **control))
    for fmt in formats:
        if fmt == "auto":
            continue
        paths = GPU_PATHS.get(fmt, ("default", "torch"))
        runs = {p: rep["runs"].get(f"{fmt}/{p}", {"error": "not run"}) for p in paths}
        for p in [p for p in paths if p != "torch"]:
            if "error" in runs[p] or "error" in runs["torch"]:
                rep["checks"].append(dict(what=f"{fmt}: GPU {p} vs GPU torch", ok=False, error="a run failed"))
                ok = False
                continue
            c = compare(runs[p], runs["torch"])
            c["ok"] = c["top1_equal"] and c["max_dlogprob"] <= a.tol
            rep["checks"].append(dict(what=f"{fmt}: GPU {p} vs GPU torch", **c))
            ok &= c["ok"]
        if "error" in runs["default"]:
            rep["checks"].append(dict(what=f"{fmt}: GPU default", ok=False, error=runs["default"]["error"][-500:]))
            ok = False
        elif control is not None and "error" not in ref["runs"][f"{fmt}/default"]:
            c = compare(runs["default"], ref["runs"][f"{fmt}/default"])
            bound = max(a.tol, 2 * control["max_dlogprob"])
            c["ok"] = c["max_dlogprob"] <= bound and (c["top1_equal"] or not control["top1_equal"])
            rep["checks"].append(dict(what=f"{fmt}: GPU default vs CPU reference (bound {bound:.3f})", **c))
            ok &= c["ok"]
    rep["ok"] = bool(ok)
    (out / "oracle_match.json").write_text(json.dumps(rep, indent=1))
    for c in rep["checks"]:
        print(f"{c['what']}: top1 {c.get('top1_equal')}, max |dlogprob| {c.get('max_dlogprob', float('nan')):.4f}, "
              f"greedy prefix >= {c.get('min_greedy_prefix')} of {MAX_TOKENS}{'' if c.get('ok', True) else '  FAIL'}")
    print("OK" if ok else "CHECK FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.oracle_match", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--reference", metavar="REF.json", help="here: run the CPU configurations, write the reference")
    g.add_argument("--check", metavar="REF.json", help="on a GPU: run the GPU configurations, compare")
    g.add_argument("--one", metavar="FORMAT", help=argparse.SUPPRESS)  # one engine (a subprocess of the above)
    p.add_argument("--model", default=None, help="model folder (reference: an embedded name too; default smollm2)")
    p.add_argument("--artifact", default=None,
                   help="calibration (reference: default runs/oracle/calibration.safetensors, made if missing)")
    p.add_argument("--formats", nargs="+", default=FORMATS)
    p.add_argument("--out", default=None, help="results folder (reference: its work folder)")
    p.add_argument("--work", default="/tmp/oracle-work", help="per-engine files (check)")
    p.add_argument("--tol", type=float, default=0.1, help="largest first-token top-5 logprob difference, nats")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        import torch

        rec = run_one(a.model, a.one, a.artifact, json.loads(Path(a.ids).read_text()), torch.cuda.is_available())
        Path(a.json).write_text(json.dumps(rec))
        return 0
    if a.reference:
        return reference(a)
    if not a.model or not a.out:
        p.error("--check needs --model DIR and --out DIR")
    return check(a)


if __name__ == "__main__":
    sys.exit(main())
