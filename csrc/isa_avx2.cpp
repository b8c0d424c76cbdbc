// AVX2 + FMA + F16C variant (the baseline of the project's x86 machines).
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <cstdint>
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define TKV_ISA avx2
#define TKV_ISA_NAME "avx2"
#define TKV_W 8
#include "kernels_impl.h"
#pragma GCC pop_options
#endif
