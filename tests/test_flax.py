"""jax_flash.flax: the attention_fn and the ready NNX / Linen modules against Flax's stock ones.

With the same parameters, a flash module and the stock module agree in the forward pass and in
the gradients with respect to the inputs and every parameter, by FlashAttention's rule
(attention_testing.py): for each result x,

    max|x_flash - x_stock_f32| <= 2 * max|x_stock_dtype - x_stock_f32| + 1e-5 * M + 1e-6

where x_stock_f32 is the stock module computing in float32 on the same (float32) parameters and
inputs, x_stock_dtype the stock module computing in the test's dtype, M = max|x_stock_f32| for
the output and the largest |stock float32 gradient| over all gradients for the gradients. Flax's
modules round the projections to the computation dtype, so both sides carry that rounding.
"""

from __future__ import annotations

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from attention_testing import (assert_within_rule, max_abs, random_array,  # noqa: E402
                               simulate_cuda_host)

import jax_flash  # noqa: E402
from jax_flash import flax as jflax  # noqa: E402

F32 = jnp.float32
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
BATCH, SEQ_Q, SEQ_K, FEATURES, HEADS, KV_HEADS = 2, 17, 23, 64, 4, 2  # head dim 16
LAYERS = 3


def inputs(rng, seq_k=SEQ_K):
  """x_q (B, T, F), x_kv (B, S, F) and a cotangent g shaped like the output, all float32."""
  xq = random_array(rng, (BATCH, SEQ_Q, FEATURES), F32)
  xkv = random_array(rng, (BATCH, seq_k, FEATURES), F32)
  g = random_array(rng, (BATCH, SEQ_Q, FEATURES), F32)
  return xq, xkv, g


def as_numpy(out, grads) -> dict:
  """{"out": ..., "d<path>": ...} in float64, from an output and a pytree of gradients."""
  result = {"out": np.asarray(out.astype(F32), np.float64)}
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    result["d" + jax.tree_util.keystr(path)] = np.asarray(leaf.astype(F32), np.float64)
  return result


def assert_matches_stock(flash: dict, stock32: dict, stockd: dict) -> None:
  """The rule of the module docstring on the output and on every gradient."""
  assert flash.keys() == stock32.keys() == stockd.keys()
  grad_scale = max(max_abs(x) for name, x in stock32.items() if name != "out")
  for name, got in flash.items():
    assert np.all(np.isfinite(got)), f"{name} has non-finite elements"
    magnitude = None if name == "out" else grad_scale
    assert_within_rule(name, got, stock32[name], stockd[name], magnitude=magnitude)


