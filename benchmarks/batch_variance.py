"""Does a row of vLLM's CPU linear layers depend on how many rows share the batch?  Measured per dtype.

    python -m benchmarks.batch_variance                # SmolLM2's projection shapes, bf16 and float32

Concurrent requests share vLLM's GEMMs: a request's activations are one row among M.  Our attention is
shape-independent (tests/test_paged_reference.py), so whether a request's output depends on its batch comes
down to vLLM's GEMM kernels, which it picks per CPU class and dtype (``dispatch_cpu_unquantized_gemm``: the
SGL AMX kernel for small bf16 weights on an AMX CPU, oneDNN's otherwise, each with its own blocking per M).
This builds each of the model's projections the way vLLM's CPU worker does, feeds the same rows alone and
inside batches of M rows, and reports how often and by how much a row's output differs from its M = 1 value.
A 2-bit cache then turns such differences into code flips (benchmarks/amplification.py): that is why the
concurrency tests pin float32, and what the README's guarantee per CPU class rests on.

Results: benchmarks/results/batch-variance-<cpu class>.{json,md} and headline
``batch_variance.cpu-<class>.<dtype>.rows_changed_fraction`` / ``.max_rel_diff``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .common import add_headline_arg, add_out_arg, merge_headline, run_record, write_json

# SmolLM2-135M's projections (out, in): q, k/v, o, the merged gate/up and down
SHAPES = {"q_proj": (576, 576), "kv_proj": (192, 576), "o_proj": (576, 576), "gate_up": (3072, 576),
          "down": (576, 1536)}
BATCH_ROWS = (2, 3, 8, 17, 64, 256)


def vllm_linear(weight: torch.Tensor):
    """The callable vLLM's CPU worker uses for this weight (its dispatch on this CPU and dtype) and its name."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    layer.bias = None
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    fn = layer.cpu_linear
    kind = ("sgl" if "weight_packed_linear" in fn.__code__.co_names else
            "onednn" if "onednn_mm" in fn.__code__.co_names else "torch")
    return (lambda x: fn(x, layer.weight, None)), kind


def measure(dtype: torch.dtype, rows: tuple[int, ...], seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
        x = torch.randn(max(rows), k, generator=g).to(dtype)
        lin, kind = vllm_linear(w)
        with torch.no_grad():
            alone = torch.cat([lin(x[i:i + 1]) for i in range(max(rows))]).float()
            per_m = {}
            for m in rows:
                y = lin(x[:m]).float()
                diff = (y - alone[:m]).abs()
                rel = float((diff.amax(1) / alone[:m].abs().amax(1)).max())  # of the row's largest output
                per_m[m] = dict(rows_changed=int((diff.amax(1) > 0).sum()), rows=m, max_rel_diff=rel)
        out[name] = dict(kernel=kind, per_m=per_m)
    return out


def summary(res: dict) -> dict:
    rows = sum(v["rows"] for s in res.values() for v in s["per_m"].values())
    changed = sum(v["rows_changed"] for s in res.values() for v in s["per_m"].values())
    return dict(rows_changed_fraction=changed / rows, max_rel_diff=max(v["max_rel_diff"] for s in res.values()
                                                                        for v in s["per_m"].values()))


def markdown(rep: dict) -> str:
    m = rep["machine"]
    lines = [f"# Batch variance of vLLM's CPU GEMMs ({rep['cpu_class']})", "",
             f"`{rep['run']['command']}` on {m['cpu']} ({' '.join(m['cpu_simd'])}), torch {m['torch']}, "
             f"vLLM {rep['vllm']}, {rep['run']['time']}.", "",
             "A row fed alone vs inside a batch of M rows through the projection vLLM builds for this CPU and dtype "
             "(SmolLM2's shapes, random weights): rows whose output changed, and the largest change relative to the row's largest output.", "",
             "| dtype | projection | kernel | " + " | ".join(f"M={r}" for r in rep["rows"]) + " |",
             "|---|---|---|" + "---|" * len(rep["rows"])]
    for dt, res in rep["dtypes"].items():
        for name, s in res.items():
            cells = [f"{v['rows_changed']}/{v['rows']} ({v['max_rel_diff']:.0e})" for v in s["per_m"].values()]
            lines.append(f"| {dt} | {name} | {s['kernel']} | " + " | ".join(cells) + " |")
    lines += ["", "| dtype | rows changed | max relative change |", "|---|---|---|"]
    lines += [f"| {dt} | {s['rows_changed_fraction']:.1%} | {s['max_rel_diff']:.1e} |" for dt, s in rep["summary"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    import vllm

    from vllm_temporalkv.cpu_isa import cpu_class

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--rows", nargs="+", type=int, default=list(BATCH_ROWS))
    add_out_arg(ap)
    add_headline_arg(ap)
    a = ap.parse_args(argv)
    cls = cpu_class()
    rep = dict(cpu_class=cls, vllm=vllm.__version__, rows=a.rows, dtypes={}, summary={}, run=run_record())
    rep["machine"] = rep["run"]["machine"]
    for dt in a.dtypes:
        res = measure(getattr(torch, dt), tuple(a.rows))
        rep["dtypes"][dt], rep["summary"][dt] = res, summary(res)
        print(f"{dt}: rows changed {rep['summary'][dt]['rows_changed_fraction']:.1%}, max relative change "
              f"{rep['summary'][dt]['max_rel_diff']:.1e} ({', '.join(k + ' ' + v['kernel'] for k, v in res.items())})")
    out = Path(a.out)
    write_json(out / f"batch-variance-{cls}.json", rep)
    (out / f"batch-variance-{cls}.md").write_text(markdown(rep))
    if not a.no_headline:
        merge_headline({f"batch_variance.cpu-{cls}.{dt}.{k}": v for dt, s in rep["summary"].items() for k, v in s.items()})
    return rep


if __name__ == "__main__":
    main()
