"""Flax's own attention tests (flax tests/linen/linen_attention_test.py and
tests/nnx/nn/attention_test.py), run against jax_flash.flax.

Each case of Flax's tests rewritten for FlashMultiHeadDotProductAttention (Linen),
FlashMultiHeadAttention (NNX) and jax_flash.flax.dot_product_attention, on the default
implementation (the CPU kernel here) unless a mask array needs "blockwise" or "xla". Where the
stock module is compared with itself (dropout off, key/value defaults, Linen vs NNX), the flash
module is compared with the stock one too, within float32 round-off.

What jax_flash.flax does not do is asserted as such (README, "Flax"): sowing the attention
weights, AQT einsums raise NotImplementedError; complex
and float64 inputs a ValueError; a row whose every key is masked gives 0 where Flax gives the
mean of the values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from attention_testing import max_abs  # noqa: E402

from jax_flash import flax as jflax  # noqa: E402

F32 = jnp.float32
ONES = dict(kernel_init=jax.nn.initializers.ones, bias_init=jax.nn.initializers.zeros)


def assert_close(got, want, tol=1e-5):
  """max|got - want| <= tol * max|want| + tol / 10 (float32 round-off for tol=1e-5)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  err = max_abs(got - want)
  assert err <= tol * max_abs(want) + tol / 10, f"max abs error {err:.3g}"


def linen_pair(**kwargs):
  """(stock, flash) Linen modules with the same attributes."""
  return (nn.MultiHeadDotProductAttention(**kwargs),
          jflax.FlashMultiHeadDotProductAttention(**kwargs))


# ---------------------------------------------------------------------------------------------
# Linen (tests/linen/linen_attention_test.py)


@pytest.mark.parametrize("shape", [(4, 6, 5), (4, 2, 3, 5)], ids=["self", "two_batch_dims"])
def test_linen_multihead_self_attention(shape):
  """test_multihead_self_attention, test_multihead_encoder_decoder_attention: shape and dtype of
  the output with all-ones kernels, and the stock module's values."""
  x = jnp.ones(shape)
  stock, flash = linen_pair(num_heads=8, qkv_features=16, deterministic=False, **ONES)
  y, variables = flash.init_with_output(jax.random.key(0), x)
  assert y.shape == x.shape and y.dtype == F32
  assert_close(y, stock.apply(variables, x))


def test_linen_dtype_infer_refuses_complex():
  """test_dtype_infer: the stock module infers complex64 from the input; jax_flash computes in
  float32, bfloat16 or float16 and says so."""
  x = jnp.ones((4, 6, 5), jnp.complex64)
  stock, flash = linen_pair(num_heads=8, qkv_features=16, deterministic=False, **ONES)
  y, _ = stock.init_with_output(jax.random.key(0), x)
  assert y.dtype == jnp.complex64
  with pytest.raises(ValueError, match="float32, bfloat16 or float16; got complex64"):
    flash.init_with_output(jax.random.key(0), x)


def test_linen_out_initializers():
  """test_mha_out_initializers: out_kernel_init / out_bias_init reach the out projection only."""
  q = jnp.ones((4, 2, 3, 5))
  _, flash = linen_pair(num_heads=8, qkv_features=16, kernel_init=jax.nn.initializers.ones,
                        out_kernel_init=jax.nn.initializers.zeros,
                        bias_init=jax.nn.initializers.zeros,
                        out_bias_init=jax.nn.initializers.ones, deterministic=False)
  params = flash.init(jax.random.key(0), q)["params"]
  for name in ("query", "key", "value"):
    np.testing.assert_allclose(params[name]["kernel"], 1.0)
    np.testing.assert_allclose(params[name]["bias"], 0.0)
  np.testing.assert_allclose(params["out"]["kernel"], 0.0)
  np.testing.assert_allclose(params["out"]["bias"], 1.0)


