"""The backward's 16-bit-plus-int8 residual o (jax_flash/_rounding.py, issue 13 item 2): its
precision, its edge values, and the C++ encoder and decoder the CUDA forward's epilogue uses
(cuda/common/rounding_residual.h, compiled here into a small program) against the Python one."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash import _rounding

ROOT = pathlib.Path(__file__).resolve().parent.parent
DTYPES = [jnp.bfloat16, jnp.float16]
# Where the stated precision starts: float16's smallest normal; for bfloat16 the magnitude from
# which a step stays a normal float32 (jax_flash._rounding clamps it there: XLA flushes float32
# subnormals).
SMALLEST_NORMAL = {jnp.bfloat16: 2.0**-110, jnp.float16: 2.0**-14}


def _values(dtype, count=50_000, seed=0):
  """Random float32 values over the dtype's whole normal range, both signs, plus ties (values
  exactly half an ulp between two 16-bit numbers) and powers of two."""
  rng = np.random.default_rng(seed)
  top = 60000.0 if dtype == jnp.float16 else 1e38
  magnitude = np.exp(rng.uniform(np.log(SMALLEST_NORMAL[dtype]), np.log(top), count))
  x = (magnitude * rng.choice([-1.0, 1.0], count)).astype(np.float32)
  hi = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
  # Midpoints between neighbouring 16-bit values (an error of exactly half an ulp: k = +-128,
  # clamped to 127 on one side), and powers of two (the ulp changes there).
  above = np.asarray(jnp.asarray(np.abs(hi) * np.float32(1.01)).astype(dtype).astype(jnp.float32))
  ties = (np.sign(hi) * (np.abs(hi) + (above - np.abs(hi)) / 2)).astype(np.float32)
  twos = np.ldexp(np.float32(1), np.arange(-10, 10)).astype(np.float32)
  return np.concatenate([x, hi, ties, twos, -twos])


@pytest.mark.parametrize("dtype", DTYPES)
def test_join_recovers_float32_to_the_stated_precision(dtype):
  x = _values(dtype)
  hi, k = _rounding.split_rounding(jnp.asarray(x), dtype)
  assert hi.dtype == dtype and k.dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(hi), np.asarray(jnp.asarray(x).astype(dtype)))
  joined = np.asarray(_rounding.join_rounding(hi, k))
  relative = np.abs(joined - x) / np.abs(x)
  assert relative.max() <= _rounding.relative_precision(dtype), relative.max()
  # Far better than the 16-bit value alone (about 2^8 times, on average).
  alone = np.abs(np.asarray(hi.astype(jnp.float32)) - x) / np.abs(x)
  assert relative.mean() < alone.mean() / 100, (relative.mean(), alone.mean())


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_values_inf_nan_and_zero(dtype):
  overflows = 7e4 if dtype == jnp.float16 else np.finfo(np.float32).max  # to inf in `dtype`
  x = jnp.asarray([0.0, -0.0, 1.0, -2.5, jnp.inf, -jnp.inf, jnp.nan, overflows], jnp.float32)
  hi, k = _rounding.split_rounding(x, dtype)
  np.testing.assert_array_equal(np.asarray(k), 0)  # exact values need no correction; non-finite hi none
  joined = np.asarray(_rounding.join_rounding(hi, k))
  expected = np.asarray(x.astype(dtype).astype(jnp.float32))
  np.testing.assert_array_equal(joined, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_widen_exactly_is_the_conversion_on_every_bit_pattern(dtype):
  bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
  hi = jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype)
  got = np.asarray(jax.jit(_rounding.widen_exactly)(hi)).view(np.uint32)
  expected = np.asarray(hi.astype(jnp.float32)).view(np.uint32)
  finite = np.isfinite(np.asarray(hi.astype(jnp.float32)))
  np.testing.assert_array_equal(got[finite], expected[finite])
  assert np.isnan(got.view(np.float32)[~finite]).sum() == np.isnan(expected.view(np.float32)).sum()


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_under_jit_keeps_the_error(dtype):
  """Compiled as one program (on the GPU where there is one): XLA may drop a float32 -> 16-bit ->
  float32 convert pair there (xla_allow_excess_precision), which made every k 0 until
  split_rounding widened hi by bit operations."""
  x = _values(dtype, count=5000)
  hi, k = jax.jit(_rounding.split_rounding, static_argnums=1)(jnp.asarray(x), dtype)
  eager_hi, eager_k = _rounding.split_rounding(jnp.asarray(x), dtype)
  np.testing.assert_array_equal(np.asarray(hi), np.asarray(eager_hi))
  np.testing.assert_array_equal(np.asarray(k), np.asarray(eager_k))
  # The random values (the first 5000) are almost never 16-bit numbers: nearly all have an error.
  assert np.count_nonzero(np.asarray(k)[:5000]) > 4500


def test_refuses_other_dtypes():
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    _rounding.split_rounding(jnp.zeros(3, jnp.float32), jnp.float32)


def _check_program(tmp_path) -> pathlib.Path:
  """tests/cpp/rounding_residual_check.cc built (skips without a C++ compiler)."""
  compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if compiler is None:
    pytest.skip("no C++ compiler")
  binary = tmp_path / "rounding_residual_check"
  subprocess.run([compiler, "-std=c++17", "-O1", f"-I{ROOT / 'cuda'}",
                  str(ROOT / "tests" / "cpp" / "rounding_residual_check.cc"), "-o", str(binary)],
                 check=True)
  return binary


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernels_decoder_gives_the_same_float32(tmp_path, dtype):
  """Bit for bit, over random values, subnormal 16-bit values and the clamped tie (k = 127)."""
  binary = _check_program(tmp_path)
  x = _values(dtype, 5000, seed=1)
  if dtype == jnp.float16:  # its subnormals (normal float32 numbers)
    x = np.concatenate([x, np.float32(2.0**-14) * np.float32([0.3, 0.77, 0.01, 1.5])])
  hi, k = _rounding.split_rounding(jnp.asarray(x), dtype)
  hi32 = np.asarray(hi.astype(jnp.float32))
  k = np.asarray(k)
  lines = "".join(f"{h:08x} {int(c)} {int(dtype == jnp.float16)}\n"
                  for h, c in zip(hi32.view(np.uint32), k))
  out = subprocess.run([str(binary)], input=lines, check=True, capture_output=True, text=True).stdout
  native = np.array([int(w, 16) for w in out.split()], np.uint32)
  ours = np.asarray(_rounding.join_rounding(hi, jnp.asarray(k))).view(np.uint32)
  assert np.abs(k).max() == 127
  np.testing.assert_array_equal(native, ours)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernels_encoder_gives_the_same_error(tmp_path, dtype):
  """The CUDA forward's own split (rounding_error, which its epilogue applies to each element
  and its 16-bit rounding) gives split_rounding's k: over random values, ties (k = +-128
  clamped), values that overflow the 16-bit dtype, inf and NaN (k 0)."""
  binary = _check_program(tmp_path)
  x = _values(dtype, 5000, seed=2)
  big = 70000.0 if dtype == jnp.float16 else 3.4e38
  x = np.concatenate([x, np.float32([big, -big, np.inf, -np.inf, np.nan, 0.0, -0.0])])
  hi, k = _rounding.split_rounding(jnp.asarray(x), dtype)
  hi32 = np.asarray(_rounding.widen_exactly(hi))
  lines = "".join(f"{a:08x} {h:08x} {int(dtype == jnp.float16)}\n"
                  for a, h in zip(x.view(np.uint32), hi32.view(np.uint32)))
  out = subprocess.run([str(binary), "encode"], input=lines, check=True, capture_output=True,
                       text=True).stdout
  native = np.array([int(w) for w in out.split()], np.int64)
  assert {-128, 127} <= set(np.asarray(k).tolist())
  np.testing.assert_array_equal(native, np.asarray(k, np.int64))
