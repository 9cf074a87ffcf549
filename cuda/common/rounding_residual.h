// The backward's residual o as its 16-bit value hi plus an int8 k, o's rounding error in units of
// step(hi) = ulp(hi) / 256 (jax_flash/_rounding.py says why): the CUDA forward's epilogue writes
// k (rounding_error), and XLA forms the backward's delta = rowsum(dO * O) from hi + k step(hi),
// exact in float32 (join_rounding here is its C++ twin). tests/test_rounding.py checks both
// against jax_flash/_rounding.py.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/attention_params.h"

namespace jax_flash {

// k's unit: 1/256 of hi's ulp (jax_flash._rounding.STEP_BITS).
inline constexpr int kRoundingStepBits = 8;

// step(hi) for hi (a bfloat16 or float16 value, given in float32): a power of two built from
// hi's exponent field, clamped as jax_flash._rounding clamps it (float16: the subnormals' ulp
// below its smallest normal; bfloat16: never below float32's smallest normal, 2^-126).
JF_HOST_DEVICE inline float rounding_step(float hi, bool float16) {
  uint32_t bits;
  std::memcpy(&bits, &hi, sizeof bits);
  int field = static_cast<int>((bits >> 23) & 0xFFu);
  const int min_field = float16 ? 127 - 14 : 1 + 7 + kRoundingStepBits;
  if (field < min_field) field = min_field;
  const int exponent = field - 127 - (float16 ? 10 : 7) - kRoundingStepBits;  // >= -126
  const uint32_t step_bits = static_cast<uint32_t>(exponent + 127) << 23;
  float step;
  std::memcpy(&step, &step_bits, sizeof step);
  return step;
}

// k of o = hi + k step(hi): o's rounding error o - hi (exact in float32) in steps of hi, rounded
// to nearest even and clamped to int8, 0 where hi or the error is not finite; hi is o rounded to
// the 16-bit dtype, given in float32. As jax_flash._rounding.split_rounding forms it.
// Branch-free (the forward's epilogue forms it for every element): k is formed whatever hi and
// the error are (a non-finite one gives a step like any other, fmin/fmax keep NaN out of the
// cast) and discarded at the end where they are not finite.
JF_HOST_DEVICE inline int8_t rounding_error(float o, float hi, bool float16) {
  const float error = o - hi;
  const bool finite = std::isfinite(hi) && std::isfinite(error);
  // error / step as error times 1 / step, exact: both powers of two, normal (the step's exponent
  // field is 1..240, its reciprocal's 254 minus that), so no division in the forward's epilogue.
  const float step = rounding_step(hi, float16);
  uint32_t step_bits, inverse_bits;
  std::memcpy(&step_bits, &step, sizeof step_bits);
  inverse_bits = (254u - (step_bits >> 23)) << 23;
  float inverse;
  std::memcpy(&inverse, &inverse_bits, sizeof inverse);
  const float k = std::fmin(std::fmax(std::rint(error * inverse), -128.f), 127.f);
  return finite ? static_cast<int8_t>(k) : int8_t{0};
}

// o in float32 from hi and k.
JF_HOST_DEVICE inline float join_rounding(float hi, int8_t k, bool float16) {
  return hi + static_cast<float>(k) * rounding_step(hi, float16);
}

}  // namespace jax_flash
