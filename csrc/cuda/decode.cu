// vllm-temporalkv CUDA paged decode for the codebook formats (TemporalKV / ChannelKV / KVQuant): the twin of
// vllm_temporalkv/ops/triton_decode.py with each KV head's codebooks in shared memory.
//
//   tkv_decode  grid (splits, KV heads, requests), units x WPT warps (WPT = head_dim / 64).  A CTA copies its KV
//               head's K and V codebooks into shared memory (swizzled: maps.cuh), then each unit (1 or 2 warps)
//               walks 32-token tiles of the CTA's range: codes streamed into shared memory by cp.async one tile
//               ahead, centroids gathered per lane straight into mma fragments, x = z * std + mean and RoPE in
//               fp16 pairs, S^T = K Q^T and O^T = V^T P^T on tensor cores (m16n8k16, fp32 accumulators) for the
//               whole GQA group at once, online softmax in base 2.  Units merge in shared memory; the CTA writes
//               one partial (max, sum, sum p z) per query head.
//   tkv_merge   grid (requests, KV heads): the exact tokens (sinks, tail, new token) and the splits' merge.
//
// One variant per compilation (nvcc -D...): TKV_KM / TKV_KL (K code path 0 temporal, 1 channel, 2 scalar; chunk l
// or bits), TKV_VM / TKV_VL, TKV_D (64 or 128), TKV_OUTL (exact outliers), TKV_BF16 (model dtype bfloat16, else
// float16), TKV_VSKEW (skewed V gathers).  vllm_temporalkv/ops/cuda.py builds and caches them;
// vllm_temporalkv/ops/cuda_emulator.py replays the same thread program on the CPU.
#include "cfg.cuh"
#include "k_frag.cuh"
#include "merge.cuh"
#include "outliers.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "v_frag.cuh"

