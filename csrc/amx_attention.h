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
//   softmaxed in float32 (in powers of 2: exp2_16), the weights rounded to bf16, then the weighted values (one
//   tile product per 32 keys and 16 dims), divided by the row's float32 sum.  Same rounding points as the flash
//   path (bf16 weights into a bf16 GEMM, float32 sums); not bit-identical to it, or chunk-invariant (the flash
//   path is neither).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"

// TKV_AMX_UNIT: the inline namespace this unit's copy lives in (isa_amx.cpp: tiles_unit, isa_amx_emu.cpp:
// emulated_unit), so that the two copies of these inline functions are two sets of symbols, never merged by the
// linker
#ifndef TKV_AMX_UNIT
#error "define TKV_AMX_UNIT (the including unit's namespace) before including amx_attention.h"
#endif

namespace tkv {
namespace amx {
inline namespace TKV_AMX_UNIT {

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

// 2^x for the softmax (x <= 0, in the log2 domain: the scale times log2(e) folded into one FMA): 2^floor(x) by
// scalef, 2^frac(x) by a degree-5 fit (relative error 8e-8) - 8 vector ops against the Cephes exp's 16.
inline __m512 exp2_16(__m512 x) {  // (finite x: scalef takes any exponent, 2^-300 is 0)
  const __m512 xf = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, xf);
  __m512 p = _mm512_set1_ps(EXP2_FRAC[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_FRAC[i]));
  return _mm512_scalef_ps(p, xf);
}

// K^T tiles of keys [0, N) (N a multiple of 32; rows >= n zero) read at src + k * st: tile [kb][c], its row j the
// 32-bit pair (dims 32c + 2j, +1) of keys 16 kb .. 16 kb + 15 - one gather per row
inline void pack_kt(const uint16_t* src, int64_t st, int64_t n, int64_t N, int D, uint32_t* KT) {
  const int dc = D / 32;
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)(st * 2)));
  for (int64_t kb = 0; kb < N / 16; ++kb) {
    const int64_t left = n - kb * 16;
    const __mmask16 mk = (__mmask16)(left >= 16 ? 0xffff : left <= 0 ? 0 : (1u << left) - 1);
    for (int c = 0; c < dc; ++c) {
      uint32_t* t = KT + ((size_t)kb * dc + c) * 256;
      const uint16_t* base = src + kb * 16 * st + 32 * c;  // (masked-off lanes load nothing)
      for (int j = 0; j < 16; ++j)
        _mm512_storeu_si512(t + 16 * j, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mk, idx, base + 2 * j, 1));
    }
  }
}

// V tiles of values [0, N) (rows >= n zero): tile [kb][b], its row j keys 32 kb + 2j and + 1 interleaved, dims
// 16 b .. 16 b + 15
inline void pack_vt(const uint16_t* src, int64_t st, int64_t n, int64_t N, int D, uint32_t* VT) {
  const int db = D / 16;
  const __m512i ilv = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                        0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                        0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);  // (a[n], b[n]) pairs
  const auto row = [&](int64_t k, int b) {
    return k < n ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k * st + 16 * b)))
                 : _mm512_setzero_si512();
  };
  for (int64_t kb = 0; kb < N / 32; ++kb)
    for (int b = 0; b < db; ++b) {
      uint32_t* t = VT + ((size_t)kb * db + b) * 256;
      for (int j = 0; j < 16; ++j)
        _mm512_storeu_si512(t + 16 * j, _mm512_permutex2var_epi16(row(kb * 32 + 2 * j, b), ilv, row(kb * 32 + 2 * j + 1, b)));
    }
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
  uint32_t* KT = grow(sKT, (size_t)nk32 * 2 * dc * 256);       // [key block][dim chunk] 16 pairs x 16 keys
  uint32_t* VT = grow(sVT, (size_t)nk32 * db * 256);           // [key block][dim block] 16 key pairs x 16 dims
  float* S = grow(sS, (size_t)16 * nk16 * 16);
  uint16_t* P = grow(sP, (size_t)16 * nk32 * 32);
  uint16_t* Vc = Kc + (size_t)nk32 * 32 * D;
  std::memset(Q + (size_t)R * D, 0, (size_t)(Rp - R) * D * 2);  // padding rows (and keys): zeros, not NaN bit patterns
  for (int r = 0; r < R; ++r)
    std::memcpy(Q + (size_t)r * D, a.q + (r / g) * a.sq_t + (h * g + r % g) * a.sq_h, D * 2);
  for (int64_t k = 0; k < nk; ++k) {
    std::memcpy(Kc + k * D, krow(k, false), D * 2);
    std::memcpy(Vc + k * D, krow(k, true), D * 2);
  }
  pack_kt(Kc, D, nk, (int64_t)nk32 * 32, D, KT);
  pack_vt(Vc, D, nk, (int64_t)nk32 * 32, D, VT);
  const int64_t lds = (int64_t)nk16 * 16, ldp = (int64_t)nk32 * 32;
  alignas(64) float O[2 * 16 * 16];
  float inv[16];
  const float c2 = a.scale * 1.44269504088896341f;  // scores to the log2 domain (exp2_16)
  const __m512 sc = _mm512_set1_ps(c2);
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
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * c2);
      __m512 sum = _mm512_setzero_ps();
      for (const auto& g2 : rng)
        for (int64_t k0 = g2[0]; k0 < g2[1]; k0 += 16) {
          const __mmask16 mk = (__mmask16)(g2[1] - k0 >= 16 ? 0xffff : (1u << (g2[1] - k0)) - 1);
          const __m512 e = _mm512_maskz_mov_ps(mk, exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(mk, s + k0), sc, m)));
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

