// Torch bindings of the CPU kernels (module vllm_temporalkv._C_cpu).  Argument checks, the
// run-time ISA choice, and the parallel loops (torch's own thread pool, dynamically scheduled);
// the arithmetic lives in kernels_impl.h, compiled once per ISA (isa_*.cpp).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "common.h"

namespace tkv {
namespace {

bool cpu_has(const std::string& isa) {
#ifdef TKV_X86
  __builtin_cpu_init();
  if (isa == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                              __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                            __builtin_cpu_supports("f16c");
#endif
  return isa == "scalar";
}

const Kernels* by_name(const std::string& isa) {
#ifdef TKV_X86
  if (isa == "avx512") return &avx512::kernels;
  if (isa == "avx2") return &avx2::kernels;
#endif
  if (isa == "scalar") return &scalar::kernels;
  return nullptr;
}

const Kernels* best() {
  for (const char* n : {"avx512", "avx2", "scalar"})
    if (cpu_has(n)) return by_name(n);
  return &scalar::kernels;
}

// VLLM_TEMPORALKV_CPU_ISA=avx512|avx2|scalar forces a variant (if the CPU has it)
const Kernels* initial() {
  const char* env = std::getenv("VLLM_TEMPORALKV_CPU_ISA");
  if (env && *env && by_name(env) && cpu_has(env)) return by_name(env);
  return best();
}

const Kernels* g_kernels = initial();

// Gathers at full speed: Linux says the CPU is not affected by Gather Data Sampling (its microcode mitigation makes
// every vpgather several times slower), or the CPU has AVX-512 FP16 (Sapphire Rapids on: never affected).
// VLLM_TEMPORALKV_CPU_GATHERS=0|1 overrides.
bool gathers_fast() {
  const char* env = std::getenv("VLLM_TEMPORALKV_CPU_GATHERS");
  if (env && *env) return env[0] == '1';
#ifdef TKV_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512fp16")) return true;
#endif
  std::ifstream f("/sys/devices/system/cpu/vulnerabilities/gather_data_sampling");
  std::string line;
  return f && std::getline(f, line) && line.rfind("Not affected", 0) == 0;
}

}  // namespace
bool g_gathers = gathers_fast();
namespace {

template <class F>
void parallel_items(int64_t n, const F& f) {
  if (n <= 0) return;
  const int nt = at::get_num_threads();
  if (nt <= 1 || n == 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      int64_t i;
      while ((i = next.fetch_add(1, std::memory_order_relaxed)) < n) f(i);
    }
  });
}

// The kernels' (block, KV head) items - item = block * H + h - in one contiguous range of head-major order per
// thread: a KV head's codebook tables (the encode's: 160 KB per head at 2 bits, SmolLM2's shape) are then fetched by
// one core, not by every core.  In a served step they come from DRAM (the model's weights have streamed through the
// caches since the layer's last step): a prefix-cache hit's 40-token chunk spent ~half its cache update on that.
// head(h) runs where a thread starts on KV head h (prefetch_head).
template <class F, class S>
void parallel_heads(int64_t blocks, int64_t H, const F& f, const S& head) {
  const int64_t n = blocks * H;
  if (n <= 0) return;
  const auto run = [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      if (j == b || j % blocks == 0) head(j / blocks);
      f((j % blocks) * H + j / blocks);
    }
  };
  const int nt = at::get_num_threads();
  if (nt <= 1 || n == 1 || at::in_parallel_region()) {
    run(0, n);
    return;
  }
  at::parallel_for(0, n, (n + nt - 1) / nt, run);
}

// One KV head's codebook tables of a codec into this core's L2 (software prefetch): what the encode searches (the
// transposed centroids, float16 where exact, and their squared norms) or what a decode looks codes up in (the
// centroids, float16 where exact).  A served layer step finds them in DRAM - the model's weights have streamed
// through the caches since the layer's last step - and a decode's lookups are random (each code picks its centroid:
// no hardware prefetcher follows them), the encode's search a few short streams per channel group.  A prefix-cache
// hit's 40-token chunk on the AMX Xeon (write_gather, in-process, two runs each): 6.3 / 6.5 -> 5.9 / 6.1 ms per
// request of 30 layers.  (The fused decode, prefetching at each item: no change at batch 1, 600 tokens.)
void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

void prefetch_head(const Codec& cd, int64_t D, int64_t h, bool encode) {
  if (cd.method != TEMPORAL && cd.method != CHANNEL) return;  // (the scalar method's tables are small)
  const int64_t G = D / cd.chunk, n = G * cd.kc * cd.chunk;  // centroid floats per head
  if (encode) {
    if (cd.centT16)
      prefetch_range(cd.centT16 + h * n, n * 2);
    else
      prefetch_range(cd.centT + h * n, n * 4);
    prefetch_range(cd.csq + h * G * cd.kc, G * cd.kc * 4);
  } else if (cd.half_exact) {
    prefetch_range(cd.cent16 + h * n, n * 2);
  } else {
    prefetch_range(cd.cent + h * n, n * 4);
  }
}

void check_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be a contiguous float32 CPU tensor");
}

Layout make_layout(const std::vector<int64_t>& li) {
  TORCH_CHECK(li.size() == 8, "layout: [H, D, block_size, cap, rec_bytes, bf16, round, window]");
  Layout L;
  L.H = (int)li[0];
  L.D = (int)li[1];
  L.block_size = (int)li[2];
  L.cap = (int)li[3];
  L.rec_bytes = li[4];
  L.bf16 = (int)li[5];
  L.round = (int)li[6];
  L.window = (int)li[7];
  L.ring = L.window + BLOCK;
  TORCH_CHECK(L.bf16 == 0 || L.bf16 == 1, "bad stored half dtype");
  TORCH_CHECK(L.round >= 0 && L.round <= 2, "bad model dtype");
  TORCH_CHECK(L.D % 32 == 0 && L.D <= MAX_D, "head_dim must be a multiple of 32 and <= ", MAX_D);
  TORCH_CHECK(L.block_size % BLOCK == 0 && L.block_size >= 2 * BLOCK, "bad block size");
  TORCH_CHECK(L.cap <= 4 * L.D, "bad outlier cap");
  TORCH_CHECK(L.window >= 0 && L.window % BLOCK == 0 && L.window + BLOCK <= L.block_size, "bad recent window");
  return L;
}

Codec make_codec(const std::vector<at::Tensor>& ct, const std::vector<int64_t>& ci, const Layout& L) {
  TORCH_CHECK(ct.size() == 12,
              "codec tensors: [cent, centT, mean, std, inv_std, lo, hi, cent16, centK, csq, cmax, centT16]");
  TORCH_CHECK(ci.size() == 14, "codec ints: [method, chunk, bits, kc, code_bytes, codes_off, idx_off, val_off, "
                                "scales_off, qoff, mean_off, mean_c, group, half_exact]");
  for (int i = 0; i < 7; ++i) check_f32(ct[i], "codec tensor");
  TORCH_CHECK(ct[7].scalar_type() == at::kHalf && ct[7].is_contiguous() &&
                  ct[7].numel() == (ci[0] == QJL ? 0 : ct[0].numel()),
              "cent16: the centroids in float16");
  Codec c;
  c.method = (int)ci[0];
  c.chunk = (int)ci[1];
  c.bits = (int)ci[2];
  c.kc = (int)ci[3];
  c.code_bytes = (int)ci[4];
  c.codes_off = ci[5];
  c.idx_off = ci[6];
  c.val_off = ci[7];
  c.scales_off = ci[8];
  c.qoff = (int)ci[9];
  c.mean_off = ci[10];
  c.mean_c = (int)ci[11];
  c.group = (int)ci[12];
  c.half_exact = (int)ci[13];
  c.smax = 0.f;  // (encode_args: QJL's keys)
  const int64_t D = L.D, H = L.H;
  TORCH_CHECK(c.method >= 0 && c.method <= QJL, "bad method");
  if (c.method == SCALED) {  // no codebook: the centroid tensors are empty, mean 0 and std 1 (values are raw)
    TORCH_CHECK((c.bits == 8 || c.bits == 4) && c.kc == (1 << c.bits) && c.chunk == 1 && c.qoff > 0 &&
                    c.qoff < c.kc, "scaled codec: 8 or 4 bits, 2**bits levels, 0 < qoff < 2**bits");
    TORCH_CHECK(c.code_bytes == BLOCK * D * c.bits / 8, "bad code_bytes");
    TORCH_CHECK(c.scales_off >= 0 && c.scales_off + (L.block_size / BLOCK) * BLOCK * 2 <= L.rec_bytes,
                "scales past the record");
    TORCH_CHECK(L.cap == 0, "scaled codes keep no outliers");
  } else if (c.method == TADA || c.method == AFFINE) {  // no codebook either: a scale and a min per group of
    // channels; TaDA's values are deviations from the head mean, split across the heads' records
    TORCH_CHECK((c.bits == 8 || c.bits == 4 || c.bits == 2) && c.kc == (1 << c.bits) && c.chunk == 1,
                "TaDA / affine codec: 8, 4 or 2 bits");
    TORCH_CHECK(c.code_bytes == BLOCK * D * c.bits / 8, "bad code_bytes");
    TORCH_CHECK(c.group > 0 && D % c.group == 0 && c.group % 32 == 0,
                "TaDA / affine group: a multiple of 32 dividing D");
    const int64_t nb = L.block_size / BLOCK;
    TORCH_CHECK(c.scales_off >= 0 && c.scales_off + nb * BLOCK * 2 * (D / c.group) * 2 <= L.rec_bytes,
                "TaDA / affine scales past the record");
    if (c.method == TADA)
      TORCH_CHECK(c.mean_c > 0 && c.mean_c * H >= D && c.mean_off >= 0 &&
                      c.mean_off + nb * BLOCK * c.mean_c * 2 <= L.rec_bytes,
                  "TaDA head mean: the heads' shares must cover head_dim, within the record");
    TORCH_CHECK(L.cap == 0, "TaDA / affine codes keep no outliers");
  } else if (c.method == QJL) {  // sign sketches: m bits of S k_in, m_o of S_o k_out, 2 norms per token, 8 channels
    TORCH_CHECK(c.chunk > 0 && c.chunk % 32 == 0 && c.kc > 0 && c.kc % 32 == 0 && c.kc <= c.chunk && c.bits == 1,
                "QJL codec: sketch sizes m >= m_o, multiples of 32");
    TORCH_CHECK(c.code_bytes == BLOCK * (c.chunk / 8 + c.kc / 8 + 4) + QJL_OUTLIERS, "bad QJL code_bytes");
    TORCH_CHECK(ct[0].numel() == D * c.chunk, "QJL: S^T [D, m]");
    TORCH_CHECK(L.cap == 0, "QJL keys keep no codebook outliers");
  } else if (c.method == SCALAR) {
    TORCH_CHECK((c.bits == 1 || c.bits == 2 || c.bits == 4) && c.kc == (1 << c.bits) && c.chunk == 1,
                "scalar codec: bits 1/2/4 and 2**bits centroids");
    TORCH_CHECK(c.code_bytes == BLOCK * D * c.bits / 8, "bad code_bytes");
  } else {
    TORCH_CHECK((c.chunk == 2 || c.chunk == 4 || c.chunk == 8) && c.bits == 8 && c.kc >= 1 && c.kc <= 256,
                "vector codec: chunk 2/4/8, <= 256 centroids");
    TORCH_CHECK(c.code_bytes == BLOCK * D / c.chunk, "bad code_bytes");
  }
  const int64_t v = c.method == SCALAR ? 1 : c.chunk;
  const int64_t G = D / v;
  const int64_t nc = c.method >= SCALED ? 0 : H * G * c.kc * v;
  TORCH_CHECK((c.method == QJL || ct[0].numel() == nc) && ct[1].numel() == nc, "bad centroid shape");
  for (int i = 2; i < 7; ++i) TORCH_CHECK(ct[i].numel() == H * D, "bad stats shape");
  TORCH_CHECK(c.codes_off + (L.block_size / BLOCK) * c.code_bytes <= L.rec_bytes, "codes past the record");
  if (L.cap > 0)
    TORCH_CHECK(c.idx_off + (L.block_size / BLOCK) * L.cap * 2 <= L.rec_bytes &&
                    c.val_off + (L.block_size / BLOCK) * L.cap * 2 <= L.rec_bytes,
                "outliers past the record");
  c.cent = ct[0].data_ptr<float>();
  c.centT = ct[1].data_ptr<float>();
  c.mean = ct[2].data_ptr<float>();
  c.std = ct[3].data_ptr<float>();
  c.inv_std = ct[4].data_ptr<float>();
  c.lo = ct[5].data_ptr<float>();
  c.hi = ct[6].data_ptr<float>();
  c.cent16 = reinterpret_cast<const uint16_t*>(ct[7].data_ptr());
  check_f32(ct[8], "centK");
  TORCH_CHECK(ct[8].numel() == (c.method == QJL ? 0 : ct[0].numel()),
              "centK: the centroids, [H, KC, D] for the scalar method");
  c.centK = ct[8].data_ptr<float>();
  check_f32(ct[9], "csq");
  TORCH_CHECK(ct[9].numel() == (c.method == TEMPORAL || c.method == CHANNEL ? H * G * c.kc : 0),
              "csq: the centroids' squared norms, [H, G, KC] for the vector methods");
  c.csq = ct[9].data_ptr<float>();
  check_f32(ct[10], "cmax");
  TORCH_CHECK(ct[10].numel() == (c.method == TEMPORAL || c.method == CHANNEL ? H * G : 0),
              "cmax: the largest squared norm of each codebook, [H, G] for the vector methods");
  c.cmax = ct[10].data_ptr<float>();
  TORCH_CHECK(ct[11].scalar_type() == at::kHalf && ct[11].is_contiguous() &&
                  ct[11].numel() == (c.half_exact && (c.method == TEMPORAL || c.method == CHANNEL) ? nc : 0),
              "centT16: centT in float16 where the centroids are fp16-exact (half_exact), for the vector methods");
  c.centT16 = ct[11].numel() ? reinterpret_cast<const uint16_t*>(ct[11].data_ptr()) : nullptr;
  return c;
}