def test_linen_dropout():
  """test_multihead_self_attention_w_dropout / _explicit_dropout: a rate > 0 with
  deterministic=False drops attention weights at init and at apply; an explicit dropout_rng
  gives the same output for the same key and another for another key (jax_flash draws its own
  bits, so the values are not the stock module's: tests/test_dropout.py checks the mask)."""
  x = jax.random.normal(jax.random.key(5), (4, 2, 3, 5))
  _, flash = linen_pair(num_heads=8, qkv_features=16, dropout_rate=0.5, deterministic=False,
                        broadcast_dropout=False)
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  y, variables = flash.init_with_output(rngs, x)
  assert y.shape == x.shape
  undropped = flash.clone(deterministic=True).apply(variables, x)
  dropped = flash.apply(variables, x, dropout_rng=jax.random.key(2))
  assert max_abs(np.asarray(dropped - undropped)) > 1e-3
  np.testing.assert_array_equal(flash.apply(variables, x, dropout_rng=jax.random.key(2)),
                                dropped)
  assert max_abs(np.asarray(flash.apply(variables, x, dropout_rng=jax.random.key(3)) -
                            dropped)) > 1e-3


def test_linen_dropout_disabled():
  """test_multihead_self_attention_w_dropout_disabled: with dropout off (rate 0, or
  deterministic=True) the output does not depend on the dropout rng, and is the stock one."""
  x = jnp.ones((4, 2, 3, 5))
  stock, flash = linen_pair(num_heads=8, qkv_features=16, dropout_rate=0.0, deterministic=True,
                            **ONES)
  rngs1 = {"params": jax.random.key(1), "dropout": jax.random.key(2)}
  rngs2 = {"params": jax.random.key(3), "dropout": jax.random.key(4)}
  y1, variables = flash.init_with_output(rngs1, x)
  y2, _ = flash.init_with_output(rngs2, x)
  np.testing.assert_allclose(y1, y2)
  np.testing.assert_allclose(flash.apply(variables, x, rngs=rngs1),
                             flash.apply(variables, x, rngs=rngs2))
  for rate in (0.0, 0.5):  # deterministic given at the call
    module = jflax.FlashMultiHeadDotProductAttention(num_heads=8, qkv_features=16,
                                                     dropout_rate=rate, **ONES)
    y5 = module.apply(variables, x, deterministic=True, rngs=rngs1)
    y6 = module.apply(variables, x, deterministic=True, rngs=rngs2)
    np.testing.assert_allclose(y5, y6)
    assert_close(y5, stock.apply(variables, x))


def test_linen_causal_mask_is_is_causal():
  """test_causal_mask_1d, applied: make_causal_mask in the stock module is is_causal=True in the
  flash module (on the kernels), and the mask itself on "blockwise"."""
  x = jax.random.normal(jax.random.key(0), (3, 16, 12))
  stock = nn.MultiHeadDotProductAttention(num_heads=3, qkv_features=12)
  variables = stock.init(jax.random.key(1), x)
  want = stock.apply(variables, x, mask=nn.make_causal_mask(jnp.ones((3, 16))))
  flash = jflax.FlashMultiHeadDotProductAttention(num_heads=3, qkv_features=12, is_causal=True)
  assert_close(flash.apply(variables, x), want)
  blockwise = jflax.FlashMultiHeadDotProductAttention(num_heads=3, qkv_features=12,
                                                      implementation="blockwise")
  assert_close(blockwise.apply(variables, x, mask=nn.make_causal_mask(jnp.ones((3, 16)))), want)


