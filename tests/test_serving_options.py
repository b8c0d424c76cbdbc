"""The plugin's serving options (--additional-config / environment): misspelt keys and values are errors that
name the option and the fix, never a silent default (the server-level refusal: test_vllm_server)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_temporalkv.vllm.plugin import TemporalKVConfigError, serving_options  # noqa: E402


def cfg(tmp_path, **extra):
    return SimpleNamespace(additional_config=extra, model_config=SimpleNamespace(model=str(tmp_path)),
                           cache_config=SimpleNamespace(cache_dtype="temporalkv-2bit"))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in ("VLLM_TEMPORALKV_ARTIFACT", "VLLM_TEMPORALKV_OUTLIERS", "VLLM_TEMPORALKV_BATCH_INVARIANT",
              "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(k, raising=False)


def test_defaults_and_values(tmp_path, monkeypatch):
    o = serving_options(cfg(tmp_path))
    assert o["artifact"].endswith("temporalkv/calibration.safetensors") and not o["outliers"]
    assert not o["batch_invariant"]
    assert serving_options(cfg(tmp_path, temporalkv_outliers=True))["outliers"]
    assert serving_options(cfg(tmp_path, temporalkv_outliers="off"))["outliers"] is False
    monkeypatch.setenv("VLLM_TEMPORALKV_OUTLIERS", "yes")
    assert serving_options(cfg(tmp_path))["outliers"]
    assert not serving_options(cfg(tmp_path, temporalkv_outliers=False))["outliers"]  # the config wins
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert serving_options(cfg(tmp_path))["batch_invariant"]


@pytest.mark.parametrize("extra,env,message", [
    ({"temporalkv_outliers": "maybe"}, {}, r"temporalkv_outliers='maybe' is not a boolean: use true or false"),
    ({}, {"VLLM_TEMPORALKV_OUTLIERS": "ture"}, r"VLLM_TEMPORALKV_OUTLIERS='ture' is not a boolean"),
    ({}, {"VLLM_TEMPORALKV_BATCH_INVARIANT": "2"}, r"VLLM_TEMPORALKV_BATCH_INVARIANT='2' is not a boolean"),
    ({"temporalkv_outlier": True}, {}, r"unknown option\(s\) temporalkv_outlier; the plugin's options are "
                                       r"temporalkv_artifact, temporalkv_outliers"),
    ({"temporalkv_artifact": 7}, {}, r"temporalkv_artifact=7: expected a file path"),
])
def test_bad_options(tmp_path, monkeypatch, extra, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(TemporalKVConfigError, match=message):
        serving_options(cfg(tmp_path, **extra))


def test_other_plugins_keys_are_left_alone(tmp_path):
    assert serving_options(cfg(tmp_path, some_other_plugin={"x": 1}))["format"] == "temporalkv-2bit"
