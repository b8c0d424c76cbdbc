"""What the C++ kernel tests share (tests/test_cpu_kernels.py, tests/test_cpu_window_scaled.py): layer caches of a
synthetic artifact, the output tolerances, the float64 oracle check."""

import torch

from tests.helpers import synthetic_artifact
from vllm_temporalkv.cache import LayerCache
from vllm_temporalkv.formats import get_format
from vllm_temporalkv.ops import cpu, paged_torch
from vllm_temporalkv.rope import Rope


def make_cache(fmt, D, outliers, dtype, layer, H=2, GQ=3, block_size=16, window=None):
    """A LayerCache of a synthetic artifact (layer 0 of a temporal format: the hybrid's K is channel-chunked)."""
    from transformers import LlamaConfig

    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": H * GQ,
           "num_key_value_heads": H, "hidden_size": H * GQ * D, "vocab_size": 100,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    f = get_format(fmt)
    art = synthetic_artifact(cfg, formats=f.calibrated_formats) if f.needs_calibration else None  # a pair: its parts
    rope = Rope(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    return LayerCache.build(fmt, layer, head_dim=D, block_size=block_size, dtype=dtype, rope=rope, artifact=art,
                            outliers=outliers, window=window, num_kv_heads=H)


def _tol(dtype, ref):
    # 2 units of the model dtype's rounding at the outputs' magnitude (tests/test_cpu_kernels.py's docstring);
    # float32: the two float32 attentions' different summation orders, well above their ~1e-6
    eps = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -16}[dtype]
    return 2 * eps * max(1.0, ref.float().abs().max().item())


def _check_f32_vs_f64(lc, pages, q, key, val, sl, tables, scale, **kw):
    """The kernel's float32 output against the float64 oracle (1e-5 x max(1, |output|))."""
    R, Hq, D = q.shape
    want = paged_torch.paged_attention(lc, pages, q, key, val, torch.arange(R + 1), sl, tables, scale,
                                       out=torch.empty(R, Hq, D, dtype=torch.float64), batch_invariant=True)
    got = cpu.decode_attention(lc, pages, q, key, val, sl, tables, scale, out=torch.empty(R, Hq, D), **kw)
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-5 * max(1.0, want.abs().max().item()), err


def _prefill_dense(q, ke, ve, kd, vd, scale, offset, window=0):
    """The prefill attention's definition in float64: query offset + i sees keys 0 .. itself, those before its own
    8-token block (with a recent window: window tokens before it) decoded (block 0, the sinks, exact), the rest
    exact."""
    n = offset + q.shape[0]
    p = torch.arange(offset, n)[:, None]
    t = torch.arange(n)[None, :]
    dec = (t < torch.where((p < 8) | (p < window), 0, (p - window) // 8 * 8))[:, None, :]  # [Tq, 1, n]
    g = q.shape[1] // ke.shape[1]
    qh = q.double().transpose(0, 1)  # [Hq, Tq, D]
    heads = lambda x: x[:n].double().repeat_interleave(g, 1).transpose(0, 1)  # noqa: E731 - [Hq, n, D]
    s = torch.where(dec, (qh @ heads(kd).transpose(1, 2)).transpose(0, 1),
                    (qh @ heads(ke).transpose(1, 2)).transpose(0, 1)) * scale  # [Tq, Hq, n]
    w = torch.softmax(s.masked_fill((t > p)[:, None, :], float("-inf")), -1)
    zero = torch.zeros((), dtype=w.dtype)
    od = torch.where(dec, w, zero).transpose(0, 1) @ heads(vd)
    oe = torch.where(dec, zero, w).transpose(0, 1) @ heads(ve)
    return (od + oe).transpose(0, 1)
