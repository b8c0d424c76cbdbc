// The CUDA decode kernel's data maps: which lane holds which (token, channel), and where every gather lands in
// shared memory.  Pure integer functions, compiled for the device (decode.cu) and for the host (the test that
// checks vllm_temporalkv/ops/cuda_emulator.py uses the same maps: tests/test_cuda_kernel.py builds this header
// with the host compiler and compares every value).
//
// Notation (see benchmarks/gpu/NOTES.md, "The CUDA decode kernel"): a warp handles 32-token tiles; lane = 4 n + j
// (n = lane / 4, j = lane % 4, the mma.sync "groupID" and "threadID_in_group").  Scores are computed transposed,
// S^T = K Q^T (mma.m16n8k16: A = K, rows = tokens, k = channels; B = Q^T, 8 query-head columns), then
// O^T = V^T P^T (A = V^T, rows = channels, k = tokens; B = P^T from S^T's accumulators by movmatrix).
#pragma once

#if defined(__CUDACC__)
#define TKV_HD __host__ __device__ __forceinline__
#else
#define TKV_HD inline
#endif

namespace tkvc {

constexpr int TILE = 32;    // tokens per tile (4 blocks)
constexpr int BLOCK = 8;    // tokens per encoded block (methods.BLOCK_TOKENS)
constexpr int SINKS = 8;    // exact sink tokens (methods.SINK_TOKENS)
constexpr int TAIL0 = 8;    // first tail slot of a page's region (layout.TAIL_SLOT0)
constexpr int GQP = 8;      // query heads per KV head served by one mma column block (GQ <= 8)
constexpr int SLICE = 64;   // channels one warp decodes: 32 rotary pairs of K, 64 channels of V
enum Method : int { TEMPORAL = 0, CHANNEL = 1, SCALAR = 2 };  // CodeLayout.kernel_variant

// ---- K (A operand of S^T = K Q^T) --------------------------------------------------------------------------

// Token (0..31 in the tile) of row rho (0..15) of S^T's m-tile mt (0..1).  Lane row n holds rows n and n + 8 of
// both m-tiles: tokens 4n .. 4n + 3, one temporal code of 4 tokens (l = 4), half of one of 8, two of 2.
TKV_HD int row_token(int mt, int rho) { return 4 * (rho & 7) + 2 * mt + (rho >> 3); }

// Channel of option o (0..3) of k-chunk kc (0..3) for lane column j, warp slice u (0 or 1 at D = 128).  The
// k-index 2j + e + 8 hi of a chunk holds option o = e + 2 hi: e picks one of two low channels 4 apart (two
// different codebook groups), hi its rotary partner c + D/2, so a lane rotates keys without shuffles.  Over its
// 4 chunks a lane's options cover 4 consecutive channels: one channel code of l = 4.
TKV_HD int k_channel(int u, int kc, int j, int o, int HD) {
  return 32 * u + 8 * j + 4 * (o & 1) + kc + (o >> 1) * HD;
}
// The option lane row n gathers at step s: the 4 lanes of a half-warp that share j (n = 0..3 or 4..7) take
// 4 different options, i.e. 4 different codebook groups, at every step.
TKV_HD int k_option(int s, int n) { return (s + n) & 3; }
TKV_HD int k_slot(int o, int n) { return (o - n) & 3; }  // inverse: the step (register slot) holding option o

// PRMT selector that takes, from the 8 halves' bytes of (lo = slots 0, 1; hi = slots 2, 3), the halves of
// options oa and ob (un-skewing lane row n's slots into mma fragment order)
TKV_HD unsigned unskew_selector(int oa, int ob, int n) {
  const unsigned ha = k_slot(oa, n), hb = k_slot(ob, n);
  return (2 * ha) | ((2 * ha + 1) << 4) | ((2 * hb) << 8) | ((2 * hb + 1) << 12);
}

// ---- V (A operand of O^T = V^T P^T) ------------------------------------------------------------------------

// V^T m-tile ct (0..3 of a warp's 64-channel slice): rows n (rh = 0) and n + 8 (rh = 1).  Option o = 2 (ct & 1)
// + rh of V pair cp = ct >> 1 (two m-tiles) is the channel below; the 16 lanes that share a wavefront of a
// gather of l-token codes (8 bytes per lane: n = 0..3 or 4..7 for l = 4; 4 bytes: all n for l = 2; 16 bytes:
// n pairs for l = 8) take 16 (32, 8) different codebook groups when their options differ, which the skew
// v_option makes them do.  vl: the temporal chunk (other V methods use the l = 4 map).
TKV_HD int v_channel(int uv, int cp, int o, int n, int vl) {
  const int nr = 16 / vl;
  return SLICE * uv + vl * (4 * (n % nr) + o) + n / nr + cp * (8 / nr);
}
TKV_HD int v_option(int s, int j, int skew) { return skew ? (s ^ j) : s; }
// Lane column j's tokens: block j of the tile (8 j .. 8 j + 7); k-index kk of k-chunk mt is S^T row kk of m-tile mt.
TKV_HD int v_token(int mt, int kk) { return row_token(mt, kk); }

// ---- shared-memory codebooks ---------------------------------------------------------------------------------

// Vector codebooks (temporal / channel): entry (group g, code) of 2 l bytes at entry index code * G + swz(g, G).
// A half-warp's 8-byte gathers then hit 16 different bank pairs whenever its lanes read 16 different groups
// whose swizzled index differs mod 16: the low and high halves of a warp slice (g < G/2, g >= G/2) are moved
// G/4 apart (XOR), so a channel and its rotary partner never share a bank pair.
TKV_HD int swz(int g, int G) { return (G >= 4 && g >= G / 2) ? (g ^ (G / 4)) : g; }
TKV_HD int entry_index(int g, int code, int G) { return code * G + swz(g, G); }

// Bytes of codes per block of 8 tokens and one KV head (CodeLayout.block_bytes): temporal / channel l: 8 D / l,
// scalar b bits: D b.
TKV_HD int code_bytes(int method, int l_or_bits, int D) { return method == SCALAR ? D * l_or_bits : 8 * D / l_or_bits; }

}  // namespace tkvc
