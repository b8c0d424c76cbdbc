// The CPU kernels, written once for a generic SIMD width.  Included by isa_avx512.cpp, isa_avx2.cpp
// and isa_scalar.cpp, each after `#pragma GCC target(...)` with TKV_ISA (the namespace) and TKV_W
// (floats per vector: 16, 8 or 4) defined.  Everything except the exported kernel table has
// internal linkage (anonymous namespace), so no code compiled for one ISA can leak into another.
//
// Floating-point contract: the units are compiled with -ffp-contract=off, so `a * b + c` is two
// roundings, exactly as torch's elementwise ops compute it; fused multiply-adds appear only where
// vfma() is written (the attention math, and the encode's nearest-centroid screen, which only picks the
// answer where a proven rounding bound says the contract's own distances agree: nearest_screen).  The encode
// and gather paths reproduce the torch reference (ops/paged_torch.py) bit for bit.

#include "common.h"

namespace tkv {
namespace TKV_ISA {
namespace {

constexpr int W = TKV_W;
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf vload(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
// broadcast (not `vf{} + x`: adding 0.0 is not an identity for -0.0, so the compiler kept a scalar add in every
// hot loop; a broadcast keeps the sign of zero, which no result depends on)
inline vf vbc(float x) {
#if TKV_W == 16
  return _mm512_set1_ps(x);
#elif TKV_W == 8
  return _mm256_set1_ps(x);
#else
  return vf{x, x, x, x};
#endif
}
inline vf vfma(vf a, vf b, vf c) {
#if TKV_W == 16
  return _mm512_fmadd_ps(a, b, c);
#elif TKV_W == 8
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;  // (two roundings: -ffp-contract=off; no FMA unit assumed)
#endif
}
// RoPE on W channel pairs (k0 at channel c, k1 at c + D/2) by cos cc / sin ss, stored at p0 / p1: the rotation
// every fast decode path applies to its decoded keys (the same float32 ops in each)
inline void rope_store(float* p0, float* p1, vf k0, vf k1, vf cc, vf ss) {
  vstore(p0, vfma(k0, cc, -(k1 * ss)));
  vstore(p1, vfma(k1, cc, k0 * ss));
}
inline vi iota() {  // 0, 1, ..., W - 1
  vi v;
  for (int i = 0; i < W; ++i) v[i] = i;
  return v;
}
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline float hsum(vf v) {
  float s = v[0];
  for (int i = 1; i < W; ++i) s += v[i];
  return s;
}

// the largest lane (exact in any order: a shuffle tree where the ISA has one)
inline float hmax(vf v) {
#if TKV_W == 16
  return _mm512_reduce_max_ps((__m512)v);
#else
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

inline uint32_t f2u(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }

// exp for the softmax (Cephes polynomial, ~1 ulp); inputs <= 0 here, clamped below at -87.  On AVX-512 the floor
// is one VRNDSCALEPS and the power of two one VSCALEFPS (p * 2^n rounded once, as p * (float)2^n is): the same
// values in 15 instructions instead of 22.  The decode's softmax; the prefill's takes powers of 2 (vexp2, below).
inline vf vexp(vf x) {
  x = vmin(vmax(x, vbc(-87.0f)), vbc(88.0f));
  vf t = vfma(x, vbc(1.44269504088896341f), vbc(0.5f));
#if TKV_W == 16
  const vf tf = (vf)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
  vi ti = __builtin_convertvector(t, vi);  // truncation
  vf tf = __builtin_convertvector(ti, vf);
  ti = ti + (vi)(tf > t);  // floor: -1 where truncation rounded up
  tf = __builtin_convertvector(ti, vf);
#endif
  vf r = vfma(tf, vbc(-0.693359375f), x);
  r = vfma(tf, vbc(2.12194440e-4f), r);
  vf p = vbc(1.9875691500e-4f);
  p = vfma(p, r, vbc(1.3981999507e-3f));
  p = vfma(p, r, vbc(8.3334519073e-3f));
  p = vfma(p, r, vbc(4.1665795894e-2f));
  p = vfma(p, r, vbc(1.6666665459e-1f));
  p = vfma(p, r, vbc(5.0000001201e-1f));
  p = vfma(p, r * r, r + vbc(1.0f));
#if TKV_W == 16
  return (vf)_mm512_scalef_ps((__m512)p, (__m512)tf);
#else
  vi e = (ti + 127) << 23;
  vf s;
  __builtin_memcpy(&s, &e, sizeof s);
  return p * s;
#endif
}

// 2^x for the prefill's softmax, x <= 0 in the log2 domain (the scores' scale carries log2(e), so the max is
// subtracted and the power taken with no multiply): 2^floor(x) exactly, x clamped at -126 where that is still a
// normal float (callers zero masked lanes themselves), times 2^frac(x) (EXP2_FRAC, as amx_attention.h's exp2_16).
// 10 vector ops on AVX-512 against vexp's 17; AVX2 floors with one VROUNDPS.  With the scores read in place (no copy
// per row and tile), a served prefill chunk's layer on a 2-core AMD EPYC (bf16, AVX512_BF16): SmolLM2's 4096 tokens
// ~46 -> ~42 ms, Llama-8B's 2048 at 6k 341 -> 328 ms; float32 on AVX2 159 -> 152 ms.
inline vf vexp2(vf x) {
  x = vmax(x, vbc(-126.0f));
#if TKV_W == 16
  const vf xf = (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#elif TKV_W == 8
  const vf xf = (vf)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
  vi ti = __builtin_convertvector(x, vi);  // truncation: up for a negative fraction
  ti = ti + (vi)(__builtin_convertvector(ti, vf) > x);  // (true: -1)
  const vf xf = __builtin_convertvector(ti, vf);
#endif
  const vf f = x - xf;
  vf p = vbc(EXP2_FRAC[0]);
  for (int i = 1; i < 6; ++i) p = vfma(p, f, vbc(EXP2_FRAC[i]));
#if TKV_W == 16
  return (vf)_mm512_scalef_ps((__m512)p, (__m512)xf);
#else
  vi e = (__builtin_convertvector(xf, vi) + 127) << 23;
  vf s;
  __builtin_memcpy(&s, &e, sizeof s);
  return p * s;
#endif
}

// ---- half precision <-> float (round to nearest even, as torch's casts) ------------------------

inline float fp16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t ex = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (ex == 0) {
    float f = (float)man * 5.9604644775390625e-8f;  // subnormal (or zero): man * 2^-24, exact
    return u2f(f2u(f) | sign);
  }
  if (ex == 31) return u2f(sign | 0x7f800000u | (man << 13));
  return u2f(sign | ((ex + 112) << 23) | (man << 13));
}

inline uint16_t f32_to_fp16(float f) {  // FP16 library's fp16_ieee_from_fp32_value (c10::Half)
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (__builtin_fabsf(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f2u(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = u2f((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f2u(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }
inline uint16_t f32_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u = f2u(f);
  return (uint16_t)((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
}
inline float h2f(uint16_t h, int bf16) { return bf16 ? bf16_to_f32(h) : fp16_to_f32(h); }
inline uint16_t f2h(float f, int bf16) { return bf16 ? f32_to_bf16(f) : f32_to_fp16(f); }
inline float round_half(float f, int bf16) { return h2f(f2h(f, bf16), bf16); }
// to the model dtype: mode 1 bfloat16, 0 float16, 2 float32 (nothing to do)
inline float round_to(float f, int mode) { return mode == 2 ? f : round_half(f, mode); }

// round float32 lanes to the model's half dtype and back (round to nearest even, as torch's casts)
inline vf vround(vf x, int bf16) {  // bf16: 1 bfloat16, 0 float16, 2 no rounding
  typedef uint32_t vu __attribute__((vector_size(W * 4)));
  if (bf16 == 2) return x;
  if (bf16) {
    vu u;
    __builtin_memcpy(&u, &x, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    __builtin_memcpy(&x, &u, sizeof u);
    return x;
  }
#if TKV_W == 16
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif TKV_W == 8
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int i = 0; i < W; ++i) x[i] = round_half(x[i], 0);
  return x;
#endif
}

// W half values (bf16: 1 bfloat16, 0 float16) -> float32, exact (h2f's values)
inline vf vload_half(const uint16_t* p, int bf16) {
  if (bf16) {
#if TKV_W == 16  // (one widening load and a shift; the generic widening went through two 128-bit halves)
    return (vf)_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif TKV_W == 8
    return (vf)_mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#endif
    typedef uint16_t vh __attribute__((vector_size(W * 2)));
    typedef uint32_t vu __attribute__((vector_size(W * 4)));
    vh hv;
    __builtin_memcpy(&hv, p, sizeof hv);
    const vu u = __builtin_convertvector(hv, vu) << 16;
    vf x;
    __builtin_memcpy(&x, &u, sizeof x);
    return x;
  }
#if TKV_W == 16
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif TKV_W == 8
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vf x;
  for (int i = 0; i < W; ++i) x[i] = fp16_to_f32(p[i]);
  return x;
#endif
}

// W centroid-table floats: float32 as they are, float16 bits converted (exact)
inline vf vload_tab(const float* p) { return vload(p); }
inline vf vload_tab(const uint16_t* p) { return vload_half(p, 0); }

// n half values -> float32, W at a time then the rest (h2f's values; element by element was ~2/3 of TaDA's decode)
inline void half_to_f32(float* dst, const uint16_t* src, int n, int bf16) {
  int i = 0;
  for (; i + W <= n; i += W) vstore(dst + i, vload_half(src + i, bf16));
  for (; i < n; ++i) dst[i] = h2f(src[i], bf16);
}

// round_to's values lane by lane (vround, and NaN as round_to makes it: bfloat16 0x7FC00000, float16 keeps the sign)
inline vf vround_to(vf x, int mode) {
  if (mode == 2) return x;
  typedef uint32_t vu __attribute__((vector_size(W * 4)));
  const vi nan = x != x;
  vf r = vround(x, mode);
  vu xu, ru;
  __builtin_memcpy(&xu, &x, sizeof xu);
  __builtin_memcpy(&ru, &r, sizeof ru);
  const vu qn = (mode == 1 ? vu{} : xu & 0x80000000u) | 0x7FC00000u;
  ru = nan ? qn : ru;
  __builtin_memcpy(&r, &ru, sizeof r);
  return r;
}

// ---- page records ------------------------------------------------------------------------------

inline const uint8_t* record(const uint8_t* pages, const Layout& L, int64_t page, int h) {
  return pages + (page * L.H + h) * L.rec_bytes;
}
inline const uint16_t* region_row(const uint8_t* rec, const Layout& L, int slot, int kv) {
  return reinterpret_cast<const uint16_t*>(rec) + (int64_t)(slot * 2 + kv) * L.D;
}

// the 8 token scales (fp16) of block `slot` of a SCALED codec's record
inline const uint16_t* row_scales(const uint8_t* rec, const Codec& cd, int64_t slot) {
  return cd.method == SCALED ? reinterpret_cast<const uint16_t*>(rec + cd.scales_off) + slot * BLOCK : nullptr;
}

// ---- 8 x 8 transposes between a block's rows [8][D] and columns [D][8] --------------------------

// dst[j * ldd + i] = src[i * lds + j], i, j < 8
inline void tr8(const float* src, int lds, float* dst, int ldd) {
#if TKV_W >= 8
  __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + lds), r2 = _mm256_loadu_ps(src + 2 * lds),
         r3 = _mm256_loadu_ps(src + 3 * lds), r4 = _mm256_loadu_ps(src + 4 * lds),
         r5 = _mm256_loadu_ps(src + 5 * lds), r6 = _mm256_loadu_ps(src + 6 * lds),
         r7 = _mm256_loadu_ps(src + 7 * lds);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(s0, s4, 0x20));
  _mm256_storeu_ps(dst + ldd, _mm256_permute2f128_ps(s1, s5, 0x20));
  _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(s2, s6, 0x20));
  _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(s3, s7, 0x20));
  _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(s0, s4, 0x31));
  _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(s1, s5, 0x31));
  _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(s2, s6, 0x31));
  _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(s3, s7, 0x31));
#else
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) dst[j * ldd + i] = src[i * lds + j];
#endif
}
// rows src[t * lds + c] -> columns dst[c * ldd + t]
inline void rows_to_cols(const float* src, int lds, float* dst, int ldd, int D) {
  for (int c = 0; c < D; c += 8) tr8(src + c, lds, dst + (int64_t)c * ldd, ldd);
}
// columns src[c * lds + t] -> rows dst[t * ldd + c]
inline void cols_to_rows(const float* src, int lds, float* dst, int ldd, int D) {
  for (int c = 0; c < D; c += 8) tr8(src + (int64_t)c * lds, lds, dst + c, ldd);
}

// ---- centroid vectors: L floats from a float32 or float16 table -------------------------------

template <int L>
inline void cent_copy(float* dst, const float* gb, int code) {
  __builtin_memcpy(dst, gb + code * L, L * sizeof(float));
}
template <int L>
inline void cent_copy(float* dst, const uint16_t* gb, int code) {
#if TKV_W >= 8
  const uint16_t* s = gb + code * L;
  if (L == 8) {
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
  } else if (L == 4) {
    _mm_storeu_ps(dst, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))));
  } else {
    int32_t w;
    __builtin_memcpy(&w, s, 4);
    _mm_storel_pi(reinterpret_cast<__m64*>(dst), _mm_cvtph_ps(_mm_cvtsi32_si128(w)));
  }
#else
  for (int e = 0; e < L; ++e) dst[e] = fp16_to_f32(gb[code * L + e]);
#endif
}

// W channels [c0, c0 + W) of one token's channel codes (row[g]: the code of channel group g, L channels each;
// cb: the head's centroids, group g's at cb + g * gstride) from the float16 table: W / L centroid vectors
// side by side in one float16 -> float32 conversion
template <int L>
inline vf crow(const uint16_t* cb, int64_t gstride, const uint8_t* row, int c0) {
  const int g0 = c0 / L;
#if TKV_W >= 8
  // (indexed in bytes from each group's table: the code scales in the load's address, as in traw)
  auto tab = [&](int g) { return reinterpret_cast<const char*>(cb + g * gstride); };
  auto q8 = [&](int j) {  // the 8 float16 values of groups g0 + j.. (L = 8: one code; 4: two; 2: four)
    const int g = g0 + j;
    if (L == 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tab(g) + (size_t)row[g] * 16));
    if (L == 4) {
      int64_t a, b;
      __builtin_memcpy(&a, tab(g) + (size_t)row[g] * 8, 8);
      __builtin_memcpy(&b, tab(g + 1) + (size_t)row[g + 1] * 8, 8);
      return _mm_set_epi64x(b, a);
    }
    int32_t w[4];
    for (int e = 0; e < 4; ++e) __builtin_memcpy(w + e, tab(g + e) + (size_t)row[g + e] * 4, 4);
    return _mm_setr_epi32(w[0], w[1], w[2], w[3]);
  };
#if TKV_W == 16
  const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(q8(0)), q8(8 / L), 1);
  return (vf)_mm512_cvtph_ps(h);
#else
  return (vf)_mm256_cvtph_ps(q8(0));
#endif
#else
  vf x;
  for (int e = 0; e < W; ++e) {
    const int g = (c0 + e) / L;
    x[e] = fp16_to_f32(cb[g * gstride + row[g] * L + (c0 + e) % L]);
  }
  (void)g0;
  return x;
#endif
}

#if TKV_W == 16
// W channels of one token's channel codes (crow's values) from its groups' tables T[0 .. W / L) (byte pointers,
// hoisted out of the token loop by the caller) and its codes row[0 .. W / L)
template <int L>
__attribute__((always_inline)) inline __m256i crow16(const char* const* T, const uint8_t* row) {
  if (L == 8)
    return _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(T[0] + (size_t)row[0] * 16))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(T[1] + (size_t)row[1] * 16)), 1);
  if (L == 4) {
    const __m128i lo = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(T[0] + (size_t)row[0] * 8)),
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(T[1] + (size_t)row[1] * 8)));
    const __m128i hi = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(T[2] + (size_t)row[2] * 8)),
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(T[3] + (size_t)row[3] * 8)));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
  }
  int32_t w[8];
  for (int e = 0; e < 8; ++e) __builtin_memcpy(w + e, T[e] + (size_t)row[e] * 4, 4);
  return _mm256_setr_epi32(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]);
}

// 32 channels' values of one token's channel codes (L = 2 or 4 channels per code; codes row[0 .. 32 / L), groups
// g0 ..) as 32 fp16 in one gather: group e's entry r lies (e * kc + r) * 2L bytes from the head's first table cb.
// One vpgather for the 32 / L scalar index loads, loads and shuffles of two crow16 (~1/4 less time in a
// channel-chunked K's decode, SmolLM2's shape; gathers are not slowed by a GDS mitigation on the CPUs with AVX-512
// FP16 / AMX).  Channel-chunked V at L = 4 and every 8-channel code keep crow16: gathers measured no faster there
// (L = 8, 16-byte entries as qword pairs: slower)
template <int L>
__attribute__((always_inline)) inline __m512i crow32(const uint16_t* cb, int kc, const uint8_t* row, int g0) {
  static_assert(L == 2 || L == 4, "crow32: 2 or 4 channels per code");
  if (L == 2) {  // 16 entries of 4 bytes
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
    const __m512i grp = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(g0));
    return _mm512_i32gather_epi32(_mm512_add_epi32(codes, _mm512_mullo_epi32(grp, _mm512_set1_epi32(kc))), cb, 4);
  }
  // L == 4: 8 entries of 8 bytes
  const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row)));
  const __m256i grp = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(g0));
  return _mm512_i32gather_epi64(_mm256_add_epi32(codes, _mm256_mullo_epi32(grp, _mm256_set1_epi32(kc))),
                                reinterpret_cast<const long long*>(cb), 8);
}
inline vf lo16(__m512i h) { return (vf)_mm512_cvtph_ps(_mm512_castsi512_si256(h)); }
inline vf hi16(__m512i h) { return (vf)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)); }

#endif

// ---- codes -> normalized values of one block (8 tokens, one KV head) ----------------------------

template <int L, class T>
inline void dec_temporal_cols(const Codec& cd, const T* table, int h, int D, const uint8_t* codes, float* dst,
                              int ld) {
  const int G = D / L;
  const int64_t gstride = (int64_t)cd.kc * L;
  const T* cb = table + (int64_t)h * G * gstride;
  for (int j = 0; j < BLOCK / L; ++j) {
    const uint8_t* row = codes + j * D;
    const T* gb = cb;
    for (int c0 = 0; c0 < D; c0 += L, gb += gstride)
      for (int m = 0; m < L; ++m) cent_copy<L>(dst + (int64_t)(c0 + m) * ld + j * L, gb, row[c0 + m]);
  }
}

template <int L, class T>
inline void dec_channel_rows(const Codec& cd, const T* table, int h, int D, const uint8_t* codes, float* dst,
                             int ld) {
  const int G = D / L;
  const int64_t gstride = (int64_t)cd.kc * L;
  const T* cb = table + (int64_t)h * G * gstride;
  if constexpr (sizeof(T) == 2) {  // the float16 table: W channels per conversion (the same values)
    if (D % W == 0) {
      for (int c0 = 0; c0 < D; c0 += W)  // (channels outer: the groups' table addresses stay in registers)
        for (int t = 0; t < BLOCK; ++t) vstore(dst + (int64_t)t * ld + c0, crow<L>(cb, gstride, codes + t * G, c0));
      return;
    }
  }
  for (int t = 0; t < BLOCK; ++t) {
    const uint8_t* row = codes + t * G;
    const T* gb = cb;
    for (int gi = 0; gi < G; ++gi, gb += gstride) cent_copy<L>(dst + (int64_t)t * ld + gi * L, gb, row[gi]);
  }
}

// W channels at a time: the W codes are cut out of the packed bits by per-lane shifts, and the
// value picked from the KC codebook vectors (table [KC][D]) by a tree of selects on the code's bits
template <int BITS>
inline void dec_scalar_rows(const Codec& cd, int h, int D, const uint8_t* codes, float* dst, int ld) {
  constexpr int KC = 1 << BITS;
  typedef uint32_t vu __attribute__((vector_size(W * 4)));
  const float* tb = cd.centK + (int64_t)h * KC * D;
  const int rowb = D * BITS / 8;
  for (int c0 = 0; c0 < D; c0 += W) {
    // W * BITS bits from bit c0 * BITS: whole bytes, or (W * BITS = 4) one half of a byte
    constexpr int NB = W * BITS >= 8 ? W * BITS / 8 : 1;
    const int bitpos = c0 * BITS, byte = bitpos / 8, boff = bitpos % 8;
    vi hi, sh;
    for (int i = 0; i < W; ++i) {
      const int sb = boff + i * BITS;
      hi[i] = sb >= 32 ? -1 : 0;
      sh[i] = sb % 32;
    }
    vf T[KC];
    for (int k = 0; k < KC; ++k) T[k] = vload(tb + (int64_t)k * D + c0);
    for (int t = 0; t < BLOCK; ++t) {
      uint32_t w[2] = {0, 0};
      __builtin_memcpy(w, codes + t * rowb + byte, NB);
      const vi wv = hi ? (vi{} + (int32_t)w[1]) : (vi{} + (int32_t)w[0]);
      const vi idx = (vi)((vu)wv >> (vu)sh);
      vf v[KC];
      for (int k = 0; k < KC; ++k) v[k] = T[k];
      for (int b = 0; b < BITS; ++b) {
        const vi m = ((idx >> b) & 1) != 0;
        for (int k = 0; k < (KC >> (b + 1)); ++k) v[k] = m ? v[2 * k + 1] : v[2 * k];
      }
      vstore(dst + (int64_t)t * ld + c0, v[0]);
    }
  }
}

