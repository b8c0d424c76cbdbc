"""The CUDA decode kernel (csrc/cuda/decode.cu) replayed on the CPU, warp by warp, with torch tensors of 32 lanes.

What it models, the way the kernel does it: every CTA's shared memory as bytes (the codebooks in their swizzled
layout, the code stages the cp.async copies fill), every shared-memory load by its per-lane byte addresses (and
counts its wavefronts: ``LoadStats``), every register as its 32-bit pattern (fp16 pairs, byte permutes, the
mma.sync m16n8k16 / movmatrix fragment layouts of the PTX ISA), the fp16 key math, the base-2 online softmax, the
unit and split merges by log-sum-exp, and the exact tokens of the merge kernel.  Tested against
``paged_torch.paged_attention`` (tests/test_cuda_kernel.py): if the lane maps, the swizzle or the fragment
assembly were wrong, the outputs would be.

Bank model (NVIDIA, 32 banks of 4 bytes): a warp's load is served in phases - 32 lanes for accesses of up to 4
bytes, 16 (half-warps) for 8 bytes, 8 for 16 bytes - and a phase takes as many wavefronts as the largest number of
distinct 4-byte words one bank must deliver (the same word to several lanes is one).  ``ideal``: one wavefront
per phase that has active lanes.

Each function mirrors its namesake in csrc/cuda/*.cuh; keep them in step.  Cheap to import (torch only)."""

from __future__ import annotations

import collections
import dataclasses
import math

import torch

from . import cuda_plan as P
from ..layout import TAIL_SLOT0 as TAIL0
from ..methods import BLOCK_TOKENS as BLOCK, KERNEL_CHANNEL_VECTOR as CHANNEL, KERNEL_SCALAR as SCALAR
from ..methods import KERNEL_TOKEN_VECTOR as TEMPORAL, SINK_TOKENS as SINKS

TILE, GQP, SLICE = P.TILE, P.GQP, P.SLICE
OPS: collections.Counter = collections.Counter()  # warp instructions the emulated program issues, by kind
LANE = torch.arange(32, dtype=torch.int64)
NL, JL = LANE >> 2, LANE & 3  # the mma groupID / threadID_in_group of each lane
NEG_INF = float("-inf")


# ---- maps (csrc/cuda/maps.cuh): ints or int64 tensors --------------------------------------------------------

def row_token(mt, rho):
    return 4 * (rho & 7) + 2 * mt + (rho >> 3)


def k_channel(u, kc, j, o, HD):
    return 32 * u + 8 * j + 4 * (o & 1) + kc + (o >> 1) * HD


def k_option(s, n):
    return (s + n) & 3


def k_slot(o, n):
    return (o - n) & 3


def unskew_selector(oa, ob, n):
    ha, hb = k_slot(oa, n), k_slot(ob, n)
    return (2 * ha) | ((2 * ha + 1) << 4) | ((2 * hb) << 8) | ((2 * hb + 1) << 12)


def v_channel(uv, cp, o, n, vl):
    nr = 16 // vl
    return SLICE * uv + vl * (4 * (n % nr) + o) + n // nr + cp * (8 // nr)


def v_option(s, j, skew):
    return (s ^ j) if skew else s + 0 * j


def swz(g, G):
    if G < 4:
        return g
    if isinstance(g, torch.Tensor):
        return torch.where(g >= G // 2, g ^ (G // 4), g)
    return g ^ (G // 4) if g >= G // 2 else g


def entry_index(g, code, G):
    return code * G + swz(g, G)


# ---- registers: 32-bit patterns in int64 tensors [32] -----------------------------------------------------------

def _h(u):  # low / high fp16 of each lane's register, as float32
    lo = (u & 0xFFFF).to(torch.int16 if False else torch.int32)
    lo = torch.where(lo >= 0x8000, lo - 0x10000, lo).to(torch.int16).view(torch.float16).float()
    hi = ((u >> 16) & 0xFFFF).to(torch.int32)
    hi = torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16).view(torch.float16).float()
    return lo, hi


def _bits16(x: torch.Tensor) -> torch.Tensor:  # float -> fp16 (round to nearest even) bits as int64
    return x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF


def pack_h2(a, b):
    return _bits16(a) | (_bits16(b) << 16)


def hfma2(a, b, c):
    OPS["hfma2"] += 1
    (a0, a1), (b0, b1), (c0, c1) = _h(a), _h(b), _h(c)
    return pack_h2(a0 * b0 + c0, a1 * b1 + c1)


def hmul2(a, b):
    OPS["hmul2"] += 1
    (a0, a1), (b0, b1) = _h(a), _h(b)
    return pack_h2(a0 * b0, a1 * b1)


def hneg2(a):
    return a ^ 0x80008000


def low2half2(a):
    return (a & 0xFFFF) | ((a & 0xFFFF) << 16)


def high2half2(a):
    return (a >> 16) | (a & 0xFFFF0000)


def prmt(a, b, sel):
    """__byte_perm: result byte i = byte (sel nibble i & 7) of (a, b)."""
    OPS["prmt"] += 1
    x = (b.to(torch.int64) << 32) | a.to(torch.int64)
    sel = torch.as_tensor(sel, dtype=torch.int64)
    out = torch.zeros_like(x)
    for i in range(4):
        k = (sel >> (4 * i)) & 7
        out |= ((x >> (8 * k)) & 0xFF) << (8 * i)
    return out


def half_bits_to_float(u, bf16: bool):
    u = u.to(torch.int32) & 0xFFFF
    if bf16:
        return (u << 16).view(torch.float32)
    return torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16).view(torch.float16).float()


