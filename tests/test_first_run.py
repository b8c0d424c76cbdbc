"""The README's first command, as a fresh machine sees it: `vllm-temporalkv serve` finds no calibration,
calibrates on first use (here kept CI-small), serves the OpenAI API, and reuses the artifact afterwards.
Plus the argument handling of that wrapper (vLLM's own parser reads the arguments) and how an artifact
that lacks a format is extended without losing what it holds.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_temporalkv.artifact import ENV_ARTIFACT, Artifact, default_artifact_path  # noqa: E402
from vllm_temporalkv.harness.server import free_port  # noqa: E402
from vllm_temporalkv import cli  # noqa: E402
from vllm_temporalkv.vllm import cli as vllm_cli  # noqa: E402

CI_SIZE = ["--calibrate-samples", "2", "--calibrate-seq-len", "256", "--calibrate-iters", "5"]


def fresh_model_dir(src: Path, dst: Path) -> Path:
    """The converted SmolLM2 folder's files, linked into a folder with no calibration in it (the
    artifact is written into <model folder>/temporalkv/: the cached model stays untouched)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).symlink_to(f.resolve())
    return dst


def wrapper_cmd() -> list[str]:
    script = Path(sys.executable).parent / "vllm-temporalkv"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "vllm_temporalkv.vllm.cli"]


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(predicate, proc, log: Path, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = predicate()
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(f"`vllm-temporalkv serve` exited with code {proc.returncode} before {what}; log:\n"
                        + log.read_text(errors="replace")[-6000:])
        time.sleep(1)
    stop(proc)
    pytest.fail(f"no {what} after {timeout} s; log:\n" + log.read_text(errors="replace")[-6000:])


def launch(model: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in (ENV_ARTIFACT, "VLLM_CPU_KVCACHE_SPACE")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    cmd = [*wrapper_cmd(), "serve", str(model), "--kv-cache-dtype", "temporalkv-2bit", "--served-model-name",
           "smollm2", *CI_SIZE, "--host", "127.0.0.1", "--port", str(port), *extra]
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    f.close()
    return proc, port


def models_answer(port: int):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# end to end


def test_first_run_calibrates_serves_and_reuses(tmp_path, smollm2_dir):
    openai = pytest.importorskip("openai")
    model = fresh_model_dir(Path(smollm2_dir), tmp_path / "smollm2")
    artifact = default_artifact_path(model)
    assert not artifact.exists()
    log = tmp_path / "first.log"
    t0 = time.time()
    proc, port = launch(model, log, "--enforce-eager")
    try:
        # ~3 min on an idle 2-core machine (calibration ~1.5 min, server start); generous for busy ones
        models = wait_for(lambda: models_answer(port), proc, log, 1200, "answer on /v1/models")
        assert [m["id"] for m in models["data"]] == ["smollm2"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300)
        r = client.chat.completions.create(model="smollm2", max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": "Say hello."}])
        assert r.choices[0].message.content.strip()
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    print(f"first run: {time.time() - t0:.0f} s to an answer and shutdown")
    assert "no calibration for temporalkv-2bit" in text and "calibrating now (2 x 256 tokens" in text, text[-4000:]
    assert "calibrated temporalkv-2bit in" in text
    art = Artifact.load(artifact)
    assert "temporalkv-2bit" in art.formats
    assert (art.calibration["num_samples"], art.calibration["seq_len"], art.calibration["iters"]) == (2, 256, 5)
    assert art.calibration["first_use"]

    # a second start reuses it: the wrapper decides before vLLM starts, so stop once vLLM is under way
    log2 = tmp_path / "second.log"
    proc, port = launch(model, log2)
    try:
        wait_for(lambda: "not recalibrating" in log2.read_text(errors="replace"), proc, log2, 600,
                 "reuse message")
    finally:
        stop(proc)
    text2 = log2.read_text(errors="replace")
    assert f"using calibration artifact {artifact}" in text2 and "calibrating now" not in text2
    assert Artifact.load(artifact).calibration["created"] == art.calibration["created"]


# ---------------------------------------------------------------------------------------------
# the wrapper's decisions (vLLM's parser, no server)


@pytest.fixture(scope="module")
def parser():
    return vllm_cli.serve_parser()


def plan(parser, args, tmp_model, environ=None, cuda=False):
    return cli.plan_serve(args, parser=parser, environ=environ or {}, cuda=cuda, resolve=lambda _: tmp_model)


@pytest.fixture
def model_dir(tmp_path, smollm2_dir):
    return fresh_model_dir(Path(smollm2_dir), tmp_path / "m")


def test_strip_our_options():
    args, size, auto = cli.strip_our_options(
        ["--port", "8001", "--calibrate-samples", "3", "--calibrate_seq_len=128", "--no-auto-calibrate",
         "--calibrate-iters=7", "--max-model-len", "2048"])
    assert args == ["--port", "8001", "--max-model-len", "2048"]
    assert size == {"num_samples": 3, "seq_len": 128, "iters": 7} and auto is False
    with pytest.raises(cli.UsageError, match="positive whole number"):
        cli.strip_our_options(["--calibrate-samples", "x"])
    with pytest.raises(cli.UsageError, match="needs a value"):
        cli.strip_our_options(["--calibrate-iters"])


def test_default_model(parser, model_dir):
    p = plan(parser, ["--port", "8001"], model_dir)
    assert p.default_model and p.model_dir == model_dir
    assert p.args == [str(model_dir), "--port", "8001", "--served-model-name", "smollm2",
                      "--kv-cache-dtype", "temporalkv-2bit"]
    assert p.kv_cache_dtype == "temporalkv-2bit" and p.size == cli.FIRST_USE and p.auto_calibrate
    assert p.env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    ns = parser.parse_args(["serve", *p.args])  # vLLM reads what the wrapper hands it
    assert (ns.model_tag, ns.served_model_name, ns.kv_cache_dtype, ns.port) == (
        str(model_dir), ["smollm2"], "temporalkv-2bit", 8001)
    assert cli.decide_calibration(p).action == "calibrate"
    # what the user gave is kept
    p = plan(parser, ["--served-model-name", "mine", "--kv_cache_dtype=auto", "--kv-cache-memory-bytes", "1G"],
             model_dir, environ={})
    assert p.args == [str(model_dir), "--served-model-name", "mine", "--kv_cache_dtype=auto",
                      "--kv-cache-memory-bytes", "1G"]
    assert p.kv_cache_dtype == "auto" and p.env == {} and cli.decide_calibration(p).action == "skip"
    assert plan(parser, [], model_dir, environ={"VLLM_CPU_KVCACHE_SPACE": "4"}).env == {}
    assert plan(parser, [], model_dir, cuda=True).env == {}
    # "smollm2" as the model is the embedded one
    for args in (["--enforce-eager", "smollm2", "--port", "1"], ["--model", "smollm2"], ["--model=smollm2"]):
        p = plan(parser, args, model_dir)
        assert p.default_model and p.model_dir == model_dir, args
        ns = parser.parse_args(["serve", *p.args])
        assert ns.model_tag == str(model_dir) and ns.served_model_name == ["smollm2"], args


def test_explicit_model(parser, model_dir, tmp_path):
    for args in (["--enforce-eager", str(model_dir), "--kv-cache-dtype", "temporalkv-1bit", "--port", "9"],
                 ["--port", "9", f"--model={model_dir}", "--kv-cache-dtype=temporalkv-1bit"],
                 ["--model", str(model_dir), "--kv_cache_dtype", "temporalkv-1bit", *CI_SIZE]):
        p = plan(parser, args, tmp_path / "not-this")
        assert not p.default_model and p.model_dir == model_dir and p.kv_cache_dtype == "temporalkv-1bit", args
        assert p.args == [a for a in args if a not in CI_SIZE], args
        assert "--served-model-name" not in p.args
        d = cli.decide_calibration(p)
        assert d.action == "calibrate" and d.path == default_artifact_path(model_dir) and d.formats == ["temporalkv-1bit"]
    assert plan(parser, [str(model_dir), *CI_SIZE], tmp_path).size == {"num_samples": 2, "seq_len": 256, "iters": 5}
    # not ours, not local, or the artifact named explicitly: nothing to calibrate here
    assert cli.decide_calibration(plan(parser, [str(model_dir), "--kv-cache-dtype", "fp8"], tmp_path)).action == "skip"
    p = plan(parser, ["org/model", "--kv-cache-dtype", "temporalkv-2bit"], tmp_path)
    assert p.model_dir is None and cli.decide_calibration(p).action == "skip"
    p = plan(parser, [str(model_dir), "--kv-cache-dtype", "temporalkv-2bit", "--additional-config",
                      json.dumps({"temporalkv_artifact": "/x.safetensors"})], tmp_path)
    assert p.explicit_artifact == "/x.safetensors" and cli.decide_calibration(p).action == "skip"
    p = plan(parser, [str(model_dir), "--kv-cache-dtype", "temporalkv-2bit"], tmp_path, environ={ENV_ARTIFACT: "/y"})
    assert cli.decide_calibration(p).action == "skip"
    p = plan(parser, [str(model_dir), "--kv-cache-dtype", "temporalkv-2bit", "--no-auto-calibrate"], tmp_path)
    assert not p.auto_calibrate and cli.decide_calibration(p).action == "skip"


def test_second_embedded_model_and_gguf_paths(parser, model_dir, tmp_path):
    from vllm_temporalkv.models import ModelError

    asked = []

    def resolve(spec):
        asked.append(spec)
        return model_dir

    def plan_(args):
        return cli.plan_serve(args, parser=parser, environ={}, cuda=False, resolve=resolve)

    # the second embedded model by name: fetched / converted (here: resolve), served under its name
    for args in (["qwen2.5-coder-1.5b", "--kv-cache-dtype", "temporalkv-2bit"],
                 ["--model", "qwen2.5-coder-1.5b", "--kv-cache-dtype", "temporalkv-2bit"],
                 ["--kv-cache-dtype=temporalkv-2bit", "--model=qwen2.5-coder-1.5b"]):
        asked.clear()
        p = plan_(args)
        assert asked == ["qwen2.5-coder-1.5b"], args
        assert p.embedded == "qwen2.5-coder-1.5b" and not p.default_model and p.model_dir == model_dir, args
        ns = parser.parse_args(["serve", *p.args])
        assert ns.model_tag == str(model_dir) and ns.served_model_name == ["qwen2.5-coder-1.5b"], args
        assert ns.kv_cache_dtype == "temporalkv-2bit", args
        assert cli.decide_calibration(p).action == "calibrate", args
    assert parser.parse_args(["serve", *plan_(["qwen2.5-coder-1.5b", "--served-model-name", "q"]).args]
                             ).served_model_name == ["q"]

    # a .gguf file: served from its converted folder, under the name it was given
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    for args in ([str(gguf), "--kv-cache-dtype", "temporalkv-2bit"], ["--model", str(gguf)], [f"--model={gguf}"]):
        asked.clear()
        p = plan_(args)
        assert asked == [gguf] and p.gguf == gguf and p.embedded is None and p.model_dir == model_dir, args
        ns = parser.parse_args(["serve", *p.args])
        assert ns.model_tag == str(model_dir) and ns.served_model_name == [str(gguf)], args
    # a fetch or conversion that fails is the wrapper's to say (vLLM would only see a missing model)
    def fails(spec):
        raise ModelError("part 3 of 22 of X is missing: could not download ...")

    with pytest.raises(cli.UsageError, match="part 3 of 22 of X is missing"):
        cli.plan_serve(["qwen2.5-coder-1.5b"], parser=parser, environ={}, cuda=False, resolve=fails)


def test_gguf_path_resolves_to_its_converted_folder(parser, smollm2_dir):
    """The real resolution of SmolLM2's own GGUF (installed; converted already by the smollm2_dir fixture)."""
    from vllm_temporalkv.models import smollm2_gguf

    gguf = smollm2_gguf()
    p = cli.plan_serve([str(gguf), "--kv-cache-dtype", "temporalkv-2bit"], parser=parser, environ={}, cuda=False)
    assert p.gguf == gguf and p.model_dir == Path(smollm2_dir)
    assert p.args == [str(smollm2_dir), "--kv-cache-dtype", "temporalkv-2bit", "--served-model-name", str(gguf)]


def test_reuse_extend_and_leave_alone(parser, model_dir, tiny_artifact, tmp_path):
    from vllm_temporalkv.calibration.run import extend_artifact

    path = default_artifact_path(model_dir)
    path.parent.mkdir()
    shutil.copy(tiny_artifact, path)
    old = Artifact.load(path)
    assert "temporalkv-2bit" in old.formats and "channelkv-1bit" not in old.formats
    d = cli.decide_calibration(plan(parser, [str(model_dir), "--kv-cache-dtype", "temporalkv-2bit"], tmp_path))
    assert d.action == "reuse"
    # a mixed format is served from its parts: all there, nothing to calibrate
    d = cli.decide_calibration(plan(parser, [str(model_dir), "--kv-cache-dtype", "temporalkv-2bit-mixed"], tmp_path))
    assert d.action == "reuse"
    d = cli.decide_calibration(plan(parser, [str(model_dir), "--kv-cache-dtype", "channelkv-1bit"], tmp_path))
    assert d.action == "extend" and d.formats == old.formats + ["channelkv-1bit"]
    # extending keeps every format, statistic and codebook it had, with the settings it records
    art = extend_artifact(path, ["channelkv-1bit"], model=str(model_dir), progress=False, log=lambda *a: None)
    new = Artifact.load(path, formats=old.formats + ["channelkv-1bit"])
    assert new.formats == old.formats + ["channelkv-1bit"] and art.formats == new.formats
    for key, c in old.codebooks.items():
        assert new.codebooks[key].equal(c)
    for key, s in old.stats.items():
        assert new.stats[key].mean.equal(s.mean) and new.stats[key].hi.equal(s.hi)
    assert {k: new.layer_methods[k] for k in old.formats} == old.layer_methods
    assert old.cost and all(new.cost[k].equal(c) for k, c in old.cost.items())  # the mix's loss estimates survive
    assert new.calibration["extended"][0]["formats"] == ["channelkv-1bit"]
    assert not list(path.parent.glob("*.extend*"))
    # an artifact for another model is left alone (vLLM refuses it, naming the fix)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (model_dir / "config.json").unlink()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    d = cli.decide_calibration(plan(parser, [str(model_dir), "--kv-cache-dtype", "temporalkv-4bit"], tmp_path))
    assert d.action == "skip" and "another model" in d.reason


def test_missing_calibration_extra_names_the_install(parser, model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(cli.first_use, "CALIBRATE_EXTRA", ("transformers", "surely_not_installed_pkg"))
    p = plan(parser, [str(model_dir), "--kv-cache-dtype", "temporalkv-2bit"], tmp_path)
    with pytest.raises(cli.UsageError, match=r"pip install 'vllm-temporalkv\[calibrate\]'"):
        cli.run_first_use(p, cli.decide_calibration(p))


def test_cpu_tuning(parser, model_dir):
    """On a small CPU without bf16 units, `serve` runs the model in float32 on every core - unless the
    user chose a dtype / a core binding; a GPU machine is left alone."""
    p = cli.ServePlan(args=[])
    cli.tune(p, [], {}, bf16_units=False, cpus=[0, 1])
    assert p.tuned_args == ["--dtype", "float32"]
    assert p.tuned_env == {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                           "GOMP_SPINCOUNT": "20000"}
    assert len(p.tuned_why) == 2 and "--dtype bfloat16 to override" in p.tuned_why[1]
    p = cli.ServePlan(args=[])  # the user's own OpenMP wait policy stays
    cli.tune(p, [], {"OMP_WAIT_POLICY": "active"}, bf16_units=True, cpus=[0, 1])
    assert p.tuned_env == {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    p = cli.ServePlan(args=[])
    cli.tune(p, ["--dtype=bfloat16"], {"VLLM_CPU_OMP_THREADS_BIND": "0"}, bf16_units=False, cpus=[0, 1])
    assert p.tuned_args == [] and p.tuned_env == {} and p.tuned_why == []
    p = cli.ServePlan(args=[])
    cli.tune(p, [], {}, bf16_units=True, cpus=list(range(8)))
    assert p.tuned_args == [] and p.tuned_env == {}
    # what serve hands vLLM parses, and keeps the user's choice
    p = plan(parser, ["--dtype", "bfloat16"], model_dir)
    assert p.tuned_args == []
    p = plan(parser, [], model_dir)
    ns = parser.parse_args(["serve", *p.args, *p.tuned_args])
    assert ns.dtype == (p.tuned_args[1] if p.tuned_args else "auto")
    assert plan(parser, [], model_dir, cuda=True).tuned_args == []