// scaled integer codes (SCALED: the selective formats), rows: dst[t][c] = (code - qoff) * scale[t], one token's
// BITS-bit codes packed along the channels (lowest channel in the lowest bits), W at a time.  The product is exact
// in float32 (<= 8 bits times an fp16 scale), as the torch codec computes it.
// W codes of BITS bits (8, 4 or 2) from bit c0 * BITS of a row, as integers: lane i takes byte i / (8 / BITS), its
// bits (i % (8 / BITS)) * BITS and up
// BITS < 8: the W codes are W * BITS <= 64 bits, read as one integer; a lane takes the 32-bit half holding its code
// and shifts it down (a partial memcpy into a vector was assembled byte group by byte group through general
// registers: ~2/3 of the selective decode's unpacking on an AMX Xeon)
template <int BITS>
struct Unpack {
  typedef uint8_t vb __attribute__((vector_size(W)));
  static constexpr int PER32 = 32 / BITS;  // codes per 32-bit half
  vi sh, upper;
  Unpack() {
    for (int i = 0; i < W; ++i) {
      sh[i] = (i % PER32) * BITS;
      upper[i] = i >= PER32 ? -1 : 0;
    }
  }
  vi operator()(const uint8_t* row, int c0) const {
    if constexpr (BITS == 8) {
      vb b;
      __builtin_memcpy(&b, row + c0, W);
      return __builtin_convertvector(b, vi);
    }
    uint64_t w = 0;
    __builtin_memcpy(&w, row + c0 * BITS / 8, W * BITS / 8);
    const vi lo = vi{} + (int32_t)(uint32_t)w, hi = vi{} + (int32_t)(uint32_t)(w >> 32);
    return (((hi & upper) | (lo & ~upper)) >> sh) & ((1 << BITS) - 1);
  }
};

template <int BITS>
inline void dec_scaled_rows(const Codec& cd, int D, const uint8_t* codes, const uint16_t* rs, float* dst, int ld) {
  const Unpack<BITS> un;
  const int rowb = D * BITS / 8;
  const vi off = vi{} + cd.qoff;
  for (int t = 0; t < BLOCK; ++t) {
    const vf s = vbc(fp16_to_f32(rs[t]));
    const uint8_t* row = codes + (int64_t)t * rowb;
    for (int c0 = 0; c0 < D; c0 += W)
      vstore(dst + (int64_t)t * ld + c0, __builtin_convertvector(un(row, c0) - off, vf) * s);
  }
}

// TaDA's deviations (AFFINE: the values), rows of one block: dst[t][c] = code * scale + min (two roundings: the
// torch codecs' float32 ops), the scale and min of c's group
template <int BITS>
inline void dec_affine_rows(const Codec& cd, int D, const uint8_t* codes, const uint16_t* par, float* dst, int ld) {
  const Unpack<BITS> un;
  const int rowb = D * BITS / 8, G = D / cd.group;  // (W divides the group: 32 | 128 or the whole head)
  float pf[BLOCK * 2 * (MAX_D / W)];  // the block's scales and mins, converted W at a time (not one by one)
  half_to_f32(pf, par, BLOCK * 2 * G, 0);
  for (int t = 0; t < BLOCK; ++t) {
    const uint8_t* row = codes + (int64_t)t * rowb;
    const float* pt = pf + t * 2 * G;
    for (int gi = 0; gi < G; ++gi) {
      const vf sc = vbc(pt[gi]), mn = vbc(pt[G + gi]);  // once per group, not per vector
      for (int c0 = gi * cd.group; c0 < (gi + 1) * cd.group; c0 += W)
        vstore(dst + (int64_t)t * ld + c0, __builtin_convertvector(un(row, c0), vf) * sc + mn);
    }
  }
}

// TaDA's head mean of a block as 8 rows mean[t][D] where every head's share of it is at least W channels: each share W
// channels at a time straight from its record, a share's last vector overlapping the one before it
template <bool BF16, class Share>
inline void tada_mean_rows(float* mean, int D, int shares, int mc, int last, Share share) {
  for (int sh = 0; sh < shares; ++sh) {
    const int c0 = sh * mc, n = sh + 1 < shares ? mc : last;
    const uint16_t* m = share(sh);
    for (int t = 0; t < BLOCK; ++t, m += mc) {
      for (int j = 0; j + W < n; j += W) vstore(mean + t * D + c0 + j, vload_half(m + j, BF16));
      vstore(mean + t * D + c0 + n - W, vload_half(m + n - W, BF16));
    }
  }
}

// ---- the rows' formats (TaDA, QJL's values, selective) read W channels at a time ----------------------------------
// A block of rows as dec_tada_rows and the fast decode's fused kernels (rows_kscores, rows_pv) read it: load(rec,
// slot) readies the block, at(u, c) = row u's channels c .. c + W - 1 in registers.  DC: the head dim where known at
// compile time, else 0 (known: ~10% of TaDA's decode call).

// TaDA: load() assembles the block's mean rows (tada_mean_rows: every head's share at least W channels) and converts
// its parameters; at() = mean - (code * scale + min) (TadaCodec.decode's float32 ops: two roundings, then the
// difference; the deviations stored first and the mean's shares subtracted at the shares' offsets - vectors
// straddling two stores, the mean's dtype tested per vector - took ~10% more of TaDA's decode call)
template <int BITS, int DC>
struct TadaRows {
  static constexpr int DK = DC;
  const Codec& cd;
  const Layout& L;
  const int h, D, G, mc, shares, last, rowb;
  const Unpack<BITS> un;
  int gi[MAX_D / W];  // each W channels' group (not a division per vector; DC known: not used)
  alignas(64) float mean[BLOCK * (DC ? DC : MAX_D)];
  float pf[BLOCK * 2 * (MAX_D / W)];
  const uint8_t* codes = nullptr;
  TadaRows(const Codec& c, const Layout& l, int h_, int D_)
      : cd(c), L(l), h(h_), D(DC ? DC : D_), G(D / c.group), mc(c.mean_c), shares((D + mc - 1) / mc),
        last(D - (shares - 1) * mc), rowb(D * BITS / 8) {
    if (!DC)  // (one group - D <= 128 - without a division per vector)
      for (int i = 0; i < D; i += W) gi[i / W] = G == 1 ? 0 : i / cd.group;
  }
  static bool serves(const Codec& c, int D) {  // (DC known: at() takes the groups as TaDA sizes them)
    const int shares = (D + c.mean_c - 1) / c.mean_c;
    return c.mean_c >= W && D - (shares - 1) * c.mean_c >= W && (!DC || c.group == (D < 128 ? D : 128));
  }
  __attribute__((always_inline)) void load(const uint8_t* rec, int slot) {
    const uint8_t* rec0 = rec - (int64_t)h * L.rec_bytes;
    auto share = [&](int sh) {
      return reinterpret_cast<const uint16_t*>(rec0 + (int64_t)sh * L.rec_bytes + cd.mean_off) +
             (int64_t)slot * BLOCK * mc;
    };
    if (L.bf16)
      tada_mean_rows<true>(mean, D, shares, mc, last, share);
    else
      tada_mean_rows<false>(mean, D, shares, mc, last, share);
    half_to_f32(pf, reinterpret_cast<const uint16_t*>(rec + cd.scales_off) + (int64_t)slot * BLOCK * 2 * G,
                BLOCK * 2 * G, 0);
    codes = rec + cd.codes_off + (int64_t)slot * cd.code_bytes;
  }
  __attribute__((always_inline)) vf at(int u, int c) const {  // (DC known: sizes and c's group as constants)
    const int Dn = DC ? DC : D, Gn = DC ? (DC + 127) / 128 : G, g = DC ? c / (DC < 128 ? DC : 128) : gi[c / W];
    const float* pt = pf + u * 2 * Gn;
    return vload(mean + u * Dn + c) -
           (__builtin_convertvector(un(codes + u * (Dn * BITS / 8), c), vf) * vbc(pt[g]) + vbc(pt[Gn + g]));
  }
};

// the selective formats: at() = (code - qoff) * the token's scale, dec_scaled_rows's values
template <int BITS, int DC>
struct ScaledRows {
  static constexpr int DK = DC;
  const Codec& cd;
  const int D, rowb;
  const Unpack<BITS> un;
  const vi off;
  float s[BLOCK];
  const uint8_t* codes = nullptr;
  ScaledRows(const Codec& c, const Layout&, int, int D_)
      : cd(c), D(DC ? DC : D_), rowb(D * BITS / 8), off(vi{} + c.qoff) {}
  static bool serves(const Codec&, int) { return true; }
  __attribute__((always_inline)) void load(const uint8_t* rec, int slot) {
    half_to_f32(s, reinterpret_cast<const uint16_t*>(rec + cd.scales_off) + (int64_t)slot * BLOCK, BLOCK, 0);
    codes = rec + cd.codes_off + (int64_t)slot * cd.code_bytes;
  }
  __attribute__((always_inline)) vf at(int u, int c) const {
    return __builtin_convertvector(un(codes + u * ((DC ? DC : D) * BITS / 8), c) - off, vf) * vbc(s[u]);
  }
};

// QJL's values: at() = code * scale + min, the scale and min of c's group (dec_affine_rows's values; groups a power
// of 2 of at least 2W channels: the group a shift away)
template <int BITS, int DC>
struct AffineRows {
  static constexpr int DK = DC;
  const Codec& cd;
  const int D, G, rowb, gshift;
  const Unpack<BITS> un;
  float pf[BLOCK * 2 * (MAX_D / W)];
  const uint8_t* codes = nullptr;
  AffineRows(const Codec& c, const Layout&, int, int D_)
      : cd(c), D(DC ? DC : D_), G(D / c.group), rowb(D * BITS / 8), gshift(__builtin_ctz(c.group)) {}
  static bool serves(const Codec& c, int) { return c.group >= 2 * W && (c.group & (c.group - 1)) == 0; }
  __attribute__((always_inline)) void load(const uint8_t* rec, int slot) {
    half_to_f32(pf, reinterpret_cast<const uint16_t*>(rec + cd.scales_off) + (int64_t)slot * BLOCK * 2 * G,
                BLOCK * 2 * G, 0);
    codes = rec + cd.codes_off + (int64_t)slot * cd.code_bytes;
  }
  __attribute__((always_inline)) vf at(int u, int c) const {
    const float* pt = pf + u * 2 * G;
    const int g = c >> gshift;
    return __builtin_convertvector(un(codes + u * ((DC ? DC : D) * BITS / 8), c), vf) * vbc(pt[g]) + vbc(pt[G + g]);
  }
};

// TaDA, rows of one block of head h: dst[t][c] = mean[t][c] - (code * scale + min) (TadaCodec.decode's float32 ops:
// two roundings, then the difference); the head mean's channels from the records of every head of the page (rec0:
// head 0's), head sh keeping channels sh * mean_c .. + mean_c - 1.  MEAN = false (AFFINE, QJL's values): the
// deviations alone.  Shares of at least W channels: the rows as TadaRows reads them (the block's mean rows first, W
// channels at a time).  Shares narrower than W (more KV heads than D / W): each token's mean assembled element-wise,
// the deviations stored, then subtracted.
template <int BITS, bool MEAN = true>
inline void dec_tada_rows(const Codec& cd, const Layout& L, const uint8_t* rec0, int h, int slot, float* dst,
                          int ld) {
  const int D = L.D, G = D / cd.group;
  const uint8_t* rec = rec0 + (int64_t)h * L.rec_bytes;
  const uint8_t* codes = rec + cd.codes_off + (int64_t)slot * cd.code_bytes;
  const uint16_t* par = reinterpret_cast<const uint16_t*>(rec + cd.scales_off) + (int64_t)slot * BLOCK * 2 * G;
  if constexpr (!MEAN) {
    dec_affine_rows<BITS>(cd, D, codes, par, dst, ld);
  } else {
    const int mc = cd.mean_c, shares = (D + mc - 1) / mc, last = D - (shares - 1) * mc;
    auto share = [&](int sh) {  // head sh's share of the block's 8 tokens: [8][mean_c]
      return reinterpret_cast<const uint16_t*>(rec0 + (int64_t)sh * L.rec_bytes + cd.mean_off) +
             (int64_t)slot * BLOCK * mc;
    };
    if (TadaRows<BITS, 0>::serves(cd, D)) {
      TadaRows<BITS, 0> rw(cd, L, h, D);
      rw.load(rec, slot);
      for (int t = 0; t < BLOCK; ++t)
        for (int c = 0; c < D; c += W) vstore(dst + (int64_t)t * ld + c, rw.at(t, c));
    } else {
      alignas(64) float dev[BLOCK * MAX_D];
      dec_affine_rows<BITS>(cd, D, codes, par, dev, D);
      alignas(64) float mean[MAX_D];
      for (int t = 0; t < BLOCK; ++t) {
        for (int sh = 0; sh < shares; ++sh)
          half_to_f32(mean + sh * mc, share(sh) + (int64_t)t * mc, sh + 1 < shares ? mc : last, L.bf16);
        for (int c0 = 0; c0 < D; c0 += W)
          vstore(dst + (int64_t)t * ld + c0, vload(mean + c0) - vload(dev + t * D + c0));
      }
    }
  }
}

template <class T>
inline void dec_native(const Codec& cd, const T* table, int h, int D, const uint8_t* codes, float* dst, int ld,
                       const uint16_t* rs) {
  if (cd.method == SCALED) {
    if (cd.bits == 4)
      dec_scaled_rows<4>(cd, D, codes, rs, dst, ld);
    else
      dec_scaled_rows<8>(cd, D, codes, rs, dst, ld);
    return;
  }
  if (cd.method == TEMPORAL) {
    switch (cd.chunk) {
      case 2: dec_temporal_cols<2>(cd, table, h, D, codes, dst, ld); break;
      case 4: dec_temporal_cols<4>(cd, table, h, D, codes, dst, ld); break;
      default: dec_temporal_cols<8>(cd, table, h, D, codes, dst, ld); break;
    }
  } else if (cd.method == CHANNEL) {
    switch (cd.chunk) {
      case 2: dec_channel_rows<2>(cd, table, h, D, codes, dst, ld); break;
      case 4: dec_channel_rows<4>(cd, table, h, D, codes, dst, ld); break;
      default: dec_channel_rows<8>(cd, table, h, D, codes, dst, ld); break;
    }
  } else {  // scalar codebooks are tiny: always the float32 table
    switch (cd.bits) {
      case 4: dec_scalar_rows<4>(cd, h, D, codes, dst, ld); break;
      case 2: dec_scalar_rows<2>(cd, h, D, codes, dst, ld); break;
      default: dec_scalar_rows<1>(cd, h, D, codes, dst, ld); break;
    }
  }
}

// normalized values of one block, as rows dst[t * ld + c] or columns dst[c * ld + t]; half: from the
// float16 tables (attention), else float32 (bit-exact gather); rs: the block's 8 token scales (SCALED only)
inline void decode_block(const Codec& cd, int h, int D, const uint8_t* codes, float* dst, int ld, bool cols,
                         float* tmp, bool half = false, const uint16_t* rs = nullptr) {
  const bool native_cols = cd.method == TEMPORAL;
  float* d = native_cols == cols ? dst : tmp;
  const int dl = native_cols == cols ? ld : (native_cols ? BLOCK : D);
  if (half)
    dec_native(cd, cd.cent16, h, D, codes, d, dl, rs);
  else
    dec_native(cd, cd.cent, h, D, codes, d, dl, rs);
  if (native_cols == cols) return;
  if (native_cols)
    cols_to_rows(tmp, BLOCK, dst, ld, D);
  else
    rows_to_cols(tmp, D, dst, ld, D);
}

// decode_block for the block in `slot` of head h's record rec (its page's head-0 record: rec - h * rec_bytes):
// every method, TaDA's head mean included
inline void decode_block_at(const Codec& cd, const Layout& L, int h, const uint8_t* rec, int slot, float* dst,
                            int ld, bool cols, float* tmp, bool half) {
  if (cd.method != TADA && cd.method != AFFINE) {
    decode_block(cd, h, L.D, rec + cd.codes_off + (int64_t)slot * cd.code_bytes, dst, ld, cols, tmp, half,
                 row_scales(rec, cd, slot));
    return;
  }
  float* d = cols ? tmp : dst;
  const int dl = cols ? L.D : ld;
  const uint8_t* rec0 = rec - (int64_t)h * L.rec_bytes;
  if (cd.method == AFFINE) {
    switch (cd.bits) {
      case 8: dec_tada_rows<8, false>(cd, L, rec0, h, slot, d, dl); break;
      case 4: dec_tada_rows<4, false>(cd, L, rec0, h, slot, d, dl); break;
      default: dec_tada_rows<2, false>(cd, L, rec0, h, slot, d, dl); break;
    }
  } else {
    switch (cd.bits) {
      case 8: dec_tada_rows<8>(cd, L, rec0, h, slot, d, dl); break;
      case 4: dec_tada_rows<4>(cd, L, rec0, h, slot, d, dl); break;
      default: dec_tada_rows<2>(cd, L, rec0, h, slot, d, dl); break;
    }
  }
  if (cols) rows_to_cols(tmp, L.D, dst, ld, L.D);
}

// ---- fused decode attention ---------------------------------------------------------------------

// s[i][t] = sum_c qr[i][c] * KT[c][t] for GB query heads, t < DTILE.  QC vectors of tokens per pass (AVX-512: the
// whole tile, 4 x GB independent sums, each query broadcast once per channel; with two, each sum's chain of FMAs
// was bound by their latency)
template <int GB>
inline void qk_tile(const float* qr, int D, const float* KT, float* sc) {
  constexpr int QC = W == 16 && GB <= 4 ? DTILE / W : 2;
  for (int t = 0; t < DTILE; t += QC * W) {
    vf a[QC][GB];
    for (int j = 0; j < QC; ++j)
      for (int i = 0; i < GB; ++i) a[j][i] = vf{};
    for (int c = 0; c < D; ++c) {
      vf k[QC];
      for (int j = 0; j < QC; ++j) k[j] = vload(KT + c * DTILE + t + j * W);
      for (int i = 0; i < GB; ++i) {
        const vf qb = vbc(qr[i * D + c]);
        for (int j = 0; j < QC; ++j) a[j][i] = vfma(qb, k[j], a[j][i]);
      }
    }
    for (int i = 0; i < GB; ++i)
      for (int j = 0; j < QC; ++j) vstore(sc + i * DTILE + t + j * W, a[j][i]);
  }
}

// acc[i][c] += sum_{t < n} p[i][t] * row(t, c .. c + W - 1) for GB query heads (n tokens: the sums loaded once;
// channels 2W at a time, tokens in order): stored rows (pv_rows) and rows read from their codes (rows_pv) alike
template <int GB, class RowAt>
inline void pv_sum(float* acc, int astride, const float* p, int pstride, int D, int n, RowAt row) {
  for (int c = 0; c < D; c += 2 * W) {
    vf a0[GB], a1[GB];
    for (int i = 0; i < GB; ++i) {
      a0[i] = vload(acc + i * astride + c);
      a1[i] = vload(acc + i * astride + c + W);
    }
    for (int t = 0; t < n; ++t) {
      const vf z0 = row(t, c), z1 = row(t, c + W);
      for (int i = 0; i < GB; ++i) {
        const vf pb = vbc(p[i * pstride + t]);
        a0[i] = vfma(pb, z0, a0[i]);
        a1[i] = vfma(pb, z1, a1[i]);
      }
    }
    for (int i = 0; i < GB; ++i) {
      vstore(acc + i * astride + c, a0[i]);
      vstore(acc + i * astride + c + W, a1[i]);
    }
  }
}

// acc[i][c] += sum_{t < n} p[i][t] * Z[t][c] for GB query heads
template <int GB>
inline void pv_rows(float* acc, int astride, const float* p, int pstride, const float* Z, int D, int n) {
  pv_sum<GB>(acc, astride, p, pstride, D, n, [&](int t, int c) { return vload(Z + t * D + c); });
}

inline void pv_rows_any(float* acc, int astride, const float* p, int g, const float* Z, int D, int n) {
  int i = 0;
  for (; i + 4 <= g; i += 4) pv_rows<4>(acc + i * astride, astride, p + i * DTILE, DTILE, Z, D, n);
  switch (g - i) {
    case 3: pv_rows<3>(acc + i * astride, astride, p + i * DTILE, DTILE, Z, D, n); break;
    case 2: pv_rows<2>(acc + i * astride, astride, p + i * DTILE, DTILE, Z, D, n); break;
    case 1: pv_rows<1>(acc + i * astride, astride, p + i * DTILE, DTILE, Z, D, n); break;
    default: break;
  }
}

inline void qk_tile_any(const float* qr, int g, int D, const float* KT, float* sc) {
  int i = 0;
  for (; i + 4 <= g; i += 4) qk_tile<4>(qr + i * D, D, KT, sc + i * DTILE);
  switch (g - i) {
    case 3: qk_tile<3>(qr + i * D, D, KT, sc + i * DTILE); break;
    case 2: qk_tile<2>(qr + i * D, D, KT, sc + i * DTILE); break;
    case 1: qk_tile<1>(qr + i * D, D, KT, sc + i * DTILE); break;
    default: break;
  }
}

// ---- QJL keys (seed 002): scores straight from the sign sketches --------------------------------
// A block of 8 keys of one KV head (codecs/qjl.py QJLKeyQuantizer): per token the m sign bits of S k_in (bit j of
// byte i: sketch row 8i + j, 1 = positive), then per token the m_o sign bits of S_o k_out (S_o: S's first m_o
// rows), per token ||k|| and ||k_out|| (fp16), then the block's 8 outlier channels (uint8).  QJL's estimate of a
// post-RoPE query's score is linear in q:
//   sqrt(pi/2)/m ||k_in|| <S (q - q_M), sign(S k_in)> + sqrt(pi/2)/m_o ||k_out|| <S_o q_M, sign(S_o k_out)>
// (q_M: q on the block's outlier channels, 0 elsewhere; ||k_in|| = sqrt(max(||k||^2 - ||k_out||^2, 0))).  S q once
// per call, S q_M (8 columns of S) once per block, then two signed sums per token and query head: no key is
// reconstructed (the torch path's surrogate k_hat costs (m + m_o) x D multiply-adds per token).  The sums run in
// another order than the torch path's matmuls: the scores agree to float32 rounding, not bit for bit.
constexpr float SQRT_HALF_PI = 1.2533141373155003f;  // sqrt(pi / 2)

// lanes (all ones) where sketch rows j0 .. j0 + W - 1 of a packed sign row are positive (lanebit: 1 << lane) - the
// sign tests off AVX-512, where the bits are a mask register as they lie
inline vi sign_lanes(const uint8_t* row, int j0, vi lanebit) {
  uint32_t w = 0;
  __builtin_memcpy(&w, row + j0 / 8, W >= 8 ? W / 8 : 1);
  if (W < 8) w >>= j0 % 8;
  return ((vi{} + (int32_t)w) & lanebit) != 0;
}

