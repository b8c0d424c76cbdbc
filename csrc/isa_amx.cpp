// AMX variants of a prefill chunk's attention (amx_attention.h: short and long chunks): compiled for AMX-BF16 tiles, called only
// where ops.cpp's amx_ready() found them (CPU and OS).
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")
#define TKV_AMX_UNIT tiles_unit
#include "amx_attention.h"
namespace tkv {
namespace amx {
const TileKernels tiles{&chunk_head, &pack_long, &long_panel};
}  // namespace amx
}  // namespace tkv
#pragma GCC pop_options
#endif
