// Layout probe for the first GPU run (benchmarks/gpu/cuda_decode.py --probe): one warp runs the two warp-level
// instructions whose register layouts the decode kernel and its CPU emulator assume - mma.m16n8k16 (f16 -> f32)
// and movmatrix.m8n8.trans - on given fragments, so their results can be compared with the emulator's model
// (ops/cuda_emulator.py mma16816 / movmatrix_trans) before anything else is trusted.
#include "ptx.cuh"

// in: [32 lanes][7] 32-bit words: A fragment (4), B fragment (2), a movmatrix source (1).
// dout: [32][4] f32 (D = A B, C = 0); mout: [32] the transposed fragment.
extern "C" __global__ void tkv_probe(const uint32_t* in, float* dout, uint32_t* mout) {
  const int l = threadIdx.x & 31;
  const uint32_t* w = in + l * 7;
  const uint32_t a[4] = {w[0], w[1], w[2], w[3]};
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  tkvc::mma16816(d, a, w[4], w[5]);
#pragma unroll
  for (int i = 0; i < 4; ++i) dout[l * 4 + i] = d[i];
  mout[l] = tkvc::movmatrix_trans(w[6]);
}