void check_pages(const at::Tensor& pages, const Layout& L) {
  TORCH_CHECK(pages.device().is_cpu() && pages.scalar_type() == at::kByte && pages.is_contiguous() &&
                  pages.dim() == 3 && pages.size(1) == L.H && pages.size(2) == L.rec_bytes,
              "pages must be a contiguous uint8 CPU tensor [num_pages, H, bytes]");
}

void check_table(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt, what, " must be an int32 CPU tensor");
}

}  // namespace

std::string isa() { return g_kernels->name; }

void set_isa(const std::string& name) {
  TORCH_CHECK(by_name(name), "unknown ISA ", name, " (avx512, avx2, scalar)");
  TORCH_CHECK(cpu_has(name), "this CPU does not support ", name);
  g_kernels = by_name(name);
}

bool gathers() { return g_gathers; }
void set_gathers(bool on) { g_gathers = on; }

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const char* n : {"avx512", "avx2", "scalar"})
    if (cpu_has(n)) out.push_back(n);
  return out;
}

// Whether each token's heads x D values of t [N, heads, D] lie one after the other (the tokens' rows may be strided:
// a split of vLLM's QKV projection, read in place)
bool token_rows(const at::Tensor& t) { return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2); }

// Rows of a [n, H, D] CPU tensor - float32, bfloat16 or float16, each row's D values contiguous, other strides free
// (the slices and gathers the backend holds) - read as float32.
struct SrcRows {
  const char* p;
  int64_t st, sh, n;  // strides in bytes; rows
  at::ScalarType dt;
  explicit SrcRows(const at::Tensor& t)
      : p(static_cast<const char*>(t.data_ptr())), st(t.stride(0) * (int64_t)t.element_size()),
        sh(t.stride(1) * (int64_t)t.element_size()), n(t.size(0)), dt(t.scalar_type()) {}
  void row(int64_t i, int64_t h, int D, float* dst) const {
    const char* r = p + i * st + h * sh;
    if (dt == at::kFloat) {
      std::memcpy(dst, r, sizeof(float) * D);
    } else if (dt == at::kBFloat16) {
      const uint16_t* u = reinterpret_cast<const uint16_t*>(r);
      for (int c = 0; c < D; ++c) {
        const uint32_t b = (uint32_t)u[c] << 16;
        std::memcpy(dst + c, &b, sizeof(float));
      }
    } else {
      const at::Half* u = reinterpret_cast<const at::Half*>(r);
      for (int c = 0; c < D; ++c) dst[c] = static_cast<float>(u[c]);
    }
  }
};

// A decode argument [R, X, D] as float32 rows one after the other: its data as it is, or widened / gathered into buf
// (token_rows; float32, bfloat16 or float16): Python's .float().contiguous() per tensor per layer step (or ATen's in
// here) cost ~2 us each of a decode step's ~20 us of glue per layer, SmolLM2 at batch 8 - an allocation and a
// dispatch for ~5k values.
const float* widened(const at::Tensor& t, std::vector<float>& buf, const char* what) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(t.device().is_cpu() && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf), what,
              " must be a float32, bfloat16 or float16 CPU tensor");
  TORCH_CHECK(token_rows(t), what, ": [R, heads, D] with each row's heads x D values contiguous");
  const int64_t R = t.size(0), X = t.size(1), D = t.size(2);
  if (dt == at::kFloat && (R <= 1 || t.stride(0) == X * D)) return t.data_ptr<float>();
  buf.resize(R * X * D);
  const SrcRows rows(t);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < X; ++h) rows.row(r, h, (int)D, buf.data() + (r * X + h) * D);
  return buf.data();
}

