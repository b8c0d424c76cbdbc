// amx_attention.h's kernels with every tile instruction emulated in AVX512-BF16 (amx_emulate.h): the same code as
// isa_amx.cpp's, run where the CPU has AVX512-BF16 but no tiles when asked (ops.cpp set_amx_emulated; the tests of
// the AMX kernels on such CPUs).  Slower than the tiles and than the C++ kernel; never chosen by itself.
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>
#include "amx_emulate.h"
#define TKV_AMX_UNIT emulated_unit
#include "amx_attention.h"
namespace tkv {
namespace amx {
const TileKernels emulated{&chunk_head, &pack_long, &long_panel};
}  // namespace amx
}  // namespace tkv
#pragma GCC pop_options
#endif