@pytest.mark.parametrize("spatial_shape", [(5,), (6, 5)])
def test_linen_decoding(spatial_shape):
  """test_decoding: the decode module fed one position at a time under lax.scan gives the stock
  module's causal forward (one or two batch dims; decoding runs along the last spatial dim).
  The cache itself against the stock one: test_flax_decode.py."""
  x = jax.random.normal(jax.random.key(0), (2, *spatial_shape, 12))
  decode = jflax.FlashMultiHeadDotProductAttention(num_heads=3, qkv_features=12, decode=True)
  variables = decode.init(jax.random.key(1), x)
  params, cache = variables["params"], variables["cache"]
  stock = nn.MultiHeadDotProductAttention(num_heads=3, qkv_features=12,
                                          precision=jax.lax.Precision.HIGHEST)
  want = stock.apply({"params": params}, x, mask=nn.make_causal_mask(jnp.ones(x.shape[:-1])))

  def body(cache, xt):
    y, mutated = decode.apply({"params": params, "cache": cache}, xt[..., None, :],
                              mutable=["cache"])
    return mutated["cache"], y[..., 0, :]

  _, ys = jax.lax.scan(body, cache, jnp.moveaxis(x, -2, 0))
  assert_close(jnp.moveaxis(ys, 0, -2), want)


def test_linen_autoregressive_receptive_field():
  """test_autoregressive_receptive_field_1d: with is_causal, output position i depends on
  inputs 0..i and on no later one (one head of dim 1, all-ones kernels)."""
  length = 10
  inputs = jax.random.normal(jax.random.key(2), (1, length, 1))
  module = jflax.FlashMultiHeadDotProductAttention(
      num_heads=1, kernel_init=jax.nn.initializers.ones, is_causal=True)
  variables = module.init(jax.random.key(1), inputs)

  def loss(inputs, pos):
    return module.apply(variables, inputs)[0, pos, :].sum()

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  for i in range(length):
    deps = np.any(np.abs(np.asarray(grad(inputs, i))[0]) > 1e-5, axis=-1)
    assert deps[:i + 1].all(), f"position {i} does not see every earlier one"
    assert not deps[i + 1:].any(), f"position {i} sees a later one"


def test_linen_kv_args():
  """test_multihead_kv_args: inputs_k alone means values from the keys; inputs_v without
  inputs_k raises as in Flax; the deprecated inputs_kv is not taken (documented)."""
  query = jax.random.uniform(jax.random.key(1), (3, 5))
  key_value = jax.random.uniform(jax.random.key(2), (9, 5))
  stock, flash = linen_pair(num_heads=8, qkv_features=16, deterministic=False, **ONES)
  y0, v0 = flash.init_with_output(jax.random.key(43279), query, inputs_k=key_value,
                                  inputs_v=key_value)
  y1, v1 = flash.init_with_output(jax.random.key(43279), query, inputs_k=key_value)
  assert (y0 == y1).all()
  assert jax.tree.all(jax.tree.map(lambda a, b: (a == b).all(), v0, v1))
  assert_close(y0, stock.apply(v0, query, key_value, key_value))
  with pytest.raises(ValueError, match="`inputs_k` cannot be None if `inputs_v` is not None"):
    flash.init_with_output(jax.random.key(0), query, inputs_v=key_value)
  with pytest.raises(TypeError, match="inputs_kv"):
    flash.init_with_output(jax.random.key(0), query, inputs_kv=key_value)


def test_linen_sow_attention_weights_is_refused():
  """test_multihead_sow_attention_weights: FlashAttention never forms the weights to sow."""
  x = jnp.ones((4, 6, 5))
  flash = jflax.FlashMultiHeadDotProductAttention(num_heads=8, qkv_features=16, **ONES)
  variables = flash.init(jax.random.key(0), x)
  with pytest.raises(NotImplementedError, match="sow"):
    flash.apply(variables, x, sow_weights=True, mutable=["intermediates"])
  _, state = flash.apply(variables, x, sow_weights=False, mutable=["intermediates"])
  assert "intermediates" not in state


@pytest.mark.parametrize("force_fp32", [True, False])
def test_linen_mixed_precision(force_fp32):
  """test_mixed_precision_multihead_attention (without sow_weights, which is refused): bfloat16
  computation with float32 parameters; the softmax is float32 either way."""
  x = jax.random.uniform(jax.random.key(0), (2, 4))
  kwargs = dict(num_heads=2, qkv_features=4, force_fp32_for_softmax=force_fp32,
                deterministic=False, dtype=jnp.bfloat16)
  stock, flash = linen_pair(**kwargs)
  variables = stock.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)
  got, want = flash.apply(variables, x), stock.apply(variables, x)
  assert got.dtype == want.dtype == jnp.bfloat16
  assert_close(np.asarray(got, F32), np.asarray(want, F32), tol=2e-2)