// Fused decode attention, one query token per request.  q [R, Hq, D]; knew/vnew [R, H, D] (rounded to the
// model dtype: the model's half values, or a float32 model's rounded to the stored half); q, knew, vnew float32,
// bfloat16 or float16 (widened here); seq_lens [R] int32 (incl. the new token); block_tables [R, P] int32;
// cosT/sinT [D/2, P >= tiles * DTILE] f32 (Rope.cos_sin, transposed); out [R, Hq, D] float32, bfloat16 or
// float16 (the float32 sums rounded once, into out).
void decode_attention(const at::Tensor& pages, const at::Tensor& q, const at::Tensor& knew,
                      const at::Tensor& vnew, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                      const at::Tensor& cosT, const at::Tensor& sinT, const at::Tensor& out,
                      const std::vector<at::Tensor>& kt, const std::vector<int64_t>& ki,
                      const std::vector<at::Tensor>& vt, const std::vector<int64_t>& vi,
                      const std::vector<int64_t>& li, double scale, int64_t tiles_per_split, bool exact,
                      const at::Tensor& tcos, const at::Tensor& tsin, const at::Tensor& dcos,
                      const at::Tensor& dsin, double inv_rope_scale, const at::Tensor& xpages) {
  DecodeArgs a;
  a.lay = make_layout(li);
  a.k = make_codec(kt, ki, a.lay);
  a.v = make_codec(vt, vi, a.lay);
  check_pages(pages, a.lay);
  for (const auto* t : {&cosT, &sinT}) check_f32(*t, "decode argument");
  thread_local std::vector<float> qbuf, kbuf, vbuf, obuf;  // (reused: this thread's calls run one at a time)
  const float* q32 = widened(q, qbuf, "q");
  const float* k32 = widened(knew, kbuf, "key");
  const float* v32 = widened(vnew, vbuf, "value");
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16 ||
                   out.scalar_type() == at::kHalf), "out must be a contiguous float32, bfloat16 or float16 CPU tensor");
  const bool out32 = out.scalar_type() == at::kFloat;
  check_table(seq_lens, "seq_lens");
  check_table(block_tables, "block_tables");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1, "block_tables: [R, P], rows contiguous");
  const int64_t R = q.size(0), Hq = q.size(1), D = a.lay.D, H = a.lay.H;
  TORCH_CHECK(q.dim() == 3 && q.size(2) == D && Hq % H == 0, "q: [R, Hq, D]");
  TORCH_CHECK(knew.sizes() == at::IntArrayRef({R, H, D}) && vnew.sizes() == knew.sizes(), "key/value: [R, H, D]");
  TORCH_CHECK(out.sizes() == q.sizes(), "out: like q");
  TORCH_CHECK(seq_lens.numel() == R && seq_lens.is_contiguous() && block_tables.size(0) == R, "batch sizes differ");
  TORCH_CHECK(cosT.dim() == 2 && cosT.size(0) == D / 2 && sinT.sizes() == cosT.sizes(), "cosT/sinT: [D/2, P]");
  if (R == 0) return;
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(sl[r] >= 1, "seq_lens must be >= 1");
    max_len = std::max<int64_t>(max_len, sl[r]);
  }
  TORCH_CHECK(max_len <= block_tables.size(1) * a.lay.block_size, "seq_lens exceed the block table");
  const int64_t max_tiles = (max_len + DTILE - 1) / DTILE;
  TORCH_CHECK(cosT.size(1) >= max_tiles * DTILE, "cosT/sinT: too few positions");
  const int64_t num_pages = pages.size(0);
  {  // every page the kernel will read must exist
    const int32_t* bt = block_tables.data_ptr<int32_t>();
    for (int64_t r = 0; r < R; ++r) {
      const int64_t np = (sl[r] - 1) / a.lay.block_size + 1;
      for (int64_t i = 0; i < np; ++i) {
        const int32_t pg = bt[r * block_tables.stride(0) + i];
        TORCH_CHECK(pg >= 0 && pg < num_pages, "block table entry out of range: ", pg);
      }
    }
  }
  // split-K at fixed tile boundaries: a request's partial sums, and so its output, do not depend on
  // the other requests of the batch (the longest one only adds splits that shorter ones skip)
  const int64_t tps = std::max<int64_t>(1, tiles_per_split);
  const int64_t S = (max_tiles + tps - 1) / tps;
  a.pages = pages.data_ptr<uint8_t>();
  a.R = (int)R;
  a.Hq = (int)Hq;
  a.g = (int)(Hq / H);
  a.S = (int)S;
  a.q = q32;
  a.knew = k32;
  a.vnew = v32;
  a.seq_lens = sl;
  a.bt = block_tables.data_ptr<int32_t>();
  a.bt_stride = block_tables.stride(0);
  if (xpages.numel()) {  // small pages: each request's (sink page, ring page)
    check_table(xpages, "xpages");
    TORCH_CHECK(xpages.dim() == 2 && xpages.size(0) == R && xpages.size(1) == 2 && xpages.is_contiguous(),
                "xpages: contiguous [R, 2]");
    const int32_t* x = xpages.data_ptr<int32_t>();
    for (int64_t i = 0; i < 2 * R; ++i)
      TORCH_CHECK(x[i] >= 0 && x[i] < num_pages, "exact page out of range: ", x[i]);
    a.xp = x;
  }
  a.cosT = cosT.data_ptr<float>();
  a.sinT = sinT.data_ptr<float>();
  a.P = cosT.size(1);
  a.scale = (float)scale;
  a.exact = exact ? 1 : 0;
  if (!exact) {
    for (const auto* t : {&tcos, &tsin, &dcos, &dsin}) check_f32(*t, "decode argument");
    TORCH_CHECK(dcos.numel() == D / 2 * DTILE && dsin.numel() == D / 2 * DTILE, "dcos/dsin: [D/2, DECODE_TILE]");
    TORCH_CHECK(tcos.dim() == 2 && tcos.size(1) == D / 2 && tsin.sizes() == tcos.sizes() &&
                    tcos.size(0) >= max_tiles, "tcos/tsin: [>= tiles, D/2]");
    a.tcos = tcos.data_ptr<float>();
    a.tsin = tsin.data_ptr<float>();
    a.dcos = dcos.data_ptr<float>();
    a.dsin = dsin.data_ptr<float>();
    a.inv_rope_scale = (float)inv_rope_scale;
  }
  std::vector<float> rcs;
  if (!exact) {  // the row rotation's factors, transposed here once (per decode item, ~2% of a batch-8 call)
    const int64_t HD = D / 2;
    rcs.resize(2 * DTILE * HD);
    for (int64_t t = 0; t < DTILE; ++t)
      for (int64_t c = 0; c < HD; ++c) {
        rcs[t * HD + c] = a.dcos[c * DTILE + t];
        rcs[(DTILE + t) * HD + c] = a.dsin[c * DTILE + t];
      }
    a.rcs = rcs.data();
  }
  a.tiles_per_split = (int)std::min<int64_t>(tps, max_tiles);
  at::Tensor part = at::empty({R * H * S * a.g * (4 + 2 * D)}, out.options().dtype(at::kFloat));
  a.part = part.data_ptr<float>();
  if (!out32) {
    obuf.resize(out.numel());
    a.out16 = reinterpret_cast<uint16_t*>(out.data_ptr());
    a.out_bf16 = out.scalar_type() == at::kBFloat16;
  }
  a.out = out32 ? out.data_ptr<float>() : obuf.data();
  const Kernels* kern = g_kernels;
  if (a.k.method == TADA || a.v.method == TADA) {
    // TaDA's items in (request, split, KV head) order: a split's KV heads one after the other, so the head mean
    // they all read (stored once per token, a share in each head's record) comes from a cache for all but the first:
    // kernels_cpu decode at batch 8 x 8k, SmolLM2's shape, ~3.3 -> ~2.8 ms, Llama-8B's ~15.5 -> ~14.7 ms (AMD EPYC).
    // The partial sums keep their places, so the merge and the outputs do not change.  (The codebook formats lost
    // ~3% in this order at Llama-8B's shape: each item then fetches another head's tables.)
    parallel_items(R * H * S, [&](int64_t i) { kern->decode_item(a, ((i / (S * H) * H) + i % H) * S + i / H % S); });
  } else {
    parallel_items(R * H * S, [&](int64_t i) { kern->decode_item(a, i); });
  }
  parallel_items(R * H, [&](int64_t i) { kern->decode_merge(a, i); });
}

// QJL's table for the surrogate keys of many blocks (qjl_surrogate_rows): T[g][nib][c] = the signed sum of rows 4g ..
// 4g + 3 of S in channel c, row 4g + b taken positive where bit b of nib is set - (+-S[4g] +- S[4g+1]) + (+-S[4g+2]
// +- S[4g+3]) in float32.  A key's m signed rows are then m / 4 table rows added, not m rows multiplied.  S^T [D][m]
// (K.cent) is transposed to rows first; the table is m / 4 x 16 x D floats (1 MB at Llama-8B's first layers' sketch).
void qjl_table(const Codec& K, int64_t D, std::vector<float>& S, std::vector<float>& T) {
  const int64_t m = K.chunk;
  S.resize((size_t)(m * D));
  T.resize((size_t)(m / 4 * 16 * D));
  for (int64_t c = 0; c < D; ++c)
    for (int64_t j = 0; j < m; ++j) S[j * D + c] = K.cent[c * m + j];
  std::vector<float> pair((size_t)(8 * D));  // the 4 signed sums of rows 4g, 4g + 1, then of 4g + 2, 4g + 3
  for (int64_t g = 0; g < m / 4; ++g) {
    for (int h = 0; h < 2; ++h) {
      const float* r0 = S.data() + (4 * g + 2 * h) * D;
      const float* r1 = r0 + D;
      for (int k = 0; k < 4; ++k) {
        float* p = pair.data() + (h * 4 + k) * D;
        for (int64_t c = 0; c < D; ++c) p[c] = ((k & 1) ? r0[c] : -r0[c]) + ((k & 2) ? r1[c] : -r1[c]);
      }
    }
    for (int nib = 0; nib < 16; ++nib) {
      const float* lo = pair.data() + (nib & 3) * D;
      const float* hi = pair.data() + (4 + (nib >> 2)) * D;
      float* t = T.data() + (g * 16 + nib) * D;
      for (int64_t c = 0; c < D; ++c) t[c] = lo[c] + hi[c];
    }
  }
}

