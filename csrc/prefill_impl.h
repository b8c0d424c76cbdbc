// Prefill attention (a chunk of queries over decoded + exact keys), fused and GQA-aware.  Included by
// kernels_impl.h inside its per-ISA anonymous namespace (vf, vload, vfma, vexp2, hsum, W from there).
//
// Why: the chunk's attention was torch's float32 flash kernel on K/V copied once per query head of a GQA
// group, with the own block's exact keys in a second pass merged by log-sum-exp; on a 2-core AVX-512 machine it
// took ~75% of a 512-query chunk's layer step (benchmarks/throughput: prefill-heavy 0.60x auto).  Here the
// g query heads of a KV head share every K/V tile read (L1-resident, tile-major), and each query's own block is
// taken from the exact keys in the same pass: one softmax over the union, no merge.
//
// Arithmetic, the same for a query whatever rows share its group (so its output does not depend on how the
// prompt was chunked or batched): scores s[t] = sum_c (q[c] * scale log2(e)) * k_t[c] as one FMA chain in channel
// order per key (bf16: pair sums times scale log2(e)); keys in 32-token tiles at absolute positions, tiles in
// order; per tile the running max, 2^(s - max) of the valid lanes (vexp2; others exactly 0), the tile's weights
// added lane-wise into a vector of partial sums (reduced once, at the end: a horizontal sum per row and tile was
// ~a fifth of the kernel - the same chunk as below, 71 -> 61 ms), then V accumulated key by key in order with
// FMAs.  A tile a query sees nothing of is skipped (adding exact zeros would change nothing).  Which of the two
// sources a key comes from depends only on the query's own position.

constexpr int PF_RB = 4;     // rows per score micro-block

// s[k][t] = sum_c qs[k][c] * KT[c][t] for PF_RB rows, t < TILE (KT: one tile, [D][TILE])
inline void pf_scores(const float* qs, int D, const float* KT, float* s) {
  constexpr int NV = TILE / W;
  vf acc[PF_RB][NV];
  for (int k = 0; k < PF_RB; ++k)
    for (int v = 0; v < NV; ++v) acc[k][v] = vf{};
  for (int c = 0; c < D; ++c) {
    vf kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = vload(KT + c * TILE + v * W);
    for (int k = 0; k < PF_RB; ++k) {
      const vf qb = vbc(qs[k * MAX_D + c]);
      for (int v = 0; v < NV; ++v) acc[k][v] = vfma(qb, kv[v], acc[k][v]);
    }
  }
  for (int k = 0; k < PF_RB; ++k)
    for (int v = 0; v < NV; ++v) vstore(s + k * TILE + v * W, acc[k][v]);
}