def test_linen_einsum_overrides_are_refused():
  """test_dot_product_attention_precision_and_einsum_override / _specify_einsums_together:
  Flax's function raises ValueError for combinations of precision, einsum_dot_general and the
  AQT einsums; jax_flash's refuses the einsums themselves (NotImplementedError) and takes
  precision and the default einsum_dot_general."""
  ones = jnp.ones((1, 4, 2, 2))
  einsum = lambda: jnp.einsum
  for kwargs in (dict(precision=jax.lax.Precision.DEFAULT),
                 dict(einsum_dot_general=jax.lax.dot_general)):
    with pytest.raises(ValueError):
      nn.dot_product_attention(ones, ones, ones, qk_attn_weights_einsum=einsum,
                               attn_weights_value_einsum=einsum, **kwargs)
    with pytest.raises(NotImplementedError, match="einsum"):
      jflax.dot_product_attention(ones, ones, ones, qk_attn_weights_einsum=einsum,
                                  attn_weights_value_einsum=einsum, **kwargs)
    assert_close(jflax.dot_product_attention(ones, ones, ones, **kwargs),
                 nn.dot_product_attention(ones, ones, ones, **kwargs))
  for qk, av in ((einsum, None), (None, einsum)):
    with pytest.raises(NotImplementedError, match="einsum"):
      jflax.dot_product_attention(ones, ones, ones, qk_attn_weights_einsum=qk,
                                  attn_weights_value_einsum=av)


# ---------------------------------------------------------------------------------------------
# NNX (tests/nnx/nn/attention_test.py)


def nnx_pair(**kwargs):
  """(stock, flash) NNX modules with the same arguments and the same state."""
  stock = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
  flash = jflax.FlashMultiHeadAttention(**kwargs, rngs=nnx.Rngs(1))
  nnx.update(flash, nnx.state(stock))
  return stock, flash


def test_nnx_basic():
  stock, flash = nnx_pair(num_heads=2, in_features=3, qkv_features=6, out_features=6)
  x = jax.random.normal(jax.random.key(0), (1, 7, 3))
  y = flash(x, decode=False)
  assert y.shape == (1, 7, 6)
  assert_close(y, stock(x, decode=False))


def test_nnx_sow_attention_weights_is_refused():
  """test_multihead_sow_attention_weights."""
  flash = jflax.FlashMultiHeadAttention(num_heads=8, in_features=8, decode=False,
                                        rngs=nnx.Rngs(0), **{
                                            "kernel_init": nnx.initializers.ones_init(),
                                            "bias_init": nnx.initializers.zeros_init()})
  x = jnp.ones((4, 6, 8))
  with pytest.raises(NotImplementedError, match="sow"):
    flash(x, sow_weights=True)


def test_nnx_autoregressive_decode_with_x64():
  """test_autoregressive_decode_with_x64: the cache's int32 index under x64 (float32 inputs:
  the kernels take no float64)."""
  with jax.enable_x64(True):
    x = jnp.ones((1, 4, 4), jnp.float32)
    module = jflax.FlashMultiHeadAttention(in_features=4, num_heads=2, qkv_features=4,
                                           decode=True, rngs=nnx.Rngs(0))
    module.init_cache(x.shape, dtype=x.dtype)
    assert module.cached_key.shape == module.cached_value.shape == (1, 4, 2, 2)
    y1 = module(x[:, :1, :])
    y2 = module(x[:, 1:2, :])
    assert y1.shape == y2.shape == (1, 1, 4)
    assert module.cache_index[...] == 2 and module.cache_index.dtype == jnp.int32