# ---- mma.sync fragment layouts (PTX ISA, m16n8k16 .f16, .f32 accumulators) --------------------------------------

def mma16816(d, a, b0, b1):
    """d [32, 4] float32 += A B for A fragments a (4 registers [32]) and B fragments b0, b1."""
    OPS["mma"] += 1
    g, t = NL, JL
    A = torch.zeros(16, 16)
    for r, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        lo, hi = _h(a[r])
        A[g + dr, 2 * t + dc], A[g + dr, 2 * t + 1 + dc] = lo, hi
    B = torch.zeros(16, 8)
    for r, dk in enumerate((0, 8)):
        lo, hi = _h((b0, b1)[r])
        B[2 * t + dk, g], B[2 * t + 1 + dk, g] = lo, hi
    C = torch.zeros(16, 8)
    C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = d[:, 0], d[:, 1], d[:, 2], d[:, 3]
    Dm = A @ B + C
    return torch.stack([Dm[g, 2 * t], Dm[g, 2 * t + 1], Dm[g + 8, 2 * t], Dm[g + 8, 2 * t + 1]], 1)


def movmatrix_trans(x):
    OPS["movmatrix"] += 1
    M = torch.zeros(8, 8)
    lo, hi = _h(x)
    M[NL, 2 * JL], M[NL, 2 * JL + 1] = lo, hi
    T = M.t()
    return pack_h2(T[NL, 2 * JL], T[NL, 2 * JL + 1])


def shfl_xor(x, o):
    OPS["shfl"] += 1
    return x[LANE ^ o]


# ---- shared memory ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoadStats:
    instructions: int = 0
    wavefronts: int = 0
    ideal: int = 0

    def add(self, other: "LoadStats") -> None:
        self.instructions += other.instructions
        self.wavefronts += other.wavefronts
        self.ideal += other.ideal


