"""A fuzzer over the calibration artifact: every mutation must be refused at start-up, cleanly.

    python -m benchmarks.artifact_fuzz [--mutations 600] [--model DIR] [--artifact FILE]

A mutation is a copy of a good artifact with one thing wrong, of the kinds a file meets in the wild
and a few a buggy writer makes: truncation, flipped bytes in the header (JSON) or the tensor data, a
bad header length, an empty file; and through safetensors itself, wrong dtypes and shapes, NaN / Inf
in a codebook or the statistics, a missing / renamed / extra tensor, two layers' codebooks swapped,
another model's fingerprint, garbage metadata values - each
with the good file's content checksum (corruption) or, half the time, with one recomputed for the bad
content (a writer that wrote the bad values; not for a swap of two layers or another valid per-layer
method, which with a fresh checksum are a valid artifact of another calibration).

Each is opened the way a server starts (``Artifact.load`` with the model's fingerprint and the format,
then every layer's quantizers) and classed:
* ``refused``: an ``ArtifactError`` naming the file and the command that re-creates it (clean);
* ``identical``: it loaded, and everything a server uses equals the good artifact (a harmless byte,
  e.g. in a padding space - clean);
* ``crash``: any other exception (unclean: a message that names neither the file nor the fix);
* ``accepted``: it loaded and differs (unclean: a server would start and answer wrongly).
Results: ``benchmarks/results/artifact-fuzz.{json,md}``; headline ``stress.artifact_fuzz.<format>.mutations``
and ``stress.artifact_fuzz.<format>.unclean`` (must be 0).
"""

from __future__ import annotations

import argparse
import json
import random
import struct
from collections import Counter
from pathlib import Path

import torch

from vllm_temporalkv.harness.artifacts import load_all

from .common import HEADLINE, add_out_arg, ensure_calibrated, is_results, merge_headline, run_record, write_json


# ---- the file ------------------------------------------------------------------------------------
def _save(tensors: dict[str, torch.Tensor], meta: dict[str, str], *, rehash: bool) -> bytes:
    """The safetensors bytes of (tensors, meta); rehash: with the checksum recomputed for them."""
    from safetensors.torch import save

    from vllm_temporalkv.artifact import DIGEST_KEY, content_digest

    meta = dict(meta)
    if rehash:
        meta[DIGEST_KEY] = content_digest(meta, tensors)
    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)


# ---- mutations ------------------------------------------------------------------------------------
def _other_fingerprint(fp: dict, rng: random.Random) -> dict:
    fp = dict(fp)
    key = rng.choice([k for k, v in fp.items() if isinstance(v, (int, float)) and not isinstance(v, bool)] or list(fp))
    fp[key] = (fp[key] * 2 + 1) if isinstance(fp[key], (int, float)) else "other"
    return fp


