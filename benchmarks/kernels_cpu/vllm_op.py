"""vLLM's own CPU attention op on a bf16 (or float32) paged cache: the baseline benchmarks.kernels_cpu compares with,
called exactly as vllm/v1/attention/backends/cpu_attn.py calls it, and checked against float32 dense attention."""

from __future__ import annotations

import math

import torch

from vllm_temporalkv.cpu_isa import request_amx

from ..kernel_common import SHAPES
from .config import VLLM_TOL

def load_vllm_op(dtype, D: int, block_size: int) -> dict:
    """{'ops': vllm._custom_ops, 'isa': ..., 'split_kv': ...} or {'error': why it cannot be called}."""
    try:
        import vllm
        from vllm import _custom_ops as ops  # loads vllm._C (registers torch.ops._C.*)
    except Exception as e:  # noqa: BLE001
        return dict(error=f"vLLM not importable: {type(e).__name__}: {e}")
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        return dict(error=f"vLLM {vllm.__version__} has no torch.ops._C.cpu_attention_with_kv_cache (not a CPU build)")
    try:
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, D, "auto")
        split = bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
    except Exception as e:  # noqa: BLE001
        return dict(error=f"vLLM's CPU backend helpers failed: {type(e).__name__}: {e}")
    # vLLM's op runs AMX tiles on an AMX CPU (isa "amx"); outside vLLM's worker nothing has asked Linux for the
    # tile state yet, and the first tile instruction was a SIGILL (an Intel AMX Xeon, issue 36): ask as the worker
    # does (cpu_isa.request_amx; a no-op without AMX)
    amx = request_amx()
    return dict(ops=ops, isa=isa, split_kv=split, version=vllm.__version__, amx_requested=amx)


class VllmBf16:
    """A bf16 paged cache of B requests x L tokens in vLLM's CPU layout, and its attention op."""

    def __init__(self, v: dict, B: int, L: int, H: int, HQ: int, D: int, dtype, block_size: int, fill: bool = True):
        self.v, self.H, self.HQ, self.D, self.dtype, self.bs = v, H, HQ, D, dtype, block_size
        per = -(-L // block_size)
        n = B * per
        # vLLM zero-fills its KV cache; its op multiplies masked (p = 0) slots' V by the weights, so
        # uninitialised memory (NaN bit patterns) in a page's unused slots would poison the check.
        self.kv = torch.zeros(n, H, block_size, 2 * D, dtype=dtype)
        if fill:  # random bf16 values (timing does not depend on them; the check writes through vLLM)
            self.kv.view(-1)[:].normal_()
        self.k, self.v_cache = self.kv.view(n, H, 2 * block_size, D).chunk(2, dim=2)  # as forward() does
        self.bt = torch.randperm(n).reshape(B, per).to(torch.int32)

    def write(self, key, value, r: int, start: int):
        """Write request r's tokens start.. (key/value [T, H, D]) with vLLM's own cache update."""
        pos = torch.arange(start, start + key.shape[0])
        slots = self.bt[r, pos // self.bs].long() * self.bs + pos % self.bs
        self.v["ops"].cpu_attn_reshape_and_cache(key, value, self.k, self.v_cache, slots, self.v["isa"])

    def metadata(self, qsl, seq_lens, causal: bool = True):
        return self.v["ops"].cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0], num_heads=self.HQ, num_kv_heads=self.H, head_dim=self.D, seq_lens=seq_lens,
            dtype=self.dtype, query_start_loc=qsl, causal=causal, sliding_window_size=-1, isa=self.v["isa"],
            enable_kv_split=self.v["split_kv"])

    def __call__(self, q, qsl, seq_lens, md, out, bt=None):
        self.v["ops"].cpu_attention_with_kv_cache(
            query=q, key_cache=self.k, value_cache=self.v_cache, output=out, query_start_loc=qsl, seq_lens=seq_lens,
            scale=self.D ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=self.bt if bt is None else bt, softcap=0.0, scheduler_metadata=md, s_aux=None)
        return out


def dense_attention(q, K, V, offset: int, scale: float) -> torch.Tensor:
    """float32 causal attention: q [T, HQ, D] at positions offset.., K/V [offset + T, H, D] -> [T, HQ, D]."""
    T, HQ, D = q.shape
    H = K.shape[1]
    g = HQ // H
    qh = q.float().view(T, H, g, D).permute(1, 2, 0, 3).reshape(H, g * T, D)
    k, v = K.float().transpose(0, 1), V.float().transpose(0, 1)
    s = (qh @ k.transpose(1, 2)).view(H, g, T, -1) * scale
    qpos = offset + torch.arange(T)
    s.masked_fill_(torch.arange(K.shape[0])[None, :] > qpos[:, None], -math.inf)
    o = torch.softmax(s, -1).view(H, g * T, -1) @ v
    return o.view(H, g, T, D).permute(2, 0, 1, 3).reshape(T, HQ, D)


def check_vllm(v: dict, shape: str, dtype, block_size: int, c: int, n: int, T: int) -> dict:
    """vLLM's op on a small cache it wrote itself (c requests of n tokens; the last T of each are its
    queries: T = 1 is a decode) against float32 dense attention."""
    sh = SHAPES[shape]
    H, HQ, D = sh["h"], sh["hq"], sh["d"]
    g = torch.Generator().manual_seed(7)
    base = VllmBf16(v, c, n, H, HQ, D, dtype, block_size, fill=False)
    K = torch.randn(c, n, H, D, generator=g).to(dtype)
    V = torch.randn(c, n, H, D, generator=g).to(dtype)
    for r in range(c):
        base.write(K[r], V[r], r, 0)
    q = torch.randn(c * T, HQ, D, generator=g).to(dtype)
    qsl = torch.arange(0, c * T + 1, T, dtype=torch.int32)
    sl = torch.full((c,), n, dtype=torch.int32)
    out = base(q, qsl, sl, base.metadata(qsl, sl), torch.empty_like(q))
    want = torch.cat([dense_attention(q[r * T:(r + 1) * T], K[r], V[r], n - T, D ** -0.5) for r in range(c)])
    err, ref = float((out.float() - want).abs().max()), float(want.abs().max())
    tol = VLLM_TOL * max(1.0, ref)
    return dict(vllm_check_err=err, vllm_check_tol=tol, vllm_check_ok=err <= tol, vllm_check=f"{c}x{n}, {T} queries")