// pos where sketch rows j0 .. j0 + W - 1 of a packed sign row are positive, else neg
inline vf qjl_signs(const uint8_t* row, int j0, vi lanebit, vf pos, vf neg) {
#if TKV_W == 16
  // AVX-512: the 16 sign bits are the blend's mask register as they lie (no broadcast, and, compare)
  uint16_t m;
  __builtin_memcpy(&m, row + j0 / 8, 2);
  return (vf)_mm512_mask_blend_ps((__mmask16)m, (__m512)neg, (__m512)pos);
#else
  return sign_lanes(row, j0, lanebit) ? pos : neg;
#endif
}

// a sum in any order (QJL's scores promise float32 rounding, not an order): a tree, not hsum's sequence
inline float hsum_any(vf v) {
#if TKV_W == 16
  return _mm512_reduce_add_ps((__m512)v);
#else
  float t[W];
  __builtin_memcpy(t, &v, sizeof v);
  for (int w = W / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
#endif
}

#if TKV_W == 16
// out[u] = the sum of p[u]'s 16 lanes, for 16 vectors at once (a transpose-and-add tree: 45 vector ops)
__attribute__((always_inline)) inline vf hsum16(const vf* p) {
  __m512 a[8], b[4];
  for (int k = 0; k < 8; ++k) {
    const __m512 x = (__m512)p[2 * k], y = (__m512)p[2 * k + 1];
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int m = 0; m < 4; ++m) {
    const __m512d x = _mm512_castps_pd(a[2 * m]), y = _mm512_castps_pd(a[2 * m + 1]);
    b[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return (vf)_mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// out[i] = <s + i * ss, the signs of row> over n sketch rows, GB query heads (each row's signs built once)
template <int GB>
inline void qjl_dots(const float* s, int ss, const uint8_t* row, int n, vi lanebit, float* out) {
  vf acc[GB];
  for (int i = 0; i < GB; ++i) acc[i] = vf{};
  const vf one = vbc(1.f), mone = vbc(-1.f);
  for (int j = 0; j < n; j += W) {
    const vf sg = qjl_signs(row, j, lanebit, one, mone);
    for (int i = 0; i < GB; ++i) acc[i] = vfma(vload(s + i * ss + j), sg, acc[i]);
  }
  for (int i = 0; i < GB; ++i) out[i] = hsum_any(acc[i]);
}

// Sq[i] = S qr[i] ([g][m]) from S^T [D][m]: channels outer, 4 vectors of rows at a time (4 independent chains; one
// vector at a time the multiply-adds waited on each other)
inline void qjl_sketch_queries(const Codec& K, int D, int g, const float* qr, float* Sq) {
  const int m = K.chunk;
  for (int i = 0; i < g; ++i) {
    int j = 0;
    for (; j + 4 * W <= m; j += 4 * W) {
      vf a0 = vf{}, a1 = vf{}, a2 = vf{}, a3 = vf{};
      for (int c = 0; c < D; ++c) {
        const vf x = vbc(qr[i * D + c]);
        const float* r = K.cent + (int64_t)c * m + j;
        a0 = vfma(x, vload(r), a0);
        a1 = vfma(x, vload(r + W), a1);
        a2 = vfma(x, vload(r + 2 * W), a2);
        a3 = vfma(x, vload(r + 3 * W), a3);
      }
      vstore(Sq + i * m + j, a0);
      vstore(Sq + i * m + j + W, a1);
      vstore(Sq + i * m + j + 2 * W, a2);
      vstore(Sq + i * m + j + 3 * W, a3);
    }
    for (; j < m; j += W) {
      vf acc = vf{};
      for (int c = 0; c < D; ++c) acc = vfma(vbc(qr[i * D + c]), vload(K.cent + (int64_t)c * m + j), acc);
      vstore(Sq + i * m + j, acc);
    }
  }
}

// lane i's bit of a sign row's W-bit slice (sign_lanes' test off AVX-512)
inline vi lane_bits() {
  vi b;
  for (int i = 0; i < W; ++i) b[i] = 1 << i;
  return b;
}

// where a QJL block's parts start (the layout in the comment above) and a token's two score factors
// sqrt(pi/2)/m ||k_in|| and sqrt(pi/2)/m_o ||k_out||
struct QjlBlock {
  const uint8_t* in;   // [8][m / 8] sign bits of S k_in
  const uint8_t* out;  // [8][m_o / 8] sign bits of S_o k_out
  const uint8_t* nrm;  // [8][2] fp16 ||k||, ||k_out||
  const uint8_t* oc;   // [8] outlier channels
  int m, mo;
  QjlBlock(const Codec& K, const uint8_t* blk)
      : in(blk), out(blk + BLOCK * (K.chunk / 8)), nrm(out + BLOCK * (K.kc / 8)), oc(nrm + BLOCK * 4),
        m(K.chunk), mo(K.kc) {}
  void factors(int t, float* ai, float* ao) const {
    uint16_t hn[2];
    __builtin_memcpy(hn, nrm + 4 * t, 4);
    const float nu = fp16_to_f32(hn[0]), nuo = fp16_to_f32(hn[1]);
    const float n2 = nu * nu - nuo * nuo;
    *ai = SQRT_HALF_PI / m * (n2 > 0.f ? __builtin_sqrtf(n2) : 0.f);
    *ao = SQRT_HALF_PI / mo * nuo;
  }
};

// acc + s in the lanes whose sign bits j0 .. j0 + W - 1 of a packed sign row are set (1 = positive)
inline vf add_where(vf acc, vf s, const uint8_t* row, int j0, vi lanebit) {
#if TKV_W == 16
  // the 16 bits are the add's mask register as they lie (through a general register: loaded straight from memory
  // into the mask register, a microbenchmark of this loop ran ~20% slower on an AMD EPYC)
  uint16_t m;
  __builtin_memcpy(&m, row + j0 / 8, 2);
  return (vf)_mm512_mask_add_ps((__m512)acc, (__mmask16)m, (__m512)acc, (__m512)s);
#else
  return sign_lanes(row, j0, lanebit) ? acc + s : acc;
#endif
}

// A block's 8 keys at once, GB query heads at once: out[i * BLOCK + t] = the lane-wise sums of s_i[j] (s_i = s + i *
// ss, j < n) over the sketch rows where token t's signs (rows + t * rs) are positive.  Each head's W sketch values are
// loaded once for the 8 tokens, and the 8 x GB sums are independent chains of masked adds (one key at a time, the
// chains were too few to hide the adds' latency).
template <int GB>
inline void qjl_pos_sums(const float* s, int ss, int n, const uint8_t* rows, int rs, vi lanebit, vf* out) {
  vf acc[BLOCK][GB];
  for (int t = 0; t < BLOCK; ++t)
    for (int i = 0; i < GB; ++i) acc[t][i] = vf{};
  for (int j = 0; j < n; j += W) {
    vf sv[GB];
    for (int i = 0; i < GB; ++i) sv[i] = vload(s + i * ss + j);
    for (int t = 0; t < BLOCK; ++t)
      for (int i = 0; i < GB; ++i) acc[t][i] = add_where(acc[t][i], sv[i], rows + t * rs, j, lanebit);
  }
  for (int i = 0; i < GB; ++i)
    for (int t = 0; t < BLOCK; ++t) out[i * BLOCK + t] = acc[t][i];
}

// The scores o[i * DTILE + t] of a block's 8 keys for GB query heads (sketches s_i = s + i * ss: m inlier then m_o
// outlier values; tot[2i], tot[2i + 1]: their sums).  A signed sum is twice the sum over the positive signs minus the
// total, so each sign costs one masked add and the token's factors ai[t] / ao[t] come after the sums:
//   ai[t] (2 P_in - tot_in) + ao[t] (2 P_out - tot_out)
// (float32 rounding of the same sums in another order than the torch path's: the scores agree to float32 rounding)
template <int GB>
inline void qjl_scores8(const float* s, int ss, int m, int mo, const QjlBlock& qb, const float* af, const float* tot,
                        vi lanebit, float* o) {
  vf pin[GB * BLOCK], pout[GB * BLOCK];
  qjl_pos_sums<GB>(s, ss, m, qb.in, m / 8, lanebit, pin);
  qjl_pos_sums<GB>(s + m, ss, mo, qb.out, mo / 8, lanebit, pout);
#if TKV_W == 16
  // the 16 vectors' sums at once (lanes 0-7 the inlier sums, 8-15 the outlier sums), scaled lane-wise by the tokens'
  // factors (f: ai then ao) and the two halves added
  const vf f = vload(af);
  for (int i = 0; i < GB; ++i) {
    vf v[16];
    for (int t = 0; t < BLOCK; ++t) v[t] = pin[i * BLOCK + t], v[BLOCK + t] = pout[i * BLOCK + t];
    const vf r = hsum16(v);
    const __m512 tt = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(tot[2 * i]), _mm512_set1_ps(tot[2 * i + 1]));
    const __m512 x = _mm512_mul_ps((__m512)f, _mm512_sub_ps(_mm512_add_ps((__m512)r, (__m512)r), tt));
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    _mm256_storeu_ps(o + i * DTILE, _mm256_add_ps(_mm512_castps512_ps256(x), hi));
  }
#else
  for (int i = 0; i < GB; ++i) {
    float pi[BLOCK], po[BLOCK];
    for (int t = 0; t < BLOCK; ++t) pi[t] = hsum_any(pin[i * BLOCK + t]), po[t] = hsum_any(pout[i * BLOCK + t]);
    const float ti = tot[2 * i], to = tot[2 * i + 1];
    for (int t = 0; t < BLOCK; ++t) o[i * DTILE + t] = af[t] * (2.f * pi[t] - ti) + af[BLOCK + t] * (2.f * po[t] - to);
  }
#endif
}

// A block's sketches of GB query heads (q_i = qr + i * D, S q_i = Sq + i * m): s_in = S q - S q_M (the first m of
// s_i = sb + i * ss), s_out = S_o q_M (the next m_o), and their sums tot[2i], tot[2i + 1] (q_M: q on the block's 8
// outlier channels, columns col of S).  j outer, heads inner: each column vector is loaded once for GB heads.
template <int GB>
inline void qjl_adjust(const float* const* col, const uint8_t* oc, int D, int m, int mo, const float* qr,
                       const float* Sq, float* sb, int ss, float* tot) {
  vf qv[GB][QJL_OUTLIERS];
  for (int i = 0; i < GB; ++i)
    for (int o = 0; o < QJL_OUTLIERS; ++o) qv[i][o] = vbc(oc[o] < D ? qr[i * D + oc[o]] : 0.f);
  vf tin[GB], tout[GB];
  for (int i = 0; i < GB; ++i) tin[i] = tout[i] = vf{};
  for (int j = 0; j < m; j += W) {  // (m, m_o: multiples of 32; m_o <= m)
    vf c[QJL_OUTLIERS];
    for (int o = 0; o < QJL_OUTLIERS; ++o) c[o] = vload(col[o] + j);
    for (int i = 0; i < GB; ++i) {
      vf a = qv[i][0] * c[0], b = qv[i][1] * c[1];  // two chains of multiply-adds
      for (int o = 2; o < QJL_OUTLIERS; o += 2) {
        a = vfma(qv[i][o], c[o], a);
        b = vfma(qv[i][o + 1], c[o + 1], b);
      }
      const vf u = a + b, si = vload(Sq + i * m + j) - u;
      vstore(sb + i * ss + j, si);
      tin[i] += si;
      if (j < mo) {
        vstore(sb + i * ss + m + j, u);
        tout[i] += u;
      }
    }
  }
  for (int i = 0; i < GB; ++i) tot[2 * i] = hsum_any(tin[i]), tot[2 * i + 1] = hsum_any(tout[i]);
}

// the scores sc[i * DTILE + c0 + t] of one block's 8 keys (blk) for g query heads qr (already scaled), Sq = S qr;
// sb: scratch of g * (m + m_o + 2) floats, the block's adjusted sketches and their sums
inline void qjl_block(const Codec& K, int D, int g, const float* qr, const float* Sq, const uint8_t* blk, float* sb,
                      float* sc, int c0, vi lanebit) {
  const QjlBlock qb(K, blk);
  const int m = qb.m, mo = qb.mo, ms = m + mo;
  float* tot = sb + g * ms;  // [g][2]: the sums of s_in and s_out
  const uint8_t* oc = qb.oc;
  // query heads at a time: the scores' 8 x GB accumulators (of 32 vector registers), the adjustment's column vectors
  // loaded once for GB heads
  constexpr int GB = W == 16 ? 3 : 1;
  // the outlier channels' columns of S (written blocks name distinct channels < D; another byte reads column 0 with
  // a zero coefficient)
  const float* col[QJL_OUTLIERS];
  for (int o = 0; o < QJL_OUTLIERS; ++o) col[o] = K.cent + (int64_t)(oc[o] < D ? oc[o] : 0) * m;
  int i = 0;
  for (; i + GB <= g; i += GB) qjl_adjust<GB>(col, oc, D, m, mo, qr + i * D, Sq + i * m, sb + i * ms, ms, tot + 2 * i);
  for (; i < g; ++i) qjl_adjust<1>(col, oc, D, m, mo, qr + i * D, Sq + i * m, sb + i * ms, ms, tot + 2 * i);
  float af[2 * BLOCK];  // the tokens' factors: ai, then ao
  for (int t = 0; t < BLOCK; ++t) qb.factors(t, af + t, af + BLOCK + t);
  float* o = sc + c0;
  for (i = 0; i + GB <= g; i += GB)
    qjl_scores8<GB>(sb + i * ms, ms, m, mo, qb, af, tot + 2 * i, lanebit, o + i * DTILE);
  for (; i < g; ++i) qjl_scores8<1>(sb + i * ms, ms, m, mo, qb, af, tot + 2 * i, lanebit, o + i * DTILE);
}

// With the table of signed 4-row sums (K.qlut, ops.cpp qjl_table): a key's sums are its m / 4 table rows (picked by
// its sign nibbles) added in order, ~1/4 of the vector ops; the outlier channels' likewise over its m_o / 4.  The same
// sums in another order again (float32 rounding), and the same on every ISA (each channel summed alone, in order).
template <int DC>
inline void qjl_table_rows(const Codec& K, int D_, const QjlBlock& qb, const bool* outlier, float* dst) {
  const int D = DC ? DC : D_, m = qb.m, mo = qb.mo;
  constexpr int NV = (DC ? DC : MAX_D) / W;
  const float* T = K.qlut;
  for (int t = 0; t < BLOCK; ++t) {
    float* x = dst + t * D;
    vf acc[NV];
    for (int v = 0; v < D / W; ++v) acc[v] = vf{};
    const uint8_t* row = qb.in + t * (m / 8);
    for (int g = 0; g < m / 4; ++g) {
      const float* tr = T + ((int64_t)g * 16 + ((row[g >> 1] >> ((g & 1) * 4)) & 15)) * D;
      for (int v = 0; v < D / W; ++v) acc[v] = acc[v] + vload(tr + v * W);
    }
    for (int v = 0; v < D / W; ++v) vstore(x + v * W, acc[v]);
    float ai, ao;
    qb.factors(t, &ai, &ao);
    const uint8_t* ro = qb.out + t * (mo / 8);
    for (int c = 0; c < D; ++c) {
      if (outlier[c]) {
        float y = 0.f;
        for (int g = 0; g < mo / 4; ++g) y = y + T[((int64_t)g * 16 + ((ro[g >> 1] >> ((g & 1) * 4)) & 15)) * D + c];
        x[c] = ao * y;
      } else {
        x[c] = ai * x[c];
      }
    }
  }
}

// QJL's surrogate keys k_hat of one block's 8 tokens, rows dst[t * D + c] (codecs/qjl.py key_surrogate, what the
// torch path decodes for a prefill chunk's attention): channel c's signed sum of column c of S (S_o on the block's
// outlier channels) times sqrt(pi/2)/m ||k_in|| (sqrt(pi/2)/m_o ||k_out||), in float32 - in another order than the
// torch path's matmul, so it may differ from it by float32 rounding (a model-dtype unit where that rounding flips)
inline void qjl_surrogate_rows(const Codec& K, int D, const uint8_t* blk, float* dst) {
  const QjlBlock qb(K, blk);
  const int m = qb.m, mo = qb.mo;
  bool outlier[MAX_D] = {};
  for (int o = 0; o < QJL_OUTLIERS; ++o)
    if (qb.oc[o] < D) outlier[qb.oc[o]] = true;
  if (K.qlut) {
    switch (D) {
      case 64: qjl_table_rows<64>(K, D, qb, outlier, dst); return;
      case 128: qjl_table_rows<128>(K, D, qb, outlier, dst); return;
      default: qjl_table_rows<0>(K, D, qb, outlier, dst); return;
    }
  }
  const vi lanebit = lane_bits();
  for (int t = 0; t < BLOCK; ++t) {
    float* x = dst + t * D;
    for (int c = 0; c < D; c += 4) qjl_dots<4>(K.cent + (int64_t)c * m, m, qb.in + t * (m / 8), m, lanebit, x + c);
    float ai, ao;
    qb.factors(t, &ai, &ao);
    for (int c = 0; c < D; ++c) {
      if (outlier[c]) {
        qjl_dots<1>(K.cent + (int64_t)c * m, m, qb.out + t * (mo / 8), mo, lanebit, x + c);
        x[c] = ao * x[c];
      } else {
        x[c] = ai * x[c];
      }
    }
  }
}

// ---- temporal V: accumulate straight from the centroid vectors ---------------------------------
// A temporal code holds L consecutive tokens of one channel, so the 8 tokens of a block for channel
// c are 8/L centroid vectors side by side: one 8-lane vector.  acc8[i][c] (lane = token in block)
// += p[i][block] * that vector; the lanes are summed once per split.  No decode-to-rows transpose.
typedef float v8 __attribute__((vector_size(32)));
inline v8 v8load(const float* p) { v8 v; __builtin_memcpy(&v, p, sizeof v); return v; }
inline void v8store(float* p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }
inline v8 v8fma(v8 a, v8 b, v8 c) {
#if TKV_W >= 8
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline v8 v8round(v8 x, int bf16) {  // bf16: 1 bfloat16, 0 float16, 2 no rounding
  typedef uint32_t u8v __attribute__((vector_size(32)));
  if (bf16 == 2) return x;
  if (bf16) {
    u8v u;
    __builtin_memcpy(&u, &x, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    __builtin_memcpy(&x, &u, sizeof u);
    return x;
  }
#if TKV_W >= 8
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int i = 0; i < 8; ++i) x[i] = round_half(x[i], 0);
  return x;
#endif
}

#if TKV_W >= 8
// the 8 float16 values of channel c of one block of temporal codes (8/L centroid vectors side by side)
template <int L>
inline __m128i traw(const uint16_t* gb, const uint8_t* codes, int D, int c) {
  // a centroid is 2 * L bytes: indexed in bytes, the code scales in the load's address (x8 for L = 4) instead of
  // a shift per code (~10% of the 2-bit decode on an AMX Xeon; the same values)
  const char* tb = reinterpret_cast<const char*>(gb);
  if (L == 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tb + (size_t)codes[c] * 16));
  if (L == 4) {
    int64_t a, b;
    __builtin_memcpy(&a, tb + (size_t)codes[c] * 8, 8);
    __builtin_memcpy(&b, tb + (size_t)codes[D + c] * 8, 8);
    return _mm_set_epi64x(b, a);
  }
  int32_t w0, w1, w2, w3;
  __builtin_memcpy(&w0, tb + (size_t)codes[c] * 4, 4);
  __builtin_memcpy(&w1, tb + (size_t)codes[D + c] * 4, 4);
  __builtin_memcpy(&w2, tb + (size_t)codes[2 * D + c] * 4, 4);
  __builtin_memcpy(&w3, tb + (size_t)codes[3 * D + c] * 4, 4);
  return _mm_setr_epi32(w0, w1, w2, w3);
}

#endif

// Where a tile's blocks of codes are (the fast decode's): block b of the tile at bc[b] (BlockPtrs: any pages), or
// at base + b * CB (BlockRun: the tile inside one page, its blocks one after the other; CB, the bytes of one block's
// codes, a compile-time constant).  A tile inside one page - every tile of pages of >= 64 tokens but the first and
// last of a context - then reads no pointer per block and the codes at constant offsets: -11% time per decode call
// on the AMX Xeon (SmolLM2's shape, batch 8 x 4200; V -8%, K -2%).
struct BlockPtrs {
  const uint8_t* const* bc;
  const uint8_t* operator()(int b) const { return bc[b]; }
};
template <int CB>
struct BlockRun {
  const uint8_t* base;
  const uint8_t* operator()(int b) const { return base + b * CB; }
};

// W consecutive tokens [t, t + W) of a tile (t a multiple of W) of channel c, from the blocks' temporal codes
// bc(t / 8), ...: the fast decode's unit (16 tokens = two blocks in one float16 -> float32 conversion)
template <int L, class Codes>
inline vf tvec(const uint16_t* gb, Codes bc, int t, int D, int c) {
#if TKV_W == 16
  const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(traw<L>(gb, bc(t / BLOCK), D, c)),
                                            traw<L>(gb, bc(t / BLOCK + 1), D, c), 1);
  return (vf)_mm512_cvtph_ps(h);
#elif TKV_W == 8
  return (vf)_mm256_cvtph_ps(traw<L>(gb, bc(t / BLOCK), D, c));
#else
  const uint8_t* codes = bc(t / BLOCK);
  vf x;
  for (int e = 0; e < W; ++e) {
    const int u = t % BLOCK + e;  // token in its block
    x[e] = fp16_to_f32(gb[codes[(u / L) * D + c] * L + u % L]);
  }
  return x;
#endif
}

template <int L>
inline v8 tblock(const uint16_t* gb, const uint8_t* codes, int D, int c) {
#if TKV_W >= 8
  return _mm256_cvtph_ps(traw<L>(gb, codes, D, c));
#else
  float x[8];
  for (int j = 0; j < BLOCK / L; ++j)
    for (int e = 0; e < L; ++e) x[j * L + e] = fp16_to_f32(gb[codes[j * D + c] * L + e]);
  return v8load(x);
#endif
}

// blocks [b0, b1) of a tile whose V codes start at bc[b]; p [GB][DTILE]; acc8 [GB][D][8] (stride astride)
template <int L, int GB>
inline void pv_temporal(float* acc8, int64_t astride, const float* p, const uint8_t* const* bc, int b0, int b1,
                        const uint16_t* cb, int64_t gstride, int D, const float* vstd, const float* vmean,
                        int bf16) {
  const uint16_t* gb = cb;
  for (int c0 = 0; c0 < D; c0 += L, gb += gstride) {
    for (int m = 0; m < L; ++m) {
      const int c = c0 + m;
      const v8 sd = v8{} + vstd[c], mn = v8{} + vmean[c];
      v8 a[GB];
      for (int i = 0; i < GB; ++i) a[i] = v8load(acc8 + i * astride + c * 8);
      for (int b = b0; b < b1; ++b) {
        const v8 x = v8round(tblock<L>(gb, bc[b], D, c) * sd + mn, bf16);
        for (int i = 0; i < GB; ++i) a[i] = v8fma(v8load(p + i * DTILE + b * BLOCK), x, a[i]);
      }
      for (int i = 0; i < GB; ++i) v8store(acc8 + i * astride + c * 8, a[i]);
    }
  }
}

template <int L>
inline void pv_temporal_any(float* acc8, int g, int D, const float* p, const uint8_t* const* bc, int b0, int b1,
                            const uint16_t* cb, int64_t gstride, const float* vstd, const float* vmean, int bf16) {
  const int64_t as = (int64_t)D * 8;
  int i = 0;
  for (; i + 4 <= g; i += 4)
    pv_temporal<L, 4>(acc8 + i * as, as, p + i * DTILE, bc, b0, b1, cb, gstride, D, vstd, vmean, bf16);
  switch (g - i) {
    case 3: pv_temporal<L, 3>(acc8 + i * as, as, p + i * DTILE, bc, b0, b1, cb, gstride, D, vstd, vmean, bf16); break;
    case 2: pv_temporal<L, 2>(acc8 + i * as, as, p + i * DTILE, bc, b0, b1, cb, gstride, D, vstd, vmean, bf16); break;
    case 1: pv_temporal<L, 1>(acc8 + i * as, as, p + i * DTILE, bc, b0, b1, cb, gstride, D, vstd, vmean, bf16); break;
    default: break;
  }
}

// temporal K of one block straight into the tile's columns: dst[c * DTILE + t], from the float16 table
template <int L>
inline void dec_temporal_kt(const Codec& cd, int h, int D, const uint8_t* codes, float* dst) {
  const int64_t gstride = (int64_t)cd.kc * L;
  const uint16_t* gb = cd.cent16 + (int64_t)h * (D / L) * gstride;
  for (int c0 = 0; c0 < D; c0 += L, gb += gstride)
    for (int m = 0; m < L; ++m) v8store(dst + (c0 + m) * DTILE, tblock<L>(gb, codes, D, c0 + m));
}

// ---- the fast decode (exact=False): no model-dtype rounding to reproduce, so -------------------
// V is accumulated in normalized space (denormalized once per split, in decode_merge), and K is decoded,
// denormalized and rotated by its offset in the tile in one pass.  Both read W tokens of one channel at a
// time (tvec); the blocks of a tile outside the valid range point at a valid block's codes (finite values
// whose softmax weights are exactly 0).

// acc[i][c][e] += p[i][t + e] * z[t + e][c], over a whole tile, for GB query heads; acc [GB][D][W]
template <int L, int GB, int DC, class Codes>  // DC: the head dim where known at compile time, else 0 (D_)
inline void pv_temporal_z(float* acc, int64_t astride, const float* p, Codes bc, const uint16_t* cb, int64_t gstride,
                          int D_) {
  const int D = DC ? DC : D_;
  // the tile's weights in registers for all its channels (AVX-512: GB x 4 vectors; read through p in the loop, the
  // compiler reloaded them for every channel - acc may alias p - a quarter of the loop's loads beside the lookups')
  constexpr int PR = W == 16 && GB <= 4 ? DTILE / W : 1;
  vf pr[GB][PR];
  for (int i = 0; i < GB; ++i)
    for (int j = 0; j < PR; ++j) pr[i][j] = vload(p + i * DTILE + j * W);
  const uint16_t* gb = cb;
  for (int c0 = 0; c0 < D; c0 += L, gb += gstride) {
    for (int m = 0; m < L; ++m) {
      const int c = c0 + m;
      vf a[GB];
      for (int i = 0; i < GB; ++i) a[i] = vload(acc + i * astride + c * W);
      for (int t = 0; t < DTILE; t += W) {
        const vf x = tvec<L>(gb, bc, t, D, c);
        for (int i = 0; i < GB; ++i) a[i] = vfma(PR > 1 ? pr[i][t / W] : vload(p + i * DTILE + t), x, a[i]);
      }
      for (int i = 0; i < GB; ++i) vstore(acc + i * astride + c * W, a[i]);
    }
  }
}

template <int L, int DC, class Codes>
inline void pv_temporal_z_any(float* acc, int g, int D_, const float* p, Codes bc, const uint16_t* cb,
                              int64_t gstride) {
  const int D = DC ? DC : D_;
  const int64_t as = (int64_t)D * W;
  int i = 0;
  for (; i + 4 <= g; i += 4) pv_temporal_z<L, 4, DC>(acc + i * as, as, p + i * DTILE, bc, cb, gstride, D);
  switch (g - i) {
    case 3: pv_temporal_z<L, 3, DC>(acc + i * as, as, p + i * DTILE, bc, cb, gstride, D); break;
    case 2: pv_temporal_z<L, 2, DC>(acc + i * as, as, p + i * DTILE, bc, cb, gstride, D); break;
    case 1: pv_temporal_z<L, 1, DC>(acc + i * as, as, p + i * DTILE, bc, cb, gstride, D); break;
    default: break;
  }
}

// whether a tile's blocks of codes lie one after the other (one page): BlockRun serves them
inline bool tile_run(const uint8_t* const* bc, int code_bytes) {
  for (int b = 1; b < DTILE / BLOCK; ++b)
    if (bc[b] != bc[0] + (int64_t)b * code_bytes) return false;
  return true;
}

// pv_temporal_z_any on a tile's codes bc (BlockRun where the head dim DT is known and the blocks are one run)
template <int L, int DT>
inline void pv_temporal_tile(float* acc, int g, int D, const float* p, const uint8_t* const* bc, const uint16_t* cb,
                             int64_t gstride) {
  if (DT && tile_run(bc, (BLOCK / L) * D))
    pv_temporal_z_any<L, DT>(acc, g, D, p, BlockRun<(BLOCK / L) * DT>{bc[0]}, cb, gstride);
  else
    pv_temporal_z_any<L, DT>(acc, g, D, p, BlockPtrs{bc}, cb, gstride);
}

// channel-chunked V: acc[i][c] += sum over the tile's tokens of p[i][t] * z[t][c], normalized space, each token's
// row decoded W channels at a time straight into the FMAs (acc: the partial state's accz, stride astride).
// CH chunks of W channels at once: GB * CH independent accumulator chains (one chain per head was bound by the
// FMA latency, one token after the other)
template <int L, int GB, int CH>
inline void pv_channel_z(float* acc, int64_t astride, const float* p, const uint8_t* const* bc, int b0, int b1,
                         const uint16_t* cb, int64_t gstride, int D) {
  const int G = D / L;
  for (int c0 = 0; c0 < D; c0 += CH * W) {
    vf a[GB][CH];
    for (int i = 0; i < GB; ++i)
      for (int k = 0; k < CH; ++k) a[i][k] = vload(acc + i * astride + c0 + k * W);
#if TKV_W == 16
    // the CH x W / L groups' tables, hoisted out of the token loop (crow recomputed them per token: ~10% of a call)
    const char* T[CH][W / L];
    for (int k = 0; k < CH; ++k)
      for (int e = 0; e < W / L; ++e) T[k][e] = reinterpret_cast<const char*>(cb + ((c0 + k * W) / L + e) * gstride);
    const bool gathers = g_gathers;
#endif
    for (int b = b0; b < b1; ++b) {
      const uint8_t* row = bc[b];
      const float* pb = p + b * BLOCK;
      for (int t = 0; t < BLOCK; ++t, row += G) {
        vf z[CH];
#if TKV_W == 16
        bool done = false;
        if constexpr (L == 2 && CH % 2 == 0) {
          if (gathers) {  // two chunks per gather (crow32)
            for (int k = 0; k < CH; k += 2) {
              const __m512i hh = crow32<L>(cb, (int)(gstride / L), row + (c0 + k * W) / L, (c0 + k * W) / L);
              z[k] = lo16(hh);
              z[k + 1] = hi16(hh);
            }
            done = true;
          }
        }
        if (!done)
          for (int k = 0; k < CH; ++k) z[k] = (vf)_mm512_cvtph_ps(crow16<L>(T[k], row + (c0 + k * W) / L));
#else
        for (int k = 0; k < CH; ++k) z[k] = crow<L>(cb, gstride, row, c0 + k * W);
#endif
        for (int i = 0; i < GB; ++i) {
          const vf w = vbc(pb[i * DTILE + t]);
          for (int k = 0; k < CH; ++k) a[i][k] = vfma(w, z[k], a[i][k]);
        }
      }
    }
    for (int i = 0; i < GB; ++i)
      for (int k = 0; k < CH; ++k) vstore(acc + i * astride + c0 + k * W, a[i][k]);
  }
}

template <int L, int GB>
inline void pv_channel_z_ch(float* acc, int64_t astride, const float* p, const uint8_t* const* bc, int b0, int b1,
                            const uint16_t* cb, int64_t gstride, int D) {
  constexpr int CH = W == 16 ? 4 : 2;  // 4 x 4 zmm accumulators of 32; 4 x 2 ymm of 16
  if (D % (CH * W) == 0)
    pv_channel_z<L, GB, CH>(acc, astride, p, bc, b0, b1, cb, gstride, D);
  else
    pv_channel_z<L, GB, 1>(acc, astride, p, bc, b0, b1, cb, gstride, D);
}

template <int L>
inline void pv_channel_z_any(float* acc, int64_t astride, int g, int D, const float* p, const uint8_t* const* bc,
                             int b0, int b1, const uint16_t* cb, int64_t gstride) {
  int i = 0;
  for (; i + 4 <= g; i += 4) pv_channel_z_ch<L, 4>(acc + i * astride, astride, p + i * DTILE, bc, b0, b1, cb, gstride, D);
  switch (g - i) {
    case 3: pv_channel_z_ch<L, 3>(acc + i * astride, astride, p + i * DTILE, bc, b0, b1, cb, gstride, D); break;
    case 2: pv_channel_z_ch<L, 2>(acc + i * astride, astride, p + i * DTILE, bc, b0, b1, cb, gstride, D); break;
    case 1: pv_channel_z_ch<L, 1>(acc + i * astride, astride, p + i * DTILE, bc, b0, b1, cb, gstride, D); break;
    default: break;
  }
}

// temporal K of a tile, decoded, denormalized (z * std + mean) and rotated by each key's offset in the tile
// (dcos/dsin [D/2][DTILE]) in one pass: KT[c][t].  gb0: the head's first channel group's centroids.
template <int L, int DC, class Codes>  // DC: the head dim where known at compile time, else 0 (D_)
inline void ktile_fast(float* KT, Codes kc, const uint16_t* gb0, int64_t gstride, int D_, const float* kstd,
                       const float* kmean, const float* dcos, const float* dsin) {
  const int D = DC ? DC : D_;
  const int HD = D / 2;
  for (int c = 0; c < HD; ++c) {
    const uint16_t* g0 = gb0 + (c / L) * gstride;
    const uint16_t* g1 = gb0 + ((c + HD) / L) * gstride;
    const vf sd0 = vbc(kstd[c]), mn0 = vbc(kmean[c]), sd1 = vbc(kstd[c + HD]), mn1 = vbc(kmean[c + HD]);
    for (int t = 0; t < DTILE; t += W) {
      const vf k0 = vfma(tvec<L>(g0, kc, t, D, c), sd0, mn0);
      const vf k1 = vfma(tvec<L>(g1, kc, t, D, c + HD), sd1, mn1);
      const vf cc = vload(dcos + c * DTILE + t), ss = vload(dsin + c * DTILE + t);
      rope_store(KT + c * DTILE + t, KT + (c + HD) * DTILE + t, k0, k1, cc, ss);
    }
  }
}

#if TKV_W == 16
// ktile_fast and qk_tile in one pass (AVX-512, GB <= 4 query heads): each rotated key vector goes straight into the
// tile's 4 x GB score sums (registers) instead of through KT - no stores and reloads of the decoded keys, and 16 KB
// less to keep in L1 beside the tables.  qr: the queries as qk_tile takes them; the scores' float32 sums in another
// order than KT's (channel pairs c, c + D/2 together).
template <int L, int DC, int GB, class Codes>
inline void kqk_fast(float* sc, const float* qr, Codes kc, const uint16_t* gb0, int64_t gstride, int D_,
                     const float* kstd, const float* kmean, const float* dcos, const float* dsin) {
  const int D = DC ? DC : D_;
  const int HD = D / 2;
  constexpr int NC = DTILE / W;
  vf acc[NC][GB];
  for (int j = 0; j < NC; ++j)
    for (int i = 0; i < GB; ++i) acc[j][i] = vf{};
  for (int c = 0; c < HD; ++c) {
    const uint16_t* g0 = gb0 + (c / L) * gstride;
    const uint16_t* g1 = gb0 + ((c + HD) / L) * gstride;
    const vf sd0 = vbc(kstd[c]), mn0 = vbc(kmean[c]), sd1 = vbc(kstd[c + HD]), mn1 = vbc(kmean[c + HD]);
    vf r0[NC], r1[NC];
    for (int j = 0; j < NC; ++j) {
      const int t = j * W;
      const vf k0 = vfma(tvec<L>(g0, kc, t, D, c), sd0, mn0);
      const vf k1 = vfma(tvec<L>(g1, kc, t, D, c + HD), sd1, mn1);
      const vf cc = vload(dcos + c * DTILE + t), ss = vload(dsin + c * DTILE + t);
      r0[j] = vfma(k0, cc, -(k1 * ss));
      r1[j] = vfma(k1, cc, k0 * ss);
    }
    for (int i = 0; i < GB; ++i) {
      const vf q0 = vbc(qr[i * D + c]), q1 = vbc(qr[i * D + c + HD]);
      for (int j = 0; j < NC; ++j) acc[j][i] = vfma(q1, r1[j], vfma(q0, r0[j], acc[j][i]));
    }
  }
  for (int i = 0; i < GB; ++i)
    for (int j = 0; j < NC; ++j) vstore(sc + i * DTILE + j * W, acc[j][i]);
}

template <int L, int DC, class Codes>
inline bool kqk_fast_any(float* sc, const float* qr, int g, Codes kc, const uint16_t* gb0, int64_t gstride, int D,
                         const float* kstd, const float* kmean, const float* dcos, const float* dsin) {
  switch (g) {
    case 1: kqk_fast<L, DC, 1>(sc, qr, kc, gb0, gstride, D, kstd, kmean, dcos, dsin); return true;
    case 2: kqk_fast<L, DC, 2>(sc, qr, kc, gb0, gstride, D, kstd, kmean, dcos, dsin); return true;
    case 3: kqk_fast<L, DC, 3>(sc, qr, kc, gb0, gstride, D, kstd, kmean, dcos, dsin); return true;
    case 4: kqk_fast<L, DC, 4>(sc, qr, kc, gb0, gstride, D, kstd, kmean, dcos, dsin); return true;
    default: return false;
  }
}
#endif

// K and the scores of a tile from its codes kc (BlockRun where the head dim DT is known and the blocks are one run):
// kqk_fast where it serves (returns true: sc holds the scores), else the decoded keys into KT (false)
template <int L, int DT>
inline bool kscores_fast_tile(float* KT, float* sc, const float* qr, int g, const uint8_t* const* kc,
                              const uint16_t* gb0, int64_t gstride, int D, const float* kstd, const float* kmean,
                              const float* dcos, const float* dsin) {
#if TKV_W == 16
  if (DT && tile_run(kc, (BLOCK / L) * D))
    return kqk_fast_any<L, DT>(sc, qr, g, BlockRun<(BLOCK / L) * DT>{kc[0]}, gb0, gstride, D, kstd, kmean, dcos, dsin);
  return kqk_fast_any<L, DT>(sc, qr, g, BlockPtrs{kc}, gb0, gstride, D, kstd, kmean, dcos, dsin);
#else
  (void)sc, (void)qr, (void)g, (void)KT, (void)kc, (void)gb0, (void)gstride, (void)D, (void)kstd, (void)kmean,
      (void)dcos, (void)dsin;
  return false;
#endif
}

// ktile_fast on a tile's codes kc (BlockRun where the head dim DT is known and the blocks are one run)
template <int L, int DT>
inline void ktile_fast_tile(float* KT, const uint8_t* const* kc, const uint16_t* gb0, int64_t gstride, int D,
                            const float* kstd, const float* kmean, const float* dcos, const float* dsin) {
  if (DT && tile_run(kc, (BLOCK / L) * D))
    ktile_fast<L, DT>(KT, BlockRun<(BLOCK / L) * DT>{kc[0]}, gb0, gstride, D, kstd, kmean, dcos, dsin);
  else
    ktile_fast<L, DT>(KT, BlockPtrs{kc}, gb0, gstride, D, kstd, kmean, dcos, dsin);
}

// channel-chunked K of a tile, the same values as decoding then denormalizing and rotating the columns (the same
// float32 ops in the same order), in one pass: W channels of a token's row at a time (crow), denormalized and
// rotated by the token's offset in the tile (rcos/rsin: dcos/dsin as rows, [DTILE][D/2]), into rows tmp
// [DTILE][D], then transposed into KT[c][t].  Channels outer, the tile's tokens inner: only the W/L groups'
// codebooks of channels c and c + D/2 are live at a time (a token at a time walks all D/L groups' tables, 32 KB
// per head at 2 bits, D 64).  With the byte-indexed loads in crow: ~13% less time per decode call than decoding,
// transposing and rotating block by block (SmolLM2 shape, 8k).  Needs D/2 % W == 0.
template <int L>
inline void ktile_channel_fast(float* KT, const uint8_t* const* kc, const uint16_t* cb, int64_t gstride, int D,
                               const float* kstd, const float* kmean, const float* rcos, const float* rsin,
                               float* tmp) {
  const int HD = D / 2, G = D / L;
  for (int c = 0; c < HD; c += W) {
    const vf sd0 = vload(kstd + c), mn0 = vload(kmean + c), sd1 = vload(kstd + c + HD), mn1 = vload(kmean + c + HD);
    for (int t = 0; t < DTILE; ++t) {
      const uint8_t* row = kc[t / BLOCK] + (t % BLOCK) * G;
      const vf k0 = vfma(crow<L>(cb, gstride, row, c), sd0, mn0);
      const vf k1 = vfma(crow<L>(cb, gstride, row, c + HD), sd1, mn1);
      const vf cc = vload(rcos + t * HD + c), ss = vload(rsin + t * HD + c);
      rope_store(tmp + t * D + c, tmp + t * D + c + HD, k0, k1, cc, ss);
    }
  }
  for (int b = 0; b < DTILE / BLOCK; ++b) rows_to_cols(tmp + b * BLOCK * D, D, KT + b * BLOCK, DTILE, D);
}

#if TKV_W == 16
// sc[i][t0 + u] = <qr[i], rows[u]> for 16 decoded, rotated rows [16][D] and every query head: each row's products
// summed over channels to one vector, the 16 vectors reduced at once (hsum16)
inline void rows_dot16(float* sc, const float* qr, int g, int D, int t0, const float* rows) {
  for (int i = 0; i < g; ++i) {
    const float* qi = qr + i * D;
    vf p[W];
    for (int u = 0; u < W; ++u) {
      vf acc = vload(qi) * vload(rows + u * D);
      for (int c = W; c < D; c += W) acc = vfma(vload(qi + c), vload(rows + u * D + c), acc);
      p[u] = acc;
    }
    vstore(sc + i * DTILE + t0, hsum16(p));
  }
}

// ktile_channel_fast and qk_tile without the transposes (AVX-512): per 16 tokens their rows decoded, denormalized
// and rotated (rows [16][D]), then per query head each row's products with the query summed over channels to one
// vector, and the 16 vectors reduced to the 16 scores at once (hsum16).  The 8 x 8 transposes into KT and the
// column dot products cost ~2.5x this on SmolLM2's shape (the hybrid artifact's channel-chunked K: most layers).
template <int L, int DC, class Codes>
inline void kqk_channel_fast(float* sc, const float* qr, int g, Codes kc, const uint16_t* cb, int64_t gstride,
                             int D_, const float* kstd, const float* kmean, const float* rcos, const float* rsin,
                             float* rows) {
  const int D = DC ? DC : D_;
  const int HD = D / 2, G = D / L;
  constexpr int NG = W / L;  // channel groups per W channels
  if constexpr (L <= 4) {
    if (HD % (2 * W) == 0 && g_gathers) {  // 2 x 32 channels (c, c + D/2) per token in two gathers
      const int kcn = (int)(gstride / L);
      for (int t0 = 0; t0 < DTILE; t0 += W) {
        for (int c = 0; c < HD; c += 2 * W) {
          const vf sa = vload(kstd + c), ma = vload(kmean + c), sb = vload(kstd + c + W), mb = vload(kmean + c + W);
          const vf sa1 = vload(kstd + c + HD), ma1 = vload(kmean + c + HD), sb1 = vload(kstd + c + HD + W),
                   mb1 = vload(kmean + c + HD + W);
          for (int u = 0; u < W; ++u) {
            const int t = t0 + u;
            const uint8_t* row = kc(t / BLOCK) + (t % BLOCK) * G;
            const __m512i h0 = crow32<L>(cb, kcn, row + c / L, c / L);
            const __m512i h1 = crow32<L>(cb, kcn, row + (c + HD) / L, (c + HD) / L);
            const vf k0a = vfma(lo16(h0), sa, ma), k0b = vfma(hi16(h0), sb, mb);
            const vf k1a = vfma(lo16(h1), sa1, ma1), k1b = vfma(hi16(h1), sb1, mb1);
            const vf cca = vload(rcos + t * HD + c), ssa = vload(rsin + t * HD + c);
            const vf ccb = vload(rcos + t * HD + c + W), ssb = vload(rsin + t * HD + c + W);
            rope_store(rows + u * D + c, rows + u * D + c + HD, k0a, k1a, cca, ssa);
            rope_store(rows + u * D + c + W, rows + u * D + c + W + HD, k0b, k1b, ccb, ssb);
          }
        }
        rows_dot16(sc, qr, g, D, t0, rows);
      }
      return;
    }
  }
  for (int t0 = 0; t0 < DTILE; t0 += W) {
    for (int c = 0; c < HD; c += W) {
      const vf sd0 = vload(kstd + c), mn0 = vload(kmean + c), sd1 = vload(kstd + c + HD), mn1 = vload(kmean + c + HD);
      const char* T0[NG];
      const char* T1[NG];
      for (int e = 0; e < NG; ++e) {
        T0[e] = reinterpret_cast<const char*>(cb + (c / L + e) * gstride);
        T1[e] = reinterpret_cast<const char*>(cb + ((c + HD) / L + e) * gstride);
      }
      for (int u = 0; u < W; ++u) {
        const int t = t0 + u;
        const uint8_t* row = kc(t / BLOCK) + (t % BLOCK) * G;
        const vf k0 = vfma((vf)_mm512_cvtph_ps(crow16<L>(T0, row + c / L)), sd0, mn0);
        const vf k1 = vfma((vf)_mm512_cvtph_ps(crow16<L>(T1, row + (c + HD) / L)), sd1, mn1);
        const vf cc = vload(rcos + t * HD + c), ss = vload(rsin + t * HD + c);
        rope_store(rows + u * D + c, rows + u * D + c + HD, k0, k1, cc, ss);
      }
    }
    rows_dot16(sc, qr, g, D, t0, rows);
  }
}
#endif

#if TKV_W == 16
// The scores of 16 decoded rows rows[u][D] (u < 16; t0: their first token's offset in the tile), rotated here by
// their offsets (rcos/rsin: dcos/dsin as rows) in place: per query head each row's products summed over channels to
// one vector, the 16 reduced at once (hsum16) - for keys decoded as rows (selective, TaDA), whose transposes into
// KT and column dot products cost more than this
inline void row_scores16(float* sc, const float* qr, int g, int D, int t0, float* rows, const float* rcos,
                         const float* rsin) {
  const int HD = D / 2;
  for (int u = 0; u < W; ++u) {
    float* r = rows + u * D;
    const int t = t0 + u;
    for (int c = 0; c < HD; c += W) {
      const vf k0 = vload(r + c), k1 = vload(r + c + HD), cc = vload(rcos + t * HD + c), ss = vload(rsin + t * HD + c);
      rope_store(r + c, r + c + HD, k0, k1, cc, ss);
    }
  }
  rows_dot16(sc, qr, g, D, t0, rows);
}
#endif

#if TKV_W == 16
// A tile's keys scored from a rows format's blocks without storing them (GB query heads): per token its row rotated
// by the token's offset (rcos/rsin: dcos/dsin as rows) and dotted with each query head in registers, channel pairs
// (c, c + D/2) together (row_scores16's float32 ops, the sums in another order); 16 tokens' sums reduced at once
// (hsum16).  Blocks outside [v0, v1) score 0 (finite values whose softmax weights are exactly 0).  Decoding the
// rows, then rotating and scoring them (row_scores16) stored and reloaded every key value twice.
template <class Rows, int GB>
inline void rows_kscores(Rows& rw, const uint8_t* const* recs, const int* slots, int v0, int v1, const float* qr,
                         int qs, const float* rcos, const float* rsin, float* sc) {
  const int D = Rows::DK ? Rows::DK : rw.D, HD = D / 2;
  vf p[GB][W];
  for (int b = 0; b < DTILE / BLOCK; ++b) {
    const int c0 = b * BLOCK, u0 = c0 % W;
    if (c0 < v0 || c0 >= v1) {
      for (int i = 0; i < GB; ++i)
        for (int u = 0; u < BLOCK; ++u) p[i][u0 + u] = vf{};
    } else {
      rw.load(recs[b], slots[b]);
      for (int u = 0; u < BLOCK; ++u) {
        const int t = c0 + u;
        vf acc[GB];
        for (int i = 0; i < GB; ++i) acc[i] = vf{};
        for (int c = 0; c < HD; c += W) {
          const vf x0 = rw.at(u, c), x1 = rw.at(u, c + HD);
          const vf cc = vload(rcos + t * HD + c), ss = vload(rsin + t * HD + c);
          const vf r0 = vfma(x0, cc, -(x1 * ss)), r1 = vfma(x1, cc, x0 * ss);
          for (int i = 0; i < GB; ++i)
            acc[i] = vfma(vload(qr + i * qs + c + HD), r1, vfma(vload(qr + i * qs + c), r0, acc[i]));
        }
        for (int i = 0; i < GB; ++i) p[i][u0 + u] = acc[i];
      }
    }
    if (u0 + BLOCK == W)
      for (int i = 0; i < GB; ++i) vstore(sc + i * DTILE + c0 + BLOCK - W, hsum16(p[i]));
  }
}

// A rows format's values of a tile's blocks [b0, b1) accumulated without storing them (GB query heads), block by
// block in pv_sum's order - the same sums as decoding the rows and accumulating them (pv_rows), bit for bit
template <class Rows, int GB>
inline void rows_pv(Rows& rw, const uint8_t* const* recs, const int* slots, int b0, int b1, const float* p,
                    float* acc, int astride) {
  const int D = Rows::DK ? Rows::DK : rw.D;
  for (int b = b0; b < b1; ++b) {
    rw.load(recs[b], slots[b]);
    pv_sum<GB>(acc, astride, p + b * BLOCK, DTILE, D, BLOCK, [&](int u, int c) { return rw.at(u, c); });
  }
}

// rows_kscores / rows_pv for g query heads, 4 at a time (a group's rows decoded again for the next group)
template <class Rows>
inline void rows_kscores_any(Rows& rw, const uint8_t* const* recs, const int* slots, int v0, int v1, const float* qr,
                             int g, const float* rcos, const float* rsin, float* sc) {
  const int D = rw.D;
  for (int i = 0; i < g; i += 4) {
    const float* q = qr + i * D;
    float* s = sc + i * DTILE;
    switch (g - i < 4 ? g - i : 4) {
      case 1: rows_kscores<Rows, 1>(rw, recs, slots, v0, v1, q, D, rcos, rsin, s); break;
      case 2: rows_kscores<Rows, 2>(rw, recs, slots, v0, v1, q, D, rcos, rsin, s); break;
      case 3: rows_kscores<Rows, 3>(rw, recs, slots, v0, v1, q, D, rcos, rsin, s); break;
      default: rows_kscores<Rows, 4>(rw, recs, slots, v0, v1, q, D, rcos, rsin, s); break;
    }
  }
}

template <class Rows>
inline void rows_pv_any(Rows& rw, const uint8_t* const* recs, const int* slots, int b0, int b1, const float* p, int g,
                        float* acc, int astride) {
  for (int i = 0; i < g; i += 4) {
    const float* pi = p + i * DTILE;
    float* ai = acc + (int64_t)i * astride;
    switch (g - i < 4 ? g - i : 4) {
      case 1: rows_pv<Rows, 1>(rw, recs, slots, b0, b1, pi, ai, astride); break;
      case 2: rows_pv<Rows, 2>(rw, recs, slots, b0, b1, pi, ai, astride); break;
      case 3: rows_pv<Rows, 3>(rw, recs, slots, b0, b1, pi, ai, astride); break;
      default: rows_pv<Rows, 4>(rw, recs, slots, b0, b1, pi, ai, astride); break;
    }
  }
}

// fn(rows) with the rows reader of cd's method and bits (TaDA, QJL's values, selective), the head dim DC; false where
// none serves
template <int DC, class Fn>
inline bool with_rows(const Codec& cd, const Layout& L, int h, int D, Fn&& fn) {
  if (cd.method == TADA && TadaRows<4, DC>::serves(cd, D)) {
    switch (cd.bits) {
      case 8: { TadaRows<8, DC> rw(cd, L, h, D); fn(rw); return true; }
      case 4: { TadaRows<4, DC> rw(cd, L, h, D); fn(rw); return true; }
      default: { TadaRows<2, DC> rw(cd, L, h, D); fn(rw); return true; }
    }
  }
  if (cd.method == AFFINE && AffineRows<2, DC>::serves(cd, D)) {
    switch (cd.bits) {
      case 8: { AffineRows<8, DC> rw(cd, L, h, D); fn(rw); return true; }
      case 4: { AffineRows<4, DC> rw(cd, L, h, D); fn(rw); return true; }
      default: { AffineRows<2, DC> rw(cd, L, h, D); fn(rw); return true; }
    }
  }
  if (cd.method == SCALED) {
    if (cd.bits == 4) {
      ScaledRows<4, DC> rw(cd, L, h, D);
      fn(rw);
    } else {
      ScaledRows<8, DC> rw(cd, L, h, D);
      fn(rw);
    }
    return true;
  }
  return false;
}
#endif

// K and the scores of a tile of channel codes kc (kqk_channel_fast, BlockRun where it can): true where it serves
template <int L, int DT>
inline bool kscores_channel_tile(float* sc, const float* qr, int g, const uint8_t* const* kc, const uint16_t* cb,
                                 int64_t gstride, int D, const float* kstd, const float* kmean, const float* rcos,
                                 const float* rsin, float* rows) {
#if TKV_W == 16
  if (DT && tile_run(kc, (BLOCK / L) * D))
    kqk_channel_fast<L, DT>(sc, qr, g, BlockRun<(BLOCK / L) * DT>{kc[0]}, cb, gstride, D, kstd, kmean, rcos, rsin,
                            rows);
  else
    kqk_channel_fast<L, DT>(sc, qr, g, BlockPtrs{kc}, cb, gstride, D, kstd, kmean, rcos, rsin, rows);
  return true;
#else
  (void)sc, (void)qr, (void)g, (void)kc, (void)cb, (void)gstride, (void)D, (void)kstd, (void)kmean, (void)rcos,
      (void)rsin, (void)rows;
  return false;
#endif
}

// Partial state per query head in DecodeArgs::part: [m, lz, lx, pad, accz[D], accx[D]]: running max,
// then softmax weights and weighted V sums.  Every V row is accumulated in raw space (accx, lx; decoded
// rows rounded to the model dtype when exact); the normalized-space pair (accz, lz) is merged as
// (accz*std + lz*mean + accx) / (lz + lx) and stays 0 here.
constexpr float RESCALE_SLACK = 8.f;
inline void rescale(float* st, int D, float alpha) {
  st[1] *= alpha;
  st[2] *= alpha;
  const vf a = vbc(alpha);
  for (int c = 0; c < 2 * D; c += W) vstore(st + 4 + c, vload(st + 4 + c) * a);
}

template <int DT>
void decode_item_t(const DecodeArgs& a, int64_t item) {
  const Layout& L = a.lay;
  const int D = DT ? DT : L.D;
  const int H = L.H, g = a.g, S = a.S, HD = D / 2;
  const int s = (int)(item % S);
  const int64_t rh = item / S;
  const int h = (int)(rh % H);
  const int r = (int)(rh / H);
  const int stride = 4 + 2 * D;
  float* part = a.part + item * g * stride;
  for (int i = 0; i < g; ++i) {
    float* st = part + i * stride;
    st[0] = -__builtin_inff();
    st[1] = st[2] = st[3] = 0.f;
    for (int c = 0; c < 2 * D; ++c) st[4 + c] = 0.f;
  }
  const int n = a.seq_lens[r];
  if (n <= 0) return;
  const int p = n - 1;                   // the query's position
  // decoded blocks: [SINKS, cend); the own block (and a recent window: the ring) exact
  const int cend = p < SINKS ? 0 : (int)exact_from(p, L.window);
  const int32_t* btr = a.bt + (int64_t)r * a.bt_stride;
  const float* q = a.q + ((int64_t)r * a.Hq + (int64_t)h * g) * D;
  const int64_t hd = (int64_t)h * D;
  const int bs = L.block_size;

  alignas(64) float KT[MAX_D * DTILE];      // decoded keys of a tile, [D][DTILE]
  alignas(64) float tmp[BLOCK * MAX_D];
  float* qr = static_cast<float*>(__builtin_alloca(sizeof(float) * g * D));   // rotated queries
  float* sc = static_cast<float*>(__builtin_alloca(sizeof(float) * g * DTILE));  // scores / weights

  const bool vtemp = a.v.method == TEMPORAL;  // V accumulated per lane straight from the centroids
  // the scaled methods' values are raw (std 1, mean 0): the fast decode skips their denormalization
  const bool skip_vnorm = !a.exact && (a.v.method == SCALED || a.v.method == TADA || a.v.method == AFFINE);
  float* ZT = static_cast<float*>(__builtin_alloca(sizeof(float) * DTILE * D));  // a tile's decoded V rows
  // the fast decode (module comment above pv_temporal_z): V in normalized space, K decoded and rotated in one pass
  const bool fast_v = vtemp && !a.exact;
  const bool fast_vc = !a.exact && a.v.method == CHANNEL && D % W == 0;  // channel V, fast: normalized space too
  const bool fast_k = !a.exact && a.k.method == TEMPORAL && L.cap == 0;
  // channel-chunked K, fast: decoded, denormalized and rotated row by row (ktile_channel_fast)
  const bool fast_kc = !a.exact && a.k.method == CHANNEL && L.cap == 0 && HD % W == 0 && HD % BLOCK == 0;
  // keys as rows (selective, TaDA: raw values, std 1 and mean 0), scored straight from their codes (with_rows,
  // rows_kscores), else decoded into rows and scored from them (row_scores16: TaDA's shares narrower than W)
  const bool rows_k = TKV_W == 16 && !a.exact && (a.k.method == SCALED || a.k.method == TADA) && L.cap == 0 &&
                      HD % W == 0 && HD % BLOCK == 0;
  // the rows' values read straight from the codes, never stored (with_rows: TaDA where every head's share of the
  // mean is at least W channels, QJL's values, the selective formats; rows_pv)
  [[maybe_unused]] const bool rows_v = TKV_W == 16 && !a.exact &&
                                       (a.v.method == SCALED || a.v.method == TADA || a.v.method == AFFINE) &&
                                       L.cap == 0 && D % (2 * W) == 0;
  const float* rcos = a.rcs;  // dcos/dsin as rows [DTILE][HD]: the row rotation's factors (once per call)
  float* krows = nullptr;     // a tile's decoded key rows
  if (fast_kc || rows_k) krows = static_cast<float*>(__builtin_alloca(sizeof(float) * DTILE * D));
  const int AW = fast_v ? W : 8;  // lanes per accumulated channel: tokens of a tile (fast) or of a block
  float* acc8 = nullptr;
  if (vtemp) {
    acc8 = static_cast<float*>(__builtin_malloc(sizeof(float) * g * D * AW));
    for (int64_t i = 0; i < (int64_t)g * D * AW; ++i) acc8[i] = 0.f;
  }

  for (int i = 0; i < g * D; ++i) qr[i] = q[i] * a.scale;
  const int rmode = a.exact ? L.round : 2;  // rounding of decoded K/V to the model dtype
  const vi lane = iota();
  // QJL's keys: the queries' sketches S qr (Sq), a block's adjusted ones and their sums (qsb); lanebit: lane i's bit
  // of a sign row
  const bool qjl_k = a.k.method == QJL;
  float* Sq = nullptr;
  float* qsb = nullptr;
  const vi lanebit = lane_bits();
  if (qjl_k) {
    Sq = static_cast<float*>(__builtin_alloca(sizeof(float) * (g * a.k.chunk + g * (a.k.chunk + a.k.kc + 2))));
    qsb = Sq + g * a.k.chunk;
    qjl_sketch_queries(a.k, D, g, qr, Sq);
  }

  if (s == 0) {  // exact tokens: sinks, the own block's earlier tokens (the tail; a recent window's ring), the new token
    const int emax = SINKS + L.ring + 1;
    float* ek = static_cast<float*>(__builtin_malloc(sizeof(float) * 2 * emax * D));
    float* ev = ek + (int64_t)emax * D;
    float* es = static_cast<float*>(__builtin_alloca(sizeof(float) * emax));
    int ne = 0;
    const int nsink = p < SINKS ? p : SINKS;
    const uint8_t* rec0 = record(a.pages, L, a.xp ? a.xp[2 * r] : btr[0], h);
    auto row_f32 = [&](float* dst, const uint16_t* src) { half_to_f32(dst, src, D, L.bf16); };
    for (int j = 0; j < nsink; ++j, ++ne) {
      row_f32(ek + ne * D, region_row(rec0, L, j, 0));
      row_f32(ev + ne * D, region_row(rec0, L, j, 1));
    }
    if (p >= SINKS && p > cend) {  // the ring: token t in slot TAIL0 + t % ring of its own page (small pages: t % 8)
      for (int t = cend; t < p; ++t, ++ne) {
        const uint8_t* rect = record(a.pages, L, a.xp ? a.xp[2 * r + 1] : btr[t / bs], h);
        const int slot = a.xp ? t % BLOCK : TAIL0 + t % L.ring;
        row_f32(ek + ne * D, region_row(rect, L, slot, 0));
        row_f32(ev + ne * D, region_row(rect, L, slot, 1));
      }
    }
    const float* kn = a.knew + ((int64_t)r * H + h) * D;
    const float* vn = a.vnew + ((int64_t)r * H + h) * D;
    for (int c = 0; c < D; ++c) {
      ek[ne * D + c] = kn[c];
      ev[ne * D + c] = vn[c];
    }
    ++ne;
    for (int i = 0; i < g; ++i) {
      float* st = part + i * stride;
      const float* qi = q + i * D;
      float m = -__builtin_inff();
      for (int j = 0; j < ne; ++j) {
        vf acc = vf{};
        for (int c = 0; c < D; c += W) acc = vfma(vload(qi + c), vload(ek + j * D + c), acc);
        es[j] = hsum(acc) * a.scale;
        m = es[j] > m ? es[j] : m;
      }
      float l = 0.f;
      float* ax = st + 4 + D;
      for (int j = 0; j < ne; ++j) {
        const float w = __builtin_expf(es[j] - m);
        l += w;
        const vf wb = vbc(w);
        for (int c = 0; c < D; c += W) vstore(ax + c, vfma(wb, vload(ev + j * D + c), vload(ax + c)));
      }
      st[0] = m;
      st[2] = l;
    }
    __builtin_free(ek);
  }

  const int n_tiles = cend > SINKS ? (cend + DTILE - 1) / DTILE : 0;
  const int t_lo = s * a.tiles_per_split;
  const int t_hi = t_lo + a.tiles_per_split < n_tiles ? t_lo + a.tiles_per_split : n_tiles;
  const Codec& K = a.k;
  const Codec& V = a.v;
  const float* kstd = K.std + hd;
  const float* kmean = K.mean + hd;
  const float* kinv = K.inv_std + hd;
  const float* vmean = V.mean + hd;
  const float* vstd = V.std + hd;
  // The code bytes of a tile's blocks, requested from memory ahead of their use when pages are smaller than a
  // tile: its 8 blocks then lie in pages scattered by the block table, the hardware prefetcher cannot guess them,
  // and a decode walking one block's tokens after the other (channel-chunked K) waited for each block's first line
  // in turn (~45% of its time on 16-token pages).  Within one page the codes are sequential and the addresses'
  // divisions cost more than the prefetches gain (~10% of a batch-1 call).
  const bool scattered = bs < DTILE;
  // the codes of each block of the tile at t0 (valid columns [v0, v1)); a block outside them points at a valid
  // block's codes (finite values whose softmax weights are exactly 0)
  // (a whole tile inside one page - pages of whole tiles - in one division: its blocks follow each other)
  const bool page_tiles = bs % DTILE == 0;
  auto tile_codes = [&](const Codec& cd, int t0, int v0, int v1, const uint8_t** out) {
    if (page_tiles && v0 == 0 && v1 == DTILE) {
      out[0] = record(a.pages, L, btr[t0 / bs], h) + cd.codes_off + (int64_t)((t0 % bs) / BLOCK) * cd.code_bytes;
      for (int b = 1; b < DTILE / BLOCK; ++b) out[b] = out[0] + (int64_t)b * cd.code_bytes;
      return;
    }
    for (int b = 0; b < DTILE / BLOCK; ++b) {
      const int tok = t0 + (b * BLOCK < v0 ? v0 : b * BLOCK < v1 ? b * BLOCK : v1 - BLOCK);
      out[b] = record(a.pages, L, btr[tok / bs], h) + cd.codes_off + (int64_t)((tok % bs) / BLOCK) * cd.code_bytes;
    }
  };
  auto prefetch_tile = [&](int tile) {
    const int t0 = tile * DTILE, v0 = (t0 > SINKS ? t0 : SINKS) - t0;
    const int v1 = (t0 + DTILE < cend ? t0 + DTILE : cend) - t0;
    const uint8_t* c[DTILE / BLOCK];
    const Codec* kv[2] = {&a.k, &a.v};
    for (const Codec* cd : kv) {
      tile_codes(*cd, t0, v0, v1, c);
      for (int b = 0; b < DTILE / BLOCK; ++b)
        for (int o = 0; o < cd->code_bytes; o += 64) __builtin_prefetch(c[b] + o);
    }
  };
  // the fast decode's queries for the tile: rotated back by its start t0 (its keys are rotated by their offsets)
  auto rotate_q = [&](int tile) {
    const float* C = a.tcos + (int64_t)tile * HD;
    const float* Sn = a.tsin + (int64_t)tile * HD;
    const vf irs = vbc(a.inv_rope_scale), sc_ = vbc(a.scale);
    for (int i = 0; i < g; ++i) {
      const float* qi = q + i * D;
      float* o = qr + i * D;
      for (int c = 0; c < HD; c += W) {
        const vf cc = vload(C + c) * irs, ss = vload(Sn + c) * irs;
        const vf q0 = vload(qi + c), q1 = vload(qi + c + HD);
        vstore(o + c, vfma(q0, cc, q1 * ss) * sc_);
        vstore(o + c + HD, vfma(q1, cc, -(q0 * ss)) * sc_);
      }
    }
  };
  // TaDA reads ~10 streams per item (K's and V's codes, parameters and every head's share of the mean, in as many
  // records): the next tile's lines requested ahead (~7% of a batch-8 call at 8k, SmolLM2's shape)
  const bool tada_pf = a.k.method == TADA || a.v.method == TADA;
  auto prefetch_tada = [&](int tile) {
    const int t0 = tile * DTILE, v0 = (t0 > SINKS ? t0 : SINKS) - t0;
    const int v1 = (t0 + DTILE < cend ? t0 + DTILE : cend) - t0;
    const Codec* kv[2] = {&a.k, &a.v};
    for (const Codec* cd : kv) {
      if (cd->method != TADA) continue;
      const int G = D / cd->group, mb = BLOCK * cd->mean_c * 2, shares = (D + cd->mean_c - 1) / cd->mean_c;
      for (int b = v0 / BLOCK; b < v1 / BLOCK; ++b) {
        const int tok = t0 + b * BLOCK, slot = (tok % bs) / BLOCK;
        const uint8_t* rec = record(a.pages, L, btr[tok / bs], h);
        const uint8_t* c = rec + cd->codes_off + (int64_t)slot * cd->code_bytes;
        for (int o = 0; o < cd->code_bytes; o += 64) __builtin_prefetch(c + o);
        __builtin_prefetch(rec + cd->scales_off + (int64_t)slot * BLOCK * 2 * G * 2);
        const uint8_t* rec0 = rec - (int64_t)h * L.rec_bytes;
        for (int sh = 0; sh < shares; ++sh) {
          const uint8_t* m = rec0 + (int64_t)sh * L.rec_bytes + cd->mean_off + (int64_t)slot * mb;
          for (int o = 0; o < mb; o += 64) __builtin_prefetch(m + o);
        }
      }
    }
  };
  if (scattered && t_lo < t_hi) prefetch_tile(t_lo);
  if (tada_pf && t_lo < t_hi) prefetch_tada(t_lo);
  for (int tile = t_lo; tile < t_hi; ++tile) {
    if (scattered && tile + 1 < t_hi) prefetch_tile(tile + 1);
    if (tada_pf && tile + 1 < t_hi) prefetch_tada(tile + 1);
    const int t0 = tile * DTILE;
    const int v0 = (t0 > SINKS ? t0 : SINKS) - t0;             // valid columns [v0, v1)
    const int v1 = (t0 + DTILE < cend ? t0 + DTILE : cend) - t0;
    if (qjl_k) {  // scores straight from the sketches (QJL's keys are post-RoPE: qr unrotated)
      const uint8_t* kc[DTILE / BLOCK];
      tile_codes(K, t0, v0, v1, kc);
      for (int b = 0; b < DTILE / BLOCK; ++b) {
        if (b * BLOCK >= v0 && b * BLOCK < v1) {
          qjl_block(K, D, g, qr, Sq, kc[b], qsb, sc, b * BLOCK, lanebit);
        } else {
          for (int i = 0; i < g; ++i)
            for (int t = 0; t < BLOCK; ++t) sc[i * DTILE + b * BLOCK + t] = 0.f;
        }
      }
    } else {
      // K: decode the tile's blocks into columns, denormalize, outliers, rotate by the offset
      bool scored = false;  // the scores already in sc (kqk_fast, kqk_channel_fast, row_scores16)
      if (!a.exact) rotate_q(tile);  // (the fast decode's fused scores take the rotated queries)
      if (fast_k || fast_kc) {
        const uint8_t* kc[DTILE / BLOCK];
        tile_codes(K, t0, v0, v1, kc);
        const int64_t gs = (int64_t)K.kc * K.chunk;
        const uint16_t* gb0 = K.cent16 + (int64_t)h * (D / K.chunk) * gs;  // the head's first group's centroids
        if (fast_k) {
          switch (K.chunk) {
            case 2: scored = kscores_fast_tile<2, DT>(KT, sc, qr, g, kc, gb0, gs, D, kstd, kmean, a.dcos, a.dsin); break;
            case 4: scored = kscores_fast_tile<4, DT>(KT, sc, qr, g, kc, gb0, gs, D, kstd, kmean, a.dcos, a.dsin); break;
            default: scored = kscores_fast_tile<8, DT>(KT, sc, qr, g, kc, gb0, gs, D, kstd, kmean, a.dcos, a.dsin); break;
          }
          if (!scored) {
            switch (K.chunk) {
              case 2: ktile_fast_tile<2, DT>(KT, kc, gb0, gs, D, kstd, kmean, a.dcos, a.dsin); break;
              case 4: ktile_fast_tile<4, DT>(KT, kc, gb0, gs, D, kstd, kmean, a.dcos, a.dsin); break;
              default: ktile_fast_tile<8, DT>(KT, kc, gb0, gs, D, kstd, kmean, a.dcos, a.dsin); break;
            }
          }
        } else {
          const float* rsin = rcos + DTILE * HD;
          float* rows = krows;
          switch (K.chunk) {
            case 2: scored = kscores_channel_tile<2, DT>(sc, qr, g, kc, gb0, gs, D, kstd, kmean, rcos, rsin, rows); break;
            case 4: scored = kscores_channel_tile<4, DT>(sc, qr, g, kc, gb0, gs, D, kstd, kmean, rcos, rsin, rows); break;
            default: scored = kscores_channel_tile<8, DT>(sc, qr, g, kc, gb0, gs, D, kstd, kmean, rcos, rsin, rows); break;
          }
          if (!scored) {
            switch (K.chunk) {
              case 2: ktile_channel_fast<2>(KT, kc, gb0, gs, D, kstd, kmean, rcos, rsin, rows); break;
              case 4: ktile_channel_fast<4>(KT, kc, gb0, gs, D, kstd, kmean, rcos, rsin, rows); break;
              default: ktile_channel_fast<8>(KT, kc, gb0, gs, D, kstd, kmean, rcos, rsin, rows); break;
            }
          }
        }
      }
#if TKV_W == 16
      if (rows_k) {  // the scores straight from the codes (rows_kscores)
        const uint8_t* recs[DTILE / BLOCK];
        int slots[DTILE / BLOCK];
        for (int b = 0; b < DTILE / BLOCK; ++b) {
          const int tok = t0 + (b * BLOCK < v0 ? v0 : b * BLOCK < v1 ? b * BLOCK : v1 - BLOCK);
          recs[b] = record(a.pages, L, btr[tok / bs], h);
          slots[b] = (tok % bs) / BLOCK;
        }
        const float* rsin = rcos + DTILE * HD;
        scored = with_rows<DT>(K, L, h, D, [&](auto& rw) {
          rows_kscores_any(rw, recs, slots, v0, v1, qr, g, rcos, rsin, sc);
        });
      }
      if (rows_k && !scored) {  // the tile's rows, then their scores 16 rows at a time
        float* R = krows;
        for (int b = 0; b < DTILE / BLOCK; ++b) {
          const int c0 = b * BLOCK;
          if (c0 < v0 || c0 >= v1) {  // (finite values whose softmax weights are exactly 0)
            for (int i = 0; i < BLOCK * D; ++i) R[c0 * D + i] = 0.f;
            continue;
          }
          const int tok = t0 + c0;
          decode_block_at(K, L, h, record(a.pages, L, btr[tok / bs], h), (tok % bs) / BLOCK, R + c0 * D, D, false,
                          tmp, true);
        }
        for (int u0 = 0; u0 < DTILE; u0 += W) row_scores16(sc, qr, g, D, u0, R + u0 * D, rcos, rcos + DTILE * HD);
        scored = true;
      }
#endif
      for (int b = 0; b < (fast_k || fast_kc || rows_k ? 0 : DTILE / BLOCK); ++b) {
        const int c0 = b * BLOCK;
        if (c0 < v0 || c0 >= v1) {
          for (int c = 0; c < D; ++c)
            for (int t = 0; t < BLOCK; ++t) KT[c * DTILE + c0 + t] = 0.f;
          continue;
        }
        const int tok = t0 + c0;
        const uint8_t* rec = record(a.pages, L, btr[tok / bs], h);
        const int slot = (tok % bs) / BLOCK;
        const uint8_t* kc = rec + K.codes_off + (int64_t)slot * K.code_bytes;
        if (K.method == TEMPORAL) {
          switch (K.chunk) {
            case 2: dec_temporal_kt<2>(K, h, D, kc, KT + c0); break;
            case 4: dec_temporal_kt<4>(K, h, D, kc, KT + c0); break;
            default: dec_temporal_kt<8>(K, h, D, kc, KT + c0); break;
          }
        } else {
          decode_block_at(K, L, h, rec, slot, KT + c0, DTILE, true, tmp, true);
        }
      }
      if (L.cap > 0) {  // outliers: exact values, normalized here (denormalized with the rest below)
        for (int b = v0 / BLOCK; b < v1 / BLOCK; ++b) {
          const int tok = t0 + b * BLOCK;
          const uint8_t* rec = record(a.pages, L, btr[tok / bs], h);
          const int slot = (tok % bs) / BLOCK;
          const int16_t* oi = reinterpret_cast<const int16_t*>(rec + K.idx_off) + slot * L.cap;
          const uint16_t* ov = reinterpret_cast<const uint16_t*>(rec + K.val_off) + slot * L.cap;
          for (int o = 0; o < L.cap; ++o) {
            const int f = oi[o];
            if (f >= 0) {
              const int c = f % D;
              KT[c * DTILE + b * BLOCK + f / D] = (h2f(ov[o], L.bf16) - kmean[c]) * kinv[c];
            }
          }
        }
      }
      if (a.exact) {
      for (int c = 0; c < HD; ++c) {  // denormalize, RoPE at each key's position, model dtype: as torch
        float* x0 = KT + c * DTILE;
        float* x1 = KT + (c + HD) * DTILE;
        const float* C = a.cosT + c * a.P + t0;
        const float* Sn = a.sinT + c * a.P + t0;
        const vf sd0 = vbc(kstd[c]), mn0 = vbc(kmean[c]), sd1 = vbc(kstd[c + HD]), mn1 = vbc(kmean[c + HD]);
        for (int t = 0; t < DTILE; t += W) {
          // z * std + mean, then x * cos + rotate_half(x) * sin: each product rounded, no FMA (the
          // torch path's float32 ops), then rounded to the model dtype: the torch path's decoded keys
          const vf k0 = vload(x0 + t) * sd0 + mn0, k1 = vload(x1 + t) * sd1 + mn1;
          const vf cc = vload(C + t), ss = vload(Sn + t);
          vstore(x0 + t, vround(k0 * cc + (-k1) * ss, L.round));
          vstore(x1 + t, vround(k1 * cc + k0 * ss, L.round));
        }
      }
      } else {  // faster: rotate by the offset in the tile only; the queries are rotated back by t0
        for (int c = 0; c < (fast_k || fast_kc || scored ? 0 : HD); ++c) {  // (fast_k, fast_kc: rotated as decoded)
          float* x0 = KT + c * DTILE;
          float* x1 = KT + (c + HD) * DTILE;
          const float* dc = a.dcos + c * DTILE;
          const float* ds = a.dsin + c * DTILE;
          const vf sd0 = vbc(kstd[c]), mn0 = vbc(kmean[c]), sd1 = vbc(kstd[c + HD]), mn1 = vbc(kmean[c + HD]);
          for (int t = 0; t < DTILE; t += W) {
            const vf k0 = vfma(vload(x0 + t), sd0, mn0), k1 = vfma(vload(x1 + t), sd1, mn1);
            const vf cc = vload(dc + t), ss = vload(ds + t);
            rope_store(x0 + t, x1 + t, k0, k1, cc, ss);
          }
        }
      }
      if (!scored) qk_tile_any(qr, g, D, KT, sc);  // scores
    }
    // online softmax
    for (int i = 0; i < g; ++i) {
      float* st = part + i * stride;
      float* si = sc + i * DTILE;
      vf mv = vbc(-__builtin_inff());
      for (int t = 0; t < DTILE; t += W) {
        const vi u = lane + t;
        mv = (u >= v0) & (u < v1) ? vmax(mv, vload(si + t)) : mv;
      }
      const float mt = hmax(mv);
      // a new running max only when the tile's is RESCALE_SLACK above it (the rescale of every sum costs more
      // than the tile's own softmax); weights up to e^8 meanwhile, far from float32's range
      if (mt > st[0] + RESCALE_SLACK) {
        if (st[0] != -__builtin_inff()) {
          const float alpha = __builtin_expf(st[0] - mt);
          rescale(st, D, alpha);
          if (vtemp) {
            float* a8 = acc8 + (int64_t)i * D * AW;
            const vf al = vbc(alpha);
            for (int c = 0; c < D * AW; c += W) vstore(a8 + c, vload(a8 + c) * al);
          }
        }
        st[0] = mt;
      }
      const vf mb = vbc(st[0]);
      vf lv = vf{};
      for (int t = 0; t < DTILE; t += W) {
        const vi u = lane + t;
        const vf e = (u >= v0) & (u < v1) ? vexp(vload(si + t) - mb) : vf{};
        vstore(si + t, e);
        lv += e;
      }
      // decoded V is accumulated in raw space (rounded to the model dtype), the fast decode's in normalized space
      st[fast_v || fast_vc ? 1 : 2] += hsum_any(lv);  // (a shuffle tree: ~2% of a decode call in scalar adds)
    }
    // V
    if (fast_v || fast_vc) {  // normalized space, straight from the codes
      const uint8_t* bc[DTILE / BLOCK];
      tile_codes(V, t0, v0, v1, bc);
      const int64_t gstride = (int64_t)V.kc * V.chunk;
      const uint16_t* cb = V.cent16 + hd * V.kc;  // h * (D / l) groups * kc * l values
      const int b0 = v0 / BLOCK, b1 = v1 / BLOCK;
      if (fast_vc) {
        switch (V.chunk) {
          case 2: pv_channel_z_any<2>(part + 4, stride, g, D, sc, bc, b0, b1, cb, gstride); break;
          case 4: pv_channel_z_any<4>(part + 4, stride, g, D, sc, bc, b0, b1, cb, gstride); break;
          default: pv_channel_z_any<8>(part + 4, stride, g, D, sc, bc, b0, b1, cb, gstride); break;
        }
      } else {
        switch (V.chunk) {
          case 2: pv_temporal_tile<2, DT>(acc8, g, D, sc, bc, cb, gstride); break;
          case 4: pv_temporal_tile<4, DT>(acc8, g, D, sc, bc, cb, gstride); break;
          default: pv_temporal_tile<8, DT>(acc8, g, D, sc, bc, cb, gstride); break;
        }
      }
      if (L.cap > 0) {  // exact outliers: the difference to the decoded value, into the raw-space sums
        for (int b = b0; b < b1; ++b) {
          const int tok = t0 + b * BLOCK;
          const uint8_t* rec = record(a.pages, L, btr[tok / bs], h);
          const int slot = (tok % bs) / BLOCK;
          const int16_t* oi = reinterpret_cast<const int16_t*>(rec + V.idx_off) + slot * L.cap;
          const uint16_t* ov = reinterpret_cast<const uint16_t*>(rec + V.val_off) + slot * L.cap;
          for (int o = 0; o < L.cap; ++o) {
            const int f = oi[o];
            if (f < 0) continue;
            const int t = f / D, c = f % D, l = V.chunk;
            const int code = fast_vc ? bc[b][t * (D / l) + c / l] : bc[b][(t / l) * D + c];  // channel / temporal
            const float zd = fp16_to_f32(cb[(c / l) * gstride + code * l + (fast_vc ? c % l : t % l)]);
            const float dz = h2f(ov[o], L.bf16) - (zd * vstd[c] + vmean[c]);
            for (int i = 0; i < g; ++i) part[i * stride + 4 + D + c] += sc[i * DTILE + b * BLOCK + t] * dz;
          }
        }
      }
      continue;
    }
    if (vtemp) {
      const uint8_t* bc[DTILE / BLOCK];
      for (int b = v0 / BLOCK; b < v1 / BLOCK; ++b) {
        const int tok = t0 + b * BLOCK;
        bc[b] = record(a.pages, L, btr[tok / bs], h) + V.codes_off + (int64_t)((tok % bs) / BLOCK) * V.code_bytes;
      }
      const int64_t gstride = (int64_t)V.kc * V.chunk;
      const uint16_t* cb = V.cent16 + hd * V.kc;  // h * (D / l) groups * kc * l values
      switch (V.chunk) {
        case 2: pv_temporal_any<2>(acc8, g, D, sc, bc, v0 / BLOCK, v1 / BLOCK, cb, gstride, vstd, vmean, rmode); break;
        case 4: pv_temporal_any<4>(acc8, g, D, sc, bc, v0 / BLOCK, v1 / BLOCK, cb, gstride, vstd, vmean, rmode); break;
        default: pv_temporal_any<8>(acc8, g, D, sc, bc, v0 / BLOCK, v1 / BLOCK, cb, gstride, vstd, vmean, rmode); break;
      }
      if (L.cap > 0) {  // exact outliers: correct the accumulated decoded value
        for (int b = v0 / BLOCK; b < v1 / BLOCK; ++b) {
          const int tok = t0 + b * BLOCK;
          const uint8_t* rec = record(a.pages, L, btr[tok / bs], h);
          const int slot = (tok % bs) / BLOCK;
          const int16_t* oi = reinterpret_cast<const int16_t*>(rec + V.idx_off) + slot * L.cap;
          const uint16_t* ov = reinterpret_cast<const uint16_t*>(rec + V.val_off) + slot * L.cap;
          for (int o = 0; o < L.cap; ++o) {
            const int f = oi[o];
            if (f < 0) continue;
            const int t = f / D, c = f % D, l = V.chunk;
            const float zd = fp16_to_f32(cb[(c / l) * gstride + bc[b][(t / l) * D + c] * l + t % l]);
            const float zx = zd * vstd[c] + vmean[c];
            const float dz = h2f(ov[o], L.bf16) - (a.exact ? round_to(zx, L.round) : zx);
            for (int i = 0; i < g; ++i) acc8[((int64_t)i * D + c) * 8 + t] += sc[i * DTILE + b * BLOCK + t] * dz;
          }
        }
      }
      continue;
    }
    // V: decode each block of the tile once (normalized) into the tile's rows, then accumulate them for all query
    // heads in one pass (the same FMAs in the same order as block by block, without reloading the sums per block)
    const int b0 = v0 / BLOCK, b1 = v1 / BLOCK;
#if TKV_W == 16
    if (rows_v && b1 > b0) {  // the same sums straight from the codes (rows_pv)
      const uint8_t* recs[DTILE / BLOCK];
      int slots[DTILE / BLOCK];
      for (int b = b0; b < b1; ++b) {
        const int tok = t0 + b * BLOCK;
        recs[b] = record(a.pages, L, btr[tok / bs], h);
        slots[b] = (tok % bs) / BLOCK;
      }
      if (with_rows<DT>(V, L, h, D,
                        [&](auto& rw) { rows_pv_any(rw, recs, slots, b0, b1, sc, g, part + 4 + D, stride); }))
        continue;
    }
#endif
    for (int b = b0; b < b1; ++b) {
      const int tok = t0 + b * BLOCK;
      const uint8_t* rec = record(a.pages, L, btr[tok / bs], h);
      const int slot = (tok % bs) / BLOCK;
      float* Zb = ZT + b * BLOCK * D;
      decode_block_at(V, L, h, rec, slot, Zb, D, false, tmp, true);
      if (!skip_vnorm)
        for (int t = 0; t < BLOCK; ++t)  // z * std + mean (two roundings, as torch), model dtype
          for (int c = 0; c < D; c += W)
            vstore(Zb + t * D + c, vround(vload(Zb + t * D + c) * vload(vstd + c) + vload(vmean + c), rmode));
      if (L.cap > 0) {
        const int16_t* oi = reinterpret_cast<const int16_t*>(rec + V.idx_off) + slot * L.cap;
        const uint16_t* ov = reinterpret_cast<const uint16_t*>(rec + V.val_off) + slot * L.cap;
        for (int o = 0; o < L.cap; ++o)
          if (oi[o] >= 0) Zb[oi[o]] = h2f(ov[o], L.bf16);
      }
    }
    if (b1 > b0) pv_rows_any(part + 4 + D, stride, sc + b0 * BLOCK, g, ZT + b0 * BLOCK * D, D, (b1 - b0) * BLOCK);
  }
  if (vtemp) {
    for (int i = 0; i < g; ++i) {
      float* az = part + i * stride + 4 + (fast_v ? 0 : D);  // normalized (fast) or raw space
      for (int c = 0; c < D; ++c) {
        const float* x = acc8 + ((int64_t)i * D + c) * AW;
        if (AW == 8) {
          az[c] += ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
        } else {  // the fast decode's W lanes: a shuffle tree (the scalar adds were ~2% of a decode call)
          az[c] += hsum_any(vload(x));
        }
      }
    }
    __builtin_free(acc8);
  }
}

void decode_item(const DecodeArgs& a, int64_t item) {
  switch (a.lay.D) {
    case 64: decode_item_t<64>(a, item); break;
    case 128: decode_item_t<128>(a, item); break;
    default: decode_item_t<0>(a, item); break;
  }
}

void decode_merge(const DecodeArgs& a, int64_t rh) {
  const int D = a.lay.D, H = a.lay.H, g = a.g, S = a.S;
  const int h = (int)(rh % H);
  const int64_t r = rh / H;
  const int stride = 4 + 2 * D;
  const float* vstd = a.v.std + (int64_t)h * D;
  const float* vmean = a.v.mean + (int64_t)h * D;
  for (int i = 0; i < g; ++i) {
    float M = -__builtin_inff();
    for (int s = 0; s < S; ++s) {
      const float m = a.part[((rh * S + s) * g + i) * stride];
      M = m > M ? m : M;
    }
    float* o = a.out + (r * a.Hq + (int64_t)h * g + i) * D;
    float lz = 0.f, lx = 0.f;
    for (int c = 0; c < D; ++c) o[c] = 0.f;
    alignas(64) float az[MAX_D];
    for (int c = 0; c < D; ++c) az[c] = 0.f;
    for (int s = 0; s < S; ++s) {
      const float* st = a.part + ((rh * S + s) * g + i) * stride;
      if (st[0] == -__builtin_inff()) continue;
      const float w = __builtin_expf(st[0] - M);
      lz += w * st[1];
      lx += w * st[2];
      for (int c = 0; c < D; ++c) {
        az[c] += w * st[4 + c];
        o[c] += w * st[4 + D + c];
      }
    }
    const float inv = 1.f / (lz + lx);
    for (int c = 0; c < D; ++c) o[c] = (az[c] * vstd[c] + lz * vmean[c] + o[c]) * inv;
    if (a.out16) {  // the model's half dtype, rounded here (Tensor.to's rounding), not by a copy after the call
      uint16_t* o16 = a.out16 + (o - a.out);
      for (int c = 0; c < D; ++c) o16[c] = f2h(o[c], a.out_bf16);
    }
  }
}

// ---- gather: one decoded block, bit-identical to paged_torch.gather_kv --------------------------

void gather_block(const GatherArgs& a, int64_t item) {
  const Layout& L = a.lay;
  const int H = L.H, D = L.D, HD = D / 2;
  const int h = (int)(item % H);
  const int64_t bi = item / H + 1;
  const int64_t tok0 = bi * BLOCK;
  const uint8_t* rec = record(a.pages, L, a.bt[tok0 / L.block_size], h);
  const int slot = (int)((tok0 % L.block_size) / BLOCK);
  const int64_t hd = (int64_t)h * D;
  alignas(64) float X[BLOCK * MAX_D], tmp[BLOCK * MAX_D], Y[MAX_D];
  for (int kind = 0; kind < 2; ++kind) {
    const Codec& cd = kind ? a.v : a.k;
    if (cd.method == QJL) {  // the surrogate keys, post-RoPE (mean 0, std 1 below: unchanged)
      qjl_surrogate_rows(cd, D, rec + cd.codes_off + (int64_t)slot * cd.code_bytes, X);
    } else {
      decode_block_at(cd, L, h, rec, slot, X, D, false, tmp, cd.half_exact != 0);
    }
    const float* sd = cd.std + hd;
    const float* mn = cd.mean + hd;
    for (int t = 0; t < BLOCK; ++t)
      for (int c = 0; c < D; c += W) {
        vf x = vload(X + t * D + c) * vload(sd + c);  // z * std, then + mean: two roundings (torch)
        vstore(X + t * D + c, x + vload(mn + c));
      }
    if (L.cap > 0) {
      const int16_t* oi = reinterpret_cast<const int16_t*>(rec + cd.idx_off) + slot * L.cap;
      const uint16_t* ov = reinterpret_cast<const uint16_t*>(rec + cd.val_off) + slot * L.cap;
      for (int o = 0; o < L.cap; ++o)
        if (oi[o] >= 0) X[oi[o]] = h2f(ov[o], L.bf16);
    }
    void* out = kind ? a.vout : a.kout;
    for (int t = 0; t < BLOCK; ++t) {
      float* x = X + t * D;
      if (kind == 0 && cd.method != QJL) {  // x * cos + rotate_half(x) * sin, as Rope.apply
        const float* C = a.cos + (tok0 + t) * HD;  // cos/sin of channel c + D/2 equal those of c
        const float* Sn = a.sin + (tok0 + t) * HD;
        for (int c = 0; c < HD; c += W) {
          const vf x0 = vload(x + c), x1 = vload(x + c + HD), cc = vload(C + c), ss = vload(Sn + c);
          vstore(Y + c, x0 * cc + (-x1) * ss);
          vstore(Y + c + HD, x1 * cc + x0 * ss);
        }
        x = Y;
      }
      const int64_t o0 = ((tok0 + t) * H + h) * D;
      if (L.round == 2) {
        float* o = static_cast<float*>(out) + o0;
        for (int c = 0; c < D; ++c) o[c] = x[c];
      } else {
        uint16_t* o = static_cast<uint16_t*>(out) + o0;
        for (int c = 0; c < D; ++c) o[c] = f2h(x[c], L.round);
      }
    }
  }
}

// ---- encode: nearest centroid (the codec contract) and whole blocks -----------------------------

// The nearest of K centroids CT [v][K] (transposed, K a multiple of W) to each of NV vectors U[n * 8 ..] at once:
// squared distances summed in order over the v floats without FMA, ties to the lowest index.  Each centroid block
// is loaded once for the NV vectors and their compare-select chains interleave (one vector's chain is
// latency-bound: the prefill's cache update spent ~30% of its time on one vector at a time).
template <int NV, class TT = float>
inline void nearest_n(const float* U, const TT* CT, int K, int v, int* out) {
  vi lane;
  for (int i = 0; i < W; ++i) lane[i] = i;
  vf bv[NV];
  vi bi[NV];
  for (int n = 0; n < NV; ++n) {
    bv[n] = vbc(__builtin_inff());
    bi[n] = vi{};
  }
  for (int k0 = 0; k0 < K; k0 += W) {
    vf d[NV];
    const vf c0 = vload_tab(CT + k0);
    for (int n = 0; n < NV; ++n) {
      const vf t = vbc(U[n * 8]) - c0;
      d[n] = t * t;
    }
    for (int e = 1; e < v; ++e) {
      const vf ce = vload_tab(CT + e * K + k0);
      for (int n = 0; n < NV; ++n) {
        const vf t = vbc(U[n * 8 + e]) - ce;
        d[n] = d[n] + t * t;
      }
    }
    for (int n = 0; n < NV; ++n) {
      const vi lt = d[n] < bv[n];
      bv[n] = lt ? d[n] : bv[n];
      bi[n] = lt ? lane + k0 : bi[n];
    }
  }
  for (int n = 0; n < NV; ++n) {
    float bd = bv[n][0];
    int best = bi[n][0];
    for (int i = 1; i < W; ++i)
      if (bv[n][i] < bd || (bv[n][i] == bd && bi[n][i] < best)) { bd = bv[n][i]; best = bi[n][i]; }
    out[n] = best;
  }
}

// index of the nearest of K centroids CT [v][K] (transposed) to u [v]: squared distance summed in
// order over the v floats without FMA, ties to the lowest index
inline float tab_at(const float* p, int64_t i) { return p[i]; }
inline float tab_at(const uint16_t* p, int64_t i) { return h2f(p[i], 0); }

template <class TT = float>
inline int nearest1(const float* u, const TT* CT, int K, int v) {
  if (K % W) {
    int best = 0;
    float bd = __builtin_inff();
    for (int k = 0; k < K; ++k) {
      float t = u[0] - tab_at(CT, k);
      float d = t * t;
      for (int e = 1; e < v; ++e) {
        t = u[e] - tab_at(CT, e * K + k);
        d = d + t * t;
      }
      if (d < bd) { bd = d; best = k; }
    }
    return best;
  }
  int best;
  nearest_n<1, TT>(u, CT, K, v, &best);
  return best;
}

// lanes with a == b, a <= b (false for NaN) as bitmasks, lane i -> bit i; lanes of x where bit i of m, else y
inline unsigned eq_mask(vf a, vf b) {
#if TKV_W == 16
  return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ);
#elif TKV_W == 8
  return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ));
