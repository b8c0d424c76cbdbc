// A short prefill chunk's attention on AMX tiles (bf16 products, float32 sums): the attention ops.cpu.prefill_attention
// defines - query p over the decoded keys before its own 8-token block and the exact keys from that block's start to
// itself, one softmax over both - for a chunk of a few queries over a short context (a prefix-cache hit's new
// tokens).  Why: torch's flash kernel plus the own-block merge took ~185 us per layer for 40 queries over 296 keys
// (SmolLM2's shape) on a 2-core AMX Xeon, almost all of it fixed cost; the arithmetic is a few microseconds of tile
// work.  Included by isa_amx.cpp only (compiled for AMX-BF16); called where the CPU has AMX tiles and the OS granted
// their state (ops.cpp asks once).
//
// Per KV head, its g query heads folded into the rows (row u * g + i: query u, head h * g + i):
//   keys: the decoded rows [0, nd) then the exact rows [0, nx) (positions x0 ..), packed once per head into B tiles
//   (16 keys x 32 dims, dim pairs interleaved as tdpbf16ps reads them); values packed per 32 keys x 16 dims;
//   per 16 rows: the scores of every key (one tile product per 16 keys and 32 dims), masked by each row's rule and
//   softmaxed in float32, the weights rounded to bf16, then the weighted values (one tile product per 32 keys and
//   16 dims), divided by the row's float32 sum.  Same rounding points as the flash path (bf16 weights into a bf16
//   GEMM, float32 sums); not bit-identical to it, or chunk-invariant (the flash path is neither).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace tkv {
namespace amx {


namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure() {  // every tile: 16 rows x 64 bytes (C: 16 floats, A / B: 32 bf16 or 16 pairs)
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

// exp for the softmax (the Cephes polynomial of kernels_impl.h's vexp; inputs <= 0, clamped at -87)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  const __m512 tf = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(tf, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(tf, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(tf), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

}  // namespace

// Head h's rows of the chunk (every query of the chunk, its g query heads).
inline void chunk_head(const ChunkArgs& a, int h) {
  configure();  // (tile configuration is per thread)
  const int D = a.D, g = a.g, R = a.Tq * g, Rp = (R + 15) / 16 * 16;
  const int64_t nk = a.nd + a.nx;
  const int nk16 = (int)((nk + 15) / 16), nk32 = (int)((nk + 31) / 32);
  const int dc = D / 32, db = D / 16;
  // key row k of the combined array: decoded k < nd, else exact k - nd
  auto krow = [&](int64_t k, bool val) -> const uint16_t* {
    return k < a.nd ? (val ? a.vd : a.kd) + k * a.sd_t + h * a.sd_h
                    : (val ? a.vx : a.kx) + (k - a.nd) * a.sx_t + h * a.sx_h;
  };
  // scratch kept per thread (allocating it per call cost more than the attention: page faults after every free)
  thread_local std::vector<uint16_t> sQ, sKV, sP;
  thread_local std::vector<uint32_t> sKT, sVT;
  thread_local std::vector<float> sS;
  const auto grow = [](auto& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  };
  uint16_t* Q = grow(sQ, (size_t)Rp * D);                     // rows u * g + i
  uint16_t* Kc = grow(sKV, (size_t)2 * nk32 * 32 * D);        // the combined keys, then values, contiguous
  uint32_t* KT = grow(sKT, (size_t)nk16 * dc * 256);           // [key block][dim chunk] 16 pairs x 16 keys
  uint32_t* VT = grow(sVT, (size_t)nk32 * db * 256);           // [key block][dim block] 16 key pairs x 16 dims
  float* S = grow(sS, (size_t)16 * nk16 * 16);
  uint16_t* P = grow(sP, (size_t)16 * nk32 * 32);
  uint16_t* Vc = Kc + (size_t)nk32 * 32 * D;
  std::memset(Q + (size_t)R * D, 0, (size_t)(Rp - R) * D * 2);  // padding rows and keys: zeros, not NaN bit patterns
  std::memset(Kc + nk * D, 0, (size_t)(nk32 * 32 - nk) * D * 2);  // (a zero weight times a NaN value is NaN)
  std::memset(Vc + nk * D, 0, (size_t)(nk32 * 32 - nk) * D * 2);
  for (int r = 0; r < R; ++r)
    std::memcpy(Q + (size_t)r * D, a.q + (r / g) * a.sq_t + (h * g + r % g) * a.sq_h, D * 2);
  for (int64_t k = 0; k < nk; ++k) {
    std::memcpy(Kc + k * D, krow(k, false), D * 2);
    std::memcpy(Vc + k * D, krow(k, true), D * 2);
  }
  // K^T tiles: row j of tile [kb][c] is the 32-bit pair (dims 32c + 2j, +1) of keys 16 kb .. 16 kb + 15: a gather
  const __m512i kstride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(D * 2));
  for (int kb = 0; kb < nk16; ++kb)
    for (int c = 0; c < dc; ++c) {
      uint32_t* t = KT + ((size_t)kb * dc + c) * 256;
      const uint16_t* base = Kc + (size_t)kb * 16 * D + 32 * c;
      for (int j = 0; j < 16; ++j)
        _mm512_storeu_si512(t + 16 * j, _mm512_i32gather_epi32(kstride, base + 2 * j, 1));
    }
  // V tiles: row j of tile [kb][b] interleaves keys 32 kb + 2j and + 1, dims 16 b .. 16 b + 15
  const __m512i ilv = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                        0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                        0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);  // (a[n], b[n]) pairs
  for (int kb = 0; kb < nk32; ++kb)
    for (int b = 0; b < db; ++b) {
      uint32_t* t = VT + ((size_t)kb * db + b) * 256;
      for (int j = 0; j < 16; ++j) {
        const uint16_t* v0 = Vc + ((size_t)kb * 32 + 2 * j) * D + 16 * b;
        const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0)));
        const __m512i y = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + D)));
        _mm512_storeu_si512(t + 16 * j, _mm512_permutex2var_epi16(x, ilv, y));
      }
    }
  const int64_t lds = (int64_t)nk16 * 16, ldp = (int64_t)nk32 * 32;
  alignas(64) float O[2 * 16 * 16];
  float inv[16];
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int r0 = 0; r0 < R; r0 += 16) {
    // scores for rows r0 ..: the rows' A tiles (tmm0 .. dc - 1) loaded once, two key blocks at a time (C: tmm4 / 5,
    // B: tmm6 / 7) so that one block's products overlap the other's (one accumulator's chain is latency-bound)
    switch (dc) {  // (tile numbers are immediates)
      case 4: _tile_loadd(3, Q + (size_t)r0 * D + 96, D * 2); [[fallthrough]];
      case 3: _tile_loadd(2, Q + (size_t)r0 * D + 64, D * 2); [[fallthrough]];
      case 2: _tile_loadd(1, Q + (size_t)r0 * D + 32, D * 2); [[fallthrough]];
      default: _tile_loadd(0, Q + (size_t)r0 * D, D * 2);
    }
    for (int kb = 0; kb < nk16; kb += 2) {
      const bool two = kb + 1 < nk16;
      const uint32_t* b0 = KT + (size_t)kb * dc * 256;
      const uint32_t* b1 = b0 + (size_t)dc * 256;
      _tile_zero(4);
      _tile_zero(5);
#define TKV_QK(c, A)                              \
  _tile_loadd(6, b0 + (c) * 256, 64);             \
  _tile_dpbf16ps(4, A, 6);                        \
  if (two) {                                      \
    _tile_loadd(7, b1 + (c) * 256, 64);           \
    _tile_dpbf16ps(5, A, 7);                      \
  }
      TKV_QK(0, 0)
      if (dc > 1) { TKV_QK(1, 1) }
      if (dc > 2) { TKV_QK(2, 2) }
      if (dc > 3) { TKV_QK(3, 3) }
#undef TKV_QK
      _tile_stored(4, S + (size_t)kb * 16, lds * 4);
      if (two) _tile_stored(5, S + (size_t)(kb + 1) * 16, lds * 4);
    }
    for (int i = 0; i < 16; ++i) {  // each row over its two visible ranges; weights to bf16, zero elsewhere
      const float* s = S + (size_t)i * lds;
      uint16_t* pr = P + (size_t)i * ldp;
      std::memset(pr, 0, ldp * 2);
      const int r = r0 + i;
      inv[i] = 0.f;
      if (r >= R) continue;
      const int64_t p = a.offset + r / g, own = p & ~int64_t(7);
      const int64_t rng[2][2] = {{0, own < a.nd ? own : a.nd},                    // decoded keys before own block
                                 {a.nd + (own - a.x0), a.nd + (p - a.x0) + 1}};  // exact keys own .. p
      __m512 mx = _mm512_set1_ps(-__builtin_inff());
      for (const auto& g2 : rng)
        for (int64_t k0 = g2[0]; k0 < g2[1]; k0 += 16) {
          const __mmask16 mk = (__mmask16)(g2[1] - k0 >= 16 ? 0xffff : (1u << (g2[1] - k0)) - 1);
          mx = _mm512_mask_max_ps(mx, mk, mx, _mm512_maskz_loadu_ps(mk, s + k0));
        }
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * a.scale);
      __m512 sum = _mm512_setzero_ps();
      for (const auto& g2 : rng)
        for (int64_t k0 = g2[0]; k0 < g2[1]; k0 += 16) {
          const __mmask16 mk = (__mmask16)(g2[1] - k0 >= 16 ? 0xffff : (1u << (g2[1] - k0)) - 1);
          const __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(mk, s + k0), sc, m)));
          sum = _mm512_add_ps(sum, e);
          const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
          _mm256_mask_storeu_epi16(pr + k0, mk, eb);
        }
      inv[i] = 1.f / _mm512_reduce_add_ps(sum);
    }
    for (int b = 0; b < db; b += 2) {  // weighted values, two blocks of 16 dims at a time (C: tmm4 / 5)
      _tile_zero(4);
      _tile_zero(5);
      for (int kb = 0; kb < nk32; ++kb) {
        _tile_loadd(0, P + (size_t)kb * 32, ldp * 2);
        _tile_loadd(6, VT + ((size_t)kb * db + b) * 256, 64);
        _tile_loadd(7, VT + ((size_t)kb * db + b + 1) * 256, 64);
        _tile_dpbf16ps(4, 0, 6);
        _tile_dpbf16ps(5, 0, 7);
      }
      _tile_stored(4, O, 64);
      _tile_stored(5, O + 256, 64);
      for (int i = 0; i < 16 && r0 + i < R; ++i) {
        const int r = r0 + i;
        uint16_t* dst = a.out + (r / g) * a.so_t + (h * g + r % g) * a.so_h + 16 * b;
        const __m512 iv = _mm512_set1_ps(inv[i]);
        const __m512 o0 = _mm512_mul_ps(_mm512_load_ps(O + 16 * i), iv);
        const __m512 o1 = _mm512_mul_ps(_mm512_load_ps(O + 256 + 16 * i), iv);
        _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(o1, o0));
      }
    }
  }
  _tile_release();  // (a thread holding a tile configuration makes every context switch save the tiles)
}

}  // namespace amx
}  // namespace tkv
