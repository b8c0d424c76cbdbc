"""Regenerate every table and plot of the README from scratch.

    python -m benchmarks                 # calibrate (if needed), quality, served perplexity, capacity, retrieval, [kernels],
                                         # cpu kernels, stress, artifact fuzzing, README
    python -m benchmarks --only capacity retrieval
    python -m benchmarks --dry-run       # print the commands

Each step is the module's own command line with its defaults (run one alone for its options); the
results land in benchmarks/results/ and headline.json, and the README's results block is rewritten
from headline.json at the end. The kernel benchmark runs only where a CUDA GPU is present; the
throughput tables come from the GPU box (benchmarks/throughput.py, see its docstring).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STEPS = {
    # name: (command after `python -m`, needs a GPU)
    "calibrate-unweighted": (["calibrate", "--no-fisher", "--output", "runs/smollm2-unweighted.safetensors"], False),
    "quality": (["benchmarks.quality", "--ablation-artifact", "runs/smollm2-unweighted.safetensors"], False),
    "served-ppl": (["benchmarks.served_ppl"], False),
    "capacity": (["benchmarks.capacity"], False),
    "retrieval": (["benchmarks.retrieval"], False),
    "kernels": (["benchmarks.kernels"], True),
    "kernels-cpu": (["benchmarks.kernels_cpu"], False),
    "encode-cpu": (["benchmarks.encode_cpu"], False),
    "batch-variance": (["benchmarks.batch_variance"], False),
    "stress": (["benchmarks.stress"], False),
    "stress-parallel": (["benchmarks.stress", "--parallel", "pp2", "tp3"], False),
    "artifact-fuzz": (["benchmarks.artifact_fuzz"], False),
    "readme": (["benchmarks.readme"], False),
}


def _full_calibration(path: Path) -> bool:
    """The default artifact exists and is a full calibration of every format (not the small one
    `vllm-temporalkv serve` makes on first use)."""
    from vllm_temporalkv.artifact import Artifact, ArtifactError
    from vllm_temporalkv.formats import calibrated_formats

    try:
        art = Artifact.load(path)
    except ArtifactError:
        return False
    # the formats with codebooks of their own (the calibration-free ones, mixes and K/V pairs never have any)
    return not art.calibration.get("first_use") and set(calibrated_formats()) <= set(art.formats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(STEPS), default=None)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)

    import torch

    from vllm_temporalkv.models import resolve_model

    steps = args.only or list(STEPS)
    cmds = []
    default_artifact = resolve_model(None) / "temporalkv" / "calibration.safetensors"
    if not _full_calibration(default_artifact) and any(s in steps for s in ("quality", "served-ppl", "capacity", "retrieval")):
        cmds.append(("calibrate", [sys.executable, "-m", "calibrate"]))
    for name in steps:
        cmd, gpu = STEPS[name]
        if gpu and not torch.cuda.is_available():
            print(f"skipping {name}: needs a CUDA GPU")
            continue
        if name == "calibrate-unweighted" and (ROOT / cmd[-1]).is_file():
            continue
        cmds.append((name, [sys.executable, "-m", *cmd]))
    for name, cmd in cmds:
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        if not args.dry_run:
            subprocess.run(cmd, cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
