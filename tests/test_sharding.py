"""The kernels partition like native ops under jax.jit with shardings (8 simulated CPU devices).

Batch and head sharding must need no communication at all, and give the single-device results
(forward and gradients), with both partitioners (Shardy and GSPMD). Sequence sharding runs ring
attention: K/V blocks move by collective-permute only. Layouts the op cannot run sharded (GQA
kv heads that do not split over the head axis, a sharded head dim, windows over a sharded
sequence) must stay correct (the op then runs on gathered inputs).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import _ops, _rounding, _sharding
from attention_testing import random_qkv_and_cotangent

COLLECTIVES = re.compile(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter")


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (conftest sets --xla_force_host_platform_device_count=8)")
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
  previous = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
  yield request.param
  jax.config.update("jax_use_shardy_partitioner", previous)


def _inputs(seed, batch=4, seq=48, heads_q=8, heads_k=4, head_dim=16):
  rng = np.random.default_rng(seed)
  q, k, v, g = random_qkv_and_cotangent(rng, batch, seq, heads_q, heads_k, head_dim)
  lens = jnp.asarray(rng.integers(1, seq + 1, size=batch), jnp.int32)
  return q, k, v, g, lens


def _attention(q, k, v, lens):
  return jax_flash.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lens,
                                         implementation="cpu")


def _forward_and_vjp(q, k, v, g, lens):
  out, vjp = jax.vjp(lambda q, k, v: _attention(q, k, v, lens), q, k, v)
  return out, vjp(g)  # the cotangent is given: no reduction, so no collective of its own


def _run(mesh, spec_q, spec_kv, args):
  q, k, v, g, lens = args
  rows_q, rows_kv = NamedSharding(mesh, spec_q), NamedSharding(mesh, spec_kv)
  batch = NamedSharding(mesh, P(spec_q[0]))
  shardings = (rows_q, rows_kv, rows_kv, rows_q, batch)
  placed = [jax.device_put(x, s) for x, s in zip(args, shardings)]
  fn = jax.jit(_forward_and_vjp, in_shardings=shardings)
  hlo = fn.lower(*placed).compile().as_text()
  return jax.tree.map(np.asarray, fn(*placed)), hlo


def _assert_matches_single_device(got, args):
  want = jax.tree.map(np.asarray, jax.jit(_forward_and_vjp)(*args))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("spec", [
    P("data", None, None, None),                 # batch
    P(None, None, "model", None),                # heads (4 kv heads over 4 devices)
    P("data", None, "model", None),              # batch and heads
    P(("data", "model"), None, None, None),      # batch over the whole mesh
], ids=["batch", "heads", "batch+heads", "batch-2d"])
def test_batch_and_head_sharding_needs_no_communication(mesh, partitioner, spec):
  args = _inputs(0, batch=8)
  got, hlo = _run(mesh, spec, spec, args)
  assert not COLLECTIVES.search(hlo), COLLECTIVES.findall(hlo)
  _assert_matches_single_device(got, args)
  assert got[0].shape == args[0].shape


def test_output_keeps_the_input_sharding(mesh, partitioner):
  q, k, v, g, lens = _inputs(1)
  spec = P("data", None, "model", None)
  placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
  out = jax.jit(_attention)(*placed, jax.device_put(lens, NamedSharding(mesh, P("data"))))
  assert out.sharding.spec[0] == "data" and out.sharding.spec[2] == "model", out.sharding


def test_kv_heads_that_do_not_split_stay_correct(mesh, partitioner):
  """8 query heads over a 4-way axis, but only 2 kv heads: heads are kept whole."""
  args = _inputs(2, heads_k=2)
  got, _ = _run(mesh, P("data", None, "model", None), P("data", None, None, None), args)
  _assert_matches_single_device(got, args)


@pytest.mark.parametrize("heads", [8, 1], ids=["mha", "mqa"])
def test_equal_heads_and_mqa_shard_query_heads(mesh, partitioner, heads):
  """Query heads over the head axis; the kv heads with them (MHA: no communication) or
  replicated (MQA: the backward's only collective sums dK/dV over the head axis)."""
  args = _inputs(5, heads_k=heads)
  kv_spec = P("data", None, "model" if heads == 8 else None, None)
  got, hlo = _run(mesh, P("data", None, "model", None), kv_spec, args)
  found = set(COLLECTIVES.findall(hlo))
  assert found == (set() if heads == 8 else {"all-reduce"}), found
  _assert_matches_single_device(got, args)


@pytest.mark.parametrize("spec", [
    P(None, "model", None, None),                # sequence
    P("data", "model", None, None),              # batch and sequence
    P(None, ("data", "model"), None, None),      # sequence over the whole mesh
], ids=["sequence", "batch+sequence", "sequence-2d"])
def test_sequence_sharding_runs_the_ring(mesh, partitioner, spec):
  args = _inputs(3, seq=64)
  got, hlo = _run(mesh, spec, spec, args)
  assert set(COLLECTIVES.findall(hlo)) == {"collective-permute"}, set(COLLECTIVES.findall(hlo))
  _assert_matches_single_device(got, args)


def test_sequence_and_heads_sharded_together(mesh, partitioner):
  args = _inputs(6, seq=64)
  spec = P(None, "data", "model", None)
  got, hlo = _run(mesh, spec, spec, args)
  assert set(COLLECTIVES.findall(hlo)) == {"collective-permute"}, set(COLLECTIVES.findall(hlo))
  _assert_matches_single_device(got, args)


def test_window_over_a_sharded_sequence_stays_correct(mesh, partitioner):
  """Windows are not chunk-aligned: the sequence is gathered instead of running the ring."""
  q, k, v, g, lens = _inputs(7, seq=64)
  spec = NamedSharding(mesh, P(None, "model", None, None))

  def windowed(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, local_window_size=(5, 0), implementation="cpu")

  placed = [jax.device_put(x, spec) for x in (q, k, v)]
  got = np.asarray(jax.jit(windowed)(*placed))
  np.testing.assert_allclose(got, np.asarray(windowed(q, k, v)), rtol=2e-6, atol=2e-6)


def test_sharded_head_dim_stays_correct(mesh, partitioner):
  args = _inputs(3)
  spec = P(None, None, None, "model")
  got, _ = _run(mesh, spec, spec, args)
  _assert_matches_single_device(got, args)


def test_vmap_under_sharding(mesh):
  q, k, v, g, lens = _inputs(4, batch=8)
  spec = NamedSharding(mesh, P(None, "data", None, "model", None))
  qs, ks, vs = (jax.device_put(x.reshape(2, 4, *x.shape[1:]), spec) for x in (q, k, v))
  fn = jax.jit(jax.vmap(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, is_causal=True, implementation="cpu")))
  got = np.asarray(fn(qs, ks, vs)).reshape(q.shape)
  want = np.asarray(jax_flash.dot_product_attention(q, k, v, is_causal=True, implementation="cpu"))
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("spec", [P("data", None, "model", None), P("data", "model", None, None)],
                         ids=["batch_heads", "sequence"])