def assert_close(got, want, name=""):
  """Equal up to float32 round-off: max|got - want| <= 1e-5 max|want| + 1e-6."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (name, got.shape, want.shape)
  err = max_abs(got - want)
  assert err <= 1e-5 * max_abs(want) + 1e-6, f"{name}: max abs error {err:.3g}"


def causal_mask(x):
  return nn.make_causal_mask(x[..., 0])


# ---------------------------------------------------------------------------------------------
# NNX


def nnx_mha(cls, dtype=F32, **kwargs):
  return cls(HEADS, FEATURES, dtype=dtype, decode=False, rngs=nnx.Rngs(0), **kwargs)


def nnx_results(model, xq, xkv, g, **call) -> dict:
  """Output and gradients (inputs and parameters) of sum(model(xq, xkv) * g), under nnx.jit."""

  @nnx.jit
  def run(model, xq, xkv):
    def loss(model, xq, xkv):
      out = model(xq, xkv, **call)
      return jnp.sum(out.astype(F32) * g), out

    grad_fn = nnx.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = grad_fn(model, xq, xkv)
    return out, grads

  out, grads = run(model, xq, xkv)
  assert out.dtype == (getattr(model, "dtype", None) or F32) and out.shape == g.shape
  return as_numpy(out, grads)


# bfloat16 once per API (its stock compiles are the slow part): NNX cross, Linen causal GQA.
@pytest.mark.parametrize("dtype, variant", [
    ("float32", "cross"), ("float32", "causal_gqa"), ("bfloat16", "cross")])
def test_nnx_module_matches_stock(rng, dtype, variant):
  causal = variant == "causal_gqa"
  kv_heads = KV_HEADS if causal else None  # stock NNX has num_kv_heads too
  stock32 = nnx_mha(nnx.MultiHeadAttention, num_kv_heads=kv_heads)
  stockd = nnx_mha(nnx.MultiHeadAttention, DTYPES[dtype], num_kv_heads=kv_heads)
  flash = nnx_mha(jflax.FlashMultiHeadAttention, DTYPES[dtype], num_kv_heads=kv_heads,
                  is_causal=causal)
  nnx.update(stockd, nnx.state(stock32))
  nnx.update(flash, nnx.state(stock32))
  xq, xkv, g = inputs(rng)
  if causal:
    xkv, stock_call = xq, dict(mask=causal_mask(xq))
  else:
    stock_call = {}
  ref32 = nnx_results(stock32, xq, xkv, g, **stock_call)
  refd = ref32 if dtype == "float32" else nnx_results(stockd, xq, xkv, g, **stock_call)
  assert_matches_stock(nnx_results(flash, xq, xkv, g), ref32, refd)


def nnx_stack(cls, **kwargs):
  """LAYERS attention layers with stacked parameters (leading axis: layer)."""

  @nnx.vmap(in_axes=0, out_axes=0)
  def create(key):
    return cls(HEADS, FEATURES, decode=False, rngs=nnx.Rngs(key), **kwargs)

  return create(jax.random.split(jax.random.key(1), LAYERS))


class ScannedStack(nnx.Module):
  """x <- x + attention(x) for each layer: nnx.scan over the stack, each step under nnx.remat."""

  def __init__(self, layers):
    self.layers = layers

  def __call__(self, x, _, **call):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def step(x, layer):
      return x + layer(x, **call)

    return step(x, self.layers)


def test_nnx_scan_and_remat_over_layers_matches_stock(rng):
  stock = nnx_stack(nnx.MultiHeadAttention)
  flash = nnx_stack(jflax.FlashMultiHeadAttention, is_causal=True)
  nnx.update(flash, nnx.state(stock))
  assert nnx.state(flash, nnx.Param)["query"]["kernel"].shape == (LAYERS, FEATURES, HEADS, 16)
  xq, _, g = inputs(rng)
  ref = nnx_results(ScannedStack(stock), xq, None, g, mask=causal_mask(xq))
  got = nnx_results(ScannedStack(flash), xq, None, g)
  assert_matches_stock(got, ref, ref)


@pytest.mark.parametrize("num_kv_heads", [None, KV_HEADS])
def test_nnx_state_moves_between_stock_and_flash(rng, num_kv_heads):
  kwargs = dict(num_kv_heads=num_kv_heads, normalize_qk=True)
  stock = nnx_mha(nnx.MultiHeadAttention, **kwargs)
  flash = jflax.FlashMultiHeadAttention(HEADS, FEATURES, rngs=nnx.Rngs(7), **kwargs)
  stock_state, flash_state = nnx.state(stock), nnx.state(flash)
  assert jax.tree.structure(stock_state) == jax.tree.structure(flash_state)
  assert jax.tree.map(jnp.shape, stock_state) == jax.tree.map(jnp.shape, flash_state)
  assert set(nnx.to_pure_dict(stock_state)) == {"query", "key", "value", "out", "query_ln",
                                                "key_ln"}

  xq, xkv, _ = inputs(rng)
  # stock -> flash through a pure dict (what a checkpoint holds), then flash -> stock.
  nnx.replace_by_pure_dict(flash_state, nnx.to_pure_dict(stock_state))
  nnx.update(flash, flash_state)
  assert_close(flash(xq, xkv), stock(xq, xkv), "stock -> flash")
  other = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, rngs=nnx.Rngs(8), **kwargs)
  assert not np.allclose(other(xq, xkv), stock(xq, xkv))
  nnx.update(other, nnx.state(flash))
  assert_close(other(xq, xkv), stock(xq, xkv), "flash -> stock")


def test_nnx_padding_lengths_match_stock_mask(rng):
  stock = nnx_mha(nnx.MultiHeadAttention)
  flash = nnx_mha(jflax.FlashMultiHeadAttention)
  nnx.update(flash, nnx.state(stock))
  xq, xkv, _ = inputs(rng)
  lengths = jnp.array([SEQ_K, 9], jnp.int32)
  mask = nnx.make_attention_mask(jnp.ones((BATCH, SEQ_Q)), jnp.arange(SEQ_K) < lengths[:, None])
  want = nnx.jit(lambda m, q, kv: m(q, kv, mask=mask))(stock, xq, xkv)
  got = nnx.jit(lambda m, q, kv: m(q, kv, key_value_seq_lengths=lengths))(flash, xq, xkv)
  assert_close(got, want)


def test_nnx_implementation_is_selectable(rng):
  xq, xkv, _ = inputs(rng)
  default = nnx_mha(jflax.FlashMultiHeadAttention)
  xla = nnx_mha(jflax.FlashMultiHeadAttention, implementation="xla")
  assert xla.attention_fn.implementation == "xla"
  assert_close(xla(xq, xkv), default(xq, xkv))


# ---------------------------------------------------------------------------------------------
# Linen


def repeat_kv(params, group: int):
  """GQA parameters -> the equivalent stock (one kv head per query head) parameters."""
  params = dict(params)
  for name in ("key", "value"):
    params[name] = jax.tree.map(lambda p: jnp.repeat(p, group, axis=-2), params[name])
  return params


def linen_results(apply, params, xq, xkv, g) -> dict:
  """Output and gradients (inputs and parameters) of sum(apply(params, xq, xkv) * g), under
  jax.jit."""

  @jax.jit
  def run(params, xq, xkv):
    def loss(params, xq, xkv):
      out = apply(params, xq, xkv)
      return jnp.sum(out.astype(F32) * g), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(params, xq, xkv)
    return out, grads

  out, grads = run(params, xq, xkv)
  assert out.shape == g.shape
  return as_numpy(out, grads)


def applier(module, params_map=lambda p: p, **call):
  return lambda params, xq, xkv: module.apply({"params": params_map(params)}, xq, xkv, **call)


@pytest.mark.parametrize("dtype, variant", [
    ("float32", "cross"), ("float32", "causal_gqa"), ("bfloat16", "causal_gqa")])
def test_linen_module_matches_stock(rng, dtype, variant):
  causal = variant == "causal_gqa"
  kv_heads = KV_HEADS if causal else None
  flash = jflax.FlashMultiHeadDotProductAttention(HEADS, dtype=DTYPES[dtype],
                                                  num_kv_heads=kv_heads, is_causal=causal)
  stock32 = nn.MultiHeadDotProductAttention(HEADS, dtype=F32)
  stockd = nn.MultiHeadDotProductAttention(HEADS, dtype=DTYPES[dtype])
  xq, xkv, g = inputs(rng)
  if causal:
    # Stock Linen has no GQA: the reference repeats each kv head over its query-head group.
    xkv = xq
    params = flash.init(jax.random.key(0), xq)["params"]
    assert params["key"]["kernel"].shape == (FEATURES, KV_HEADS, FEATURES // HEADS)
    params_map = lambda p: repeat_kv(p, HEADS // KV_HEADS)  # noqa: E731
    stock_call = dict(mask=causal_mask(xq))
  else:
    params = stockd.init(jax.random.key(0), xq, xkv)["params"]
    params_map, stock_call = (lambda p: p), {}
  ref32 = linen_results(applier(stock32, params_map, **stock_call), params, xq, xkv, g)
  refd = ref32 if dtype == "float32" else linen_results(
      applier(stockd, params_map, **stock_call), params, xq, xkv, g)
  assert_matches_stock(linen_results(applier(flash), params, xq, xkv, g), ref32, refd)


def test_linen_checkpoint_matches_stock(rng):
  flash = jflax.FlashMultiHeadDotProductAttention(HEADS, is_causal=True)
  stock = nn.MultiHeadDotProductAttention(HEADS)
  xq, _, g = inputs(rng)
  params = stock.init(jax.random.key(0), xq)["params"]
  remat_flash = jax.checkpoint(applier(flash))
  ref = linen_results(applier(stock, mask=causal_mask(xq)), params, xq, xq, g)
  assert_matches_stock(linen_results(remat_flash, params, xq, xq, g), ref, ref)


def test_linen_variables_move_between_stock_and_flash(rng):
  stock = nn.MultiHeadDotProductAttention(HEADS, qkv_features=32, out_features=48,
                                          normalize_qk=True)
  flash = jflax.FlashMultiHeadDotProductAttention(HEADS, qkv_features=32, out_features=48,
                                                  normalize_qk=True)
  xq, xkv, _ = inputs(rng)
  stock_vars = stock.init(jax.random.key(0), xq, xkv)
  flash_vars = flash.init(jax.random.key(0), xq, xkv)
  assert jax.tree.structure(stock_vars) == jax.tree.structure(flash_vars)
  assert jax.tree.map(jnp.shape, stock_vars) == jax.tree.map(jnp.shape, flash_vars)
  # Same initialisers and names, so the same key even gives the same values.
  jax.tree.map(np.testing.assert_array_equal, stock_vars, flash_vars)
  other_vars = stock.init(jax.random.key(3), xq, xkv)
  assert_close(flash.apply(other_vars, xq, xkv), stock.apply(other_vars, xq, xkv))


def test_linen_padding_lengths_match_stock_mask(rng):
  stock = nn.MultiHeadDotProductAttention(HEADS)
  flash = jflax.FlashMultiHeadDotProductAttention(HEADS)
  xq, xkv, _ = inputs(rng)
  variables = stock.init(jax.random.key(0), xq, xkv)
  lengths = jnp.array([5, SEQ_K], jnp.int32)
  mask = nn.make_attention_mask(jnp.ones((BATCH, SEQ_Q)), jnp.arange(SEQ_K) < lengths[:, None])
  assert_close(flash.apply(variables, xq, xkv, key_value_seq_lengths=lengths),
               stock.apply(variables, xq, xkv, mask=mask))


# ---------------------------------------------------------------------------------------------
# The attention function inside the stock modules, and on its own


def test_attention_fn_in_stock_modules(rng):
  xq, xkv, _ = inputs(rng)
  mask = causal_mask(xq)

  stock = nnx_mha(nnx.MultiHeadAttention)
  flash_fn = nnx_mha(nnx.MultiHeadAttention, attention_fn=jflax.dot_product_attention)
  causal_fn = nnx_mha(nnx.MultiHeadAttention, attention_fn=jflax.make_attention_fn(is_causal=True))
  nnx.update(flash_fn, nnx.state(stock))
  nnx.update(causal_fn, nnx.state(stock))
  assert_close(nnx.jit(lambda m, q, kv: m(q, kv))(flash_fn, xq, xkv), stock(xq, xkv), "nnx")
  assert_close(flash_fn(xq, is_causal=True), stock(xq, mask=mask), "nnx is_causal call")
  # nnx passes is_causal=False on every call: it must not undo the function's is_causal=True.
  assert_close(causal_fn(xq), stock(xq, mask=mask), "nnx make_attention_fn(is_causal=True)")

  linen_stock = nn.MultiHeadDotProductAttention(HEADS)
  variables = linen_stock.init(jax.random.key(0), xq, xkv)
  linen_fn = nn.MultiHeadDotProductAttention(HEADS, attention_fn=jflax.dot_product_attention)
  linen_causal = nn.MultiHeadDotProductAttention(
      HEADS, attention_fn=jflax.make_attention_fn(is_causal=True))
  assert_close(jax.jit(linen_fn.apply)(variables, xq, xkv), linen_stock.apply(variables, xq, xkv),
               "linen")
  assert_close(linen_causal.apply(variables, xq), linen_stock.apply(variables, xq, mask=mask),
               "linen make_attention_fn(is_causal=True)")


def test_attention_fn_names_every_argument_linen_passes():
  # Linen passes attention_fn only the keywords its signature names: naming them all is what
  # turns an unsupported one into an error instead of dropping it.
  linen_kwargs = {"mask", "dropout_rng", "dropout_rate", "broadcast_dropout", "deterministic",
                  "dtype", "precision", "force_fp32_for_softmax", "qk_attn_weights_einsum",
                  "attn_weights_value_einsum", "module"}
  for fn in (jflax.dot_product_attention, jflax.make_attention_fn()):
    assert linen_kwargs <= set(inspect.signature(fn).parameters)


@pytest.mark.parametrize("batch_dims", [(), (2, 3)])
def test_attention_fn_batch_dims_and_lengths(rng, batch_dims):
  shape_q, shape_k = (*batch_dims, 9, 4, 16), (*batch_dims, 11, 2, 16)
  q, k, v = random_array(rng, shape_q, F32), random_array(rng, shape_k, F32), random_array(
      rng, shape_k, F32)
  want = nnx.dot_product_attention(q, k, v, is_causal=True)
  assert_close(jflax.dot_product_attention(q, k, v, is_causal=True), want)

  lengths = jnp.asarray(rng.integers(1, 12, batch_dims), jnp.int32)
  mask = (jnp.arange(11) < lengths[..., None])[..., None, None, :]  # (batch..., 1, 1, S)
  want = nnx.dot_product_attention(q, k, v, mask=jnp.broadcast_to(mask, (*batch_dims, 4, 9, 11)))
  assert_close(jflax.dot_product_attention(q, k, v, key_value_seq_lengths=lengths), want)


@pytest.mark.parametrize("implementation", ["cpu", "blockwise", "xla"])
@pytest.mark.parametrize("batch_dims", [(), (2, 3)])
def test_attention_fn_takes_mask_and_bias(rng, implementation, batch_dims):
  """Flax's masks and biases (batch dims folded like the query's, broadcast dims kept) go
  through to the paths that take them, as in Flax's own attention; every row keeps a key."""
  q = random_array(rng, (*batch_dims, 9, 4, 16), F32)
  k, v = (random_array(rng, (*batch_dims, 11, 4, 16), F32) for _ in range(2))
  mask = jnp.asarray(rng.random((*batch_dims, 1, 9, 11)) < 0.6).at[..., 0].set(True)
  bias = random_array(rng, (4, 1, 11), F32)  # per head and key, broadcast over batch and rows
  want = nnx.dot_product_attention(q, k, v, bias=bias, mask=mask)
  got = jflax.dot_product_attention(q, k, v, bias, mask, implementation=implementation)
  assert_close(got, want)
  module = jflax.FlashMultiHeadAttention(num_heads=4, in_features=8, qkv_features=16,
                                         decode=False, implementation=implementation,
                                         rngs=nnx.Rngs(0))
  x = random_array(rng, (2, 9, 8), F32)
  stock = nnx.MultiHeadAttention(num_heads=4, in_features=8, qkv_features=16, decode=False,
                                 rngs=nnx.Rngs(0))
  causal = nnx.make_causal_mask(x[..., 0])
  assert_close(module(x, mask=causal), stock(x, mask=causal))


