"""What the CUDA decode kernel (csrc/cuda/decode.cu) is launched with, computed on the host in plain torch: its
variant (compile-time defines), the tables it reads (fp16 codebooks, statistics, RoPE factors), the launch shape
(splits, units, shared-memory carve-up) and the parameter blocks.  Shared by the loader (``ops.cuda``, which adds
device pointers) and the CPU emulator (``ops.cuda_emulator``, which replays the kernel's program on these very
tables), so the two cannot drift.  Imports no CUDA, no vLLM."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..layout import PageLayout
from ..methods import BLOCK_TOKENS, KERNEL_CHANNEL_VECTOR, KERNEL_SCALAR, KERNEL_TOKEN_VECTOR, SINK_TOKENS

TILE = 32  # tokens per tile (csrc/cuda/maps.cuh TILE)
GQP = 8  # query heads per KV head one mma column block serves
SLICE = 64  # channels per warp
THREADS = 256  # threads per CTA: decode.cu's __launch_bounds__ (TKV_THREADS) caps registers at 64K / threads
# temporal K and V codes: 12 warps per SM (<= 168 registers, no spills, outliers too) decode 1.06-1.17x faster than 8
# on the H100 (B = 8, L = 32k; benchmarks/results/cuda-decode); channel / scalar paths would spill there
THREADS_TEMPORAL = 384
SMEM_LIMITS = {(9, 0): 232448, (8, 0): 166912, (8, 6): 101376, (8, 9): 101376, (8, 7): 166912}  # opt-in bytes/block
FP16_MAX_K = 30000.0  # the kernel computes keys in fp16: refuse codebooks whose decoded keys could get near 65504


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled kernel: the -D defines of decode.cu."""

    km: int  # K code path (CodeLayout.kernel_variant): 0 temporal, 1 channel, 2 scalar
    kl: int  # chunk l (vector methods) or bits (scalar)
    vm: int
    vl: int
    d: int
    outliers: bool
    bf16: bool
    vskew: bool = True
    threads: int = THREADS  # the CTA's most threads (registers per thread <= 64K / threads)

    @property
    def defines(self) -> dict[str, int]:
        return {"TKV_KM": self.km, "TKV_KL": self.kl, "TKV_VM": self.vm, "TKV_VL": self.vl, "TKV_D": self.d,
                "TKV_OUTL": int(self.outliers), "TKV_BF16": int(self.bf16), "TKV_VSKEW": int(self.vskew),
                "TKV_THREADS": self.threads}

    @property
    def name(self) -> str:
        return (f"k{self.km}l{self.kl}-v{self.vm}l{self.vl}-d{self.d}-o{int(self.outliers)}-"
                f"{'bf16' if self.bf16 else 'fp16'}{'' if self.vskew else '-noskew'}"
                f"{'' if self.threads == THREADS else f'-t{self.threads}'}")

    @property
    def wpt(self) -> int:  # warps per tile unit
        return self.d // SLICE

    def kvec(self, kind: str) -> int:
        m, l = (self.km, self.kl) if kind == "k" else (self.vm, self.vl)
        return 1 if m == KERNEL_SCALAR else l

    def kc(self, kind: str) -> int:
        m, l = (self.km, self.kl) if kind == "k" else (self.vm, self.vl)
        return 2 ** l if m == KERNEL_SCALAR else 256

    def groups(self, kind: str) -> int:
        return self.d // self.kvec(kind)

    def code_bytes(self, kind: str) -> int:
        m, l = (self.km, self.kl) if kind == "k" else (self.vm, self.vl)
        return self.d * l if m == KERNEL_SCALAR else 8 * self.d // l

    def table_bytes(self, kind: str) -> int:
        return self.groups(kind) * self.kc(kind) * self.kvec(kind) * 2

    @property
    def vmap(self) -> int:  # the chunk of v_channel's map
        return self.vl if self.vm == KERNEL_TOKEN_VECTOR else 4

    @property
    def xchg(self) -> bool:
        return self.wpt > 1 or self.outliers


def _code_path(q) -> tuple[int, int]:
    cl = q.code_layout
    v = cl.kernel_variant
    return v, (cl.code_bits if v == KERNEL_SCALAR else cl.vec_dim)


def default_threads(km: int, vm: int) -> int:
    return THREADS_TEMPORAL if km == vm == KERNEL_TOKEN_VECTOR else THREADS