#else
  unsigned m = 0;
  for (int i = 0; i < W; ++i) m |= (unsigned)(a[i] == b[i]) << i;
  return m;
#endif
}
inline unsigned le_mask(vf a, vf b) {
#if TKV_W == 16
  return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ);
#elif TKV_W == 8
  return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_LE_OQ));
#else
  unsigned m = 0;
  for (int i = 0; i < W; ++i) m |= (unsigned)(a[i] <= b[i]) << i;
  return m;
#endif
}
inline vf vblend(unsigned m, vf x, vf y) {
#if TKV_W == 16
  return _mm512_mask_blend_ps((__mmask16)m, y, x);
#else
  vi sel;
  for (int i = 0; i < W; ++i) sel[i] = -(int32_t)((m >> i) & 1);
  return sel ? x : y;
#endif
}

// the smallest lane (W = 16 / 8: a shuffle tree; NaN-free inputs here)
inline float hmin(vf v) {
#if TKV_W == 16
  return _mm512_reduce_min_ps(v);
#elif TKV_W == 8
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
#else
  float r = v[0];
  for (int i = 1; i < W; ++i) r = v[i] < r ? v[i] : r;
  return r;
#endif
}

// Column `lane` of K / W stored screens (S[j * W + lane]): the row j of its only screen <= thr, -1 if none or more.
// (AVX-512's screen stores none: nearest_screen's two minima.)
inline int lane_single(const float* S, int lane, int K, float thr) {
#if TKV_W == 8
  if (K == 256) {  // the column's 32 rows in four gathers of 8 (the scan below: the encode ~1.4x slower, AMD EPYC)
    const __m256i step = _mm256_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56);
    uint32_t mk = 0;
    for (int r = 0; r < 4; ++r)
      mk |= le_mask((vf)_mm256_i32gather_ps(S + r * 64 + lane, step, 4), vbc(thr)) << (8 * r);
    return mk && !(mk & (mk - 1)) ? __builtin_ctz(mk) : -1;
  }
