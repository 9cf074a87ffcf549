"""The split-KV program around the tiled forward (jax_flash._split_kv), run here on the CPU
kernel's tiled forward: pack-GQA and key chunks must give the tiled forward's own o and lse for
every chunk count, GQA/MQA, ragged and zero lengths, NaN inputs; and the rule."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_flash import _decode, _ops, _split_kv
from jax_flash._reference import EMPTY_ROW_LSE


def _tiled_forward(q, k, v, q_lens, kv_lens, *, o_float32=True):
  config = _ops.KernelConfig("cpu", 1.0 / np.sqrt(q.shape[-1]), False, -1, -1, o_float32=o_float32)
  return _ops._flash_fwd(q, k, v, q_lens, kv_lens, config)


def _inputs(batch, seq_q, seq_k, heads_q, heads_k, head_dim, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (batch, seq_q, heads_q, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (batch, seq_k, heads_k, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (batch, seq_k, heads_k, head_dim), jnp.float32).astype(dtype)
  return q, k, v


def _check(batch, seq_q, seq_k, heads_q, heads_k, head_dim, dtype, splits, q_lens, kv_lens,
           seed=0):
  q, k, v = _inputs(batch, seq_q, seq_k, heads_q, heads_k, head_dim, dtype, seed)
  q_lens = jnp.asarray(q_lens, jnp.int32)
  kv_lens = jnp.asarray(kv_lens, jnp.int32)
  want_o, want_lse = _tiled_forward(q, k, v, q_lens, kv_lens)
  got_o, got_lse = jax.jit(functools.partial(_split_kv.split_kv_forward, _tiled_forward),
                           static_argnums=5)(q, k, v, q_lens, kv_lens, splits)
  assert got_o.dtype == q.dtype and got_o.shape == q.shape
  assert got_lse.shape == want_lse.shape
  tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_o, np.float32), np.asarray(want_o, np.float32),
                             rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("heads_q, heads_k", [(8, 2), (4, 4), (6, 1)])
def test_matches_the_tiled_forward(splits, heads_q, heads_k):
  _check(3, 2, 300, heads_q, heads_k, 32, jnp.float32, splits, (2, 1, 0), (300, 17, 299))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_inputs(dtype):
  _check(2, 1, 1000, 8, 2, 64, dtype, 4, (1, 1), (1000, 513))


def test_rows_without_keys_are_empty_in_every_chunk():
  q, k, v = _inputs(2, 1, 256, 4, 2, 32, jnp.float32)
  o, lse = _split_kv.split_kv_forward(_tiled_forward, q, k, v, jnp.asarray([1, 1], jnp.int32),
                                      jnp.asarray([0, 100], jnp.int32), 4)
  assert np.all(np.asarray(o[0]) == 0) and np.all(np.asarray(lse[0]) == EMPTY_ROW_LSE)
  assert np.all(np.isfinite(np.asarray(o[1]))) and np.all(np.asarray(lse[1]) > EMPTY_ROW_LSE)


def test_nan_in_a_visible_key_reaches_its_rows_only():
  q, k, v = _inputs(2, 1, 256, 4, 2, 32, jnp.float32)
  k = k.at[1, 200, 0, 3].set(jnp.nan)  # batch 1, kv head 0, chunk 3 of 4
  o, lse = _split_kv.split_kv_forward(_tiled_forward, q, k, v, jnp.asarray([1, 1], jnp.int32),
                                      jnp.asarray([256, 256], jnp.int32), 4)
  o, lse = np.asarray(o), np.asarray(lse)
  assert np.all(np.isnan(o[1, :, :2])) and np.all(np.isnan(lse[1, :2]))  # query heads 0, 1
  assert np.all(np.isfinite(o[1, :, 2:])) and np.all(np.isfinite(o[0]))


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 3), seq_q=st.integers(1, 4), seq_k=st.integers(1, 700),
       group=st.sampled_from([1, 2, 4]), heads_k=st.integers(1, 2), splits=st.integers(1, 9),
       seed=st.integers(0, 100))
def test_random_shapes(batch, seq_q, seq_k, group, heads_k, splits, seed):
  rng = np.random.default_rng(seed)
  q_lens = rng.integers(0, seq_q + 1, batch)
  kv_lens = rng.integers(0, seq_k + 1, batch)
  _check(batch, seq_q, seq_k, heads_k * group, heads_k, 16, jnp.float32, splits, q_lens, kv_lens,
         seed)


def test_the_rule():
  assert _split_kv.applies(1, 32, 8, False, -1, -1)
  assert _split_kv.applies(4, 32, 8, False, -1, -1)
  assert not _split_kv.applies(1, 32, 8, True, -1, -1)  # causal: positions move
  assert not _split_kv.applies(1, 32, 8, False, 100, -1)  # window
  assert not _split_kv.applies(512, 32, 8, False, -1, -1)  # a prefill: rows fill tiles already
  assert _split_kv.num_splits(64, 8, 8192, 132) == 1  # 512 units already fill the GPU twice
  assert _split_kv.num_splits(1, 8, 8192, 132) == 16  # 8192 / 512 keys
  assert _split_kv.num_splits(16, 16, 16384, 132) == 2
  assert _split_kv.num_splits(0, 8, 100, 132) == 1


def test_cuda_calls_take_it_where_the_rule_says(monkeypatch):
  """The CUDA wiring, traced without a GPU: off unless asked for, then the rule's chunk count and
  the program's shapes (the program around the tiled forward, not the CUDA decode kernel that
  runs by default)."""
  monkeypatch.delenv("JAX_FLASH_CUDA_DECODE", raising=False)
  assert _ops.cuda_kv_splits(2, 1, 32, 8, 8192, False, -1, -1) == 0
  monkeypatch.setenv("JAX_FLASH_CUDA_DECODE", "split")
  monkeypatch.setattr(_decode, "_CUDA_DECODE_MODE", "split")  # as if read at import
  assert _ops.cuda_kv_splits(64, 1, 32, 8, 8192, False, -1, -1) == 1
  assert _ops.cuda_kv_splits(2, 1, 32, 8, 8192, False, -1, -1) >= 2
  assert _ops.cuda_kv_splits(2, 1, 32, 8, 8192, True, -1, -1) == 0
  assert _ops.cuda_kv_splits(2, 1024, 32, 8, 8192, False, -1, -1) == 0
  q, k, v = _inputs(2, 3, 1000, 8, 2, 64, jnp.bfloat16)
  lens = jnp.asarray([3, 1], jnp.int32), jnp.asarray([1000, 10], jnp.int32)
  config = _ops.KernelConfig("cuda", 0.125, False, -1, -1, kv_splits=4)
  o, lse = jax.eval_shape(lambda *a: _ops._flash_fwd(*a, config), q, k, v, *lens)
  assert (o.shape, o.dtype) == (q.shape, jnp.bfloat16)
  assert (lse.shape, lse.dtype) == ((2, 8, 3), jnp.float32)
  program = str(jax.make_jaxpr(lambda *a: _ops._flash_fwd(*a, config))(q, k, v, *lens))
  assert "jax_flash_cuda_fwd" in program and "jax_flash_cuda_decode" not in program
