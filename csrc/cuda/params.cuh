// Kernel arguments, one plain struct per kernel passed by value (__grid_constant__).  Mirrored field by field by
// vllm_temporalkv/ops/cuda.py (ctypes.Structure): 8-byte fields first, then 4-byte ones, so both sides lay it out
// without padding questions.  Keep the two in the same order.
#pragma once
#include <stdint.h>

namespace tkvc {

struct DecodeParams {
  const uint8_t* pages;         // [num_pages][H][rec_bytes]
  const int32_t* seq_lens;      // [R]: cached + new tokens; the query sits at seq_len - 1
  const int32_t* block_tables;  // [R][bt_stride]
  const uint16_t* q;            // [R][H * GQ][D] in the model's half dtype
  const uint16_t* kcb;          // K codebooks, fp16: [H][G][KC][l] (vector) or [H][D][KC] (scalar)
  const uint16_t* vcb;
  const float* kmean;           // [H][D] channel statistics (float32)
  const float* kstd;
  const float* vmean;
  const float* vinv;            // 1 / std of V
  const float* dt_cos;          // [TILE][D/2]: Rope.cos_sin of offsets 0..31 (RoPE attention scale included)
  const float* dt_sin;
  const uint32_t* base_cs;      // [n_base][D/4][2] fp16x2: tile start 32 t: (cos c, cos c+4), (sin c, sin c+4), c = 8 (e/4) + e%4
  const float* base_cos;        // [n_base][D/2] float32 cos / sin of tile starts (outliers only), scale divided out
  const float* base_sin;
  float* part_acc;              // [R][H][S][GQP][D]: sum of p * z over the split (V normalized)
  float* part_ml;               // [R][H][S][GQP][2]: (running max in log2 units, sum of p)
  int64_t rec_bytes;            // bytes of one (page, KV head) record
  int64_t bt_stride;
  int64_t k_codes, v_codes, k_idx, k_val, v_idx, v_val;  // offsets inside a record
  int32_t H, GQ, block_size, S, tiles_per_split, cap, n_base, units;
  float qk_scale;               // softmax scale * log2(e)
  int32_t off_stage, stage_bytes, off_xchg, off_pbuf, off_corr, off_q, off_merge, smem_bytes;
};

struct MergeParams {
  const uint8_t* pages;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  const uint16_t* q;            // [R][H * GQ][D]
  const uint16_t* knew;         // [R][H][D] the step's own key (post-RoPE) and value, model dtype
  const uint16_t* vnew;
  const float* vmean;           // [H][D]
  const float* vstd;
  const float* part_acc;
  const float* part_ml;
  uint16_t* out;                // [R][H * GQ][D]
  int64_t rec_bytes;
  int64_t bt_stride;
  int32_t H, GQ, block_size, S;
  float qk_scale;
  int32_t pad;
};

}  // namespace tkvc
