"""The model: a decoder-only byte-level transformer in Flax NNX (pre-norm blocks, rotary or
learned positions, grouped-query attention), its attention taken from lm.attention.

Besides the training forward (``ByteLM.__call__``) the model decodes with a KV cache, one
``LayerCache`` per block: ``prefill`` runs the prompts and returns their keys and values,
``decode`` feeds one token per sequence at that sequence's own position (so prompts of different
lengths decode together) and attends over the cache's first ``position + 1`` entries, passed to
the attention as ``key_value_seq_lengths``."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lm.attention import attention_fn, cached_attention_fn, packed_attention_fn
from lm.config import Config

VOCAB_SIZE = 256  # bytes


def rope(x: jax.Array, base: float, positions: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding of x (B, T, heads, H), rotating pairs (i, i + H/2), at the given
  positions, (T,) or per sequence (B, T) (default 0 .. T-1)."""
  seq_len, head_dim = x.shape[1], x.shape[-1]
  if positions is None:
    positions = jnp.arange(seq_len)
  freqs = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = positions.astype(jnp.float32)[..., None] * freqs  # (T or B, T, H/2)
  cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # broadcast over heads
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


class LayerCache(NamedTuple):
  """One block's cached keys and values, (B, max_len, kv_heads, head_dim) each."""

  key: jax.Array
  value: jax.Array


def _filled(y: jax.Array, max_len: int) -> jax.Array:
  """y (B, T, ...) at positions 0 .. T-1 of zeros (B, max_len, ...)."""
  return jnp.zeros((y.shape[0], max_len, *y.shape[2:]), y.dtype).at[:, :y.shape[1]].set(y)


