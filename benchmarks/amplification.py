"""How much a last-bit difference in K/V moves the next-token NLL once the cache quantizes it.

    python -m benchmarks.amplification            # SmolLM2, 1 x 1100 Brown tokens, causal protocol

Tensor parallelism (another reduction order) and batching (another GEMM kernel) change activations in their
last float32 bits; vLLM's own float32 cache passes that on unchanged (~1e-5 nats), but any quantizer - a bf16
cache's rounding as much as a 2-bit code - turns a value near one of its decision boundaries into a whole step.
This perturbs every pre-RoPE K/V value by one float32 ulp (relative 2^-23, Gaussian) before the simulated cache
(benchmarks.quality's causal protocol: what a decode step sees) and reports |d NLL| per token against the same
window unperturbed.  It prints; nothing is written.
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> dict:
    from vllm_temporalkv.artifact import Artifact, default_artifact_path
    from vllm_temporalkv.corpora import load_corpus, token_windows
    from vllm_temporalkv.harness.simulate import Simulator, token_nlls
    from vllm_temporalkv.models import load_hf_model, load_tokenizer, resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1100)
    ap.add_argument("--configs", nargs="+", default=["bf16", "temporalkv-4bit", "temporalkv-2bit"])
    args = ap.parse_args(argv)
    d = resolve_model(args.model)
    model = load_hf_model(d, dtype=torch.float32)
    art = Artifact.load(default_artifact_path(d))
    ids = token_windows(load_tokenizer(d), load_corpus("brown"), args.tokens, 1)[0]
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in args.configs:
        sim = Simulator(name, art, None, "causal")
        clean = token_nlls(model, ids, sim)

        class Perturbed:  # the same simulator, fed K/V one ulp away
            protocol, stash, qs = "causal", sim.stash, sim.qs

            def __call__(self, layer, kind, x):
                return sim(layer, kind, x * (1 + 2.0**-23 * torch.randn(x.shape, generator=g)))

        dd = (token_nlls(model, ids, Perturbed()) - clean).abs()
        out[name] = {"max": float(dd.max()), "median": float(dd.median())}
        print(f"{name:16} |d NLL| per token: max {dd.max():.2e}, median {dd.median():.2e}")
    return out


if __name__ == "__main__":
    main()