// ---- a long chunk (2048 queries at 6144: a prompt's prefill chunks) -------------------------------------------
// The same attention as chunk_head, flash-style so that it scales: per KV head the queries (g heads folded into the
// rows), the decoded keys [0, nd) and the exact keys [0, nx) are packed once (pack_long, one item per head); then
// per panel of 256 rows (long_panel, one item per head and panel, the longest panels first) the decoded keys are read
// in blocks of 256, each block's scores for every 16-row tile of the panel that sees any of it (causal: a tile stops
// at its last row's own block), an online softmax in the log2 domain (running max and sum per row, the row's
// float32 output rescaled when the max grows), the weights rounded to bf16 times the values in tile products; then
// each tile's own-block exact keys (at most two 32-key blocks).  Rounding points as the flash path's and chunk_head's.
// Why: torch's flash kernel over the decoded keys plus the own-block merge took ~45 ms of a 58 ms layer step (SmolLM2's
// shape, 2048 queries at 6144, 2-core AMX Xeon), half of it its exp-and-sum pass; chunk_head on such a chunk stores
// every score of a row tile and skips nothing (1.9-2.4x flash's time).  Measured: 0.69x flash's time for SmolLM2's
// 4096-query prompt chunk (benchmarks/results/cpu-speed-log.md, "Long chunks on AMX tiles too").

constexpr int LONG_ROWS = LONG_PANEL_ROWS;  // rows per panel (16 tiles): one pass over the head's packed keys per panel
constexpr int LONG_KEYS = 256;  // keys per block: its K and V tiles (64 KB at D = 128) stay in L2 across the panel

// Offsets (in 32-bit words) of one head's packed operands in the caller's buffer, from LongShape.
inline void long_offsets(const LongShape& s, int64_t h, int64_t off[5]) {
  const int64_t q = s.Rp * s.D / 2, d = s.nd32 * s.D / 2, x = s.nx32 * s.D / 2, per = q + 2 * d + 2 * x;
  off[0] = h * per;          // Q rows, bf16
  off[1] = off[0] + q;       // decoded K^T tiles
  off[2] = off[1] + d;       // decoded V tiles
  off[3] = off[2] + d;       // exact K^T tiles
  off[4] = off[3] + x;       // exact V tiles
}

inline void pack_long(const ChunkArgs& a, const LongShape& s, int h, uint32_t* buf) {
  int64_t off[5];
  long_offsets(s, h, off);
  const int D = a.D, g = a.g, R = a.Tq * g;
  uint16_t* Q = reinterpret_cast<uint16_t*>(buf + off[0]);
  for (int r = 0; r < R; ++r)
    std::memcpy(Q + (size_t)r * D, a.q + (r / g) * a.sq_t + (h * g + r % g) * a.sq_h, D * 2);
  std::memset(Q + (size_t)R * D, 0, (size_t)(s.Rp - R) * D * 2);  // padding rows: zeros, not NaN bit patterns
  pack_kt(a.kd + h * a.sd_h, a.sd_t, a.nd, s.nd32, D, buf + off[1]);
  pack_vt(a.vd + h * a.sd_h, a.sd_t, a.nd, s.nd32, D, buf + off[2]);
  pack_kt(a.kx + h * a.sx_h, a.sx_t, a.nx, s.nx32, D, buf + off[3]);
  pack_vt(a.vx + h * a.sx_h, a.sx_t, a.nx, s.nx32, D, buf + off[4]);
}

