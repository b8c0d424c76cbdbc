"""How the kernel benchmarks time a step: on a GPU from CUDA graphs behind an L2 flush (GpuTimer, benchmarks/kernels),
on the CPU by wall clock behind a cache flush (CpuTimer, benchmarks/kernels_cpu); and the copy bandwidth each
compares against."""

from __future__ import annotations

import statistics
import sys
import time

import torch

L2_FLUSH_BYTES = 256 << 20


class GpuTimer:
    """Median time (ms) of fn.  GPU: each run behind an L2 flush, from a CUDA graph when it can be
    captured.  Otherwise (smoke, interpreter): wall clock, meaningless for performance."""

    def __init__(self, device, reps: int, warmup: int, graph: bool):
        from vllm_temporalkv.ops import triton_encode  # imported once TRITON_INTERPRET is decided (kernels.main)

        self.cuda = device.type == "cuda" and not triton_encode.INTERPRET
        self.reps, self.warmup, self.graph = reps, warmup, graph and self.cuda
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if self.cuda else None
        self.mode = ("cuda-graph" if self.graph else "cuda-events") + "+l2-flush" if self.cuda else "wall-clock"
        self.fallbacks = 0

    def __call__(self, fn) -> float:
        if not self.cuda:
            fn()  # compile / warm caches
            ts = []
            for _ in range(self.reps):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
            return statistics.median(ts)
        fn()  # compile, fill the kernels' per-device caches (codec params, RoPE tables)
        torch.cuda.synchronize()
        run, g = fn, None
        if self.graph:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                run = g.replay
            except RuntimeError as e:  # not capturable: time it eagerly (counted in the report)
                print(f"  (CUDA graph capture failed, timing eagerly: {e})", file=sys.stderr)
                self.fallbacks += 1
                torch.cuda.synchronize()
        for _ in range(self.warmup):
            self.flush.zero_()
            run()
        start = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(self.reps):
            self.flush.zero_()  # also keeps the GPU busy while the host enqueues the step
            start[i].record()
            run()
            end[i].record()
        torch.cuda.synchronize()
        del g
        return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def copy_bandwidth(timer: GpuTimer, device, nbytes: int) -> float:
    """Device copy bandwidth, GB/s: (bytes read + written) / time of one large tensor copy."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = timer(lambda: y.copy_(x))
    del x, y
    return 2 * nbytes / (ms * 1e-3) / 1e9


class CpuTimer:
    """Wall-clock median (ms) of fn: warm-up runs, then up to ``reps`` runs, each after writing a
    flush buffer (so the measured run reads its data from memory, as a layer does in serving), and
    no more than ``budget_s`` seconds of runs unless fewer than ``min_reps``."""

    def __init__(self, reps: int, warmup: int, flush_bytes: int, budget_s: float, min_reps: int):
        self.reps, self.warmup, self.budget_s, self.min_reps = reps, warmup, budget_s, min_reps
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8) if flush_bytes else None
        self.mode = f"wall-clock, {flush_bytes >> 20} MiB flush" if flush_bytes else "wall-clock, no flush"
        self._i = 0

    def _flush(self):
        if self.flush is not None:
            self._i += 1
            self.flush.fill_(self._i & 0x7F)

    def __call__(self, fn) -> dict:
        t0 = time.perf_counter()
        for _ in range(max(1, self.warmup)):
            self._flush()
            t = time.perf_counter()
            fn()
            first = time.perf_counter() - t
            if time.perf_counter() - t0 > self.budget_s:
                break
        n = max(self.min_reps, min(self.reps, int(self.budget_s / max(first, 1e-6))))
        ts = []
        for _ in range(n):
            self._flush()
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return dict(ms=statistics.median(ts), min_ms=min(ts), reps=n)


def bandwidth(nbytes: int, reps: int) -> dict:
    """STREAM-like copy: (bytes read + bytes written) / time of a large uint8 tensor copy (torch's
    parallel copy, all threads; write-allocate traffic not counted, as STREAM); and a read-only float32
    sum of the same bytes."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    t = CpuTimer(max(3, reps), 1, 0, 30.0, 3)
    copy = t(lambda: y.copy_(x))
    read = t(lambda: x.sum())
    return dict(copy_gbps=2 * nbytes / (copy["ms"] * 1e-3) / 1e9, read_gbps=nbytes / (read["ms"] * 1e-3) / 1e9,
                copy_bytes=nbytes, copy_ms=copy["ms"], read_ms=read["ms"])
