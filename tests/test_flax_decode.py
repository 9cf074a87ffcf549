"""decode=True in jax_flash.flax's modules against Flax's own autoregressive cache.

FlashMultiHeadDotProductAttention (Linen) and FlashMultiHeadAttention (NNX) keep Flax's cache
variables (collection "cache": cached_key, cached_value, cache_index) and attend over the valid
prefix with the kernels (key_value_seq_lengths, no mask array). Checked here:

* decoding one position at a time gives the full-sequence causal forward at every position, by
  FlashAttention's rule (attention_testing.py) against the stock module's full forward computing
  in float32 (and in the test's dtype for the bound), with grouped-query attention too;
* after the same calls the cache equals the stock module's: names, shapes, dtypes, values;
* a cache (and parameters) made by the stock module decode on in ours, and the other way round;
* past the end of the cache both do what Flax does (no error: the last slot is overwritten);
* misuse raises the stock module's exception type with a message naming the argument and shapes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from attention_testing import assert_within_rule, max_abs, random_array  # noqa: E402

from jax_flash import flax as jflax  # noqa: E402

F32 = jnp.float32
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
BATCH, SEQ, FEATURES, HEADS, KV_HEADS = 2, 11, 32, 4, 2  # head dim 8


def assert_close(got, want, name=""):
  """Equal up to float32 round-off: max|got - want| <= 1e-5 max|want| + 1e-6."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (name, got.shape, want.shape)
  err = max_abs(got - want)
  assert err <= 1e-5 * max_abs(want) + 1e-6, f"{name}: max abs error {err:.3g}"


