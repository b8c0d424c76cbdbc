import os
import tempfile

import pytest
import torch

# tests never reach the HF hub; vLLM (server tests) must not phone home either
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# One vLLM cache root for the whole run, inherited by every server and benchmark it starts (harness.server.VLLMServer
# made a fresh one per server): in a fresh root each server inspects the model's architecture again, ~8 s of a ~33 s
# start on a 2-core AMD EPYC, and a run starts ~25 servers and engines.  A user's servers share ~/.cache/vllm the
# same way.  The root is new per run (nothing is carried between runs); the one compiled server of the default run
# has no twin whose torch.compile cache it could pick up.
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="tkv-tests-vllm-cache-"))
# Triton's interpreter must be chosen before anything imports triton (vLLM does, and several test
# modules import vLLM at collection): without a GPU the Triton kernels' tests run interpreted
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")



def _machine_line() -> str:
    from vllm_temporalkv.cpu_isa import cpu_class, simd_flags
    from vllm_temporalkv.cpu_tuning import default_dtype

    return (f"cpu class: {cpu_class()} ({' '.join(simd_flags())}); {os.cpu_count()} CPUs; "
            f"served model dtype by default: {default_dtype() or 'bfloat16'}")


# The CPU class and SIMD flags head and close every run's output (the closing line survives `-q`): numeric
# bounds and kernel variants differ by class (AVX2 / AVX-512 / AVX512-BF16 / AMX), so a failure must name the
# machine it happened on.
def pytest_report_header(config):
    return [_machine_line()]


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the slow tier (tests marked slow; or set TKV_SLOW=1)")


def pytest_configure(config):
    # CI must stay under ~45 min on the slowest machine: every run lists its slowest tests, so that the log of each
    # landing says where the time goes (pass --durations=N to choose another count)
    if getattr(config.option, "durations", None) is None:
        config.option.durations = 25
        config.option.durations_min = 5.0
    config.addinivalue_line("markers", "slow: minutes of CPU each and covered in a cheaper form by the default run "
                                       "(a second opinion, not the only one); run with --runslow or TKV_SLOW=1")


def pytest_collection_modifyitems(config, items):
    # The slow tier: a 2-core AVX2-only VM took 85 min for the whole suite (2026-11-28) against CI's 90-min limit,
    # an AMX Xeon 46 min; these few tests were a third of it.  Each is skipped with its reason printed, never dropped
    # silently, and each names in its docstring what in the default run covers its claim.
    if config.getoption("--runslow") or os.environ.get("TKV_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow tier: run with --runslow (or TKV_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(_machine_line())


TINY_FORMATS = ["temporalkv-2bit", "channelkv-2bit", "kvquant-2bit", "temporalkv-4bit", "temporalkv-1bit"]  # + the mix


@pytest.fixture(scope="session")
def smollm2_dir():
    from vllm_temporalkv.models import resolve_model

    return resolve_model(None)


@pytest.fixture
def calibration_spy(monkeypatch):
    """The calibration's collections counted (``spy.calls``) and its fit stopped by KeyboardInterrupt at layer
    ``spy.stop`` (None: it runs through) - a run stopped and resumed."""
    import types

    from vllm_temporalkv.calibration import collect
    from vllm_temporalkv.calibration import run as calibrate

    real_fit, real_collect = calibrate.fit_layer, collect.collect_kv_grads
    spy = types.SimpleNamespace(calls=[], stop=None)

    def fit(layer, *a, **kw):
        if layer == spy.stop:
            raise KeyboardInterrupt
        return real_fit(layer, *a, **kw)

    def counting(*a, **kw):
        spy.calls.append(1)
        return real_collect(*a, **kw)

    monkeypatch.setattr(calibrate, "fit_layer", fit)
    monkeypatch.setattr(collect, "collect_kv_grads", counting)
    return spy


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, smollm2_dir):
    """A small but real calibration of SmolLM2: 2 windows x 256 tokens of Wikipedia leads."""
    from vllm_temporalkv.calibration import run_calibration

    out = tmp_path_factory.mktemp("calib") / "tiny.safetensors"
    run_calibration(model=str(smollm2_dir), formats=TINY_FORMATS, num_samples=2, seq_len=256,
                    iters=5, output=out, progress=False, log=lambda *a: None)
    return out