def test_make_attention_fn_fixes_jax_flash_options(rng):
  q = random_array(rng, (2, 13, 4, 16), F32)
  fn = jflax.make_attention_fn(local_window_size=[3, 1], scale=0.3, implementation="xla")
  assert fn == jflax.make_attention_fn(local_window_size=(3, 1), scale=0.3, implementation="xla")
  hash(fn)  # NNX keeps attention_fn as a static attribute
  want = jax.nn.dot_product_attention(q, q, q, local_window_size=(3, 1), scale=0.3)
  assert_close(fn(q, q, q), want)
  with pytest.raises(ValueError, match="implementation"):
    jflax.make_attention_fn(implementation="triton")


def test_attention_fn_dtype_promotes_like_flax(rng):
  q = random_array(rng, (2, 9, 4, 16), F32)
  k = random_array(rng, (2, 9, 4, 16), jnp.bfloat16)
  assert jflax.dot_product_attention(q, k, k).dtype == F32
  out = jflax.dot_product_attention(q, q, q, dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16
  want = jflax.dot_product_attention(*(x.astype(jnp.bfloat16) for x in (q, q, q)))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_attention_fn_options_that_cannot_matter_are_accepted(rng):
  q = random_array(rng, (2, 9, 4, 16), F32)
  want = jflax.dot_product_attention(q, q, q)
  got = jflax.dot_product_attention(
      q, q, q, dropout_rate=0.1, deterministic=True, dropout_rng=jax.random.key(0),
      broadcast_dropout=False, precision=jax.lax.Precision.HIGHEST, force_fp32_for_softmax=True)
  np.testing.assert_array_equal(got, want)


def _to_bfloat16(arrays, /, *, dtype=None):
  """A promote_dtype in NNX's calling convention that ignores `dtype`: everything to bfloat16."""
  del dtype
  return tuple(jnp.asarray(x, jnp.bfloat16) for x in arrays)


def test_attention_fn_takes_the_arguments_of_flax_attention_functions(rng):
  """Every parameter of Linen's and NNX's dot_product_attention is one of ours, so either can be
  swapped for ours inside a functools.partial (before: a TypeError for einsum_dot_general and
  promote_dtype)."""
  for flax_fn in (nn.dot_product_attention, nnx.dot_product_attention):
    for fn in (jflax.dot_product_attention, jflax.make_attention_fn()):
      missing = set(inspect.signature(flax_fn).parameters) - set(inspect.signature(fn).parameters)
      assert not missing, (flax_fn.__module__, missing)


def test_einsum_dot_general_and_promote_dtype_defaults_change_nothing(rng):
  q = random_array(rng, (2, 9, 4, 16), F32)
  k = random_array(rng, (2, 9, 2, 16), jnp.bfloat16)
  want = jflax.dot_product_attention(q, k, k, is_causal=True)
  nnx_promote = inspect.signature(nnx.dot_product_attention).parameters["promote_dtype"].default
  for fn in (jflax.dot_product_attention, jflax.make_attention_fn()):
    for extra in (dict(einsum_dot_general=None), dict(einsum_dot_general=jax.lax.dot_general),
                  dict(promote_dtype=None), dict(promote_dtype=nnx_promote)):
      got = fn(q, k, k, is_causal=True, **extra)
      assert got.dtype == want.dtype, extra
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(extra))