def assert_same_cache(got, want):
  """Two "cache" collections (pure dicts) with the same names, shapes, dtypes and values."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    name = jax.tree_util.keystr(path)
    assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, g.dtype, w.shape, w.dtype)
    np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(w, np.float64), name)


def causal_mask(x):
  return nn.make_causal_mask(x[..., 0])


# ---------------------------------------------------------------------------------------------
# Linen


def linen_decode(module, params, cache, x, steps=None):
  """Feeds x (batch..., T, F) one position at a time (position t % T on call t) through the
  jit-compiled decode call; returns (outputs (batch..., steps, F), the cache after)."""

  @jax.jit
  def step(cache, xt):
    y, mutated = module.apply({"params": params, "cache": cache}, xt, mutable=["cache"])
    return mutated["cache"], y

  seq = x.shape[-2]
  outputs = []
  for t in range(seq if steps is None else steps):
    cache, y = step(cache, x[..., t % seq:t % seq + 1, :])
    outputs.append(y)
  return jnp.concatenate(outputs, axis=-2), cache


def stock_linen_params(params, groups: int):
  """Our Linen parameters with each kv head repeated `groups` times: the stock module's
  equivalent (stock Linen has no grouped-query attention)."""
  params = jax.tree.map(lambda x: x, params)  # a copy with the same structure
  for name in ("key", "value"):
    params[name] = {k: jnp.repeat(w, groups, axis=-2) for k, w in params[name].items()}
  return params


@pytest.mark.parametrize("num_kv_heads", [None, KV_HEADS], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linen_decode_matches_full_causal_forward(rng, dtype, num_kv_heads):
  x = random_array(rng, (BATCH, SEQ, FEATURES), F32)
  flash = jflax.FlashMultiHeadDotProductAttention(
      HEADS, num_kv_heads=num_kv_heads, dtype=DTYPES[dtype], is_causal=True, decode=True)
  variables = flash.init(jax.random.key(0), x)
  params, cache = variables["params"], variables["cache"]
  got, cache = linen_decode(flash, params, cache, x)
  full = flash.clone(decode=False).apply({"params": params}, x)
  assert got.dtype == full.dtype == DTYPES[dtype] and int(cache["cache_index"]) == SEQ

  stock_params = stock_linen_params(params, HEADS // (num_kv_heads or HEADS))
  ref32, refd = (nn.MultiHeadDotProductAttention(HEADS, dtype=d).apply(
      {"params": stock_params}, x, mask=causal_mask(x)) for d in (F32, DTYPES[dtype]))
  as64 = lambda y: np.asarray(y.astype(F32), np.float64)
  assert_within_rule("decode", as64(got), as64(ref32), as64(refd))
  assert_within_rule("full", as64(full), as64(ref32), as64(refd))
  if dtype == "float32":
    assert_close(got, full, "decode vs full")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linen_cache_is_the_stock_cache(rng, dtype):
  """The same variables after init and after every decode call (past the end too: Flax clamps
  the write to the last slot and keeps counting), and the same outputs."""
  x = random_array(rng, (BATCH, 5, FEATURES), F32)
  stock = nn.MultiHeadDotProductAttention(HEADS, dtype=DTYPES[dtype], decode=True)
  flash = jflax.FlashMultiHeadDotProductAttention(HEADS, dtype=DTYPES[dtype], decode=True,
                                                   is_causal=True)
  stock_vars, flash_vars = (m.init(jax.random.key(0), x) for m in (stock, flash))
  assert set(flash_vars) == {"params", "cache"}
  assert set(flash_vars["cache"]) == {"cached_key", "cached_value", "cache_index"}
  assert_same_cache(flash_vars["cache"], stock_vars["cache"])
  assert flash_vars["cache"]["cached_key"].shape == (BATCH, 5, HEADS, FEATURES // HEADS)
  assert flash_vars["cache"]["cache_index"].dtype == jnp.int32
  assert_same_cache(flash_vars["params"], stock_vars["params"])

  params = stock_vars["params"]
  for steps in (3, 7):  # within the cache, and 2 calls past its end
    want, want_cache = linen_decode(stock, params, stock_vars["cache"], x, steps)
    got, got_cache = linen_decode(flash, params, flash_vars["cache"], x, steps)
    assert_same_cache(got_cache, want_cache)
    assert int(got_cache["cache_index"]) == steps
    if dtype == "float32":
      assert_close(got, want, f"{steps} steps")


def test_linen_cache_moves_between_stock_and_flash(rng):
  """Three calls on one module, the rest on the other, from the first one's variables: the
  outputs of the stock module decoding all the way."""
  x = random_array(rng, (BATCH, 6, FEATURES), F32)
  stock = nn.MultiHeadDotProductAttention(HEADS, decode=True)
  flash = jflax.FlashMultiHeadDotProductAttention(HEADS, decode=True)
  variables = stock.init(jax.random.key(1), x)
  params = variables["params"]
  want, _ = linen_decode(stock, params, variables["cache"], x)
  for first, second in ((stock, flash), (flash, stock)):
    head, cache = linen_decode(first, params, first.init(jax.random.key(1), x)["cache"], x[:, :3])
    tail, _ = linen_decode(second, params, cache, x[:, 3:])
    assert_close(jnp.concatenate([head, tail], axis=1), want,
                 f"{type(first).__name__} -> {type(second).__name__}")


def test_linen_decode_with_lengths_is_the_stock_decode_with_a_mask(rng):
  """key_value_seq_lengths in a decode call narrow the prefix further, as a padding mask does
  in the stock decode call."""
  x = random_array(rng, (BATCH, 6, FEATURES), F32)
  stock = nn.MultiHeadDotProductAttention(HEADS, decode=True)
  flash = jflax.FlashMultiHeadDotProductAttention(HEADS, decode=True)
  variables = stock.init(jax.random.key(2), x)
  lengths = jnp.array([2, 6], jnp.int32)
  mask = (jnp.arange(6) < lengths[:, None])[:, None, None, :]
  stock_cache = flash_cache = variables["cache"]
  for t in range(6):
    xt = x[:, t:t + 1]
    want, stock_cache = stock.apply({**variables, "cache": stock_cache}, xt, mask=mask,
                                    mutable=["cache"])
    got, flash_cache = flash.apply({**variables, "cache": flash_cache}, xt,
                                   key_value_seq_lengths=lengths, mutable=["cache"])
    stock_cache, flash_cache = stock_cache["cache"], flash_cache["cache"]
    assert_close(got, want, f"position {t}")


@pytest.mark.parametrize("batch_dims", [(2,), (2, 3)])
def test_linen_decode_under_scan(rng, batch_dims):
  """Flax's test_decoding: the decode module under lax.scan, one or two batch dims."""
  x = random_array(rng, (*batch_dims, 5, 12), F32)
  flash = jflax.FlashMultiHeadDotProductAttention(num_heads=3, qkv_features=12, decode=True)
  variables = flash.init(jax.random.key(1), x)
  params, cache = variables["params"], variables["cache"]
  assert cache["cached_key"].shape == (*batch_dims, 5, 3, 4)

  def body(cache, xt):
    y, mutated = flash.apply({"params": params, "cache": cache}, xt[..., None, :],
                             mutable=["cache"])
    return mutated["cache"], y[..., 0, :]

  _, ys = jax.lax.scan(body, cache, jnp.moveaxis(x, -2, 0))
  want = nn.MultiHeadDotProductAttention(num_heads=3, qkv_features=12).apply(
      {"params": params}, x, mask=causal_mask(x))
  assert_close(jnp.moveaxis(ys, 0, -2), want)