#endif
  int found = -1;
  for (int j = 0; j < K / W; ++j)
    if (S[j * W + lane] <= thr) {
      if (found >= 0) return -1;
      found = j;
    }
  return found;
}

// one row of W screens (centroids k0 ..) for NV vectors (U2: their -2 u); VC: v where known at compile time, else 0
template <int NV, class TT, int VC>
__attribute__((always_inline)) inline void screen_row(vf* s, const float (*U2)[8], const TT* CT, const float* csq,
                                                      int K, int v_, int k0) {
  const int v = VC ? VC : v_;
  const vf q = vload(csq + k0), c0 = vload_tab(CT + k0);
  for (int n = 0; n < NV; ++n) s[n] = vfma(vbc(U2[n][0]), c0, q);
  for (int e = 1; e < v; ++e) {
    const vf ce = vload_tab(CT + e * K + k0);
    for (int n = 0; n < NV; ++n) s[n] = vfma(vbc(U2[n][e]), ce, s[n]);
  }
}

// a + M of the bound below for u (false for inf and NaN: searched in full)
inline bool screen_bounded(const float* u, int v, float cmax, float* am) {
  float a = u[0] * u[0];
  for (int e = 1; e < v; ++e) a = a + u[e] * u[e];
  *am = a + cmax;
  return *am < 1e30f;
}

