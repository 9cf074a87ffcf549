"""FlashAttention in plain XLA: the ``implementation="blockwise"`` path.

Keys and values are visited in blocks of ``KEY_BLOCK`` inside a ``lax.scan`` with an online
softmax (running row maximum and sum, rescaled accumulator), and the backward pass recomputes each
block's probabilities from the saved log-sum-exp, as the kernels do. Memory grows linearly with the
sequence: one ``(T, KEY_BLOCK)`` tile of scores per head at a time, never ``(T, S)``.

Its products are XLA's at JAX's default precision for the input dtype, so float32 inputs are as
accurate as any float32 matmul in JAX on that device (TF32 tensor cores on recent NVIDIA GPUs,
full float32 on the CPU), with float32 softmax statistics and accumulation. It is what
``implementation=None`` runs for float32 inputs on a GPU, where the CUDA kernels take 16-bit
inputs. Semantics are the kernels': a row with no key to attend to gives 0 output, 0 gradient
and lse ``EMPTY_ROW_LSE``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flash._reference import EMPTY_ROW_LSE, key_mask

# Keys per scan step. Scores of one step take batch * heads * T * KEY_BLOCK float32s.
KEY_BLOCK = 512


class _Config(NamedTuple):
  """Static settings of one call (hashable: the custom_vjp's nondiff argument)."""

  scale: float
  is_causal: bool
  window_left: int
  window_right: int
  block: int  # keys per scan step


def _split_groups(x: jax.Array, heads_k: int) -> jax.Array:
  """(B, T, N, H) -> (B, T, K, G, H) float32: query heads grouped by the kv head they share."""
  batch, seq, heads, head_dim = x.shape
  return x.astype(jnp.float32).reshape(batch, seq, heads_k, heads // heads_k, head_dim)


def _key_blocks(x: jax.Array, block: int) -> jax.Array:
  """(B, S, K, H) -> (S / block, B, block, K, H) float32, S padded up with zeros."""
  batch, seq, heads, head_dim = x.shape
  blocks = -(-seq // block)
  x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, blocks * block - seq), (0, 0), (0, 0)])
  return jnp.moveaxis(x.reshape(batch, blocks, block, heads, head_dim), 1, 0)


