"""Artifacts for tests and benchmarks: every tensor of an artifact file, and random artifacts shaped for a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def load_all(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor and the metadata of a safetensors file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def synthetic_artifact(model: str, formats: list[str], path: Path) -> Path:
    """Random codebooks and channel statistics shaped for ``model`` (speed only: the GPU box runs
    dummy-weight models, which calibration cannot serve).  K of layer 0 is channel-chunked in the
    hybrid formats, as calibrations here choose; every other layer is temporal."""
    import torch

    from vllm_temporalkv.artifact import Artifact, model_fingerprint
    from vllm_temporalkv.calibration import codebook_keys
    from vllm_temporalkv.codecs import make_codec
    from vllm_temporalkv.codecs.quantizer import ChannelStats
    from vllm_temporalkv.formats import FORMATS, get_format, parse_codebook_key

    cfg = json.loads((Path(model) / "config.json").read_text())
    fp = model_fingerprint(cfg)
    H, D, L = fp["num_kv_heads"], fp["head_dim"], fp["num_layers"]
    ours = sorted({c for f in formats if f in FORMATS for c in get_format(f).calibrated_formats})
    g = torch.Generator().manual_seed(0)
    stats = {(i, kv): ChannelStats(torch.randn(H, D, generator=g) * 0.1, torch.rand(H, D, generator=g) + 0.5,
                                   -torch.ones(H, D) * 3, torch.ones(H, D) * 3) for i in range(L) for kv in "kv"}
    books = {(i, kv, key): torch.randn(make_codec(*parse_codebook_key(key)).codebook_shape(H, D), generator=g).half()
             for key in codebook_keys(ours) for i in range(L) for kv in "kv"}
    methods = {}
    for f in ours:
        fmt = get_format(f)
        methods[f] = {"k": (["channel"] + ["temporal"] * (L - 1)) if fmt.hybrid else [fmt.method] * L,
                      "v": [fmt.method] * L}
    art = Artifact(fp, ours, methods, {"data": "synthetic (random codebooks: speed only)"}, stats, books, {})
    path.parent.mkdir(parents=True, exist_ok=True)
    return art.save(path)
