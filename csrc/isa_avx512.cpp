// AVX-512 variant, chosen at run time when the CPU (and OS) support AVX-512F.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <cstdint>
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#define TKV_ISA avx512
#define TKV_ISA_NAME "avx512"
#define TKV_W 16
#include "kernels_impl.h"
#pragma GCC pop_options
#endif
