"""Scoring a server with the suite: greedy completions over the OpenAI API, records reused across runs, and a
server per --kv-cache-dtype started and stopped."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import re
import time
from pathlib import Path

from tqdm import tqdm

from .suite import Sample, record_key, score

CHECKPOINT_S = 30  # a long run writes what it scored this often (seconds), for --resume

def prompt_sha(prompt: str) -> str:
    """A short fingerprint of a prompt: a resumed run reuses a record only for the very prompt it answered."""
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]


def run_suite(url: str, model: str, samples: list[Sample], concurrency: int = 4, timeout: float = 3600,
              desc: str = "requests", on_record=None) -> list[dict]:
    """Greedy completions for every sample; returns one record per sample (output and score), in the order of
    ``samples``.  ``on_record(rec)`` is called as each one completes (a long run checkpoints with it)."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", timeout=timeout, max_retries=0)

    def one(s: Sample) -> dict:
        r = client.completions.create(model=model, prompt=s.prompt, max_tokens=s.max_tokens, temperature=0)
        text = r.choices[0].text
        return {"task": s.task, "length": s.length, "index": s.index, "answers": s.answers, "output": text,
                "score": score(text, s.answers), "prompt_tokens": r.usage.prompt_tokens,
                "completion_tokens": r.usage.completion_tokens, "prompt_sha": prompt_sha(s.prompt)}

    with cf.ThreadPoolExecutor(concurrency) as ex:
        futs = {ex.submit(one, s): i for i, s in enumerate(samples)}
        recs: list[dict | None] = [None] * len(samples)
        for f in tqdm(cf.as_completed(futs), total=len(futs), desc=desc, unit="req", leave=False):
            recs[futs[f]] = f.result()
            if on_record is not None:
                on_record(recs[futs[f]])
    return recs


def reusable(prev: list[dict], samples: list[Sample]) -> dict[tuple, dict]:
    """The earlier records that answered one of ``samples`` exactly: same task, length and index (the suite
    draws each sample from its own seed, so a 10-sample suite begins with the 1-sample one), the same
    reference answers and, where recorded, the same prompt."""
    want = {(s.task, s.length, s.index): s for s in samples}
    out = {}
    for r in prev:
        s = want.get(record_key(r))
        if s is not None and r.get("answers") == s.answers and r.get("prompt_sha", prompt_sha(s.prompt)) == prompt_sha(s.prompt):
            out[record_key(r)] = r
    return out


def serve_and_score(model: str, fmt: str, samples: list[Sample], args, on_record=None) -> dict:
    from vllm_temporalkv.formats import FORMATS
    from vllm_temporalkv.harness.server import VLLMServer
    from vllm_temporalkv.harness.simulate import OUTLIER_SUFFIX

    # "<format>-o1": the plugin's format with 1% exact outliers (the artifact holds the thresholds), "-o0.5" with
    # 0.5% (temporalkv_outliers takes a percentage up to 1); "<format>@windowN": with a recent window of N
    # half-precision tokens (temporalkv_recent_window)
    base, _, variant = fmt.partition("@")
    m = OUTLIER_SUFFIX.search(base)
    dtype, outliers = (base[: m.start()], float(m.group(1))) if m and base[: m.start()] in FORMATS else (base, None)
    options = {}
    if args.artifact and dtype in FORMATS:
        options["temporalkv_artifact"] = str(args.artifact)
    if outliers is not None:
        options["temporalkv_outliers"] = True if outliers == 1 else outliers
    if re.fullmatch(r"window\d+", variant) and dtype in FORMATS:
        options["temporalkv_recent_window"] = int(variant.removeprefix("window"))
    elif variant:
        raise SystemExit(f"{fmt}: unknown variant @{variant} (known: @windowN for the plugin's formats)")
    extra = ["--additional-config", json.dumps(options)] if options else []
    max_len = max(s.length for s in samples)
    s = VLLMServer(model, "--kv-cache-dtype", dtype, "--served-model-name", "model", "--dtype", args.dtype,
                   "--max-model-len", str(max_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--max-num-seqs", str(args.concurrency), *(["--enforce-eager"] if args.enforce_eager else []),
                   *extra, *args.server_args, kv_space_gib=args.kv_space_gib, timeout=args.server_timeout)
    t0 = time.time()
    s.start()
    try:
        t1 = time.time()
        recs = run_suite(s.url, "model", samples, args.concurrency, desc=fmt, on_record=on_record)
        t2 = time.time()
    finally:
        s.stop()
    return {"records": recs, "kv_tokens": s.kv_capacity_tokens(), "startup_s": round(t1 - t0, 1),
            "suite_s": round(t2 - t1, 1), "suite_prompts": len(recs)}


def artifact_digest(model: str, fmt: str, artifact: str | None) -> str | None:
    """The content digest of the artifact a plugin format is served from (None for formats that read none):
    records are reused across runs only from the same calibration."""
    from safetensors import safe_open

    from vllm_temporalkv.artifact import default_artifact_path
    from vllm_temporalkv.formats import FORMATS, get_format

    base = fmt.partition("@")[0]
    base = base[:-3] if base.endswith("-o1") and base[:-3] in FORMATS else base
    if base not in FORMATS or not get_format(base).needs_calibration:
        return None
    path = Path(artifact) if artifact else default_artifact_path(model)
    if not path.is_file():
        return "missing"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    return meta.get("content_sha256") or hashlib.sha256(path.read_bytes()).hexdigest()