def _write(cached: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
  """new (B, 1, ...) written into cached (B, max_len, ...) at each sequence's position (B,)."""
  return jax.vmap(lambda c, n, at: jax.lax.dynamic_update_slice_in_dim(c, n, at, axis=0))(
      cached, new, positions)


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with optional grouped-query (fewer) key/value heads."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.dtype)
    hd, n, k = config.head_dim, config.heads, config.num_kv_heads
    self.query = nnx.Linear(config.width, n * hd, use_bias=False, dtype=dtype, rngs=rngs)
    self.key_value = nnx.Linear(config.width, 2 * k * hd, use_bias=False, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(n * hd, config.width, use_bias=False, dtype=dtype, rngs=rngs,
                          kernel_init=nnx.initializers.normal(0.02 / math.sqrt(2 * config.layers)))
    self.attend = attention_fn(config)
    self.attend_cached = cached_attention_fn(config)
    self.attend_packed = packed_attention_fn(config)

  def _project(self, x: jax.Array, positions: jax.Array | None):
    """q (B, T, heads, head_dim) and k, v (B, T, kv_heads, head_dim) of x at `positions`."""
    c = self.config
    batch, seq_len, _ = x.shape
    q = self.query(x).reshape(batch, seq_len, c.heads, c.head_dim)
    k, v = jnp.split(self.key_value(x).reshape(batch, seq_len, 2 * c.num_kv_heads, c.head_dim), 2,
                     axis=2)
    if c.positions == "rope":
      q, k = rope(q, c.rope_base, positions), rope(k, c.rope_base, positions)
    return q, k, v

  def _output(self, o: jax.Array) -> jax.Array:
    batch, seq_len = o.shape[:2]
    return self.out(o.reshape(batch, seq_len, self.config.heads * self.config.head_dim))

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """Causal self-attention (GQA when kv_heads < heads); with `segment_ids` (B, T) packed
    documents, each attending only to itself, at `positions` (B, T) within their documents."""
    q, k, v = self._project(x, positions)
    if segment_ids is not None:
      return self._output(self.attend_packed(q, k, v, segment_ids))
    return self._output(self.attend(q, k, v))

  def prefill(self, x: jax.Array, max_len: int) -> tuple[jax.Array, LayerCache]:
    """The training forward on prompts x (B, T, width), and a cache of max_len positions
    holding their keys and values at 0 .. T-1."""
    q, k, v = self._project(x, None)
    return self._output(self.attend(q, k, v)), LayerCache(_filled(k, max_len), _filled(v, max_len))

  def decode(self, x: jax.Array, positions: jax.Array, cache: LayerCache
             ) -> tuple[jax.Array, LayerCache]:
    """One new token per sequence, x (B, 1, width) at positions (B,): writes its key and value
    into the cache there and attends to the cache's entries 0 .. position."""
    q, k, v = self._project(x, positions[:, None])
    cache = LayerCache(_write(cache.key, k, positions), _write(cache.value, v, positions))
    o = self.attend_cached(q, cache.key, cache.value, key_value_seq_lengths=positions + 1)
    return self._output(o), cache


class MLP(nnx.Module):
  """Two-layer GELU MLP."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(config.dtype)
    hidden = config.mlp_ratio * config.width
    self.up = nnx.Linear(config.width, hidden, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(hidden, config.width, dtype=dtype, rngs=rngs,
                           kernel_init=nnx.initializers.normal(0.02 / math.sqrt(2 * config.layers)))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(config.dtype)
    self.attn_norm = nnx.RMSNorm(config.width, dtype=dtype, rngs=rngs)
    self.attn = CausalSelfAttention(config, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(config.width, dtype=dtype, rngs=rngs)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    return self._mlp(x + self.attn(self.attn_norm(x), segment_ids, positions))

  def prefill(self, x: jax.Array, max_len: int) -> tuple[jax.Array, LayerCache]:
    a, cache = self.attn.prefill(self.attn_norm(x), max_len)
    return self._mlp(x + a), cache

  def decode(self, x: jax.Array, positions: jax.Array, cache: LayerCache
             ) -> tuple[jax.Array, LayerCache]:
    a, cache = self.attn.decode(self.attn_norm(x), positions, cache)
    return self._mlp(x + a), cache

  def _mlp(self, x: jax.Array) -> jax.Array:
    return x + self.mlp(self.mlp_norm(x))


class ByteLM(nnx.Module):
  """Decoder-only transformer over bytes; returns float32 logits (B, T, 256)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.dtype)
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(VOCAB_SIZE, config.width, dtype=dtype, embedding_init=init, rngs=rngs)
    if config.positions == "learned":
      self.pos_embed = nnx.Embed(config.seq_len, config.width, dtype=dtype, embedding_init=init,
                                 rngs=rngs)
    self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.layers)])
    self.final_norm = nnx.RMSNorm(config.width, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """Logits of tokens (B, T); packed rows pass each token's document id and its position in
    the document, both (B, T) int32 (train_lm.py --pack)."""
    x = self._embed(tokens, jnp.arange(tokens.shape[1])[None] if positions is None else positions)
    for block in self.blocks:
      x = block(x, segment_ids, positions)
    return self._logits(x)

  def prefill(self, tokens: jax.Array, max_len: int) -> tuple[jax.Array, list[LayerCache]]:
    """Logits (B, T, 256) of prompts (B, T) (as __call__) and the blocks' caches of max_len
    positions, filled at 0 .. T-1."""
    x, caches = self._embed(tokens, jnp.arange(tokens.shape[1])[None]), []
    for block in self.blocks:
      x, cache = block.prefill(x, max_len)
      caches.append(cache)
    return self._logits(x), caches

  def decode(self, tokens: jax.Array, positions: jax.Array, caches: list[LayerCache]
             ) -> tuple[jax.Array, list[LayerCache]]:
    """Logits (B, 256) of the next token after `tokens` (B,), which sit at positions (B,); the
    caches with their keys and values written there."""
    x, new_caches = self._embed(tokens[:, None], positions[:, None]), []
    for block, cache in zip(self.blocks, caches):
      x, cache = block.decode(x, positions, cache)
      new_caches.append(cache)
    return self._logits(x)[:, 0], new_caches

  def _embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    if self.config.positions == "learned":
      x = x + self.pos_embed(positions)
    return x

  def _logits(self, x: jax.Array) -> jax.Array:
    return self.embed.attend(self.final_norm(x)).astype(jnp.float32)  # tied output layer