// The first n cached tokens of one sequence -> (K post-RoPE, V) [n, H, D] in the model dtype (a
// half dtype, or float32), bit-identical to paged_torch.gather_kv.  cos/sin: [P >= n, D/2] from Rope.cos_sin.
std::vector<at::Tensor> gather(const at::Tensor& pages, const at::Tensor& block_table, int64_t n,
                               const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& kt,
                               const std::vector<int64_t>& ki, const std::vector<at::Tensor>& vt,
                               const std::vector<int64_t>& vi, const std::vector<int64_t>& li, int64_t sink_page,
                               int64_t ring_page) {
  GatherArgs a;
  a.lay = make_layout(li);
  a.k = make_codec(kt, ki, a.lay);
  a.v = make_codec(vt, vi, a.lay);
  check_pages(pages, a.lay);
  check_table(block_table, "block_table");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(block_table.dim() == 1 && block_table.is_contiguous(), "block_table: one contiguous row");
  const int64_t H = a.lay.H, D = a.lay.D, bs = a.lay.block_size;
  TORCH_CHECK(n >= 0 && n <= block_table.numel() * bs, "n exceeds the block table");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D / 2 && cos.size(0) >= n && sin.sizes() == cos.sizes(),
              "cos/sin: [P >= n, D/2]");
  const bool f32 = a.lay.round == 2;
  const auto dt = f32 ? at::kFloat : a.lay.round == 1 ? at::kBFloat16 : at::kHalf;
  TORCH_CHECK(f32 || a.lay.round == a.lay.bf16, "a half model stores its own dtype");
  at::Tensor K = at::empty({n, H, D}, pages.options().dtype(dt));
  at::Tensor V = at::empty({n, H, D}, pages.options().dtype(dt));
  if (n == 0) return {K, V};
  const int32_t* bt = block_table.data_ptr<int32_t>();
  for (int64_t i = 0; i < (n - 1) / bs + 1; ++i)
    TORCH_CHECK(bt[i] >= 0 && bt[i] < pages.size(0), "block table entry out of range: ", bt[i]);
  a.pages = pages.data_ptr<uint8_t>();
  a.bt = bt;
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.kout = K.data_ptr();
  a.vout = V.data_ptr();
  const uint8_t* pg = a.pages;
  auto region = [&](int64_t page, int64_t h, int64_t slot, int kv) {
    return reinterpret_cast<const uint16_t*>(pg + (page * H + h) * a.lay.rec_bytes) + (slot * 2 + kv) * D;
  };
  // an exact (sink or tail) row: the stored half values, upcast for a float32 model
  auto copy_row = [&](at::Tensor& out, int64_t t, int64_t h, const uint16_t* src) {
    const int64_t o = (t * H + h) * D;
    if (!f32) {
      std::memcpy(reinterpret_cast<uint16_t*>(out.data_ptr()) + o, src, D * 2);
      return;
    }
    float* dst = out.data_ptr<float>() + o;
    for (int64_t c = 0; c < D; ++c) {
      if (a.lay.bf16) {
        const uint32_t u = (uint32_t)src[c] << 16;
        std::memcpy(dst + c, &u, 4);
      } else {
        dst[c] = static_cast<float>(c10::Half(src[c], c10::Half::from_bits()));
      }
    }
  };
  // small pages (sink_page >= 0): the sinks and the tail in the request's exact pages, else in its code pages
  const bool small = sink_page >= 0;
  if (small)
    TORCH_CHECK(sink_page < pages.size(0) && ring_page >= 0 && ring_page < pages.size(0), "exact page out of range");
  const int64_t ns = std::min<int64_t>(n, SINKS);
  const int64_t sp = small ? sink_page : bt[0];
  for (int64_t t = 0; t < ns; ++t)
    for (int64_t h = 0; h < H; ++h) {
      copy_row(K, t, h, region(sp, h, t, 0));
      copy_row(V, t, h, region(sp, h, t, 1));
    }
  const int64_t tail0 = exact_from(n, a.lay.window);  // the encoded blocks end here; the ring holds the rest
  const int64_t full = tail0 / BLOCK;
  for (int64_t t = tail0; t < n; ++t) {  // token t in slot TAIL0 + t % ring of its page (small pages: t % 8)
    const int64_t tp = small ? ring_page : bt[t / bs], ts = small ? t % BLOCK : TAIL0 + t % a.lay.ring;
    for (int64_t h = 0; h < H; ++h) {
      copy_row(K, t, h, region(tp, h, ts, 0));
      copy_row(V, t, h, region(tp, h, ts, 1));
    }
  }
  const Kernels* kern = g_kernels;
  // QJL's keys from the table of signed 4-row sums where enough blocks are read to pay for it (building it: ~0.1 ms
  // by count at Llama-8B's first layers' sketch, about what 10 blocks of one head cost without it)
  thread_local std::vector<float> qs, qt;
  if (a.k.method == QJL && (full - 1) * H >= 16 && D % 16 == 0 && a.k.chunk % 8 == 0 && a.k.kc <= a.k.chunk) {
    qjl_table(a.k, D, qs, qt);
    a.k.qlut = qt.data();
  }
  if (full > 1)
    parallel_heads(full - 1, H, [&](int64_t i) { kern->gather_block(a, i); }, [&](int64_t h) {
      prefetch_head(a.k, a.lay.D, h, false);
      prefetch_head(a.v, a.lay.D, h, false);
    });
  return {K, V};
}

// the largest Euclidean norm of a row of S, from S^T [D][m]: QJL's sign screen bounds its float32 rounding with it
// (kernels_impl.h qjl_sign_rows; D x m multiply-adds per call that encodes a block)
float sketch_row_norm_max(const float* ST, int64_t D, int64_t m) {
  double best = 0.0;
  for (int64_t j = 0; j < m; ++j) {
    double s = 0.0;
    for (int64_t c = 0; c < D; ++c) s += (double)ST[c * m + j] * ST[c * m + j];
    best = s > best ? s : best;
  }
  return (float)std::sqrt(best) * 1.001f;  // (rounded up)
}

// An encode's layout and codecs, checked: the encoders take codebook codes, the selective formats' scaled ones,
// TaDA's (its head mean over at most 16 heads: torch sums that many in head order) and QJL's (sign sketches of its
// keys, affine codes of its values)
EncodeArgs encode_args(const at::Tensor& pages, const std::vector<at::Tensor>& kt, const std::vector<int64_t>& ki,
                       const std::vector<at::Tensor>& vt, const std::vector<int64_t>& vi,
                       const std::vector<int64_t>& li) {
  EncodeArgs a;
  a.lay = make_layout(li);
  a.k = make_codec(kt, ki, a.lay);
  a.v = make_codec(vt, vi, a.lay);
  check_pages(pages, a.lay);
  for (const Codec* c : {&a.k, &a.v})
    TORCH_CHECK(c->method < SCALED || c->method == SCALED || c->method == AFFINE || (c->method == QJL && c == &a.k) ||
                    (c->method == TADA && a.lay.H <= 16),
                "write_kv encodes codebook codes, the selective formats', TaDA's (<= 16 KV heads) and QJL's");
  return a;  // (QJL's Codec::smax: encode_blocks, where there are blocks to encode)
}

// The K/V rows and RoPE tables of an encode (write_kv, write_kv_window)
void check_rows(const at::Tensor& kh, const at::Tensor& vh, const at::Tensor& cos, const at::Tensor& sin,
                const Layout& L, int64_t max_pos) {
  const int64_t N = kh.size(0), H = L.H, D = L.D;
  const auto dt = L.bf16 ? at::kBFloat16 : at::kHalf;
  TORCH_CHECK(kh.scalar_type() == dt && vh.scalar_type() == dt && kh.sizes() == at::IntArrayRef({N, H, D}) &&
                  vh.sizes() == kh.sizes() && token_rows(kh) && token_rows(vh),
              "key/value: [N, H, D] in the cache's half dtype, each token's H x D values contiguous");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D / 2 && cos.size(0) > max_pos && sin.sizes() == cos.sizes(),
              "cos/sin: [P > max position, D/2]");
}

// Row i's K/V (store half) into region slot `slot` of page `page`, every head
void put_row(const EncodeArgs& a, int64_t i, int64_t page, int64_t slot) {
  const int64_t H = a.lay.H, D = a.lay.D;
  for (int64_t h = 0; h < H; ++h) {
    uint16_t* reg = reinterpret_cast<uint16_t*>(a.pages + (page * H + h) * a.lay.rec_bytes) + slot * 2 * D;
    std::memcpy(reg, a.kh + i * a.krow + h * D, D * 2);
    std::memcpy(reg + D, a.vh + i * a.vrow + h * D, D * 2);
  }
}

// blocks per KV head from which an encode searches float32 tables (encode_blocks): 256 tokens by default
// (set_encode_f32_blocks: benchmarks/encode_cpu.py alternates both tables in one process)
int64_t g_f32_table_blocks = 32;
int64_t encode_f32_blocks() { return g_f32_table_blocks; }
void set_encode_f32_blocks(int64_t blocks) {
  TORCH_CHECK(blocks >= 0, "set_encode_f32_blocks: a block count >= 0 (0: always float32 tables), got ", blocks);
  g_f32_table_blocks = blocks;
}

// Step 1 of a cache write: `blocks` (EncodeArgs::blocks, 5 ints each) encoded in parallel, each reading its ring
// rows before step 2 (the caller's exact writes, put_row) may reuse their slots
void encode_blocks(EncodeArgs& a, const at::Tensor& pages, const at::Tensor& kh, const at::Tensor& vh,
                   const std::vector<int64_t>& blocks, const at::Tensor& cos, const at::Tensor& sin, double s2) {
  a.pages = pages.data_ptr<uint8_t>();
  a.kh = reinterpret_cast<const uint16_t*>(kh.data_ptr());
  a.vh = reinterpret_cast<const uint16_t*>(vh.data_ptr());
  a.krow = kh.stride(0);  // (check_rows: each token's H x D values contiguous)
  a.vrow = vh.stride(0);
  a.blocks = blocks.data();
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.s2 = (float)s2;
  if (blocks.empty()) return;
  // computed here, not per encode_args: most decode steps' writes complete no block
  if (a.k.method == QJL) a.k.smax = sketch_row_norm_max(a.k.cent, a.lay.D, a.k.chunk);
  // The search reads its codebook tables in float32 where a call encodes many blocks per head (a prompt's chunk):
  // the same values without a conversion per table row - SmolLM2's 30 layers, both alternated in one process, cold
  // tables, 2-core AMD EPYC: 0.83-0.90x the float16 tables' time from 256 to 4096 tokens (benchmarks/encode_cpu.py).
  // A few blocks (a decode step's, a prefix-cache hit's short chunk) keep half the bytes fetched from DRAM.
  const int64_t per_head = (int64_t)blocks.size() / 5;
  a.nitems = per_head * a.lay.H;
  if (per_head >= g_f32_table_blocks) a.k.centT16 = a.v.centT16 = nullptr;
  const Kernels* kern = g_kernels;
  parallel_heads(per_head, a.lay.H, [&](int64_t i) { kern->encode_item(a, i); }, [&](int64_t h) {
    prefetch_head(a.k, a.lay.D, h, true);
    prefetch_head(a.v, a.lay.D, h, true);
  });
}

