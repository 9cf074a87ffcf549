"""Ring attention (context parallelism) inside shard_map, on 8 simulated CPU devices: forward,
log-sum-exp and gradients equal the single-device results; K/V move only by collective-permute.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_flash
from attention_testing import SIMULATED_CUDA_CONSTANTS, random_qkv_and_cotangent

DEVICES = 4


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) < DEVICES:
    pytest.skip(f"needs {DEVICES} devices")
  return Mesh(np.array(jax.devices()[:DEVICES]), ("seq",))


def _inputs(seed, batch=2, seq=64, heads_q=4, heads_k=2, head_dim=16):
  return random_qkv_and_cotangent(np.random.default_rng(seed), batch, seq, heads_q, heads_k, head_dim)


def _ring_fn(mesh, layout, **options):
  spec = P(None, "seq", None, None)

  def local(q, k, v, q_lens, kv_lens):
    return jax_flash.ring_attention(q, k, v, axis_name="seq", layout=layout,
                                    query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
                                    implementation="cpu", return_residual=True, **options)

  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(), P()),
                       out_specs=(spec, P(None, "seq", None)))


def _vjp_outputs(attention, q, k, v, g, q_lens, kv_lens):
  (out, lse), vjp = jax.vjp(lambda q, k, v: attention(q, k, v, q_lens, kv_lens), q, k, v)
  return out, lse, *vjp((g, jnp.zeros_like(lse)))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", [False, True], ids=["", "lengths"])
def test_ring_matches_single_device(mesh, layout, is_causal, lengths):
  q, k, v, g = _inputs(int(is_causal) + 2 * int(lengths))
  seq = q.shape[1]
  q_lens = jnp.asarray([seq, 37] if lengths else [seq, seq], jnp.int32)
  kv_lens = jnp.asarray([seq, 21] if lengths else [seq, seq], jnp.int32)

  def single(q, k, v, q_lens, kv_lens):
    return jax_flash.dot_product_attention(q, k, v, is_causal=is_causal, query_seq_lengths=q_lens,
                                           key_value_seq_lengths=kv_lens, implementation="cpu",
                                           return_residual=True)

  want = [np.asarray(x) for x in jax.jit(_vjp_outputs, static_argnums=0)(
      single, q, k, v, g, q_lens, kv_lens)]

  order = jax_flash.zigzag_indices(seq, DEVICES) if layout == "zigzag" else np.arange(seq)
  inverse = np.argsort(order)
  ring = _ring_fn(mesh, layout, is_causal=is_causal)
  got = jax.jit(_vjp_outputs, static_argnums=0)(ring, q[:, order], k[:, order], v[:, order],
                                                g[:, order], q_lens, kv_lens)
  got = [np.asarray(x)[:, inverse] for x in got]
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def test_ring_communicates_only_by_collective_permute(mesh):
  q, k, v, g = _inputs(5)
  lens = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
  ring = _ring_fn(mesh, "zigzag", is_causal=True)
  hlo = jax.jit(_vjp_outputs, static_argnums=0).lower(ring, q, k, v, g, lens, lens).compile().as_text()
  found = set(re.findall(r"all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute", hlo))
  assert found == {"collective-permute"}, found


def test_zigzag_indices_balance_causal_work():
  order = jax_flash.zigzag_indices(16, 4).reshape(4, 4)  # 4 devices, 2 chunks of 2 each
  # A device's causal work is the sum of its positions (+1); zig-zag makes them equal.
  work = (order + 1).sum(axis=1)
  assert len(set(work.tolist())) == 1, work
  with pytest.raises(ValueError, match="multiple"):
    jax_flash.zigzag_indices(10, 4)


def test_ring_rejects_causal_with_unequal_lengths(mesh):
  q, k, v, _ = _inputs(6)
  spec = P(None, "seq", None, None)
  fn = jax.shard_map(lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="seq",
                                                              is_causal=True, implementation="cpu"),
                     mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
  with pytest.raises(ValueError, match="T == S"):
    fn(q, k[:, :32], v[:, :32])


def test_ring_gradients_on_a_mesh_with_other_axes():
  """Inputs that also vary over a data axis: the VJP's cotangents must carry the same types
  (shard_map's default check_vma=True)."""
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  mesh2d = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "seq"))
  spec = P("data", "seq", None, None)
  ring = jax.shard_map(lambda q, k, v: jax_flash.ring_attention(
      q, k, v, axis_name="seq", layout="zigzag", is_causal=True, implementation="cpu"),
      mesh=mesh2d, in_specs=(spec,) * 3, out_specs=spec)
  q, k, v, g = _inputs(7, batch=2, seq=32)
  order = jax_flash.zigzag_indices(32, 2)
  inverse = np.argsort(order)
  loss = lambda attention: lambda q, k, v: jnp.sum(attention(q, k, v) * g[:, order])
  got = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2)))(q[:, order], k[:, order], v[:, order])
  single = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True,
                                                           implementation="cpu")
  want = jax.grad(lambda q, k, v: jnp.sum(single(q, k, v) * g), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a)[:, inverse], np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [-0.4, 0.0], ids=["negative", "zero"])