def test_backward_with_the_rounding_error_of_o(mesh, partitioner, spec):
  """The backward's o_error operand (CUDA's residual: jax_flash._rounding) partitions like o,
  on batch/head sharding and through a context-parallel strategy over a sharded sequence: the
  gradients equal those from o joined back into float32 (what the CPU kernel is given)."""
  q, k, v, g, lens = _inputs(3)
  q, k, v, g = (x.astype(jnp.bfloat16) for x in (q, k, v, g))
  config = _ops.KernelConfig("cpu", 0.25, True, -1, -1)
  o32, lse = _sharding.flash_fwd(q, k, v, lens, lens, _ops.for_backward(config))
  o, o_error = _rounding.split_rounding(o32, jnp.bfloat16)
  rows, batch = NamedSharding(mesh, spec), NamedSharding(mesh, P("data"))
  lse_spec = NamedSharding(mesh, P(spec[0], spec[2], spec[1]))
  args = (q, k, v, o, o_error, lse, g, lens)
  shardings = (rows, rows, rows, rows, rows, lse_spec, rows, batch)
  placed = [jax.device_put(x, s) for x, s in zip(args, shardings)]
  with_error = jax.jit(lambda q, k, v, o, e, lse, g, lens: _sharding.flash_bwd(
      q, k, v, o, lse, g, lens, lens, config, None, e), in_shardings=shardings)
  joined = jax.jit(lambda q, k, v, o, e, lse, g, lens: _sharding.flash_bwd(
      q, k, v, _rounding.join_rounding(o, e), lse, g, lens, lens, config))
  for got, want in zip(with_error(*placed), joined(*args)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)
