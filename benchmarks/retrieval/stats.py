"""The suite's averages (per task and length, per length, overall) and their bootstrap intervals, paired with auto."""

from __future__ import annotations

from .suite import TASKS, record_key

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
    ``per_length_ci`` and, paired against ``auto`` on the prompts both answered, ``ratio`` / ``ratio_ci`` (the
    average over every length ÷ auto's: a suite of short prompts alone has no 4k-8k), ``long_ratio`` /
    ``long_ratio_ci`` (4k-8k ÷ auto) and ``long_diff_ci`` (4k-8k minus auto)."""
    import numpy as np

    ok = {f: r["records"] for f, r in results.items() if "error" not in r and r.get("records")}
    q = lambda a: [float(np.quantile(a, (1 - CI) / 2)), float(np.quantile(a, (1 + CI) / 2))]  # noqa: E731

    def ratio_ci(num, den):  # the draws where auto scored anything
        with np.errstate(divide="ignore", invalid="ignore"):
            x = num / den
        x = x[np.isfinite(x)]
        return q(x) if x.size else None

    base = ok.get("auto")
    has_long = any(n >= 4096 for n in lengths)
    for f, recs in ok.items():
        r = results[f]
        b = _stratified_means(recs, lengths, rounds, seed)
        r["avg_ci"] = q(b["avg"])
        r["per_length_ci"] = {str(n): q(v) for n, v in b["by_length"].items()}
        if has_long:
            r["long_ci"] = q(b["long"])
        if base is None or f == "auto":
            continue
        common = {record_key(x) for x in recs} & {record_key(x) for x in base}
        pb = _stratified_means(recs, lengths, rounds, seed, paired=base, keys=common)
        mean = lambda rs: summarize([x for x in rs if record_key(x) in common])  # noqa: E731
        mine, theirs = mean(recs), mean(base)
        r["paired_prompts"] = len(common)
        r["ratio"] = mine["avg_accuracy"] / theirs["avg_accuracy"] if theirs["avg_accuracy"] else None
        r.pop("ratio_ci", None)
        if (ci := ratio_ci(pb["avg"], pb["paired_avg"])) is not None:
            r["ratio_ci"] = ci
        if not has_long:
            continue
        long = [str(n) for n in lengths if n >= 4096]
        la, lb = (sum(m["per_length"][n] for n in long) / len(long) for m in (mine, theirs))
        r["long_ratio"] = la / lb if lb else None  # on the prompts both answered
        r["long_diff"] = la - lb
        r["long_diff_ci"] = q(pb["long"] - pb["paired_long"])
        if (ci := ratio_ci(pb["long"], pb["paired_long"])) is not None:
            r["long_ratio_ci"] = ci
