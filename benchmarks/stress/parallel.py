"""vLLM's parallel engine (pipeline / tensor parallel ranks) against one process, in the stress benchmark."""

from __future__ import annotations

import os
import time

from vllm_temporalkv.harness.server import ServerFailed, VLLMServer

from ..common import error_line, model_dtype
from .client import MODEL, Req, compare, send

PARALLEL = {"pp2": ["--pipeline-parallel-size", "2"], "tp3": ["--tensor-parallel-size", "3"]}


def _bind(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for several ranks on a small machine: the CPUs dealt out round-robin."""
    cpus = sorted(os.sched_getaffinity(0))
    per = [[c for i, c in enumerate(cpus) if i % ranks == r] or [cpus[r % len(cpus)]] for r in range(ranks)]
    return "|".join(",".join(map(str, p)) for p in per)


async def parallel_check(args, fmt: str, configs: list[str], ids: list[int]) -> dict:
    """Greedy outputs of a few prompts on a single-process server and on each parallel configuration: each
    rank must use its own layers' (PP) and KV heads' (TP) codebooks.  A configuration vLLM cannot run is
    recorded with vLLM's own error."""
    import openai

    from vllm_temporalkv.models import resolve_model

    dtype = model_dtype(args.dtype)
    prompts = [Req(40_000 + i, "greedy", ids[5000 + 3000 * i: 5000 + 3000 * i + n], 24)
               for i, n in enumerate((300, 1100, 2100))]
    env = {"VLLM_TEMPORALKV_ARTIFACT": str(args.artifact)} if args.artifact else {}
    outs: dict[str, dict] = {}
    for name in ["single", *configs]:
        extra, e = [], dict(env)
        if name != "single":
            extra = PARALLEL[name] + ["--distributed-executor-backend", "mp"]
            e["VLLM_CPU_OMP_THREADS_BIND"] = _bind(int(PARALLEL[name][1]))
        server = VLLMServer(resolve_model(args.model), "--kv-cache-dtype", fmt, "--served-model-name", MODEL,
                            "--dtype", dtype, "--max-model-len", "4096", *(["--enforce-eager"] if args.enforce_eager else []),
                            *extra, env=e,
                            timeout=900, log_path=args.out / "stress-runs" / f"{fmt}-{name}.log")
        t0 = time.time()
        try:
            server.start()
        except ServerFailed as err:
            outs[name] = {"error": error_line(err.log, server.proc.returncode if server.proc else -1)}
            continue
        try:
            client = openai.AsyncOpenAI(base_url=server.url, api_key="none", timeout=900, max_retries=0)
            res = [await send(client, r, solo=True) for r in prompts]
        finally:
            server.stop()
        outs[name] = {"seconds": round(time.time() - t0, 1), "env": e.get("VLLM_CPU_OMP_THREADS_BIND"),
                      "errors": [r["error"] for r in res if r["error"]],
                      "choices": [r["choices"][0] if r["choices"] else None for r in res]}
    single = outs["single"]
    report = {}
    for name in configs:
        o = outs[name]
        if "error" in o or "error" in single:
            report[name] = {"ran": False, "error": o.get("error") or "single-process server: " + single["error"]}
            continue
        verdicts, detail = [], []
        for a, b in zip(single["choices"], o["choices"]):
            if not (a and b):
                verdicts.append("failed")
                continue
            v, d = compare(b, a)
            verdicts.append(v)
            same = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), min(len(a.tokens), len(b.tokens)))
            # the first token is the prompt's cache alone: a rank on the wrong codebooks moves it by nats
            detail.append({"first_token_dlogprob": abs(a.logprobs[0] - b.logprobs[0]) if same else None,
                           "max_abs_dlogprob_same_tokens": d, "same_tokens_until": same, "tokens": len(a.tokens)})
        report[name] = {"ran": True, "verdicts": verdicts, "detail": detail, "errors": o["errors"],
                        "seconds": o["seconds"], "bind": o["env"],
                        "matches_single": all(v in ("identical", "within_tolerance") for v in verdicts)}
    return report
