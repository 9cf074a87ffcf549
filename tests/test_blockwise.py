"""The "blockwise" path (FlashAttention in plain XLA: key blocks in a scan, recomputing
backward): block edges, transformations, linear memory, and the rule that picks it for float32
inputs on a GPU. Its results on the whole grid are checked in test_forward_backward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _blockwise, _dispatch, _registry
from attention_testing import Case, check_against_references, run_jax_flash

CASE = Case(batch=2, seq_q=70, seq_k=90, heads_q=4, heads_k=2, head_dim=40, is_causal=True,
            local_window_size=(40, 5), q_lens=(70, 33), kv_lens=(61, 90), return_residual=True)


@pytest.mark.parametrize("block", [1, 7, 32, 89, 90, 512])
def test_any_block_size(monkeypatch, block):
  """Block edges anywhere (one key per block, a padded last block, one block for all keys)."""
  monkeypatch.setattr(_blockwise, "KEY_BLOCK", block)
  check_against_references(CASE, run_jax_flash(CASE, "blockwise"))


def test_vmap_and_checkpoint(monkeypatch):
  monkeypatch.setattr(_blockwise, "KEY_BLOCK", 32)
  q, k, v, g = dataclasses.replace(CASE, q_lens=None, kv_lens=None).inputs()

  def loss(q, k, v):
    out = jax_flash.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise")
    return jnp.sum(out * g)

  want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  per_example = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, 0, 0))
  # vmap over a new leading axis of two copies: each copy's gradient is the unbatched one.
  stacked = [jnp.stack([x, x]) for x in (q, k, v)]
  got = per_example(*stacked)
  remat = jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(q, k, v)
  for name, w, b, r in zip(("dq", "dk", "dv"), want, got, remat):
    np.testing.assert_allclose(b[0], w, rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(r, w, rtol=1e-5, atol=1e-6, err_msg=name)


def temp_bytes(seq: int) -> int:
  x = jax.ShapeDtypeStruct((1, seq, 4, 64), jnp.float32)

  def loss(q, k, v):
    return jnp.sum(jax_flash.dot_product_attention(q, k, v, implementation="blockwise"))

  analysis = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().memory_analysis()
  if analysis is None:
    pytest.skip("compiled.memory_analysis() returns None on this jax/backend")
  return analysis.temp_size_in_bytes


def test_memory_is_linear(monkeypatch):
  monkeypatch.setattr(_blockwise, "KEY_BLOCK", 256)
  temps = {seq: temp_bytes(seq) for seq in (1024, 2048, 4096)}
  assert temps[2048] / temps[1024] <= 2.25, temps  # linear: 2, quadratic: 4
  assert temps[4096] / temps[1024] <= 4.5, temps


@pytest.mark.parametrize("dtype,want", [(jnp.float32, "blockwise"), (jnp.bfloat16, "cuda"),
                                        (jnp.float16, "cuda")])
def test_default_on_a_gpu(monkeypatch, dtype, want):
  """On a GPU with the CUDA kernels, None runs them for 16-bit inputs and the blockwise path for
  float32 (the kernels take 16-bit inputs); an explicit choice is kept."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(_registry, "has_platform", lambda platform: platform in ("cpu", "cuda"))
  monkeypatch.setattr(_registry, "cuda_gpu_present", lambda: True)
  call = _dispatch.Call((1, 8, 2, 16), jnp.dtype(dtype))
  assert _dispatch.select(None, call) == want
  assert _dispatch.select("xla", call) == "xla"


def test_ring_attention_refuses_xla_paths():
  q = jnp.zeros((1, 8, 2, 16), jnp.float32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
  spec = jax.sharding.PartitionSpec(None, "seq")
  for implementation in ("xla", "blockwise"):
    ring = jax.shard_map(lambda q: jax_flash.ring_attention(
        q, q, q, axis_name="seq", implementation=implementation), mesh=mesh, in_specs=spec,
        out_specs=spec)
    with pytest.raises(ValueError, match="needs a kernel"):
      ring(q)
