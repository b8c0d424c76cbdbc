// The second kernel of a decode step: one CTA per (request, KV head), a warp per query head.  It attends to the
// exact tokens itself (the sinks, the query's own block before it - the tail - and the step's new token, read from
// the pages' half-precision region as paged_torch.gather_kv reads them), merges them with the decode kernel's
// split partials by their log-sum-exps, applies V's z * std + mean once, and writes the output in the model dtype.
// Rows of padding requests (seq_len <= 0) are written as zeros.
#pragma once
#include "maps.cuh"
#include "params.cuh"
#include "ptx.cuh"

namespace tkvc {

// region row of exact token e (sinks first, then the tail) for K (kv = 0) or V (kv = 1): paged_torch.gather_kv's
template <int D>
__device__ __forceinline__ const uint16_t* exact_row_d(const MergeParams& p, const int32_t* btr, int h, int e,
                                                       int nsink, int cend, int kv) {
  const int64_t page = e < nsink ? btr[0] : btr[cend / p.block_size];
  const int slot = e < nsink ? e : TAIL0 + (e - nsink);
  return reinterpret_cast<const uint16_t*>(p.pages + (page * p.H + h) * p.rec_bytes) + (int64_t(slot) * 2 + kv) * D;
}

template <int D, bool BF16>
__device__ __forceinline__ void merge_body(const MergeParams& p) {
  constexpr int PER = D / 32;  // channels per lane: c = lane + 32 i
  typedef Half<BF16> HT;
  const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int HQ = p.H * p.GQ;
  const int n = p.seq_lens[r];
  for (int g = warp; g < p.GQ; g += blockDim.x >> 5) {
    const int64_t row = (int64_t(r) * HQ + h * p.GQ + g) * D;
    if (n <= 0) {
#pragma unroll
      for (int i = 0; i < PER; ++i) p.out[row + lane + 32 * i] = 0;
      continue;
    }
    float q[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) q[i] = HT::to_float(p.q[row + lane + 32 * i]) * p.qk_scale;
    const int pos = n - 1, cend = pos / BLOCK * BLOCK;
    const int32_t* btr = p.block_tables + int64_t(r) * p.bt_stride;
    // exact rows: sinks 0..min(8, pos) - 1, tail cend..pos - 1 (pos >= 8), the new token
    const int nsink = pos < SINKS ? pos : SINKS;
    const int ntail = pos >= SINKS ? pos - cend : 0;
    const int ne = nsink + ntail + 1;
    // the splits first (their maxima and normalized sums, V denormalized here), then the exact rows online
    const float* ml = p.part_ml + ((int64_t(r) * p.H + h) * p.S * GQP + g) * 2;
    const float* pa = p.part_acc + ((int64_t(r) * p.H + h) * p.S * GQP + g) * D;
    float mx = -INFINITY;
    for (int s = 0; s < p.S; ++s) mx = fmaxf(mx, ml[s * GQP * 2]);
    float acc[PER], l = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] = 0.f;
    for (int s = 0; s < p.S; ++s) {
      const float ms = ml[s * GQP * 2], ls = ml[s * GQP * 2 + 1];
      if (ms == -INFINITY) continue;
      const float w = exp2f(ms - mx);
      l += w * ls;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int c = lane + 32 * i;
        acc[i] += w * (pa[s * GQP * D + c] * p.vstd[h * D + c] + ls * p.vmean[h * D + c]);
      }
    }
    for (int e = 0; e < ne; ++e) {  // at most 8 sinks + 7 tail tokens + the new one
      const bool region = e < nsink + ntail;
      const uint16_t* kr = region ? exact_row_d<D>(p, btr, h, e, nsink, cend, 0) : p.knew + (int64_t(r) * p.H + h) * D;
      const uint16_t* vr = region ? exact_row_d<D>(p, btr, h, e, nsink, cend, 1) : p.vnew + (int64_t(r) * p.H + h) * D;
      float d = 0.f;
#pragma unroll
      for (int i = 0; i < PER; ++i) d += q[i] * HT::to_float(kr[lane + 32 * i]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      const float mn = fmaxf(mx, d);
      const float a = exp2f(mx - mn), w = exp2f(d - mn);  // mx = -inf (no split): a = 0
      l = l * a + w;
#pragma unroll
      for (int i = 0; i < PER; ++i) acc[i] = acc[i] * a + w * HT::to_float(vr[lane + 32 * i]);
      mx = mn;
    }
    const float inv = 1.f / l;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const typename HT::T o = HT::from_float(acc[i] * inv);
      p.out[row + lane + 32 * i] = *reinterpret_cast<const uint16_t*>(&o);
    }
  }
}

}  // namespace tkvc
