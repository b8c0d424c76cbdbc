// AMX variants of a prefill chunk's attention (amx_attention.h: short and long chunks): compiled for AMX-BF16 tiles, called only
// where ops.cpp's amx_ready() found them (CPU and OS).
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")
#include "amx_attention.h"
namespace tkv {
namespace amx {
void chunk_head_entry(const ChunkArgs& a, int h) { chunk_head(a, h); }
void long_pack_entry(const ChunkArgs& a, const LongShape& s, int h, uint32_t* buf) { pack_long(a, s, h, buf); }
void long_panel_entry(const ChunkArgs& a, const LongShape& s, int h, int64_t panel, const uint32_t* buf) {
  long_panel(a, s, h, panel, buf);
}
}  // namespace amx
}  // namespace tkv
#pragma GCC pop_options
#endif
