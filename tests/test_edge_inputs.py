"""Edge inputs (issue 13, item 4): empty arrays, sequence lengths in other integer dtypes and
scales that are finite doubles but not finite float32s. Each is checked against what
jax.nn.dot_product_attention does with it: the same results where jax.nn gives one, and a
ValueError naming the argument where jax.nn refuses (or would silently give NaN).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_flash
from attention_testing import random_array
from jax_flash._reference import EMPTY_ROW_LSE

IMPLEMENTATIONS = ["cpu", "xla", "blockwise"]


def pattern(*fragments: str) -> str:
  """A regex matching the literal fragments, in order, anywhere in the message."""
  return ".*".join(re.escape(f) for f in fragments)


def _outputs_and_grads(attention, q, k, v, g):
  """(out, lse, dq, dk, dv) of `attention` (returning (out, lse)) for the loss sum(out * g)."""

  def loss(q, k, v):
    out, lse = attention(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * g), (out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return (out, lse, *grads)


# ---------------------------------------------------------------------------------------------
# Empty arrays: batch, query length, key length or query heads 0


EMPTY_SHAPES = [
    # (id, q shape, k shape, is_causal, dtype)
    ("batch0", (0, 6, 4, 16), (0, 5, 2, 16), False, "float32"),
    ("batch0_bf16_causal_one_head", (0, 3, 1, 8), (0, 3, 1, 8), True, "bfloat16"),
    ("queries0", (2, 0, 4, 16), (2, 5, 2, 16), False, "float32"),
    ("keys0", (2, 6, 4, 16), (2, 0, 2, 16), True, "bfloat16"),
    ("query_heads0", (2, 6, 0, 16), (2, 5, 1, 16), False, "float32"),
    ("unbatched_queries0", (0, 4, 16), (5, 2, 16), False, "float32"),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("q_shape,k_shape,causal,dtype", [s[1:] for s in EMPTY_SHAPES],
                         ids=[s[0] for s in EMPTY_SHAPES])
def test_empty_inputs_give_what_jax_nn_gives(rng, implementation, q_shape, k_shape, causal,
                                             dtype):
  """Output, lse and every gradient shaped (and typed) as jax.nn's, all zero; rows with no keys
  carry EMPTY_ROW_LSE. Batch 0 under jax.grad raised a bare ZeroDivisionError on "cpu" (the dQ
  split count divided by batch x heads) and on "blockwise" (a reshape by -1 of an empty array)
  before the fix."""
  dtype = jnp.dtype(dtype)
  q = random_array(rng, q_shape, dtype)
  k = random_array(rng, k_shape, dtype)
  v = random_array(rng, k_shape, dtype)
  g = random_array(rng, q_shape, jnp.float32)

  def flash(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, is_causal=causal, return_residual=True,
                                           implementation=implementation)

  def jax_nn(q, k, v):
    return jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                        v.astype(jnp.float32), is_causal=causal,
                                        return_residual=True, implementation="xla")

  for run in (lambda f: _outputs_and_grads(f, q, k, v, g),
              lambda f: jax.jit(_outputs_and_grads, static_argnums=0)(f, q, k, v, g)):
    got, want = run(flash), run(jax_nn)
    for name, x, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
      assert x.shape == w.shape, (name, x.shape, w.shape)
      expected_dtype = jnp.float32 if name == "lse" else dtype
      assert x.dtype == expected_dtype, (name, x.dtype)
      if name == "lse":
        assert np.all(np.asarray(x) == EMPTY_ROW_LSE), name
      else:
        assert not np.any(np.asarray(x, np.float32)), name


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_batch0_with_lengths_and_window(rng, implementation):
  q = random_array(rng, (0, 6, 4, 16), jnp.float32)
  k = random_array(rng, (0, 9, 2, 16), jnp.float32)
  lengths = jnp.zeros((0,), jnp.int32)

  def loss(q, k, v):
    out = jax_flash.dot_product_attention(
        q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        local_window_size=(2, 1), is_causal=True, implementation=implementation)
    return jnp.sum(out)

  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, k)
  assert [d.shape for d in grads] == [q.shape, k.shape, k.shape]


def test_batch0_in_ring_attention(rng):
  """ring_attention inside shard_map with an empty batch: empty output and gradients."""
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
  spec = P(None, "seq", None, None)
  ring = jax.shard_map(
      lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="seq", is_causal=True,
                                               implementation="cpu"),
      mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  q = random_array(rng, (0, 8, 2, 16), jnp.float32)
  out = jax.jit(ring)(q, q, q)
  assert out.shape == q.shape
  grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v)), argnums=(0, 1, 2)))(q, q, q)
  assert [d.shape for d in grads] == [q.shape] * 3


def test_zero_heads_with_zero_kv_heads_is_refused(rng):
  """N = K = 0: jax.nn raises a bare ZeroDivisionError (N % K); jax_flash names the heads."""
  q = random_array(rng, (2, 6, 0, 16), jnp.float32)
  with pytest.raises(ValueError, match=pattern("N=0", "K=0", "query(2, 6, 0, 16)")):
    jax_flash.dot_product_attention(q, q, q)


# ---------------------------------------------------------------------------------------------
# Sequence lengths: int32 only, as in jax.nn


NON_INT32_LENGTHS = [np.uint8, np.int8, np.int16, np.uint16, np.uint32]


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
@pytest.mark.parametrize("dtype", NON_INT32_LENGTHS, ids=lambda d: np.dtype(d).name)
def test_lengths_of_other_integer_dtypes_are_refused(rng, name, dtype):
  """jax.nn takes int32 lengths only (a ValueError otherwise); so does jax_flash, naming the
  argument and the dtype, before it picks an implementation. Before the fix they were clipped
  in their own dtype, so a uint8 length of 200 with S = 300 computed as 44 (300 wraps to 44 in
  uint8) and an int8 100 as -56: silently wrong outputs."""
  q = random_array(rng, (1, 4, 2, 8), jnp.float32)
  k = random_array(rng, (1, 300, 1, 8), jnp.float32)
  lengths = np.array([200 if np.iinfo(dtype).max >= 200 else 100], dtype)
  with pytest.raises(ValueError, match=pattern(name, "int32", np.dtype(dtype).name)):
    jax.nn.dot_product_attention(q, k, k, **{name: lengths})
  with pytest.raises(ValueError, match=pattern(name, "int32", "got", np.dtype(dtype).name,
                                               ".astype(jnp.int32)")):
    jax_flash.dot_product_attention(q, k, k, **{name: lengths})


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
def test_int64_lengths_are_refused_under_x64(rng, name):
  with jax.enable_x64(True):
    q = random_array(rng, (1, 4, 2, 8), jnp.float32)
    lengths = np.array([3], np.int64)
    assert jnp.asarray(lengths).dtype == jnp.int64
    with pytest.raises(ValueError, match=pattern(name, "int32", "int64")):
      jax.nn.dot_product_attention(q, q, q, **{name: lengths})
    with pytest.raises(ValueError, match=pattern(name, "int32", "int64")):
      jax_flash.dot_product_attention(q, q, q, **{name: lengths})


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_int32_lengths_past_a_narrow_range_count_every_key(rng, implementation):
  """The lengths that wrapped in uint8/int8, given as int32 (and as Python ints, which become
  int32): 200 of S = 300 keys, query length 100 of 130, the same as jax.nn."""
  q = random_array(rng, (1, 130, 2, 8), jnp.float32)
  k = random_array(rng, (1, 300, 1, 8), jnp.float32)
  options = dict(query_seq_lengths=np.array([100], np.int32),
                 key_value_seq_lengths=np.array([200], np.int32))
  want = jax.nn.dot_product_attention(q, k, k, implementation="xla", **options)
  for lengths in (options, {n: [int(x[0])] for n, x in options.items()}):
    got = jax_flash.dot_product_attention(q, k, k, implementation=implementation, **lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Scales that are not finite float32s


@pytest.mark.parametrize("scale", [1e39, -1e39, 3e38, 2.4e38, float(np.finfo(np.float64).max)],
                         ids=["1e39", "-1e39", "3e38", "2.4e38", "float64_max"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_scales_past_float32_are_refused(rng, scale, implementation):
  """1e39 is a finite double but inf in float32: it passed the finiteness check and gave an
  all-zero output on the kernels (jax.nn: NaN everywhere). 2.4e38 and 3e38 are finite float32s
  whose product with log2(e), which the kernels form, is not. All raise, naming the value."""
  q = random_array(rng, (1, 4, 2, 8), jnp.float32)
  with pytest.raises(ValueError, match=pattern("scale", "float32", "log2(e)", repr(scale))):
    jax_flash.dot_product_attention(q, q, q, scale=scale, implementation=implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_largest_float32_scales_run(rng, implementation):
  """Just below the bound the call runs and matches jax.nn (a small q, 2**-100, keeps the
  logits finite and every product of q and k a normal float32)."""
  q = random_array(rng, (1, 5, 2, 8), jnp.float32) * 2.0**-100
  k = random_array(rng, (1, 7, 2, 8), jnp.float32)
  for scale in (2.35e38, -2.35e38, float(np.float32(2.3586e38))):
    want = jax.nn.dot_product_attention(q, k, k, scale=scale, implementation="xla")
    got = jax_flash.dot_product_attention(q, k, k, scale=scale, implementation=implementation)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_ring_attention_refuses_scales_past_float32(rng):
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
  spec = P(None, "seq", None, None)
  ring = jax.shard_map(
      lambda q: jax_flash.ring_attention(q, q, q, axis_name="seq", scale=1e39,
                                         implementation="cpu"),
      mesh=mesh, in_specs=(spec,), out_specs=spec)
  with pytest.raises(ValueError, match=pattern("scale", "float32", "1e+39")):
    ring(random_array(rng, (1, 8, 2, 16), jnp.float32))


@pytest.mark.parametrize("scale", [0.0, -0.0, 1e-40, -1e-44, 1e-39], ids=str)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_zero_and_subnormal_scales(rng, scale, implementation):
  """A scale that is 0 or subnormal in float32 makes every logit 0 (XLA flushes subnormal
  products to 0): uniform attention over the visible keys, as jax.nn gives, and a NaN in a
  query row still makes that row NaN (0 * NaN), as in jax.nn. Before the fix the kernels got a
  subnormal scale as it was (which their handlers refuse), and a zero scale replaced q with
  zeros, so a NaN in it vanished."""
  q = np.array(random_array(rng, (1, 6, 2, 8), jnp.float32))
  k = random_array(rng, (1, 9, 1, 8), jnp.float32)
  v = random_array(rng, (1, 9, 1, 8), jnp.float32)
  q[0, 2, 1, 3] = np.nan
  options = dict(scale=scale, is_causal=True)
  want = np.asarray(jax.nn.dot_product_attention(q, k, v, implementation="xla", **options))
  got = np.asarray(jax_flash.dot_product_attention(q, k, v, implementation=implementation,
                                                   **options))
  assert np.all(np.isnan(got[0, 2, 1])) and np.all(np.isnan(want[0, 2, 1]))
  finite = np.isfinite(want)
  assert np.array_equal(np.isfinite(got), finite)
  np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)


# The kernels sum unnormalised weights times values and normalise once at the end (as
# FlashAttention does); with the running max as the reference, values near FLT_MAX / (weight
# bound x keys) overflowed there where jax.nn, normalising first, is finite. The CPU kernel's
# reference now keeps the row's sum below 2 (cpu/flash_fwd.h raised_reference); the blockwise
# path keeps its accumulator scaled by the running sum's power of two; the CUDA kernels take
# bfloat16 calls' weights 2^-(8 + ceil(log2 S)) smaller (common/attention_params.h
# pv_headroom_log2; float16 values cannot reach the limit).
@pytest.mark.parametrize("implementation", ["cpu", "blockwise", "xla"])
@pytest.mark.parametrize("seq_q, seq_k", [(4, 96), (100, 300)], ids=["decode", "tiled"])
def test_values_near_the_float32_limit(implementation, seq_q, seq_k):
  """Nearly uniform weights over 96 or 300 keys of values 1e37 (a sum of the unnormalised
  weights above 34 overflows): the CPU decode kernel (4 rows) and the tiled forward (100 rows,
  five key blocks, so the reference also rises between blocks)."""
  q = jax.random.normal(jax.random.key(0), (1, seq_q, 2, 32), jnp.float32)
  k = jax.random.normal(jax.random.key(1), (1, seq_k, 2, 32), jnp.float32) * 0.01
  v = jnp.full((1, seq_k, 2, 32), 1e37, jnp.float32)
  want = np.asarray(jax.nn.dot_product_attention(q, k, v))
  got = np.asarray(jax_flash.dot_product_attention(q, k, v, implementation=implementation))
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("differentiated", [False, True], ids=["plain", "for_backward"])
@pytest.mark.parametrize("seq_q, seq_k, head_dim", [(4, 96, 64), (100, 300, 128), (256, 8192, 128),
                                                    (1, 8192, 256)],
                         ids=["decode", "tiled", "long", "decode_long_hd256"])
def test_bfloat16_values_near_the_float32_limit_on_cuda(seq_q, seq_k, head_dim, differentiated):
  """The CUDA kernels (tiled forward, decode kernel; a differentiated call's forward, which
  keeps the sum of its rounded weights) on bfloat16 values 1e37: the nearly uniform weights'
  unnormalised sum times V passes FLT_MAX from 35 keys on. Gives V as jax.nn does."""
  q = jax.random.normal(jax.random.key(0), (1, seq_q, 2, head_dim), jnp.bfloat16)
  k = (jax.random.normal(jax.random.key(1), (1, seq_k, 2, head_dim), jnp.float32) * 0.01).astype(jnp.bfloat16)
  v = jnp.full((1, seq_k, 2, head_dim), 1e37, jnp.bfloat16)
  attention = lambda q: jax_flash.dot_product_attention(q, k, v, implementation="cuda")
  got = jax.vjp(attention, q)[0] if differentiated else attention(q)
  got = np.asarray(got.astype(jnp.float32))
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, float(v[0, 0, 0, 0]), rtol=1e-2)
