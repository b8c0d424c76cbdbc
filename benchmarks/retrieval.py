"""Long-context retrieval through a real server: a RULER-style suite scored over OpenAI requests.

    python -m benchmarks.retrieval                                   # every format, one server each
    python -m benchmarks.retrieval --formats auto temporalkv-2bit --lengths 4096 --samples 4
    python -m benchmarks.retrieval --url http://host:8000/v1 --served-model-name m --tokenizer MODEL_DIR

Tasks (after RULER, Hsieh et al. 2024; built here, deterministic for a --seed):
    niah_single      one "special magic number" needle in a haystack of Austen's prose
    niah_multikey    the same with 3 distractor needles under other keys
    niah_multivalue  4 numbers under one key: all must be found
    niah_multiquery  4 keys asked at once
    vt               variable tracking: a chain of 5 assignments "VAR A = 12345", "VAR B = VAR A", ...
    cwe              common-word extraction from a numbered word list (10 words x 30, the rest x 3)
at every --lengths (prompt + answer tokens; default 2k / 4k / 8k, SmolLM2's limit). A sample scores the
share of its reference strings found in the greedy answer (RULER's string match).

The suite only talks to an OpenAI-compatible /v1/completions endpoint, so it scores any server (--url).
The runner starts `vllm serve` (python -m vllm.entrypoints.openai.api_server) once per --kv-cache-dtype
in turn (``<format>-o1``: with 1% outliers; ``<format>@windowN``: with a recent window of N half-precision tokens). Results: retrieval.json / .md / .png in --out; with the default --out the headline figures
``retrieval.<name>.<format>.avg_accuracy`` (mean over tasks and lengths, 0-1) are merged into
benchmarks/results/headline.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from .common import DTYPE_HELP, HEADLINE, RESULTS, merge_headline, model_dtype, run_record, write_json

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")
LENGTHS = (2048, 4096, 8192)
MAX_TOKENS = {"niah_single": 32, "niah_multikey": 32, "niah_multivalue": 64, "niah_multiquery": 64, "vt": 40,
              "cwe": 120}

_NIAH = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
         "I will quiz you about the numbers afterwards.\n{context}\n{question}")
_NEEDLE = "One of the special magic numbers for {key} is: {value}."


@dataclass
class Sample:
    task: str
    length: int  # token budget: prompt + max_tokens <= length
    index: int
    prompt: str
    answers: list[str]
    max_tokens: int
    prompt_tokens: int = 0
    meta: dict = field(default_factory=dict)


def score(output: str, answers: list[str]) -> float:
    """RULER's string match: the share of reference strings that occur in the output (case-insensitive)."""
    low = output.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


