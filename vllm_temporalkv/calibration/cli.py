"""``python -m calibrate`` / ``temporalkv-calibrate``: write a calibration artifact for a model."""

from __future__ import annotations

import argparse
import sys

from ..formats import calibrated_formats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="temporalkv-calibrate",
        description="Fit TemporalKV / ChannelKV / KVQuant codebooks for a model and write one "
        ".safetensors artifact (Fisher-weighted k-means on pre-RoPE K and V).",
    )
    p.add_argument("--model", default=None,
                   help="HF hub id, local HF folder, .gguf file, or an embedded model: smollm2 (the default, "
                        "SmolLM2-135M-Instruct) | qwen2.5-coder-1.5b (Qwen2.5-Coder-1.5B-Instruct, fetched once)")
    p.add_argument("--data", default="wiki-leads",
                   help="calibration text: wiki-leads | brown | austen | a .txt file or folder | hf:<dataset>[:config[:split]]")
    p.add_argument("--formats", nargs="+", default=["all"], metavar="FORMAT",
                   help=f"formats to fit (default all): {' '.join(calibrated_formats())}; a mixed format "
                        "(temporalkv-2bit-mixed) or K/V pair (temporalkv-k4v2) fits its parts")
    p.add_argument("--num-samples", type=int, default=None,
                   help="calibration windows (default: 64 on a GPU as in the thesis, 8 on the CPU)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--iters", type=int, default=50, help="Lloyd iterations (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fisher", action="store_true",
                   help="plain (unweighted) k-means: the thesis's Fisher ablation")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--attention", default="eager", choices=["eager", "sdpa"],
                   help="the model's attention while collecting K / V (default eager, as the thesis measured; "
                        "sdpa: ~3.5x faster windows on the CPU, the same K / V to ~1e-5, not bit-identical codebooks)")
    p.add_argument("--low-memory", action="store_true",
                   help="collect with each decoder layer checkpointed and the LM loss 256 tokens at a time: a "
                        "2048-token window of qwen2.5-coder-1.5b peaks at 9.8 GB (the float32 model is 7.5 GB) "
                        "instead of ~21 GB (11.1 GB at 512 tokens); 1.0-1.6x the collection time; the same K / V, "
                        "gradients equal to float rounding (bit-identical where measured); recorded in the artifact")
    p.add_argument("--rotate", default=None, choices=["keys", "values", "both"],
                   help="research: fit the key (pre-RoPE) and / or value codebooks on vectors rotated by a randomized "
                        "Hadamard matrix (codecs/rotation.py); the quality harness simulates such an artifact, the "
                        "server refuses it")
    p.add_argument("--output", "-o", default=None,
                   help="artifact path (default: temporalkv/calibration.safetensors inside the model folder)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..formats import FormatError

    from .run import run_calibration

    try:
        run_calibration(
            model=args.model, data=args.data, formats=args.formats, num_samples=args.num_samples,
            seq_len=args.seq_len, iters=args.iters, seed=args.seed, fisher=not args.no_fisher,
            device=args.device, attention=args.attention, low_memory=args.low_memory,
            rotation={kv: "hadamard" for kv in {"keys": "k", "values": "v", "both": "kv"}.get(args.rotate, "")},
            output=args.output,
            progress=not args.quiet,
        )
    except (FormatError, ValueError) as e:  # our errors name the problem and the fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
