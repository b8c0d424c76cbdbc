"""SIGTERM to a stress server with requests in flight: exit, processes left behind, a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

from vllm_temporalkv.harness.server import VLLMServer

from ..common import model_dtype
from .client import SIGTERM_GRACE, Req, compare, send
from .serving import _alive, server_factory

async def sigterm_inflight(args, server: VLLMServer, ids: list[int]) -> dict:
    """SIGTERM to the server's main process with 8 requests in flight: exit code and seconds, whether it hung
    (then SIGKILLed), processes left behind, in-flight requests finished."""
    import openai
    import psutil

    client = openai.AsyncOpenAI(base_url=server.url, api_key="none", timeout=600, max_retries=0)
    inflight = [asyncio.create_task(send(client, Req(20_000 + i, "greedy", ids[90_000 + 800 * i: 90_000 + 800 * i + 700],
                                                     args.sigterm_tokens))) for i in range(8)]
    await asyncio.sleep(3)
    group = [server.proc.pid, *(c.pid for c in psutil.Process(server.proc.pid).children(recursive=True))]
    t0 = time.time()
    os.kill(server.proc.pid, signal.SIGTERM)
    limit = args.shutdown_timeout + SIGTERM_GRACE
    try:
        rc = await asyncio.to_thread(server.proc.wait, limit)
    except subprocess.TimeoutExpired:  # hung: record who is still there, then make sure it ends
        rc = None
    exit_s = time.time() - t0
    hung = {"alive": sorted(_alive(group).values())} if rc is None else None
    if rc is None:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
    res = await asyncio.gather(*inflight)
    await asyncio.sleep(2)
    left = _alive(group)
    for p in left:  # do not leak what the server left behind
        os.kill(p, signal.SIGKILL)
    server.stop()
    return {"shutdown_timeout": args.shutdown_timeout, "exit_code": rc, "exit_s": round(exit_s, 2),
            "hung_after_s": limit if hung else None, "hung": hung, "processes": len(group), "left_behind": len(left),
            "inflight": len(inflight), "inflight_max_tokens": args.sigterm_tokens,
            "inflight_completed": sum(not r["error"] for r in res),
            "inflight_errors": sorted({r["error"].split(":")[0] for r in res if r["error"]})}


async def sigterm_and_restart(args, server: VLLMServer, make_server, ids: list[int], probe: Req) -> dict:
    """SIGTERM with requests in flight (``sigterm_inflight``); then a restart answers the probe as before."""
    import openai

    client = openai.AsyncOpenAI(base_url=server.url, api_key="none", timeout=600, max_retries=0)
    before = (await send(client, probe, solo=True))["choices"]
    out = await sigterm_inflight(args, server, ids)
    t1 = time.time()
    restarted = make_server()
    restarted.start()
    try:
        client2 = openai.AsyncOpenAI(base_url=restarted.url, api_key="none", timeout=600, max_retries=0)
        after = (await send(client2, probe, solo=True))["choices"]
    finally:
        restarted.stop()
    out["restart_s"] = round(time.time() - t1, 1)
    out["probe_after_restart"] = compare(after[0], before[0])[0] if before and after else "failed"
    return out


async def sigterm_trials(args, fmt: str, ids: list[int], n: int) -> list[dict]:
    """n fresh servers of fmt, each sent SIGTERM with requests in flight: how often a shutdown hangs, per
    format (``auto`` the control: a hang there is vLLM's own)."""
    make = server_factory(args, model_dtype(args.dtype), fmt)
    trials = []
    for _ in range(n):
        server = make()
        server.start()
        try:
            trials.append(await sigterm_inflight(args, server, ids))
        finally:
            server.stop()
    return trials
