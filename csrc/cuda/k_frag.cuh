// K side of one tile for one warp: codes (staged in shared memory) -> centroids from the shared-memory codebook
// -> x = z * std + mean -> RoPE by the token's offset in the tile -> mma A fragments of S^T = K Q^T.
//
// Registers per lane (KD): slot s (0..3) holds option k_option(s, n) of the lane's k-chunks.  Temporal codes give
// fp16 pairs along tokens (tokens 4n + 2mt, 4n + 2mt + 1 = rows n, n + 8 of m-tile mt); channel and scalar codes
// give pairs along channels (k-chunks 2kp, 2kp + 1) per token q (0..3 = 4n + q).  The fp16 math is done in
// that orientation with per-lane constants (KConst); the fragments are then assembled with two layers of
// byte permutes: slots (0,1) and (2,3) side by side, then un-skewed by the lane's row n.
#pragma once
#include "cfg.cuh"
#include "ptx.cuh"

namespace tkvc {

// per-lane constants of the K math, loaded once per launch
template <class C>
struct KConst {
  int base[4];         // channel of slot s at k-chunk 0 (k_channel(u, 0, j, k_option(s, n)))
  uint32_t gb[4][2];   // byte offset of slot s's codebook group in the table (l = 2: per k-chunk pair)
  uint32_t sm[4][4];   // temporal: (std, mean) of slot s at chunk kc; else [s][2kp + {0: std pair, 1: mean pair}]
  uint32_t cf[2][4][2][2];  // RoPE factors (cos, sign * sin) fp16x2: temporal [sp][kc][mt]; else [sp][kp][q / 2][q % 2]
  uint32_t sel_lo, sel_hi;  // un-skew selectors (options 0,1 / 2,3)
};

__device__ __forceinline__ uint32_t pack_h2(float a, float b) { return h2u(__floats2half2_rn(a, b)); }

template <class C>
__device__ __forceinline__ void k_const_init(KConst<C>& k, int u, int n, int j, int h, const float* kmean,
                                             const float* kstd, const float* dtc, const float* dts) {
  constexpr int HD = C::HD, D = C::D;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int o = k_option(s, n);
    k.base[s] = k_channel(u, 0, j, o, HD);
    if (C::KM != SCALAR) {
      constexpr int EB = 2 * C::KVEC;
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int g = (C::KM == TEMPORAL && C::KL == 2) || (C::KM == CHANNEL && C::KL == 2) ? k.base[s] / 2 + x
                                                                                              : k.base[s] / C::KL;
        uint32_t off = swz(g, C::KG) * EB;
        if (C::KM == TEMPORAL && C::KL == 8) off += (n & 1) * 8;  // this lane's 4 tokens: half of an 8-token code
        if (C::KM == CHANNEL && C::KL == 8) off += (o & 1) * 8;   // this option's 4 channels: half of an entry
        k.gb[s][x] = off;
      }
    }
    const float* mn = kmean + h * D;
    const float* sd = kstd + h * D;
    if (C::KTOK) {
#pragma unroll
      for (int kc = 0; kc < 4; ++kc) k.sm[s][kc] = pack_h2(sd[k.base[s] + kc], mn[k.base[s] + kc]);
    } else {
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) {
        const int c = k.base[s] + 2 * kp;
        k.sm[s][2 * kp] = pack_h2(sd[c], sd[c + 1]);
        k.sm[s][2 * kp + 1] = pack_h2(mn[c], mn[c + 1]);
      }
    }
  }
#pragma unroll
  for (int sp = 0; sp < 2; ++sp) {
    const float sg = k_option(sp, n) < 2 ? -1.f : 1.f;  // slot sp low: x cos - y sin; high: x cos + y sin
    const int i0 = k.base[sp] % HD;                      // rotary frequency index of chunk 0
    if (C::KTOK) {
#pragma unroll
      for (int kc = 0; kc < 4; ++kc)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int dt = 4 * n + 2 * mt, i = i0 + kc;
          k.cf[sp][kc][mt][0] = pack_h2(dtc[dt * HD + i], dtc[(dt + 1) * HD + i]);
          k.cf[sp][kc][mt][1] = pack_h2(sg * dts[dt * HD + i], sg * dts[(dt + 1) * HD + i]);
        }
    } else {
#pragma unroll
      for (int kp = 0; kp < 2; ++kp)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int dt = 4 * n + q, i = i0 + 2 * kp;
          uint32_t* f = k.cf[sp][2 * kp + (q >> 1)][q & 1];
          f[0] = pack_h2(dtc[dt * HD + i], dtc[dt * HD + i + 1]);
          f[1] = pack_h2(sg * dts[dt * HD + i], sg * dts[dt * HD + i + 1]);
        }
    }
  }
  k.sel_lo = unskew_selector(0, 1, n);
  k.sel_hi = unskew_selector(2, 3, n);
}

