"""Calibration: real text -> pre-RoPE K/V + Fisher weights -> k-means codebooks -> one artifact.

``run_calibration`` (and the ``temporalkv-calibrate`` / ``python -m calibrate`` command) needs the
``calibrate`` extra (transformers, gguf, fast-pytorch-kmeans, numba); serving does not.
"""

from .run import codebook_keys, hybrid_choice, run_calibration

__all__ = ["codebook_keys", "hybrid_choice", "run_calibration"]