// whether lane(s) `at` of x are one lane and every other lane of x is above thr
inline bool lone_lane(unsigned at, vf x, vf thr) {
  return !(at & (at - 1)) && !le_mask(vblend(at, vbc(__builtin_inff()), x), thr);
}

// The same answers as nearest_n (the contract's argmin, ties to the lowest index) with ~2/3 of its arithmetic: a
// screen s_k = ||c_k||^2 - 2 u.c_k (one FMA per float instead of a subtract, a multiply and an add); when the
// smallest screen of all is more than T below every other, its centroid is the answer, else (rare: near-ties)
// nearest_n searches in full.
// Why T proves it: with a = ||u||^2 and M = max ||c||^2, the contract's distance d_k is within gamma(v + 2) * 2 (a
// + M) of the true one (v subtractions, squares and adds in float), the screen within gamma(3v) (a + 2M) of the
// true s_k (csq's own sum plus v multiply-adds, fused or not), gamma(n) = n 2^-24 / (1 - n 2^-24).  If k* is the
// contract's argmin and j the screen's, d_k* <= d_j gives s~_k* <= s~_j + 2 gamma(3v) (a + 2M) + 4 gamma(v + 2)
// (a + M) < s~_j + 2^-15 (a + M) for v <= 8 (~4x margin, which also covers the rounding of a, M and the
// threshold's own sum; 1e-30 covers underflow in the products): a centroid alone within T of the smallest screen
// is k*.  A vector whose a + M is not finite and below 1e30 (overflow, inf, NaN: cmax is NaN when a centroid is)
// is searched in full; below it every screen is finite.
// K <= 256, a multiple of W; U's vectors `us` floats apart; csq [K] the centroids' squared norms.
template <int NV, class TT = float, int VC = 0>  // VC: v where known at compile time (2, 4, 8), else 0
inline void nearest_screen(const float* U, int us, const TT* CT, const float* csq, float cmax, int K, int v_,
                           int* out) {
  const int v = VC ? VC : v_;
  float U2[NV][8];  // -2 u: each FMA's broadcast operand read from memory
  for (int n = 0; n < NV; ++n)
    for (int e = 0; e < v; ++e) U2[n][e] = -2.f * U[n * us + e];
  float am;
#if TKV_W == 16
  if (K <= W * W) {
    // AVX-512, at most W rows of W screens: two running minima and no stored screens.  m1 keeps each lane's smallest
    // (centroids k0 + L in lane L); r is rotated down one lane before each row's min, so row j's screen of lane L
    // ends in lane (L - (J - 1 - j)) mod W: two centroids of one lane of m1 lie in two lanes of r.  Hence if one
    // lane of m1 and one lane of r hold the smallest screen m and every other lane of both is above the threshold,
    // exactly one screen is within it, and the two lanes give its row and lane.  (Storing the screens and gathering
    // the winning lane's column back, as below, waited on the loop's stores: ~1/5 of a real layer's encode on an AMD
    // EPYC; this one writes SmolLM2's real keys and values 15-20% faster, the same codes.)
    const int J = K / W;
    vf m1[NV], r[NV];
    for (int n = 0; n < NV; ++n) m1[n] = r[n] = vbc(__builtin_inff());
    for (int k0 = 0; k0 < K; k0 += W) {
      vf s[NV];
      screen_row<NV, TT, VC>(s, U2, CT, csq, K, v, k0);
      for (int n = 0; n < NV; ++n) {
        m1[n] = vmin(m1[n], s[n]);
        r[n] = vmin((vf)_mm512_alignr_epi32((__m512i)r[n], (__m512i)r[n], 1), s[n]);
      }
    }
    for (int n = 0; n < NV; ++n) {
      if (screen_bounded(U + n * us, v, cmax, &am)) {
        const float m = hmin(m1[n]);
        const vf thr = vbc(m + (0x1p-15f * am + 1e-30f));
        const unsigned at = eq_mask(m1[n], vbc(m)), ar = eq_mask(r[n], vbc(m));
        if (lone_lane(at, m1[n], thr) && lone_lane(ar, r[n], thr)) {
          const int lane = __builtin_ctz(at), j = (__builtin_ctz(ar) - lane + J - 1) & (W - 1);
          out[n] = j * W + lane;
          continue;
        }
      }
      nearest_n<1, TT>(U + n * us, CT, K, v, out + n);
    }
    return;
  }
#endif
  // The loop keeps each lane's smallest screen and stores every screen; the winning lane's own column of stored
  // screens then gives the index and its second smallest.  (Keeping each lane's index and second smallest in the
  // loop cost 4 more vector ops per W screens, and the loop is bound by its vector ops: this is ~1.17x faster on
  // AVX-512, ~1.5x on AVX2: tests/test_cpu_kernels.py checks the answers, benchmarks/results/cpu-speed-log.md the
  // timings.)
  alignas(64) float S[NV][256];
  vf m1[NV];
  for (int n = 0; n < NV; ++n) m1[n] = vbc(__builtin_inff());
  for (int k0 = 0; k0 < K; k0 += W) {
    vf s[NV];
    screen_row<NV, TT, VC>(s, U2, CT, csq, K, v, k0);
    for (int n = 0; n < NV; ++n) {
      vstore(S[n] + k0, s[n]);
      m1[n] = vmin(m1[n], s[n]);
    }
  }
  for (int n = 0; n < NV; ++n) {
    if (screen_bounded(U + n * us, v, cmax, &am)) {
      const float m = hmin(m1[n]);
      const float thr = m + (0x1p-15f * am + 1e-30f);
      const unsigned at = eq_mask(m1[n], vbc(m));  // the lane(s) holding the smallest screen
      if (lone_lane(at, m1[n], vbc(thr))) {  // one lane, and no other lane's smallest within T of it ...
        const int lane = __builtin_ctz(at);
        const int j = lane_single(S[n], lane, K, thr);  // ... nor, in its lane, another screen
        if (j >= 0) {
          out[n] = j * W + lane;
          continue;
        }
      }
    }
    nearest_n<1, TT>(U + n * us, CT, K, v, out + n);
  }
}

