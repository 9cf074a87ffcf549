"""The CPU backward's key blocks in step (cuda/cpu/flash_bwd.h FlashBwdMain::run): a task's key
blocks walk each query head's blocks several at a time, so that a query block's Q, dO and dQ
rows serve them all from L2. A dQ row still takes its key blocks' terms in their order, and each
(key block, query block) visit's arithmetic is unchanged, so every gradient must be bit for bit
what the walk of one key block at a time gives (JAX_FLASH_CPU_BWD_KEY_BLOCKS=1, read at each
call; by default as many as one core's L2 holds, at most eight), under every mask and score
policy, and with dbias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernel")

# 11 key blocks of 64 (the last 20 keys), 12 query blocks: walks of 3 end on a short round.
B, T, S, N, K, H = 2, 720, 660, 4, 2, 64


def _inputs(dtype):
  keys = jax.random.split(jax.random.PRNGKey(50), 6)
  q = jax.random.normal(keys[0], (B, T, N, H), dtype)
  k = jax.random.normal(keys[1], (B, S, K, H), dtype)
  v = jax.random.normal(keys[2], (B, S, K, H), dtype)
  d_o = jax.random.normal(keys[3], (B, T, N, H), dtype)
  return q, k, v, d_o, keys[4], keys[5]


def _options(kind, key, dropout_key):
  """The call's keyword arguments, and a bias to differentiate where the kind has one."""
  if kind == "plain":
    return {}, None
  if kind == "causal_lengths":  # key blocks whose first query rows are off the tile grid
    return {"is_causal": True, "query_seq_lengths": jnp.array([720, 500]),
            "key_value_seq_lengths": jnp.array([660, 430])}, None
  if kind == "window":  # neighbouring key blocks see different query ranges
    return {"local_window_size": (90, 40)}, None
  if kind == "segments":
    q_ids = jnp.array([np.repeat([0, 1, 2], [200, 350, 170]), np.repeat([0, 1], [400, 320])])
    kv_ids = jnp.array([np.repeat([0, 1, 2], [190, 360, 110]), np.repeat([1, 0], [230, 430])])
    return {"q_segment_ids": q_ids, "kv_segment_ids": kv_ids}, None
  if kind == "softcap_alibi_dropout":
    return {"logits_soft_cap": 5.0, "alibi_slopes": jnp.linspace(0.01, 0.3, N, dtype=jnp.float32),
            "dropout_rate": 0.2, "dropout_key": dropout_key}, None
  if kind == "block_mask":
    blocks = jax.random.bernoulli(key, 0.6, (B, N) + jax_flash.block_mask_shape(T, S))
    return {"block_mask": blocks, "is_causal": True}, None
  if kind == "bias_rows":  # dbias by (batch, key): every query row and head sums into it
    return {}, jax.random.normal(key, (B, 1, 1, S), jnp.float32)
  if kind == "bias_full":
    return {}, jax.random.normal(key, (1, N, T, S), jnp.float32)
  raise ValueError(kind)


def _gradients(q, k, v, d_o, bias, options):
  def attend(q, k, v, bias):
    return jax_flash.dot_product_attention(q, k, v, bias, implementation="cpu", **options)
  _, vjp = jax.vjp(attend, q, k, v, bias)
  return [np.asarray(g) for g in vjp(d_o) if g is not None]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["plain", "causal_lengths", "window", "segments",
                                  "softcap_alibi_dropout", "block_mask", "bias_rows", "bias_full"])
def test_key_blocks_in_step_match_one_at_a_time(kind, dtype, monkeypatch):
  q, k, v, d_o, key, dropout_key = _inputs(jnp.dtype(dtype))
  options, bias = _options(kind, key, dropout_key)
  monkeypatch.setenv("JAX_FLASH_CPU_BWD_KEY_BLOCKS", "1")
  alone = _gradients(q, k, v, d_o, bias, options)
  assert any(np.any(g != 0) for g in alone)
  for in_step in ("3", "", "9"):  # a short last round, the default, a count past the most (ignored)
    monkeypatch.setenv("JAX_FLASH_CPU_BWD_KEY_BLOCKS", in_step)
    together = _gradients(q, k, v, d_o, bias, options)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), alone, together):
      np.testing.assert_array_equal(a, b, err_msg=f"{name}, {in_step or 'default'} key blocks in step")
