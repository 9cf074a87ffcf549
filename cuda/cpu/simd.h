// A float32 SIMD vector for the CPU kernels, written with GCC/Clang vector extensions so the same
// source compiles to AVX-512, AVX2 or SSE2 depending on the flags of the including file.
// JF_SIMD_LANES (16, 8 or 4) is set by that file; see kernels_isa.cc.
#pragma once

#include <cstdint>
#include <cstring>

#if JF_SIMD_LANES == 16 && defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// 2^x for x <= 0 (the softmax only needs that side), about 2 ulp: x split into an integer n and a
// fraction f in [-0.5, 0.5] by rounding to nearest, a degree-6 Taylor polynomial for 2^f, times
// 2^n. Inputs at or below -127 (including -inf) give exactly 0 (below -126 with AVX-512 the
// subnormal 2^x, down to -149); NaN gives NaN. No compare, blend or int/float conversion: it
// sits beside the tile products' FMAs.
//
// With AVX-512 (10 vector operations): n = roundscale(x), f = max(x - n, -1) (x = -inf gives
// f = NaN, and vmaxps returns its second operand where the first is NaN: f = -1), and
// scalef(p, n) = p 2^n, which is +0 for n = -inf and NaN for a NaN n. Elsewhere (13): x clamped
// at -127, n from the low mantissa bits of x + 1.5 * 2^23, 2^n built from n's bits (n = -127
// gives the factor +0). For x in [-126, 0] both give the same bits.
inline Vec exp2_polynomial(Vec f) {
  Vec p = splat(1.5403530e-4f);
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  return p;
}

#if JF_SIMD_LANES == 16 && defined(__AVX512F__)
inline Vec exp2_nonpositive(Vec x) {
  const __m512 xm = reinterpret_cast<__m512>(x);
  const __m512 n = _mm512_roundscale_ps(xm, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_max_ps(_mm512_sub_ps(xm, n), _mm512_set1_ps(-1.f));
  const Vec p = exp2_polynomial(reinterpret_cast<Vec>(f));
  return reinterpret_cast<Vec>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), n));
}
#else
inline Vec exp2_nonpositive(Vec x) {
  const Vec lo = splat(-127.f);
  x = lo > x ? lo : x;  // max(-127, x), keeping a NaN x
  const Vec magic = splat(12582912.f);  // 1.5 * 2^23
  const Vec t = x + magic;
  const Vec n = t - magic;
  const Vec p = exp2_polynomial(x - n);
  IVec bits;
  std::memcpy(&bits, &t, sizeof(bits));
  // bits(t) = bits(magic) + n; the exponent field of 2^n is n + 127.
  bits = (bits - (0x4B400000 - 127)) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
#endif

}  // namespace jax_flash::cpu::JF_ISA