// vectors screened at once: each keeps 2 registers of state (AVX-512: 32 registers, AVX2 / SSE: 16)
constexpr int SCREEN_NV = W >= 16 ? 4 : 2;

// the largest of K floats (K a multiple of W), NaN if any is (nearest_rows; the encode's come from ops/cpu.py)
inline float vec_max(const float* x, int K) {
  vf m = vload(x);
  vi nan = m != m;
  for (int k = W; k < K; k += W) {
    const vf y = vload(x + k);
    m = vmax(m, y);
    nan |= y != y;
  }
  for (int i = 0; i < W; ++i)
    if (nan[i]) return __builtin_nanf("");
  return -hmin(-m);
}

void nearest_rows(const float* vecs, const float* centT, int64_t* out, int64_t n, int K, int v) {
  if (K % W || K > 256 || v > 8) {
    for (int64_t i = 0; i < n; ++i) out[i] = nearest1(vecs + i * v, centT, K, v);
    return;
  }
  alignas(64) float csq[256];
  for (int k = 0; k < K; ++k) {  // squared norms (any rounding: the screen's bound allows for it)
    float s = centT[k] * centT[k];
    for (int e = 1; e < v; ++e) s = s + centT[e * K + k] * centT[e * K + k];
    csq[k] = s;
  }
  const float cmax = vec_max(csq, K);
  constexpr int NV = SCREEN_NV;
  int idx[NV];
  int64_t i = 0;
  for (; i + NV <= n; i += NV) {
    nearest_screen<NV>(vecs + i * v, v, centT, csq, cmax, K, v, idx);
    for (int j = 0; j < NV; ++j) out[i + j] = idx[j];
  }
  for (; i < n; ++i) {
    nearest_screen<1>(vecs + i * v, v, centT, csq, cmax, K, v, idx);
    out[i] = idx[0];
  }
}

template <class TT>
inline void encode_groups(const Codec& cd, int h, const float* X, uint8_t* out, int l, int G, int KC, const TT* tab);

// X [8][D]: raw values of one block (keys pre-RoPE), float32 of the model dtype.  Writes codes
// (and outliers) of block `slot` of record `rec`, as KVQuantizer.encode + pack_block_codes.
inline void encode_rows(const Codec& cd, const Layout& L, int h, float* X, uint8_t* rec, int slot) {
  const int D = L.D, N = BLOCK * D;
  const int64_t hd = (int64_t)h * D;
  const float* lo = cd.lo + hd;
  const float* hi = cd.hi + hd;
  const float* mean = cd.mean + hd;
  const float* inv = cd.inv_std + hd;
  if (L.cap > 0) {  // split_outliers: the cap largest excesses (std units), ties to the lower index
    int cand[BLOCK * MAX_D];
    float cex[BLOCK * MAX_D];
    int nc = 0;
    for (int f = 0; f < N; ++f) {
      const int c = f % D;
      const float x = X[f];
      const float a = lo[c] - x, b = x - hi[c];
      float e = a > b ? a : b;  // torch.maximum
      e = e < 0.f ? 0.f : e;    // clamp_min(0)
      e = e * inv[c];
      if (e > 0.f) { cand[nc] = f; cex[nc] = e; ++nc; }
    }
    int16_t* oi = reinterpret_cast<int16_t*>(rec + cd.idx_off) + slot * L.cap;
    uint16_t* ov = reinterpret_cast<uint16_t*>(rec + cd.val_off) + slot * L.cap;
    for (int o = 0; o < L.cap; ++o) {
      int bj = -1;
      for (int j = 0; j < nc; ++j)
        if (cex[j] >= 0.f && (bj < 0 || cex[j] > cex[bj])) bj = j;  // first max = lowest index
      if (bj < 0) {
        oi[o] = -1;
        ov[o] = 0;
      } else {
        oi[o] = (int16_t)cand[bj];
        ov[o] = f2h(X[cand[bj]], L.bf16);
        cex[bj] = -1.f;
      }
    }
    for (int f = 0; f < N; ++f) {  // clamp every value to its thresholds
      const int c = f % D;
      float x = X[f];
      x = x > lo[c] ? x : lo[c];  // torch.maximum(x, lo)
      x = x < hi[c] ? x : hi[c];  // torch.minimum(., hi)
      X[f] = x;
    }
  }
  for (int t = 0; t < BLOCK; ++t)
    for (int c = 0; c < D; c += W) {
      const vf d = vload(X + t * D + c) - vload(mean + c);
      vstore(X + t * D + c, d * vload(inv + c));
    }
  uint8_t* out = rec + cd.codes_off + (int64_t)slot * cd.code_bytes;
  if (cd.method == SCALAR) {
    const int bits = cd.bits, per = 8 / bits, KC = cd.kc;
    for (int i = 0; i < cd.code_bytes; ++i) out[i] = 0;
    for (int c = 0; c < D; ++c) {
      const float* cb = cd.cent + (hd + c) * KC;
      for (int t = 0; t < BLOCK; ++t) {
        const float u = X[t * D + c];
        int best = 0;
        float bd = __builtin_inff();
        for (int k = 0; k < KC; ++k) {
          const float dd = u - cb[k];
          const float d = dd * dd;
          if (d < bd) { bd = d; best = k; }
        }
        out[t * (D / per) + c / per] |= (uint8_t)(best << ((c % per) * bits));
      }
    }
    return;
  }
  const int l = cd.chunk, G = D / l, KC = cd.kc;
  if (cd.centT16)
    encode_groups(cd, h, X, out, l, G, KC, cd.centT16);
  else
    encode_groups(cd, h, X, out, l, G, KC, cd.centT);
}