namespace tkvc {

// the KV head's codebooks -> shared memory (vector: swizzled entries; scalar: transposed to [KC][swz(D)], so that
// lanes reading different channels' codebooks - a channel and its rotary partner too - hit different banks)
template <int M, int VEC, int G, int KC, int D>
__device__ __forceinline__ void load_table(uint8_t* tab, const uint16_t* cb, int h) {
  if constexpr (M == SCALAR) {
    const uint16_t* src = cb + int64_t(h) * D * KC;  // [D][KC] as the codec stores it
    uint16_t* t16 = reinterpret_cast<uint16_t*>(tab);
    for (int i = threadIdx.x; i < D * KC; i += blockDim.x) t16[(i % KC) * D + swz(i / KC, D)] = src[i];
  } else {
    constexpr int EB = 2 * VEC;
    const uint16_t* src = cb + int64_t(h) * G * KC * VEC;
    // a warp copies 4 consecutive codes x 8 groups: 32-byte runs of the source (whole sectors) and 4 shared-memory
    // wavefronts per 8-byte copy (code-major, one entry per lane, put the 32 lanes 256 bytes apart: 32 wavefronts)
    static_assert(G % 8 == 0 && KC % 4 == 0, "table copy order");
    for (int e = threadIdx.x; e < G * KC; e += blockDim.x) {
      const int blk = e >> 5, sub = e & 31;
      const int code = (blk % (KC / 4)) * 4 + (sub & 3), g = (blk / (KC / 4)) * 8 + (sub >> 2);
      cp_async<EB>(tab + entry_index(g, code, G) * EB, src + (int64_t(g) * KC + code) * VEC);
    }
  }
}

// cp.async the code bytes of a tile's 4 blocks (K then V) into a stage; blocks outside [SINKS, cend) are skipped
// (their stale bytes are still valid codes; their scores are masked).  Unsigned, compile-time chunk counts and the
// page size as a shift (unsupported() refuses other sizes): a run-time division here cost ~200 instructions per
// warp-tile, a fifth of the loop (ncu, 2026-11-26).  hrec: this KV head's record in page 0.
template <class C>
__device__ __forceinline__ void issue_codes(const DecodeParams& p, uint8_t* stage, const int32_t* btr,
                                            const uint8_t* hrec, unsigned page_bytes, unsigned bsh, int t0, int cend,
                                            int ut) {
  constexpr unsigned NT = C::WPT * 32, PK = C::KCB / 16, PV = C::VCB / 16, CH = 4 * (PK + PV);
#pragma unroll
  for (unsigned c0 = 0; c0 < CH; c0 += NT) {
    const unsigned c = c0 + unsigned(ut);
    if (CH % NT != 0 && c >= CH) continue;
    const bool isv = c >= 4 * PK;
    const unsigned cc = isv ? c - 4 * PK : c;
    const unsigned b = isv ? cc / PV : cc / PK;
    const unsigned off = (isv ? cc % PV : cc % PK) * 16;
    const int tok = t0 + BLOCK * int(b);
    if (tok < SINKS || tok >= cend) continue;
    const unsigned page = unsigned(btr[unsigned(tok) >> bsh]);
    const unsigned slot = (unsigned(tok) & ((1u << bsh) - 1)) / BLOCK;
    const uint8_t* rec = hrec + uint64_t(page) * page_bytes;  // one IMAD.WIDE.U32: a page is < 4 GiB
    if (isv) cp_async<16>(stage + 4 * C::KCB + b * C::VCB + off, rec + p.v_codes + slot * C::VCB + off);
    else cp_async<16>(stage + b * C::KCB + off, rec + p.k_codes + slot * C::KCB + off);
  }
}

template <class C>
__device__ __forceinline__ void unit_sync(int unit) {
  if (C::WPT > 1) named_barrier(1 + unit, 32 * C::WPT);
  else __syncwarp();
}

template <class C>
__device__ void decode_body(const DecodeParams& p) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int D = C::D, HD = C::HD;
  uint8_t* tabK = smem;
  uint8_t* tabV = smem + C::KTAB;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int unit = warp / C::WPT, wu = warp % C::WPT, ut = tid - unit * C::WPT * 32;
  const int n = lane >> 2, j = lane & 3;
  const int split = blockIdx.x, h = blockIdx.y, r = blockIdx.z;
  const int HQ = p.H * p.GQ;
  const int32_t* btr = p.block_tables + int64_t(r) * p.bt_stride;
  const int seq = p.seq_lens[r];
  const int pos = seq - 1;
  const int cend = pos >= 0 ? pos / BLOCK * BLOCK : 0;  // encoded blocks: [SINKS, cend)
  const int n_tiles = cend > SINKS ? (cend + TILE - 1) / TILE : 0;
  const int lo = split * p.tiles_per_split;
  const int hi = min(lo + p.tiles_per_split, n_tiles);
  uint8_t* stg = smem + p.off_stage + unit * 2 * p.stage_bytes;
  const unsigned bsh = __ffs(p.block_size) - 1;  // pages of 2^bsh tokens
  const unsigned page_bytes = unsigned(p.H * p.rec_bytes);  // one page's records (< 4 GiB)
  const uint8_t* hrec = p.pages + int64_t(h) * p.rec_bytes;

  load_table<C::KM, C::KVEC, C::KG, C::KKC, D>(tabK, p.kcb, h);
  load_table<C::VM, C::VVEC, C::VG, C::VKC, D>(tabV, p.vcb, h);
  cp_async_commit();
  int t = lo + unit;
  if (t < hi) issue_codes<C>(p, stg, btr, hrec, page_bytes, bsh, t * TILE, cend, ut);
  cp_async_commit();

