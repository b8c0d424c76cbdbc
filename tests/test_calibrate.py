"""A small real calibration of SmolLM2, its artifact, restart after interruption, and the harness."""

import json

import pytest
import torch

from vllm_temporalkv.calibration import run as calibrate
from tests.conftest import TINY_FORMATS
from vllm_temporalkv.artifact import Artifact, model_fingerprint
from vllm_temporalkv.formats import SINK_TOKENS, get_format
from vllm_temporalkv.models import load_hf_model


def test_artifact_fits_smollm2(tiny_artifact, smollm2_dir):
    fp = model_fingerprint(json.loads((smollm2_dir / "config.json").read_text()))
    art = Artifact.load(tiny_artifact, expect=fp, formats=TINY_FORMATS)
    assert art.fingerprint["num_kv_heads"] == 3 and art.fingerprint["head_dim"] == 64
    assert art.calibration["num_samples"] == 2 and art.calibration["fisher"] is True
    # hybrid: one choice per layer, for K and V separately, backed by the MSE table
    m = art.layer_methods["temporalkv-2bit"]
    t = art.mse["temporalkv-2bit"]
    for layer in range(30):
        for j, kv in enumerate("kv"):
            assert m[kv][layer] == ("channel" if t[layer, j, 1] < t[layer, j, 0] else "temporal")
    assert set(art.layer_methods["channelkv-2bit"]["k"]) == {"channel"}
    # the per-layer loss estimates a mixed format chooses by: recorded for every hybrid format, finite, and
    # fewer bits cost more in total (the hybrid's choice in each layer)
    assert "channelkv-2bit" not in art.cost
    total = {}
    for f in ("temporalkv-4bit", "temporalkv-2bit", "temporalkv-1bit"):
        c = art.cost[f]
        assert c.shape == (30, 2, 2) and torch.isfinite(c).all() and (c >= 0).all()
        total[f] = sum(float(c[i, j, int(art.layer_methods[f][kv][i] == "channel")]) for i in range(30)
                       for j, kv in enumerate("kv"))
    assert total["temporalkv-4bit"] < total["temporalkv-2bit"] < total["temporalkv-1bit"], total
    parts = Artifact.load(tiny_artifact, formats=["temporalkv-2bit-mixed"]).layer_formats("temporalkv-2bit-mixed")
    assert sum(get_format(p).nominal_bits for p in parts) <= 2 * 30 and len(set(parts)) > 1, parts
    s = art.stats[(5, "k")]
    assert (s.std > 0).all() and (s.lo < s.hi).all()