def test_ring_with_non_positive_scale(mesh, scale):
  """The kernels take positive scales; ring_attention maps others onto them (q's sign flipped,
  or zeroed), checked against the plain XLA path, which takes any scale as it is."""
  q, k, v, g = _inputs(7)
  seq = q.shape[1]
  lens = jnp.asarray([seq, 29], jnp.int32)

  def single(q, k, v, q_lens, kv_lens):
    return jax_flash.dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                           query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
                                           implementation="xla", return_residual=True)

  want = jax.jit(_vjp_outputs, static_argnums=0)(single, q, k, v, g, lens, lens)
  got = jax.jit(_vjp_outputs, static_argnums=0)(
      _ring_fn(mesh, "contiguous", is_causal=True, scale=scale), q, k, v, g, lens, lens)
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    # Rows past the query length: jax_flash's lse there is EMPTY_ROW_LSE, the same in both.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("head_dim", [40, 111])
def test_ring_takes_the_head_dims_dot_product_attention_takes(mesh, head_dim):
  """Head dims that are no multiple of the kernels' tiles: the ring and the single-device call
  run the same checks and the same padding (jax_flash._ops.call_kernels)."""
  q, k, v, g = _inputs(8, seq=32, head_dim=head_dim)
  lens = jnp.full((q.shape[0],), q.shape[1], jnp.int32)

  def single(q, k, v, q_lens, kv_lens):
    return jax_flash.dot_product_attention(q, k, v, is_causal=True, implementation="cpu",
                                           return_residual=True)

  want = jax.jit(_vjp_outputs, static_argnums=0)(single, q, k, v, g, lens, lens)
  got = jax.jit(_vjp_outputs, static_argnums=0)(_ring_fn(mesh, "contiguous", is_causal=True),
                                                q, k, v, g, lens, lens)
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)


def test_ring_pads_the_head_dim_for_the_cuda_kernels(mesh, monkeypatch):
  """On the CUDA kernels (simulated: traced, never run) the ring pads a head dim of 111 to 112
  as dot_product_attention does, where it used to refuse it, and returns the caller's shape."""
  from jax_flash import _registry
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(_registry, "has_platform", lambda platform: platform in ("cpu", "cuda"))
  monkeypatch.setattr(_registry, "cuda_gpu_present", lambda: True)
  # The CUDA module's constants (as built with CUDA; stand-ins so the test runs without it).
  monkeypatch.setattr(_registry, "CUDA_KERNEL_CONSTANTS", dict(SIMULATED_CUDA_CONSTANTS))
  q, k, v, _ = _inputs(9, seq=32, head_dim=111)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  spec = P(None, "seq", None, None)
  ring = jax.shard_map(lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="seq"),
                       mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  jaxpr = str(jax.make_jaxpr(ring)(q, k, v))
  assert jax.make_jaxpr(ring)(q, k, v).out_avals[0].shape == q.shape
  # Each ring step's forward: the tiled kernel, or the decode kernel for these few query rows
  # per device (its default on CUDA), on the padded head dim.
  assert "jax_flash_cuda_fwd" in jaxpr or "jax_flash_cuda_decode" in jaxpr
  assert "bf16[2,8,4,112]" in jaxpr


def test_ring_second_derivatives_name_jax_flash(mesh):
  q, k, v, g = _inputs(10, seq=32)
  ring = _ring_fn(mesh, "contiguous", is_causal=True)
  lens = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
  f = lambda q: jnp.sum(ring(q, k, v, lens, lens)[0] * g)
  with pytest.raises(NotImplementedError, match="jax_flash.*second and higher derivatives"):
    jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2))(q)
