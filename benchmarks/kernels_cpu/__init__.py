"""CPU benchmark of the C++ kernels (``vllm_temporalkv.ops.cpu``) against the torch path and vLLM's own
CPU attention on a bf16 cache (issue 13).

    python -m benchmarks.kernels_cpu                                   # the full grid, both shapes
    python -m benchmarks.kernels_cpu --shapes llama8b --batch 8 --context 8192 --formats temporalkv-2bit
    python -m benchmarks.kernels_cpu --smoke --out /tmp/kc             # tiny configs: the plumbing (~30 s)

One layer, the step's attention only (the cache update is not timed).  For each shape (``llama8b``:
32 query / 8 KV heads, head_dim 128; ``smollm2``: 9 / 3, head_dim 64):

* **decode** (one query token per request) at batch B and context L (``--batch``, ``--context``;
  default B in {1, 8}, L in {2k, 8k, 32k}); each request sees L tokens (L - 1 cached + its new one);
* **prefill**: one request's chunk of Q queries at offset O (``--prefill Q@O``, default 2048@6144:
  it attends to O cached tokens and causally to itself).

Timed side by side in the same run, on caches of the same B x L:

* ``cpp``: ``ops.cpu.paged_attention(..., batch_invariant=False)`` (what the vLLM backend calls on the
  CPU; decode goes to the fused C++ kernel straight from the codes, a prefill chunk to the torch
  attention on K/V gathered by the C++ decoder) on pages full of random codes (``kernel_common.fill_pages``);
* ``torch``: ``ops.paged_torch.paged_attention(..., batch_invariant=False)``, the float32 serving path
  the C++ kernels replace, on the same pages;
* ``vllm_bf16``: vLLM's CPU attention op, ``torch.ops._C.cpu_attention_with_kv_cache``, called exactly
  as ``vllm/v1/attention/backends/cpu_attn.py`` calls it (through ``vllm._custom_ops``): a bf16 cache
  ``[num_blocks, Hkv, block_size, 2 D]`` viewed as K and V halves, vLLM's CPU block size (128), pages
  scattered by a random block table, scheduler metadata from ``cpu_attn_get_scheduler_metadata`` with
  the ISA vLLM's backend would pick (``_get_attn_isa``) and ``VLLM_CPU_ATTN_SPLIT_KV``.  The metadata is
  built once per configuration outside the timing (vLLM builds it once per step for all layers).  If
  the op is missing (a non-CPU vLLM build, no vLLM), the reason is recorded and the ratios use
  ``sdpa_bf16`` instead;
* ``sdpa_bf16`` (``--no-sdpa`` skips it): torch SDPA on dense contiguous bf16 K/V (decode: the GQ query
  heads of a KV head as GQ rows, exact GQA without K/V copies; prefill: causal with ``enable_gqa``).

Before a configuration is timed, the C++ output is compared with the torch path on a slice of it
(the first ``--check-requests`` requests at up to ``--check-tokens`` tokens; for the prefill, the first
``--check-queries`` queries of the chunk at the same offset), and vLLM's op with a float32 dense
attention on a small cache written by vLLM's own ``cpu_attn_reshape_and_cache``.  Each row gives the
bytes the step must read (codes, sinks and tail, outliers, centroids once, RoPE tables, queries and
new K/V) per cached token and in total, the GB/s that implies for the C++ kernel and for vLLM's bf16
op (all of K and V: 2 Hkv D 2 bytes per token), and both as fractions of a STREAM-like copy measured
in the same run (``(bytes read + bytes written) / time`` of a ``--copy-mib`` tensor copy; a read-only
sum is recorded too).

Timing: wall clock, median of up to ``--reps`` runs after ``--warmup``, each behind a cache flush
(writing ``--flush-mib``, default twice the L3: in serving, the other layers evict a layer's cache
between two of its steps); slow paths (the torch path at long contexts) stop at ``--budget-s`` seconds
per measurement, never under ``--min-reps`` runs.  All torch threads (recorded with the CPU model,
its SIMD flags and the C++ kernel variant ``ops.cpu.isa()``).

Results: ``benchmarks/results/kernels-cpu.{json,md,png}``; headline figures
``kernels.cpu.<b{B}-l{L} | smollm2-b{B}-l{L} | prefill{Q}-at{O} | smollm2-prefill{Q}-at{O}>.<format>.
speedup_vs_vllm`` and ``.speedup_vs_torch`` for the formats in HEADLINE_FORMATS at HEADLINE_POINTS
and the prefill, merged into headline.json.  ``--smoke``: tiny configurations through the same code,
written to ``--out`` (a temp dir by default, never benchmarks/results), no headline; timings meaningless.
"""