// Twin of paged_torch.write_kv.  kh/vh [N, H, D] in the model dtype; positions/page_ids [N] int64;
// cos/sin [P > max position, D/2] from Rope.cos_sin; s2 = rope.scale ** 2.
void write_kv(const at::Tensor& pages, const at::Tensor& kh, const at::Tensor& vh, const at::Tensor& positions,
              const at::Tensor& page_ids, const at::Tensor& cos, const at::Tensor& sin, double s2,
              const std::vector<at::Tensor>& kt, const std::vector<int64_t>& ki, const std::vector<at::Tensor>& vt,
              const std::vector<int64_t>& vi, const std::vector<int64_t>& li, const at::Tensor& sink_pages,
              const at::Tensor& ring_pages) {
  EncodeArgs a = encode_args(pages, kt, ki, vt, vi, li);
  TORCH_CHECK(a.lay.window == 0, "write_kv: a layout without a recent window (with one: write_kv_window)");
  const int64_t N = kh.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kLong && page_ids.scalar_type() == at::kLong &&
                  positions.is_contiguous() && page_ids.is_contiguous() && positions.numel() == N &&
                  page_ids.numel() == N,
              "positions/page_ids: contiguous int64 [N]");
  const bool small = sink_pages.numel() > 0;  // small pages: each token's sink page and ring page
  if (small)
    TORCH_CHECK(sink_pages.scalar_type() == at::kLong && ring_pages.scalar_type() == at::kLong &&
                    sink_pages.is_contiguous() && ring_pages.is_contiguous() && sink_pages.numel() == N &&
                    ring_pages.numel() == N,
                "sink_pages/ring_pages: contiguous int64 [N]");
  if (N == 0) return;
  const int64_t* spg = small ? sink_pages.data_ptr<int64_t>() : nullptr;
  const int64_t* rpg = small ? ring_pages.data_ptr<int64_t>() : nullptr;
  if (small)
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(spg[i] >= 0 && spg[i] < pages.size(0) && rpg[i] >= 0 && rpg[i] < pages.size(0),
                  "exact page out of range");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* pid = page_ids.data_ptr<int64_t>();
  int64_t max_pos = 0;
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pid[i] >= 0 && pid[i] < pages.size(0), "bad position or page id");
    max_pos = std::max(max_pos, pos[i]);
  }
  check_rows(kh, vh, cos, sin, a.lay, max_pos);
  // the blocks this call completes: their rows from the input where a row of the same page and position is there
  // (a request's tokens are in order: a suffix of the block), the others from its tail slots
  std::vector<int64_t> blocks;
  for (int64_t e = 0; e < N; ++e) {
    if (pos[e] < SINKS || pos[e] % BLOCK != BLOCK - 1) continue;
    const int64_t pos0 = pos[e] - (BLOCK - 1);
    int64_t first = pos[e];
    for (int r = BLOCK - 2; r >= 0; --r) {
      const int64_t src = e - (BLOCK - 1) + r;
      if (!(src >= 0 && pid[src] == pid[e] && pos[src] == pos0 + r)) break;
      first = pos0 + r;
    }
    blocks.insert(blocks.end(), {pos0, pid[e], small ? rpg[e] : pid[e], e - (BLOCK - 1), first});
  }
  a.small = small;
  encode_blocks(a, pages, kh, vh, blocks, cos, sin, s2);  // 1. the completed blocks (their tail rows read first)
  // 2. sinks, and tokens whose block is not completed within this call, go to the region
  for (int64_t i = 0; i < N; ++i) {
    const int64_t p = pos[i], off = p % BLOCK;
    if (p < SINKS) {
      put_row(a, i, small ? spg[i] : pid[i], p);
    } else {
      const int64_t j = i + (BLOCK - 1 - off);
      if (j < N && pid[j] == pid[i] && pos[j] == p + (BLOCK - 1 - off)) continue;  // encoded
      put_row(a, i, small ? rpg[i] : pid[i], (small ? 0 : TAIL0) + off);
    }
  }
}

// Twin of paged_torch.write_kv_window (a layout with a recent window): request r's tokens are rows
// query_start_loc[r] .. [r + 1] of kh / vh, the last of its seq_lens[r]; the blocks that leave the window as it
// grows from ctx to n tokens are encoded (rows from this call's input or from the ring of their page, all read
// before anything is written), then the tokens still exact go to the sinks (page 0 of its table) or the ring (slot
// TAIL0 + p % ring of their page).  block_tables [R, >= pages of n] int32.
void write_kv_window(const at::Tensor& pages, const at::Tensor& kh, const at::Tensor& vh,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     const at::Tensor& cos, const at::Tensor& sin, double s2, const std::vector<at::Tensor>& kt,
                     const std::vector<int64_t>& ki, const std::vector<at::Tensor>& vt, const std::vector<int64_t>& vi,
                     const std::vector<int64_t>& li) {
  EncodeArgs a = encode_args(pages, kt, ki, vt, vi, li);
  const int w = a.lay.window;
  TORCH_CHECK(w > 0, "write_kv_window: a layout with a recent window (without one: write_kv)");
  const int64_t R = seq_lens.numel(), N = kh.size(0), bs = a.lay.block_size;
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous() && query_start_loc.numel() == R + 1,
              "query_start_loc [R + 1] / seq_lens [R]: contiguous int64");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == R &&
                  block_tables.stride(1) == 1,
              "block_tables: int32 [R, pages], rows contiguous");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bst = block_tables.stride(0), P = pages.size(0);
  TORCH_CHECK(qsl[0] == 0 && qsl[R] == N, "query_start_loc must run from 0 to the rows of key/value");
  int64_t max_pos = 0;
  std::vector<int64_t> blocks;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t q0 = qsl[r], q1 = qsl[r + 1], n = lens[r], ctx = n - (q1 - q0);
    TORCH_CHECK(q0 <= q1 && ctx >= 0, "request ", r, ": more new tokens than its sequence length");
    if (q1 == q0) continue;
    TORCH_CHECK((n + bs - 1) / bs <= block_tables.size(1), "request ", r, ": its block table is too short");
    for (int64_t j = 0; j < (n + bs - 1) / bs; ++j)
      TORCH_CHECK(bt[r * bst + j] >= 0 && bt[r * bst + j] < P, "request ", r, ": page out of range");
    max_pos = std::max(max_pos, n - 1);
    for (int64_t p0 = exact_from(ctx, w), hi = exact_from(n, w); p0 < hi; p0 += BLOCK) {
      const int64_t page = bt[r * bst + p0 / bs];
      blocks.insert(blocks.end(), {p0, page, page, q0 + p0 - ctx, ctx});
    }
  }
  check_rows(kh, vh, cos, sin, a.lay, max_pos);
  if (N == 0) return;
  encode_blocks(a, pages, kh, vh, blocks, cos, sin, s2);  // 1. the blocks leaving the window (ring rows read first)
  // 2. the tokens still exact after this call: the sinks, and those from exact_from(n) on
  for (int64_t r = 0; r < R; ++r) {
    const int64_t q0 = qsl[r], q1 = qsl[r + 1], n = lens[r], ctx = n - (q1 - q0), hi = exact_from(n, w);
    for (int64_t p = ctx; p < n; ++p) {
      if (p < SINKS)
        put_row(a, q0 + p - ctx, bt[r * bst], p);
      else if (p >= hi)
        put_row(a, q0 + p - ctx, bt[r * bst + p / bs], TAIL0 + p % a.lay.ring);
    }
  }
}

// Whether prefill_attention can take bf16 scores here: the avx512 kernels in use on a CPU with AVX512_BF16.
bool bf16_dot() {
#ifdef TKV_X86
  __builtin_cpu_init();
  return g_kernels == &avx512::kernels && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

void check_rows(const at::Tensor& t, const char* what) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(t.device().is_cpu() && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) &&
                  (t.size(0) == 0 || t.size(2) <= 1 || t.stride(2) == 1),
              what, ": a CPU tensor of float32, bfloat16 or float16 with contiguous rows");
}