def test_promote_dtype_is_called_as_nnx_calls_it(rng):
  """A promote_dtype of one's own casts the inputs as it does in nnx.dot_product_attention."""
  q = random_array(rng, (2, 9, 4, 16), F32)
  want = jflax.dot_product_attention(q.astype(jnp.bfloat16), q.astype(jnp.bfloat16),
                                     q.astype(jnp.bfloat16))
  for fn in (jflax.dot_product_attention, jflax.make_attention_fn()):
    got = fn(q, q, q, promote_dtype=_to_bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))
  stock = nnx.dot_product_attention(q, q, q, promote_dtype=_to_bfloat16)
  assert stock.dtype == jnp.bfloat16
  # FlashAttention's rule: against float32, within twice the stock bfloat16 error
  assert_within_rule("out", np.asarray(got, F32), np.asarray(nnx.dot_product_attention(q, q, q)),
                     np.asarray(stock, F32))


def test_einsum_dot_general_overrides_are_refused(rng):
  q = random_array(rng, (2, 9, 4, 16), F32)

  def my_dot_general(*args, **kwargs):
    return jax.lax.dot_general(*args, **kwargs)

  for fn in (jflax.dot_product_attention, jflax.make_attention_fn()):
    with pytest.raises(NotImplementedError, match="einsum_dot_general=.*my_dot_general"):
      fn(q, q, q, einsum_dot_general=my_dot_general)