@pytest.mark.parametrize("keep_rngs", [True, False])
def test_nnx_keep_rngs(keep_rngs):
  module = jflax.FlashMultiHeadAttention(in_features=4, num_heads=2, qkv_features=4,
                                         decode=True, rngs=nnx.Rngs(42), dropout_rate=0.5,
                                         keep_rngs=keep_rngs)
  assert (module.rngs is not None) == keep_rngs
  # Dropout off for evaluation, and on: with the call's rngs, or the kept ones; without either
  # a ValueError names rngs (the stock module's rule).
  x = jax.random.normal(jax.random.key(0), (1, 3, 4))
  off = module(x, decode=False, deterministic=True)
  on = module(x, decode=False, deterministic=False, rngs=nnx.Rngs(3))
  assert on.shape == off.shape == (1, 3, 4)
  if keep_rngs:
    module(x, decode=False, deterministic=False)
  else:
    with pytest.raises(ValueError, match="rngs"):
      module(x, decode=False, deterministic=False)


@pytest.mark.parametrize("use_padding", [True, False], ids=["padding", "no_padding"])
@pytest.mark.parametrize("is_cross_attention", [True, False], ids=["cross", "self"])
def test_nnx_causal_mask_equivalence(use_padding, is_cross_attention):
  """test_causal_mask_equivalence: a padding mask with is_causal=True is the combined mask;
  here on "blockwise" (masks as arrays) and on the kernels (padding as key_value_seq_lengths).
  In self-attention the padding masks both keys: every row is empty, which Flax gives the mean
  of the values and jax_flash 0 (a documented deviation)."""
  q_len, kv_len, heads, head_dim = 2, 4 if is_cross_attention else 2, 2, 4
  q = jax.random.normal(jax.random.key(0), (1, 1, q_len, heads, head_dim))
  k = jax.random.normal(jax.random.key(1), (1, 1, kv_len, heads, head_dim))
  v = jax.random.normal(jax.random.key(2), (1, 1, kv_len, heads, head_dim))
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((q_len, kv_len), bool)),
                            (1, 1, heads, q_len, kv_len))
  padding = None
  if use_padding:
    padding = jnp.ones((1, 1, 1, q_len, kv_len), bool).at[..., -2:].set(False)
  combined = nnx.combine_masks(padding, causal, dtype=q.dtype)
  want = nnx.dot_product_attention(q, k, v, mask=combined, deterministic=True)

  got_blockwise = jflax.dot_product_attention(q, k, v, mask=padding, is_causal=True,
                                              deterministic=True, implementation="blockwise")
  lengths = jnp.full((1, 1), kv_len - 2 if use_padding else kv_len, jnp.int32)
  got_kernels = jflax.dot_product_attention(q, k, v, is_causal=True, deterministic=True,
                                            key_value_seq_lengths=lengths)
  for got in (got_blockwise, got_kernels):
    if use_padding and not is_cross_attention:
      assert not np.any(np.asarray(got))
      np.testing.assert_allclose(want, jnp.broadcast_to(v.mean(axis=2, keepdims=True), want.shape),
                                 atol=1e-6)
    else:
      np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("normalize_qk", [True, False])