// lanes k0 .. k0 + 15 that fall in [a0, a1)
inline __mmask16 lanes(int k0, int a0, int a1) {
  const int l = std::clamp(a0 - k0, 0, 16), h = std::clamp(a1 - k0, 0, 16);
  return (__mmask16)(((1u << h) - 1) & ~((1u << l) - 1));
}

// Two 16-row tiles (rows r0 .. r0 + 31, their Q rows at Qt) against nb keys (a multiple of 32) of packed tiles KT /
// VT: row i sees keys [lo[i], hi[i]) of the block.  m (log2 domain, scaled), l and O (32 x D float32) are the rows'
// running state.  Two row tiles at a time so that every tile product has three others beside it (C: tmm4 .. 7, A:
// tmm0 / 1, B: tmm2 / 3): a tile register is not renamed, so one accumulator's chain of products waits on itself.
inline void long_block(const uint16_t* Qt, int D, const uint32_t* KT, const uint32_t* VT, int nb, const int* lo,
                       const int* hi, float c2, float* m, float* l, float* O, float* S, uint16_t* P) {
  const int dc = D / 32, db = D / 16;
  const int ldq = D * 2;
  // S and P tile-major (each tile's 16 rows x 64 bytes contiguous: a strided tile store cost ~2x a contiguous one):
  // scores of rows 16t .. and keys 16j .. at S + (t * NJ + j) * 256, weights of keys 32j .. at P + (t * NK + j) * 512
  constexpr int NJ = LONG_KEYS / 16, NK = LONG_KEYS / 32;
  for (int kb = 0; kb < nb / 16; kb += 2) {  // scores: rows (tile 0 / 1) x keys (16-key block kb / kb + 1)
    const uint32_t* b0 = KT + (size_t)kb * dc * 256;
    const uint32_t* b1 = b0 + (size_t)dc * 256;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int c = 0; c < dc; ++c) {
      _tile_loadd(0, Qt + 32 * c, ldq);
      _tile_loadd(2, b0 + c * 256, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_loadd(3, b1 + c * 256, 64);
      _tile_dpbf16ps(5, 0, 3);
      _tile_loadd(1, Qt + 16 * D + 32 * c, ldq);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, S + kb * 256, 64);
    _tile_stored(5, S + (kb + 1) * 256, 64);
    _tile_stored(6, S + (NJ + kb) * 256, 64);
    _tile_stored(7, S + (NJ + kb + 1) * 256, 64);
  }
  alignas(64) float alpha[32], mold[32], rsum[32];  // (each row's rescale 2^(old max - new max): vectorized below)
  const __m512 vc2 = _mm512_set1_ps(c2);
  for (int i = 0; i < 32; ++i) {  // each row's online softmax over its keys of the block; weights bf16, zero elsewhere
    const float* s = S + (i >> 4) * NJ * 256 + (i & 15) * 16;         // keys k0 .. k0 + 15: s + k0 * 16
    uint16_t* pr = P + (i >> 4) * NK * 512 + (i & 15) * 32;           // at pr + (k0 >> 5) * 512 + (k0 & 31)
    const auto pv = [&](int k0) { return reinterpret_cast<__m256i*>(pr + (k0 >> 5) * 512 + (k0 & 31)); };
    const int a0 = lo[i], a1 = hi[i];
    mold[i] = m[i], rsum[i] = 0.f;
    const int v0 = a1 <= a0 ? nb : a0 & ~15, v1 = a1 <= a0 ? nb : (a1 + 15) & ~15;  // its keys' vectors (the ends
    for (int k0 = 0; k0 < v0; k0 += 16) _mm256_storeu_si256(pv(k0), _mm256_setzero_si256());  // partial), zero
    for (int k0 = v1; k0 < nb; k0 += 16) _mm256_storeu_si256(pv(k0), _mm256_setzero_si256());  // weights elsewhere
    if (a1 <= a0) continue;  // nothing of this block for this row (or a padding row)
    const auto mask = [&](int k0) { return k0 >= a0 && k0 + 16 <= a1 ? (__mmask16)0xffff : lanes(k0, a0, a1); };
    if (a0 == 0 && a1 == nb) {  // every key of the block (most rows of the decoded blocks): unmasked, and two
      __m512 mx0 = _mm512_loadu_ps(s), mx1 = _mm512_loadu_ps(s + 256);  // chains each for the max and the sum
      for (int k0 = 32; k0 < nb; k0 += 32) {
        mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(s + k0 * 16));
        mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(s + k0 * 16 + 256));
      }
      const float mnew = std::max(mold[i], _mm512_reduce_max_ps(_mm512_max_ps(mx0, mx1)) * c2);
      m[i] = mnew;
      const __m512 vm = _mm512_set1_ps(mnew);
      __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
      for (int k0 = 0; k0 < nb; k0 += 32) {
        const __m512 e0 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + k0 * 16), vc2, vm));
        const __m512 e1 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + k0 * 16 + 256), vc2, vm));
        s0 = _mm512_add_ps(s0, e0);
        s1 = _mm512_add_ps(s1, e1);
        _mm512_storeu_si512(pv(k0), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      }
      rsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
      continue;
    }
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    for (int k0 = v0; k0 < v1; k0 += 16) {
      const __mmask16 mk = mask(k0);
      mx = _mm512_mask_max_ps(mx, mk, mx, _mm512_maskz_loadu_ps(mk, s + k0 * 16));
    }
    const float mnew = std::max(mold[i], _mm512_reduce_max_ps(mx) * c2);
    m[i] = mnew;
    const __m512 vm = _mm512_set1_ps(mnew);
    __m512 sum = _mm512_setzero_ps();
    for (int k0 = v0; k0 < v1; k0 += 16) {
      const __m512 e = _mm512_maskz_mov_ps(mask(k0), exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + k0 * 16), vc2, vm)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(pv(k0), (__m256i)_mm512_cvtneps_pbh(e));
    }
    rsum[i] = _mm512_reduce_add_ps(sum);
  }
  for (int i = 0; i < 32; i += 16) {  // alpha: 1 where the max stayed (or the row saw nothing), 0 from -inf
    const __m512 mo = _mm512_loadu_ps(mold + i), mn = _mm512_loadu_ps(m + i);
    const __mmask16 fresh = _mm512_cmp_ps_mask(mo, _mm512_set1_ps(-__builtin_inff()), _CMP_EQ_OQ);
    const __m512 al = _mm512_maskz_mov_ps(~fresh, exp2_16(_mm512_maskz_sub_ps(~fresh, mo, mn)));
    _mm512_store_ps(alpha + i, al);
    _mm512_storeu_ps(l + i, _mm512_fmadd_ps(_mm512_loadu_ps(l + i), al, _mm512_loadu_ps(rsum + i)));
  }
  alignas(64) float C[4 * 256];
  for (int b = 0; b < db; b += 2) {  // weighted values: rows (tile 0 / 1) x dims (16-dim block b / b + 1)
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int kb = 0; kb < nb / 32; ++kb) {
      _tile_loadd(0, P + kb * 512, 64);
      _tile_loadd(2, VT + ((size_t)kb * db + b) * 256, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_loadd(3, VT + ((size_t)kb * db + b + 1) * 256, 64);
      _tile_dpbf16ps(5, 0, 3);
      _tile_loadd(1, P + (NK + kb) * 512, 64);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, C, 64);
    _tile_stored(5, C + 256, 64);
    _tile_stored(6, C + 512, 64);
    _tile_stored(7, C + 768, 64);
    for (int i = 0; i < 32; ++i) {
      float* o = O + (size_t)i * D + 16 * b;
      const float* c = C + (i / 16) * 512 + (i % 16) * 16;
      const __m512 al = _mm512_set1_ps(alpha[i]);
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), al, _mm512_load_ps(c)));
      _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16), al, _mm512_load_ps(c + 256)));
    }
  }
}

