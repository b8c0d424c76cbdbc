"""The ``vllm-temporalkv`` command's own room: what ``serve`` does before vLLM starts (serve.py: the arguments and
defaults; first_use.py: calibration on first use; messages.py).  Imports no vLLM: vllm/cli.py is the entry point,
hands vLLM's parser in and runs vLLM's CLI after ``prepare_serve``."""

from __future__ import annotations

import os

from . import first_use
from .first_use import FIRST_USE, Decision, decide_calibration, estimate_seconds, run_first_use
from .messages import UsageError, say
from .serve import OUR_OPTIONS, ServePlan, plan_serve, strip_our_options, tune


def prepare_serve(args: list[str], parser) -> list[str]:
    """Everything `serve` does before vLLM (``parser``: vLLM's serve parser): -> the arguments for vLLM's `serve`."""
    try:
        plan = plan_serve(args, parser=parser)
    except UsageError:
        raise
    except (SystemExit, ValueError):  # vLLM's parser refuses these arguments: let it say why
        stripped, _, _ = strip_our_options(args)
        return stripped
    for k, v in {**plan.env, **plan.tuned_env}.items():
        os.environ.setdefault(k, v)
    if plan.env:
        say("no CUDA: " + " ".join(f"{k}={v}" for k, v in plan.env.items())
            + " (GiB of KV cache; set it, or --kv-cache-memory-bytes, for another size)")
    for why in plan.tuned_why:
        say(why)
    if plan.embedded:
        from ..models import EMBEDDED

        say(f"serving the embedded {EMBEDDED[plan.embedded].title} ({plan.model_dir}) with --kv-cache-dtype "
            f"{plan.kv_cache_dtype}")
    elif plan.gguf:
        say(f"serving {plan.gguf} from its bf16 conversion {plan.model_dir} with --kv-cache-dtype "
            f"{plan.kv_cache_dtype}")
    decision = decide_calibration(plan)
    if decision.action in ("calibrate", "extend"):
        run_first_use(plan, decision)
    elif decision.action == "reuse":
        c = decision.artifact.calibration
        say(f"{decision.reason}; calibrated on {c.get('num_samples')} x {c.get('seq_len')} tokens - "
            "not recalibrating")
    elif first_use._ours(plan.kv_cache_dtype):
        say(f"no calibration here: {decision.reason}")
    return plan.args + plan.tuned_args


__all__ = ["FIRST_USE", "OUR_OPTIONS", "Decision", "ServePlan", "UsageError", "decide_calibration", "estimate_seconds",
           "plan_serve", "prepare_serve", "run_first_use", "say", "strip_our_options", "tune"]