def test_flax_arguments_through_stock_modules(rng):
  """Stock modules with our function in a functools.partial carrying the Flax arguments, as one
  carries them for Flax's own functions: the same results as Flax's functions so configured."""
  xq, xkv, _ = inputs(rng)
  dot_general = dict(einsum_dot_general=jax.lax.dot_general)
  linen_stock = nn.MultiHeadDotProductAttention(
      HEADS, attention_fn=functools.partial(nn.dot_product_attention, **dot_general))
  variables = linen_stock.init(jax.random.key(0), xq, xkv)
  linen_flash = nn.MultiHeadDotProductAttention(
      HEADS, attention_fn=functools.partial(jflax.dot_product_attention, **dot_general))
  assert_close(jax.jit(linen_flash.apply)(variables, xq, xkv),
               linen_stock.apply(variables, xq, xkv), "linen einsum_dot_general")

  nnx_promote = inspect.signature(nnx.dot_product_attention).parameters["promote_dtype"].default
  for promote in (nnx_promote, _to_bfloat16):
    stock = nnx_mha(nnx.MultiHeadAttention, attention_fn=functools.partial(
        nnx.dot_product_attention, promote_dtype=promote))
    flash = nnx_mha(nnx.MultiHeadAttention, attention_fn=functools.partial(
        jflax.dot_product_attention, promote_dtype=promote))
    nnx.update(flash, nnx.state(stock))
    want, got = stock(xq, xkv), flash(xq, xkv)
    assert got.dtype == want.dtype
    if promote is nnx_promote:
      assert_close(got, want, "nnx promote_dtype")
    else:  # both attentions in bfloat16: the FlashAttention rule against the float32 stock
      stock32 = nnx_mha(nnx.MultiHeadAttention)
      nnx.update(stock32, nnx.state(stock))
      assert_within_rule("nnx promote_dtype bfloat16", np.asarray(got, F32),
                         np.asarray(stock32(xq, xkv)), np.asarray(want, F32))

  def my_dot_general(*args, **kwargs):
    return jax.lax.dot_general(*args, **kwargs)

  refusing = nn.MultiHeadDotProductAttention(
      HEADS, attention_fn=functools.partial(jflax.dot_product_attention,
                                            einsum_dot_general=my_dot_general))
  with pytest.raises(NotImplementedError, match="einsum_dot_general"):
    refusing.apply(variables, xq, xkv)


