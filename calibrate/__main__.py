"""``python -m calibrate`` from a checkout: the same as the ``temporalkv-calibrate`` command."""

import sys

from vllm_temporalkv.calibration.cli import main

if __name__ == "__main__":
    sys.exit(main())