// A prefill chunk's attention (PrefillArgs): queries q [Tq, Hq, D] at positions offset.., each over the keys up to
// itself - decoded (kd / vd [>= its own block's start, H, D], positions 0..) before its own block (exact_start),
// exact (kx / vx [n, H, D], positions x0..) from there on; out [Tq, Hq, D].  Any of float32 / bfloat16 / float16,
// rows contiguous, other strides free: the arrays are padded to whole tiles, tiled (keys tile-major) and converted
// here in one parallel pass - in torch that glue was ~a dozen ops, over half of a short chunk's layer step
// (benchmarks/prefix: a prefix-cache hit's 40-token chunk).  b16 (bf16_dot()): the scores from the bf16 values
// and, where the values are bf16 too, their weighted sums with the weights rounded to bf16 (PrefillArgs); the rest
// float32 as without.
void prefill_attention(const at::Tensor& q, const at::Tensor& kd, const at::Tensor& vd, const at::Tensor& kx,
                       const at::Tensor& vx, int64_t x0, int64_t offset, double scale, at::Tensor& out, bool b16,
                       int64_t window) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out: [Tq, Hq, D]");
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= MAX_D, "head_dim must be a multiple of 32 and at most ", MAX_D);
  TORCH_CHECK(kd.dim() == 3 && kd.sizes() == vd.sizes() && kx.dim() == 3 && kx.sizes() == vx.sizes() &&
                  kd.size(2) == D && kx.size(2) == D && kd.size(1) == kx.size(1),
              "keys and values: [n, H, D]");
  const int64_t H = kd.size(1);
  TORCH_CHECK(H > 0 && Hq % H == 0, "query heads must be a multiple of the KV heads");
  check_rows(q, "q");
  check_rows(out, "out");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&kd, &vd, &kx, &vx})
    check_rows(*t, "prefill keys and values");
  TORCH_CHECK(!b16 || bf16_dot(), "bf16 prefill scores need the avx512 kernels on a CPU with AVX512_BF16");
  TORCH_CHECK(window >= 0 && window % BLOCK == 0 && window < (1 << 30), "window: whole blocks");
  if (Tq == 0) return;
  const int64_t own_last = exact_start(offset + Tq - 1, (int)window), own_first = exact_start(offset, (int)window);
  TORCH_CHECK(offset >= 0 && x0 >= 0 && kd.size(0) >= own_last && x0 <= own_first && x0 + kx.size(0) >= offset + Tq,
              "the key arrays do not cover the chunk (decoded up to its last query's window, exact from its first's)");
  const int64_t nd = (own_last + TILE - 1) / TILE * TILE;  // decoded keys 0 .. nd - 1 (zero past kd)
  const int64_t xt = x0 / TILE * TILE;                      // exact keys from the tile x0 is in (zero before x0)
  const int64_t nx = (offset + Tq + TILE - 1) / TILE * TILE - xt;
  at::Tensor kbuf = at::empty({H * (nd + nx) * D}, q.options().dtype(b16 ? at::kBFloat16 : at::kFloat));
  // bf16 values too (their weighted sums as bf16 dot products, PrefillArgs::vd16): where they hold bf16 values
  const bool v16 = b16 && vd.scalar_type() == at::kBFloat16 && vx.scalar_type() == at::kBFloat16;
  at::Tensor vbuf = at::empty({H * (nd + nx) * D}, q.options().dtype(v16 ? at::kBFloat16 : at::kFloat));
  float* kf = b16 ? nullptr : kbuf.data_ptr<float>();
  uint16_t* k16 = b16 ? reinterpret_cast<uint16_t*>(kbuf.data_ptr<at::BFloat16>()) : nullptr;
  float* vf_ = v16 ? nullptr : vbuf.data_ptr<float>();
  uint16_t* vp16 = v16 ? reinterpret_cast<uint16_t*>(vbuf.data_ptr<at::BFloat16>()) : nullptr;
  const SrcRows KD(kd), VD(vd), KX(kx), VX(vx);
  const int64_t td = nd / TILE, tiles = (nd + nx) / TILE;
  parallel_items(H * tiles, [&](int64_t item) {  // one tile of one KV head: keys tile-major, values row-major
    const int64_t h = item / tiles, j = item % tiles;
    const bool dec = j < td;
    const int64_t t0 = (dec ? j : j - td) * TILE;  // the tile's first row in its array
    const int64_t base = dec ? h * nd * D : H * nd * D + h * nx * D;
    const SrcRows &K = dec ? KD : KX, &V = dec ? VD : VX;
    const int64_t kt = base + t0 * D;  // the tile: [D][TILE] float32, or [D / 2][TILE][2] bf16
    alignas(64) float kr[MAX_D];
    for (int64_t t = 0; t < TILE; ++t) {
      const int64_t r = t0 + t;  // row in the padded array: position r (decoded) or xt + r (exact)
      const int64_t src = dec ? r : xt + r - x0;
      float* vrow = v16 ? nullptr : vf_ + base + r * D;
      uint16_t* vp = v16 ? vp16 + base + (r / 2) * 2 * D + (r & 1) : nullptr;  // bf16 values: [n / 2][D][2]
      if (!(dec ? src < KD.n : (src >= 0 && src < KX.n))) {  // padding: zero keys and values
        if (v16) {
          for (int64_t c = 0; c < D; ++c) vp[2 * c] = 0;
        } else {
          std::memset(vrow, 0, sizeof(float) * D);
        }
        if (b16) {
          for (int64_t c2 = 0; c2 < D / 2; ++c2) std::memset(k16 + kt + (c2 * TILE + t) * 2, 0, 4);
        } else {
          for (int64_t c = 0; c < D; ++c) kf[kt + c * TILE + t] = 0.f;
        }
        continue;
      }
      if (v16) {  // a token pair's values channel by channel (bf16 bits as they are)
        const uint16_t* u = reinterpret_cast<const uint16_t*>(V.p + src * V.st + h * V.sh);
        for (int64_t c = 0; c < D; ++c) vp[2 * c] = u[c];
      } else {
        V.row(src, h, (int)D, vrow);
      }
      if (b16 && K.dt == at::kBFloat16) {  // a bf16 key's channel pairs moved as they are
        const char* kr16 = K.p + src * K.st + h * K.sh;
        for (int64_t c2 = 0; c2 < D / 2; ++c2) std::memcpy(k16 + kt + (c2 * TILE + t) * 2, kr16 + c2 * 4, 4);
        continue;
      }
      K.row(src, h, (int)D, kr);
      if (b16) {
        for (int64_t c = 0; c < D; ++c) k16[kt + (c / 2) * TILE * 2 + t * 2 + (c & 1)] = c10::BFloat16(kr[c]).x;
      } else {
        for (int64_t c = 0; c < D; ++c) kf[kt + c * TILE + t] = kr[c];
      }
    }
  });
  at::Tensor qf = q.scalar_type() == at::kFloat && q.is_contiguous() ? q : q.to(at::kFloat).contiguous();
  at::Tensor q16 = !b16 ? at::Tensor()
                   : (q.scalar_type() == at::kBFloat16 && q.is_contiguous() ? q : q.to(at::kBFloat16).contiguous());
  const bool direct = out.scalar_type() == at::kFloat && out.is_contiguous();
  at::Tensor o32 = direct ? out : at::empty({Tq, Hq, D}, q.options().dtype(at::kFloat));
  PrefillArgs a;
  a.Tq = (int)Tq;
  a.Hq = (int)Hq;
  a.g = (int)(Hq / H);
  a.D = (int)D;
  a.offset = offset;
  a.window = (int)window;
  a.scale = (float)scale;
  a.q = qf.data_ptr<float>();
  a.vd = v16 ? nullptr : vf_;
  a.nd = nd;
  a.vx = v16 ? nullptr : vf_ + H * nd * D;
  if (v16) {
    a.vd16 = vp16;
    a.vx16 = vp16 + H * nd * D;
  }
  a.x0 = xt;
  a.nx = nx;
  a.out = o32.data_ptr<float>();
  if (b16) {
    a.q16 = reinterpret_cast<const uint16_t*>(q16.data_ptr<at::BFloat16>());
    a.kdT16 = k16;
    a.kxT16 = k16 + H * nd * D;
    a.kdT = a.kxT = nullptr;
  } else {
    a.kdT = kf;
    a.kxT = kf + H * nd * D;
  }
  const int64_t groups = (Tq * a.g + PF_ROWS - 1) / PF_ROWS;
  const Kernels* kern = g_kernels;
  parallel_items(H * groups, [&](int64_t i) { kern->prefill_item(a, i); });
  if (!direct) out.copy_(o32);
}

// A prefill chunk's cache update and read-back on codebook pages without a recent window (the first half of
// prefill_chunk and prefill_chunk_flash): the chunk's K/V written (kh / vh in the cache's half dtype, rows
// strided or not - vLLM's are slices of its QKV projection; the blocks it completes encoded once: write_kv), then
// the first m cached tokens read back decoded (gather: the sinks and whole blocks, the chunk's completed ones
// included).  sink_page / ring_page: small pages' exact pages of this request (-1: none).  The same ops in the same
// order as write_kv and gather, so the same pages and K/V bit for bit.
std::vector<at::Tensor> write_gather(const at::Tensor& pages, const at::Tensor& kh, const at::Tensor& vh,
                                     const at::Tensor& positions, const at::Tensor& page_ids,
                                     const at::Tensor& block_table, int64_t m, const at::Tensor& cos,
                                     const at::Tensor& sin, double s2, const std::vector<at::Tensor>& kt,
                                     const std::vector<int64_t>& ki, const std::vector<at::Tensor>& vt,
                                     const std::vector<int64_t>& vi, const std::vector<int64_t>& li,
                                     int64_t sink_page, int64_t ring_page) {
  const int64_t N = kh.size(0);
  const bool small = sink_page >= 0;
  const auto opt = positions.options().dtype(at::kLong);
  // (K/V as they are where each token's values are contiguous: a strided split of the QKV projection is read in place)
  write_kv(pages, token_rows(kh) ? kh : kh.contiguous(), token_rows(vh) ? vh : vh.contiguous(),
           positions.to(at::kLong).contiguous(), page_ids.to(at::kLong).contiguous(), cos, sin, s2, kt, ki, vt, vi, li,
           small ? at::full({N}, sink_page, opt) : at::empty({0}, opt),
           small ? at::full({N}, ring_page, opt) : at::empty({0}, opt));
  return gather(pages, block_table, m, cos, sin, kt, ki, vt, vi, li, sink_page, ring_page);
}

// A prefill chunk's layer step on codebook pages without a recent window (ops.cpu._prefill), in one call instead
// of three: write_gather (the chunk's K/V written, the first m cached tokens read back decoded), then the chunk's
// attention over them (prefill_attention) - its queries' exact keys the decoded rows x0 .. e0 - 1 followed by
// ke / ve (the exact rows from e0 on: the context's incomplete block, read by the caller before this write may
// reuse its slots, and the chunk's own).  The same ops in the same order as the three calls, so the same pages and
// outputs bit for bit; what it saves is their Python glue, ~a third of a prefix-cache hit's short chunk
// (benchmarks/prefix).
void prefill_chunk(const at::Tensor& pages, const at::Tensor& q, const at::Tensor& kh, const at::Tensor& vh,
                   const at::Tensor& ke, const at::Tensor& ve, const at::Tensor& positions, const at::Tensor& page_ids,
                   const at::Tensor& block_table, int64_t m, int64_t x0, int64_t e0, int64_t offset,
                   const at::Tensor& cos, const at::Tensor& sin, double s2, const std::vector<at::Tensor>& kt,
                   const std::vector<int64_t>& ki, const std::vector<at::Tensor>& vt, const std::vector<int64_t>& vi,
                   const std::vector<int64_t>& li, int64_t sink_page, int64_t ring_page, double scale, at::Tensor& out,
                   bool b16) {
  TORCH_CHECK(0 <= x0 && x0 <= e0 && e0 <= m, "prefill_chunk: decoded exact rows x0 <= e0 <= m");
  const std::vector<at::Tensor> kv = write_gather(pages, kh, vh, positions, page_ids, block_table, m, cos, sin, s2,
                                                  kt, ki, vt, vi, li, sink_page, ring_page);
  const bool mixed = e0 > x0;  // the sinks a query before position 8 reads exactly are decoded rows here
  prefill_attention(q, kv[0], kv[1], mixed ? at::cat({kv[0].slice(0, x0, e0), ke}) : ke,
                    mixed ? at::cat({kv[1].slice(0, x0, e0), ve}) : ve, x0, offset, scale, out, b16, 0);
}