# ---------------------------------------------------------------------------------------------
# What cannot be honoured raises


@pytest.mark.parametrize("kwargs, match", [
    (dict(module=object()), "sow"),
    (dict(qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum), "einsum"),
])
def test_attention_fn_raises_for_what_it_cannot_honour(rng, kwargs, match):
  q = random_array(rng, (2, 9, 4, 16), F32)
  with pytest.raises(NotImplementedError, match=match):
    jflax.dot_product_attention(q, q, q, **kwargs)
  with pytest.raises(NotImplementedError, match=match):
    jflax.make_attention_fn(is_causal=True)(q, q, q, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mask=jnp.ones((2, 1, 9, 9), bool)), "mask.*is_causal=True.*key_value_seq_lengths"),
    (dict(bias=jnp.zeros((2, 1, 9, 9))), "bias"),
])
def test_attention_fn_refuses_mask_and_bias_on_cuda(rng, monkeypatch, kwargs, match):
  """The CUDA kernels take no mask or bias arrays yet: on a (simulated) GPU host the attention
  function and the modules (the stock one with it too) refuse them in Flax's terms."""
  simulate_cuda_host(monkeypatch)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q = random_array(rng, (2, 9, 4, 16), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match=match):
    jflax.dot_product_attention(q, q, q, **kwargs)
  with pytest.raises(NotImplementedError, match=match):
    jflax.make_attention_fn(is_causal=True)(q, q, q, **kwargs)
  xq = random_array(rng, (BATCH, SEQ_Q, FEATURES), jnp.bfloat16)
  for module in (nnx_mha(jflax.FlashMultiHeadAttention, dtype=jnp.bfloat16),
                 nnx_mha(nnx.MultiHeadAttention, dtype=jnp.bfloat16,
                         attention_fn=jflax.dot_product_attention)):
    with pytest.raises(NotImplementedError, match="mask"):
      module(xq, mask=causal_mask(xq), deterministic=True)


def test_attention_fn_errors_name_the_shapes_passed(rng):
  """With batch dims (2, 3) jax_flash folds them into one before its kernels; its errors still
  name the arrays as the caller passed them, never the folded rank-4 forms."""
  q = random_array(rng, (2, 3, 9, 4, 16), F32)
  k = random_array(rng, (2, 3, 11, 2, 16), F32)
  for mask, want in ((jnp.ones((2, 3, 5, 9, 11), bool), "mask(2, 3, 5, 9, 11)"),
                     (jnp.ones((3, 1, 1, 9, 11), bool), "mask(3, 1, 1, 9, 11)"),
                     (jnp.ones((1, 2, 3, 1, 9, 11), bool), "mask(1, 2, 3, 1, 9, 11)")):
    with pytest.raises(ValueError, match=re.escape(want)):
      jflax.dot_product_attention(q, k, k, mask=mask, implementation="xla")
  with pytest.raises(ValueError, match=re.escape("got mask(9, 12)")):
    jflax.dot_product_attention(q, k, k, mask=jnp.ones((9, 12), bool), implementation="cpu")
  with pytest.raises(ValueError, match=re.escape("query(2, 3, 9, 4, 16), key(2, 3, 11, 3, 16)")):
    k3 = random_array(rng, (2, 3, 11, 3, 16), F32)
    jflax.dot_product_attention(q, k3, k3)
  with pytest.raises(ValueError, match=re.escape("H=300 (query(2, 3, 9, 4, 300))")):
    q300, k300 = (random_array(rng, (*x.shape[:-1], 300), F32) for x in (q, k))
    jflax.dot_product_attention(q300, k300, k300, implementation="cpu")


