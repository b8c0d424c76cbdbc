// Portable variant: no target flags (SSE2 on x86-64, the compiler's baseline elsewhere).
#include <cstdint>
// 8-float vectors are passed between inlined internal functions only: no ABI concern
#pragma GCC diagnostic ignored "-Wpsabi"
#define TKV_ISA scalar
#define TKV_ISA_NAME "scalar"
#define TKV_W 4
#include "kernels_impl.h"