// x * std + mean on a pair along tokens (temporal): (std, mean) broadcast from one packed register
__device__ __forceinline__ uint32_t denorm_bcast(uint32_t x, uint32_t sm) {
  const __half2 v = u2h(sm);
  return h2u(__hfma2(u2h(x), __low2half2(v), __high2half2(v)));
}
__device__ __forceinline__ uint32_t denorm_pair(uint32_t x, uint32_t sd, uint32_t mn) {
  return h2u(__hfma2(u2h(x), u2h(sd), u2h(mn)));
}
// rotate the pair (x: slot sp, y: slot sp + 2) by (c, s') : x' = x c + y s', y' = y c - x s'
__device__ __forceinline__ void rope_pair(uint32_t& x, uint32_t& y, const uint32_t (&f)[2]) {
  const __half2 c = u2h(f[0]), s = u2h(f[1]), a = u2h(x), b = u2h(y);
  x = h2u(__hfma2(b, s, __hmul2(a, c)));
  y = h2u(__hfma2(__hneg2(a), s, __hmul2(b, c)));
}

// A fragment of (k-chunk, m-tile) from the 4 slots' pairs: lo = rows n (tokens .x), hi = rows n + 8 (.y), or
// for pairs along channels, lo/hi = the registers of rows n / n + 8 and h = which half (k-chunk parity)
__device__ __forceinline__ void k_fragment(uint32_t (&a)[4], uint32_t s0n, uint32_t s1n, uint32_t s2n, uint32_t s3n,
                                           uint32_t s0m, uint32_t s1m, uint32_t s2m, uint32_t s3m, uint32_t pick_n,
                                           uint32_t pick_m, uint32_t sel_lo, uint32_t sel_hi) {
  const uint32_t x = prmt(s0n, s1n, pick_n), y = prmt(s2n, s3n, pick_n);  // row n: slots 0..3
  const uint32_t xp = prmt(s0m, s1m, pick_m), yp = prmt(s2m, s3m, pick_m);  // row n + 8
  a[0] = prmt(x, y, sel_lo);
  a[1] = prmt(xp, yp, sel_lo);
  a[2] = prmt(x, y, sel_hi);
  a[3] = prmt(xp, yp, sel_hi);
}

// ---- temporal K: one k-chunk at a time ------------------------------------------------------------------------

// the code words of the lane's slots: 4 codes (k-chunks 0..3, one byte each) of the lane's code row(s)
template <class C>
__device__ __forceinline__ void k_temporal_words(const uint8_t* stg, int n, const KConst<C>& k, uint32_t (&cw)[4][2]) {
  const uint8_t* blk = stg + (n >> 1) * C::KCB;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    if (C::KL == 2) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        cw[s][mt] = *reinterpret_cast<const uint32_t*>(blk + (2 * (n & 1) + mt) * C::D + k.base[s]);
    } else {
      const int row = C::KL == 4 ? (n & 1) : 0;
      cw[s][0] = cw[s][1] = *reinterpret_cast<const uint32_t*>(blk + row * C::D + k.base[s]);
    }
  }
}

template <class C>
__device__ __forceinline__ void k_temporal_chunk(const uint8_t* tab, int kc, const KConst<C>& k,
                                                 const uint32_t (&cw)[4][2], uint32_t (&kd)[4][2]) {
  constexpr int EB = 2 * C::KL, ROW = C::KG * EB;  // bytes per code value across the groups
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    if (C::KL == 2) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint32_t code = (cw[s][mt] >> (8 * kc)) & 0xFF;
        kd[s][mt] = *reinterpret_cast<const uint32_t*>(tab + k.gb[s][kc >> 1] + code * ROW);
      }
    } else {
      const uint32_t code = (cw[s][0] >> (8 * kc)) & 0xFF;
      const uint2 v = *reinterpret_cast<const uint2*>(tab + k.gb[s][0] + code * ROW);
      kd[s][0] = v.x;
      kd[s][1] = v.y;
    }
  }
}

// decode, denormalize, rotate one k-chunk (temporal) and issue its two mmas
template <class C>
__device__ __forceinline__ void k_temporal_mma(const uint8_t* tab, int kc, const KConst<C>& k, const uint32_t (&cw)[4][2],
                                               const uint32_t (&qb)[4][2], float (&S)[2][4]) {
  uint32_t kd[4][2];
  k_temporal_chunk<C>(tab, kc, k, cw, kd);
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) kd[s][mt] = denorm_bcast(kd[s][mt], k.sm[s][kc]);
#pragma unroll
  for (int sp = 0; sp < 2; ++sp)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) rope_pair(kd[sp][mt], kd[sp + 2][mt], k.cf[sp][kc][mt]);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    uint32_t a[4];
    k_fragment(a, kd[0][mt], kd[1][mt], kd[2][mt], kd[3][mt], kd[0][mt], kd[1][mt], kd[2][mt], kd[3][mt], 0x5410,
               0x7632, k.sel_lo, k.sel_hi);
    mma16816(S[mt], a, qb[kc][0], qb[kc][1]);
  }
}

