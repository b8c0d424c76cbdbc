"""How ``vllm-temporalkv`` speaks: its own lines on stderr, and the error that stops ``serve`` before vLLM."""

from __future__ import annotations

import sys


def say(msg: str) -> None:
    print(f"vllm-temporalkv: {msg}", file=sys.stderr, flush=True)


class UsageError(ValueError):
    pass