// The flash prefill's window part and merge (WindowArgs; ops/cpu_flash.py): out [Tq, Hq, D] = softmax over each
// query's 8 positions p - window - 7 .. p - window (kd / vd decoded from position 0, kx / vx exact from x0; window: a
// recent window, 0 for none) and the parts (o [H, g, Tq - t0,
// D], lse [H, g, Tq - t0] float32, first query t0), merged by log-sum-exp.  q, keys, values, parts' outputs and out:
// one dtype, float32 or bfloat16, each row's D values contiguous (other strides free).
void window_merge(const at::Tensor& q, const at::Tensor& kd, const at::Tensor& vd, const at::Tensor& kx,
                  const at::Tensor& vx, int64_t x0, int64_t offset, double scale, const std::vector<at::Tensor>& po,
                  const std::vector<at::Tensor>& plse, const std::vector<int64_t>& pt0, at::Tensor& out,
                  int64_t window) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "window_merge: float32 or bfloat16, got ", dt);
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out: [Tq, Hq, D]");
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= MAX_D, "head_dim must be a multiple of 32 and at most ", MAX_D);
  TORCH_CHECK(kd.dim() == 3 && kd.sizes() == vd.sizes() && kx.dim() == 3 && kx.sizes() == vx.sizes() &&
                  kd.size(2) == D && kx.size(2) == D && kd.size(1) == kx.size(1),
              "keys and values: [n, H, D]");
  const int64_t H = kd.size(1);
  TORCH_CHECK(H > 0 && Hq % H == 0, "query heads must be a multiple of the KV heads");
  const int64_t g = Hq / H;
  TORCH_CHECK(po.size() == plse.size() && po.size() == pt0.size() && po.size() <= 8, "at most 8 parts, (o, lse, t0) each");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &kd, &vd, &kx, &vx, &out})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dt && t->stride(2) == 1,
                "window_merge: CPU tensors of one dtype, each row contiguous");
  std::vector<WindowPart> parts(po.size());
  for (size_t k = 0; k < po.size(); ++k) {
    const at::Tensor &o = po[k], &l = plse[k];
    const int64_t tp = Tq - pt0[k];
    TORCH_CHECK(pt0[k] >= 0 && pt0[k] <= Tq, "part t0 out of range");
    TORCH_CHECK(o.device().is_cpu() && o.scalar_type() == dt && o.dim() == 4 && o.size(0) == H && o.size(1) == g &&
                    o.size(2) == tp && o.size(3) == D && o.stride(3) == 1,
                "part output: [H, g, Tq - t0, D], rows contiguous, the dtype of q");
    TORCH_CHECK(l.device().is_cpu() && l.scalar_type() == at::kFloat && l.dim() == 3 && l.size(0) == H &&
                    l.size(1) == g && l.size(2) == tp,
                "part log-sum-exp: float32 [H, g, Tq - t0]");
    parts[k] = WindowPart{o.data_ptr(), o.stride(0), o.stride(1), o.stride(2),
                          l.data_ptr<float>(), l.stride(0), l.stride(1), l.stride(2), pt0[k]};
  }
  if (Tq == 0) return;
  TORCH_CHECK(window >= 0 && window % BLOCK == 0 && window < (1 << 30), "window: a multiple of ", BLOCK, " >= 0");
  const int64_t own_last = exact_start(offset + Tq - 1, (int)window), own_first = exact_start(offset, (int)window);
  TORCH_CHECK(offset >= 0 && kd.size(0) >= own_last && x0 <= own_first && x0 + kx.size(0) >= offset + Tq,
              "the key arrays do not cover the chunk (decoded up to its last query's own block, exact from its first's)");
  WindowArgs a;
  a.Tq = (int)Tq;
  a.H = (int)H;
  a.g = (int)g;
  a.D = (int)D;
  a.bf16 = dt == at::kBFloat16;
  a.np = (int)parts.size();
  a.window = (int)window;
  a.offset = offset;
  a.x0 = x0;
  a.scale = (float)scale;
  auto rows = [](const at::Tensor& t) { return WinRows{t.data_ptr(), t.stride(0), t.stride(1)}; };
  a.q = rows(q);
  a.kd = rows(kd);
  a.vd = rows(vd);
  a.kx = rows(kx);
  a.vx = rows(vx);
  a.out = out.data_ptr();
  a.so_t = out.stride(0);
  a.so_h = out.stride(1);
  a.parts = parts.data();
  const int64_t chunks = (Tq + WIN_ROWS - 1) / WIN_ROWS;
  const Kernels* kern = g_kernels;
  parallel_items(H * chunks, [&](int64_t i) { kern->window_item(a, i); });
}

// Whether this CPU has AMX tiles for the prefill-chunk attention: AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24
// and 22), AVX512-BF16, and Linux granting this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA, as vLLM's CPU worker and torch ask it; asking again is harmless).  Asked once.
bool amx_tiles() {
#if defined(__x86_64__)
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 22) & 1)) return false;
    if (!__builtin_cpu_supports("avx512bf16")) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// Whether the tile kernels' emulation (amx_emulate.h: each tile instruction in AVX512-BF16) can run here.
bool amx_emulation_possible() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// The emulation in place of the tiles: asked for by tests on CPUs without tiles (or, on an AMX CPU, to check the
// emulation against the tiles) - set_amx_emulated, or VLLM_TEMPORALKV_CPU_AMX_EMULATE=1 at load.  Never chosen by
// itself: emulated, a chunk attends slower than on the C++ kernel.
bool g_amx_emulated = [] {
  const char* env = std::getenv("VLLM_TEMPORALKV_CPU_AMX_EMULATE");
  return env && env[0] == '1' && amx_emulation_possible();
}();

// Whether the AMX prefill-chunk attention runs here: on the tiles, or emulated where asked.
bool amx_ready() { return g_amx_emulated || amx_tiles(); }

bool amx_emulated() { return g_amx_emulated; }

void set_amx_emulated(bool on) {
  TORCH_CHECK(!on || amx_emulation_possible(),
              "emulating AMX tiles needs AVX512-BF16, which this CPU lacks (the AMX kernels' tests skip here)");
  g_amx_emulated = on;
}

// The tile kernels that serve: amx_ready() is checked first
const amx::TileKernels& tile_kernels() {
#if defined(__x86_64__)
  return g_amx_emulated ? amx::emulated : amx::tiles;
#else
  TORCH_CHECK(false, "no AMX tile kernels in this build (not x86-64)");
  __builtin_unreachable();
#endif
}

// A long chunk's attention on AMX tiles (amx_attention.h long_panel): every KV head's operands packed (one item per
// head), then panels of rows (the longest first).
void amx_long(const amx::ChunkArgs& a) {
  const int64_t H = a.H, R = (int64_t)a.Tq * a.g, panels = (R + amx::LONG_PANEL_ROWS - 1) / amx::LONG_PANEL_ROWS;
  const amx::LongShape ls{(R + 31) / 32 * 32, (a.nd + 31) / 32 * 32, (a.nx + 31) / 32 * 32, a.D};
  // (kept between calls: a fresh ~10 MB buffer per layer step page-faults on every first touch)
  thread_local std::vector<uint32_t> packed;
  if (packed.size() < (size_t)(ls.words_per_head() * H)) packed.resize(ls.words_per_head() * H);
  uint32_t* buf = packed.data();
  const amx::TileKernels& k = tile_kernels();
  parallel_items(H, [&](int64_t h) { k.long_pack(a, ls, (int)h, buf); });
  parallel_items(H * panels, [&](int64_t i) { k.long_panel(a, ls, (int)(i % H), panels - 1 - i / H, buf); });
}

// ops.cpu.prefill_attention's attention (a chunk's queries over the decoded keys before their exact start and the
// exact keys from there, one softmax) on AMX tiles, with or without a recent window: where a served chunk's write
// and gather ran in Python (recent windows, formats the fused call does not encode) and flash would attend.  bf16,
// head dims 32 .. 128 by 32, amx_ready() (ops.cpu.amx_prefill_ok); kd / vd decoded from position 0 (at least up to
// the last query's exact start), kx / vx exact from position x0 (the first query's exact start) to offset + Tq - 1.
void amx_prefill(const at::Tensor& q, const at::Tensor& kd, const at::Tensor& vd, const at::Tensor& kx,
                 const at::Tensor& vx, int64_t x0, int64_t offset, double scale, at::Tensor& out, int64_t window) {
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2), H = kd.size(1), n = offset + Tq;
  TORCH_CHECK(amx_ready(), "amx_prefill: no AMX tiles here (CPU or OS)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "amx_prefill: bfloat16 only");
  TORCH_CHECK(D % 32 == 0 && D <= 128 && H > 0 && Hq % H == 0 && q.stride(2) == 1 && out.stride(2) == 1,
              "amx_prefill: head dims 32 .. 128 by 32, query heads a multiple of the KV heads, rows contiguous");
  if (Tq == 0) return;
  const auto bf = [](const at::Tensor& t) { return t.to(at::kBFloat16).contiguous(); };
  const at::Tensor kdc = bf(kd), vdc = bf(vd), kxc = bf(kx), vxc = bf(vx);
  const int64_t last = exact_start(n - 1, (int)window);
  TORCH_CHECK(last <= kdc.size(0) && x0 + kxc.size(0) == n && kxc.size(1) == H,
              "amx_prefill: decoded rows up to the last query's exact start, exact rows from x0 to the last query");
  amx::ChunkArgs a{(int)Tq, (int)H, (int)(Hq / H), (int)D, offset, last, x0, kxc.size(0), (float)scale,
                   reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
                   reinterpret_cast<const uint16_t*>(kdc.data_ptr()), reinterpret_cast<const uint16_t*>(vdc.data_ptr()),
                   kdc.stride(0), kdc.stride(1),
                   reinterpret_cast<const uint16_t*>(kxc.data_ptr()), reinterpret_cast<const uint16_t*>(vxc.data_ptr()),
                   kxc.stride(0), kxc.stride(1),
                   reinterpret_cast<uint16_t*>(out.data_ptr()), out.stride(0), out.stride(1), window};
  amx_long(a);
}

