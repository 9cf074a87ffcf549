"""`bias` and `mask` arrays on the XLA paths that take them ("blockwise" and "xla"; the "cpu"
kernel's: tests/test_bias_mask_kernel.py), against
jax.nn.dot_product_attention: the output and the gradients of q, k, v and the bias, for every
way the arrays broadcast (B|1, N|1, T|1, S|1, and fewer dims), with GQA, T != S, block edges
anywhere and jax_flash's own masks on top. Float32 inputs: the tolerance is the floor of the
FlashAttention rule (attention_testing.py), 1e-5 of the largest reference value plus 1e-6.

jax.nn gives a row with no key to attend to the mean of the values and jax_flash gives 0; the
random cases keep every live row's diagonal key, and test_row_masked_out_gives_zero checks the
empty rows."""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_flash
from jax_flash import _blockwise

B, T, S, N, K, H = 2, 21, 30, 4, 2, 8
XLA_PATHS = ("blockwise", "xla")


@pytest.fixture(autouse=True)
def _exact_float32():
  with jax.default_matmul_precision("highest"):
    yield


def _inputs(seed: int, dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (B, T, N, H), dtype)
  k = jax.random.normal(keys[1], (B, S, K, H), dtype)
  v = jax.random.normal(keys[2], (B, S, K, H), dtype)
  g = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
  return q, k, v, g


def _logit_shape(full: tuple[bool, bool, bool, bool], rank: int) -> tuple[int, ...]:
  """The (B|1, N|1, T|1, S|1) shape `full` picks, with its leading dims dropped down to `rank`
  where they are 1 (jax.nn prepends them again)."""
  shape = tuple(n if f else 1 for n, f in zip((B, N, T, S), full))
  while len(shape) > rank and shape[0] == 1:
    shape = shape[1:]
  return shape


def _loss_and_grads(attention, q, k, v, bias, g):
  """attention's output, and the gradients of sum(out * g) in q, k, v and the bias."""
  def loss(q, k, v, bias):
    out = attention(q, k, v, bias)
    return jnp.sum(out.astype(jnp.float32) * g), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
  return out, grads


