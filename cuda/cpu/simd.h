// A float32 SIMD vector for the CPU kernels, written with GCC/Clang vector extensions so the same
// source compiles to AVX-512, AVX2 or SSE2 depending on the flags of the including file.
// JF_SIMD_LANES (16, 8 or 4) is set by that file; see kernels_isa.cc.
#pragma once

#include <cstdint>
#include <cstring>

#ifndef JF_SIMD_LANES
#error "JF_SIMD_LANES must be defined by the translation unit that includes simd.h"
#endif

namespace jax_flash::cpu::JF_ISA {

inline constexpr int kLanes = JF_SIMD_LANES;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }
// x in every lane. (Not `Vec{} + x`: 0 + x is not x for x = -0, so the compiler must add before
// it broadcasts; in the tile products that put an add beside every two FMAs. x - 0 is x for every
// x, and compiles to a bare broadcast.)
inline Vec splat(float x) { return x - Vec{}; }
inline float reduce_max(Vec v) {
  float r = v[0];
  for (int i = 1; i < kLanes; ++i) r = v[i] > r ? v[i] : r;
  return r;
}
inline float reduce_sum(Vec v) {
  float r = 0.f;
  for (int i = 0; i < kLanes; ++i) r += v[i];
  return r;
}
inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }
// min(a, 0), keeping a NaN NaN.
inline Vec vmin0(Vec a) { return a > 0.f ? Vec{} : a; }

// 2^x for x <= 0 (the softmax only needs that side), about 2 ulp: x clamped at -127, split into
// an integer n and a fraction f in [-0.5, 0.5] by the round-to-nearest of adding 1.5 * 2^23 (whose
// low mantissa bits are then n), a degree-6 Taylor polynomial for 2^f, times 2^n made from n's
// bits. n = -127 makes that factor +0, so inputs at or below -127 (including -inf) give exactly
// 0; NaN gives NaN (it survives the clamp, the rounding and the product). 13 vector operations,
// no compare, blend or int/float conversion: it sits beside the tile products' FMAs.
inline Vec exp2_nonpositive(Vec x) {
  const Vec lo = splat(-127.f);
  x = lo > x ? lo : x;  // max(-127, x), keeping a NaN x
  const Vec magic = splat(12582912.f);  // 1.5 * 2^23
  const Vec t = x + magic;
  const Vec n = t - magic;
  const Vec f = x - n;
  Vec p = splat(1.5403530e-4f);
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  IVec bits;
  std::memcpy(&bits, &t, sizeof(bits));
  // bits(t) = bits(magic) + n; the exponent field of 2^n is n + 127.
  bits = (bits - (0x4B400000 - 127)) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace jax_flash::cpu::JF_ISA