def wavefronts(addr: list[int], size: int, active: list[bool]) -> tuple[int, int]:
    """(wavefronts, ideal) of one warp-wide shared load of ``size`` bytes per lane."""
    phase = 32 if size <= 4 else (16 if size == 8 else 8)
    got = ideal = 0
    for p0 in range(0, 32, phase):
        words = {w for lane in range(p0, p0 + phase) if active[lane]
                 for w in range(addr[lane] // 4, (addr[lane] + size - 1) // 4 + 1)}
        if words:
            got += max(collections.Counter(w % 32 for w in words).values())
            ideal += 1
    return got, ideal


class Smem:
    """One CTA's shared memory; ``load`` returns each lane's value(s) as 32-bit patterns and counts wavefronts."""

    def __init__(self, nbytes: int, stats: dict[str, LoadStats]):
        self.mem = torch.zeros(nbytes, dtype=torch.uint8)
        self.stats = stats

    def load(self, site: str, addr, size: int, active=None):
        addr = torch.as_tensor(addr, dtype=torch.int64).expand(32)
        act = torch.ones(32, dtype=torch.bool) if active is None else torch.as_tensor(active).expand(32)
        st = self.stats.setdefault(site, LoadStats())
        w, i = wavefronts(addr.tolist(), size, act.tolist())
        OPS[f"lds{size}"] += 1
        st.instructions += 1
        st.wavefronts += w
        st.ideal += i
        by = self.mem[addr[:, None] + torch.arange(size)].to(torch.int64)  # [32, size]
        if size < 4:
            return sum(by[:, k] << (8 * k) for k in range(size))
        by = by.view(32, size // 4, 4)
        words = by[..., 0] | (by[..., 1] << 8) | (by[..., 2] << 16) | (by[..., 3] << 24)
        return words[:, 0] if size == 4 else [words[:, k] for k in range(size // 4)]

    def write(self, off: int, data: torch.Tensor) -> None:
        b = data.contiguous().view(torch.uint8).flatten()
        self.mem[off: off + b.numel()] = b


# ---- the kernel's program ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class KConst:
    base: list  # [4] lane tensors
    gb: list  # [4][2]
    sm: list  # [4][4]
    cf: list  # [2][4][2][2]
    sel_lo: torch.Tensor
    sel_hi: torch.Tensor


def k_const_init(v: P.Variant, u: int, h: int, T: P.Tables) -> KConst:
    D, HD = v.d, v.d // 2
    n, j = NL, JL
    kmean, kstd = T.kmean[h].cpu(), T.kstd[h].cpu()
    dtc, dts = T.dt_cos.cpu(), T.dt_sin.cpu()
    KG = v.groups("k")
    base, gb, sm = [], [], []
    for s in range(4):
        o = k_option(s, n)
        b = k_channel(u, 0, j, o, HD)
        base.append(b)
        row = []
        if v.km != SCALAR:
            EB = 2 * v.kvec("k")
            for x in range(2):
                g = b // 2 + x if v.kl == 2 else b // v.kl
                off = swz(g, KG) * EB
                if v.km == TEMPORAL and v.kl == 8:
                    off = off + (n & 1) * 8
                if v.km == CHANNEL and v.kl == 8:
                    off = off + (o & 1) * 8
                row.append(off)
        gb.append(row)
        if v.km == TEMPORAL:
            sm.append([pack_h2(kstd[b + kc], kmean[b + kc]) for kc in range(4)])
        else:
            r = []
            for kp in range(2):
                c = b + 2 * kp
                r += [pack_h2(kstd[c], kstd[c + 1]), pack_h2(kmean[c], kmean[c + 1])]
            sm.append(r)
    cf = [[[[None, None] for _ in range(2)] for _ in range(4)] for _ in range(2)]
    for sp in range(2):
        sg = torch.where(k_option(sp, n) < 2, -1.0, 1.0)
        i0 = base[sp] % HD
        if v.km == TEMPORAL:
            for kc in range(4):
                for mt in range(2):
                    dt, i = 4 * n + 2 * mt, i0 + kc
                    cf[sp][kc][mt] = [pack_h2(dtc[dt, i], dtc[dt + 1, i]), pack_h2(sg * dts[dt, i], sg * dts[dt + 1, i])]
        else:
            for kp in range(2):
                for q in range(4):
                    dt, i = 4 * n + q, i0 + 2 * kp
                    cf[sp][2 * kp + (q >> 1)][q & 1] = [pack_h2(dtc[dt, i], dtc[dt, i + 1]),
                                                         pack_h2(sg * dts[dt, i], sg * dts[dt, i + 1])]
    return KConst(base, gb, sm, cf, unskew_selector(0, 1, n), unskew_selector(2, 3, n))


def denorm_bcast(x, smv):
    return hfma2(x, low2half2(smv), high2half2(smv))


def denorm_pair(x, sd, mn):
    return hfma2(x, sd, mn)


def rope_pair(x, y, f):
    c, s = f
    return hfma2(y, s, hmul2(x, c)), hfma2(hneg2(x), s, hmul2(y, c))


def k_fragment(s0n, s1n, s2n, s3n, s0m, s1m, s2m, s3m, pick_n, pick_m, sel_lo, sel_hi):
    x, y = prmt(s0n, s1n, pick_n), prmt(s2n, s3n, pick_n)
    xp, yp = prmt(s0m, s1m, pick_m), prmt(s2m, s3m, pick_m)
    return [prmt(x, y, sel_lo), prmt(xp, yp, sel_lo), prmt(x, y, sel_hi), prmt(xp, yp, sel_hi)]


def k_temporal_words(v, sm: Smem, stg: int, k: KConst):
    n = NL
    blk = stg + (n >> 1) * v.code_bytes("k")
    cw = []
    for s in range(4):
        if v.kl == 2:
            cw.append([sm.load("k.codes", blk + (2 * (n & 1) + mt) * v.d + k.base[s], 4) for mt in range(2)])
        else:
            row = (n & 1) if v.kl == 4 else 0
            w = sm.load("k.codes", blk + row * v.d + k.base[s], 4)
            cw.append([w, w])
    return cw


def k_temporal_chunk(v, sm: Smem, tab: int, kc: int, k: KConst, cw):
    EB = 2 * v.kl
    ROW = v.groups("k") * EB
    kd = []
    for s in range(4):
        if v.kl == 2:
            kd.append([sm.load("k.gather", tab + k.gb[s][kc >> 1] + ((cw[s][mt] >> (8 * kc)) & 0xFF) * ROW, 4)
                       for mt in range(2)])
        else:
            code = (cw[s][0] >> (8 * kc)) & 0xFF
            x, y = sm.load("k.gather", tab + k.gb[s][0] + code * ROW, 8)
            kd.append([x, y])
    return kd


def k_temporal_mma(v, sm, tab, kc, k, cw, qb, S):
    kd = k_temporal_chunk(v, sm, tab, kc, k, cw)
    kd = [[denorm_bcast(kd[s][mt], k.sm[s][kc]) for mt in range(2)] for s in range(4)]
    for sp in range(2):
        for mt in range(2):
            kd[sp][mt], kd[sp + 2][mt] = rope_pair(kd[sp][mt], kd[sp + 2][mt], k.cf[sp][kc][mt])
    for mt in range(2):
        a = k_fragment(kd[0][mt], kd[1][mt], kd[2][mt], kd[3][mt], kd[0][mt], kd[1][mt], kd[2][mt], kd[3][mt],
                       0x5410, 0x7632, k.sel_lo, k.sel_hi)
        S[mt] = mma16816(S[mt], a, qb[kc][0], qb[kc][1])


def k_channel_gather(v, sm: Smem, stg: int, tab: int, k: KConst):
    n = NL
    blk = stg + (n >> 1) * v.code_bytes("k")
    G = [[[None, None] for _ in range(4)] for _ in range(4)]
    for s in range(4):
        for q in range(4):
            tr = 4 * (n & 1) + q
            if v.km == CHANNEL:
                EB, L = 2 * v.kl, v.kl
                ROW = v.groups("k") * EB
                row = blk + tr * (v.d // L)
                if L == 2:
                    w = sm.load("k.codes", row + k.base[s] // 2, 2)
                    G[s][q][0] = sm.load("k.gather", tab + k.gb[s][0] + (w & 0xFF) * ROW, 4)
                    G[s][q][1] = sm.load("k.gather", tab + k.gb[s][1] + (w >> 8) * ROW, 4)
                else:
                    code = sm.load("k.codes", row + k.base[s] // L, 1)
                    G[s][q][0], G[s][q][1] = sm.load("k.gather", tab + k.gb[s][0] + code * ROW, 8)
            else:
                B, KC = v.kl, v.kc("k")
                row = blk + tr * (v.d * B // 8)
                bit = k.base[s] * B
                if B == 4:
                    w = sm.load("k.codes", row + bit // 8, 2)
                else:
                    w = sm.load("k.codes", row + bit // 8, 1) >> (bit % 8)
                vals = [sm.load("k.gather", tab + 2 * (((w >> (B * kc)) & (KC - 1)) * v.d + swz(k.base[s] + kc, v.d)), 2)
                        for kc in range(4)]
                G[s][q][0] = vals[0] | (vals[1] << 16)
                G[s][q][1] = vals[2] | (vals[3] << 16)
    return G


def k_channel_mma(v, sm, stg, tab, k, qb, S):
    G = k_channel_gather(v, sm, stg, tab, k)
    for s in range(4):
        for q in range(4):
            for kp in range(2):
                G[s][q][kp] = denorm_pair(G[s][q][kp], k.sm[s][2 * kp], k.sm[s][2 * kp + 1])
    for sp in range(2):
        for q in range(4):
            for kp in range(2):
                G[sp][q][kp], G[sp + 2][q][kp] = rope_pair(G[sp][q][kp], G[sp + 2][q][kp],
                                                           k.cf[sp][2 * kp + (q >> 1)][q & 1])
    for kc in range(4):
        for mt in range(2):
            kp, qn, qm = kc >> 1, 2 * mt, 2 * mt + 1
            pick = 0x7632 if kc & 1 else 0x5410
            a = k_fragment(G[0][qn][kp], G[1][qn][kp], G[2][qn][kp], G[3][qn][kp], G[0][qm][kp], G[1][qm][kp],
                           G[2][qm][kp], G[3][qm][kp], pick, pick, k.sel_lo, k.sel_hi)
            S[mt] = mma16816(S[mt], a, qb[kc][0], qb[kc][1])


def _z_at(v, kind: str, sm: Smem, stg: int, tab: int, b: int, tb: int, c: int) -> float:
    """k_z_at / v_z_at (one lane: not counted as a warp load)."""
    m, l = (v.km, v.kl) if kind == "k" else (v.vm, v.vl)
    D, cb = v.d, v.code_bytes(kind)
    blk = stg + b * cb
    mem = sm.mem
    if m == TEMPORAL:
        code = int(mem[blk + (tb // l) * D + c])
        e = entry_index(c // l, code, v.groups(kind)) * l + tb % l
    elif m == CHANNEL:
        code = int(mem[blk + tb * (D // l) + c // l])
        e = entry_index(c // l, code, v.groups(kind)) * l + c % l
    else:
        bit = c * l
        code = (int(mem[blk + tb * (D * l // 8) + bit // 8]) >> (bit % 8)) & (2 ** l - 1)
        e = code * D + swz(c, D)
    return float(mem[tab + 2 * e: tab + 2 * e + 2].view(torch.float16)[0])


def v_gather(v, sm: Smem, stg: int, tab: int, uv: int, cp: int):
    n, j = NL, JL
    blk = stg + j * v.code_bytes("v")
    vd = []
    for s in range(4):
        c = v_channel(uv, cp, v_option(s, j, v.vskew), n, v.vmap)
        if v.vm == TEMPORAL:
            L = v.vl
            EB = 2 * L
            ROW = v.groups("v") * EB
            gofs = swz(c // L, v.groups("v")) * EB
            if L == 8:
                code = sm.load("v.codes", blk + c, 1)
                vd.append(sm.load("v.gather", tab + gofs + code * ROW, 16))
            elif L == 4:
                row = []
                for r in range(2):
                    code = sm.load("v.codes", blk + r * v.d + c, 1)
                    row += sm.load("v.gather", tab + gofs + code * ROW, 8)
                vd.append(row)
            else:
                vd.append([sm.load("v.gather", tab + gofs + sm.load("v.codes", blk + r * v.d + c, 1) * ROW, 4)
                           for r in range(4)])
        else:
            vals = []
            for tr in range(8):
                if v.vm == CHANNEL:
                    L = v.vl
                    code = sm.load("v.codes", blk + tr * (v.d // L) + c // L, 1)
                    vals.append(sm.load("v.gather", tab + 2 * (entry_index(c // L, code, v.groups("v")) * L + c % L), 2))
                else:
                    B, KC = v.vl, v.kc("v")
                    bit = c * B
                    code = (sm.load("v.codes", blk + tr * (v.d * B // 8) + bit // 8, 1) >> (bit % 8)) & (KC - 1)
                    vals.append(sm.load("v.gather", tab + 2 * (code * v.d + swz(c, v.d)), 2))
            vd.append([vals[2 * q] | (vals[2 * q + 1] << 16) for q in range(4)])
    return vd


def v_unskew(v, vd):
    if not v.vskew:
        return vd
    b0, b1 = (JL & 1).bool(), (JL & 2).bool()
    OPS["sel"] += 32  # two select layers over 16 registers
    out = [[None] * 4 for _ in range(4)]
    for q in range(4):
        t = [torch.where(b0, vd[s ^ 1][q], vd[s][q]) for s in range(4)]
        for s in range(4):
            out[s][q] = torch.where(b1, t[s ^ 2], t[s])
    return out


def v_mma(acc, vd, o0, bp):
    for mt in range(2):
        a = [prmt(vd[o0][mt], vd[o0][2 + mt], 0x5410), prmt(vd[o0 + 1][mt], vd[o0 + 1][2 + mt], 0x5410),
             prmt(vd[o0][mt], vd[o0][2 + mt], 0x7632), prmt(vd[o0 + 1][mt], vd[o0 + 1][2 + mt], 0x7632)]
        acc = mma16816(acc, a, bp[mt][0], bp[mt][1])
    return acc


def frag_slot(T, g):  # [2 m-tiles][32 lanes][4]: one float4 per lane and m-tile (conflict-free 16-byte accesses)
    n, mt, rh = T >> 2, (T >> 1) & 1, T & 1
    return mt * 128 + (4 * n + (g >> 1)) * 4 + 2 * rh + (g & 1)


# ---- one decode step ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    out: torch.Tensor  # [R, HQ, D] in the model dtype
    stats: dict[str, LoadStats]  # per load site, over every warp of the launch
    launch: P.Launch
    ops: dict[str, int] = dataclasses.field(default_factory=dict)  # emulated warp instructions by kind
    warp_tiles: int = 0  # (warp, tile) pairs the decode kernel ran


def _f16_codebook_bytes(v: P.Variant, kind: str, cb: torch.Tensor) -> torch.Tensor:
    """One head's codebook as the kernel's load_table lays it out in shared memory."""
    m = v.km if kind == "k" else v.vm
    if m == SCALAR:  # [D][KC] -> code-major [KC][swz(D)]
        t = cb.half().view(v.d, v.kc(kind)).t()
        out = torch.empty_like(t)
        out[:, swz(torch.arange(v.d), v.d)] = t
        return out.contiguous()
    G, KC, vec = v.groups(kind), v.kc(kind), v.kvec(kind)
    src = cb.half().view(G, KC, vec)
    dst = torch.zeros(G * KC, vec, dtype=torch.float16)
    g = torch.arange(G)[:, None].expand(G, KC)
    code = torch.arange(KC)[None, :].expand(G, KC)
    dst[entry_index(g, code, G).flatten()] = src.reshape(-1, vec)
    return dst


@torch.no_grad()
def paged_attention(lc, pages, query, key, value, query_start_loc, seq_lens, block_tables, scale, *,
                    splits: int | None = None, units: int | None = None, vskew: bool = True,
                    sms: int = 132) -> Result:
    """Emulate ops.cuda.paged_attention on CPU tensors (decode: one query token per request)."""
    R, HQ, D = query.shape
    lay = lc.layout
    OPS.clear()
    cap_tokens = block_tables.shape[1] * lay.block_size
    L = P.make_launch(lc, R, HQ, cap_tokens, sms=sms, splits=splits, units=units, vskew=vskew)
    v, plan = L.variant, L.plan
    T = P.make_tables(lc, L.n_base, "cpu")
    H, GQ, S = L.H, L.GQ, L.S
    HD, WPT = D // 2, v.wpt
    bf16 = v.bf16
    qscale = P.qk_scale(scale)
    qbits = query.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    pages = pages.contiguous()
    bt = block_tables.to(torch.int64)
    lens = seq_lens.tolist()
    stats: dict[str, LoadStats] = {}
    part_acc = torch.zeros(R, H, S, GQP, D)
    part_ml = torch.zeros(R, H, S, GQP, 2)
    kcb_s = [_f16_codebook_bytes(v, "k", T.kcb[h]) for h in range(H)]
    vcb_s = [_f16_codebook_bytes(v, "v", T.vcb[h]) for h in range(H)]
    kconsts = {(h, u): k_const_init(v, u, h, T) for h in range(H) for u in range(WPT)}
    base_cs = T.base_cs.to(torch.int64) & 0xFFFFFFFF
    tabK, tabV = 0, v.table_bytes("k")
    kcb_b, vcb_b = v.code_bytes("k"), v.code_bytes("v")

    for r in range(R):
        seq = lens[r]
        pos = seq - 1
        cend = pos // BLOCK * BLOCK if pos >= 0 else 0
        n_tiles = -(-cend // TILE) if cend > SINKS else 0
        for h in range(H):
            # query of head n at lane channels 32 u + 8 j + i and + HD, scaled, fp16 pairs
            qs = torch.zeros(GQP, D)
            qs[:GQ] = half_bits_to_float(qbits[r, h * GQ:(h + 1) * GQ], bf16) * qscale
            qh = {}
            for u in range(WPT):
                ch = 32 * u + 8 * JL[:, None] + torch.arange(8)  # [32, 8]
                live = ((NL < GQ) & (seq > 0))[:, None]
                ql = torch.where(live, qs[NL.clamp(max=GQP - 1)[:, None], ch], 0.0)
                qhi = torch.where(live, qs[NL.clamp(max=GQP - 1)[:, None], ch + HD], 0.0)
                qh[u] = [[pack_h2(ql[:, c], ql[:, 4 + c]), pack_h2(qhi[:, c], qhi[:, 4 + c])] for c in range(4)]
            for split in range(S):
                lo = split * L.tiles_per_split
                hi = min(lo + L.tiles_per_split, n_tiles)
                if lo >= hi:  # no tile: the CTA writes an empty partial (max -inf, sum 0)
                    part_ml[r, h, split, :, 0] = NEG_INF
                    continue
                sm = Smem(plan.bytes, stats)
                sm.write(tabK, kcb_s[h])
                sm.write(tabV, vcb_s[h])
                unit_res = []
                for unit in range(plan.units):
                    unit_res.append(_unit(v, plan, L, T, sm, pages, bt, r, h, unit, lo, hi, cend, tabK, tabV,
                                          kcb_b, vcb_b, kconsts, qh, qs, base_cs, lay, GQ))
                # CTA merge of the units
                for g in range(GQ):
                    ms = torch.tensor([u_[0][g] for u_ in unit_res])
                    M = float(ms.max())
                    w = torch.where(ms == NEG_INF, torch.zeros(()), torch.exp2(ms - M))
                    part_acc[r, h, split, g] = sum(w[u] * unit_res[u][2][g] for u in range(plan.units))
                    part_ml[r, h, split, g, 0] = M
                    part_ml[r, h, split, g, 1] = float(sum(w[u] * unit_res[u][1][g] for u in range(plan.units)))
    ops = dict(OPS)  # the decode kernel's (the merge kernel's exact rows are plain torch here)
    warp_tiles = ops.pop("_warp_tiles", 0)
    out = _merge(lc, v, L, T, pages, bt, query, key, value, lens, part_acc, part_ml, qscale)
    return Result(out, stats, L, ops, warp_tiles)


def _unit(v, plan, L, T, sm, pages, bt, r, h, unit, lo, hi, cend, tabK, tabV, kcb_b, vcb_b, kconsts, qh, qs,
          base_cs, lay, GQ):
    """One tile unit's walk over its tiles; returns (m [GQP], l [GQP], acc [GQP, D])."""
    D, HD, WPT = v.d, v.d // 2, v.wpt
    n, j = NL, JL
    stg = plan.off_stage + unit * 2 * plan.stage_bytes
    acc = {u: [torch.zeros(32, 4) for _ in range(4)] for u in range(WPT)}
    m = {u: [torch.full((32,), NEG_INF), torch.full((32,), NEG_INF)] for u in range(WPT)}
    lsum = {u: [torch.zeros(32), torch.zeros(32)] for u in range(WPT)}
    corr = {u: torch.zeros(SLICE, GQP) for u in range(WPT)}
    rec = lambda page: (page * L.H + h) * lay.bytes  # noqa: E731
    flat = pages.view(-1)
    it = 0
    t = lo + unit
    while t < hi:
        t0 = t * TILE
        cur = stg + (it & 1) * plan.stage_bytes
        # the stage as issue_codes fills it (valid blocks only; the rest keeps stale bytes)
        for b in range(4):
            tok = t0 + BLOCK * b
            if tok < SINKS or tok >= cend:
                continue
            page, slot = int(bt[r, tok // lay.block_size]), (tok % lay.block_size) // BLOCK
            a = rec(page)
            sm.mem[cur + b * kcb_b: cur + (b + 1) * kcb_b] = flat[a + lay.k_codes + slot * kcb_b:
                                                                  a + lay.k_codes + (slot + 1) * kcb_b]
            sm.mem[cur + 4 * kcb_b + b * vcb_b: cur + 4 * kcb_b + (b + 1) * vcb_b] = \
                flat[a + lay.v_codes + slot * vcb_b: a + lay.v_codes + (slot + 1) * vcb_b]
        outl = _outlier_entries(L, lay, flat, bt, r, h, t0, cend, v.bf16) if v.outliers else []
        stK, stV = cur, cur + 4 * kcb_b
        OPS["_warp_tiles"] += WPT
        xs = torch.zeros(WPT, 2, 32, 4)
        for u in range(WPT):
            kk = kconsts[(h, u)]
            row = base_cs[t].view(-1)  # [D/4 * 2]: entries 16u + 4j + kc
            qb = []
            for c in range(4):
                e = (16 * u + 4 * j + c) * 2
                cs, sn = row[e], row[e + 1]
                x, y = qh[u][c]
                qb.append([hfma2(y, sn, hmul2(x, cs)), hfma2(hneg2(x), sn, hmul2(y, cs))])
            S = [torch.zeros(32, 4), torch.zeros(32, 4)]
            if v.km == TEMPORAL:
                cw = k_temporal_words(v, sm, stK, kk)
                for c in range(4):
                    k_temporal_mma(v, sm, tabK, c, kk, cw, qb, S)
            else:
                k_channel_mma(v, sm, stK, tabK, kk, qb, S)
            xs[u] = torch.stack(S, 0)  # [2 m-tiles][32 lanes][4], decode.cu's exchange layout
            if v.outliers:
                _k_outliers(v, L, T, sm, stK, tabK, qs, xs[u].view(-1), h, t, u, outl)
        # pair sum, softmax, V: both warps compute the same softmax
        Ssum = xs.sum(0)
        tb = t0 + BLOCK * (n >> 1)
        valid = (tb >= SINKS) & (tb < cend)
        for u in range(WPT):
            Sm = [Ssum[0].clone(), Ssum[1].clone()]
            mx = [torch.full((32,), NEG_INF), torch.full((32,), NEG_INF)]
            for mt in range(2):
                for c in range(4):
                    mx[c & 1] = torch.where(valid, torch.maximum(mx[c & 1], Sm[mt][:, c]), mx[c & 1])
            alpha = [None, None]
            for i in range(2):
                for o in (4, 8, 16):
                    mx[i] = torch.maximum(mx[i], shfl_xor(mx[i], o))
                mn = torch.maximum(m[u][i], mx[i])
                alpha[i] = torch.where(mn == NEG_INF, torch.ones(()), torch.exp2(m[u][i] - mn))
                m[u][i] = mn
                lsum[u][i] = lsum[u][i] * alpha[i]
            pv = [torch.zeros(32, 4), torch.zeros(32, 4)]
            for mt in range(2):
                for c in range(4):
                    pv[mt][:, c] = torch.where(valid, torch.exp2(Sm[mt][:, c] - m[u][c & 1]), torch.zeros(()))
                    lsum[u][c & 1] = lsum[u][c & 1] + pv[mt][:, c]
            for ct in range(4):
                acc[u][ct] = acc[u][ct] * torch.stack([alpha[c & 1] for c in range(4)], 1)
            bp = [[movmatrix_trans(pack_h2(pv[mt][:, 0], pv[mt][:, 1])),
                   movmatrix_trans(pack_h2(pv[mt][:, 2], pv[mt][:, 3]))] for mt in range(2)]
            if v.outliers:
                pw = torch.stack(pv, 0).reshape(-1)
                g = torch.arange(GQP)
                a0 = alpha[0][g >> 1]
                a1 = alpha[1][g >> 1]
                corr[u] *= torch.where((g & 1).bool(), a1, a0)[None, :]
                _v_outliers(v, L, T, sm, stV, tabV, pw, corr[u], h, u, outl)
            for cp in range(2):
                vd = v_unskew(v, v_gather(v, sm, stV, tabV, u, cp))
                acc[u][2 * cp] = v_mma(acc[u][2 * cp], vd, 0, bp)
                acc[u][2 * cp + 1] = v_mma(acc[u][2 * cp + 1], vd, 2, bp)
        t += plan.units
        it += 1
    # the unit's result, as the kernel writes its merge area
    um, ul, ua = torch.full((GQP,), NEG_INF), torch.zeros(GQP), torch.zeros(GQP, D)
    for u in range(WPT):
        for i in range(2):
            for o in (4, 8, 16):
                lsum[u][i] = lsum[u][i] + shfl_xor(lsum[u][i], o)
        for ct in range(4):
            for c in range(4):
                g = 2 * j + (c & 1)
                ch = v_channel(u, ct >> 1, 2 * (ct & 1) + (c >> 1), n, v.vmap)
                a = acc[u][ct][:, c]
                if v.outliers:
                    a = a + corr[u][ch - SLICE * u, g]
                ua[g, ch] = a
        if u == 0:
            for i in range(2):
                um[2 * JL[:4] + i] = m[u][i][:4]
                ul[2 * JL[:4] + i] = lsum[u][i][:4]
    return um, ul, ua


def _outlier_entries(L, lay, flat, bt, r, h, t0, cend, bf16):
    """The tile's K and V outliers: (kind, tile block b, block-flat index, value) for live slots."""
    out = []
    for b in range(4):
        tok = t0 + BLOCK * b
        if tok < SINKS or tok >= cend:
            continue
        page, slot = int(bt[r, tok // lay.block_size]), (tok % lay.block_size) // BLOCK
        a = (page * L.H + h) * lay.bytes
        for kind, io, vo in (("k", lay.k_idx, lay.k_val), ("v", lay.v_idx, lay.v_val)):
            for kk in range(L.cap):
                at = (slot * L.cap + kk) * 2
                idx = int(flat[a + io + at: a + io + at + 2].view(torch.int16)[0])
                if idx < 0:
                    continue
                vb = flat[a + vo + at: a + vo + at + 2].view(torch.int16).to(torch.int64) & 0xFFFF
                out.append((kind, b, idx, float(half_bits_to_float(vb, bf16)[0])))
    return out


def _k_outliers(v, L, T, sm, stK, tabK, qs, xw, h, tile, u, outl):
    D, HD = v.d, v.d // 2
    for kind, b, idx, x in outl:
        if kind != "k":
            continue
        tb, c = idx // D, idx % D
        i = c % HD
        if v.wpt > 1 and i // 32 != u:
            continue
        y = _z_at(v, "k", sm, stK, tabK, b, tb, c) * float(T.kstd[h, c]) + float(T.kmean[h, c])
        delta = x - y
        Tt = 8 * b + tb
        cb, sb = float(T.base_cos[tile, i]), float(T.base_sin[tile, i])
        cd, sd = float(T.dt_cos[Tt, i]), float(T.dt_sin[Tt, i])
        cosp, sinp = cb * cd - sb * sd, sb * cd + cb * sd
        for g in range(L.GQ):
            q = qs[g]
            coef = q[c] * cosp + q[c + HD] * sinp if c < HD else q[c] * cosp - q[c - HD] * sinp
            xw[frag_slot(Tt, g)] += delta * float(coef)


def _v_outliers(v, L, T, sm, stV, tabV, pw, corr, h, uv, outl):
    D = v.d
    for kind, b, idx, x in outl:
        if kind != "v":
            continue
        tb, c = idx // D, idx % D
        if v.wpt > 1 and c // SLICE != uv:
            continue
        zd = _z_at(v, "v", sm, stV, tabV, b, tb, c)
        ze = (x - float(T.vmean[h, c])) * float(T.vinv[h, c])
        Tt = 8 * b + tb
        for g in range(L.GQ):
            corr[c - SLICE * uv, g] += float(pw[frag_slot(Tt, g)]) * (ze - zd)


def _merge(lc, v, L, T, pages, bt, query, key, value, lens, part_acc, part_ml, qscale):
    """tkv_merge: exact tokens + the splits, V denormalized once, rounded to the model dtype."""
    R, HQ, D = query.shape
    H, GQ, S = L.H, L.GQ, L.S
    lay = lc.layout
    from ..page_views import region_view

    region = region_view(lay, pages, lc.store_dtype)
    out = torch.zeros(R, HQ, D, dtype=lc.dtype)
    for r in range(R):
        n = lens[r]
        if n <= 0:
            continue
        nsink, ntail, cend = P.exact_rows(n)
        for h in range(H):
            rows_k, rows_v = [], []
            for e in range(nsink):
                rows_k.append(region[bt[r, 0], h, e, 0])
                rows_v.append(region[bt[r, 0], h, e, 1])
            for e in range(ntail):
                pg = bt[r, cend // lay.block_size]
                rows_k.append(region[pg, h, TAIL0 + e, 0])
                rows_v.append(region[pg, h, TAIL0 + e, 1])
            rows_k.append(key[r, h].to(lc.dtype))
            rows_v.append(value[r, h].to(lc.dtype))
            Ke, Ve = torch.stack(rows_k).float(), torch.stack(rows_v).float()
            for g in range(GQ):  # the splits, then the exact rows online (tkv_merge's order)
                q = query[r, h * GQ + g].float() * qscale
                ms, ls = part_ml[r, h, :, g, 0], part_ml[r, h, :, g, 1]
                mx = float(ms.max())
                w = torch.where(ms == NEG_INF, torch.zeros(()), torch.exp2(ms - mx))
                acc = (w[:, None] * (part_acc[r, h, :, g] * T.vstd[h] + ls[:, None] * T.vmean[h])).sum(0)
                lsum = float((w * ls).sum())
                for e in range(Ke.shape[0]):
                    d = float(Ke[e] @ q)
                    mn = max(mx, d)
                    a, we = math.exp2(mx - mn) if mx != NEG_INF else 0.0, math.exp2(d - mn)
                    lsum = lsum * a + we
                    acc = acc * a + we * Ve[e]
                    mx = mn
                out[r, h * GQ + g] = (acc / lsum).to(lc.dtype)
    return out
