// The AMX tile instructions amx_attention.h uses, emulated in AVX512-BF16 so that its kernels run - and are tested
// against the C++ kernel - on CPUs without tiles (most of the machines this project is built and tested on; the
// AMX Xeons vLLM's CPU backend targets are the ones where they serve).  Included by isa_amx_emu.cpp only, after
// <immintrin.h> and before amx_attention.h: the intrinsics' names are redefined to the functions below.
//
// Semantics as the Intel SDM writes them for palette 1 (8 tiles of at most 16 rows x 64 bytes): a load copies each
// configured row's colsb bytes and zeroes the rest of the tile; a store writes the configured rows and columns;
// TDPBF16PS adds, per row m of C and pair k of A's row, the two products A[m][2k] * B[k][2n] and A[m][2k+1] *
// B[k][2n+1] to C[m][n] - here one VDPBF16PS per (m, k), which also reads bf16 denormals as zero and flushes float32
// denormal results, as the tile unit does.  Not promised: the tile unit's exact rounding of the two products' sum
// into C (the SDM leaves it open), so emulated and real tiles agree within float32 rounding, not bit for bit.
// A misuse the hardware faults on (a tile used before a configuration is loaded, or after _tile_release; operand
// shapes that do not fit) aborts with a message instead.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tkv {
namespace amx_emu {

struct Unit {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t t[8][16][64] = {};
};

inline Unit& unit() {  // tile state is per thread, as the hardware's
  thread_local Unit u;
  return u;
}

[[noreturn]] inline void fault(const char* what, int t) {
  std::fprintf(stderr, "vllm-temporalkv: emulated AMX tile %d: %s\n", t, what);
  std::abort();
}

inline Unit& use(int t) {
  Unit& u = unit();
  if (!u.configured) fault("used without a tile configuration (_tile_loadconfig)", t);
  if (t < 0 || t > 7) fault("no such tile (palette 1 has tiles 0 .. 7)", t);
  return u;
}

inline void loadconfig(const void* cfg) {
  const uint8_t* c = static_cast<const uint8_t*>(cfg);
  if (c[0] != 1) fault("only palette 1 is emulated", -1);
  Unit& u = unit();
  for (int i = 0; i < 8; ++i) {
    std::memcpy(&u.colsb[i], c + 16 + 2 * i, 2);
    u.rows[i] = c[48 + i];
    if (u.rows[i] > 16 || u.colsb[i] > 64 || u.colsb[i] % 4) fault("configured past 16 rows x 64 bytes", i);
  }
  std::memset(u.t, 0, sizeof u.t);  // (loading a configuration zeroes the tiles)
  u.configured = true;
}

inline void release() {
  Unit& u = unit();
  u.configured = false;
  std::memset(u.t, 0, sizeof u.t);
}

inline void zero(int t) { std::memset(use(t).t[t], 0, sizeof(Unit::t[0])); }

inline void loadd(int t, const void* base, int64_t stride) {
  Unit& u = use(t);
  std::memset(u.t[t], 0, sizeof(Unit::t[0]));
  for (int r = 0; r < u.rows[t]; ++r)
    std::memcpy(u.t[t][r], static_cast<const uint8_t*>(base) + r * stride, u.colsb[t]);
}

inline void stored(int t, void* base, int64_t stride) {
  const Unit& u = use(t);
  for (int r = 0; r < u.rows[t]; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, u.t[t][r], u.colsb[t]);
}

// C (float32) += A (bf16 pairs, rows x K pairs) . B (K rows of bf16 pairs): C's rows are A's, B's rows A's pairs,
// C's columns B's (the SDM's shape rules; a mismatch is a fault there)
inline void dpbf16ps(int c, int a, int b) {
  Unit& u = use(c);
  use(a), use(b);
  const int M = u.rows[c], K = u.colsb[a] / 4, N = u.colsb[c] / 4;
  if (u.rows[a] != M || u.rows[b] != K || u.colsb[b] != u.colsb[c]) fault("dpbf16ps operands' shapes do not fit", c);
  const __mmask16 cols = (__mmask16)((1u << N) - 1);
  for (int m = 0; m < M; ++m) {
    float* row = reinterpret_cast<float*>(u.t[c][m]);
    const uint32_t* ar = reinterpret_cast<const uint32_t*>(u.t[a][m]);
    __m512 acc = _mm512_maskz_loadu_ps(cols, row);
    for (int k = 0; k < K; ++k)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)ar[k]),
                            (__m512bh)_mm512_maskz_loadu_epi32(cols, u.t[b][k]));
    _mm512_mask_storeu_ps(row, cols, acc);
  }
}

}  // namespace amx_emu
}  // namespace tkv

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(cfg) ::tkv::amx_emu::loadconfig(cfg)
#define _tile_release() ::tkv::amx_emu::release()
#define _tile_loadd(t, base, stride) ::tkv::amx_emu::loadd((t), (base), (stride))
#define _tile_stored(t, base, stride) ::tkv::amx_emu::stored((t), (base), (stride))
#define _tile_zero(t) ::tkv::amx_emu::zero(t)
#define _tile_dpbf16ps(c, a, b) ::tkv::amx_emu::dpbf16ps((c), (a), (b))