# ---------------------------------------------------------------- text sources
def _austen_sentences() -> dict[str, list[str]]:
    """Each novel as a list of sentences (line breaks inside paragraphs reflowed)."""
    from vllm_temporalkv.corpora import load_austen

    out = {}
    for title, text in load_austen().items():
        paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
        sents = [s for p in paras if p for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", p) if s]
        out[title] = sents
    return out


def _vocabulary(books: dict[str, list[str]]) -> list[str]:
    """Lower-case words of 4-10 letters from the novels, in first-seen order (deterministic)."""
    seen = dict.fromkeys(w for s in books["Emma"] for w in re.findall(r"\b[a-z]{4,10}\b", s))
    return list(seen)


class SuiteBuilder:
    """Builds the samples of one suite; prompts go through the model's chat template, followed by the
    task's answer prefix (as RULER does for chat models), and are sent as plain completions."""

    def __init__(self, tokenizer, seed: int = 0, chat_template: bool = True):
        self.tok = tokenizer
        self.seed = seed
        self.chat = chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.books = _austen_sentences()
        self.titles = sorted(self.books)
        self.vocab = _vocabulary(self.books)
        self._ntok_cache: dict[str, int] = {}

    def ntok(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def render(self, body: str, prefix: str) -> str:
        if not self.chat:
            return f"{body}\n{prefix}"
        head = self.tok.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                            add_generation_prompt=True)
        return head + prefix

    def prompt_tokens(self, prompt: str) -> int:
        # what the server counts: the tokenizer's own special tokens (BOS) included
        return len(self.tok.encode(prompt))

    # ---- haystack: consecutive sentences of one novel with needles at chosen sentence boundaries
    def _haystack(self, rng: random.Random, budget: int, needles: list[str], depths: list[float]) -> str:
        sents = self.books[rng.choice(self.titles)]
        start = rng.randrange(0, len(sents) // 2)
        picked, used = [], 0
        for s in sents[start:]:
            n = self._ntok_cache.get(s)
            if n is None:
                n = self._ntok_cache[s] = self.ntok(s) + 1
            if used + n > budget:
                break
            picked.append(s)
            used += n
        out = list(picked)
        # insert deepest first so that earlier indices stay valid
        for needle, d in sorted(zip(needles, depths), key=lambda x: -x[1]):
            out.insert(round(d * len(picked)), needle)
        return " ".join(out)

    def _fit(self, length: int, max_tokens: int, make, overhead: int | None = None, floor: int = 64) -> tuple[str, int]:
        """make(budget) -> prompt; shrink the haystack budget until prompt + answer fit in length."""
        overhead = self.prompt_tokens(make(0)) if overhead is None else overhead
        budget = length - max_tokens - overhead
        while True:
            if budget < floor:
                raise ValueError(f"length {length} is too short for the task (fixed part {overhead} tokens)")
            prompt = make(budget)
            n = self.prompt_tokens(prompt)
            if n + max_tokens <= length:
                return prompt, n
            budget -= n + max_tokens - length + 8

    def _key(self, rng: random.Random) -> str:
        return f"{rng.choice(self.vocab)}-{rng.choice(self.vocab)}"

    @staticmethod
    def _number(rng: random.Random, digits: int = 7) -> str:
        return str(rng.randrange(10 ** (digits - 1), 10**digits))

    # ---- tasks
    def niah(self, rng, length, task):
        n_keys = {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 1, "niah_multiquery": 4}[task]
        n_vals = 4 if task == "niah_multivalue" else 1
        keys = []
        while len(keys) < n_keys:
            k = self._key(rng)
            if k not in keys:
                keys.append(k)
        values = {k: [self._number(rng) for _ in range(n_vals)] for k in keys}
        needles = [_NEEDLE.format(key=k, value=v) for k in keys for v in values[k]]
        rng.shuffle(needles)
        depths = [rng.random() for _ in needles]
        if task == "niah_multiquery":
            asked = keys
            q = ", ".join(keys[:-1]) + f", and {keys[-1]}"
            question = f"What are all the special magic numbers for {q} mentioned in the provided text?"
            prefix = f" The special magic numbers for {q} mentioned in the provided text are"
        elif task == "niah_multivalue":
            asked = keys
            question = f"What are all the special magic numbers for {keys[0]} mentioned in the provided text?"
            prefix = f" The special magic numbers for {keys[0]} mentioned in the provided text are"
        else:
            asked = keys[:1]
            question = f"What is the special magic number for {keys[0]} mentioned in the provided text?"
            prefix = f" The special magic number for {keys[0]} mentioned in the provided text is"
        answers = [v for k in asked for v in values[k]]
        sub_seed = rng.random()  # the haystack draw repeats identically while the budget is fitted

        def make(budget):
            hay = self._haystack(random.Random(hash_seed(sub_seed)), budget, needles, depths)
            return self.render(_NIAH.format(context=hay, question=question), prefix)

        prompt, n = self._fit(length, MAX_TOKENS[task], make)
        return prompt, answers, n, {"keys": keys, "depths": depths}

    def vt(self, rng, length):
        names = []
        while len(names) < 5:
            nm = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if nm not in names:
                names.append(nm)
        value = str(rng.randrange(10000, 100000))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        depths = sorted(rng.random() for _ in chain)
        body_q = f"Question: Find all variables that are assigned the value {value} in the text above."
        prefix = (f" Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
                  f"assigned the value {value}, they are: ")
        sub_seed = rng.random()

        def make(budget):
            hay = self._haystack(random.Random(hash_seed(sub_seed)), budget, chain, depths)
            return self.render("Memorize and track the chain(s) of variable assignment hidden in the following "
                               f"text.\n\n{hay}\n{body_q}", prefix)

        prompt, n = self._fit(length, MAX_TOKENS["vt"], make)
        return prompt, names, n, {"value": value}

    def cwe(self, rng, length):
        words = rng.sample(self.vocab, 1200)
        common, rare = words[:10], words[10:]
        # RULER: 10 words x 30 among words x 3; scaled down below 8k so the common ones leave room
        f_common = max(8, min(30, length // 256))
        question = "Question: What are the 10 most common words in the above list?"
        prefix = " Answer: The top 10 words that appear most often in the list are:"
        order_seed = rng.random()

        def listing(n_rare):
            lst = common * f_common + rare[:n_rare] * 3
            random.Random(hash_seed(order_seed)).shuffle(lst)
            return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))

        def render(ctx):
            return self.render("Below is a numbered list of words. In these words, some appear more often than "
                               f"others. Memorize the ones that appear most often.\n{ctx}\n{question}", prefix)

        def make(budget):  # budget: tokens for the list
            lo, hi = 0, len(rare)  # the most rare words whose list fits (bisection)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.ntok(listing(mid)) <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            return render(listing(lo))

        prompt, n = self._fit(length, MAX_TOKENS["cwe"], make, overhead=self.prompt_tokens(render("")),
                              floor=self.ntok(listing(0)))
        return prompt, common, n, {"freq_common": f_common}

    def build(self, tasks=TASKS, lengths=LENGTHS, samples: int = 10) -> list[Sample]:
        out = []
        for task in tasks:
            if task not in TASKS:
                raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
            for length in lengths:
                for i in range(samples):
                    rng = random.Random(f"{self.seed}/{task}/{length}/{i}")
                    if task.startswith("niah"):
                        prompt, answers, n, meta = self.niah(rng, length, task)
                    elif task == "vt":
                        prompt, answers, n, meta = self.vt(rng, length)
                    else:
                        prompt, answers, n, meta = self.cwe(rng, length)
                    out.append(Sample(task, length, i, prompt, answers, MAX_TOKENS[task], n, meta))
        return out


def hash_seed(x: float) -> int:
    return int(x * 2**52)


# ---------------------------------------------------------------- scoring a server
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
                "prompt_sha": prompt_sha(s.prompt)}

    with cf.ThreadPoolExecutor(concurrency) as ex:
        futs = {ex.submit(one, s): i for i, s in enumerate(samples)}
        recs: list[dict | None] = [None] * len(samples)
        for f in tqdm(cf.as_completed(futs), total=len(futs), desc=desc, unit="req", leave=False):
            recs[futs[f]] = f.result()
            if on_record is not None:
                on_record(recs[futs[f]])
    return recs


def record_key(r) -> tuple[str, int, int]:
    return (r["task"], r["length"], r["index"])


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


def samples_per_cell(recs: list[dict]) -> int:
    """Prompts per task and length (the fewest any cell has)."""
    by: dict[tuple[str, int], int] = {}
    for r in recs:
        by[(r["task"], r["length"])] = by.get((r["task"], r["length"]), 0) + 1
    return min(by.values()) if by else 0


def summarize(recs: list[dict]) -> dict:
    """Accuracy per task and length, per length, and the averages (over tasks, then lengths)."""
    by: dict[tuple[str, int], list[float]] = {}
    for r in recs:
        by.setdefault((r["task"], r["length"]), []).append(r["score"])
    cell = {f"{t}@{n}": sum(v) / len(v) for (t, n), v in sorted(by.items())}
    lengths = sorted({n for _, n in by})
    tasks = [t for t in TASKS if any(tt == t for tt, _ in by)]
    per_len = {str(n): sum(cell[f"{t}@{n}"] for t in tasks) / len(tasks) for n in lengths}
    per_task = {t: sum(cell[f"{t}@{n}"] for n in lengths) / len(lengths) for t in tasks}
    return {"cells": cell, "per_length": per_len, "per_task": per_task,
            "avg_accuracy": sum(per_len.values()) / len(per_len)}


CHECKPOINT_S = 30  # a long run writes what it scored this often (seconds), for --resume
BOOT = 2000  # bootstrap resamples
CI = 0.95


def _boot_length(scores: dict[tuple, float], keys: list[tuple], rounds: int, rng) -> "np.ndarray":
    import numpy as np

    idx = rng.integers(0, len(keys), size=(rounds, len(keys)))
    return np.array([scores[k] for k in keys])[idx].mean(1)


def _stratified_means(recs: list[dict], lengths: list[int], rounds: int, seed: int,
                      paired: list[dict] | None = None, keys: set | None = None) -> dict:
    """Bootstrap of the averages ``summarize`` reports: at every length, the prompts (all tasks) are drawn with
    replacement and averaged, then over lengths.  With equal samples per task, as the suite builds, a length's
    mean over its prompts is summarize's mean over tasks.  ``keys`` restricts the draw to those prompts;
    ``paired`` (another format's records) is drawn with the very same draws, so a difference or ratio is
    paired on the prompts both answered.
    -> {"avg", "long", "by_length": {n: ...}} (arrays of ``rounds``), and "paired_avg" / "paired_long"."""
    import numpy as np

    long = [n for n in lengths if n >= 4096]
    own = {record_key(r): r["score"] for r in recs}
    other = {record_key(r): r["score"] for r in paired} if paired is not None else None
    out = {"by_length": {}, "paired_by_length": {}}
    for n in lengths:
        ks = sorted(k for k in own if k[1] == n and (keys is None or k in keys)
                    and (other is None or k in other))
        if not ks:
            raise ValueError(f"no prompts at length {n} to draw from")
        rng = np.random.default_rng([seed, n])  # the same draws for every format with the same prompts
        out["by_length"][n] = _boot_length(own, ks, rounds, rng)
        if other is not None:
            out["paired_by_length"][n] = _boot_length(other, ks, rounds, np.random.default_rng([seed, n]))
    for tag, by in (("", out["by_length"]), ("paired_", out["paired_by_length"])):
        if by:
            out[tag + "avg"] = sum(by.values()) / len(lengths)
            out[tag + "long"] = sum(by[n] for n in long) / len(long) if long else np.zeros(rounds)
    return out


def intervals(results: dict, lengths: list[int], rounds: int = BOOT, seed: int = 0) -> None:
    """Add 95% bootstrap intervals to each scored format of ``results`` (in place): ``avg_ci``, ``long_ci``,
    ``per_length_ci`` and, paired against ``auto`` on the prompts both answered, ``long_ratio`` /
    ``long_ratio_ci`` (4k-8k ÷ auto) and ``long_diff_ci`` (4k-8k minus auto)."""
    import numpy as np

    ok = {f: r["records"] for f, r in results.items() if "error" not in r and r.get("records")}
    q = lambda a: [float(np.quantile(a, (1 - CI) / 2)), float(np.quantile(a, (1 + CI) / 2))]  # noqa: E731
    base = ok.get("auto")
    for f, recs in ok.items():
        r = results[f]
        b = _stratified_means(recs, lengths, rounds, seed)
        r["avg_ci"] = q(b["avg"])
        r["per_length_ci"] = {str(n): q(v) for n, v in b["by_length"].items()}
        if not any(n >= 4096 for n in lengths):
            continue
        r["long_ci"] = q(b["long"])
        if base is None or f == "auto":
            continue
        common = {record_key(x) for x in recs} & {record_key(x) for x in base}
        pb = _stratified_means(recs, lengths, rounds, seed, paired=base, keys=common)
        mean = lambda rs: summarize([x for x in rs if record_key(x) in common])  # noqa: E731
        mine, theirs = mean(recs), mean(base)
        long = [str(n) for n in lengths if n >= 4096]
        la, lb = (sum(m["per_length"][n] for n in long) / len(long) for m in (mine, theirs))
        r["long_ratio"] = la / lb if lb else None  # on the prompts both answered
        r["long_diff"] = la - lb
        r["paired_prompts"] = len(common)
        r["long_diff_ci"] = q(pb["long"] - pb["paired_long"])
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = pb["long"] / pb["paired_long"]
        ratio = ratio[np.isfinite(ratio)]
        if ratio.size:
            r["long_ratio_ci"] = q(ratio)


def _ci(x) -> str:
    return f" [{x[0]:.2f}, {x[1]:.2f}]" if x else ""


# ---------------------------------------------------------------- the runner
def serve_and_score(model: str, fmt: str, samples: list[Sample], args, on_record=None) -> dict:
    from vllm_temporalkv.formats import FORMATS
    from vllm_temporalkv.harness.server import VLLMServer

    # "<format>-o1": the plugin's format with 1% exact outliers (the artifact holds the thresholds);
    # "<format>@windowN": with a recent window of N half-precision tokens (temporalkv_recent_window)
    base, _, variant = fmt.partition("@")
    dtype, outliers = (base[:-3], True) if base.endswith("-o1") and base[:-3] in FORMATS else (base, False)
    options = {}
    if args.artifact and dtype in FORMATS:
        options["temporalkv_artifact"] = str(args.artifact)
    if outliers:
        options["temporalkv_outliers"] = True
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


def write_markdown(rep: dict, path: Path) -> None:
    st = rep["settings"]
    res = rep["formats"]
    lengths = [str(n) for n in st["lengths"]]
    lines = [f"# Long-context retrieval through the server ({st['name']})", "",
             *[f"Command: `{c}`  " for c in dict.fromkeys(r.get("command", rep["run"]["command"])
                                                          for r in rep["formats"].values())],
             f"Machine: {rep['run']['machine']['cpu']}, {rep['run']['time']}  ",
             f"Seed {st['seed']}, greedy, --dtype {st.get('dtype', 'bfloat16')}; haystacks from Jane Austen's "
             "novels; accuracy = share of reference strings in the answer (RULER's string match). Prompts: samples "
             "per task and length (a format run with more samples answers the fewer-sample suite's prompts too).", "",
             f"Brackets: {CI:.0%} bootstrap intervals ({BOOT} resamples of the prompts at each length). The ratio and "
             "difference to auto are paired: on the prompts both answered, with the same draws. With few samples "
             "the intervals are wide.", "",
             "## Average accuracy by length", "",
             "| --kv-cache-dtype | prompts | " + " | ".join(lengths)
             + " | average | 4k-8k | 4k-8k ÷ auto | 4k-8k - auto |",
             "|---|---|" + "---|" * (len(lengths) + 4)]
    for f, r in res.items():
        if "error" in r:
            lines.append(f"| {f} | | " + " | ".join("–" for _ in lengths) + f" | refused: {r['error'][:120]} | | |")
            continue
        ratio = f"{r['long_ratio']:.2f}{_ci(r.get('long_ratio_ci'))}" if r.get("long_ratio") is not None else "–"
        la = "–" if r.get("long_avg") is None else f"{r['long_avg']:.3f}{_ci(r.get('long_ci'))}"
        diff = f"{r['long_diff']:+.3f}{_ci(r.get('long_diff_ci'))}" if r.get("long_diff") is not None else "–"
        lines.append(f"| {f} | {samples_per_cell(r['records'])} | "
                     + " | ".join(f"{r['per_length'].get(n, float('nan')):.3f}" for n in lengths)
                     + f" | {r['avg_accuracy']:.3f}{_ci(r.get('avg_ci'))} | {la} | {ratio} | {diff} |")
    lines += ["", "## Per task (all lengths)", "", "| --kv-cache-dtype | " + " | ".join(st["tasks"]) + " |",
              "|---|" + "---|" * len(st["tasks"])]
    for f, r in res.items():
        if "error" not in r:
            lines.append(f"| {f} | " + " | ".join(f"{r['per_task'].get(t, float('nan')):.3f}" for t in st["tasks"]) + " |")
    lines += ["", "## Per task and length", "", "| --kv-cache-dtype | " + " | ".join(
        f"{t}@{n}" for t in st["tasks"] for n in lengths) + " |", "|---|" + "---|" * (len(st["tasks"]) * len(lengths))]
    for f, r in res.items():
        if "error" not in r:
            lines.append(f"| {f} | " + " | ".join(f"{r['cells'].get(f'{t}@{n}', float('nan')):.2f}"
                                                  for t in st["tasks"] for n in lengths) + " |")
    lines += ["", "## Wall time", "", "| --kv-cache-dtype | server start-up s | prompts timed | suite s | s per prompt "
              "| ÷ auto |", "|---|---|---|---|---|---|"]
    per = lambda r: r["suite_s"] / r.get("suite_prompts", len(r["records"]))  # noqa: E731
    base_s = per(res["auto"]) if res.get("auto", {}).get("suite_s") else None
    for f, r in res.items():
        if "error" not in r and r.get("suite_s") is not None:
            ratio = f"{per(r) / base_s:.2f}" if base_s else "–"
            lines.append(f"| {f} | {r.get('startup_s', '–')} | {r.get('suite_prompts', len(r['records']))} | "
                         f"{r['suite_s']} | {per(r):.1f} | {ratio} |")
    path.write_text("\n".join(lines) + "\n")


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st, res = rep["settings"], rep["formats"]
    ok = {f: r for f, r in res.items() if "error" not in r}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for f, r in ok.items():
        xs = [int(n) for n in r["per_length"]]
        style = "-" if f.startswith("temporalkv") else ("--" if f in ("auto", "fp8") else ":")
        line, = axes[0].plot(xs, list(r["per_length"].values()), style, marker="o", label=f)
        if "per_length_ci" in r:  # the bootstrap interval as a band
            lo, hi = zip(*(r["per_length_ci"][n] for n in r["per_length"]))
            axes[0].fill_between(xs, lo, hi, color=line.get_color(), alpha=0.08)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(st["lengths"], [str(n) for n in st["lengths"]])
    axes[0].set_xlabel("context length (tokens)")
    axes[0].set_ylabel("average accuracy over tasks")
    axes[0].legend(fontsize=7, ncol=2)
    tasks = st["tasks"]
    w = 0.8 / max(1, len(ok))
    for i, (f, r) in enumerate(ok.items()):
        axes[1].bar([j + i * w for j in range(len(tasks))], [r["per_task"].get(t, 0) for t in tasks], w, label=f)
    axes[1].set_xticks([j + 0.4 - w / 2 for j in range(len(tasks))], tasks, rotation=20, fontsize=8)
    axes[1].set_ylabel("accuracy (all lengths)")
    fig.suptitle(f"Retrieval through the server, {st['name']} ({rep['run']['machine']['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_formats() -> list[str]:
    from vllm_temporalkv.formats import FORMATS

    return ["auto", "fp8"] + list(FORMATS)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.retrieval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct; its "
                   "artifact must be in <model>/temporalkv/calibration.safetensors or given with --artifact)")
    p.add_argument("--name", default="smollm2", help="model tag in the headline keys")
    p.add_argument("--formats", nargs="+", default=None, help="--kv-cache-dtype values (default: auto, fp8 and "
                   "every format the plugin serves); <format>-o1 serves a plugin format with 1%% exact outliers")
    p.add_argument("--artifact", default=None, help="calibration artifact for the plugin's formats")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    p.add_argument("--samples", type=int, default=10, help="samples per task and length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (= --max-num-seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-space-gib", type=int, default=2)
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--server-timeout", type=float, default=900)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed on to every server (last)")
    p.add_argument("--url", default=None, help="score this running server instead of starting any")
    p.add_argument("--served-model-name", default=None, help="with --url: the model name to request")
    p.add_argument("--tokenizer", default=None, help="with --url: tokenizer folder for building prompts")
    p.add_argument("--resume", action="store_true", help="keep the formats an earlier run with the same tasks, "
                   "lengths, samples and seed already scored in --out/retrieval.json")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--rerender", action="store_true", help="only recompute the summaries, intervals, tables, plot "
                   "and headline from --out/retrieval.json (no server)")
    args = p.parse_args(argv)
    if args.rerender:
        return report(json.loads((Path(args.out) / "retrieval.json").read_text()), Path(args.out))

    from vllm_temporalkv.models import load_tokenizer, resolve_model

    model = str(resolve_model(args.model)) if args.url is None or args.tokenizer is None else None
    tok = load_tokenizer(args.tokenizer or model)
    samples = SuiteBuilder(tok, args.seed).build(args.tasks, args.lengths, args.samples)
    print(f"{len(samples)} samples: {len(args.tasks)} tasks x {len(args.lengths)} lengths x {args.samples}")
    args.dtype = model_dtype(args.dtype)
    settings = {"name": args.name, "tasks": args.tasks, "lengths": args.lengths, "samples": args.samples,
                "seed": args.seed, "concurrency": args.concurrency, "max_num_batched_tokens": args.max_num_batched_tokens,
                "dtype": args.dtype}
    out = Path(args.out)
    results, partial = {}, {}
    if args.resume and (out / "retrieval.json").is_file():  # keep what an earlier run with the same suite scored
        prev = json.loads((out / "retrieval.json").read_text())
        # runs before --dtype existed served bfloat16; the sample count may differ (records are matched one by one)
        same = (all(prev["settings"].get(k) == settings[k] for k in ("tasks", "lengths", "seed"))
                and prev["settings"].get("dtype", "bfloat16") == settings["dtype"])
        if same:
            results = {f: r for f, r in prev["formats"].items() if "error" not in r}
            partial = prev.get("partial", {})
            print(f"resuming: {', '.join(results) or 'nothing'} scored"
                  + (f"; {', '.join(partial)} part-way" if partial else ""))
        else:
            print("not resuming: the earlier run had other tasks, lengths, seed or dtype")

    def save():
        write_json(out / "retrieval.json", {"settings": settings, "formats": results, "run": run_record(),
                                            **({"partial": partial} if partial else {})})

    if args.url:
        recs = run_suite(args.url, args.served_model_name or "model", samples, args.concurrency)
        results[args.served_model_name or args.url] = {"records": recs, **summarize(recs)}
    else:
        fmts = args.formats or default_formats()
        for fmt in tqdm(fmts, desc="servers", unit="server"):
            digest = artifact_digest(model, fmt, args.artifact)
            old = results.get(fmt, {})
            if old.get("artifact_sha256") != digest and digest is not None:
                old = {}  # another calibration: nothing to reuse
            half = partial.get(fmt, {})
            if half.get("artifact_sha256") != digest:
                half = {}
            have = reusable(old.get("records", []) + half.get("records", []), samples)
            todo = [x for x in samples if (x.task, x.length, x.index) not in have]
            if not todo:
                continue
            # records of indices beyond this run's samples (an earlier, longer run) stay
            kept = [r for r in old.get("records", []) if record_key(r) not in have] + list(have.values())
            done, last = list(kept), [time.time()]

            def checkpoint(rec, done=done, last=last, fmt=fmt, digest=digest):
                done.append(rec)
                if time.time() - last[0] > CHECKPOINT_S:  # a long run can be stopped and resumed at any point
                    partial[fmt] = {"records": list(done), "artifact_sha256": digest}
                    save()
                    last[0] = time.time()

            if have:
                tqdm.write(f"{fmt}: {len(have)} prompts already scored, {len(todo)} to go")
            try:
                r = serve_and_score(model, fmt, todo, args, on_record=checkpoint)
                recs = sorted(kept + r.pop("records"), key=record_key)
                if old:  # the start-up of the first run
                    r["startup_s"] = old.get("startup_s", r["startup_s"])
                if old.get("suite_s") is not None and old.get("records"):  # time summed over the top-ups
                    r["suite_s"] = round(old["suite_s"] + r["suite_s"], 1)
                    r["suite_prompts"] = old.get("suite_prompts", len(old["records"])) + r["suite_prompts"]
                results[fmt] = {"records": recs, **summarize(recs), "samples": samples_per_cell(recs),
                                **r, "artifact_sha256": digest,
                                "command": run_record()["command"]}
            except Exception as e:  # a refusing format is a result, not the end of the run
                if not old:
                    results[fmt] = {"error": f"{type(e).__name__}: {e}"[-600:]}
                else:
                    tqdm.write(f"{fmt}: the top-up failed ({type(e).__name__}: {e}); keeping the earlier records")
            partial.pop(fmt, None)
            r = results.get(fmt, {})
            tqdm.write(f"{fmt:20} " + (r["error"] if "error" in r else
                                        f"avg {r['avg_accuracy']:.3f} per length {r['per_length']}"))
            save()
    return report({"settings": settings, "formats": results, "run": run_record(),
                   **({"partial": partial} if partial else {})}, out)