def _tensor_mutations(tensors, meta, rng: random.Random):
    """(name, tensors, meta, legit) with one structural fault; legit: with a checksum recomputed for it the
    file would be a valid artifact of another calibration (two layers' codebooks swapped, another valid
    per-layer method) - detectable only as corruption, so it is never rehashed."""
    names = sorted(tensors)
    books = [n for n in names if n.startswith("codebook.")]
    stats = [n for n in names if n.startswith("stats.")]
    pick = rng.choice
    kind = pick(["dtype", "shape", "nan", "inf", "drop", "rename", "extra", "swap", "fingerprint", "meta-json",
                 "meta-value", "kind", "schema", "formats", "methods", "stats-nan", "stats-zero-std", "empty-meta"])
    t, m = dict(tensors), dict(meta)
    legit = kind == "swap"
    if kind == "dtype":
        n = pick(names)
        t[n] = t[n].to(pick([torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.float16]))
    elif kind == "shape":
        n = pick(names)
        x = t[n]
        t[n] = pick([x.flatten(), x[..., :-1] if x.shape[-1] > 1 else x[None], x.unsqueeze(0), x.transpose(0, -1),
                     torch.cat([x, x[:1]])])
    elif kind in ("nan", "inf"):
        n = pick(books)
        x = t[n].clone()
        x.view(-1)[rng.randrange(x.numel())] = float("nan") if kind == "nan" else pick([float("inf"), -float("inf")])
        t[n] = x
    elif kind == "stats-nan":
        n = pick(stats)
        x = t[n].clone()
        x.view(-1)[rng.randrange(x.numel())] = pick([float("nan"), float("inf")])
        t[n] = x
    elif kind == "stats-zero-std":
        n = pick([s for s in stats if s.endswith(".std")])
        x = t[n].clone()
        x.view(-1)[rng.randrange(x.numel())] = pick([0.0, -1.0])
        t[n] = x
    elif kind == "drop":
        del t[pick(names)]
    elif kind == "rename":
        n = pick(names)
        parts = n.split(".")
        parts[pick(range(len(parts)))] = pick(["x", "99", "-1", "", "k", "v", "1e3"])
        t[".".join(parts)] = t.pop(n)
    elif kind == "extra":
        t[pick(["extra", "codebook.0.k", "stats.0.q.mean", "codebook.0.k.temporal-l9-k7", "hybrid.x"])] = torch.zeros(2, 2)
    elif kind == "swap":
        a = pick(books)
        same = [b for b in books if b != a and b.split(".")[2:] == a.split(".")[2:]]
        if same:
            b = pick(same)
            t[a], t[b] = t[b], t[a]
        else:
            t[a] = t[a].flip(0)
    elif kind == "fingerprint":
        m["fingerprint"] = json.dumps(_other_fingerprint(json.loads(m["fingerprint"]), rng))
    elif kind == "meta-json":
        k = pick(sorted(k for k in m if k not in ("kind", "schema_version")))  # metadata order varies
        v = m[k]
        cut = rng.randrange(len(v) + 1)
        m[k] = v[:cut] + pick(["", "{", "]", "\x00", "null", "1", "\"", "}}"]) + v[cut + 1:]
    elif kind == "meta-value":
        k = pick(["fingerprint", "formats", "layer_methods", "calibration"])
        m[k] = json.dumps(pick([None, 1, "x", [], {}, [1, 2], {"a": 1}, -1e300, True]))
    elif kind == "kind":
        m["kind"] = pick(["", "other", "vllm-temporalkv/other"])
    elif kind == "schema":
        m["schema_version"] = pick(["0", "2", "", "1.0", "x"])
    elif kind == "formats":
        fm = json.loads(m["formats"])
        m["formats"] = json.dumps(pick([fm[:-1], fm + ["temporalkv-3bit"], fm + [fm[0]], [], [7]]))
    elif kind == "methods":
        lm = json.loads(m["layer_methods"])
        f = pick(list(lm))
        kv = pick(["k", "v"])
        ms = list(lm[f][kv])
        i = rng.randrange(len(ms))
        choice = pick(["bogus", "scalar", "channel", "temporal", None, 3, "drop-layer"])
        if choice == "drop-layer":
            ms.pop(i)
        else:
            ms[i] = choice
        legit = choice in ("scalar", "channel", "temporal")
        lm[f][kv] = ms
        m["layer_methods"] = json.dumps(lm)
    elif kind == "empty-meta":
        m = {}
    return kind, t, m, legit


def mutations(good: bytes, tensors: dict, meta: dict, rng: random.Random, n: int):
    """n (kind, bytes) mutations of the good file (its bytes, its tensors and metadata); safetensors lays
    it out as a u64 header length, the JSON header, the data."""
    hlen = struct.unpack("<Q", good[:8])[0]
    for _ in range(n):
        kind = rng.choice(["truncate", "header-byte", "data-byte", "header-length", "empty", "structure",
                           "structure", "structure"])
        if kind == "truncate":
            yield kind, good[:rng.randrange(len(good))]
        elif kind == "header-byte":
            b = bytearray(good)
            p = 8 + rng.randrange(hlen)
            b[p] = rng.choice([x for x in range(256) if x != b[p]])
            yield kind, bytes(b)
        elif kind == "data-byte":
            b = bytearray(good)
            p = 8 + hlen + rng.randrange(len(good) - 8 - hlen)
            b[p] ^= 1 << rng.randrange(8)
            yield kind, bytes(b)
        elif kind == "header-length":
            v = rng.choice([0, 1, hlen - 1, hlen + 1, len(good), 2 ** 40, 2 ** 64 - 1])
            yield kind, struct.pack("<Q", v) + good[8:]
        elif kind == "empty":
            yield kind, b""
        else:
            sub, t, m, legit = _tensor_mutations(tensors, meta, rng)
            rehash = not legit and rng.random() < 0.5
            yield f"{sub}{'+rehash' if rehash else ''}", _save(t, m, rehash=rehash)


# ---- the check ------------------------------------------------------------------------------------
def _same(a, b, fmt: str) -> bool:
    """Whether two artifacts give a server the same quantizers for fmt."""
    from vllm_temporalkv.cache import model_quantizers

    if a.fingerprint != b.fingerprint or a.layer_methods.get(fmt) != b.layer_methods.get(fmt):
        return False
    for (qa_k, qa_v), (qb_k, qb_v) in zip(model_quantizers(fmt, a), model_quantizers(fmt, b)):
        for x, y in ((qa_k, qb_k), (qa_v, qb_v)):
            if not torch.equal(x.codec.centroids, y.codec.centroids):
                return False
            for f in ("mean", "std", "lo", "hi"):
                if not torch.equal(getattr(x.stats, f), getattr(y.stats, f)):
                    return False
    return True