def test_interrupted_calibration_resumes_to_the_same_artifact(tiny_artifact, smollm2_dir, tmp_path, monkeypatch):
    """Stopped during the collection (streamed to disk a window at a time here) and again during the fit, it
    resumes where it stopped - and the result is the artifact of one uninterrupted run (collected 4 windows a
    file: the file size changes nothing)."""
    from vllm_temporalkv.calibration import collect

    out = tmp_path / "resumed.safetensors"
    real, real_collect = calibrate.fit_layer, collect.collect_kv_grads
    calls = []

    def failing(layer, *a, **kw):
        if layer == 3:
            raise KeyboardInterrupt
        return real(layer, *a, **kw)

    def collect_once(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_collect(*a, **kw)

    kw = dict(model=str(smollm2_dir), formats=TINY_FORMATS, num_samples=2, seq_len=256, iters=5,
              output=out, progress=False, log=lambda *a: None)
    monkeypatch.setattr(calibrate, "COLLECT_CHUNK", 1)
    monkeypatch.setattr(collect, "collect_kv_grads", collect_once)
    work = tmp_path / "resumed.safetensors.work"
    with pytest.raises(KeyboardInterrupt):
        calibrate.run_calibration(**kw)
    assert sorted(p.name for p in work.glob("collected*")) == ["collected.00000.safetensors"]
    monkeypatch.setattr(calibrate, "fit_layer", failing)
    with pytest.raises(KeyboardInterrupt):
        calibrate.run_calibration(**kw)
    assert len(calls) == 3  # the second window only: the first was on disk
    assert sorted(p.name for p in work.glob("collected*")) == ["collected.00000.safetensors",
                                                               "collected.00001.safetensors"]
    assert sorted(p.name for p in work.glob("layer_*")) == [f"layer_{i:03d}.safetensors" for i in range(3)]
    monkeypatch.setattr(calibrate, "fit_layer", real)
    calibrate.run_calibration(**kw)
    assert len(calls) == 3 and not work.exists()
    a, b = Artifact.load(out), Artifact.load(tiny_artifact)
    assert a.layer_methods == b.layer_methods
    for k in b.codebooks:
        assert torch.equal(a.codebooks[k], b.codebooks[k]), k


def test_other_formats_reuse_the_collection_not_the_fits(smollm2_dir, tmp_path, calibration_spy):
    """A stopped run's collection serves a run of other formats (it does not depend on the codebook families:
    hours of windows at 64 x 2048 on a CPU); its fitted layers do not; other attention starts over."""
    out = tmp_path / "a.safetensors"
    work = tmp_path / "a.safetensors.work"
    calls, logs = calibration_spy.calls, []
    kw = dict(model=str(smollm2_dir), num_samples=1, seq_len=128, iters=2, output=out, progress=False,
              log=logs.append, attention="sdpa")
    calibration_spy.stop = 2
    with pytest.raises(KeyboardInterrupt):
        calibrate.run_calibration(formats=["temporalkv-4bit"], **kw)
    assert len(calls) == 1 and len(list(work.glob("layer_*"))) == 2
    collected = {p.name: p.stat().st_mtime_ns for p in work.glob("collected*")}
    with pytest.raises(KeyboardInterrupt):
        calibrate.run_calibration(formats=["channelkv-2bit"], **kw)
    assert len(calls) == 1, "the collection was redone for other formats"
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("collected*")} == collected
    assert any("discarding its 2 fitted layers" in m for m in logs), logs
    assert json.loads((work / "run.json").read_text())["settings"]["keys"] == ["channel-l4-k256"]
    calibration_spy.stop = None
    art = calibrate.run_calibration(formats=["channelkv-2bit"], **kw)
    assert art.formats == ["channelkv-2bit"] and art.calibration["attention"] == "sdpa" and len(calls) == 1
    # a stopped run under other attention is not reused
    calibration_spy.stop = 2
    with pytest.raises(KeyboardInterrupt):
        calibrate.run_calibration(formats=["channelkv-2bit"], **kw)
    with pytest.raises(KeyboardInterrupt):
        calibrate.run_calibration(formats=["channelkv-2bit"], **{**kw, "attention": "eager"})
    assert len(calls) == 3 and any("different settings" in m for m in logs), logs
    with pytest.raises(ValueError, match="--attention"):
        calibrate.run_calibration(formats=["channelkv-2bit"], **{**kw, "attention": "flash"})


def test_collected_store_reads_a_layer_in_window_order(smollm2_dir, tmp_path):
    """The streamed collection returns, layer by layer, exactly what one in-memory collection holds; reading
    an incomplete one is refused."""
    from vllm_temporalkv.calibration.collect import CollectedStore, collect_kv_grads

    model = load_hf_model(smollm2_dir, attn_implementation="sdpa")
    ids = torch.randint(100, 4000, (3, 64), generator=torch.Generator().manual_seed(0))
    store = CollectedStore(tmp_path, 3, chunk=2)
    with pytest.raises(FileNotFoundError, match="incomplete"):
        store.layer(0)
    store.collect(model, ids, progress=False)
    assert store.missing() == [] and len(list(tmp_path.glob("collected.*.safetensors"))) == 2
    acts, grads = collect_kv_grads(model, ids, progress=False)
    for layer in (0, 17, 29):
        a, g = store.layer(layer)
        for kv in "kv":
            assert a[kv].shape == (3 * (64 - SINK_TOKENS), 3, 64)
            assert torch.equal(a[kv], acts[layer][kv]) and torch.equal(g[kv], grads[layer][kv])