  // per-lane constants (overlap the copies): K statistics and RoPE factors, the query of head n (B columns)
  KConst<C> kk;
  k_const_init<C>(kk, wu, n, j, h, p.kmean, p.kstd, p.dt_cos, p.dt_sin);
  uint32_t qh[4][2];
  {
    float ql[8], qhi[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) ql[i] = qhi[i] = 0.f;
    if (n < p.GQ && seq > 0) {
      const uint16_t* qr = p.q + (int64_t(r) * HQ + h * p.GQ + n) * D + 32 * wu + 8 * j;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        ql[i] = Half<C::BF16>::to_float(qr[i]) * p.qk_scale;
        qhi[i] = Half<C::BF16>::to_float(qr[HD + i]) * p.qk_scale;
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // options 0, 1 (low channels c, c + 4) and 2, 3 (their partners)
      qh[c][0] = pack_h2(ql[c], ql[4 + c]);
      qh[c][1] = pack_h2(qhi[c], qhi[4 + c]);
    }
  }
  float* qs = reinterpret_cast<float*>(smem + p.off_q);
  float* xw = reinterpret_cast<float*>(smem + p.off_xchg) + unit * 2 * C::WPT * 256;
  float* pw = reinterpret_cast<float*>(smem + p.off_pbuf) + warp * 256;
  float* corr = reinterpret_cast<float*>(smem + p.off_corr) + warp * SLICE * GQP;
  OutlierRegs onext = {{0xFFFFu, 0xFFFFu}, {0xFFFFu, 0xFFFFu}}, ocur = onext;
  if (C::OUTL) {
    const uint16_t* q0 = p.q + (int64_t(r) * HQ + h * p.GQ) * D;
    for (int i = tid; i < p.GQ * D; i += blockDim.x) qs[i] = Half<C::BF16>::to_float(q0[i]) * p.qk_scale;
    for (int i = lane; i < SLICE * GQP; i += 32) corr[i] = 0.f;
    if (t < hi) outlier_load(onext, p, btr, h, t * TILE, cend, lane);
  }
  const uint4* bcs = reinterpret_cast<const uint4*>(p.base_cs);
  uint4 bnext[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  if (t < hi) {
    const uint4* b = bcs + (int64_t(t) * (D / 2) + 32 * wu + 8 * j) / 4;
    bnext[0] = b[0];
    bnext[1] = b[1];
  }

  float acc[4][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int ct = 0; ct < 4; ++ct)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[ct][c] = 0.f;

  cp_async_wait<0>();
  __syncthreads();  // tables, the query copy and every unit's first stage are in place
  for (int it = 0; t < hi; t += p.units, ++it) {
    if (it > 0) {
      cp_async_wait<0>();
      unit_sync<C>(unit);  // this tile's stage landed; the other stage is free
    }
    const int tn = t + p.units;
    const uint8_t* cur = stg + (it & 1) * p.stage_bytes;
    if (tn < hi) issue_codes<C>(p, stg + ((it + 1) & 1) * p.stage_bytes, btr, hrec, page_bytes, bsh, tn * TILE, cend,
                                 ut);
    cp_async_commit();
    const uint4 bc0 = bnext[0], bc1 = bnext[1];
    ocur = onext;
    if (tn < hi) {
      const uint4* b = bcs + (int64_t(tn) * (D / 2) + 32 * wu + 8 * j) / 4;
      bnext[0] = b[0];
      bnext[1] = b[1];
      if (C::OUTL) outlier_load(onext, p, btr, h, tn * TILE, cend, lane);
    }
    const int t0 = t * TILE;

    // the query rotated back by the tile start: q' = R(t0)^T q (keys are rotated by their offset in the tile)
    uint32_t qb[4][2];
    {
      const uint32_t bw[8] = {bc0.x, bc0.y, bc0.z, bc0.w, bc1.x, bc1.y, bc1.z, bc1.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const __half2 cs = u2h(bw[2 * c]), sn = u2h(bw[2 * c + 1]), x = u2h(qh[c][0]), y = u2h(qh[c][1]);
        qb[c][0] = h2u(__hfma2(y, sn, __hmul2(x, cs)));
        qb[c][1] = h2u(__hfma2(__hneg2(x), sn, __hmul2(y, cs)));
      }
    }

    // S^T = K Q^T over this warp's channel slice
    float S[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int c = 0; c < 4; ++c) S[mt][c] = 0.f;
    const uint8_t* stK = cur;
    const uint8_t* stV = cur + 4 * C::KCB;
    if (C::KTOK) {
      uint32_t cw[4][2];
      k_temporal_words<C>(stK, n, kk, cw);
#pragma unroll
      for (int c = 0; c < 4; ++c) k_temporal_mma<C>(tabK, c, kk, cw, qb, S);
    } else {
      k_channel_mma<C>(stK, tabK, n, kk, qb, S);
    }
    if (C::XCHG) {  // the pair's two halves of the channels (and K outliers' corrections) meet in shared memory
      float* xs = xw + (it & 1) * C::WPT * 256;
      float4* mine = reinterpret_cast<float4*>(xs + wu * 256);  // [2 m-tiles][32 lanes] float4 (frag_slot)
      mine[lane] = make_float4(S[0][0], S[0][1], S[0][2], S[0][3]);
      mine[32 + lane] = make_float4(S[1][0], S[1][1], S[1][2], S[1][3]);
      if (C::OUTL) {
        __syncwarp();
        k_outliers<C>(ocur, p, stK, tabK, qs, xs + wu * 256, h, t, wu, lane);
      }
      unit_sync<C>(unit);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < C::WPT; ++w) {  // 16-byte loads, in the order the emulator sums
          const float4 x = reinterpret_cast<const float4*>(xs + w * 256)[mt * 32 + lane];
          s.x += x.x;
          s.y += x.y;
          s.z += x.z;
          s.w += x.w;
        }
        S[mt][0] = s.x;
        S[mt][1] = s.y;
        S[mt][2] = s.z;
        S[mt][3] = s.w;
      }
    }

