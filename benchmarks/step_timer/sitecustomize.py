"""Per-step timings inside `vllm bench throughput`'s own engine (benchmarks.throughput --step-breakdown).

Why: the bench's tok/s says how much slower a format is, not where. Deriving a step's time from the difference of
two runs (decode-heavy minus prefill-heavy) is wrong on a VM whose speed drifts between minutes, and timing an
in-process LLM is not the bench's engine (no separate engine-core process spinning on the shared cores). So this
directory goes first on PYTHONPATH of the bench's subprocess only: Python imports this `sitecustomize` in every
process it starts (front end, engine core, worker), and where the worker imports the model runner and the attention
backends, their methods are wrapped with timers. One JSON line per executed step goes to $TKV_STEPLOG: the step's
wall and process-CPU milliseconds, its scheduled tokens and requests, and the time inside each wrapped part.
Without $TKV_STEPLOG it does nothing.
"""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

LOG = os.environ.get("TKV_STEPLOG")

# module -> (class or None for a module function, attribute, part name); "step" is the step itself
TARGETS = {
    "vllm.v1.worker.gpu_model_runner": [("GPUModelRunner", "execute_model", "step")],
    # vLLM's own CPU attention (auto, fp8): attention and its cache update are separate calls
    "vllm.v1.attention.backends.cpu_attn": [("CPUAttentionBackendImpl", "forward", "attention"),
                                            ("CPUAttentionBackendImpl", "do_kv_cache_update", "cache_update")],
    # ours: the attention layer's call (attention and cache update), then its C++ parts
    "vllm_temporalkv.vllm.backend": [("TemporalKVImpl", "forward", "attention")],
    "vllm_temporalkv.ops.cpu": [(None, "decode_attention", "decode_attention"), (None, "write_kv", "write_kv"),
                                (None, "_prefill", "prefill")],
}
_parts: dict[str, float] = {}


def _step_shape(args) -> tuple[int | None, int | None]:
    so = args[1] if len(args) > 1 else None  # execute_model(self, scheduler_output, ...)
    n = getattr(so, "num_scheduled_tokens", None)
    return getattr(so, "total_num_scheduled_tokens", None), (len(n) if isinstance(n, dict) else None)


def _wrap(owner, name: str, part: str) -> None:
    f = getattr(owner, name)

    def timed(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        r = f(*args, **kwargs)
        wall = time.perf_counter() - t0
        if part == "step":
            tokens, reqs = _step_shape(args)
            rec = {"pid": os.getpid(), "ms": round(wall * 1e3, 3),
                   "cpu_ms": round((time.process_time() - c0) * 1e3, 3), "tokens": tokens, "reqs": reqs,
                   **{k: round(v * 1e3, 3) for k, v in _parts.items()}}
            _parts.clear()
            with open(LOG, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        else:
            _parts[part] = _parts.get(part, 0.0) + wall
        return r

    setattr(owner, name, timed)


class _Finder(importlib.abc.MetaPathFinder):
    """Lets the target modules load as usual, then wraps their methods."""

    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(mod):
            load(mod)
            for cls, attr, part in TARGETS[name]:
                owner = mod if cls is None else getattr(mod, cls, None)
                if owner is not None and callable(getattr(owner, attr, None)):
                    _wrap(owner, attr, part)

        spec.loader.exec_module = exec_module
        return spec


if LOG:
    sys.meta_path.insert(0, _Finder())
