"""The stress benchmark's servers: how they are started, the gauges they export, their processes, the text."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from vllm_temporalkv.formats import FORMATS
from vllm_temporalkv.harness.server import VLLMServer, scrape_metrics

from .. import common
from .client import MODEL, PAGE

def metrics(port: int) -> dict[str, float]:
    """vLLM's Prometheus gauges and counters, summed over label sets (harness.server.scrape_metrics)."""
    return scrape_metrics(port)[0]


def rss_mib(pid: int) -> float:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


async def wait_idle(port: int, timeout: float = 300) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = metrics(port)
        if (m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0) \
                or time.time() > deadline:
            return m
        await asyncio.sleep(0.5)


def _alive(pids: list[int]) -> dict[int, str]:
    """The processes among pids still running (not exited, not zombies): pid -> name."""
    import psutil

    alive = {}
    for p in pids:
        try:
            q = psutil.Process(p)
            if q.status() != psutil.STATUS_ZOMBIE:
                alive[p] = q.name()
        except psutil.NoSuchProcess:
            pass
    return alive


def server_factory(args, dtype: str, fmt: str):
    from vllm_temporalkv.models import resolve_model

    model = resolve_model(args.model)
    extra = ["--enforce-eager"] if args.enforce_eager else []
    if args.shutdown_timeout:  # vLLM's drain mode: SIGTERM lets in-flight requests finish first
        extra += ["--shutdown-timeout", str(args.shutdown_timeout)]
    env = {"VLLM_TEMPORALKV_ARTIFACT": str(args.artifact)} if args.artifact else {}
    n = [0]

    def make():
        n[0] += 1
        return VLLMServer(model, "--kv-cache-dtype", fmt, "--served-model-name", MODEL, "--dtype", dtype,
                          "--max-model-len", str(args.max_model_len), "--enable-prefix-caching",
                          "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                          "--max-num-seqs", str(args.concurrency),
                          # every format on the plugin's 1024-token pages: the same KV space and paging for the control
                          "--block-size", str(PAGE), "--num-gpu-blocks-override", str(args.kv_pages), *extra, env=env,
                          log_path=args.out / "stress-runs" / f"{fmt}-server-{n[0]}.log")
    return make


def ensure_calibrated(args, fmt: str) -> None:
    """The default artifact covers the format: what `vllm-temporalkv serve` does on first use."""
    if args.artifact or fmt not in FORMATS:
        return
    common.ensure_calibrated(args.model, fmt)


def vocab_size(model) -> int:
    from vllm_temporalkv.models import resolve_model

    return int(json.loads((Path(resolve_model(model)) / "config.json").read_text())["vocab_size"])


def token_ids(model) -> list[int]:
    from vllm_temporalkv.corpora import load_austen
    from vllm_temporalkv.models import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    novels = load_austen()
    return tok.encode(novels["Emma"] + "\n\n" + novels["Persuasion"])