    // online softmax (base 2) over the lane's rows n, n + 8 of both m-tiles (block n / 2 of the tile)
    const int tb = t0 + BLOCK * (n >> 1);
    const bool valid = tb >= SINKS && tb < cend;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (valid) mx[c & 1] = fmaxf(mx[c & 1], S[mt][c]);
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], o));
      const float mn = fmaxf(m[i], mx[i]);
      alpha[i] = mn == -INFINITY ? 1.f : ex2(m[i] - mn);
      m[i] = mn;
      l[i] *= alpha[i];
    }
    float pv[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        pv[mt][c] = valid ? ex2(S[mt][c] - m[c & 1]) : 0.f;
        l[c & 1] += pv[mt][c];
      }
#pragma unroll
    for (int ct = 0; ct < 4; ++ct)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[ct][c] *= alpha[c & 1];
    uint32_t bp[2][2];  // P^T as mma B fragments (k = the tile's tokens in S^T row order, n = query heads)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      bp[mt][0] = movmatrix_trans(pack_h2(pv[mt][0], pv[mt][1]));
      bp[mt][1] = movmatrix_trans(pack_h2(pv[mt][2], pv[mt][3]));
    }
    if (C::OUTL) {
      float4* mp = reinterpret_cast<float4*>(pw);  // [2 m-tiles][32 lanes] float4 (frag_slot)
      mp[lane] = make_float4(pv[0][0], pv[0][1], pv[0][2], pv[0][3]);
      mp[32 + lane] = make_float4(pv[1][0], pv[1][1], pv[1][2], pv[1][3]);
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // the running max moved
        const int g = lane & 7;
        const float a0 = __shfl_sync(0xffffffffu, alpha[0], g >> 1), a1 = __shfl_sync(0xffffffffu, alpha[1], g >> 1);
        const float ag = (g & 1) ? a1 : a0;
        for (int i = lane; i < SLICE * GQP; i += 32) corr[i] *= ag;
      }
      __syncwarp();
      v_outliers<C>(ocur, p, stV, tabV, pw, corr, h, wu, lane);
      __syncwarp();
    }

    // O^T += V^T P^T over this warp's 64 V channels
