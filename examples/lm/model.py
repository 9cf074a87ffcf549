"""The model: a decoder-only byte-level transformer in Flax NNX (pre-norm blocks, rotary or
learned positions, grouped-query attention), its attention taken from lm.attention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from lm.attention import attention_fn
from lm.config import Config

VOCAB_SIZE = 256  # bytes


def rope(x: jax.Array, base: float, positions: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding of x (B, T, heads, H), rotating pairs (i, i + H/2), at the given
  positions (T,) (default 0 .. T-1)."""
  seq_len, head_dim = x.shape[1], x.shape[-1]
  if positions is None:
    positions = jnp.arange(seq_len)
  freqs = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # (T, H/2)
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


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

  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    batch, seq_len, _ = x.shape
    q = self.query(x).reshape(batch, seq_len, c.heads, c.head_dim)
    k, v = jnp.split(self.key_value(x).reshape(batch, seq_len, 2 * c.num_kv_heads, c.head_dim), 2,
                     axis=2)
    if c.positions == "rope":
      q, k = rope(q, c.rope_base), rope(k, c.rope_base)
    o = self.attend(q, k, v)  # (B, T, heads, head_dim); GQA when kv_heads < heads
    return self.out(o.reshape(batch, seq_len, c.heads * c.head_dim))


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

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
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

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    if self.config.positions == "learned":
      x = x + self.pos_embed(jnp.arange(tokens.shape[1]))[None]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.final_norm(x)).astype(jnp.float32)  # tied output layer
