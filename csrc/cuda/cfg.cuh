// Compile-time configuration of one kernel variant: K and V code paths (CodeLayout.kernel_variant and chunk /
// bits), head dim, outliers, model dtype, V gather skew.  Everything else is derived here.
#pragma once
#include "maps.cuh"

namespace tkvc {

constexpr int code_bytes_c(int method, int l_or_bits, int D) { return method == SCALAR ? D * l_or_bits : 8 * D / l_or_bits; }

template <int KM_, int KL_, int VM_, int VL_, int D_, bool OUTL_, bool BF16_, bool VSKEW_>
struct Cfg {
  static constexpr int KM = KM_, KL = KL_, VM = VM_, VL = VL_, D = D_;
  static constexpr bool OUTL = OUTL_, BF16 = BF16_, VSKEW = VSKEW_;
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static constexpr int HD = D / 2;
  static constexpr int WPT = D / SLICE;  // warps per tile (a unit): each decodes a 64-channel slice
  static constexpr int KKC = KM == SCALAR ? (1 << KL) : 256;  // centroids per codebook
  static constexpr int VKC = VM == SCALAR ? (1 << VL) : 256;
  static constexpr int KVEC = KM == SCALAR ? 1 : KL;  // halves per codebook entry
  static constexpr int VVEC = VM == SCALAR ? 1 : VL;
  static constexpr int KG = D / KVEC;  // codebook groups (scalar: one per channel)
  static constexpr int VG = D / VVEC;
  static constexpr int KCB = code_bytes_c(KM, KL, D);  // code bytes per block
  static constexpr int VCB = code_bytes_c(VM, VL, D);
  static constexpr int KTAB = KG * KKC * KVEC * 2;  // shared-memory table bytes
  static constexpr int VTAB = VG * VKC * VVEC * 2;
  static constexpr int VMAP = VM == TEMPORAL ? VL : 4;  // chunk of v_channel's map
  static constexpr bool KTOK = KM == TEMPORAL;  // K math on fp16 pairs along tokens (else along channels)
  static constexpr bool XCHG = WPT > 1 || OUTL;  // scores go through shared memory (pair sum / outlier corrections)
};

}  // namespace tkvc