def test_linen_decode_misuse_raises_as_stock(rng):
  x = random_array(rng, (BATCH, 5, FEATURES), F32)
  stock = nn.MultiHeadDotProductAttention(HEADS, decode=True)
  flash = jflax.FlashMultiHeadDotProductAttention(HEADS, decode=True)
  variables = stock.init(jax.random.key(0), x)

  def call(module, *args, **kwargs):
    return module.apply(variables, *args, mutable=["cache"], **kwargs)

  # Two positions in one decode call: the query does not fit the cache.
  for module in (stock, flash):
    with pytest.raises(ValueError, match=re.escape(
        "expected query shape (2, 1, 4, 8) instead got (2, 2, 4, 8)")):
      call(module, x[:, :2])
  with pytest.raises(ValueError, match=re.escape("(batch..., max_length=5, heads, head_dim) = "
                                                 "(2, 5, 4, 8)")):
    call(flash, x[:, :2])
  with pytest.raises(ValueError, match=re.escape("expected query shape (2, 1, 4, 8) instead "
                                                 "got (3, 1, 4, 8)")):
    call(flash, random_array(rng, (3, 1, FEATURES), F32))
  # A key of two positions for one query (stock Linen writes both silently).
  with pytest.raises(ValueError, match=re.escape("expected key shape (2, 1, 4, 8) instead got "
                                                 "(2, 2, 4, 8)")):
    call(flash, x[:, :1], x[:, :2])
  with pytest.raises(ValueError, match=re.escape("key_value_seq_lengths must have one length "
                                                 "per sequence, shape (2,)")):
    call(flash, x[:, :1], key_value_seq_lengths=jnp.array([1, 2, 3], jnp.int32))
  with pytest.raises(NotImplementedError, match="local_window_size=3 with decode=True"):
    call(flash.clone(local_window_size=3), x[:, :1])
  # A mask array reaches the "cpu" kernel (the CUDA kernels refuse it: tests/test_flax.py): one
  # of ones changes nothing.
  np.testing.assert_array_equal(
      np.asarray(call(flash, x[:, :1], mask=jnp.ones((BATCH, 1, 1, 5), bool))[0]),
      np.asarray(call(flash, x[:, :1])[0]))
  # The cache is made in the dtype of the first call's keys: a float32 cache for a bf16 module.
  for module in (stock, flash):
    with pytest.raises(TypeError, match="same dtypes|cached_key is float32"):
      call(module.clone(dtype=jnp.bfloat16), x[:, :1])


# ---------------------------------------------------------------------------------------------
# NNX


def nnx_decode(module, x, steps=None):
  """Feeds x (B, T, F) one position at a time (position t % T on call t) through the
  nnx.jit-compiled decode call; returns the outputs (B, steps, F)."""
  step = nnx.jit(lambda m, xt: m(xt, decode=True))
  seq = x.shape[1]
  return jnp.concatenate([step(module, x[:, t % seq:t % seq + 1])
                          for t in range(seq if steps is None else steps)], axis=1)


def nnx_cache(module) -> dict:
  return nnx.to_pure_dict(nnx.state(module, nnx.Cache))


@pytest.mark.parametrize("num_kv_heads", [None, KV_HEADS], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nnx_decode_matches_full_causal_forward(rng, dtype, num_kv_heads):
  x = random_array(rng, (BATCH, SEQ, FEATURES), F32)
  flash = jflax.FlashMultiHeadAttention(HEADS, FEATURES, num_kv_heads=num_kv_heads,
                                        dtype=DTYPES[dtype], is_causal=True, rngs=nnx.Rngs(0))
  full = flash(x)
  flash.init_cache(x.shape, dtype=DTYPES[dtype])
  got = nnx_decode(flash, x)
  assert got.dtype == full.dtype == DTYPES[dtype] and int(flash.cache_index[...]) == SEQ

  ref32, refd = (nnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=num_kv_heads, dtype=d,
                                        decode=False, rngs=nnx.Rngs(1))
                 for d in (F32, DTYPES[dtype]))
  for stock in (ref32, refd):
    nnx.update(stock, nnx.state(flash, nnx.Param))
  ref32, refd = (m(x, mask=causal_mask(x)) for m in (ref32, refd))
  as64 = lambda y: np.asarray(y.astype(F32), np.float64)
  assert_within_rule("decode", as64(got), as64(ref32), as64(refd))
  assert_within_rule("full", as64(full), as64(ref32), as64(refd))
  if dtype == "float32":
    assert_close(got, full, "decode vs full")


