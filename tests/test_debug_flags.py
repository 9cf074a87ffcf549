"""jax.debug_infs and jax.debug_nans (issue 13, item 5): finite inputs compute no inf and no NaN
anywhere, forward or backward, on every path, with every kind of mask.

Before the fix "blockwise" raised FloatingPointError under jax.debug_infs(True) on every call
(its scan started from a -inf running maximum) and "xla" on any call with a mask (masked scores
were set to -inf), although their outputs were finite: the regression jax guards jax.nn against
(jax issue 37422). float32 on a GPU runs "blockwise" by default, so it reached GPU users.

The tests run eagerly (outside jit), where the flags check the result of every primitive
(under jit only the outputs, re-running op by op when those are not finite); "blockwise" also
with key blocks of 8, so that its scan crosses blocks some rows see nothing of.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _blockwise
from attention_testing import random_array

B, T, S, N, K, H = 2, 13, 21, 4, 2, 8

MASKS = {
    "none": {},
    "causal": dict(is_causal=True),
    "lengths_with_empty_rows": dict(query_seq_lengths=np.array([13, 6], np.int32),
                                    key_value_seq_lengths=np.array([21, 0], np.int32)),
    "window": dict(local_window_size=(3, 1)),
    # T > S: causal rows past the keys, and a window that leaves early rows no key
    "window_right_of_every_key": dict(local_window_size=(0, 0), is_causal=True),
    "mask_and_bias": "arrays",
}


def _options(rng, name):
  options = MASKS[name]
  if options != "arrays":
    return dict(options)
  mask = rng.random((B, 1, T, S)) < 0.5
  mask[0, 0, 2] = False  # an empty row
  return dict(mask=jnp.asarray(mask), bias=random_array(rng, (N, T, S), jnp.float32))


def _forward_and_backward(implementation, q, k, v, g, options):
  bias = options.pop("bias", None)

  def loss(q, k, v, bias):
    out, lse = jax_flash.dot_product_attention(q, k, v, bias, implementation=implementation,
                                               return_residual=True, **options)
    return jnp.sum(out.astype(jnp.float32) * g), (out, lse)

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  return jax.value_and_grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("implementation,key_block", [("xla", None), ("blockwise", None),
                                                      ("blockwise", 8), ("cpu", None)],
                         ids=["xla", "blockwise", "blockwise_block8", "cpu"])
def test_finite_inputs_raise_nothing(rng, monkeypatch, mask, implementation, key_block):
  """Under jax.debug_infs(True) and jax.debug_nans(True): no FloatingPointError, forward or
  backward (bias gradient included), and finite results."""
  if implementation == "cpu" and mask == "mask_and_bias":
    pytest.skip("the kernels take no mask or bias arrays")
  if key_block is not None:
    monkeypatch.setattr(_blockwise, "KEY_BLOCK", key_block)
  seq_k = 7 if mask == "window_right_of_every_key" else S
  q = random_array(rng, (B, T, N, H), jnp.float32)
  k = random_array(rng, (B, seq_k, K, H), jnp.float32)
  v = random_array(rng, (B, seq_k, K, H), jnp.float32)
  g = random_array(rng, q.shape, jnp.float32)
  options = _options(rng, mask)
  with jax.debug_infs(True), jax.debug_nans(True):
    (_, (out, lse)), grads = _forward_and_backward(implementation, q, k, v, g, options)
    jax.block_until_ready((out, lse, grads))
  for x in (out, *grads):
    assert np.all(np.isfinite(np.asarray(x)))


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_results_where_finite_are_unchanged_by_the_flags(rng, implementation):
  """The flags change nothing in the results (they only check them)."""
  q = random_array(rng, (B, T, N, H), jnp.float32)
  k = random_array(rng, (B, S, K, H), jnp.float32)
  g = random_array(rng, q.shape, jnp.float32)
  options = dict(is_causal=True, key_value_seq_lengths=np.array([21, 5], np.int32))
  plain = _forward_and_backward(implementation, q, k, k, g, dict(options))
  with jax.debug_infs(True), jax.debug_nans(True):
    flagged = _forward_and_backward(implementation, q, k, k, g, dict(options))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(flagged)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
