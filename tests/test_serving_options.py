"""The plugin's serving options (--additional-config / environment): misspelt keys and values are errors that
name the option and the fix, never a silent default (the server-level refusal: test_vllm_server)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_temporalkv.vllm.options import TemporalKVConfigError, serving_options  # noqa: E402


def cfg(tmp_path, fmt="temporalkv-2bit", **extra):
    return SimpleNamespace(additional_config=extra, model_config=SimpleNamespace(model=str(tmp_path)),
                           cache_config=SimpleNamespace(cache_dtype=fmt, block_size=1024))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in ("VLLM_TEMPORALKV_ARTIFACT", "VLLM_TEMPORALKV_OUTLIERS", "VLLM_TEMPORALKV_BATCH_INVARIANT",
              "VLLM_BATCH_INVARIANT", "VLLM_TEMPORALKV_RECENT_WINDOW", "VLLM_TEMPORALKV_SMALL_PAGES"):
        monkeypatch.delenv(k, raising=False)


def test_defaults_and_values(tmp_path, monkeypatch):
    o = serving_options(cfg(tmp_path))
    assert o["artifact"].endswith("temporalkv/calibration.safetensors") and not o["outliers"]
    assert not o["batch_invariant"]
    assert serving_options(cfg(tmp_path, temporalkv_outliers=True))["outliers"]
    assert serving_options(cfg(tmp_path, temporalkv_outliers="off"))["outliers"] is False
    # a percentage of values up to 1: "1" is 1% either way
    assert serving_options(cfg(tmp_path, temporalkv_outliers="0.5"))["outliers"] == 0.005
    assert serving_options(cfg(tmp_path, temporalkv_outliers=0.25))["outliers"] == 0.0025
    assert serving_options(cfg(tmp_path, temporalkv_outliers="1"))["outliers"] is True
    for bad in ("2", "-0.5", "half"):
        with pytest.raises(TemporalKVConfigError, match=f"temporalkv_outliers={bad!r} is not a boolean or a perc"):
            serving_options(cfg(tmp_path, temporalkv_outliers=bad))
    monkeypatch.setenv("VLLM_TEMPORALKV_OUTLIERS", "yes")
    assert serving_options(cfg(tmp_path))["outliers"]
    assert not serving_options(cfg(tmp_path, temporalkv_outliers=False))["outliers"]  # the config wins
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert serving_options(cfg(tmp_path))["batch_invariant"]
    # the recent window: the format's by default, any multiple of 8 below the page size on request
    assert serving_options(cfg(tmp_path))["window"] == 0
    assert serving_options(cfg(tmp_path, temporalkv_recent_window=24))["window"] == 24
    monkeypatch.setenv("VLLM_TEMPORALKV_RECENT_WINDOW", "16")
    assert serving_options(cfg(tmp_path))["window"] == 16


def test_small_pages_only_where_served(tmp_path, monkeypatch):
    """temporalkv_small_pages (issue 34): on by default where served (vLLM >= 0.27 on the CPU: a codebook format of
    one page size, no recent window, no --block-size, the hybrid KV manager, no KV connector), off everywhere else
    without a word; false turns it off; asked for where it is not served, refused, naming the option."""
    from vllm_temporalkv.vllm import compat

    if not compat.SMALL_PAGES_SUPPORTED:
        pytest.skip("vLLM < 0.27: small pages are not served")
    assert serving_options(cfg(tmp_path))["small_pages"] is True
    assert serving_options(cfg(tmp_path, "temporalkv-k4v2"))["small_pages"] is True
    assert serving_options(cfg(tmp_path, temporalkv_small_pages=False))["small_pages"] is False
    assert serving_options(cfg(tmp_path, temporalkv_small_pages="off"))["small_pages"] is False
    for fmt, extra in (("temporalkv-2bit", {"temporalkv_recent_window": 16}), ("selective-int8", {}), ("qjl", {}),
                       ("temporalkv-2bit-mixed", {})):  # a window, calibration-free, per-layer pages, a mix: not served
        assert serving_options(cfg(tmp_path, fmt, **extra))["small_pages"] is False, fmt
    others = {"cache_config": SimpleNamespace(cache_dtype="temporalkv-2bit", block_size=256,
                                              user_specified_block_size=True),
              "scheduler_config": SimpleNamespace(disable_hybrid_kv_cache_manager=True),
              "kv_transfer_config": object()}
    for k, v in others.items():  # --block-size N, --disable-hybrid-kv-cache-manager, --kv-transfer-config
        c = cfg(tmp_path)
        setattr(c, k, v)
        assert serving_options(c)["small_pages"] is False, k
    monkeypatch.setenv("VLLM_TEMPORALKV_SMALL_PAGES", "0")
    assert serving_options(cfg(tmp_path))["small_pages"] is False
    assert serving_options(cfg(tmp_path, temporalkv_small_pages=True))["small_pages"] is True  # the config wins
    monkeypatch.setenv("VLLM_TEMPORALKV_SMALL_PAGES", "1")
    with pytest.raises(TemporalKVConfigError, match="temporalkv_small_pages: temporalkv-2bit with a recent window"):
        serving_options(cfg(tmp_path, temporalkv_recent_window=16))
    with pytest.raises(TemporalKVConfigError, match="temporalkv_small_pages: selective-int8 .*drop the option"):
        serving_options(cfg(tmp_path, "selective-int8"))


def test_small_pages_default_size_fills_the_exact_pages():
    """Both KV-cache groups share one page size: the default small page is 64 tokens, or 128 where 64 tokens of
    codes would fill only half of an exact page (1-bit codes, with or without outliers), whatever the head size."""
    from vllm_temporalkv.vllm.options import small_block_size

    def size(fmt, D, **extra):
        return small_block_size(SimpleNamespace(additional_config=extra, cache_config=SimpleNamespace(cache_dtype=fmt),
                                                model_config=SimpleNamespace(get_head_size=lambda: D)))

    for D in (64, 128):
        assert [size(f, D) for f in ("temporalkv-4bit", "temporalkv-2bit", "temporalkv-k4v1", "channelkv-2bit")] == \
            [64] * 4
        assert size("temporalkv-1bit", D) == size("kvquant-1bit", D, temporalkv_outliers=True) == 128


def test_a_calibration_free_format_needs_no_artifact(tmp_path):
    o = serving_options(cfg(tmp_path / "not-a-folder", "selective-int8"))
    assert o["artifact"] is None and o["window"] == 128
    assert serving_options(cfg(tmp_path, "selective-int4", temporalkv_recent_window=0))["window"] == 0
    with pytest.raises(TemporalKVConfigError, match="selective-int8 keeps no outliers"):
        serving_options(cfg(tmp_path, "selective-int8", temporalkv_outliers=True))


@pytest.mark.parametrize("extra,env,message", [
    ({"temporalkv_outliers": "maybe"}, {},
     r"temporalkv_outliers='maybe' is not a boolean or a percentage of values in \(0, 1\]: use true / false"),
    ({}, {"VLLM_TEMPORALKV_OUTLIERS": "ture"}, r"VLLM_TEMPORALKV_OUTLIERS='ture' is not a boolean"),
    ({}, {"VLLM_TEMPORALKV_BATCH_INVARIANT": "2"}, r"VLLM_TEMPORALKV_BATCH_INVARIANT='2' is not a boolean"),
    ({"temporalkv_outlier": True}, {}, r"unknown option\(s\) temporalkv_outlier; the plugin's options are "
                                       r"temporalkv_artifact, temporalkv_outliers"),
    ({"temporalkv_artifact": 7}, {}, r"temporalkv_artifact=7: expected a file path"),
    ({"temporalkv_recent_window": 12}, {}, r"temporalkv_recent_window=12: the recent window is kept in whole "
                                           r"blocks; use a multiple of 8"),
    ({}, {"VLLM_TEMPORALKV_RECENT_WINDOW": "lots"}, r"VLLM_TEMPORALKV_RECENT_WINDOW='lots' is not a whole number"),
    ({"temporalkv_recent_window": 1024}, {}, r"must fit in one page of 1024; use a larger --block-size"),
])
def test_bad_options(tmp_path, monkeypatch, extra, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(TemporalKVConfigError, match=message):
        serving_options(cfg(tmp_path, **extra))


def test_other_plugins_keys_are_left_alone(tmp_path):
    assert serving_options(cfg(tmp_path, some_other_plugin={"x": 1}))["format"] == "temporalkv-2bit"


def test_default_window_fits_the_block_size_the_plugin_sets(tmp_path, monkeypatch):
    """A selective format at its default recent window (128) on a platform whose default block size is 128: the
    plugin sets its own 1024-token pages before checking the window against them (it once checked first and refused
    `vllm bench throughput --kv-cache-dtype selective-int4`: "136 tokens must fit in one page of 128")."""
    from vllm_temporalkv.vllm import plugin

    monkeypatch.setattr(plugin, "_check_model", lambda vc: serving_options(vc))  # the model checks need a real model
    vc = cfg(tmp_path, "selective-int4")
    vc.cache_config.block_size = 128  # the platform's default, not the user's
    plugin._on_config(vc)
    assert vc.cache_config.block_size == 1024
    assert serving_options(vc)["window"] == 128
