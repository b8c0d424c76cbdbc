"""The stress benchmark's requests: the mix, one request over the OpenAI API, and how a loaded output is judged
against the same request served alone."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

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