def classify(path: Path, expect: dict, fmt: str, good) -> tuple[str, str]:
    """(outcome, message) for one file, opened as a server opens it (see the module docstring)."""
    from vllm_temporalkv.artifact import Artifact, ArtifactError
    from vllm_temporalkv.cache import model_quantizers

    try:
        art = Artifact.load(path, expect=expect, formats=[fmt])
        for outliers in (False, True):
            model_quantizers(fmt, art, outliers=outliers)
    except ArtifactError as e:
        msg = str(e)
        clean = str(path) in msg and "calibrate" in msg
        return ("refused" if clean else "crash"), msg[:300]
    except Exception as e:  # noqa: BLE001 - what the fuzzer is looking for
        return "crash", f"{type(e).__name__}: {e}"[:300]
    return ("identical" if _same(art, good, fmt) else "accepted"), ""


UNCLEAN = ("crash", "accepted")


def fuzz(artifact: Path, expect: dict, fmt: str, n: int, seed: int, workdir: Path) -> dict:
    """Run n mutations of artifact; the counts and every unclean case."""
    from vllm_temporalkv.artifact import Artifact

    good = Artifact.load(artifact, expect=expect, formats=[fmt])
    workdir.mkdir(parents=True, exist_ok=True)
    src = good.save(workdir / "good.safetensors")  # as this version writes it: with its checksum
    good_bytes = src.read_bytes()
    tensors, meta = load_all(src)
    src.unlink()
    rng = random.Random(seed)
    path = workdir / "mutant.safetensors"
    counts: Counter = Counter()
    by_kind: dict[str, Counter] = {}
    unclean = []
    for kind, data in mutations(good_bytes, tensors, meta, rng, n):
        path.write_bytes(data)
        outcome, msg = classify(path, expect, fmt, good)
        counts[outcome] += 1
        by_kind.setdefault(kind.split("+")[0], Counter())[outcome] += 1
        if outcome in UNCLEAN:
            unclean.append({"kind": kind, "outcome": outcome, "message": msg})
    path.unlink(missing_ok=True)
    return {"mutations": n, "outcomes": dict(counts), "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
            "unclean": unclean}


def write_markdown(rep: dict, path: Path) -> None:
    r = rep["result"]
    outcomes = ["refused", "identical", "crash", "accepted"]
    lines = ["# Calibration artifact fuzzing", "", f"Command: `{rep['run']['command']}`  ",
             f"Machine: {rep['run']['machine']['cpu']}, {rep['run']['time']}  ",
             f"Artifact: `{rep['settings']['artifact']}` ({rep['settings']['format']}), seed {rep['settings']['seed']}", "",
             f"{r['mutations']} mutations; unclean (crash or accepted): **{len(r['unclean'])}**", "",
             "| mutation | " + " | ".join(outcomes) + " |", "|---|" + "---|" * len(outcomes)]
    for kind, c in r["by_kind"].items():
        lines.append(f"| {kind} | " + " | ".join(str(c.get(o, 0)) for o in outcomes) + " |")
    lines.append("| **all** | " + " | ".join(str(r["outcomes"].get(o, 0)) for o in outcomes) + " |")
    if r["unclean"]:
        lines += ["", "## Unclean", ""] + [f"- {u['kind']}: {u['outcome']}: {u['message']}" for u in r["unclean"][:50]]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.artifact_fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--artifact", default=None, help="the good artifact (default: the model's own; calibrated first "
                   "if missing)")
    p.add_argument("--format", default="temporalkv-2bit")
    p.add_argument("--mutations", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    add_out_arg(p)
    args = p.parse_args(argv)

    from transformers import AutoConfig

    from vllm_temporalkv.artifact import default_artifact_path, model_fingerprint
    from vllm_temporalkv.models import resolve_model

    model = resolve_model(args.model)
    artifact = Path(args.artifact) if args.artifact else default_artifact_path(model)
    if not artifact.is_file():  # what `vllm-temporalkv serve` does on first use
        ensure_calibrated(model, args.format)
    expect = model_fingerprint(AutoConfig.from_pretrained(model))
    out = Path(args.out)
    result = fuzz(artifact, expect, args.format, args.mutations, args.seed, out / "artifact-fuzz-work")
    (out / "artifact-fuzz-work").rmdir()
    rep = {"settings": {"artifact": str(artifact), "format": args.format, "seed": args.seed},
           "result": result, "run": run_record()}
    write_json(out / "artifact-fuzz.json", rep)
    write_markdown(rep, out / "artifact-fuzz.md")
    if is_results(out):
        key = f"stress.artifact_fuzz.{args.format}"
        merge_headline({f"{key}.mutations": result["mutations"], f"{key}.unclean": len(result["unclean"])}, HEADLINE)
    print(json.dumps(result["outcomes"]), f"unclean: {len(result['unclean'])}")
    for u in result["unclean"][:20]:
        print(" ", u)
    return 0 if not result["unclean"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
