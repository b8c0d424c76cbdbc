// V side of one tile for one warp: codes -> normalized centroids (V is accumulated as z; the merge kernel applies
// z * std + mean once) -> mma A fragments of O^T = V^T P^T.
//
// Lane 4n + j holds, for each V pair cp (two m-tiles of 16 channels), 4 options o (rows n / n + 8 of the two
// m-tiles): the 8 tokens of block j of the tile (k-indices 2j, 2j+1, 2j+8, 2j+9 of both k-chunks) of channel
// v_channel(uv, cp, o, n).  VD[s][q]: fp16 pair of tokens (8j + 2q, 8j + 2q + 1) of the option gathered at step s
// (v_option: skewed by j so a wavefront's lanes read different codebook groups), un-skewed by two select layers.
#pragma once
#include "cfg.cuh"
#include "ptx.cuh"

namespace tkvc {

template <class C>
__device__ __forceinline__ void v_gather(const uint8_t* stg, const uint8_t* tab, int uv, int cp, int n, int j,
                                         uint32_t (&vd)[4][4]) {
  const uint8_t* blk = stg + j * C::VCB;
  const uint16_t* t16 = reinterpret_cast<const uint16_t*>(tab);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int c = v_channel(uv, cp, v_option(s, j, C::VSKEW), n, C::VMAP);
    if (C::VM == TEMPORAL) {
      constexpr int L = C::VL, EB = 2 * L, ROW = C::VG * EB;
      const uint32_t gofs = swz(c / L, C::VG) * EB;
      if (L == 8) {
        const uint32_t code = blk[c];
        const uint4 v = *reinterpret_cast<const uint4*>(tab + gofs + code * ROW);
        vd[s][0] = v.x; vd[s][1] = v.y; vd[s][2] = v.z; vd[s][3] = v.w;
      } else if (L == 4) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t code = blk[r * C::D + c];
          const uint2 v = *reinterpret_cast<const uint2*>(tab + gofs + code * ROW);
          vd[s][2 * r] = v.x;
          vd[s][2 * r + 1] = v.y;
        }
      } else {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const uint32_t code = blk[r * C::D + c];
          vd[s][r] = *reinterpret_cast<const uint32_t*>(tab + gofs + code * ROW);
        }
      }
    } else {
      uint32_t v[8];
#pragma unroll
      for (int tr = 0; tr < 8; ++tr) {
        if (C::VM == CHANNEL) {
          constexpr int L = C::VL;
          const uint32_t code = blk[tr * (C::D / L) + c / L];
          v[tr] = t16[entry_index(c / L, code, C::VG) * L + c % L];
        } else {
          constexpr int B = C::VL;
          const int bit = c * B;
          const uint32_t code = (uint32_t(blk[tr * (C::D * B / 8) + bit / 8]) >> (bit % 8)) & (C::VKC - 1);
          v[tr] = t16[code * C::D + swz(c, C::D)];
        }
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) vd[s][q] = v[2 * q] | (v[2 * q + 1] << 16);
    }
  }
}

// slot s holds option s ^ j: bring option o to slot o (two conditional swaps)
template <class C>
__device__ __forceinline__ void v_unskew(uint32_t (&vd)[4][4], int j) {
  if (!C::VSKEW) return;
  const bool b0 = j & 1, b1 = j & 2;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t t[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) t[s] = b0 ? vd[s ^ 1][q] : vd[s][q];
#pragma unroll
    for (int s = 0; s < 4; ++s) vd[s][q] = b1 ? t[s ^ 2] : t[s];
  }
}

// the two mmas (k-chunks mt = 0, 1) of V^T m-tile ct = 2cp + (o0 >> 1), options o0 (rows n), o0 + 1 (rows n + 8)
__device__ __forceinline__ void v_mma(float (&acc)[4], const uint32_t (&vd)[4][4], int o0, const uint32_t (&bp)[2][2]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    uint32_t a[4];
    a[0] = prmt(vd[o0][mt], vd[o0][2 + mt], 0x5410);          // row n, tokens 8j + 2mt, 8j + 4 + 2mt
    a[1] = prmt(vd[o0 + 1][mt], vd[o0 + 1][2 + mt], 0x5410);  // row n + 8
    a[2] = prmt(vd[o0][mt], vd[o0][2 + mt], 0x7632);          // row n, tokens 8j + 2mt + 1, 8j + 5 + 2mt
    a[3] = prmt(vd[o0 + 1][mt], vd[o0 + 1][2 + mt], 0x7632);
    mma16816(acc, a, bp[mt][0], bp[mt][1]);
  }
}

// the decoded normalized V value at (token tb of tile block b, channel c), for an outlier's correction
template <class C>
__device__ __forceinline__ float v_z_at(const uint8_t* stg, const uint8_t* tab, int b, int tb, int c) {
  const uint8_t* blk = stg + b * C::VCB;
  const uint16_t* t16 = reinterpret_cast<const uint16_t*>(tab);
  uint32_t e;
  if (C::VM == TEMPORAL) {
    const uint32_t code = blk[(tb / C::VL) * C::D + c];
    e = t16[entry_index(c / C::VL, code, C::VG) * C::VL + tb % C::VL];
  } else if (C::VM == CHANNEL) {
    const uint32_t code = blk[tb * (C::D / C::VL) + c / C::VL];
    e = t16[entry_index(c / C::VL, code, C::VG) * C::VL + c % C::VL];
  } else {
    const int bit = c * C::VL;
    const uint32_t code = (blk[tb * (C::D * C::VL / 8) + bit / 8] >> (bit % 8)) & (C::VKC - 1);
    e = t16[code * C::D + swz(c, C::D)];
  }
  return __half2float(__ushort_as_half(static_cast<uint16_t>(e)));
}

}  // namespace tkvc
