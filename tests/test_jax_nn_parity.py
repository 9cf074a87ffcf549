"""jax's own tests of jax.nn.dot_product_attention (jax tests/nn_test.py), run against jax_flash.

The cases of testDotProductAttention (GQA, vmap, return_residual with an lse cotangent),
testDotProductAttentionMask (bias, causal, padding, custom mask and their combinations, causal
sliding window), testDotProductAttentionFloat64MaskDebugInfs (jax issue 37422),
testDotProductAttentionBiasGradient and testDotProductAttention_localWindowSizeWithoutMask,
rewritten for jax_flash's implementations: where jax compares cuDNN with XLA within 0.01-0.02,
these compare every result with jax.nn by FlashAttention's rule (attention_testing.py: within
twice jax.nn's own error in the input dtype, against jax.nn on float32 inputs).

jax_flash's documented deviations (README, "Semantics that differ from jax.nn") are asserted as
such: a row with no key gives 0 and an lse of -3.4028235e38 (jax.nn: the mean of the values), the
lse is float32 (jax.nn: the input dtype); and the CUDA kernels take no bias or mask arrays by
default (they raise; experimental under JAX_FLASH_CUDA_LOGIT_ARRAYS=on), float64 is refused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from attention_testing import (assert_within_rule, gradient_magnitude, reference_in_dtype,
                               random_array)
from jax_flash._reference import EMPTY_ROW_LSE

F32 = jnp.float32
B, S, T, N, H = 2, 128, 128, 4, 32
IMPLEMENTATIONS = ["cpu", "xla", "blockwise",
                   pytest.param("cuda", marks=pytest.mark.gpu)]


def _normal(seed: int, shape, dtype) -> jax.Array:
  return random_array(np.random.default_rng(seed), shape, dtype)


def _numpy(tree):
  return jax.tree.map(lambda x: np.asarray(jnp.asarray(x, F32), np.float64), tree)


# ---------------------------------------------------------------------------------------------
# testDotProductAttention: GQA (K = N / G), with and without vmap, with return_residual and a
# cotangent for the lse too


GQA_CASES = [  # (dtype, G, vmap): every dtype, group size and vmap setting, in 4 cases
    ("bfloat16", 1, False),
    ("float16", 2, True),
    ("bfloat16", 4, True),
    ("float16", 4, False),
]


def _gqa_inputs(dtype: str, group: int):
  dtype = jnp.dtype(dtype)
  q = _normal(0, (B, T, N, H), dtype)
  k = _normal(1, (B, S, N // group, H), dtype)
  v = _normal(2, (B, S, N // group, H), dtype)
  g = _normal(3, (B, T, N, H), dtype)
  g_lse = _normal(4, (B, T, N), dtype)
  return q, k, v, g, g_lse


def _vjp_results(attention, q, k, v, g, g_lse):
  """(out, lse, dq, dk, dv) of attention(q, k, v) -> (out, lse) for cotangents (g, g_lse)."""
  (out, lse), vjp = jax.vjp(attention, q, k, v)
  return (out, lse, *vjp((g.astype(out.dtype), g_lse.astype(lse.dtype))))


@functools.lru_cache(maxsize=None)
def _gqa_references(dtype: str, group: int):
  """jax.nn's results on float32 inputs and in the input dtype, with K and V repeated to N heads
  (as jax's test builds its reference; differentiating the repeat sums dK, dV over each
  group)."""
  q, k, v, g, g_lse = _gqa_inputs(dtype, group)

  def jax_nn(q, k, v):
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", return_residual=True)

  def in_dtype(q, k, v):
    if q.dtype == jnp.float16:  # jax.nn cannot run float16 products on the CPU (DESIGN.md)
      return reference_in_dtype(q, jnp.repeat(k, group, axis=2),
                                jnp.repeat(v, group, axis=2), return_residual=True)
    return jax_nn(q, k, v)

  upcast = [x.astype(F32) for x in (q, k, v, g, g_lse)]
  ref32 = _numpy(jax.jit(functools.partial(_vjp_results, jax_nn))(*upcast))
  refd = _numpy(jax.jit(functools.partial(_vjp_results, in_dtype))(q, k, v, g, g_lse))
  return ref32, refd


@pytest.mark.parametrize("dtype,group,use_vmap", GQA_CASES,
                         ids=[f"{d}-G{g}-{'vmap' if m else 'plain'}" for d, g, m in GQA_CASES])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dot_product_attention(implementation, dtype, group, use_vmap):
  q, k, v, g, g_lse = _gqa_inputs(dtype, group)

  def flash(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, implementation=implementation,
                                           return_residual=True)

  attention = jax.vmap(flash) if use_vmap else flash
  out, lse, dq, dk, dv = jax.jit(functools.partial(_vjp_results, attention))(q, k, v, g, g_lse)
  assert out.dtype == q.dtype and dq.dtype == q.dtype and dk.dtype == k.dtype
  # Deviation: the lse is float32 (jax.nn casts it to the input dtype).
  assert lse.dtype == F32 and lse.shape == (B, T, N)

  ref32, refd = _gqa_references(dtype, group)
  got = _numpy((out, lse, dq, dk, dv))
  grads = dict(zip(("dq", "dk", "dv"), ref32[2:]))
  for name, x, r32, rd in zip(("out", "lse", "dq", "dk", "dv"), got, ref32, refd):
    magnitude = gradient_magnitude(grads) if name.startswith("d") else None
    assert_within_rule(name, x, r32, rd, magnitude=magnitude)


# ---------------------------------------------------------------------------------------------
# testDotProductAttentionMask


MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"),
              ("bias", "causal"), ("causal", "sliding_window")]


def _mask_case(mode):
  """(args (q, k, v, bias, mask), options, g) of the mode, bfloat16 as in jax's test."""
  mode = (mode,) if isinstance(mode, str) else mode
  dtype = jnp.bfloat16
  q, k, v = (_normal(i, (B, T if i == 0 else S, N, H), dtype) for i in range(3))
  g = _normal(3, (B, T, N, H), dtype)
  bias = _normal(4, (1, N, T, S), dtype) if "bias" in mode else None
  mask = jnp.tril(jnp.ones((T, S), bool))[None, None] if "custom" in mode else None
  options = dict(is_causal="causal" in mode)
  if "padding" in mode:
    options["query_seq_lengths"] = jnp.array([T // 2, T // 4], jnp.int32)
    options["key_value_seq_lengths"] = jnp.array([S // 4, S // 2], jnp.int32)
  if "sliding_window" in mode:
    options["local_window_size"] = (3, 2) if options["is_causal"] else (3, 0)
  return (q, k, v, bias, mask), options, g


def _mask_vjp(attention, q, k, v, bias, mask, g):
  """(out, dq, dk, dv, dbias) of attention(q, k, v, bias, mask) for the cotangent g."""
  if bias is None:
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, None, mask), q, k, v)
    return (out, *vjp(g.astype(out.dtype)), None)
  out, vjp = jax.vjp(lambda q, k, v, b: attention(q, k, v, b, mask), q, k, v, bias)
  return (out, *vjp(g.astype(out.dtype)))


@functools.lru_cache(maxsize=None)
def _mask_references(mode):
  (q, k, v, bias, mask), options, g = _mask_case(mode)

  def jax_nn(q, k, v, bias, mask):
    return jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla", **options)

  run = jax.jit(functools.partial(_mask_vjp, jax_nn))
  up = lambda x: None if x is None else x.astype(F32)
  ref32 = _numpy(run(up(q), up(k), up(v), up(bias), mask, up(g)))
  refd = _numpy(run(q, k, v, bias, mask, g))
  return ref32, refd


@pytest.mark.parametrize("mode", MASK_MODES, ids=lambda m: m if isinstance(m, str) else "+".join(m))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_dot_product_attention_mask(implementation, mode):
  (q, k, v, bias, mask), options, g = _mask_case(mode)

  def flash(q, k, v, bias, mask):
    return jax_flash.dot_product_attention(q, k, v, bias, mask, implementation=implementation,
                                           **options)

  if (bias is not None or mask is not None) and implementation == "cuda":
    # Deviation: the CUDA kernels take no bias or mask arrays by default (experimental under
    # JAX_FLASH_CUDA_LOGIT_ARRAYS=on: tests/test_cuda_logit_arrays.py).
    with pytest.raises(NotImplementedError, match="bias or mask arrays"):
      flash(q, k, v, bias, mask)
    return

  got = _numpy(jax.jit(functools.partial(_mask_vjp, flash))(q, k, v, bias, mask, g))
  ref32, refd = _mask_references(mode)
  grads = dict(zip(("dq", "dk", "dv"), ref32[1:4]))
  for name, x, r32, rd in zip(("out", "dq", "dk", "dv", "dbias"), got, ref32, refd):
    if r32 is None:
      assert x is None, name
      continue
    magnitude = gradient_magnitude(grads) if name in grads else None
    assert_within_rule(name, x, r32, rd, magnitude=magnitude)


# ---------------------------------------------------------------------------------------------
# testDotProductAttentionFloat64MaskDebugInfs (jax issue 37422)


def _debug_infs_inputs(dtype):
  t, s, k, n, h = 5, 7, 3, 6, 11
  zeros = lambda *shape: jnp.zeros(shape, dtype)
  return zeros(t, n, h), zeros(s, k, h), zeros(s, k, h), jnp.arange(s) <= s // 2


@pytest.mark.parametrize("implementation", ["xla", "blockwise", "cpu"])
def test_mask_under_debug_infs(implementation):
  """Unbatched zero inputs with a (S,) mask under jax.debug_infs: no FloatingPointError and jax.nn's
  result. The kernels take the mask as what it is, key_value_seq_lengths (the first 4 keys)."""
  q, k, v, mask = _debug_infs_inputs(F32)
  want = jax.nn.dot_product_attention(q, k, v, mask=mask)
  with jax.debug_infs(True):
    if implementation == "cpu":
      got = jax_flash.dot_product_attention(
          q, k, v, key_value_seq_lengths=jnp.array([4], jnp.int32), implementation="cpu")
    else:
      got = jax_flash.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
    got.block_until_ready()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_float64_is_refused():
  """Deviation: jax.nn computes in float64 under x64; jax_flash takes float32, bfloat16 and
  float16, and says so."""
  with jax.enable_x64(True):
    q, k, v, mask = _debug_infs_inputs(jnp.float64)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16; got float64"):
      jax_flash.dot_product_attention(q, k, v, mask=mask, implementation="xla")


# ---------------------------------------------------------------------------------------------
# testDotProductAttentionBiasGradient


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("use_vmap", [False, True], ids=["plain", "vmap"])
@pytest.mark.parametrize("implementation", ["cpu", "xla", "blockwise"])
def test_dot_product_attention_bias_gradient(implementation, batch, use_vmap):
  """q = k = v = x, a full (B, N, S, S) bias and a (1, 1, S) mask of ones; under vmap each
  example is unbatched, (S, N, H) with an (N, S, S) bias. The output and dbias against jax.nn."""
  dtype = jnp.bfloat16
  x = _normal(0, (batch, S, N, H), dtype)
  bias = _normal(1, (batch, N, S, S), dtype)
  mask = jnp.ones((1, 1, S), bool)

  def attention(fn, x, bias):
    return fn(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

  def results(fn, x, bias):
    call = functools.partial(attention, fn)
    if use_vmap:
      call = jax.vmap(call, in_axes=(0, 0))
    out, vjp = jax.vjp(call, x, bias)
    return out, vjp(x)[1]

  flash = functools.partial(jax_flash.dot_product_attention, implementation=implementation)
  jax_nn = functools.partial(jax.nn.dot_product_attention, implementation="xla")
  got = _numpy(jax.jit(functools.partial(results, flash))(x, bias))
  ref32 = _numpy(jax.jit(functools.partial(results, jax_nn))(x.astype(F32), bias.astype(F32)))
  refd = _numpy(jax.jit(functools.partial(results, jax_nn))(x, bias))
  for name, a, r32, rd in zip(("out", "dbias"), got, ref32, refd):
    assert_within_rule(name, a, r32, rd)


# ---------------------------------------------------------------------------------------------
# testDotProductAttention_localWindowSizeWithoutMask


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_local_window_size_without_mask(implementation):
  dtype = F32 if implementation != "cuda" else jnp.bfloat16
  q, k, v = (_normal(i, (B, T if i == 0 else S, N, H), dtype) for i in range(3))
  large = jax_flash.dot_product_attention(q, k, v, local_window_size=(32, 32),
                                          implementation=implementation)
  small = jax_flash.dot_product_attention(q, k, v, local_window_size=(1, 1),
                                          implementation=implementation)
  assert not np.allclose(np.asarray(large, F32), np.asarray(small, F32))
  for window, got in (((32, 32), large), ((1, 1), small)):
    want = jax.nn.dot_product_attention(*(x.astype(F32) for x in (q, k, v)),
                                        local_window_size=window)
    np.testing.assert_allclose(np.asarray(got, F32), np.asarray(want), rtol=2e-2 if
                               dtype != F32 else 1e-5, atol=2e-2 if dtype != F32 else 1e-5)


# ---------------------------------------------------------------------------------------------
# The documented deviations


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_rows_without_keys_are_zero_not_the_mean_of_the_values(implementation):
  """key_value_seq_lengths of 0 for one batch element: jax.nn gives each of its rows the mean of
  the values (and an lse from its large negative fill); jax_flash gives 0 and -3.4028235e38,
  with no gradient. The other batch element is the same in both."""
  dtype = jnp.bfloat16
  q, k, v = (_normal(i, (2, 9, 4, 16), dtype) for i in range(3))
  lengths = jnp.array([9, 0], jnp.int32)
  out, lse = jax_flash.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                             return_residual=True, implementation=implementation)
  want_out, want_lse = jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=lengths, return_residual=True, implementation="xla")
  assert lse.dtype == F32 and want_lse.dtype == dtype  # lse: float32 here, bfloat16 there
  out, lse, want_out = (np.asarray(x, np.float64) for x in (out, lse, want_out))
  assert np.all(out[1] == 0) and np.all(lse[1] == EMPTY_ROW_LSE)
  mean_v = np.asarray(v[1], np.float64).mean(axis=0)  # (K, H), one per kv head
  np.testing.assert_allclose(want_out[1], np.broadcast_to(mean_v, want_out[1].shape), atol=1e-2)
  np.testing.assert_allclose(out[0], want_out[0], atol=2e-2, rtol=2e-2)
  dq = jax.grad(lambda q: jnp.sum(jax_flash.dot_product_attention(
      q, k, v, key_value_seq_lengths=lengths, implementation=implementation).astype(F32)))(q)
  assert not np.any(np.asarray(dq[1], F32))