def _scan_inputs(k: jax.Array, v: jax.Array, block: int):
  """What both passes scan over: each key block's index, K block and V block."""
  return jnp.arange(-(-k.shape[1] // block)), _key_blocks(k, block), _key_blocks(v, block)


def _block_scores(q5, k_block, index, q_lens, kv_lens, config: _Config):
  """Scaled scores (B, K, G, T, block) of key block `index`, -inf where masked."""
  scores = jnp.einsum("btkgh,bskh->bkgts", q5, k_block) * config.scale
  mask = key_mask(q5.shape[1], config.block, q_lens, kv_lens, config.is_causal,
                  config.window_left, config.window_right, key_offset=index * config.block)
  return jnp.where(mask[:, None, None], scores, -jnp.inf)


def _forward(q, k, v, q_lens, kv_lens, config):
  """(o (B, T, N, H) in q's dtype, lse (B, N, T) float32)."""
  batch, seq_q, heads_q, head_dim = q.shape
  heads_k = k.shape[2]
  q5 = _split_groups(q, heads_k)
  stats_shape = (batch, heads_k, heads_q // heads_k, seq_q)

  def step(carry, xs):
    row_max, row_sum, acc = carry
    index, k_block, v_block = xs
    scores = _block_scores(q5, k_block, index, q_lens, kv_lens, config)
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
    base = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # no key seen yet: exp(-inf) = 0
    probs = jnp.exp(scores - base[..., None])
    correction = jnp.exp(row_max - base)
    row_sum = row_sum * correction + jnp.sum(probs, axis=-1)
    acc = acc * correction[..., None] + jnp.einsum("bkgts,bskh->bkgth", probs, v_block)
    return (new_max, row_sum, acc), None

  init = (jnp.full(stats_shape, -jnp.inf), jnp.zeros(stats_shape),
          jnp.zeros(stats_shape + (head_dim,)))
  (row_max, row_sum, acc), _ = jax.lax.scan(step, init, _scan_inputs(k, v, config.block))
  has_keys = row_sum > 0
  safe_sum = jnp.where(has_keys, row_sum, 1.0)
  out = acc / safe_sum[..., None]
  out = jnp.moveaxis(out, 3, 1).reshape(batch, seq_q, heads_q, head_dim).astype(q.dtype)
  lse = jnp.where(has_keys, jnp.log(safe_sum) + row_max, EMPTY_ROW_LSE)
  return out, lse.reshape(batch, heads_q, seq_q)


def _backward(q, k, v, o, lse, d_o, q_lens, kv_lens, config):
  """(dq, dk, dv) in the dtypes of q, k, v; dK and dV summed over each kv head's query heads."""
  batch, seq_q, heads_q, head_dim = q.shape
  seq_k, heads_k = k.shape[1], k.shape[2]
  q5, do5 = _split_groups(q, heads_k), _split_groups(d_o, heads_k)
  delta = jnp.einsum("btkgh,btkgh->bkgt", do5, _split_groups(o, heads_k))
  lse = lse.reshape(batch, heads_k, heads_q // heads_k, seq_q)
  # Rows that attend to nothing: lse +inf makes every probability exp(-inf) = 0.
  lse = jnp.where(lse == EMPTY_ROW_LSE, jnp.inf, lse)

  def step(dq, xs):
    index, k_block, v_block = xs
    scores = _block_scores(q5, k_block, index, q_lens, kv_lens, config)
    probs = jnp.exp(scores - lse[..., None])
    d_probs = jnp.einsum("btkgh,bskh->bkgts", do5, v_block)
    d_scores = probs * (d_probs - delta[..., None]) * config.scale
    dq = dq + jnp.einsum("bkgts,bskh->btkgh", d_scores, k_block)
    dk_block = jnp.einsum("bkgts,btkgh->bskh", d_scores, q5)
    dv_block = jnp.einsum("bkgts,btkgh->bskh", probs, do5)
    return dq, (dk_block, dv_block)

  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(q5), _scan_inputs(k, v, config.block))

  def unblock(x, like):
    x = jnp.moveaxis(x, 0, 1).reshape(batch, -1, heads_k, head_dim)
    return x[:, :seq_k].astype(like.dtype)

  return dq.reshape(q.shape).astype(q.dtype), unblock(dk, k), unblock(dv, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, q_lens, kv_lens, config):
  return _forward(q, k, v, q_lens, kv_lens, config)


def _attention_fwd(q, k, v, q_lens, kv_lens, config):
  o, lse = _forward(q, k, v, q_lens, kv_lens, config)
  return (o, lse), (q, k, v, o, lse, q_lens, kv_lens)


def _attention_bwd(config, residuals, cotangents):
  q, k, v, o, lse, q_lens, kv_lens = residuals
  d_o, _ = cotangents  # lse leaves through stop_gradient
  return (*_backward(q, k, v, o, lse, d_o, q_lens, kv_lens, config), None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q, k, v, q_lens, kv_lens, *, scale: float, is_causal: bool,
                        window_left: int = -1, window_right: int = -1):
  """Returns (o, lse) as ``attention_reference`` does: o (B, T, N, H) in q's dtype, lse
  (B, N, T) float32, differentiable in q, k and v with a recomputing backward pass."""
  if k.shape[1] == 0 or q.shape[1] == 0:  # no blocks to scan: every row is empty
    lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), EMPTY_ROW_LSE, jnp.float32)
    return jnp.zeros_like(q), lse
  config = _Config(float(scale), bool(is_causal), int(window_left), int(window_right),
                   min(KEY_BLOCK, k.shape[1]))
  return _attention(q, k, v, q_lens, kv_lens, config)