#pragma unroll
    for (int cp = 0; cp < 2; ++cp) {
      uint32_t vd[4][4];
      v_gather<C>(stV, tabV, wu, cp, n, j, vd);
      v_unskew<C>(vd, j);
      v_mma(acc[2 * cp], vd, 0, bp);
      v_mma(acc[2 * cp + 1], vd, 2, bp);
    }
  }

  // the unit's result -> shared memory -> one partial per (request, KV head, split)
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l[i] += __shfl_xor_sync(0xffffffffu, l[i], o);
  if (C::OUTL) __syncwarp();
  cp_async_wait<0>();
  __syncthreads();  // every unit is done with its stages: the merge area may alias them
  float* um = reinterpret_cast<float*>(smem + p.off_merge);  // [units][GQP] max, then [units][GQP] sum
  float* ul = um + p.units * GQP;
  float* ua = ul + p.units * GQP;  // [units][GQP][D]
#pragma unroll
  for (int ct = 0; ct < 4; ++ct)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int g = 2 * j + (c & 1);
      const int ch = v_channel(wu, ct >> 1, 2 * (ct & 1) + (c >> 1), n, C::VMAP);
      float a = acc[ct][c];
      if (C::OUTL) a += corr[(ch - SLICE * wu) * GQP + g];
      ua[(unit * GQP + g) * D + ch] = a;
    }
  if (wu == 0 && n == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      um[unit * GQP + 2 * j + i] = m[i];
      ul[unit * GQP + 2 * j + i] = l[i];
    }
  }
  __syncthreads();
  const int64_t part = (int64_t(r) * p.H + h) * p.S + split;
  for (int i = tid; i < p.GQ * D; i += blockDim.x) {
    const int g = i / D, c = i % D;
    float M = -INFINITY;
    for (int u = 0; u < p.units; ++u) M = fmaxf(M, um[u * GQP + g]);
    float a = 0.f, L = 0.f;
    for (int u = 0; u < p.units; ++u) {
      const float w = um[u * GQP + g] == -INFINITY ? 0.f : exp2f(um[u * GQP + g] - M);
      a += w * ua[(u * GQP + g) * D + c];
      L += w * ul[u * GQP + g];
    }
    p.part_acc[(part * GQP + g) * D + c] = a;
    if (c == 0) {
      p.part_ml[(part * GQP + g) * 2] = M;
      p.part_ml[(part * GQP + g) * 2 + 1] = L;
    }
  }
}

}  // namespace tkvc

#ifndef TKV_KM
#define TKV_KM 0
#endif
#ifndef TKV_KL
#define TKV_KL 4
#endif
#ifndef TKV_VM
#define TKV_VM 0
#endif
#ifndef TKV_VL
#define TKV_VL 4
#endif
#ifndef TKV_D
#define TKV_D 128
#endif
#ifndef TKV_OUTL
#define TKV_OUTL 0
#endif
#ifndef TKV_BF16
#define TKV_BF16 1
#endif
#ifndef TKV_VSKEW
#define TKV_VSKEW 1
#endif
#ifndef TKV_THREADS  // the CTA's most threads: with one CTA per SM, registers per thread <= 64K / TKV_THREADS
#define TKV_THREADS 256
#endif

typedef tkvc::Cfg<TKV_KM, TKV_KL, TKV_VM, TKV_VL, TKV_D, TKV_OUTL != 0, TKV_BF16 != 0, TKV_VSKEW != 0> TkvCfg;

extern "C" __global__ void __launch_bounds__(TKV_THREADS, 1) tkv_decode(const __grid_constant__ tkvc::DecodeParams p) {
  tkvc::decode_body<TkvCfg>(p);
}

extern "C" __global__ void __launch_bounds__(128) tkv_merge(const __grid_constant__ tkvc::MergeParams p) {
  tkvc::merge_body<TKV_D, TKV_BF16 != 0>(p);
}