// encode_rows' vector methods: each of the G channel groups' BLOCK vectors against its codebook, CT the transposed
// centroids (float32, or their float16 bits: the same values)
template <class TT>
inline void encode_groups(const Codec& cd, int h, const float* X, uint8_t* out, int l, int G, int KC, const TT* tab) {
  const int D = G * l;
  float U[BLOCK * 8];  // the group's BLOCK vectors (8 floats apart), all against its one codebook
  int off[BLOCK], idx[BLOCK];
  for (int gi = 0; gi < G; ++gi) {
    const TT* CT = tab + ((int64_t)h * G + gi) * l * KC;
    for (int nv = 0; nv < BLOCK; ++nv) {
      float* u = U + nv * 8;
      if (cd.method == TEMPORAL) {  // vector: tokens j*l .. j*l+l-1 of channel gi*l + m
        const int j = nv / l, m = nv % l;
        for (int e = 0; e < l; ++e) u[e] = X[(j * l + e) * D + gi * l + m];
        off[nv] = j * D + gi * l + m;
      } else {  // vector: channels gi*l .. gi*l+l-1 of token nv
        for (int e = 0; e < l; ++e) u[e] = X[nv * D + gi * l + e];
        off[nv] = nv * G + gi;
      }
    }
    if (KC % W == 0) {
      constexpr int NV = SCREEN_NV;
      const float* csq = cd.csq + ((int64_t)h * G + gi) * KC;
      const float cmax = cd.cmax[(int64_t)h * G + gi];
      // the vector length known at compile time: the loop's FMAs unrolled, no tests of l per row of screens
      for (int nv = 0; nv < BLOCK; nv += NV) switch (l) {
          case 2: nearest_screen<NV, TT, 2>(U + nv * 8, 8, CT, csq, cmax, KC, l, idx + nv); break;
          case 4: nearest_screen<NV, TT, 4>(U + nv * 8, 8, CT, csq, cmax, KC, l, idx + nv); break;
          case 8: nearest_screen<NV, TT, 8>(U + nv * 8, 8, CT, csq, cmax, KC, l, idx + nv); break;
          default: nearest_screen<NV, TT>(U + nv * 8, 8, CT, csq, cmax, KC, l, idx + nv); break;
        }
    } else {
      for (int nv = 0; nv < BLOCK; ++nv) idx[nv] = nearest1(U + nv * 8, CT, KC, l);
    }
    for (int nv = 0; nv < BLOCK; ++nv) out[off[nv]] = (uint8_t)idx[nv];
  }
}

// ---- scaled codes (no codebook): the selective formats' and TaDA's encoders ---------------------
constexpr float SCALE_EPS = 5.9604644775390625e-8f;  // 2**-24, the smallest positive fp16: both codecs' EPS

// n codes of `bits` bits (8, 4 or 2) packed along a row, the lowest channel in the lowest bits (pack_block_codes)
inline void pack_row(const int* code, int n, int bits, uint8_t* row) {
  const int per = 8 / bits;
  for (int i = 0; i < n / per; ++i) {
    int b = 0;
    for (int e = 0; e < per; ++e) b |= code[i * per + e] << (e * bits);
    row[i] = (uint8_t)b;
  }
}

// round half to even of W floats of magnitude < 2**22 (the codes' quotients): adding and subtracting 1.5 * 2**23
// rounds at the units place in the default rounding mode (-ffp-contract=off keeps the two adds), as torch.round
inline vf vrint_small(vf x) {
  const vf big = vbc(12582912.f);
  return (x + big) - big;
}
inline vf vclamp(vf x, float lo, float hi) { return vmin(vmax(x, vbc(lo)), vbc(hi)); }

// SCALED (SelectiveQuantizer.encode), rows X [8][D]: per token scale = absmax / qmax + eps rounded to fp16, codes
// round(x / scale) (half to even) clamped to +-qmax, stored + qoff; float32 ops in torch's order
inline void encode_scaled_rows(const Codec& cd, const Layout& L, const float* X, uint8_t* rec, int slot) {
  const int D = L.D, qmax = cd.qoff - 1, rowb = D * cd.bits / 8;
  uint8_t* out = rec + cd.codes_off + (int64_t)slot * cd.code_bytes;
  uint16_t* sc = reinterpret_cast<uint16_t*>(rec + cd.scales_off) + (int64_t)slot * BLOCK;
  alignas(64) int code[MAX_D];
  for (int t = 0; t < BLOCK; ++t) {
    const float* x = X + t * D;
    vf am = vf{};
    for (int c = 0; c < D; c += W) {
      const vf v = vload(x + c);
      am = vmax(am, v < 0.f ? -v : v);
    }
    float m = am[0];
    for (int e = 1; e < W; ++e) m = am[e] > m ? am[e] : m;
    sc[t] = f32_to_fp16(m / (float)qmax + SCALE_EPS);
    const vf s = vbc(fp16_to_f32(sc[t]));
    for (int c = 0; c < D; c += W) {
      const vi q = __builtin_convertvector(vclamp(vrint_small(vload(x + c) / s), -qmax, qmax), vi) + cd.qoff;
      __builtin_memcpy(code + c, &q, sizeof q);
    }
    pack_row(code, D, cd.bits, out + t * rowb);
  }
}

// the smallest and largest of n floats (n a multiple of W; exact in any order): TaDA's and QJL's value groups
inline void group_min_max(const float* d, int n, float* l, float* u) {
  vf lo = vload(d), hi = lo;
  for (int c = W; c < n; c += W) {
    lo = vmin(lo, vload(d + c));
    hi = vmax(hi, vload(d + c));
  }
  *l = lo[0];
  *u = hi[0];
  for (int e = 1; e < W; ++e) {
    *l = lo[e] < *l ? lo[e] : *l;
    *u = hi[e] > *u ? hi[e] : *u;
  }
}

// TADA (TadaQuantizer.encode), XA [H][8][D]: every head's rows of the block.  Per token the head mean (summed in
// head order, divided by H: torch's mean over up to 16 heads) rounded to the store half; head h's deviations
// mean - x per group: min to fp16, scale (max - min) / qmax (at least eps) to fp16, codes round((dev - min) /
// scale) clamped to 0 .. qmax.  Head h's record keeps its codes, its scales then mins, and its share of the mean
// (channels h * mean_c .., zero past D: split_head_mean)
inline void encode_tada_rows(const Codec& cd, const Layout& L, int h, const float* XA, uint8_t* rec, int slot) {
  const int H = L.H, D = L.D, G = D / cd.group, qmax = (1 << cd.bits) - 1, rowb = D * cd.bits / 8, mc = cd.mean_c;
  uint8_t* out = rec + cd.codes_off + (int64_t)slot * cd.code_bytes;
  uint16_t* par = reinterpret_cast<uint16_t*>(rec + cd.scales_off) + (int64_t)slot * BLOCK * 2 * G;
  uint16_t* share = reinterpret_cast<uint16_t*>(rec + cd.mean_off) + (int64_t)slot * BLOCK * mc;
  const float* X = XA + (int64_t)h * BLOCK * D;
  const vf hv = vbc((float)H);
  alignas(64) float mean[MAX_D], dev[MAX_D];
  alignas(64) int code[MAX_D];
  for (int t = 0; t < BLOCK; ++t) {
    for (int c = 0; c < D; c += W) {
      vf s = vload(XA + t * D + c);
      for (int j = 1; j < H; ++j) s = s + vload(XA + ((int64_t)j * BLOCK + t) * D + c);
      const vf m = vround_to(s / hv, L.bf16);
      vstore(mean + c, m);
      vstore(dev + c, m - vload(X + t * D + c));
    }
    for (int j = 0; j < mc; ++j) {
      const int c = h * mc + j;
      share[t * mc + j] = c < D ? f2h(mean[c], L.bf16) : 0;
    }
    for (int gi = 0; gi < G; ++gi) {
      const float* d = dev + gi * cd.group;
      float l, u;
      group_min_max(d, cd.group, &l, &u);
      const uint16_t mn16 = f32_to_fp16(l);
      const float mn = fp16_to_f32(mn16);
      float sf = (u - mn) / (float)qmax;
      sf = sf < SCALE_EPS ? SCALE_EPS : sf;  // clamp_min
      const uint16_t sc16 = f32_to_fp16(sf);
      par[t * 2 * G + gi] = sc16;
      par[t * 2 * G + G + gi] = mn16;
      const vf s = vbc(fp16_to_f32(sc16)), mv = vbc(mn);
      for (int c = 0; c < cd.group; c += W) {
        const vi q = __builtin_convertvector(vclamp(vrint_small((vload(d + c) - mv) / s), 0.f, (float)qmax), vi);
        __builtin_memcpy(code + gi * cd.group + c, &q, sizeof q);
      }
    }
    pack_row(code, D, cd.bits, out + t * rowb);
  }
}

// ---- QJL (seed 002): its keys' sign sketches and its values' affine codes -------------------------
// AFFINE (QJLValueQuantizer / encode_values), rows X [8][D]: per token and group of cd.group channels, min and
// (max - min) / qmax in float32 rounded to fp16, codes round((x - min) / scale) (half to even) clamped to 0 .. qmax,
// 0 where the stored scale is 0 (a constant group decodes to its min); the scales then the mins per token, as TaDA's
inline void encode_affine_rows(const Codec& cd, const Layout& L, const float* X, uint8_t* rec, int slot) {
  const int D = L.D, G = D / cd.group, qmax = (1 << cd.bits) - 1, rowb = D * cd.bits / 8;
  uint8_t* out = rec + cd.codes_off + (int64_t)slot * cd.code_bytes;
  uint16_t* par = reinterpret_cast<uint16_t*>(rec + cd.scales_off) + (int64_t)slot * BLOCK * 2 * G;
  alignas(64) int code[MAX_D];
  for (int t = 0; t < BLOCK; ++t) {
    const float* x = X + (int64_t)t * D;
    for (int gi = 0; gi < G; ++gi) {
      const float* d = x + gi * cd.group;
      float l, u;
      group_min_max(d, cd.group, &l, &u);
      const uint16_t sc16 = f32_to_fp16((u - l) / (float)qmax), mn16 = f32_to_fp16(l);
      par[t * 2 * G + gi] = sc16;
      par[t * 2 * G + G + gi] = mn16;
      const float sf = fp16_to_f32(sc16);
      const bool live = sf > 0.f;
      const vf s = vbc(live ? sf : 1.f), mv = vbc(fp16_to_f32(mn16));
      for (int c = 0; c < cd.group; c += W) {
        vi q = __builtin_convertvector(vclamp(vrint_small((vload(d + c) - mv) / s), 0.f, (float)qmax), vi);
        if (!live) q = vi{};
        __builtin_memcpy(code + gi * cd.group + c, &q, sizeof q);
      }
    }
    pack_row(code, D, cd.bits, out + t * rowb);
  }
}

// sign bits of the rows 0 .. rows - 1 of S (S^T [D][ld]) times 8 vectors x_t restricted to the channels
// ch[0 .. nch - 1] (the others zero), row t at bits + t * rows / 8 (bit j of byte i: sketch row 8i + j, 1 =
// positive), nrm[t] >= ||x_t restricted||.
// The contract (codecs/qjl.py encode_keys) is the sign of the float64 product, whose products of float32s are exact
// and whose sum rounds at 2^-53: the sign of the exact sum unless it is within ~D 2^-53 ||S_j|| ||x|| of 0.  The
// float32 screen's sum is within gamma(2n) ||S_j|| ||x|| of it (n products and sums, fused or not); a lane farther
// from 0 than twice that keeps its float32 sign, the others (~1e-4 of them) are summed again in float64.
inline void qjl_sign_rows(const float* ST, int ld, int rows, const float* X, int D, const int* ch, int nch,
                          float smax, const float* nrm, uint8_t* bits) {
  const float g2n = 2.f * nch * 0x1p-24f / (1.f - 2.f * nch * 0x1p-24f);
  float thr[BLOCK];
  for (int t = 0; t < BLOCK; ++t) thr[t] = 2.f * g2n * smax * nrm[t] + 1e-30f;
  for (int j0 = 0; j0 < rows; j0 += W) {
    vf acc[BLOCK];
    for (int t = 0; t < BLOCK; ++t) acc[t] = vbc(0.f);
    for (int i = 0; i < nch; ++i) {
      const int c = ch[i];
      const vf s = vload(ST + (int64_t)c * ld + j0);
      for (int t = 0; t < BLOCK; ++t) acc[t] = vfma(vbc(X[t * D + c]), s, acc[t]);
    }
    for (int t = 0; t < BLOCK; ++t) {
      unsigned pos = le_mask(vbc(thr[t]), acc[t]);
      // (a row of exact zeros - nrm 0 - has every sum exactly 0 and every sign bit 0, float64 or not: none is summed
      // again, where each of its W lanes would sum its nch products in float64 one after the other)
      const unsigned open = nrm[t] == 0.f ? 0u : ~(pos | le_mask(vbc(thr[t]), -acc[t])) & ((1u << W) - 1);
      for (unsigned o = open; o; o &= o - 1) {  // near 0 (or not finite): the float64 sum decides
        const int j = j0 + __builtin_ctz(o);
        double p = 0.0;
        for (int i = 0; i < nch; ++i) p += (double)ST[(int64_t)ch[i] * ld + j] * X[t * D + ch[i]];
        if (p > 0.0) pos |= 1u << (j - j0);
      }
      uint8_t* row = bits + t * (rows / 8);
      if (W >= 8) {
        for (int b = 0; b < W / 8; ++b) row[j0 / 8 + b] = (uint8_t)(pos >> (8 * b));
      } else {
        const int sh = j0 % 8;
        row[j0 / 8] = (uint8_t)((sh ? row[j0 / 8] & ((1u << sh) - 1) : 0) | (pos << sh));
      }
    }
  }
}

// QJL keys (QJLKeyQuantizer.encode, encode_keys' float64 contract), post-RoPE rows X [8][D]: the block's
// QJL_OUTLIERS channels of largest sum of squares over its 8 tokens (largest first, ties to the lower channel, NaN
// first: torch's stable descending sort), per token the signs of S k_in and S_o k_out, ||k|| and ||k_out|| (float64,
// rounded to float32, then fp16), in the layout QjlBlock reads
inline void encode_qjl_rows(const Codec& cd, const Layout& L, const float* X, uint8_t* rec, int slot) {
  const int D = L.D, m = cd.chunk, mo = cd.kc;
  uint8_t* blk = rec + cd.codes_off + (int64_t)slot * cd.code_bytes;
  uint8_t* in_bits = blk;
  uint8_t* out_bits = blk + BLOCK * (m / 8);
  uint8_t* nrm = out_bits + BLOCK * (mo / 8);
  uint8_t* oc = nrm + BLOCK * 4;
  double sq[MAX_D];
  for (int c = 0; c < D; ++c) {
    double s = 0.0;
    for (int t = 0; t < BLOCK; ++t) s += (double)X[t * D + c] * X[t * D + c];
    sq[c] = s;
  }
  bool is_out[MAX_D] = {};
  int chan_out[QJL_OUTLIERS], chan_in[MAX_D], nin = 0;
  for (int o = 0; o < QJL_OUTLIERS; ++o) {
    int best = -1;
    for (int c = 0; c < D; ++c) {
      if (is_out[c]) continue;
      if (best < 0 || sq[c] > sq[best] || (sq[c] != sq[c] && sq[best] == sq[best])) best = c;
    }
    is_out[best] = true;
    chan_out[o] = best;
    oc[o] = (uint8_t)best;
  }
  for (int c = 0; c < D; ++c)
    if (!is_out[c]) chan_in[nin++] = c;
  float n_in[BLOCK], n_out[BLOCK];
  for (int t = 0; t < BLOCK; ++t) {
    const float* x = X + t * D;
    double all = 0.0, out = 0.0, in = 0.0;
    for (int c = 0; c < D; ++c) all += (double)x[c] * x[c];
    for (int o = 0; o < QJL_OUTLIERS; ++o) out += (double)x[chan_out[o]] * x[chan_out[o]];
    // summed on their own, not all - out: that difference cancels when the outliers dwarf the rest, and a screen
    // bound rounded toward 0 would keep float32 signs that float64 can flip
    for (int i = 0; i < nin; ++i) in += (double)x[chan_in[i]] * x[chan_in[i]];
    const uint16_t h[2] = {f32_to_fp16((float)__builtin_sqrt(all)), f32_to_fp16((float)__builtin_sqrt(out))};
    __builtin_memcpy(nrm + 4 * t, h, 4);
    // the screen's bounds: the restricted norms, generously rounded up (a factor 2 to spare in the threshold)
    // (0 exactly where the restricted row is all zeros - a nonzero float's square is a normal double - else at least
    // the smallest float: qjl_sign_rows skips the float64 sums of a zero row only)
    auto bound = [](double q) {
      const float b = (float)__builtin_sqrt(q) * 1.001f;
      return q == 0.0 ? 0.f : b < 0x1p-149f ? 0x1p-149f : b;  // (NaN: b, as before)
    };
    n_in[t] = bound(in);
    n_out[t] = bound(out);
  }
  qjl_sign_rows(cd.cent, m, m, X, D, chan_in, nin, cd.smax, n_in, in_bits);  // S k_in
  qjl_sign_rows(cd.cent, m, mo, X, D, chan_out, QJL_OUTLIERS, cd.smax, n_out, out_bits);  // S_o k_out
}

// One (block, KV head) to encode (EncodeArgs::blocks): the block's 8 rows from this call's input or from the ring of
// their page, keys un-rotated and rounded to the model dtype, then K and V encoded (TaDA: every head's rows, for
// the head mean; each item writes its own head's record only)
void encode_item(const EncodeArgs& a, int64_t item) {
  const Layout& L = a.lay;
  const int H = L.H, D = L.D, HD = D / 2;
  const int h = (int)(item % H);
  const int64_t* blk = a.blocks + (item / H) * 5;
  const int64_t pos0 = blk[0], pg = blk[1], rpg = blk[2], in0 = blk[3], first_in = blk[4];
  uint8_t* rec = a.pages + (pg * H + h) * L.rec_bytes;
  const int s0 = a.small ? 0 : TAIL0;  // the ring's first slot: token p waits in s0 + p % ring
  const int slot = (int)((pos0 % L.block_size) / BLOCK);
  alignas(64) float X1[BLOCK * MAX_D];
  float* XA = nullptr;
  // The next block of this head (a thread's next item: parallel_heads): its input rows fetched now - `perf` put
  // ~5% of a prompt's write on the first loads of each row.  With the division below skipped at unit RoPE scale:
  // a 4096-token write of SmolLM2's 30 layers (python -m benchmarks.encode_cpu --tokens 4096, old and new builds
  // alternated 5 times, 2-core AMD EPYC) 155.5 -> 140.9 ms (medians; every new run below every old one).
  {
    const int64_t nx = item + H;
    if (nx < a.nitems) {
      const int64_t* nb = a.blocks + (nx / H) * 5;
      for (int r = 0; r < BLOCK; ++r)
        if (nb[0] + r >= nb[4]) {
          const char* kr = reinterpret_cast<const char*>(a.kh + (nb[3] + r) * a.krow + h * D);
          const char* vr = reinterpret_cast<const char*>(a.vh + (nb[3] + r) * a.vrow + h * D);
          for (int o = 0; o < D * 2; o += 64) {
            __builtin_prefetch(kr + o, 0, 3);
            __builtin_prefetch(vr + o, 0, 3);
          }
        }
    }
  }
  for (int kind = 0; kind < 2; ++kind) {
    const Codec& cd = kind ? a.v : a.k;
    const bool all = cd.method == TADA;
    float* X = X1;
    if (all) {
      if (!XA) XA = static_cast<float*>(__builtin_malloc(sizeof(float) * H * BLOCK * D));
      X = XA;
    }
    for (int hh = all ? 0 : h; hh < (all ? H : h + 1); ++hh) {
      float* Xh = X + (all ? (int64_t)hh * BLOCK * D : 0);
      const uint8_t* trec = a.pages + (rpg * H + hh) * L.rec_bytes;
      for (int r = 0; r < BLOCK; ++r) {
        const int64_t pr = pos0 + r;
        const uint16_t* row = pr >= first_in ? (kind ? a.vh + (in0 + r) * a.vrow : a.kh + (in0 + r) * a.krow) + hh * D
                                             : region_row(trec, L, s0 + (int)(pr % L.ring), kind);
        float* x = Xh + r * D;
        for (int c = 0; c < D; c += W) vstore(x + c, vload_half(row + c, L.bf16));
        if (kind == 0 && cd.method != QJL) {  // Rope.invert (QJL's keys are post-RoPE): (x * cos - rotate_half(x) * sin) / scale**2, then the model dtype
          const float* C = a.cos + pr * HD;  // cos/sin of channel c + D/2 equal those of c (HD: a multiple of W)
          const float* Sn = a.sin + pr * HD;
          const vf s2 = vbc(a.s2);
          const bool unit = a.s2 == 1.f;  // (y / 1 is y: no division)
          for (int c = 0; c < HD; c += W) {  // rotate_half: -x[c + HD] for channel c, x[c] for channel c + HD
            const vf x1 = vload(x + c), x2 = vload(x + c + HD), cs = vload(C + c), sn = vload(Sn + c);
            vf y1 = x1 * cs - (-x2) * sn, y2 = x2 * cs - x1 * sn;
            if (!unit) {
              y1 = y1 / s2;
              y2 = y2 / s2;
            }
            vstore(x + c, vround_to(y1, L.round));
            vstore(x + c + HD, vround_to(y2, L.round));
          }
        }
      }
    }
    if (all)
      encode_tada_rows(cd, L, h, XA, rec, slot);
    else if (cd.method == QJL)
      encode_qjl_rows(cd, L, X, rec, slot);
    else if (cd.method == AFFINE)
      encode_affine_rows(cd, L, X, rec, slot);
    else if (cd.method == SCALED)
      encode_scaled_rows(cd, L, X, rec, slot);
    else
      encode_rows(cd, L, h, X, rec, slot);
  }
  if (XA) __builtin_free(XA);
}

#include "prefill_impl.h"

}  // namespace

extern const Kernels kernels;
const Kernels kernels = {
    TKV_ISA_NAME, decode_item, decode_merge, gather_block, encode_item, nearest_rows, prefill_item, window_item,
};

}  // namespace TKV_ISA
}  // namespace tkv