from __future__ import annotations

import argparse

from ..common import add_smoke_args, apply_sizes
from ..kernel_common import DEFAULT_BLOCK_SIZE, SHAPES, parse_format
from .config import DEFAULT_FORMATS, DEFAULT_PREFILL, DTYPES, VLLM_BLOCK_SIZE, l3_bytes


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels_cpu", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None, help="default: both (smoke: smollm2)")
    p.add_argument("--batch", nargs="+", type=int, default=None, help="decode batch sizes (default 1 8; smoke: 1 2)")
    p.add_argument("--context", nargs="+", type=int, default=None,
                   help="decode contexts (default 2048 8192 32768; smoke: 100)")
    p.add_argument("--prefill", default=None,
                   help=f"prefill chunk Q@OFFSET (default {DEFAULT_PREFILL}; smoke: 24@40; 'none': skip)")
    p.add_argument("--formats", nargs="+", default=None,
                   help=f"default: {' '.join(DEFAULT_FORMATS)}; a '-o1' suffix adds the 1%% outliers")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"compressed page size (default {DEFAULT_BLOCK_SIZE}; smoke: 16)")
    p.add_argument("--vllm-block-size", type=int, default=VLLM_BLOCK_SIZE, help="vLLM cache block size")
    p.add_argument("--hybrid-k", action="store_true", help="K channel-chunked (the hybrid's channel layers)")
    p.add_argument("--reps", type=int, default=None, help="timed runs at most (default 30; smoke: 2)")
    p.add_argument("--min-reps", type=int, default=None, help="timed runs at least (default 3; smoke: 1)")
    p.add_argument("--warmup", type=int, default=None, help="default 3 (smoke: 1)")
    p.add_argument("--budget-s", type=float, default=20.0, help="seconds of timed runs per measurement, about")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--check-requests", type=int, default=2)
    p.add_argument("--check-tokens", type=int, default=2048, help="context of the decode checks")
    p.add_argument("--check-queries", type=int, default=128, help="prefill queries in the checks")
    p.add_argument("--flush-mib", type=int, default=None, help="cache flush between runs (default 2 x L3; 0: none)")
    p.add_argument("--copy-mib", type=int, default=None, help="copy bandwidth tensor (default 1024; smoke: 16)")
    p.add_argument("--no-torch-path", dest="torch_path", action="store_false", help="skip timing the torch path")
    p.add_argument("--no-sdpa", dest="sdpa", action="store_false", help="skip SDPA on dense K/V")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                   help="model dtype of both caches (f32: what serves fastest on CPUs without bf16 units); f32 "
                   "results go to kernels-cpu-f32.*, headline keys kernels.cpu.f32-...speedup_vs_vllm_f32")
    p.add_argument("--seed", type=int, default=0)
    add_smoke_args(p, "tiny configurations through the same code")
    a = p.parse_args(argv)

    small = dict(shapes=["smollm2"], batch=[1, 2], context=[100], prefill="24@40", formats=["temporalkv-2bit"],
                 block_size=16, reps=2, min_reps=1, warmup=1, flush_mib=4, copy_mib=16)
    full = dict(shapes=list(SHAPES), batch=[1, 8], context=[2048, 8192, 32768], prefill=DEFAULT_PREFILL,
                formats=DEFAULT_FORMATS, block_size=DEFAULT_BLOCK_SIZE, reps=30, min_reps=3, warmup=3,
                flush_mib=max(64, 2 * l3_bytes() >> 20), copy_mib=1024)
    apply_sizes(a, full, small, "kernels-cpu-smoke-")
    if a.prefill in ("none", "0", ""):
        a.prefill = None
    elif a.prefill and (a.prefill.count("@") != 1 or not all(x.isdigit() for x in a.prefill.split("@"))):
        p.error("--prefill takes Q@OFFSET, e.g. 2048@6144")
    a.flush_bytes, a.copy_bytes = a.flush_mib << 20, a.copy_mib << 20
    for f in a.formats:
        from vllm_temporalkv.formats import get_format

        get_format(parse_format(f)[0])  # fail early on a typo
    from .run import run

    return run(a)
