"""The stress benchmark's phases on one server: the load, the same requests alone, disconnects, hostile prompts, then
SIGTERM and a restart (shutdown.py)."""

from __future__ import annotations

import asyncio
import math
import time

from ..common import model_dtype
from .client import GREEDY_KINDS, KINDS, MODEL, Req, _params, compare, finite, send
from .serving import ensure_calibrated, metrics, rss_mib, server_factory, vocab_size, wait_idle
from .shutdown import sigterm_and_restart

async def run_load(client, port: int, reqs: list[Req], concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    peak = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    done = asyncio.Event()

    async def poll():
        while not done.is_set():
            try:
                m = await asyncio.to_thread(metrics, port)
                peak["running"] = max(peak["running"], m.get("vllm:num_requests_running", 0))
                peak["waiting"] = max(peak["waiting"], m.get("vllm:num_requests_waiting", 0))
                peak["kv_usage"] = max(peak["kv_usage"], m.get("vllm:kv_cache_usage_perc", 0))
            except OSError:
                pass
            await asyncio.sleep(0.5)

    async def one(r):
        async with sem:
            return await send(client, r)

    poller = asyncio.create_task(poll())
    t0 = time.time()
    results = await asyncio.gather(*(one(r) for r in reqs))
    wall = time.time() - t0
    done.set()
    await poller
    return {"results": results, "wall_s": wall, "peak": peak}


async def run_solo(client, reqs: list[Req]) -> dict[int, dict]:
    return {r.idx: await send(client, r, solo=True) for r in reqs if r.kind in GREEDY_KINDS}


def judge(reqs: list[Req], load: list[dict], solo: dict[int, dict]) -> dict:
    counts = {"identical": 0, "within_tolerance": 0, "different": 0}
    failed, nonfinite, max_diff, first_diff, details, same_tokens = [], 0, 0.0, 0.0, [], 0
    for r, res in zip(reqs, load):
        if res["error"]:
            failed.append({"idx": r.idx, "kind": r.kind, "error": res["error"]})
            continue
        if res["disconnected"]:
            continue
        want = 2 if r.kind in ("n2", "sampled") else 1
        if len(res["choices"]) != want or any(not c.tokens for c in res["choices"]):
            failed.append({"idx": r.idx, "kind": r.kind, "error": f"{len(res['choices'])} choices, want {want}"})
            continue
        nonfinite += sum(not finite(c) for c in res["choices"])
        if r.kind not in GREEDY_KINDS:
            continue
        s = solo[r.idx]
        if s["error"] or not s["choices"]:
            failed.append({"idx": r.idx, "kind": r.kind, "error": "solo: " + (s["error"] or "no output")})
            continue
        for c in res["choices"]:
            verdict, d = compare(c, s["choices"][0])
            counts[verdict] += 1
            same_tokens += c.tokens == s["choices"][0].tokens
            max_diff = max(max_diff, d)
            if c.tokens[0] == s["choices"][0].tokens[0]:  # the prompt's cache alone decides the first token
                first_diff = max(first_diff, abs(c.logprobs[0] - s["choices"][0].logprobs[0]))
            else:
                first_diff = math.inf
            if verdict != "identical":
                details.append({"idx": r.idx, "kind": r.kind, "prompt_tokens": len(r.prompt), "verdict": verdict,
                                "max_abs_dlogprob": d, "load": c.tokens, "solo": s["choices"][0].tokens})
    return {"outputs": counts, "same_tokens": same_tokens, "failed": failed, "nonfinite_choices": nonfinite,
            "max_abs_dlogprob_same_tokens": max_diff, "max_abs_dlogprob_first_token": first_diff,
            "not_identical": details}


async def disconnect_probes(client, port: int, ids: list[int], n: int, max_len: int) -> list[dict]:
    """One long stream at a time on the idle server, dropped once the server holds pages for it."""
    plen = min(2500, max_len // 2)
    out = []
    idle = (await wait_idle(port)).get("vllm:kv_cache_usage_perc", 0.0)
    for i in range(n):
        r = Req(10_000 + i, "stream", ids[80_000 + 3000 * i : 80_000 + 3000 * i + plen], max_len - plen - 1)
        stream = await client.completions.create(stream=True, **_params(r))
        held = 0.0
        async for _ in stream:
            held = max(held, metrics(port).get("vllm:kv_cache_usage_perc", 0.0))
            if held > idle:
                break
        await stream.close()
        t0 = time.time()
        m = await wait_idle(port, timeout=60)
        while m.get("vllm:kv_cache_usage_perc", 0.0) > idle and time.time() - t0 < 60:
            await asyncio.sleep(0.2)
            m = metrics(port)
        out.append({"kv_usage_held": held, "kv_usage_after": m.get("vllm:kv_cache_usage_perc", 0.0),
                    "idle_kv_usage": idle, "freed": m.get("vllm:kv_cache_usage_perc", 0.0) <= idle and held > idle,
                    "running_after": m.get("vllm:num_requests_running", 0), "seconds_to_free": round(time.time() - t0, 2)})
    return out


async def hostile_prompts(client, max_len: int, vocab: int) -> dict[str, str]:
    """Prompts a client may send by mistake or malice: each must be refused (HTTP 400) while the server goes on."""
    cases = {"over max-model-len": list(range(100, 100 + max_len + 8)), "token id = vocab size": [1, 2, vocab],
             "negative token id": [1, -3, 2], "empty prompt": []}
    out = {}
    for name, prompt in cases.items():
        try:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
            out[name] = "served"
        except Exception as e:  # noqa: BLE001 - recorded
            out[name] = f"{type(e).__name__} {getattr(e, 'status_code', '')}".strip()
    ok = await send(client, Req(30_000, "greedy", list(range(200, 260)), 4), solo=True)
    out["served after them"] = "yes" if ok["choices"] and not ok["error"] else f"no: {ok['error']}"
    return out


async def run_format(args, fmt: str, ids: list[int], reqs: list[Req], save=lambda out: None) -> dict:
    import openai
    from vllm_temporalkv.formats import FORMATS

    dtype = model_dtype(args.dtype)
    ensure_calibrated(args, fmt)
    make = server_factory(args, dtype, fmt)
    server = make()
    t_start = time.time()
    server.start()
    out: dict = {"format": fmt, "dtype": dtype, "kv_pages": args.kv_pages,
                 "kv_tokens": server.kv_capacity_tokens(), "requests": len(reqs), "concurrency": args.concurrency,
                 "kinds": {k: sum(r.kind == k for r in reqs) for k in KINDS},
                 "prompt_tokens": {"min": min(len(r.prompt) for r in reqs), "max": max(len(r.prompt) for r in reqs),
                                   "total": sum(len(r.prompt) for r in reqs)},
                 "server_start_s": round(time.time() - t_start, 1)}
    try:
        client = openai.AsyncOpenAI(base_url=server.url, api_key="none", timeout=1800, max_retries=0)
        m0 = metrics(server.port)
        out["rss_mib_before"] = round(rss_mib(server.proc.pid), 1)
        load = await run_load(client, server.port, reqs, args.concurrency)
        m1 = await wait_idle(server.port)
        out["rss_mib_after_load"] = round(rss_mib(server.proc.pid), 1)
        out["load_wall_s"] = round(load["wall_s"], 1)
        out["peak"] = load["peak"]
        out["preemptions"] = m1.get("vllm:num_preemptions_total", 0) - m0.get("vllm:num_preemptions_total", 0)
        out["prefix_cache_hit_rate"] = round(
            (m1.get("vllm:prefix_cache_hits_total", 0) - m0.get("vllm:prefix_cache_hits_total", 0))
            / max(1.0, m1.get("vllm:prefix_cache_queries_total", 0) - m0.get("vllm:prefix_cache_queries_total", 0)), 3)
        out["disconnects"] = sum(r["disconnected"] for r in load["results"])
        out["kv_usage_after_load"] = m1.get("vllm:kv_cache_usage_perc", 0.0)
        t0 = time.time()
        solo = await run_solo(client, reqs)
        out["solo_wall_s"] = round(time.time() - t0, 1)
        out.update(judge(reqs, load["results"], solo))
        save(out)
        out["disconnect_probes"] = await disconnect_probes(client, server.port, ids, args.disconnect_probes,
                                                       args.max_model_len)
        out["hostile_prompts"] = await hostile_prompts(client, args.max_model_len, vocab_size(args.model))
        out["rss_mib_after"] = round(rss_mib(server.proc.pid), 1)
        save(out)
        if not args.no_sigterm and fmt in FORMATS:  # the plugin's formats
            probe = next(r for r in reqs if r.kind == "greedy")
            out["sigterm"] = await sigterm_and_restart(args, server, make, ids, probe)
    finally:
        server.stop()
    out["wall_s"] = round(time.time() - t_start, 1)
    return out
