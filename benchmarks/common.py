"""What every benchmark shares: where results go, how a run is recorded, the headline file."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HEADLINE = RESULTS / "headline.json"


def machine() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_record() -> dict:
    """Command line, machine and time of this run, stored next to every result."""
    return {
        "command": "python -m " + __import__("__main__").__spec__.name + " " + shlex.join(sys.argv[1:])
        if getattr(__import__("__main__"), "__spec__", None)
        else shlex.join(sys.argv),
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def merge_headline(figures: dict[str, float], path: Path = HEADLINE) -> None:
    """Merge ``"<bench>.<data-or-shape>.<format>.<metric>": number`` figures into the flat file."""
    cur = json.loads(path.read_text()) if path.is_file() else {}
    for k, v in figures.items():
        if len(k.split(".")) < 4:
            raise ValueError(f"headline key {k!r} is not <bench>.<data-or-shape>.<format>.<metric>")
        cur[k] = float(v)
    write_json(path, dict(sorted(cur.items())))