def test_nnx_linen_consistency(use_bias, dtype, normalize_qk):
  """TestLinenConsistency (decode=False; decoding: test_flax_decode.py): the flash NNX and
  Linen modules with the same parameters give the same output, and the stock modules' where
  they can run."""
  kwargs = dict(num_heads=2, qkv_features=6, out_features=6, use_bias=use_bias, dtype=dtype,
                param_dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST,
                normalize_qk=normalize_qk)
  x = jax.random.normal(jax.random.key(0), (1, 5, 3))
  linen_flash = jflax.FlashMultiHeadDotProductAttention(**kwargs)
  variables = linen_flash.init(jax.random.key(42), x)
  nnx_flash = jflax.FlashMultiHeadAttention(in_features=3, decode=False, rngs=nnx.Rngs(42),
                                            **kwargs)
  for name in ("query", "key", "value", "out"):
    getattr(nnx_flash, name).kernel[...] = variables["params"][name]["kernel"]
    if use_bias:
      getattr(nnx_flash, name).bias[...] = variables["params"][name]["bias"]
  if normalize_qk:
    for name in ("query_ln", "key_ln"):
      getattr(nnx_flash, name).scale[...] = variables["params"][name]["scale"]
  got_linen = linen_flash.apply(variables, x)
  np.testing.assert_array_equal(np.asarray(nnx_flash(x), F32), np.asarray(got_linen, F32))
  if dtype == jnp.float32:
    stock = nn.MultiHeadDotProductAttention(**kwargs)
    assert_close(got_linen, stock.apply(variables, x))


def test_nnx_varying_kv_features():
  """TestKVFeatures: in_kv_features different from in_features."""
  stock, flash = nnx_pair(num_heads=2, in_features=3, qkv_features=6, out_features=6,
                          in_kv_features=4, decode=False)
  x = jax.random.normal(jax.random.key(0), (1, 2, 3))
  y = jax.random.normal(jax.random.key(1), (1, 5, 4))
  assert_close(flash(x, y), stock(x, y))


def test_nnx_gqa():
  """TestGQADotProductAttention: shapes, the error for heads that do not divide, a GQA
  module's kernels and output, and parity with jax.nn."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  query = jax.random.normal(k1, (2, 4, 6, 8))
  key = jax.random.normal(k2, (2, 5, 3, 8))
  value = jax.random.normal(k3, (2, 5, 3, 8))
  out = jflax.dot_product_attention(query, key, value)
  assert out.shape == (2, 4, 6, 8)
  assert_close(out, jax.nn.dot_product_attention(query, key, value))
  assert_close(out, nnx.dot_product_attention(query, key, value))

  ones = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="must be a multiple"):
    jflax.dot_product_attention(jnp.ones((1, 4, 5, 8)), ones, ones)

  # Flax's module has 2048 qkv features; 512 keep the test fast with the same head counts.
  stock, flash = nnx_pair(num_heads=32, in_features=128, qkv_features=512, num_kv_heads=8,
                          decode=False)
  assert flash.query.kernel.shape == (128, 32, 16)
  assert flash.key.kernel.shape == flash.value.kernel.shape == (128, 8, 16)
  x = jax.random.normal(jax.random.key(1), (1, 10, 128))
  y = flash(x)
  assert y.shape == (1, 10, 128)
  assert_close(y, stock(x))


@pytest.mark.parametrize("q_shape,k_shape,v_shape,match", [
    ((2, 16, 4, 8), (16, 4, 8), (16, 4, 8), "same number of batch dims"),
    ((2, 16, 4, 8), (3, 16, 4, 8), (3, 16, 4, 8), "same batch dims"),
    ((2, 16, 4, 8), (2, 16, 4, 8), (2, 15, 4, 8), "key and value must have the same shape"),
    # value's head dim may differ (Flax's v_depth_per_head), query's and key's may not.
    ((2, 16, 4, 8), (2, 16, 4, 7), (2, 16, 4, 8), "query and key must have the same head dim"),
    ((2, 16, 4, 8), (2, 16, 4, 7), (2, 16, 4, 7), "same head dim"),
], ids=["rank", "batch_dims", "lengths", "kv_depths", "qk_depths"])
def test_invalid_shapes(q_shape, k_shape, v_shape, match):
  """TestDotProductAttentionValidation: a ValueError naming the problem and the shapes."""
  q, k, v = jnp.ones(q_shape), jnp.ones(k_shape), jnp.ones(v_shape)
  with pytest.raises(ValueError):
    nnx.dot_product_attention(q, k, v)
  with pytest.raises(ValueError, match=match) as raised:
    jflax.dot_product_attention(q, k, v, deterministic=True)
  assert f"query{q_shape}" in str(raised.value)