def test_low_memory_collection_matches(smollm2_dir, monkeypatch):
    """--low-memory (decoder layers checkpointed, the LM loss a chunk of tokens at a time): the same K / V, and
    gradients equal to float rounding (bit-identical on this machine, for SmolLM2 and Qwen2.5-1.5B); the
    model is left as it was; its collection is another run's (the layout name in the run key)."""
    from vllm_temporalkv.calibration import collect

    model = load_hf_model(smollm2_dir, attn_implementation="sdpa")
    ids = torch.randint(100, 4000, (2, 150), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(collect, "LOSS_CHUNK", 64)  # 149 next-token losses: three chunks
    a0, g0 = collect.collect_kv_grads(model, ids, progress=False)
    a1, g1 = collect.collect_kv_grads(model, ids, progress=False, low_memory=True)
    for layer in (0, 15, 29):
        for kv in "kv":
            assert torch.equal(a0[layer][kv], a1[layer][kv])
            torch.testing.assert_close(g1[layer][kv], g0[layer][kv], rtol=1e-5, atol=1e-7)
    assert all("forward" not in vars(layer) for layer in model.model.layers)  # the checkpointing is undone


def test_cli_rejects_bad_format(capsys):
    from vllm_temporalkv.calibration.cli import main

    assert main(["--formats", "temporalkv-3bit"]) == 2
    assert "unknown KV format 'temporalkv-3bit'" in capsys.readouterr().err


def test_quality_harness_protocol(tiny_artifact, smollm2_dir, tmp_path):
    """The simulated-compression hooks: bf16 is near-lossless, compression hurts, sinks stay exact."""
    from vllm_temporalkv.corpora import load_corpus, token_windows
    from vllm_temporalkv.harness.simulate import Simulator, window_nll
    from vllm_temporalkv.models import load_tokenizer

    art = Artifact.load(tiny_artifact)
    model = load_hf_model(smollm2_dir)
    ids = token_windows(load_tokenizer(smollm2_dir), load_corpus("brown"), 128, 1)
    nll = {n: window_nll(model, ids, Simulator(n, art, None))[0]
           for n in ("bf16", "kvquant-2bit", "temporalkv-2bit", "temporalkv-2bit@sinks-compressed")}
    with torch.no_grad():
        exact = float(torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="sum"))
    assert abs(nll["bf16"] - exact) / exact < 0.01
    assert nll["temporalkv-2bit"] > nll["bf16"] and nll["kvquant-2bit"] > nll["bf16"]
    assert nll["temporalkv-2bit@sinks-compressed"] != nll["temporalkv-2bit"]
    # keys only / values only: each half costs something, both together more than either
    for half in ("keys-only", "values-only"):
        nll[half] = window_nll(model, ids, Simulator(f"temporalkv-2bit@{half}", art, None))[0]
        assert nll["bf16"] < nll[half] < nll["temporalkv-2bit"], nll
    # causal protocol (what a decode step sees): bf16 is exact, compression still costs
    causal = {n: window_nll(model, ids, Simulator(n, art, None, "causal"))[0] for n in ("bf16", "temporalkv-2bit")}
    assert abs(causal["bf16"] - nll["bf16"]) / nll["bf16"] < 1e-3
    assert causal["temporalkv-2bit"] > causal["bf16"] and causal["temporalkv-2bit"] != nll["temporalkv-2bit"]
    k_only = window_nll(model, ids, Simulator("temporalkv-2bit@keys-only", art, None, "causal"))[0]
    assert causal["bf16"] < k_only < causal["temporalkv-2bit"]
    # a recent window of exact tokens recovers part of the loss, in both protocols
    for protocol, ref in (("thesis", nll), ("causal", causal)):
        w = window_nll(model, ids, Simulator("temporalkv-2bit@window32", art, None, protocol))[0]
        assert ref["bf16"] < w < ref["temporalkv-2bit"], (protocol, w, ref)
    # one layer group at a time (per-layer sensitivity), combined with keys only: the other layers and the values
    # stay exact; the groups together cost about what all layers do
    for protocol in ("thesis", "causal"):
        groups = [window_nll(model, ids, Simulator(f"temporalkv-2bit@keys-only+layers{a}-{a + 14}", art, None,
                                                   protocol))[0] for a in (0, 15)]
        ref = {"thesis": nll, "causal": causal}[protocol]
        full_k = nll["keys-only"] if protocol == "thesis" else k_only
        assert all(ref["bf16"] < g < full_k for g in groups), (protocol, groups, full_k)
    sim = Simulator("temporalkv-2bit@keys-only+layers3-4", art, None)
    x = torch.randn(1, 64, 3, 64)
    xb = x.bfloat16().float()
    assert torch.equal(sim(2, "k", x), xb) and torch.equal(sim(3, "v", x), xb) and not torch.equal(sim(4, "k", x), xb)
    with pytest.raises(ValueError, match="unknown ablation 'layer3'"):
        Simulator("temporalkv-2bit@keys-only+layer3", art, None)
    # the hook leaves the sink tokens' K/V bit-exact (bf16) and changes the rest
    sim = Simulator("temporalkv-2bit", art, None)
    x = torch.randn(1, 64, 3, 64)
    y = sim(4, "k", x)
    assert torch.equal(y[0, :SINK_TOKENS], x[0, :SINK_TOKENS].bfloat16().float())
    assert not torch.equal(y[0, SINK_TOKENS:], x[0, SINK_TOKENS:].bfloat16().float())