def test_nnx_modules_raise_for_what_they_cannot_honour(rng):
  xq, _, _ = inputs(rng)
  flash = nnx_mha(jflax.FlashMultiHeadAttention)
  with pytest.raises(NotImplementedError, match="sow"):
    flash(xq, sow_weights=True)
  with pytest.raises(ValueError, match="init_cache"):  # decoding: test_flax_decode.py
    flash(xq, decode=True)
  with pytest.raises(ValueError, match="attention_fn"):
    nnx_mha(jflax.FlashMultiHeadAttention, attention_fn=nnx.dot_product_attention)
  # Dropout applies (tests/test_dropout.py); in evaluation mode there is none.
  dropout = nnx_mha(jflax.FlashMultiHeadAttention, dropout_rate=0.1)
  nnx.update(dropout, nnx.state(flash, nnx.Param))
  assert np.max(np.abs(np.asarray(dropout(xq, deterministic=False) - flash(xq)))) > 1e-3
  assert_close(dropout(xq, deterministic=True), flash(xq))  # evaluation mode: no dropout
  # A mask array reaches the "cpu" kernel (the CUDA ones refuse it:
  # test_attention_fn_refuses_mask_and_bias_on_cuda), as Flax's own attention takes it.
  stock = nnx_mha(nnx.MultiHeadAttention)
  nnx.update(stock, nnx.state(flash))
  assert_close(flash(xq, mask=causal_mask(xq)), stock(xq, mask=causal_mask(xq)))


def test_linen_modules_raise_for_what_they_cannot_honour(rng):
  xq, _, _ = inputs(rng)
  flash = jflax.FlashMultiHeadDotProductAttention(HEADS)
  variables = flash.init(jax.random.key(0), xq)
  with pytest.raises(NotImplementedError, match="sow"):
    flash.apply(variables, xq, sow_weights=True, mutable=["intermediates"])
  with pytest.raises(NotImplementedError, match="einsum"):
    flash.clone(qk_attn_weights_einsum_cls=lambda: jnp.einsum,
                attn_weights_value_einsum_cls=lambda: jnp.einsum).apply(variables, xq)
  with pytest.raises(ValueError, match="attention_fn"):
    flash.clone(attention_fn=jflax.dot_product_attention).apply(variables, xq)
  with pytest.raises(ValueError, match="num_kv_heads"):
    flash.clone(num_kv_heads=3).init(jax.random.key(0), xq)
  # Dropout applies (the stock module with the flash attention_fn too: tests/test_dropout.py);
  # without a "dropout" rng Flax's own error says so.
  with pytest.raises(Exception, match="dropout"):
    flash.clone(dropout_rate=0.1).apply(variables, xq, deterministic=False)


# ---------------------------------------------------------------------------------------------
# Block-sparse masks


def _block_mask_inputs(rng, batch_dims):
  """q, k, v (batch..., T, N|K, H) with T = 160, S = 300 (2 x 3 blocks of 128), and a block mask
  (batch..., N, 2, 3) whose every query block keeps one key block."""
  q = random_array(rng, (*batch_dims, 160, 4, 16), F32)
  k, v = (random_array(rng, (*batch_dims, 300, 2, 16), F32) for _ in range(2))
  blocks = jnp.asarray(rng.random((*batch_dims, 4, 2, 3)) < 0.5).at[..., 0].set(True)
  return q, k, v, blocks


@pytest.mark.parametrize("batch_dims", [(), (2, 3)])
def test_attention_fn_takes_a_block_mask(rng, batch_dims):
  """block_mask passes through jax_flash.flax.dot_product_attention as the segment ids do (the
  batch dims folded into one): the core call on the folded arrays, on the kernels; broadcast
  batch dims (left out or 1) too. Flax's element mask from the expanded blocks gives the same
  on "xla"."""
  q, k, v, blocks = _block_mask_inputs(rng, batch_dims)
  got = jflax.dot_product_attention(q, k, v, block_mask=blocks, is_causal=True)
  fold = lambda x: x.reshape(-1, *x.shape[len(batch_dims):])
  want = jax_flash.dot_product_attention(fold(q), fold(k), fold(v), block_mask=fold(blocks),
                                         is_causal=True)
  assert_close(got, want.reshape(got.shape))
  elements = jnp.repeat(jnp.repeat(blocks, 128, axis=-2), 128, axis=-1)[..., :160, :300]
  assert_close(jflax.dot_product_attention(q, k, v, mask=elements, is_causal=True,
                                           implementation="xla"), got)
  shared = blocks[(0,) * len(batch_dims)]  # (N, 2, 3): every batch element the same blocks
  got_shared = jflax.dot_product_attention(q, k, v, block_mask=shared)
  want_shared = jflax.dot_product_attention(
      q, k, v, block_mask=jnp.broadcast_to(shared, blocks.shape))
  assert_close(got_shared, want_shared)
  with pytest.raises(ValueError, match=re.escape("block_mask(4, 2, 2)")):
    jflax.dot_product_attention(q, k, v, block_mask=jnp.ones((4, 2, 2), bool))
  fn = jflax.make_attention_fn(is_causal=True)
  assert_close(fn(q, k, v, block_mask=blocks), got)


