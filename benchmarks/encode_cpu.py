"""A prompt's cache write on the CPU (the C++ encode): the codebook search's float32 tables against their float16
copy, and how much of the search an exact pruning could skip.

    python -m benchmarks.encode_cpu            # SmolLM2's 30 layers, 64 .. 4096 tokens, + the pruning bound (~3 min)
    python -m benchmarks.encode_cpu --smoke    # a random artifact, 2 sizes, no model forward (tests)

Timing: a served layer step writes every block a prompt's chunk completes before it attends, and on the AMX Xeon,
where the attention runs on tiles, that write is a good part of a 4096-token prompt's step
(benchmarks/results/cpu-speed-log.md, "A prompt's encode").  Here each of the artifact's layers (temporalkv-2bit) is
written in turn, as a served step writes them, with a 64 MiB read between calls (the tables cold, as the model's
weights leave them), N tokens of random bf16 K/V, the float16 and the float32 tables alternated in one process
(``ops.cpu.set_encode_f32_blocks``): per N the median of --reps rounds of all layers, their ratio, and the pages
compared bit for bit.

The pruning bound: an exact search may skip a group of centroids only where a bound proves none of them nearest.
With each codebook's 256 centroids ordered into 16 spatial groups of 16 (recursive median splits along the principal
axis) and a ball per group, the groups a vector's search cannot skip - those whose ball comes within its nearest
distance - counted over the real K/V of a passage of Austen (the model run in transformers, pre-RoPE, normalized as
the codec does).  Few groups would make a pruned search pay; most of them means the full screen is the search.

Results: benchmarks/results/encode-cpu-<cpu class>.{json,md,png}; headline
``encode.smollm2-cpu-<class>.<N>tok.temporalkv-2bit.f32_tables_time_ratio`` (256 and 4096 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from .common import add_smoke_args, apply_sizes, merge_headline, run_record, write_json

FMT = "temporalkv-2bit"
BLOCK_SIZE = 2048
HEADLINE_TOKENS = (256, 4096)


def _caches(model_dir: Path, art, layers: int | None):
    from transformers import AutoConfig

    from vllm_temporalkv.cache import LayerCache
    from vllm_temporalkv.rope import Rope

    cfg = AutoConfig.from_pretrained(model_dir)
    H, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    n = art.num_layers if layers is None else min(layers, art.num_layers)
    return [LayerCache.build(FMT, i, head_dim=D, block_size=BLOCK_SIZE, dtype=torch.bfloat16, rope=Rope(cfg),
                             artifact=art, num_kv_heads=H) for i in range(n)], H, D


def time_tables(lcs, H: int, D: int, tokens: list[int], reps: int) -> list[dict]:
    """Per N: the median ms of writing N tokens into every layer in turn, float16 and float32 tables alternated."""
    from vllm_temporalkv.ops import cpu

    g = torch.Generator().manual_seed(0)
    flush = torch.randn(16 << 20)  # 64 MiB: read between calls so that each finds its tables in DRAM
    default = cpu.encode_f32_blocks()
    rows = []
    try:
        for n in tokens:
            k = (torch.randn(n, H, D, generator=g) * 2).bfloat16()
            v = torch.randn(n, H, D, generator=g).bfloat16()
            pos = torch.arange(n)
            table = torch.arange(n // BLOCK_SIZE + 1)
            pid = table[pos // BLOCK_SIZE]
            ms = {"float16": [], "float32": []}
            last = {}
            for r in range(reps + 1):  # (round 0 untimed: first-touch allocations)
                for name, blocks in (("float16", 1 << 40), ("float32", 0)):
                    cpu.set_encode_f32_blocks(blocks)
                    pages = [torch.zeros(len(table), H, lc.layout.bytes, dtype=torch.uint8) for lc in lcs]
                    total = 0.0
                    for lc, pg in zip(lcs, pages):
                        flush.sum()
                        t0 = time.perf_counter()
                        cpu.write_kv(lc, pg, k, v, pos, pid)
                        total += time.perf_counter() - t0
                    if r:
                        ms[name].append(total * 1e3)
                    last[name] = pages
            same = all(torch.equal(a, b) for a, b in zip(last["float16"], last["float32"]))
            f16, f32 = statistics.median(ms["float16"]), statistics.median(ms["float32"])
            rows.append(dict(tokens=n, float16_ms=f16, float32_ms=f32, ratio=f32 / f16, same_pages=same,
                             float16_all=ms["float16"], float32_all=ms["float32"]))
            print(f"{n:5d} tokens, {len(lcs)} layers: float16 tables {f16:8.2f} ms, float32 {f32:8.2f} ms "
                  f"({f32 / f16:.3f}x), pages {'identical' if same else 'DIFFER'}", flush=True)
    finally:
        cpu.set_encode_f32_blocks(default)
    return rows


def _spatial_groups(C: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """Indices of C's rows split into 2^levels equal groups by recursive median splits along the principal axis."""
    groups = [torch.arange(C.shape[0])]
    for _ in range(levels):
        nxt = []
        for idx in groups:
            X = C[idx] - C[idx].mean(0)
            axis = torch.linalg.svd(X, full_matrices=False)[2][0]
            o = idx[(X @ axis).argsort()]
            nxt += [o[: len(o) // 2], o[len(o) // 2:]]
        groups = nxt
    return groups


def pruning_bound(model_dir: Path, lcs, layers: list[int], tokens: int) -> list[dict]:
    """Per layer and K / V: how many of 16 centroid groups an exact search could not skip (mean, median, p90)."""
    from vllm_temporalkv.corpora import load_austen
    from vllm_temporalkv.hf_hooks import kv_output_hooks
    from vllm_temporalkv.models import load_hf_model, load_tokenizer

    model, tok = load_hf_model(model_dir, dtype=torch.float32), load_tokenizer(model_dir)
    text = max(load_austen().values(), key=len)
    ids = tok(text[len(text) // 3:], return_tensors="pt").input_ids[:, :tokens]
    acts = {}
    with kv_output_hooks(model, lambda i, kind, out: acts.__setitem__((i, kind), out[0].detach().float())), \
            torch.no_grad():
        model(ids)
    rows = []
    for i in layers:
        for kind in "kv":
            q = lcs[i].k if kind == "k" else lcs[i].v
            x = acts[(i, kind)]
            x = x[8: 8 + (x.shape[0] - 8) // 8 * 8]  # whole blocks after the sinks
            cent = q.codec.centroids.double()  # [H, G, K, v]
            vecs = q.codec.to_vectors(q.normalize(x)).double().reshape(*cent.shape[:2], -1, cent.shape[-1])
            need = []
            for h in range(cent.shape[0]):
                for gi in range(cent.shape[1]):
                    C, U = cent[h, gi], vecs[h, gi]
                    groups = _spatial_groups(C, 4)
                    centers = torch.stack([C[s].mean(0) for s in groups])
                    radius = torch.stack([(C[s] - centers[j]).norm(dim=1).max() for j, s in enumerate(groups)])
                    best = (torch.cdist(U, C) ** 2).min(1).values
                    lower = (torch.cdist(U, centers) - radius).clamp_min(0) ** 2  # no centroid of a group is nearer
                    need.append((lower <= best[:, None]).sum(1).float())
            c = torch.cat(need)
            rows.append(dict(layer=i, kind=kind, method=type(q.codec).__name__, groups=16, vectors=c.numel(),
                             mean=c.mean().item(), median=c.median().item(), p90=c.quantile(0.9).item()))
            print(f"layer {i} {kind} ({rows[-1]['method']}): groups a pruned search must visit: mean "
                  f"{rows[-1]['mean']:.2f} of 16, median {rows[-1]['median']:.0f}, p90 {rows[-1]['p90']:.0f}", flush=True)
    return rows


def markdown(rep: dict) -> str:
    m = rep["machine"]
    lines = [f"# A prompt's cache write on the CPU ({rep['name']})", "",
             f"Command: `{rep['run']['command']}`  ",
             f"Machine: {m.get('cpu')} ({m.get('torch_threads')} threads; SIMD {' '.join(m.get('cpu_simd', []))}), "
             f"{rep['run']['time']}; artifact `{rep['artifact']}`", "",
             f"Every layer's write of N tokens ({rep['layers']} layers, random bf16 K/V, tables cold), float16 and "
             f"float32 codebook tables alternated in one process, medians of {rep['reps']} rounds (ms):", "",
             "| tokens | float16 tables | float32 tables | float32 ÷ float16 | pages identical |", "|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['float16_ms']:.2f} | {r['float32_ms']:.2f} | {r['ratio']:.3f} | "
              f"{'yes' if r['same_pages'] else 'NO'} |" for r in rep["tables"]]
    lines += ["", f"Served default: float32 tables from {rep['default_f32_blocks']} blocks per KV head on.", ""]
    if rep.get("pruning"):
        lines += ["Groups of 16 centroids (of 16) an exact pruned search could not skip (ball bounds, real K/V):", "",
                  "| layer | K/V | method | vectors | mean | median | p90 |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['kind']} | {r['method']} | {r['vectors']} | {r['mean']:.2f} | "
                  f"{r['median']:.0f} | {r['p90']:.0f} |" for r in rep["pruning"]]
    return "\n".join(lines) + "\n"


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = rep["tables"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(t))
    ax.bar([i - 0.2 for i in x], [r["float16_ms"] for r in t], 0.4, label="float16 tables")
    ax.bar([i + 0.2 for i in x], [r["float32_ms"] for r in t], 0.4, label="float32 tables")
    ax.set_xticks(list(x), [str(r["tokens"]) for r in t])
    ax.set_yscale("log")
    ax.set_xlabel("tokens written (every layer)")
    ax.set_ylabel("ms, all layers")
    ax.set_title(f"encode: {rep['name']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    from vllm_temporalkv.artifact import Artifact, calibrate_hint, default_artifact_path
    from vllm_temporalkv.cpu_isa import cpu_class
    from vllm_temporalkv.models import resolve_model
    from vllm_temporalkv.ops import cpu

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--artifact", default=None, help="calibration artifact (default: the model folder's, else "
                    "runs/<cpu class>/calibration.safetensors as scripts/cpu-figures.sh makes it)")
    ap.add_argument("--tokens", nargs="+", type=int, default=None, help="default 64 128 256 ... 4096")
    ap.add_argument("--reps", type=int, default=None, help="rounds per size (default 8)")
    ap.add_argument("--prune-layers", nargs="*", type=int, default=None, help="default 3 10 20 25 (none: skip)")
    ap.add_argument("--prune-tokens", type=int, default=2048)
    add_smoke_args(ap, "a random artifact, 2 layers, 64 and 320 tokens, 2 rounds, no pruning bound (tests)")
    a = ap.parse_args(argv)
    apply_sizes(a, dict(tokens=[64, 128, 256, 512, 1024, 2048, 4096], reps=8, prune_layers=[3, 10, 20, 25]),
                dict(tokens=[64, 320], reps=2, prune_layers=[]), "encode-cpu-smoke-")
    if not cpu.available():
        raise SystemExit("the C++ extension is not built: `pip install -e .` (scripts/setup.sh) builds it")
    cls, model_dir = cpu_class(), resolve_model(a.model)
    out = Path(a.out)
    if a.smoke:
        from vllm_temporalkv.harness.artifacts import synthetic_artifact

        path = synthetic_artifact(str(model_dir), [FMT], out / "smoke-artifact.safetensors")
        a.no_headline = True
    else:
        path = Path(a.artifact) if a.artifact else default_artifact_path(model_dir)
        if not a.artifact and not path.is_file():
            path = Path("runs") / cls / "calibration.safetensors"
        if not path.is_file():
            raise SystemExit(f"no calibration artifact at {path}: {calibrate_hint(str(model_dir), path)}")
    art = Artifact.load(path)
    lcs, H, D = _caches(model_dir, art, 2 if a.smoke else None)
    name = f"{'smoke' if a.smoke else 'smollm2'}-cpu-{cls}"
    rep = dict(name=name, artifact=str(path), layers=len(lcs), reps=a.reps, default_f32_blocks=cpu.encode_f32_blocks(),
               smoke=a.smoke, run=run_record())
    rep["machine"] = rep["run"]["machine"]
    rep["tables"] = time_tables(lcs, H, D, a.tokens, a.reps)
    rep["pruning"] = pruning_bound(model_dir, lcs, a.prune_layers, a.prune_tokens) if a.prune_layers else []
    stem = f"encode-cpu-{cls}" if not a.smoke else "encode-cpu-smoke"
    write_json(out / f"{stem}.json", rep)
    (out / f"{stem}.md").write_text(markdown(rep))
    plot(rep, out / f"{stem}.png")
    if not a.no_headline:
        merge_headline({f"encode.{name}.{r['tokens']}tok.{FMT}.f32_tables_time_ratio": r["ratio"]
                        for r in rep["tables"] if r["tokens"] in HEADLINE_TOKENS})
    if not all(r["same_pages"] for r in rep["tables"]):
        raise SystemExit("the float16 and float32 tables wrote different pages: a bug in the encode's tables")
    return rep


if __name__ == "__main__":
    main()