#if TKV_W == 16
// The same scores from bf16 pairs: s[k][t] = scale * sum over channel pairs (q[c] k_t[c] + q[c+1] k_t[c+1]), one
// VDPBF16PS per 16 keys and pair (exact products, float32 sums); qp: each row's (q[c], q[c+1]) bits as one
// uint32, KT: one tile [D/2][TILE][2].  Not inlined into its caller (compiled without AVX512_BF16): one call
// per tile and micro-block.  Two accumulators per output vector (even and odd channel pairs, added at the end): 16
// independent chains - with 8 the loop waited on VDPBF16PS's latency (SmolLM2's 4096-token chunk, one layer, on a
// 2-core AMD EPYC with AVX512_BF16: 61 -> 55 ms).
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) void pf_scores_bf16(
    const uint32_t* qp, int D, const uint16_t* KT, float scale, float* s) {
  __m512 acc[PF_RB][2][2];
  for (int k = 0; k < PF_RB; ++k) acc[k][0][0] = acc[k][1][0] = acc[k][0][1] = acc[k][1][1] = _mm512_setzero_ps();
  for (int c2 = 0; c2 < D / 2; c2 += 2) {  // (D / 2: a multiple of 16)
    for (int e = 0; e < 2; ++e) {
      const uint16_t* kt = KT + (c2 + e) * 2 * TILE;
      const __m512i k0 = _mm512_loadu_si512(kt), k1 = _mm512_loadu_si512(kt + 32);
      for (int k = 0; k < PF_RB; ++k) {
        const __m512i qb = _mm512_set1_epi32((int)qp[k * (MAX_D / 2) + c2 + e]);
        acc[k][0][e] = _mm512_dpbf16_ps(acc[k][0][e], (__m512bh)qb, (__m512bh)k0);
        acc[k][1][e] = _mm512_dpbf16_ps(acc[k][1][e], (__m512bh)qb, (__m512bh)k1);
      }
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int k = 0; k < PF_RB; ++k) {
    _mm512_storeu_ps(s + k * TILE, _mm512_mul_ps(_mm512_add_ps(acc[k][0][0], acc[k][0][1]), sc));
    _mm512_storeu_ps(s + k * TILE + 16, _mm512_mul_ps(_mm512_add_ps(acc[k][1][0], acc[k][1][1]), sc));
  }
}
#endif

// acc[k][c] += sum_t w[k][t] * V_t[c], t in order, for PF_RB rows; vrow(k, t): row k's value row of key t
template <class VRow>
inline void pf_values(float* acc, int D, const float* w, int t_lo, int t_hi, const VRow& vrow) {
  constexpr int CB = 4 * W;  // channels per register block: PF_RB x 4 accumulators
  for (int c0 = 0; c0 < D; c0 += CB) {
    const int nv = (D - c0) < CB ? (D - c0) / W : 4;
    vf a[PF_RB][4];
    for (int k = 0; k < PF_RB; ++k)
      for (int v = 0; v < nv; ++v) a[k][v] = vload(acc + k * MAX_D + c0 + v * W);
    for (int t = t_lo; t < t_hi; ++t) {
      for (int k = 0; k < PF_RB; ++k) {
        const vf wb = vbc(w[k * TILE + t]);  // 0 for a masked key: adds exact zeros
        const float* vr = vrow(k, t) + c0;
        for (int v = 0; v < nv; ++v) a[k][v] = vfma(wb, vload(vr + v * W), a[k][v]);
      }
    }
    for (int k = 0; k < PF_RB; ++k)
      for (int v = 0; v < nv; ++v) vstore(acc + k * MAX_D + c0 + v * W, a[k][v]);
  }
}

#if TKV_W == 16
// pf_values from bf16: acc[k][c] += sum over token pairs (w[k][t] V_t[c] + w[k][t+1] V_t+1[c]) for PF_RB rows, the
// NV x 16 channels from c0 and the pairs [p_lo, p_hi) of the tile at t0, one VDPBF16PS per 16 channels and pair
// (exact products of the bf16 weights and values, float32 sums) - half pf_values's FMAs, which bounded the kernel
// (~half of a 4096-token chunk's prefill_item on a 2-core AMD EPYC).  wp: each row's weights as bf16 pairs
// [PF_RB][TILE / 2]; vd / vx: the KV head's values as token pairs (PrefillArgs::vd16, vx16; x0: the exact array's
// first position).  A row reads a position x decoded where x < E[k] (its own block's start, x0 <= it) or x < x0,
// else exact - both even (whole blocks, whole tiles), so a pair's two tokens come from one source.  every_decoded:
// no row reads an exact key in this tile.  NV a template argument: with a runtime count the accumulators spilled
// (2.2x slower).  Not inlined into its caller (compiled without AVX512_BF16).
static_assert(BLOCK % 2 == 0 && TILE % 2 == 0, "a token pair never straddles the decoded / exact boundary");
template <int NV>
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) void pf_values_bf16(
    float* acc, int D, int c0, const uint32_t* wp, int p_lo, int p_hi, int64_t t0, const uint16_t* vd,
    const uint16_t* vx, int64_t x0, const int64_t* E, bool every_decoded) {
  __m512 a[PF_RB][NV];
  for (int k = 0; k < PF_RB; ++k)
    for (int v = 0; v < NV; ++v) a[k][v] = _mm512_loadu_ps(acc + k * MAX_D + c0 + v * W);
  for (int p = p_lo; p < p_hi; ++p) {
    const int64_t x = t0 + 2 * p;  // the pair's first position
    const uint16_t* pd = vd + (x / 2) * 2 * D + 2 * c0;
    if (every_decoded) {
      __m512i vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_si512(pd + v * 2 * W);
      for (int k = 0; k < PF_RB; ++k) {
        const __m512i wb = _mm512_set1_epi32((int)wp[k * (TILE / 2) + p]);  // 0 for masked keys: exact zeros
        for (int v = 0; v < NV; ++v) a[k][v] = _mm512_dpbf16_ps(a[k][v], (__m512bh)wb, (__m512bh)vv[v]);
      }
      continue;
    }
    for (int k = 0; k < PF_RB; ++k) {
      const __m512i wb = _mm512_set1_epi32((int)wp[k * (TILE / 2) + p]);
      // (x < x0: decoded whatever E says - a padding row's E is 0, its weights 0: any row in bounds)
      const uint16_t* px = x < E[k] || x < x0 ? pd : vx + ((x - x0) / 2) * 2 * D + 2 * c0;
      for (int v = 0; v < NV; ++v)
        a[k][v] = _mm512_dpbf16_ps(a[k][v], (__m512bh)wb, (__m512bh)_mm512_loadu_si512(px + v * 2 * W));
    }
  }
  for (int k = 0; k < PF_RB; ++k)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + k * MAX_D + c0 + v * W, a[k][v]);
}

