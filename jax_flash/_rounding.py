"""The backward's residual o at better than 16-bit precision for one byte more an element.

The backward forms delta = rowsum(dO * O). From O rounded to bfloat16/float16 that sum carries
the rounding's error into every dS of the row, coherently, and dq/dk miss the accuracy rule on
peaked softmaxes (issue 13; examples/results/h200/session9/differential_cuda_analysis.md). A
float32 residual fixes it at 4 bytes an element; this keeps the 16-bit o the caller gets (2
bytes) plus an int8 `k`, o's rounding error in units of 1/256 of the 16-bit ulp:

    o ~= hi + k * step(hi),    step(hi) = ulp(hi) / 256,    k = rint((o - hi) / step) in [-128, 127]

which holds about 8 more significant bits (16 for bfloat16, 19 for float16): as good as float32 for
delta. The CUDA forward's epilogue writes it (cuda/common/rounding_residual.h, bit for bit
split_rounding); join_rounding gives the float32 o back, from which XLA forms the CUDA
backward's delta and the paths that need float32 o take it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Explicit mantissa bits of each 16-bit dtype, and the smallest float32 exponent field a step is
# built from: float16's smallest normal (below it the ulp stays that of its subnormals); for
# bfloat16 the field whose step is float32's smallest normal, 2^-126, since XLA flushes float32
# subnormals to zero (values under ~2^-111 then keep less than 8 extra bits: nothing in an
# attention output).
_MANTISSA_BITS = {jnp.dtype(jnp.bfloat16): 7, jnp.dtype(jnp.float16): 10}
_MIN_EXPONENT_FIELD = {jnp.dtype(jnp.bfloat16): 16, jnp.dtype(jnp.float16): 127 - 14}
# k's unit: 1/256 of hi's ulp.
STEP_BITS = 8


def _step(hi32: jax.Array, dtype) -> jax.Array:
  """ulp(hi) / 256 in float32, from hi's float32 exponent field (a normal power of two, built
  from its bits: jnp.ldexp lowers to frexp and a float power per element, which made this
  element-wise pass over o, the size of the output, compute-heavy)."""
  field = (jax.lax.bitcast_convert_type(hi32, jnp.uint32) >> 23) & 0xFF
  field = jnp.maximum(field, jnp.uint32(_MIN_EXPONENT_FIELD[jnp.dtype(dtype)]))
  # The step's exponent field, field - (mantissa bits + STEP_BITS): at least 1 (the minimum
  # field above keeps the step normal), at most 255 - 15 (inf and NaN's field 255 give a finite
  # step, which split_rounding does not use there).
  step_field = field - jnp.uint32(_MANTISSA_BITS[jnp.dtype(dtype)] + STEP_BITS)
  return jax.lax.bitcast_convert_type(step_field << 23, jnp.float32)


def widen_exactly(hi: jax.Array) -> jax.Array:
  """hi (bfloat16 or float16) as float32, exactly, by integer operations on its bits. Not
  hi.astype(float32): under its default xla_allow_excess_precision, XLA's GPU pipeline drops a
  float32 -> 16-bit -> float32 convert pair (SimplifyFPConversions), which inside
  split_rounding would make the error o32 - hi32 zero and every k 0."""
  dtype = jnp.dtype(hi.dtype)
  bits = jax.lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32)
  if dtype == jnp.dtype(jnp.bfloat16):  # bfloat16 is float32's upper half
    return jax.lax.bitcast_convert_type(bits << 16, jnp.float32)
  sign, exponent, mantissa = bits >> 15, (bits >> 10) & 0x1F, bits & 0x3FF
  # Normal numbers rebias the exponent (127 - 15); inf and NaN keep the all-ones exponent.
  field = jnp.where(exponent == 0x1F, jnp.uint32(0xFF), exponent + (127 - 15))
  wide = jax.lax.bitcast_convert_type((sign << 31) | (field << 23) | (mantissa << 13), jnp.float32)
  # Zeros and subnormals: mantissa * 2^-24, exact in float32.
  signed = jnp.where(sign == 1, -1.0, 1.0).astype(jnp.float32)
  small = signed * mantissa.astype(jnp.float32) * np.float32(2.0**-24)
  return jnp.where(exponent == 0, small, wide)


def split_rounding(o32: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """(hi, k): o32 rounded to `dtype` (bfloat16 or float16), and its rounding error as int8 in
  units of step(hi). Where hi is not finite (inf, NaN, overflow), k is 0 and hi says it all."""
  dtype = jnp.dtype(dtype)
  if dtype not in _MANTISSA_BITS:
    raise ValueError(f"split_rounding takes bfloat16 or float16; got {dtype}")
  hi = o32.astype(dtype)
  hi32 = widen_exactly(hi)
  error = o32 - hi32  # exact: the part of o32 the rounding dropped
  k = jnp.clip(jnp.round(error / _step(hi32, dtype)), -128, 127)
  k = jnp.where(jnp.isfinite(hi32) & jnp.isfinite(error), k, 0)
  return hi, k.astype(jnp.int8)


def join_rounding(hi: jax.Array, k: jax.Array) -> jax.Array:
  """float32 o from split_rounding's (hi, k): hi + k step(hi), exact in float32."""
  hi32 = hi.astype(jnp.float32)
  return hi32 + k.astype(jnp.float32) * _step(hi32, hi.dtype)


def relative_precision(dtype) -> float:
  """The worst relative error of join_rounding(*split_rounding(x)) for normal x: one step over
  the smallest normal significand, 2^-(mantissa bits + STEP_BITS) (half a step from rounding k,
  a whole one where an error of +ulp/2 is clamped from k = 128 to 127)."""
  return float(np.ldexp(1.0, -(_MANTISSA_BITS[jnp.dtype(dtype)] + STEP_BITS)))
