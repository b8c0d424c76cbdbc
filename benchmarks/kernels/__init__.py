"""GPU benchmark of the Triton kernels: paged decode straight from the codes, and the fused encode.

    python -m benchmarks.kernels                         # H100: both shapes, the full grid
    python -m benchmarks.kernels --shape llama8b --batch 8 --context 32768 --formats temporalkv-2bit
    python -m benchmarks.kernels --smoke --out /tmp/k    # no GPU: interpreter check of the plumbing
    python -m benchmarks.kernels --device cpu ...        # the C++ CPU kernels: benchmarks/kernels_cpu

Decode (one query token per request, one layer): for each shape (``llama8b``: 32 query / 8 KV
heads, head_dim 128; ``smollm2``: 9 / 3, head_dim 64), batch B, context L and format, the time of
``triton_decode.paged_attention`` on pages full of random codes, against two baselines measured in
the same run on random K/V of the same B x L: torch SDPA on contiguous half-precision K/V, and a
simple fp16/bf16 *paged* flash-decoding Triton kernel (fp16_paged.py; the repo has none).  Each row also
gives the bytes the compressed kernel must read (codes, sinks and tail, outliers, centroids once,
...), the bandwidth that implies, and its fraction of the device's copy bandwidth measured once in
the run.  Before a configuration is timed, the kernel's output on a slice of it (the first
``--check-requests`` requests, up to ``--check-tokens`` tokens) is compared with
``reference.paged_attention``, and the baseline kernel with a float32 dense attention.

Encode: ``triton_encode.write_kv`` on an 8192-token prefill (one layer), tokens/s, and its cost
next to that layer's causal prefill attention (see ``bench_encode``); checked bit-exact against
``reference.write_kv`` on the prefill's first tokens.

Timing: median of ``--reps`` runs after ``--warmup``, each behind an L2 flush (a 256 MiB memset),
the step replayed from a CUDA graph (no Python launch overhead, as vLLM serves decode) unless
``--no-graph``.  Results: benchmarks/results/kernels.{json,md,png}; headline figures (B = 1 and 8
at 32k, and the encode overhead) are merged into headline.json under the device tag.

``--headline-from kernels.json``: recompute a stored report's headline figures and merge them (no run).

``--smoke`` (no GPU needed): runs one or two tiny configurations through the same code, in Triton's
interpreter when CUDA is absent, writes to ``--out`` (a temp dir by default, never
benchmarks/results) and merges no headline.  Its timings are meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ..common import add_smoke_args, apply_sizes
from ..kernel_common import DEFAULT_BLOCK_SIZE, SHAPES

DEFAULT_FORMATS = ["temporalkv-2bit", "temporalkv-1bit", "temporalkv-4bit"]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", choices=list(SHAPES), default=None, help="default: both (smoke: smollm2)")
    p.add_argument("--batch", nargs="+", type=int, default=None, help="default: 1 8 32 64 (smoke: 1 2)")
    p.add_argument("--context", nargs="+", type=int, default=None,
                   help="default: 4096 8192 32768 131072, each where memory fits (smoke: 64)")
    p.add_argument("--formats", nargs="+", default=None,
                   help=f"default: {' '.join(DEFAULT_FORMATS)}; a '-o1' suffix adds the 1%% outliers")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="the model's half dtype")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"compressed page size (default {DEFAULT_BLOCK_SIZE}; smoke: 16)")
    p.add_argument("--hybrid-k", action="store_true", help="K channel-chunked (the hybrid's channel layers)")
    p.add_argument("--reps", type=int, default=None, help="timed runs (default 100; smoke: 2)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-graph", action="store_true", help="time eager launches (Python overhead included)")
    p.add_argument("--check-requests", type=int, default=2)
    p.add_argument("--check-tokens", type=int, default=32768, help="context of the reference check")
    p.add_argument("--encode-tokens", type=int, default=None, help="prefill length (default 8192; smoke: 32; 0: skip)")
    p.add_argument("--encode-check-tokens", type=int, default=2048)
    p.add_argument("--copy-bytes", type=int, default=None, help="copy bandwidth tensor (default 1 GiB)")
    p.add_argument("--headroom-gib", type=float, default=2.0, help="GPU memory left free when sizing configurations")
    p.add_argument("--device-tag", default=None, help="headline key part (default: from the GPU name, e.g. h100)")
    p.add_argument("--seed", type=int, default=0)
    add_smoke_args(p, "tiny configurations through the same code; no GPU needed")
    if argv is None:
        argv = sys.argv[1:]
    if "--device" in argv:  # the CPU kernels have their own benchmark (wall clock, vLLM's CPU op)
        i = argv.index("--device")
        if argv[i + 1 : i + 2] == ["cpu"]:
            from .. import kernels_cpu

            return kernels_cpu.main(argv[:i] + argv[i + 2 :])
    if argv[:1] == ["--headline-from"]:  # the headline figures of a stored report, recomputed and merged
        from ..common import merge_headline
        from .report import headline_figures

        rep = json.loads(Path(argv[1]).read_text())
        merge_headline(headline_figures(rep))
        return rep
    a = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        sys.exit("benchmarks.kernels needs a CUDA GPU; use --smoke for an interpreter check of the plumbing")
    if a.smoke:
        if not cuda:
            os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernel modules are imported
        a.warmup = min(a.warmup, 1)
    small = dict(shape=["smollm2"], batch=[1, 2], context=[64], formats=["temporalkv-2bit"], block_size=16,
                 reps=1, encode_tokens=32, copy_bytes=8 << 20)
    full = dict(shape=list(SHAPES), batch=[1, 8, 32, 64], context=[4096, 8192, 32768, 131072],
                formats=DEFAULT_FORMATS, block_size=DEFAULT_BLOCK_SIZE, reps=100, encode_tokens=8192,
                copy_bytes=1 << 30)
    apply_sizes(a, full, small, "kernels-smoke-")
    a.headroom = int(a.headroom_gib * 2**30) if cuda else 0
    from .run import run  # imports triton and the kernel modules: after TRITON_INTERPRET is decided

    return run(a)