@pytest.mark.parametrize("num_kv_heads", [None, KV_HEADS], ids=["mha", "gqa"])
def test_nnx_cache_is_the_stock_cache(rng, num_kv_heads):
  """init_cache and nnx.view make the stock module's variables; every decode call (past the end
  too) leaves the same cache and gives the same output."""
  x = random_array(rng, (BATCH, 5, FEATURES), F32)
  stock = nnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=num_kv_heads, decode=True,
                                 rngs=nnx.Rngs(0))
  flash = jflax.FlashMultiHeadAttention(HEADS, FEATURES, num_kv_heads=num_kv_heads,
                                        decode=True, rngs=nnx.Rngs(0))
  assert nnx_cache(flash) == nnx_cache(stock) == {}
  for module in (stock, flash):
    module.init_cache(x.shape)
  assert set(nnx_cache(flash)) == {"cached_key", "cached_value", "cache_index"}
  assert nnx_cache(flash)["cached_key"].shape == (BATCH, 5, num_kv_heads or HEADS, 8)
  assert_same_cache(nnx_cache(flash), nnx_cache(stock))
  assert_same_cache(nnx_cache(nnx.view(flash, decode=True, batch_size=3, max_length=4)),
                    nnx_cache(nnx.view(stock, decode=True, batch_size=3, max_length=4)))

  nnx.update(flash, nnx.state(stock, nnx.Param))
  for steps in (3, 4):  # calls 1-3 within the cache, then 4 more: 2 past its end
    want, got = nnx_decode(stock, x, steps), nnx_decode(flash, x, steps)
    assert_same_cache(nnx_cache(flash), nnx_cache(stock))
    assert_close(got, want, f"{steps} steps")
  assert int(flash.cache_index[...]) == 7


def test_nnx_cache_moves_between_stock_and_flash(rng):
  """The whole state (parameters and a half-filled cache) of one module decodes on in the
  other, as the stock module decoding all the way."""
  x = random_array(rng, (BATCH, 6, FEATURES), F32)
  make = lambda cls: cls(HEADS, FEATURES, decode=True, rngs=nnx.Rngs(3))
  reference = make(nnx.MultiHeadAttention)
  reference.init_cache(x.shape)
  want = nnx_decode(reference, x)
  for first_cls, second_cls in ((nnx.MultiHeadAttention, jflax.FlashMultiHeadAttention),
                                (jflax.FlashMultiHeadAttention, nnx.MultiHeadAttention)):
    first, second = make(first_cls), make(second_cls)
    first.init_cache(x.shape)
    head = nnx_decode(first, x[:, :3])
    state = nnx.to_pure_dict(nnx.state(first))  # what a checkpoint holds
    second.init_cache(x.shape)
    second_state = nnx.state(second)
    nnx.replace_by_pure_dict(second_state, state)
    nnx.update(second, second_state)
    tail = nnx_decode(second, x[:, 3:])
    assert_close(jnp.concatenate([head, tail], axis=1), want,
                 f"{first_cls.__name__} -> {second_cls.__name__}")


def test_nnx_decode_misuse_raises_as_stock(rng):
  x = random_array(rng, (BATCH, 5, FEATURES), F32)
  make = lambda cls, **kw: cls(HEADS, FEATURES, decode=True, rngs=nnx.Rngs(0), **kw)
  stock, flash = make(nnx.MultiHeadAttention), make(jflax.FlashMultiHeadAttention)
  for module in (stock, flash):
    with pytest.raises(ValueError, match="cache not initialized, call ``init_cache`` first"):
      module(x[:, :1])
    module.init_cache(x.shape)
    with pytest.raises(ValueError, match=re.escape("expected key shape (2, 1, 4, 8) instead "
                                                   "got (2, 2, 4, 8)")):
      module(x[:, :2])
  with pytest.raises(ValueError, match=re.escape("expected key shape (2, 1, 4, 8) instead got "
                                                 "(3, 1, 4, 8)")):
    flash(random_array(rng, (3, 1, FEATURES), F32))
  with pytest.raises(ValueError, match=re.escape("key_value_seq_lengths must have one length "
                                                 "per sequence, shape (2,)")):
    flash(x[:, :1], key_value_seq_lengths=jnp.array([1], jnp.int32))
  window = make(jflax.FlashMultiHeadAttention, local_window_size=(2, 0))
  window.init_cache(x.shape)
  with pytest.raises(NotImplementedError, match=re.escape("local_window_size=(2, 0) with "
                                                          "decode=True")):
    window(x[:, :1])
  # A mask array reaches the "cpu" kernel (the CUDA kernels refuse it: tests/test_flax.py); a
  # module of its own, as the call writes its cache.
  masked = make(jflax.FlashMultiHeadAttention)
  masked.init_cache(x.shape)
  assert np.all(np.isfinite(np.asarray(masked(x[:, :1], mask=jnp.ones((BATCH, 1, 1, 5), bool)))))
  # A float32 cache (init_cache's default dtype) for a module computing in bfloat16.
  for cls in (nnx.MultiHeadAttention, jflax.FlashMultiHeadAttention):
    module = make(cls, dtype=jnp.bfloat16)
    module.init_cache(x.shape)
    with pytest.raises(TypeError, match="same dtypes|cached_key is float32"):
      module(x[:, :1])
  assert int(flash.cache_index[...]) == 0  # no failed call wrote the cache