// Rows [p0 * LONG_ROWS, +LONG_ROWS) of KV head h (packed by pack_long into buf), two row tiles at a time.
inline void long_panel(const ChunkArgs& a, const LongShape& s, int h, int64_t p0, const uint32_t* buf) {
  configure();
  int64_t off[5];
  long_offsets(s, h, off);
  const int D = a.D, g = a.g, R = a.Tq * g;
  const int r_begin = (int)(p0 * LONG_ROWS), r_end = std::min(R, r_begin + LONG_ROWS);
  const int pairs = (r_end - r_begin + 31) / 32;  // (the packed rows are padded to 32)
  const uint16_t* Q = reinterpret_cast<const uint16_t*>(buf + off[0]);
  thread_local std::vector<float> sO, sS;
  thread_local std::vector<uint16_t> sP;
  const auto grow = [](auto& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  };
  float* O = grow(sO, (size_t)LONG_ROWS * D + 2 * LONG_ROWS);
  float *m = O + (size_t)LONG_ROWS * D, *l = m + LONG_ROWS;
  float* S = grow(sS, (size_t)32 * LONG_KEYS);
  uint16_t* P = grow(sP, (size_t)32 * LONG_KEYS);
  std::memset(O, 0, (size_t)pairs * 32 * D * 4);
  for (int r = 0; r < pairs * 32; ++r) m[r] = -__builtin_inff(), l[r] = 0.f;
  const float c2 = a.scale * 1.44269504088896341f;
  // row r: query u = r / g at p = offset + u, exact from own = exact_start(p, window): decoded [0, own), exact [own, p]
  const auto pos = [&](int r) { return a.offset + std::min(r, R - 1) / g; };
  const auto own = [&](int r) { return exact_start(pos(r), (int)a.window); };  // (common.h: windows, sinks)
  const int64_t dec_end = std::min(own(r_end - 1), a.nd);  // the panel's last decoded key + 1
  int lo[32], hi[32];
  for (int64_t k0 = 0; k0 < dec_end; k0 += LONG_KEYS) {  // the decoded keys, a block at a time for every pair
    for (int t = 0; t < pairs; ++t) {
      const int r0 = r_begin + 32 * t;
      const int64_t pair_end = std::min(own(r0 + 31), a.nd);
      if (pair_end <= k0) continue;
      const int nb = (int)std::min<int64_t>(LONG_KEYS, ((pair_end - k0) + 31) / 32 * 32);
      for (int i = 0; i < 32; ++i) {
        lo[i] = 0;
        hi[i] = r0 + i < r_end ? (int)std::clamp<int64_t>(own(r0 + i) - k0, 0, nb) : 0;
      }
      long_block(Q + (size_t)r0 * D, D, buf + off[1] + k0 * D / 2, buf + off[2] + k0 * D / 2, nb, lo, hi, c2,
                 m + 32 * t, l + 32 * t, O + (size_t)32 * t * D, S, P);
    }
  }
  for (int t = 0; t < pairs; ++t) {  // each pair's exact keys (exact row j: position x0 + j), a block at a time
    const int r0 = r_begin + 32 * t;
    const int64_t e1 = pos(r0 + 31) - a.x0 + 1;
    for (int64_t e0 = (own(r0) - a.x0) & ~int64_t(31); e0 < e1; e0 += LONG_KEYS) {
      const int nb = (int)std::min<int64_t>(LONG_KEYS, (e1 - e0 + 31) / 32 * 32);
      for (int i = 0; i < 32; ++i) {
        lo[i] = (int)std::clamp<int64_t>(own(r0 + i) - a.x0 - e0, 0, nb);
        hi[i] = r0 + i < r_end ? (int)std::clamp<int64_t>(pos(r0 + i) - a.x0 + 1 - e0, 0, nb) : 0;
      }
      long_block(Q + (size_t)r0 * D, D, buf + off[3] + e0 * D / 2, buf + off[4] + e0 * D / 2, nb, lo, hi, c2,
                 m + 32 * t, l + 32 * t, O + (size_t)32 * t * D, S, P);
    }
  }
  for (int r = r_begin; r < r_end; ++r) {
    const float* o = O + (size_t)(r - r_begin) * D;
    const __m512 iv = _mm512_set1_ps(1.f / l[r - r_begin]);
    uint16_t* dst = a.out + (r / g) * a.so_t + (h * g + r % g) * a.so_h;
    for (int d = 0; d < D; d += 32)
      _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + d + 16), iv),
                                                                _mm512_mul_ps(_mm512_loadu_ps(o + d), iv)));
  }
  _tile_release();
}

// ---- end of long chunks
}  // namespace TKV_AMX_UNIT
}  // namespace amx
}  // namespace tkv
