// 2^x on the FMA pipe, for the share of the forward's exponentials that the multi-function unit
// (MUFU, 16 results a clock per SM on Hopper) cannot take in time: at head dim 64 a block's 128 x 128
// exponentials take the MUFU as long as its two products take the tensor cores, so the softmax
// waits on it (FlashAttention-4 moves some of them to polynomials for the same reason).
//
// Range reduction by rounding to an integer j (the 1.5 * 2^23 shift), 2^(x - j) by a degree-4
// polynomial on [-1/2, 1/2] with p(0) = 1 exactly, then times 2^j built from j's bits. The
// coefficients are a minimax fit of the relative error made for this file (2.9e-6 in float32
// arithmetic: far below the 16-bit rounding P takes before P V, and about 25 float32 ulps for the
// sums). Below -127 the result is 0, as ex2.approx.ftz flushes it; NaN stays NaN.
#pragma once

namespace jax_flash::cuda {

__device__ __forceinline__ float exp2_on_fma_pipe(float x) {
  // 1.5 * 2^23 + 127: x + kShift holds round(x) + 127 in its low mantissa bits.
  constexpr float kShift = 12583039.f;
  float clamped;  // max(x, -127), NaN kept (fmaxf would drop it)
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(clamped) : "f"(x), "f"(-127.f));
  const float shifted = __fadd_rn(clamped, kShift);
  const float j = __fsub_rn(shifted, kShift);
  const float f = __fsub_rn(clamped, j);  // in [-1/2, 1/2]
  float p = 0.009582829661667347f;
  p = fmaf(p, f, 0.055906400084495544f);
  p = fmaf(p, f, 0.24024099111557007f);
  p = fmaf(p, f, 0.6931241750717163f);
  p = fmaf(p, f, 1.f);
  // (round(x) + 127) << 23 is 2^round(x) (the shift's own bits move out); 0 at -127 (and for NaN,
  // whose p is NaN).
  return p * __int_as_float(__float_as_int(shifted) << 23);
}

}  // namespace jax_flash::cuda