def report(rep: dict, out: Path) -> dict:
    """Averages, intervals, retrieval.{json,md,png}; the headline when --out is the results folder."""
    st, results = rep["settings"], rep["formats"]
    long = [str(n) for n in st["lengths"] if n >= 4096]
    for r in results.values():
        if "error" not in r:
            r["long_avg"] = sum(r["per_length"][n] for n in long) / len(long) if long else None
            r["samples"] = samples_per_cell(r["records"])
    intervals(results, st["lengths"])
    write_json(out / "retrieval.json", rep)
    write_markdown(rep, out / "retrieval.md")
    plot(rep, out / "retrieval.png")
    if out.resolve() == RESULTS.resolve():
        figs = {}
        for f, r in results.items():
            if "error" not in r:
                p = f"retrieval.{st['name']}.{f}."
                figs[p + "avg_accuracy"] = r["avg_accuracy"]
                figs[p + "samples"] = r["samples"]  # prompts per task and length
                if "avg_ci" in r:
                    figs[p + "avg_accuracy_ci_low"], figs[p + "avg_accuracy_ci_high"] = r["avg_ci"]
                if r.get("long_avg") is not None:  # the lengths >= 4096 (the issue's 4k-8k criterion)
                    figs[p + "avg_accuracy_4k_8k"] = r["long_avg"]
                    if "long_ci" in r:
                        figs[p + "avg_accuracy_4k_8k_ci_low"], figs[p + "avg_accuracy_4k_8k_ci_high"] = r["long_ci"]
                if r.get("long_ratio") is not None:  # paired with auto on the prompts both answered
                    figs[p + "ratio_vs_auto_4k_8k"] = r["long_ratio"]
                    if "long_ratio_ci" in r:
                        figs[p + "ratio_vs_auto_4k_8k_ci_low"], figs[p + "ratio_vs_auto_4k_8k_ci_high"] = r["long_ratio_ci"]
        merge_headline(figs, HEADLINE)
    print((out / "retrieval.md").read_text())
    return rep


if __name__ == "__main__":
    main()