def variant_of(lc, vskew: bool = True, threads: int | None = None) -> Variant:
    (km, kl), (vm, vl) = _code_path(lc.k), _code_path(lc.v)
    return Variant(km, kl, vm, vl, lc.layout.head_dim, bool(lc.layout.outliers), lc.dtype == torch.bfloat16, vskew,
                   threads or default_threads(km, vm))


def unsupported(lc, num_query_heads: int | None = None) -> str | None:
    """Why the CUDA kernel cannot decode this layer cache (None: it can)."""
    if lc.kernel_blocker:
        return lc.kernel_blocker
    if lc.dtype not in (torch.float16, torch.bfloat16):
        return "the CUDA kernel serves a half-precision model"
    bs = lc.layout.block_size
    if bs & (bs - 1):
        return f"the CUDA kernel serves pages of a power-of-two size, not {bs} tokens (it shifts, never divides)"
    D = lc.layout.head_dim
    if D not in (64, 128):
        return f"the CUDA kernel serves head_dim 64 or 128, not {D} (two 128-channel codebooks fill shared memory)"
    for q in (lc.k, lc.v):
        v, l = _code_path(q)
        if v not in (KERNEL_TOKEN_VECTOR, KERNEL_CHANNEL_VECTOR, KERNEL_SCALAR) or (v != KERNEL_SCALAR and l not in (2, 4, 8)):
            return f"no CUDA code path for {q.code_layout}"
    H = lc.k.codec.centroids.shape[0]
    if num_query_heads is not None and num_query_heads % H or (num_query_heads or H) // H > GQP:
        return f"the CUDA kernel serves up to {GQP} query heads per KV head"
    kmax = float((lc.k.codec.centroids.float().abs().amax() * lc.k.stats.std.abs().amax()
                  + lc.k.stats.mean.abs().amax()))
    if kmax > FP16_MAX_K:
        return f"decoded keys may reach {kmax:.3g}: beyond the fp16 range the CUDA kernel computes keys in"
    return None


# ---- tables ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Tables:
    """Everything the kernels read besides pages, queries and block tables, on one device."""

    kcb: torch.Tensor  # fp16 codebooks, flat per head: [H, G * KC * vec]
    vcb: torch.Tensor
    kmean: torch.Tensor  # [H, D] float32
    kstd: torch.Tensor
    vmean: torch.Tensor
    vstd: torch.Tensor
    vinv: torch.Tensor
    dt_cos: torch.Tensor  # [TILE, D/2]: Rope.cos_sin of offsets 0..31 (with the RoPE attention scale)
    dt_sin: torch.Tensor
    base_cos: torch.Tensor  # [n_base, D/2]: cos_sin of tile starts 32 t, scale divided out
    base_sin: torch.Tensor
    base_cs: torch.Tensor  # [n_base, D/4, 2] int32 (fp16 pairs): (cos c, cos c+4), (sin c, sin c+4)