@pytest.mark.parametrize("window", [0, 5, 16])
def test_causal_attention_is_the_dense_definition(window):
    """harness.simulate.causal_attention (banded: exact keys written over the decoded scores diagonal by diagonal)
    equals its definition computed densely: every query sees the keys of its own block and of the recent window
    before it exactly, all earlier ones decoded; grouped query heads share their KV head.  The needle probe reads
    the same ranks."""
    import types

    from vllm_temporalkv.formats import BLOCK_TOKENS
    from vllm_temporalkv.harness import simulate
    from vllm_temporalkv.rope import Rope

    torch.manual_seed(window)
    B, Hq, Hk, T, D = 2, 6, 2, 75, 16
    rope = Rope(types.SimpleNamespace(head_dim=D, hidden_size=Hq * D, num_attention_heads=Hq, rope_theta=1e4,
                                      rope_scaling=None, max_position_embeddings=4096))
    q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, Hk, T, D), torch.randn(B, Hk, T, D)
    stash = {(3, "k"): torch.randn(B, T, Hk, D), (3, "v"): torch.randn(B, T, Hk, D)}  # decoded, pre-RoPE
    sim = types.SimpleNamespace(qs={}, window=window, stash=stash)
    simulate._ACTIVE.update(sim=sim, rope=rope, probe={"query": 60, "span": [9, 10], "layers": {}})
    try:
        out, _ = simulate.causal_attention(types.SimpleNamespace(layer_idx=3), q, k, v, None, 0.25)
        probe = simulate._ACTIVE.pop("probe")["layers"][3]
    finally:
        simulate._ACTIVE.clear()
    pos = torch.arange(T)
    kq = torch.stack([rope.apply(stash[(3, "k")][b], pos) for b in range(B)]).transpose(1, 2)
    rep = lambda t: t.repeat_interleave(Hq // Hk, 1)  # noqa: E731
    s_ex, s_q = q @ rep(k).transpose(2, 3) * 0.25, q @ rep(kq).transpose(2, 3) * 0.25
    own = (pos[None, :] >= ((pos - window) // BLOCK_TOKENS * BLOCK_TOKENS)[:, None]) & (pos[None, :] <= pos[:, None])
    served = torch.where(own, s_ex, s_q)
    p = torch.softmax(served.masked_fill(pos[None, :] > pos[:, None], float("-inf")), -1)
    want = p * own @ rep(v) + p * ~own @ rep(stash[(3, "v")].transpose(1, 2))
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    for name, x in (("served", served), ("exact", s_ex)):
        want = simulate.needle_attention(x[0, :, 60, :61], [9, 10])
        assert probe[name]["rank"] == want["rank"] and probe[name]["mass"] == pytest.approx(want["mass"], abs=1e-6)


def test_quality_harness_seed_methods(smollm2_dir, tmp_path):
    """The seed methods in the thesis protocol (the format Simulator, as served): their exact tokens stay
    bit-exact, the rest is changed, fewer bits cost more NLL, and QJL's key surrogate gives attention its score
    estimate."""
    from vllm_temporalkv.codecs import qjl
    from vllm_temporalkv.corpora import load_corpus, token_windows
    from vllm_temporalkv.harness.simulate import Simulator, window_nll
    from vllm_temporalkv.layout import bits_per_float
    from vllm_temporalkv.models import load_tokenizer
    from vllm_temporalkv.rope import Rope

    model = load_hf_model(smollm2_dir)
    cfg = model.config
    served = ("selective-int8", "selective-int4", "tada-4bit", "tada-2bit", "qjl")
    sims = {n: Simulator(n, None, None) for n in served}
    sims["qjl"].bind(cfg)  # per-layer sketches and the model's RoPE (token_nlls binds every hook it runs)
    x = torch.randn(1, 300, 3, 64)
    xb = x.bfloat16().float()
    for n, sim in sims.items():
        for kind in "kv":
            y = sim(3, kind, x)
            # 300 tokens: every served method keeps 8 sinks + the last 128..135 (whole blocks: from 168); QJL keeps
            # keys as served, post-RoPE in half precision (rotated back here for the hooks)
            exact = torch.cat([torch.arange(8), torch.arange(168, 300)])
            if n == "qjl" and kind == "k":
                rope = Rope(cfg)
                post = rope.apply(xb[0], torch.arange(300)).bfloat16().float()
                torch.testing.assert_close(rope.apply(y[0], torch.arange(300))[exact], post[exact], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(y[0, exact], xb[0, exact]), (n, kind)
            comp = torch.ones(300, dtype=torch.bool)
            comp[exact] = False
            assert ((y[0, comp] - xb[0, comp]).abs() > 1e-3).any(), (n, kind)
    # QJL: <rope(q), rope(k_hat)> is the estimator on the post-RoPE keys (outlier channels per 8-token block, as
    # served), position by position
    kq = sims["qjl"].qs[20][0]
    y = sims["qjl"](20, "k", x)[0, 8:168]
    rope, pos = Rope(cfg), torch.arange(8, 168)
    enc = qjl.encode_keys(rope.apply(xb[0, 8:168], pos).bfloat16().float(), kq.S, kq.m_o, group_size=8)
    enc.norm, enc.outlier_norm = enc.norm.half(), enc.outlier_norm.half()  # as the pages keep them
    q = torch.randn(1, 3, 64)
    want = qjl.attention_logits(q, enc, kq.S, scale=1.0)[0]  # [H, T]
    got = (rope.apply(y, pos) * q).sum(-1).T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    # through the model: all compress, lower bits cost more
    ids = token_windows(load_tokenizer(smollm2_dir), load_corpus("brown"), 384, 1)
    nll = {n: window_nll(model, ids, s)[0] for n, s in sims.items()}
    base = window_nll(model, ids, lambda layer, kind, out: out.to(torch.bfloat16).to(out.dtype))[0]
    assert all(v > base for v in nll.values()), (nll, base)
    assert nll["selective-int4"] > nll["selective-int8"] and nll["tada-2bit"] > nll["tada-4bit"], nll
    bits = {n: bits_per_float(get_format(n), 64, 2048, num_kv_heads=3, num_layers=30)["total"] for n in served}
    assert bits["selective-int8"] > bits["selective-int4"] > bits["qjl"] > 4 and bits["tada-4bit"] > bits["tada-2bit"], bits


def test_tada_layer_bits_search(smollm2_dir):
    """TaDA's per-layer bits: measured costs per (layer, bits) -> the budget is met, the sensitive layers get
    more bits (a stand-in NLL: each layer's K/V error times a weight)."""
    from transformers import AutoConfig

    from vllm_temporalkv.harness.seeds import SeedSimulator, tada_layer_bits

    cfg = AutoConfig.from_pretrained(smollm2_dir)
    L = cfg.num_hidden_layers
    weight = torch.ones(L)
    weight[[0, 5]] = 1000.0
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, 300, 3, 64, generator=g), torch.randn(1, 300, 3, 64, generator=g)) for _ in range(L)]

    def nll(hook):
        return sum(float(w * sum(((hook(i, kind, x) - x.bfloat16().float()) ** 2).mean() for kind, x in zip("kv", kv[i])))
                   for i, w in enumerate(weight))

    bits, cost = tada_layer_bits("tada-mixed-3bit", cfg, torch.bfloat16, nll)
    assert len(bits) == L and sum(bits) / L <= 3.0 and set(bits) <= {2, 4, 8}
    assert bits[0] == bits[5] == 8 and sorted(bits)[L // 2] == 2
    assert cost["0"]["2"] > cost["0"]["4"] > cost["0"]["8"] >= 0
    sim = SeedSimulator("tada-mixed-3bit", cfg, torch.bfloat16, layer_bits=bits)
    assert 2 + 16 / 3 < sim.bits(2048)["total"] < 16
    with pytest.raises(ValueError, match="per-layer bits"):
        SeedSimulator("tada-mixed-3bit", cfg, torch.bfloat16)


def test_fp8_simulation_is_vllms_fp8_cache(smollm2_dir):
    """vLLM's --kv-cache-dtype fp8 in the quality harness: every value, and every key after RoPE at its position, on
    the float8 e4m3 grid (the hook hands keys back pre-RoPE), nothing exact, 8 bits per float; a key rounded before
    RoPE instead would sit off that grid."""
    from transformers import AutoConfig

    from vllm_temporalkv.harness.seeds import SeedSimulator, e4m3
    from vllm_temporalkv.rope import Rope

    cfg = AutoConfig.from_pretrained(smollm2_dir)
    sim = SeedSimulator("fp8", cfg, torch.bfloat16)
    assert sim.bits(2048) == {"k": 8.0, "v": 8.0, "total": 8.0}
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 40, 3, 64, generator=g) * 3, torch.randn(1, 40, 3, 64, generator=g)
    vq = sim(0, "v", v)
    assert torch.equal(vq, e4m3(v.bfloat16())) and not torch.equal(vq, v.bfloat16().float())
    pos = torch.arange(40)
    rope = Rope(cfg)
    post = rope.apply(sim(0, "k", k)[0], pos)  # what attention sees
    want = e4m3(rope.apply(k[0].bfloat16(), pos).bfloat16())
    assert (post - want).abs().max() <= 1e-5 * want.abs().max()  # the rotation there and back: float32 rounding
    pre = rope.apply(e4m3(k[0].bfloat16()), pos)
    assert (pre - want).abs().max() > 1e-2  # rounding before RoPE is another cache