def test_modules_take_a_block_mask(rng):
  """The NNX and Linen modules pass a call's block_mask to their attention (the same as their
  attention_fn on the projections); not in a decode step."""
  x = random_array(rng, (2, 160, FEATURES), F32)
  blocks = jnp.asarray(rng.random((2, HEADS, 2, 2)) < 0.5).at[..., 0].set(True)
  elements = jnp.repeat(jnp.repeat(blocks, 128, axis=-2), 128, axis=-1)[..., :160, :160]
  module = nnx_mha(jflax.FlashMultiHeadAttention)
  masked = nnx_mha(jflax.FlashMultiHeadAttention, implementation="xla")
  nnx.update(masked, nnx.state(module, nnx.Param))
  assert_close(module(x, block_mask=blocks), masked(x, mask=elements))
  linen = jflax.FlashMultiHeadDotProductAttention(HEADS)
  variables = linen.init(jax.random.key(0), x)
  assert_close(linen.apply(variables, x, block_mask=blocks),
               linen.clone(implementation="xla").apply(variables, x, mask=elements))
  decoder = jflax.FlashMultiHeadDotProductAttention(HEADS, decode=True)
  cache = decoder.init(jax.random.key(0), x)
  with pytest.raises(NotImplementedError, match="block_mask with decode=True"):
    decoder.apply({**variables, "cache": cache["cache"]}, x[:, :1], block_mask=blocks,
                  mutable=["cache"])


def _projected_reference(q, k, v, sinks, slopes):
  """jax_flash on a module's projections, with the sinks and slopes given directly."""
  return jax_flash.dot_product_attention(q, k, v, is_causal=True, sinks=sinks,
                                         alibi_slopes=slopes, implementation="cpu")


def test_nnx_module_learns_sinks_and_takes_alibi_slopes(rng):
  """sinks=True makes a (num_heads,) parameter that joins every row's softmax (and gets a
  gradient); alibi_slopes are fixed per head: the module equals jax_flash on its projections."""
  heads, features = 4, 32
  slopes = (0.5, 0.25, 0.125, 0.0625)
  module = jflax.FlashMultiHeadAttention(heads, features, is_causal=True, sinks=True,
                                         alibi_slopes=slopes, implementation="cpu",
                                         decode=False, rngs=nnx.Rngs(0))
  assert module.sinks[...].shape == (heads,)
  module.sinks[...] = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
  x = random_array(rng, (2, 17, features), jnp.float32)
  got = module(x)
  q, k, v = module.query(x), module.key(x), module.value(x)
  want = module.out(_projected_reference(q, k, v, module.sinks[...], jnp.asarray(slopes)))
  assert max_abs(got - want) < 1e-5

  def loss(m):
    return jnp.sum(m(x) ** 2)
  grads = nnx.grad(loss)(module)
  assert float(jnp.max(jnp.abs(grads.sinks[...]))) > 0
  with pytest.raises(ValueError, match="alibi_slopes must hold one slope per query head"):
    jflax.FlashMultiHeadAttention(heads, features, alibi_slopes=(1.0,), rngs=nnx.Rngs(0))


def test_linen_module_learns_sinks_and_takes_alibi_slopes(rng):
  """The Linen module's sinks parameter and fixed slopes, as the NNX module's."""
  heads, features = 4, 32
  slopes = (0.5, 0.25, 0.125, 0.0625)
  module = jflax.FlashMultiHeadDotProductAttention(
      num_heads=heads, is_causal=True, sinks=True, alibi_slopes=slopes, implementation="cpu")
  x = random_array(rng, (2, 17, features), jnp.float32)
  variables = module.init(jax.random.key(0), x)
  params = variables["params"]
  assert params["sinks"].shape == (heads,)
  params = {**params, "sinks": jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)}
  got = module.apply({"params": params}, x)

  def project(name, y):
    p = params[name]
    return jnp.einsum("btf,fnh->btnh", y, p["kernel"]) + p["bias"]
  attention = _projected_reference(project("query", x), project("key", x), project("value", x),
                                   params["sinks"], jnp.asarray(slopes))
  want = jnp.einsum("btnh,nhf->btf", attention, params["out"]["kernel"]) + params["out"]["bias"]
  assert max_abs(got - want) < 1e-5
  grads = jax.grad(lambda p: jnp.sum(module.apply({"params": p}, x) ** 2))(params)
  assert float(jnp.max(jnp.abs(grads["sinks"]))) > 0
