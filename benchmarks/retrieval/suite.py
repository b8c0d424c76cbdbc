"""The RULER-style suite of benchmarks.retrieval (after Hsieh et al. 2024): deterministic prompts for a --seed, each
with its reference answers, and RULER's string-match score."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

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


def record_key(r) -> tuple[str, int, int]:
    return (r["task"], r["length"], r["index"])