def _f16_pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int32 whose low half is fp16(a), high half fp16(b) (the kernel's __half2 order)."""
    lo = a.half().view(torch.int16).to(torch.int32) & 0xFFFF
    hi = b.half().view(torch.int16).to(torch.int32) & 0xFFFF
    return (lo | (hi << 16)).to(torch.int32)


def rope_tables(rope, D: int, n_base: int, device) -> dict[str, torch.Tensor]:
    HD = D // 2
    if rope is None:  # a unit test's cache that never rotates: identity
        one, zero = torch.ones(TILE, HD), torch.zeros(TILE, HD)
        bc, bs = torch.ones(n_base, HD), torch.zeros(n_base, HD)
    else:
        cos, sin = rope.cos_sin(torch.arange(TILE))
        one, zero = cos[:, 0, :HD].float().cpu(), sin[:, 0, :HD].float().cpu()
        cb, sb = rope.cos_sin(torch.arange(n_base) * TILE)
        bc, bs = cb[:, 0, :HD].float().cpu() / rope.scale, sb[:, 0, :HD].float().cpu() / rope.scale
    e = torch.arange(HD // 2)
    c = 8 * (e // 4) + e % 4
    base_cs = torch.stack([_f16_pairs(bc[:, c], bc[:, c + 4]), _f16_pairs(bs[:, c], bs[:, c + 4])], -1)
    f = lambda t: t.contiguous().to(device)  # noqa: E731
    return dict(dt_cos=f(one), dt_sin=f(zero), base_cos=f(bc), base_sin=f(bs), base_cs=f(base_cs))


def make_tables(lc, n_base: int, device) -> Tables:
    H = lc.k.codec.centroids.shape[0]
    f32 = lambda t: t.float().contiguous().to(device)  # noqa: E731
    cb = lambda q: q.codec.centroids.half().reshape(H, -1).contiguous().to(device)  # noqa: E731
    ks, vs = lc.k.stats, lc.v.stats
    return Tables(cb(lc.k), cb(lc.v), f32(ks.mean), f32(ks.std), f32(vs.mean), f32(vs.std), f32(vs.inv_std),
                  **rope_tables(lc.rope, lc.layout.head_dim, n_base, device))


# ---- launch shape -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SmemPlan:
    units: int
    threads: int
    stage_bytes: int
    off_stage: int
    off_xchg: int
    off_pbuf: int
    off_corr: int
    off_q: int
    off_merge: int
    bytes: int


def _align(x: int, a: int = 16) -> int:
    return -(-x // a) * a


def smem_plan(v: Variant, units: int) -> SmemPlan:
    """decode.cu's dynamic shared memory for ``units`` tile units (WPT warps each)."""
    warps = units * v.wpt
    off = _align(v.table_bytes("k") + v.table_bytes("v"))
    stage_bytes = 4 * (v.code_bytes("k") + v.code_bytes("v"))
    off_stage = off
    off += units * 2 * stage_bytes
    off_xchg = off
    if v.xchg:
        off += units * 2 * v.wpt * 256 * 4
    off_pbuf = off_corr = off_q = off
    if v.outliers:
        off_pbuf = off
        off += warps * 256 * 4
        off_corr = off
        off += warps * SLICE * GQP * 4
        off_q = off
        off += GQP * v.d * 4
    merge = units * GQP * (v.d + 2) * 4
    # the merge area may alias the stages and score exchanges (idle once every unit is done), never the outlier
    # buffers: the loop that writes it still reads each warp's V corrections
    off_merge = off_stage if merge <= off_pbuf - off_stage else off
    end = max(off, off_merge + merge)
    return SmemPlan(units, warps * 32, stage_bytes, off_stage, off_xchg, off_pbuf, off_corr, off_q, off_merge,
                    _align(end))


def choose_units(v: Variant, smem_limit: int) -> SmemPlan:
    """The most tile units (up to the variant's threads) whose shared memory fits."""
    for units in range(v.threads // (32 * v.wpt), 0, -1):
        plan = smem_plan(v, units)
        if plan.bytes <= smem_limit:
            return plan
    raise ValueError(f"{v.name}: even one unit needs {smem_plan(v, 1).bytes} bytes of shared memory "
                     f"(limit {smem_limit})")


def num_splits(R: int, H: int, max_tiles: int, units: int, sms: int) -> int:
    """Splits per (request, KV head): one CTA per SM (their codebooks fill it), one wave when R * H allows, at
    least one tile per unit."""
    s = max(1, sms // max(1, R * H))
    return max(1, min(s, -(-max_tiles // units)))


@dataclasses.dataclass(frozen=True)
class Launch:
    variant: Variant
    plan: SmemPlan
    R: int
    H: int
    GQ: int
    S: int
    tiles_per_split: int
    n_base: int
    cap: int


def make_launch(lc, R: int, HQ: int, max_tokens: int, *, sms: int = 132, smem_limit: int = SMEM_LIMITS[(9, 0)],
                splits: int | None = None, units: int | None = None, vskew: bool = True,
                threads: int | None = None) -> Launch:
    lay: PageLayout = lc.layout
    v = variant_of(lc, vskew, threads)
    H = lc.k.codec.centroids.shape[0]
    plan = smem_plan(v, units) if units else choose_units(v, smem_limit)
    max_tiles = max(1, -(-max_tokens // TILE))
    S = splits or num_splits(R, H, max_tiles, plan.units, sms)
    return Launch(v, plan, R, H, HQ // H, S, -(-max_tiles // S), max_tiles, lay.cap)


def page_offsets(lay: PageLayout) -> dict[str, int]:
    return dict(rec_bytes=lay.bytes, k_codes=lay.k_codes, v_codes=lay.v_codes, k_idx=lay.k_idx, k_val=lay.k_val,
                v_idx=lay.v_idx, v_val=lay.v_val)


def exact_rows(n: int) -> tuple[int, int, int]:
    """(sinks, tail tokens, cend) a query at position n - 1 reads exactly: paged_torch's own-block rule."""
    pos = n - 1
    cend = pos // BLOCK_TOKENS * BLOCK_TOKENS
    return (min(pos, SINK_TOKENS), pos - cend if pos >= SINK_TOKENS else 0, cend)


def qk_scale(scale: float) -> float:
    return float(scale) * math.log2(math.e)
