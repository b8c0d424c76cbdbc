// Exact outliers as corrections (csrc/cuda/decode.cu calls these when a variant keeps outliers).
//
// The fragments hold every decoded value; an outlier at (token t, channel c) replaces one of them.  Rather than
// patching a register (its lane and slot are data-dependent), its effect is added where it lands:
//   K: score[t][g] += (x - y) * d score / d k[t][c] = (x - y) (q_c cos + q_partner (+-) sin) at t's position,
//      y = the decoded value z * std + mean; added into this warp's score exchange slot before the pair sum;
//   V: out[g][c] += p[t][g] (z_exact - z_decoded) in V's normalized space, into a per-warp correction
//      accumulator kept in the running softmax frame (rescaled when the running max moves) and added to the
//      mma accumulators once at the end.
// A tile holds at most 4 * cap outliers of K and of V (cap = 1% of a block, 10 at D = 128); lane l handles entries
// l and l + 32 of both, prefetched one tile ahead.
#pragma once
#include "cfg.cuh"
#include "k_frag.cuh"
#include "params.cuh"
#include "v_frag.cuh"

namespace tkvc {

struct OutlierRegs {
  uint32_t k[2], v[2];  // int16 position (block-flat t * D + c; -1 empty) | model-dtype value << 16
};

__device__ __forceinline__ void outlier_load(OutlierRegs& o, const DecodeParams& p, const int32_t* btr, int h, int t0,
                                             int cend, int lane) {
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    o.k[x] = o.v[x] = 0xFFFFu;
    const int e = lane + 32 * x;
    if (e >= 4 * p.cap) continue;
    const int b = e / p.cap, kk = e % p.cap, tok = t0 + 8 * b;
    if (tok < SINKS || tok >= cend) continue;
    const unsigned bsh = __ffs(p.block_size) - 1;  // pages of 2^bsh tokens (unsupported() refuses others)
    const int64_t page = btr[unsigned(tok) >> bsh];
    const int slot = int((unsigned(tok) & ((1u << bsh) - 1)) / BLOCK);
    const uint8_t* rec = p.pages + (page * p.H + blockIdx.y) * p.rec_bytes;
    const int64_t at = (int64_t(slot) * p.cap + kk) * 2;
    o.k[x] = uint32_t(*reinterpret_cast<const uint16_t*>(rec + p.k_idx + at)) |
             (uint32_t(*reinterpret_cast<const uint16_t*>(rec + p.k_val + at)) << 16);
    o.v[x] = uint32_t(*reinterpret_cast<const uint16_t*>(rec + p.v_idx + at)) |
             (uint32_t(*reinterpret_cast<const uint16_t*>(rec + p.v_val + at)) << 16);
  }
  (void)h;
}

// slot of score / weight (token T of the tile, head g) in a [2 m-tiles][32 lanes][4] buffer of the fragments: each
// lane's 4 values of an m-tile are one float4, so a warp's 16-byte stores and loads of it take the ideal 4 wavefronts
// (a lane-major [32][8] layout put lanes 32 bytes apart: 8 wavefronts per STS.128, 8 per scalar LDS)
__device__ __forceinline__ int frag_slot(int T, int g) {
  const int n = T >> 2, mt = (T >> 1) & 1, rh = T & 1;
  return mt * 128 + (4 * n + (g >> 1)) * 4 + 2 * rh + (g & 1);
}

template <class C>
__device__ __forceinline__ void k_outliers(const OutlierRegs& o, const DecodeParams& p, const uint8_t* stg,
                                           const uint8_t* tab, const float* qs, float* xw, int h, int tile, int u,
                                           int lane) {
  constexpr int D = C::D, HD = C::HD;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int idx = int16_t(o.k[x] & 0xFFFF);
    if (idx < 0) continue;
    const int e = lane + 32 * x, b = e / p.cap, tb = idx / D, c = idx % D, i = c % HD;
    if (C::WPT > 1 && i / 32 != u) continue;  // the other warp of the pair decodes this channel
    const float y = k_z_at<C>(stg, tab, b, tb, c) * p.kstd[h * D + c] + p.kmean[h * D + c];
    const float delta = Half<C::BF16>::to_float(uint16_t(o.k[x] >> 16)) - y;
    const int T = 8 * b + tb;
    const float cb = p.base_cos[int64_t(tile) * HD + i], sb = p.base_sin[int64_t(tile) * HD + i];
    const float cd = p.dt_cos[T * HD + i], sd = p.dt_sin[T * HD + i];
    const float cosp = cb * cd - sb * sd, sinp = sb * cd + cb * sd;
    for (int g = 0; g < p.GQ; ++g) {
      const float* qg = qs + g * D;
      const float coef = c < HD ? qg[c] * cosp + qg[c + HD] * sinp : qg[c] * cosp - qg[c - HD] * sinp;
      atomicAdd(xw + frag_slot(T, g), delta * coef);
    }
  }
}

template <class C>
__device__ __forceinline__ void v_outliers(const OutlierRegs& o, const DecodeParams& p, const uint8_t* stg,
                                           const uint8_t* tab, const float* pw, float* corr, int h, int uv, int lane) {
  constexpr int D = C::D;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int idx = int16_t(o.v[x] & 0xFFFF);
    if (idx < 0) continue;
    const int e = lane + 32 * x, b = e / p.cap, tb = idx / D, c = idx % D;
    if (C::WPT > 1 && c / SLICE != uv) continue;
    const float zd = v_z_at<C>(stg, tab, b, tb, c);
    const float ze = (Half<C::BF16>::to_float(uint16_t(o.v[x] >> 16)) - p.vmean[h * D + c]) * p.vinv[h * D + c];
    const int T = 8 * b + tb;
    for (int g = 0; g < p.GQ; ++g) atomicAdd(corr + (c - SLICE * uv) * GQP + g, pw[frag_slot(T, g)] * (ze - zd));
  }
}

}  // namespace tkvc