// a tile's weights w [PF_RB][TILE] as bf16 pairs wp [PF_RB][TILE / 2] (round to nearest even, as Tensor.to)
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) void pf_weights_bf16(const float* w, uint32_t* wp) {
  static_assert(TILE == 2 * W, "a tile's weights: two vectors");
  for (int k = 0; k < PF_RB; ++k)
    _mm512_storeu_si512(wp + k * (TILE / 2), (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + k * TILE + W),
                                                                          _mm512_loadu_ps(w + k * TILE)));
}
#endif

template <int DT>
void prefill_item_t(const PrefillArgs& a, int64_t item) {
  const int D = DT ? DT : a.D;
  const int g = a.g;
  const int64_t rows = (int64_t)a.Tq * g;
  const int64_t ngroups = (rows + PF_ROWS - 1) / PF_ROWS;
  const int h = (int)(item / ngroups);
  const int64_t r0 = (item % ngroups) * PF_ROWS;
  const int nr = (int)(rows - r0 < PF_ROWS ? rows - r0 : PF_ROWS);
  const int nrp = (nr + PF_RB - 1) / PF_RB * PF_RB;  // padded to whole micro-blocks (padding rows see nothing)

  alignas(64) float qs[PF_ROWS * MAX_D];
  alignas(64) uint32_t qp[PF_ROWS * MAX_D / 2];  // bf16 scores: the rows' channel pairs
  const bool b16 = a.q16 != nullptr;
  alignas(64) float acc[PF_ROWS * MAX_D];
  alignas(64) float sd[PF_RB * TILE], sx[PF_RB * TILE], w[PF_RB * TILE];
  float m[PF_ROWS];
  vf l[PF_ROWS];  // each row's partial sums of its weights, lane-wise (hsum at the end)
  int64_t pos[PF_ROWS], ex[PF_ROWS];  // the query's position; its first exactly-read key
  int64_t pmax = -1;
  const float scale2 = a.scale * 1.44269504088896341f;  // the softmax in powers of 2 (vexp2): log2(e) in the scale
  for (int k = 0; k < nrp; ++k) {
    m[k] = -__builtin_inff();
    l[k] = vf{};
    for (int c = 0; c < D; ++c) acc[k * MAX_D + c] = 0.f;
    if (k < nr) {
      const int64_t r = r0 + k, i = r / g;
      const float* q = a.q + (i * a.Hq + (int64_t)h * g + r % g) * D;
      for (int c = 0; c < D; ++c) qs[k * MAX_D + c] = q[c] * scale2;
      if (b16) __builtin_memcpy(qp + k * (MAX_D / 2), a.q16 + (q - a.q), sizeof(uint16_t) * D);
      pos[k] = a.offset + i;
      ex[k] = exact_start(pos[k], a.window);  // own block (a recent window) exact; block 0: the sinks
      pmax = pos[k] > pmax ? pos[k] : pmax;
    } else {
      for (int c = 0; c < D; ++c) qs[k * MAX_D + c] = 0.f;
      for (int c = 0; c < D / 2; ++c) qp[k * (MAX_D / 2) + c] = 0u;
      pos[k] = -1;
      ex[k] = 0;
    }
  }
  const float* kdT = a.kdT + (int64_t)h * a.nd * D;  // [nd / TILE][D][TILE]
  const float* vd = a.vd + (int64_t)h * a.nd * D;    // [nd][D]
  const float* kxT = a.kxT + (int64_t)h * a.nx * D;
  const float* vx = a.vx + (int64_t)h * a.nx * D;
  const vf ninf = vbc(-__builtin_inff());

  for (int64_t t0 = 0; t0 <= pmax; t0 += TILE) {
    for (int k0 = 0; k0 < nrp; k0 += PF_RB) {
      const int64_t* P = pos + k0;
      const int64_t* E = ex + k0;
      int64_t bp = -1, be = 0, le = INT64_MAX;
      for (int k = 0; k < PF_RB; ++k) {
        bp = P[k] > bp ? P[k] : bp;
        if (P[k] >= 0) {
          be = E[k] > be ? E[k] : be;
          le = E[k] < le ? E[k] : le;
        }
      }
      if (t0 > bp) continue;  // no row of the micro-block sees this tile
      const bool dec = t0 < be, exa = t0 + TILE > le;  // some row reads decoded / exact keys here
#if TKV_W == 16
      if (b16) {
        if (dec) pf_scores_bf16(qp + k0 * (MAX_D / 2), D, a.kdT16 + (int64_t)h * a.nd * D + t0 * D, scale2, sd);
        if (exa) pf_scores_bf16(qp + k0 * (MAX_D / 2), D, a.kxT16 + (int64_t)h * a.nx * D + (t0 - a.x0) * D, scale2, sx);
      } else
#endif
      {
        if (dec) pf_scores(qs + k0 * MAX_D, D, kdT + t0 * D, sd);
        if (exa) pf_scores(qs + k0 * MAX_D, D, kxT + (t0 - a.x0) * D, sx);
      }
      int t_lo = TILE, t_hi = 0;
      for (int k = 0; k < PF_RB; ++k) {
        float* wk = w + k * TILE;
        const int64_t p = P[k], e = E[k];
        const int hi = (int)(p - t0 + 1 < TILE ? p - t0 + 1 : TILE);  // valid lanes [0, hi)
        if (hi <= 0) {
          for (int t = 0; t < TILE; ++t) wk[t] = 0.f;
          continue;
        }
        const int split = (int)(e - t0 < 0 ? 0 : (e - t0 < TILE ? e - t0 : TILE));  // decoded lanes [0, split)
        const float* src = wk;  // the row's scores: read in place from one source, every lane valid (most tiles)
        if (hi == TILE && (split == TILE || split == 0)) {
          src = (split ? sd : sx) + k * TILE;
        } else {
          for (int t = 0; t < TILE; ++t)
            wk[t] = t >= hi ? -__builtin_inff() : (t < split ? sd[k * TILE + t] : sx[k * TILE + t]);
        }
        vf mv = ninf;
        for (int v = 0; v < TILE; v += W) mv = vmax(mv, vload(src + v));
        const float tm = hmax(mv);
        float* mk = m + k0 + k;
        if (tm > *mk) {
          const float alpha = __builtin_exp2f(*mk - tm);  // 0 for the first tile a row sees
          const vf ab = vbc(alpha);
          l[k0 + k] = l[k0 + k] * ab;
          float* ak = acc + (k0 + k) * MAX_D;
          for (int c = 0; c < D; c += W) vstore(ak + c, vload(ak + c) * ab);
          *mk = tm;
        }
        const vf mb = vbc(*mk);
        vf sum = vf{};
        for (int v = 0; v < TILE; v += W) {
          const vf s = vload(src + v);
          vf e_ = vexp2(s - mb);
          e_ = s == ninf ? vf{} : e_;  // vexp2 clamps: masked lanes must be exactly 0
          vstore(wk + v, e_);
          sum += e_;
        }
        l[k0 + k] += sum;
        t_lo = 0;
        t_hi = hi > t_hi ? hi : t_hi;
      }
      if (t_hi == 0) continue;
      float* ab = acc + k0 * MAX_D;
#if TKV_W == 16
      if (a.vd16) {  // bf16 values: the weights rounded to bf16, summed in token pairs (t_lo: 0, even)
        alignas(64) uint32_t wp[PF_RB * (TILE / 2)];
        pf_weights_bf16(w, wp);
        const uint16_t *vd16 = a.vd16 + (int64_t)h * a.nd * D, *vx16 = a.vx16 + (int64_t)h * a.nx * D;
        for (int c0 = 0; c0 < D; c0 += 4 * W) {  // (D: a multiple of 32)
          if (D - c0 >= 4 * W)
            pf_values_bf16<4>(ab, D, c0, wp, t_lo / 2, (t_hi + 1) / 2, t0, vd16, vx16, a.x0, E, t0 + TILE <= le);
          else
            pf_values_bf16<2>(ab, D, c0, wp, t_lo / 2, (t_hi + 1) / 2, t0, vd16, vx16, a.x0, E, t0 + TILE <= le);
        }
        continue;
      }
#endif
      if (t0 + TILE <= le) {  // every row's keys here decoded: one value row for all
        pf_values(ab, D, w, t_lo, t_hi, [&](int, int t) { return vd + (t0 + t) * D; });
      } else {
        pf_values(ab, D, w, t_lo, t_hi, [&](int k, int t) {  // (a padding row: any row in bounds, weight 0)
          const int64_t x = t0 + t;
          return x < E[k] || x < a.x0 ? vd + x * D : vx + (x - a.x0) * D;
        });
      }
    }
  }
  for (int k = 0; k < nr; ++k) {
    const int64_t r = r0 + k, i = r / g;
    float* o = a.out + (i * a.Hq + (int64_t)h * g + r % g) * D;
    const float inv = hsum(l[k]);
    for (int c = 0; c < D; ++c) o[c] = acc[k * MAX_D + c] / inv;
  }
}