// A prefill chunk's layer step on codebook pages without a recent window, attending on torch's flash kernel
// (ops.cpu._prefill where use_flash_prefill): write_gather, then cpu_flash.flash_prefill's parts without a window -
// (a) and (b) in one masked call where the caller passes the mask (a short chunk: cpu_flash._mask), else (a) unmasked
// and (b) causal; gqa: torch's kernel maps query heads to KV heads (cpu_flash._flash_gqa) - and window_merge's (c)
// and merge into out.  The same ATen ops in the same order as the Python, so the same output bit for bit; what it
// saves is ~20 Python-dispatched tensor ops per layer (~1/4 of a prefix-cache hit's short chunk on a 2-core VM).
// amx: a chunk's attention on AMX tiles instead of flash and the merge, where amx_ready() - bit 1 a short chunk's
// (the masked call's), bit 2 a long one's (csrc/amx_attention.h; within bf16 rounding of the flash path, not
// bit-identical to it).
void prefill_chunk_flash(const at::Tensor& pages, const at::Tensor& q, const at::Tensor& kh, const at::Tensor& vh,
                         const at::Tensor& ke, const at::Tensor& ve, const at::Tensor& positions,
                         const at::Tensor& page_ids, const at::Tensor& block_table, int64_t m, int64_t x0, int64_t e0,
                         int64_t offset, const at::Tensor& cos, const at::Tensor& sin, double s2,
                         const std::vector<at::Tensor>& kt, const std::vector<int64_t>& ki,
                         const std::vector<at::Tensor>& vt, const std::vector<int64_t>& vi,
                         const std::vector<int64_t>& li, int64_t sink_page, int64_t ring_page, double scale,
                         at::Tensor& out, const at::Tensor& mask, bool gqa, int64_t amx) {
  TORCH_CHECK(0 <= x0 && x0 <= e0 && e0 <= m, "prefill_chunk_flash: decoded exact rows x0 <= e0 <= m");
  const std::vector<at::Tensor> kv = write_gather(pages, kh, vh, positions, page_ids, block_table, m, cos, sin, s2,
                                                  kt, ki, vt, vi, li, sink_page, ring_page);
  const auto dt = q.scalar_type();
  const at::Tensor kd = kv[0].to(dt), vd = kv[1].to(dt);
  const bool mixed = e0 > x0;  // the sinks a query before position 8 reads exactly are decoded rows here
  const at::Tensor kx = (mixed ? at::cat({kv[0].slice(0, x0, e0), ke}) : ke).to(dt);
  const at::Tensor vx = (mixed ? at::cat({kv[1].slice(0, x0, e0), ve}) : ve).to(dt);
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2), H = kd.size(1), g = Hq / H;
  TORCH_CHECK(H > 0 && Hq % H == 0, "query heads must be a multiple of the KV heads");
  if (Tq == 0) return;
  // on AMX tiles in place of flash and the merge (amx_attention.h), where asked (amx: 1 a short chunk - the masked
  // call's -, 2 a long one; ops.cpu.AMX_SHORT / AMX_LONG) and the shapes fit (bf16, head dims 32 .. 128 by 32)
  const bool short_chunk = mask.defined() && mask.numel() > 0;
  if ((amx & (short_chunk ? 1 : 2)) && dt == at::kBFloat16 && D % 32 == 0 && D <= 128 && q.stride(2) == 1 &&
      out.stride(2) == 1 && (!short_chunk || (!mixed && offset >= BLOCK)) && amx_ready()) {
    const at::Tensor kdc = kd.contiguous(), vdc = vd.contiguous(), kxc = kx.contiguous(), vxc = vx.contiguous();
    const int64_t n = offset + Tq;
    amx::ChunkArgs a{(int)Tq, (int)H, (int)g, (int)D, offset, (n - 1) & ~int64_t(BLOCK - 1), x0, kxc.size(0),
                     (float)scale,
                     reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
                     reinterpret_cast<const uint16_t*>(kdc.data_ptr()), reinterpret_cast<const uint16_t*>(vdc.data_ptr()),
                     kdc.stride(0), kdc.stride(1),
                     reinterpret_cast<const uint16_t*>(kxc.data_ptr()), reinterpret_cast<const uint16_t*>(vxc.data_ptr()),
                     kxc.stride(0), kxc.stride(1),
                     reinterpret_cast<uint16_t*>(out.data_ptr()), out.stride(0), out.stride(1)};
    TORCH_CHECK(a.nd <= kdc.size(0) && x0 + a.nx == n, "prefill_chunk_flash: the AMX path's key rows");
    if (short_chunk) {
      const amx::TileKernels& k = tile_kernels();
      parallel_items(H, [&](int64_t h) { k.chunk_head(a, (int)h); });
      return;
    }
    amx_long(a);
    return;
  }
  std::vector<at::Tensor> po, pl;
  std::vector<int64_t> pt;
  const int64_t s = offset - BLOCK;  // query t sees decoded keys < s + t + 1 in (a) and (b)
  int64_t qlo = s < 0 ? -s : 0;
  const auto heads = [&](const at::Tensor& x) {  // [n, H, D] -> [1, H, n, D] (repeated per query head without GQA)
    const at::Tensor t = x.transpose(0, 1);
    return (g == 1 || gqa ? t : t.repeat_interleave(g, 0)).unsqueeze(0);
  };
  if (Tq > qlo && mask.defined() && mask.numel() > 0) {  // (a) and (b) in one masked call (a short chunk)
    const int64_t t = Tq - qlo;
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == g * t && mask.size(1) == s + Tq, "mask: [g * t, s + Tq]");
    const at::Tensor qm = q.slice(0, qlo).view({t, H, g, D}).permute({1, 2, 0, 3}).reshape({1, H, g * t, D});
    auto r = at::_scaled_dot_product_flash_attention_for_cpu(
        qm, kd.slice(0, 0, s + Tq).transpose(0, 1).unsqueeze(0), vd.slice(0, 0, s + Tq).transpose(0, 1).unsqueeze(0),
        0.0, false, mask, scale);
    po.push_back(std::get<0>(r).select(0, 0).view({H, g, t, D}));
    pl.push_back(std::get<1>(r).select(0, 0).view({H, g, t}));
    pt.push_back(qlo);
    qlo = Tq;  // nothing left for (b)
  } else if (s > 0) {  // (a): [1, H, g * Tq, D] queries over [0, s)
    const at::Tensor qa = q.view({Tq, H, g, D}).permute({1, 2, 0, 3}).reshape({1, H, g * Tq, D});
    auto r = at::_scaled_dot_product_flash_attention_for_cpu(
        qa, kd.slice(0, 0, s).transpose(0, 1).unsqueeze(0), vd.slice(0, 0, s).transpose(0, 1).unsqueeze(0), 0.0,
        false, c10::nullopt, scale);
    po.push_back(std::get<0>(r).select(0, 0).view({H, g, Tq, D}));
    pl.push_back(std::get<1>(r).select(0, 0).view({H, g, Tq}));
    pt.push_back(0);
  }
  if (Tq > qlo) {  // (b): queries qlo.. over decoded [max(s, 0), s + Tq), causal from the first
    const int64_t a = s > 0 ? s : 0, b = s + Tq;
    auto r = at::_scaled_dot_product_flash_attention_for_cpu(q.slice(0, qlo).transpose(0, 1).unsqueeze(0),
                                                             heads(kd.slice(0, a, b)), heads(vd.slice(0, a, b)), 0.0,
                                                             true, c10::nullopt, scale);
    po.push_back(std::get<0>(r).select(0, 0).view({H, g, Tq - qlo, D}));
    pl.push_back(std::get<1>(r).select(0, 0).view({H, g, Tq - qlo}));
    pt.push_back(qlo);
  }
  window_merge(q, kd, vd, kx, vx, x0, offset, scale, po, pl, pt, out, 0);
}

// vecs [B, N, v] f32, centT [B, v, K] f32 (centroids transposed) -> [B, N] int64 nearest indices
at::Tensor nearest(const at::Tensor& vecs, const at::Tensor& centT) {
  check_f32(vecs, "vecs");
  check_f32(centT, "centroids");
  TORCH_CHECK(vecs.dim() == 3 && centT.dim() == 3 && vecs.size(0) == centT.size(0) && vecs.size(2) == centT.size(1),
              "vecs [B, N, v], centroids transposed [B, v, K]");
  const int64_t B = vecs.size(0), N = vecs.size(1), v = vecs.size(2), K = centT.size(2);
  TORCH_CHECK(K >= 1 && v >= 1, "empty codebook");
  at::Tensor out = at::empty({B, N}, vecs.options().dtype(at::kLong));
  if (B * N == 0) return out;
  constexpr int64_t CH = 512;
  const int64_t nch = (N + CH - 1) / CH;
  const float* X = vecs.data_ptr<float>();
  const float* C = centT.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const Kernels* kern = g_kernels;
  parallel_items(B * nch, [&](int64_t job) {
    const int64_t b = job / nch, s = (job % nch) * CH, e = std::min(N, s + CH);
    kern->nearest_rows(X + (b * N + s) * v, C + b * v * K, o + b * N + s, e - s, (int)K, (int)v);
  });
  return out;
}

}  // namespace tkv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vllm-temporalkv CPU kernels (AVX-512 / AVX2 / portable, chosen at run time)";
  m.def("isa", &tkv::isa, "the kernel variant in use");
  m.def("set_isa", &tkv::set_isa, "force a variant: avx512, avx2 or scalar");
  m.def("gathers", &tkv::gathers, "whether the AVX-512 decode reads channel codes with vpgather");
  m.def("set_gathers", &tkv::set_gathers, "force the AVX-512 decode's code reads: vpgather (true) or scalar loads");
  m.def("supported_isas", &tkv::supported_isas, "the variants this CPU can run");
  m.def("encode_f32_blocks", &tkv::encode_f32_blocks, "blocks per KV head from which an encode reads float32 tables");
  m.def("set_encode_f32_blocks", &tkv::set_encode_f32_blocks, "set it (0: always float32, a huge count: float16)");
  m.def("decode_attention", &tkv::decode_attention, py::call_guard<py::gil_scoped_release>());
  m.def("gather", &tkv::gather, py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &tkv::write_kv, py::call_guard<py::gil_scoped_release>());
  m.def("write_kv_window", &tkv::write_kv_window, py::call_guard<py::gil_scoped_release>());
  m.def("nearest", &tkv::nearest, py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention", &tkv::prefill_attention, py::call_guard<py::gil_scoped_release>());
  m.def("prefill_chunk", &tkv::prefill_chunk, py::call_guard<py::gil_scoped_release>());
  m.def("prefill_chunk_flash", &tkv::prefill_chunk_flash, py::call_guard<py::gil_scoped_release>());
  m.def("window_merge", &tkv::window_merge, py::call_guard<py::gil_scoped_release>());
  m.def("amx_prefill", &tkv::amx_prefill, py::call_guard<py::gil_scoped_release>());
  m.def("amx_ready", &tkv::amx_ready, "whether the AMX prefill-chunk attention runs here (tiles, or emulated)");
  m.def("amx_tiles", &tkv::amx_tiles, "whether this CPU has AMX tiles and the OS granted them");
  m.def("amx_emulated", &tkv::amx_emulated, "whether the AMX kernels run emulated in AVX512-BF16");
  m.def("set_amx_emulated", &tkv::set_amx_emulated, "run the AMX kernels emulated in AVX512-BF16 (tests)");
  m.def("bf16_dot", &tkv::bf16_dot, "whether prefill_attention takes bf16 scores here (avx512 + AVX512_BF16)");
  m.attr("TILE") = tkv::TILE;  // the prefill kernel's key tiles
  m.attr("DECODE_TILE") = tkv::DTILE;
  // bumped whenever an op's arguments change: ops/cpu.py refuses (and says so) a stale build
  m.attr("ABI_VERSION") = 22;
}
