"""One autoregressive decode step on Flax's attention cache, for jax_flash.flax's modules.

Flax's attention modules (``nn.MultiHeadDotProductAttention`` and ``nnx.MultiHeadAttention`` with
``decode=True``) keep three variables in the "cache" collection: ``cached_key`` and
``cached_value`` of shape ``(batch..., max_length, kv_heads, head_dim)`` and ``cache_index``, a
scalar int32, the position the next call writes. Each decode call writes its new key and value
there and lets its query attend to positions ``0 .. cache_index`` through a mask.

jax_flash's modules keep the same variables and write them the same way; they attend with the
kernels over the valid prefix instead, passed as ``key_value_seq_lengths`` (no mask array). Past
the end of the cache they do what Flax does: ``lax.dynamic_update_slice`` clamps the write to the
last slot, the index keeps counting, and every slot is attended to. Pure JAX: no Flax import.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class DecodeStep:
  """The cache after one decode call, and what the attention of that call takes."""

  cached_key: jax.Array  # (batch..., max_length, kv_heads, head_dim): the new key written
  cached_value: jax.Array  # like cached_key
  cache_index: jax.Array  # scalar int32: the index after this call (one more)
  key_value_seq_lengths: jax.Array  # int32 of shape batch...: the valid prefix to attend to


def check_new_entry(owner: str, name: str, x: jax.Array, cache_shape: tuple[int, ...]) -> None:
  """Raises ValueError unless `x` (the projected query, key or value of one decode call, named
  `name`) has the shape ``(batch..., 1, heads, head_dim)`` that a cache of `cache_shape`
  ``(batch..., max_length, heads, head_dim)`` takes, with Flax's message plus what each dim
  must be. Linen's stock module checks the query (its cache has the query's heads: no
  grouped-query attention there), NNX's the key."""
  *batch_dims, max_length, heads, head_dim = cache_shape
  expected = (*batch_dims, 1, heads, head_dim)
  if tuple(x.shape) != expected:
    raise ValueError(
        f"{owner}: Autoregressive cache shape error, expected {name} shape {expected} instead "
        f"got {tuple(x.shape)}. With decode=True each call takes one new position, shaped "
        f"(batch..., 1, features) with the batch dims of the cache (batch..., max_length="
        f"{max_length}, heads, head_dim) = {tuple(cache_shape)}.")


def write_and_attend(owner: str, key: jax.Array, value: jax.Array, cached_key: jax.Array,
                     cached_value: jax.Array, cache_index: jax.Array,
                     key_value_seq_lengths: jax.Array | None = None) -> DecodeStep:
  """Writes `key`, `value` ``(batch..., 1, kv_heads, head_dim)`` at `cache_index` and returns
  the new cache and the lengths to attend over: ``min(cache_index + 1, max_length)`` for every
  sequence, or less where the caller's `key_value_seq_lengths` say so.

  Raises ValueError for a key or value the cache cannot take (shape), TypeError for a dtype
  other than the cache's (``lax.dynamic_update_slice`` raises TypeError there in Flax)."""
  check_new_entry(owner, "key", key, cached_key.shape)
  check_new_entry(owner, "value", value, cached_value.shape)
  for name, new, cached in (("key", key, cached_key), ("value", value, cached_value)):
    if new.dtype != cached.dtype:
      raise TypeError(
          f"{owner}: the new {name} is {new.dtype} but cached_{name} is {cached.dtype} (shape "
          f"{tuple(cached.shape)}); create the cache in the module's computation dtype, e.g. "
          f"init_cache(input_shape, dtype={new.dtype}) in NNX")
  if jnp.shape(cache_index) != () or not jnp.issubdtype(jnp.result_type(cache_index),
                                                       jnp.integer):
    raise ValueError(f"{owner}: cache_index must be an integer scalar; got "
                     f"{jnp.result_type(cache_index)}{tuple(jnp.shape(cache_index))}")
  *batch_dims, max_length, _, _ = cached_key.shape
  zero = jnp.zeros((), jnp.result_type(cache_index))
  start = (zero,) * len(batch_dims) + (cache_index, zero, zero)
  new_key = lax.dynamic_update_slice(cached_key, key, start)
  new_value = lax.dynamic_update_slice(cached_value, value, start)

  valid = jnp.minimum(cache_index + 1, max_length).astype(jnp.int32)
  lengths = jnp.broadcast_to(valid, tuple(batch_dims))
  if key_value_seq_lengths is not None:
    given = jnp.asarray(key_value_seq_lengths)
    if given.shape != tuple(batch_dims):
      raise ValueError(
          f"{owner}: key_value_seq_lengths must have one length per sequence, shape "
          f"{tuple(batch_dims)} (the batch dims of the cache); got {given.shape}")
    lengths = jnp.minimum(lengths, given).astype(given.dtype)  # int32 is checked downstream
  return DecodeStep(new_key, new_value, cache_index + 1, lengths)
