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
inline Vec splat(float x) { return Vec{} + x; }

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

// 2^x for x <= 0 (the softmax only needs that side), about 2 ulp: split x into integer n and
// fraction f in [-0.5, 0.5], a degree-6 Taylor polynomial for 2^f, n added to the exponent bits.
// Inputs below -126 (including -inf) give exactly 0; NaN gives NaN.
inline Vec exp2_nonpositive(Vec x) {
  const Vec lo = splat(-126.f);
  const auto underflow = x < lo;
  x = x < lo ? lo : x;
  const Vec n = __builtin_convertvector(__builtin_convertvector(x - 0.5f, IVec), Vec);
  // x - 0.5 truncated toward zero rounds to nearest for x <= 0 except exact halves: fine.
  const Vec f = x - n;
  Vec p = splat(1.5403530e-4f);
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  IVec bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += __builtin_convertvector(n, IVec) << 23;
  Vec r;
  std::memcpy(&r, &bits, sizeof(r));
  return underflow ? splat(0.f) : (x == x ? r : x);
}

}  // namespace jax_flash::cpu::JF_ISA
