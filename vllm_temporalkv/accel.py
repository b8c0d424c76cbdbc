"""Whether this machine has a CUDA GPU, asked so that the process can still fork.

``torch.cuda.is_available()`` asks the CUDA runtime for its device count, and from then on torch refuses CUDA in any
forked child ("Cannot re-initialize CUDA in forked subprocess").  vLLM starts its engine core by fork unless CUDA is
already *initialized* (``torch.cuda.is_initialized()``, still False after that query), so a process that merely asked
and then built an engine crashed on the GPU: our ``vllm-temporalkv`` wrapper did, and so did the GPU oracle harness
(found on the H100, 2026-11-26).  NVML answers the same question without touching the CUDA runtime; torch uses it
when ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (and falls back to the runtime where NVML is missing, e.g. CPU-only hosts,
where forking CUDA is moot).  Code that will use the GPU itself (calibration, kernels) needs none of this.
"""

from __future__ import annotations

import os

_NVML = "PYTORCH_NVML_BASED_CUDA_CHECK"


def has_cuda() -> bool:
    """A CUDA GPU is visible to torch; asked through NVML, so the caller can still fork a CUDA child."""
    import torch

    old = os.environ.get(_NVML)
    os.environ[_NVML] = "1"  # torch reads it on every call
    try:
        return torch.cuda.is_available()
    finally:
        if old is None:
            os.environ.pop(_NVML, None)
        else:
            os.environ[_NVML] = old
