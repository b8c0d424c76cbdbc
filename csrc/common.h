// vllm-temporalkv CPU kernels: plain-old-data arguments shared by the torch binding (ops.cpp) and
// the per-ISA translation units (isa_*.cpp).  No torch headers here: the ISA units are compiled
// with different target flags and must not instantiate shared inline/template code (an inline
// function compiled with AVX-512 in one unit could be picked by the linker for all of them).
#pragma once
#include <cstdint>

namespace tkv {

constexpr int BLOCK = 8;   // tokens per encoded block (formats.BLOCK_TOKENS)
constexpr int SINKS = 8;   // exact sink tokens (formats.SINK_TOKENS)
constexpr int TAIL0 = 8;   // first tail slot of the region (layout.TAIL_SLOT0)
constexpr int TILE = 32;   // tokens per prefill key tile (multiple of BLOCK; prefill_impl.h's bf16 dot reads 32)
// tokens per decode tile (multiple of BLOCK, of 2 * the widest vector): 64 decoded ~8-15% faster than 32 on an AMX
// Xeon (fewer per-tile softmax and rescale passes per decoded token; SmolLM2 and Llama-8B shapes, batch 8)
constexpr int DTILE = 64;
constexpr int MAX_D = 256;
constexpr int QJL_OUTLIERS = 8;  // QJL: outlier channels per block of 8 keys (methods.QJL_OUTLIERS)
// 2^f on [0, 1) for the softmaxes in powers of 2 (kernels_impl.h vexp2, amx_attention.h exp2_16): a degree-5 fit,
// highest power first (Horner), relative error 8e-8
constexpr float EXP2_FRAC[6] = {1.8762329e-3f, 8.9925844e-3f, 5.5823606e-2f, 2.4015453e-1f, 6.9315296e-1f, 0.99999994f};
constexpr int PF_ROWS = 32;  // prefill: query rows (position x head of a GQA group) sharing each K/V tile read

// the code paths, chosen in Python from the code layout's geometry (layout.CodeLayout.kernel_variant):
// a vector along tokens, a vector along channels, one value with a codebook per channel; and (no codebook)
// one integer per value times its token's fp16 scale (the selective formats: (code - qoff) * scale)
// and TaDA's: the token's head mean minus (code * scale + min), a scale and a min per group of channels;
// AFFINE: code * scale + min with a scale and a min per group of channels (QJL's values); QJL: keys as sign sketches
// of the post-RoPE key (seed 002), scored without reconstructing them (K only: chunk = m, kc = m_o, cent = S^T)
enum Method : int { TEMPORAL = 0, CHANNEL = 1, SCALAR = 2, SCALED = 3, TADA = 4, AFFINE = 5, QJL = 6 };

// One (layer, K-or-V) quantizer and where its bytes sit inside a (page, head) record.
struct Codec {
  int method;   // Method
  int chunk;    // floats per vector (1 for scalar)
  int bits;     // bits per packed code: 8 for the vector methods, 4/2/1 for scalar
  int kc;       // centroids per codebook
  int code_bytes;        // bytes of codes per block of 8 tokens
  int64_t codes_off;     // byte offset of this kind's codes in the record
  int64_t idx_off;       // outlier positions (int16), if cap > 0
  int64_t val_off;       // outlier values (model half dtype)
  const float* cent;     // [H, G, KC, v] float32 (QJL: S^T [D][m], the sketch's column c contiguous)
  const float* centT;    // [H, G, v, KC] float32 (encode)
  const uint16_t* centT16; // centT in float16 bits where half_exact (vector methods; else null): the encode reads it
                           // (half the bytes of its largest table, cold in a served layer step), the same values
  const float* csq;      // [H, G, KC] float32: each centroid's squared norm (encode's screen, kernels_impl.h)
  const float* cmax;     // [H, G]: the largest of each codebook's csq (NaN if any is)
  const uint16_t* cent16; // [H, G, KC, v] float16 bits (decode attention: half the cache footprint)
  const float* centK;     // scalar method: [H, KC, D] (the codebook value k of every channel side by side)
  const float* mean;     // [H, D]
  const float* std;
  const float* inv_std;
  const float* lo;
  const float* hi;
  int64_t scales_off;    // SCALED / TADA: the fp16 parameters of each token, [blocks][8][P] from here
  int qoff;              // SCALED: the unsigned code of 0 (qmax + 1)
  int64_t mean_off;      // TADA: each head's share of the per-token head mean, [blocks][8][mean_c] from here
  int mean_c;            // TADA: channels of the mean per head's record (head h keeps h*mean_c ..)
  int group;             // TADA, AFFINE: channels per scale / min group (P = 2 * D / group: the scales, then the mins)
  float smax;            // QJL (encode): the largest norm of a row of S (encode_blocks; the sign screen's bound)
  int half_exact;        // cent16 holds the centroids exactly (fp16 ones: artifacts'): the gather reads it (half the
                         // bytes; its codebooks are cold in a served layer step), bit-identical to cent
  const float* qlut = nullptr;  // QJL (gather, where it pays): [m / 4][16][D], every signed sum of 4 rows of S
                                // (ops.cpp qjl_table; qjl_surrogate_rows)
};

struct Layout {
  int H, D, block_size, cap;
  int64_t rec_bytes;  // bytes per (page, head) record
  int bf16;           // half dtype of the stored sinks/tail/outliers: 1 bfloat16, 0 float16
  int round;          // the model dtype decoded K/V are rounded to: 1 bfloat16, 0 float16, 2 float32
  int window;         // recent window: the last `window` tokens (and the incomplete block) exact, in the ring
  int ring;           // ring slots, window + BLOCK: token p (>= SINKS) waits in slot TAIL0 + p % ring of its page
};

// First position that is not encoded once a sequence holds n tokens (layout.exact_from): the sinks are never
// encoded, blocks leave the ring when `window` newer tokens exist
inline int64_t exact_from(int64_t n, int window) {
  const int64_t e = n - window < SINKS ? SINKS : (n - window) / BLOCK * BLOCK;
  return e > SINKS ? e : SINKS;
}

struct DecodeArgs {
  Layout lay;
  Codec k, v;
  const uint8_t* pages;
  int R, Hq, g, S;
  const float* q;      // [R, Hq, D] float32
  const float* knew;   // [R, H, D] float32 (already rounded to the model dtype)
  const float* vnew;
  const int32_t* seq_lens;  // [R]
  const int32_t* bt;        // [R, bt_stride]
  int64_t bt_stride;
  const int32_t* xp = nullptr;  // small pages: [R, 2] (sink page, ring page) per request; else the code pages' region
  const float* cosT;   // [D/2, P]: Rope.cos_sin of positions 0..P-1, transposed (exact per-position RoPE)
  const float* sinT;
  int64_t P;
  // exact = 0 (faster): keys rotated as R(tile start) R(offset) with the query rotated back by the
  // tile start (cos/sin of offsets 0..DTILE-1 transposed [D/2, DTILE], rotation without the RoPE
  // scale), decoded K/V not rounded to the model dtype
  int exact;
  const float* tcos;   // [P/DTILE, D/2]: cos/sin of positions i * DTILE (Rope.cos_sin, scaled)
  const float* tsin;
  const float* dcos;
  const float* dsin;
  const float* rcs = nullptr;  // dcos then dsin as rows [2][DTILE][D/2] (decode_attention: once per call, not item)
  float inv_rope_scale;
  float scale;         // softmax scale
  int tiles_per_split;
  float* part;         // [R, H, S, g, 4 + 2D]
  float* out;          // [R, Hq, D] float32
  uint16_t* out16 = nullptr;  // else: out's rows rounded into these [R, Hq, D] half values (out then scratch)
  int out_bf16 = 1;           // out16's dtype: 1 bfloat16, 0 float16
};

struct GatherArgs {
  Layout lay;
  Codec k, v;
  const uint8_t* pages;
  const int32_t* bt;   // one block table row
  const float* cos;    // [P, D/2] (Rope.cos_sin; channels c and c + D/2 share them)
  const float* sin;
  void* kout;          // [n, H, D] in the model dtype: half bits, or float32 (round == 2)
  void* vout;
};

struct EncodeArgs {
  Layout lay;
  Codec k, v;
  uint8_t* pages;
  const uint16_t* kh;  // [N, H, D] model dtype bits, token i's H x D values at kh + i * krow (rows may be strided:
  const uint16_t* vh;  // a fused qkv projection's split, read in place)
  int64_t krow, vrow;
  const int64_t* pos;  // [N]
  const int64_t* pid;  // [N]
  // [E][5] the blocks to encode: first position, page, ring page (where rows not in this call's input wait: slot
  // ring0 + p % ring), input row of the first position (if it were in the input), first position in the input
  const int64_t* blocks;
  int64_t nitems = 0;  // blocks x H (encode_item's items)
  int small = 0;       // small pages: ring slots from 0 (the exact pages'); else from TAIL0
  const float* cos;    // [P, D/2]
  const float* sin;
  float s2;            // rope scale ** 2
};

// First key a query at position p reads exactly (the rest before it decoded): its own block's start, `window` tokens
// earlier with a recent window (paged_torch._window_start; block 0, the sinks, exact either way)
inline int64_t exact_start(int64_t p, int window) {
  if (p < SINKS || p - window < 0) return 0;
  return (p - window) / BLOCK * BLOCK;
}

// A prefill chunk's attention over its context (ops.cpu.prefill_attention): query i (position offset + i)
// sees keys 0 .. its own position, those before exact_start (its own block, or its recent window) decoded, the
// rest exact.  Keys of one KV head in tiles of TILE tokens, K tile-major (a tile's [D][TILE] contiguous).
struct PrefillArgs {
  int Tq, Hq, g, D;
  int64_t offset;      // position of query 0
  int window;          // recent window: a query at p reads exactly from exact_start(p, window) on
  float scale;
  const float* q;      // [Tq, Hq, D]
  const float* kdT;    // [H, nd / TILE, D, TILE]: decoded keys of positions 0 .. nd - 1 (zero past the context)
  const float* vd;     // [H, nd, D]
  int64_t nd;          // a multiple of TILE, >= every query's own-block start
  const float* kxT;    // [H, nx / TILE, D, TILE]: exact keys of positions x0 .. x0 + nx - 1
  const float* vx;     // [H, nx, D]
  int64_t x0, nx;      // multiples of TILE; x0 <= the first query's own-block start, x0 + nx > the last query
  float* out;          // [Tq, Hq, D]
  // bf16 scores (a bf16 model, where q and K hold bf16 values: AVX512_BF16 dot products, exact products summed
  // in float32): q16 [Tq, Hq, D] and the keys [H, n / TILE, D / 2, TILE, 2] as bf16 bits; q, kdT, kxT unused
  const uint16_t* q16 = nullptr;
  const uint16_t* kdT16 = nullptr;
  const uint16_t* kxT16 = nullptr;
  // and bf16 values (with q16, where V holds bf16 values): each token pair's values channel by channel, [H, n / 2,
  // D, 2] (positions 2j and 2j + 1 of the array), summed with the weights rounded to bf16 as VDPBF16PS products;
  // vd, vx unused
  const uint16_t* vd16 = nullptr;
  const uint16_t* vx16 = nullptr;
};

// Each query's 8 positions p - window - 7 .. p - window (decoded before exact_start(p, window), exact from it)
// merged with attention parts computed elsewhere - torch's flash kernel over the decoded keys before them and, with
// a recent window, over the exact keys after them (ops/cpu_flash.py) - by log-sum-exp.  Elements (q, keys, values, parts' outputs, out): float32, or bf16 bits with bf16 = 1.  Strides in
// elements; every row's D values contiguous.
struct WindowPart {
  const void* o;                 // [H, g, Tq - t0, D]: the part's output for query t0 + t, head h * g + i
  int64_t so_h, so_i, so_t;
  const float* lse;              // [H, g, Tq - t0]: its log-sum-exp (-inf: the query saw nothing there)
  int64_t sl_h, sl_i, sl_t;
  int64_t t0;                    // first query the part covers
};
struct WinRows {                 // [n, heads, D]: row (n, h) at p + n * st + h * sh
  const void* p;
  int64_t st, sh;
};
struct WindowArgs {
  int Tq, H, g, D, bf16, np;
  int window;                    // recent window (0: none); the 8 positions end window before the query
  int64_t offset, x0;            // position of query 0; of kx's row 0
  float scale;
  WinRows q;                     // [Tq, Hq, D]
  WinRows kd, vd;                // [>= own block of the last query, H, D]: decoded, from position 0
  WinRows kx, vx;                // [., H, D]: exact, from position x0 (<= the first query's own block)
  void* out;                     // [Tq, Hq, D]
  int64_t so_t, so_h;
  const WindowPart* parts;
};
constexpr int WIN_ROWS = 32;     // queries per window_item

// The entry points every ISA unit defines (namespace tkv::<isa>).
struct Kernels {
  const char* name;
  void (*decode_item)(const DecodeArgs&, int64_t item);
  void (*decode_merge)(const DecodeArgs&, int64_t rh);
  void (*gather_block)(const GatherArgs&, int64_t item);  // item = (block - 1) * H + h
  void (*encode_item)(const EncodeArgs&, int64_t item);   // item = block * H + h
  void (*nearest_rows)(const float* vecs, const float* centT, int64_t* out, int64_t n, int K, int v);
  void (*prefill_item)(const PrefillArgs&, int64_t item);  // item = h * groups + group of PF_ROWS rows
  void (*window_item)(const WindowArgs&, int64_t item);    // item = h * chunks + chunk of WIN_ROWS queries
};

// A short prefill chunk's attention on AMX tiles (amx_attention.h, compiled in isa_amx.cpp): its arguments, and
// head h's part (every query, the head's g query heads); callers check amx_ready() in ops.cpp first.
namespace amx {
struct ChunkArgs {
  int Tq, H, g, D;                    // queries, KV heads, query heads per KV head, head dim (a multiple of 32)
  int64_t offset;                     // position of query 0
  int64_t nd;                         // decoded rows used: [0, own block of the last query)
  int64_t x0, nx;                     // exact rows: positions x0 .. x0 + nx - 1 (x0: own block of query 0)
  float scale;
  const uint16_t* q;                  // bf16 bits, q[u * sq_t + hq * sq_h + d]
  int64_t sq_t, sq_h;
  const uint16_t *kd, *vd;            // decoded, [., H, D] rows: kd[t * sd_t + h * sd_h + d]
  int64_t sd_t, sd_h;
  const uint16_t *kx, *vx;            // exact, rows from position x0
  int64_t sx_t, sx_h;
  uint16_t* out;                      // [Tq, Hq, D] bf16: out[u * so_t + hq * so_h + d]
  int64_t so_t, so_h;
  int64_t window = 0;                 // a recent window: exact from `window` tokens before the own block (long chunks)
};
// the long-chunk kernel's packed operands per KV head (amx_attention.h long_offsets): rows and keys padded to 32
struct LongShape {
  int64_t Rp, nd32, nx32;
  int D;
  int64_t words_per_head() const { return Rp * D / 2 + (nd32 + nx32) * D; }
};
// amx_attention.h's entries: `tiles` on AMX-BF16 tiles (isa_amx.cpp), `emulated` the same code with each tile
// instruction done in AVX512-BF16 (isa_amx_emu.cpp, amx_emulate.h: the kernels' tests on CPUs without tiles)
struct TileKernels {
  void (*chunk_head)(const ChunkArgs& a, int h);  // a short chunk, KV head h
  void (*long_pack)(const ChunkArgs& a, const LongShape& s, int h, uint32_t* buf);
  void (*long_panel)(const ChunkArgs& a, const LongShape& s, int h, int64_t panel, const uint32_t* buf);
};
extern const TileKernels tiles, emulated;
constexpr int LONG_PANEL_ROWS = 256;  // amx_attention.h LONG_ROWS
}  // namespace amx

// Whether the AVX-512 decode reads channel codes with vpgather (crow32): fast where the CPU is not slowed by the
// Gather Data Sampling mitigation (ops.cpp gathers_fast), else the scalar loads of crow16
extern bool g_gathers;

namespace avx512 { extern const Kernels kernels; }
namespace avx2 { extern const Kernels kernels; }
namespace scalar { extern const Kernels kernels; }

}  // namespace tkv
