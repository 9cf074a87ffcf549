"""The CPU forward's paired query blocks (cuda/cpu/flash_fwd.h): where a call has at least 16
tasks of two 64-row query blocks, a task runs two neighbouring blocks against each key block.
Each block's arithmetic is the same as when it runs alone, so a paired call must give bit for bit
what each (batch, head) gives as a call of its own (one head, one batch element: too few tasks to
pair), with every mask and score policy that the slicing keeps (dropout's counters are the
call's (batch, head): the dropout tests cover it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernel")

B, T, S, N, K, H = 2, 320, 300, 8, 2, 64  # 5 query blocks: two pairs and a block alone


def _inputs(dtype):
  keys = jax.random.split(jax.random.PRNGKey(45), 4)
  q = jax.random.normal(keys[0], (B, T, N, H), dtype)
  k = jax.random.normal(keys[1], (B, S, K, H), dtype)
  v = jax.random.normal(keys[2], (B, S, K, H), dtype)
  return q, k, v, keys[3]


def _options(kind, key):
  """The call's keyword arguments and, for (b, h), those of its slice alone."""
  if kind == "causal_lengths":
    q_lens, kv_lens = jnp.array([320, 250]), jnp.array([300, 190])
    return ({"is_causal": True, "query_seq_lengths": q_lens, "key_value_seq_lengths": kv_lens},
            lambda b, h: {"is_causal": True, "query_seq_lengths": q_lens[b:b + 1],
                          "key_value_seq_lengths": kv_lens[b:b + 1]})
  if kind == "window":  # the two blocks of a pair start at different keys
    return ({"local_window_size": (70, 20)}, lambda b, h: {"local_window_size": (70, 20)})
  if kind == "segments":
    q_ids = jnp.array([np.repeat([0, 1, 2], [100, 150, 70]), np.repeat([0, 1], [200, 120])])
    kv_ids = jnp.array([np.repeat([0, 1, 2], [90, 160, 50]), np.repeat([1, 0], [130, 170])])
    return ({"q_segment_ids": q_ids, "kv_segment_ids": kv_ids},
            lambda b, h: {"q_segment_ids": q_ids[b:b + 1], "kv_segment_ids": kv_ids[b:b + 1]})
  if kind == "bias_softcap_alibi":
    bias = jax.random.normal(key, (B, N, T, S), jnp.float32)
    slopes = jnp.linspace(0.01, 0.3, N, dtype=jnp.float32)
    return ({"bias": bias, "logits_soft_cap": 5.0, "alibi_slopes": slopes},
            lambda b, h: {"bias": bias[b:b + 1, h:h + 1], "logits_soft_cap": 5.0,
                          "alibi_slopes": slopes[h:h + 1]})
  if kind == "block_mask":
    blocks = jax.random.bernoulli(key, 0.6, (B, N) + jax_flash.block_mask_shape(T, S))
    return {"block_mask": blocks}, lambda b, h: {"block_mask": blocks[b:b + 1, h:h + 1]}
  raise ValueError(kind)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["causal_lengths", "window", "segments", "bias_softcap_alibi",
                                  "block_mask"])
def test_paired_forward_matches_each_head_alone(kind, dtype):
  q, k, v, key = _inputs(jnp.dtype(dtype))
  whole, alone = _options(kind, key)
  attend = lambda q, k, v, **kw: jax_flash.dot_product_attention(
      q, k, v, implementation="cpu", return_residual=True, **kw)
  out, lse = attend(q, k, v, **whole)
  for b in range(B):
    for h in range(N):
      hk = h // (N // K)
      o1, lse1 = attend(q[b:b + 1, :, h:h + 1], k[b:b + 1, :, hk:hk + 1], v[b:b + 1, :, hk:hk + 1],
                        **alone(b, h))
      np.testing.assert_array_equal(np.asarray(out[b:b + 1, :, h:h + 1]), np.asarray(o1),
                                    err_msg=f"output b={b} h={h}")
      np.testing.assert_array_equal(np.asarray(lse[b:b + 1, :, h:h + 1]), np.asarray(lse1),
                                    err_msg=f"lse b={b} h={h}")