def _jax_nn(mask, **options):
  """jax.nn.dot_product_attention on float32 inputs with the kv heads repeated (GQA)."""
  def attention(q, k, v, bias):
    k, v = (jnp.repeat(x, N // K, axis=2).astype(jnp.float32) for x in (k, v))
    return jax.nn.dot_product_attention(q.astype(jnp.float32), k, v, bias, mask,
                                        implementation="xla", **options)
  return attention


def _assert_close(name, got, want, magnitude=None):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  magnitude = float(np.max(np.abs(want))) if magnitude is None else magnitude
  np.testing.assert_array_less(np.max(np.abs(got - want)), 1e-5 * magnitude + 1e-6 + 1e-12,
                               err_msg=name)


full_dims = st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=40, deadline=None)
@given(implementation=st.sampled_from(XLA_PATHS), bias_dims=st.none() | full_dims,
       bias_rank=st.integers(1, 4), mask_dims=st.none() | full_dims, mask_rank=st.integers(2, 4),
       block=st.sampled_from([1, 7, 16, 512]), is_causal=st.booleans(),
       window=st.none() | st.tuples(st.integers(0, 12), st.integers(0, 12)),
       q_lens=st.none() | st.tuples(st.integers(0, T), st.integers(0, T)),
       kv_lens=st.none() | st.tuples(st.integers(T, S), st.integers(T, S)),
       seed=st.integers(0, 2**16))
def test_bias_and_mask_match_jax_nn(implementation, bias_dims, bias_rank, mask_dims, mask_rank,
                                    block, is_causal, window, q_lens, kv_lens, seed):
  q, k, v, g = _inputs(seed)
  bias = mask = None
  if bias_dims is not None:
    bias = jax.random.normal(jax.random.PRNGKey(seed + 1), _logit_shape(bias_dims, bias_rank))
  if mask_dims is not None:
    mask = jax.random.bernoulli(jax.random.PRNGKey(seed + 2), 0.6, _logit_shape(mask_dims, mask_rank))
    # Every live row keeps its diagonal key (which no causal, window or kv length here hides),
    # so no row is empty: a (T, S) mask gets the diagonal, a per-key one the first T keys, and
    # one without a key dim (a whole row on or off) is all on.
    if not mask_dims[3]:
      mask = jnp.ones_like(mask)
    elif mask_dims[2]:
      mask = mask | jnp.eye(T, S, dtype=bool)
    else:
      mask = mask | (jnp.arange(S) < T)
  options = dict(is_causal=is_causal, local_window_size=window,
                 query_seq_lengths=None if q_lens is None else jnp.array(q_lens, jnp.int32),
                 key_value_seq_lengths=None if kv_lens is None else jnp.array(kv_lens, jnp.int32))
  if bias is None:  # a zero bias keeps one code path for the gradient check
    bias = jnp.zeros((1, 1, 1, 1))

  def ours(q, k, v, bias):
    return jax_flash.dot_product_attention(q, k, v, bias, mask, implementation=implementation,
                                           **options)

  with mock.patch.object(_blockwise, "KEY_BLOCK", block):
    out, grads = _loss_and_grads(ours, q, k, v, bias, g)
  want_out, want_grads = _loss_and_grads(_jax_nn(mask, **options), q, k, v, bias, g)
  _assert_close("out", out, want_out)
  magnitude = max(float(np.max(np.abs(x))) for x in want_grads)
  for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
    assert got.shape == want.shape, name
    _assert_close(name, got, want, magnitude)


@pytest.mark.parametrize("implementation", XLA_PATHS)
def test_row_masked_out_gives_zero(implementation):
  """A row the mask empties gives a zero output and adds nothing to any gradient (jax.nn would
  average the values there); the other rows are unaffected."""
  q, k, v, g = _inputs(0)
  mask = jnp.ones((B, N, T, S), bool).at[:, 2, 5].set(False)  # query 5 of head 2, every batch
  bias = jax.random.normal(jax.random.PRNGKey(1), (1, N, T, S))

  def ours(q, k, v, bias):
    return jax_flash.dot_product_attention(q, k, v, bias, mask, implementation=implementation)

  out, (dq, dk, dv, dbias) = _loss_and_grads(ours, q, k, v, bias, g)
  assert np.all(np.asarray(out[:, 5, 2]) == 0)
  assert np.all(np.asarray(dq[:, 5, 2]) == 0) and np.all(np.asarray(dbias[0, 2, 5]) == 0)
  for x in (out, dq, dk, dv, dbias):
    assert np.all(np.isfinite(np.asarray(x)))
  # With the cotangent of the empty row zeroed, the rest is jax.nn's.
  g = g.at[:, 5, 2].set(0.0)
  want_out, want_grads = _loss_and_grads(_jax_nn(mask), q, k, v, bias, g)
  _, grads = _loss_and_grads(ours, q, k, v, bias, g)
  _assert_close("out", out, want_out.at[:, 5, 2].set(0.0))
  magnitude = max(float(np.max(np.abs(x))) for x in want_grads)
  for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
    _assert_close(name, got, want, magnitude)


def test_bfloat16_jit_and_unbatched():
  """bfloat16 inputs (the bias is added in float32, as jax.nn does), under jit, and rank-3
  inputs whose bias has no batch dim."""
  q, k, v, _ = _inputs(3, jnp.bfloat16)
  bias = jax.random.normal(jax.random.PRNGKey(4), (N, T, S), jnp.bfloat16)
  mask = jnp.tril(jnp.ones((T, S), bool), k=S - T)
  f = jax.jit(lambda q, k, v, bias: jax_flash.dot_product_attention(
      q, k, v, bias, mask, implementation="blockwise"))
  want = _jax_nn(mask)(q, k, v, bias)
  np.testing.assert_allclose(np.asarray(f(q, k, v, bias), np.float32), np.asarray(want),
                             atol=3e-2, rtol=3e-2)
  got = f(q[0], k[0], v[0], bias)  # unbatched: (T, N, H) with a (N, T, S) bias
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want[0]), atol=3e-2,
                             rtol=3e-2)


def test_blockwise_memory_stays_linear_with_a_key_bias():
  """A bias without a (T, S) dim adds no (T, S) buffer: the blockwise path's temp memory still
  grows linearly with the sequence (ALiBi-like per-key biases, key masks)."""
  def temp_bytes(seq: int) -> int:
    x = jax.ShapeDtypeStruct((1, seq, 4, 64), jnp.float32)
    bias = jax.ShapeDtypeStruct((1, 4, 1, seq), jnp.float32)

    def loss(q, k, v, bias):
      out = jax_flash.dot_product_attention(q, k, v, bias, mask=jnp.ones((1, 1, 1, seq), bool),
                                            implementation="blockwise")
      return jnp.sum(out)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, x, x, bias).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
      pytest.skip("compiled.memory_analysis() returns None on this jax/backend")
    return analysis.temp_size_in_bytes

  with mock.patch.object(_blockwise, "KEY_BLOCK", 256):
    temps = {seq: temp_bytes(seq) for seq in (1024, 2048, 4096)}
  assert temps[4096] / temps[1024] <= 4.5, temps  # linear: 4, quadratic: 16