// ---- channel / scalar K: the whole tile's pairs along channels, then the 4 k-chunks --------------------------

// G[s][q][kp]: slot s, token 4n + q, channels base + 2kp, base + 2kp + 1 (normalized, fp16)
template <class C>
__device__ __forceinline__ void k_channel_gather(const uint8_t* stg, const uint8_t* tab, int n, const KConst<C>& k,
                                                 uint32_t (&G)[4][4][2]) {
  const uint8_t* blk = stg + (n >> 1) * C::KCB;
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int tr = 4 * (n & 1) + q;  // token in the block
      if (C::KM == CHANNEL) {
        constexpr int EB = 2 * C::KL, ROW = C::KG * EB;
        const uint8_t* row = blk + tr * (C::D / C::KL);
        if (C::KL == 2) {
          const uint32_t w = *reinterpret_cast<const uint16_t*>(row + k.base[s] / 2);
          G[s][q][0] = *reinterpret_cast<const uint32_t*>(tab + k.gb[s][0] + (w & 0xFF) * ROW);
          G[s][q][1] = *reinterpret_cast<const uint32_t*>(tab + k.gb[s][1] + (w >> 8) * ROW);
        } else {
          const uint32_t code = row[k.base[s] / C::KL];
          const uint2 v = *reinterpret_cast<const uint2*>(tab + k.gb[s][0] + code * ROW);
          G[s][q][0] = v.x;
          G[s][q][1] = v.y;
        }
      } else {  // scalar: 4 channels' codes of KL bits, each looked up in its channel's codebook
        constexpr int B = C::KL, KC = C::KKC;
        const uint8_t* row = blk + tr * (C::D * B / 8);
        const int bit = k.base[s] * B;
        uint32_t w;
        if (B == 4) w = *reinterpret_cast<const uint16_t*>(row + bit / 8);
        else w = uint32_t(row[bit / 8]) >> (bit % 8);
        const uint16_t* t16 = reinterpret_cast<const uint16_t*>(tab);
        uint32_t v[4];
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) v[kc] = t16[((w >> (B * kc)) & (KC - 1)) * C::D + swz(k.base[s] + kc, C::D)];
        G[s][q][0] = v[0] | (v[1] << 16);
        G[s][q][1] = v[2] | (v[3] << 16);
      }
    }
}

template <class C>
__device__ __forceinline__ void k_channel_mma(const uint8_t* stg, const uint8_t* tab, int n, const KConst<C>& k,
                                              const uint32_t (&qb)[4][2], float (&S)[2][4]) {
  uint32_t G[4][4][2];
  k_channel_gather<C>(stg, tab, n, k, G);
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) G[s][q][kp] = denorm_pair(G[s][q][kp], k.sm[s][2 * kp], k.sm[s][2 * kp + 1]);
#pragma unroll
  for (int sp = 0; sp < 2; ++sp)
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) rope_pair(G[sp][q][kp], G[sp + 2][q][kp], k.cf[sp][2 * kp + (q >> 1)][q & 1]);
#pragma unroll
  for (int kc = 0; kc < 4; ++kc)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int kp = kc >> 1, qn = 2 * mt, qm = 2 * mt + 1;
      const uint32_t pick = (kc & 1) ? 0x7632 : 0x5410;
      uint32_t a[4];
      k_fragment(a, G[0][qn][kp], G[1][qn][kp], G[2][qn][kp], G[3][qn][kp], G[0][qm][kp], G[1][qm][kp],
                 G[2][qm][kp], G[3][qm][kp], pick, pick, k.sel_lo, k.sel_hi);
      mma16816(S[mt], a, qb[kc][0], qb[kc][1]);
    }
}

// the decoded, normalized K value at (token tb of tile block b, channel c), for an outlier's correction
template <class C>
__device__ __forceinline__ float k_z_at(const uint8_t* stg, const uint8_t* tab, int b, int tb, int c) {
  const uint8_t* blk = stg + b * C::KCB;
  const uint16_t* t16 = reinterpret_cast<const uint16_t*>(tab);
  uint32_t e;
  if (C::KM == TEMPORAL) {
    const uint32_t code = blk[(tb / C::KL) * C::D + c];
    e = t16[entry_index(c / C::KL, code, C::KG) * C::KL + tb % C::KL];
  } else if (C::KM == CHANNEL) {
    const uint32_t code = blk[tb * (C::D / C::KL) + c / C::KL];
    e = t16[entry_index(c / C::KL, code, C::KG) * C::KL + c % C::KL];
  } else {
    const int bit = c * C::KL;
    const uint32_t code = (blk[tb * (C::D * C::KL / 8) + bit / 8] >> (bit % 8)) & (C::KKC - 1);
    e = t16[code * C::D + swz(c, C::D)];
  }
  return __half2float(__ushort_as_half(static_cast<uint16_t>(e)));
}

}  // namespace tkvc