void prefill_item(const PrefillArgs& a, int64_t item) {
  switch (a.D) {
    case 64: prefill_item_t<64>(a, item); break;
    case 128: prefill_item_t<128>(a, item); break;
    default: prefill_item_t<0>(a, item); break;
  }
}

// ---- the window part of the flash prefill (WindowArgs) ----

// W bf16 values -> float (the bits shifted into the high half), and back rounded to nearest even as torch
inline vf bf16_vload(const uint16_t* r) {
#if TKV_W == 16
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)r)), 16));
#elif TKV_W == 8
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)r)), 16));
#else
  vf x;
  for (int e = 0; e < W; ++e) x[e] = bf16_to_f32(r[e]);
  return x;
#endif
}

inline void bf16_vstore(uint16_t* r, vf x) {
#if TKV_W == 16
  const __m512i u = _mm512_castps_si512((__m512)x);
  __m512i v = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                                   _mm512_set1_epi32(0x7FFF)));
  v = _mm512_srli_epi32(v, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask((__m512)x, (__m512)x, _CMP_UNORD_Q);
  v = _mm512_mask_mov_epi32(v, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256((__m256i*)r, _mm512_cvtepi32_epi16(v));
#else
  for (int e = 0; e < W; ++e) r[e] = f32_to_bf16(x[e]);
#endif
}

// one row of D elements (float32, or bf16 bits) -> float
inline void win_row(const void* base, int64_t off, int bf16, int D, float* dst);
inline void win_row(const WinRows& r, int64_t n, int64_t h, int bf16, int D, float* dst) {
  win_row(r.p, n * r.st + h * r.sh, bf16, D, dst);
}
inline void win_row(const void* base, int64_t off, int bf16, int D, float* dst) {
  if (bf16) {
    const uint16_t* r = static_cast<const uint16_t*>(base) + off;
    for (int c = 0; c < D; c += W) vstore(dst + c, bf16_vload(r + c));
  } else {
    __builtin_memcpy(dst, static_cast<const float*>(base) + off, sizeof(float) * D);
  }
}

inline float win_dot(const float* a, const float* b, int D) {
  vf acc = vf{};
  for (int c = 0; c < D; c += W) acc = vfma(vload(a + c), vload(b + c), acc);
  return hsum(acc);
}

// Queries chunk * WIN_ROWS .. of KV head h: the positions their windows cover are read once (decoded rows where a
// later block's query reads them, exact ones where their own block's does) and shared by the chunk's queries and
// the g query heads; per head the scores, then one softmax over them and the parts' log-sum-exps.  With a recent
// window w a query at p takes here the 8 positions p - w - 7 .. p - w (none where p < w: its band part, exact keys
// p - w + 1 .. p, is one of the parts).
void window_item(const WindowArgs& a, int64_t item) {
  const int64_t chunks = (a.Tq + WIN_ROWS - 1) / WIN_ROWS;
  const int h = (int)(item / chunks);
  const int64_t t_lo = (item % chunks) * WIN_ROWS, t_hi = (a.Tq < t_lo + WIN_ROWS ? (int64_t)a.Tq : t_lo + WIN_ROWS);
  const int D = a.D, g = a.g, w = a.window;
  const int64_t p_lo = a.offset + t_lo, p_hi = a.offset + t_hi - 1;
  const int64_t e_lo = p_lo - w, e_hi = p_hi - w;  // the last of the 8 positions of the first / last query
  const int64_t P0 = e_lo >= BLOCK - 1 ? e_lo - (BLOCK - 1) : 0, NP = e_hi >= P0 ? e_hi - P0 + 1 : 0;
  const int64_t d_hi = exact_start(p_hi, w), x_lo = exact_start(p_lo, w) > P0 ? exact_start(p_lo, w) : P0;
  float* buf = static_cast<float*>(__builtin_malloc(sizeof(float) * (4 * NP * D + 1)));
  float *Kd = buf, *Vd = buf + NP * D, *Kx = buf + 2 * NP * D, *Vx = buf + 3 * NP * D;
  for (int64_t pos = P0; pos < d_hi && pos <= e_hi; ++pos) {  // decoded: read by the queries of later blocks
    win_row(a.kd, pos, h, a.bf16, D, Kd + (pos - P0) * D);
    win_row(a.vd, pos, h, a.bf16, D, Vd + (pos - P0) * D);
  }
  for (int64_t pos = x_lo; pos <= e_hi; ++pos) {  // exact: read by the queries of their own block
    win_row(a.kx, pos - a.x0, h, a.bf16, D, Kx + (pos - P0) * D);
    win_row(a.vx, pos - a.x0, h, a.bf16, D, Vx + (pos - P0) * D);
  }
  alignas(64) float qf[MAX_D], acc[MAX_D], o[MAX_D];
  const float* K[BLOCK];
  const float* V[BLOCK];
  for (int64_t t = t_lo; t < t_hi; ++t) {
    const int64_t p = a.offset + t, own = exact_start(p, w), e = p - w;
    int nk = 0;
    for (int64_t pos = (e >= BLOCK - 1 ? e - (BLOCK - 1) : 0); pos <= e; ++pos, ++nk) {
      const int64_t r = (pos - P0) * D;
      K[nk] = pos < own ? Kd + r : Kx + r;
      V[nk] = pos < own ? Vd + r : Vx + r;
    }
    for (int i = 0; i < g; ++i) {
      const int hq = h * g + i;
      win_row(a.q, t, hq, a.bf16, D, qf);
      float s[BLOCK], pl[8];
      float m = -__builtin_inff();
      for (int j = 0; j < nk; ++j) {
        s[j] = win_dot(qf, K[j], D) * a.scale;
        m = s[j] > m ? s[j] : m;
      }
      for (int k = 0; k < a.np; ++k) {
        const WindowPart& P = a.parts[k];
        pl[k] = t < P.t0 ? -__builtin_inff() : P.lse[h * P.sl_h + i * P.sl_i + (t - P.t0) * P.sl_t];
        m = pl[k] > m ? pl[k] : m;
      }
      float den = 0.f;
      for (int c = 0; c < D; ++c) acc[c] = 0.f;
      for (int j = 0; j < nk; ++j) {
        const float w = __builtin_expf(s[j] - m);
        den += w;
        const vf wv = vbc(w);
        for (int c = 0; c < D; c += W) vstore(acc + c, vfma(wv, vload(V[j] + c), vload(acc + c)));
      }
      for (int k = 0; k < a.np; ++k) {
        if (pl[k] == -__builtin_inff()) continue;
        const WindowPart& P = a.parts[k];
        const float w = __builtin_expf(pl[k] - m);
        den += w;
        win_row(P.o, h * P.so_h + i * P.so_i + (t - P.t0) * P.so_t, a.bf16, D, o);
        const vf wv = vbc(w);
        for (int c = 0; c < D; c += W) vstore(acc + c, vfma(wv, vload(o + c), vload(acc + c)));
      }
      const float inv = 1.f / den;
      const int64_t off = t * a.so_t + hq * a.so_h;
      if (a.bf16) {
        uint16_t* r = static_cast<uint16_t*>(a.out) + off;
        const vf iv = vbc(inv);
        for (int c = 0; c < D; c += W) bf16_vstore(r + c, vload(acc + c) * iv);
      } else {
        float* r = static_cast<float*>(a.out) + off;
        for (int c = 0; c < D; ++c) r[c] = acc[c] * inv;
      }
    }
  }
  __builtin_free(buf);
}
