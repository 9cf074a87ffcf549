"""Context-parallel strategies (ring, all-to-all over heads, all-gather of K/V) on 4 simulated CPU
devices: inside shard_map (context_parallel_attention) and under jax.jit with a sequence-sharded
input (dot_product_attention's context_parallel), each against the unsharded result (output,
log-sum-exp, dq, dk, dv), and the collectives each leaves in the compiled HLO.
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
from jax_flash import _context_parallel, _ops
from attention_testing import random_qkv_and_cotangent

DEVICES = 4
SPEC = P(None, "seq", None, None)
COLLECTIVES = re.compile(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter")
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) < DEVICES:
    pytest.skip(f"needs {DEVICES} devices")
  return Mesh(np.array(jax.devices()[:DEVICES]), ("seq",))


def _inputs(seed, batch=2, seq_q=32, seq_k=32, heads_q=4, heads_k=2, head_dim=16):
  rng = np.random.default_rng(seed)
  q, _, _, g = random_qkv_and_cotangent(rng, batch, seq_q, heads_q, heads_k, head_dim)
  _, k, v, _ = random_qkv_and_cotangent(rng, batch, seq_k, heads_q, heads_k, head_dim)
  return q, k, v, g


def _vjp_outputs(attention, q, k, v, g):
  (out, lse), vjp = jax.vjp(attention, q, k, v)
  return out, lse, *vjp((g, jnp.zeros_like(lse)))


def _single(q, k, v, g, **options):
  attention = lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, implementation="cpu", return_residual=True, **options)
  return [np.asarray(x) for x in jax.jit(_vjp_outputs, static_argnums=0)(attention, q, k, v, g)]


def _shard_map_results(mesh, local, layout, q, k, v, g):
  """out, lse, dq, dk, dv of `local` (q, k, v slices -> (out, lse)) under shard_map over the
  sequence, the inputs held in `layout` (T = 32), returned in the sequence's order."""
  sharded = jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 3,
                          out_specs=(SPEC, P(None, "seq", None)))
  order = jax_flash.zigzag_indices(32, DEVICES) if layout == "zigzag" else np.arange(32)
  got = jax.jit(_vjp_outputs, static_argnums=0)(sharded, q[:, order], k[:, order], v[:, order],
                                                g[:, order])
  return [np.asarray(x)[:, np.argsort(order)] for x in got]


def _assert_close(got, want):
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(a), b, err_msg=name, **TOLERANCE)


CASES = [
    ("ring", dict()),
    ("ring", dict(is_causal=True)),
    ("all_to_all", dict()),
    ("all_to_all", dict(is_causal=True)),
    ("all_to_all", dict(local_window_size=(5, 2))),
    ("all_gather", dict()),
    ("all_gather", dict(is_causal=True)),
    ("all_gather", dict(is_causal=True, local_window_size=(6, 0))),
]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("strategy,options", CASES,
                         ids=[f"{s}-{'-'.join(o) or 'full'}" for s, o in CASES])
def test_shard_map_strategies_match_single_device(mesh, strategy, options, layout):
  """GQA (4 query heads, 2 kv heads: all_to_all repeats them over 4 devices), T == S, padded
  rows (query and key lengths)."""
  q, k, v, g = _inputs(len(options) + 3 * len(strategy))
  lens = dict(query_seq_lengths=jnp.asarray([32, 27], jnp.int32),
              key_value_seq_lengths=jnp.asarray([32, 19], jnp.int32))
  want = _single(q, k, v, g, **options, **lens)

  local = lambda q, k, v: jax_flash.context_parallel_attention(
      q, k, v, axis_name="seq", strategy=strategy, layout=layout, implementation="cpu",
      return_residual=True, **options, **lens)
  _assert_close(_shard_map_results(mesh, local, layout, q, k, v, g), want)


@pytest.mark.parametrize("strategy,layout", [
    ("ring", "contiguous"), ("ring", "zigzag"), ("all_to_all", "zigzag"),
    ("all_gather", "contiguous"), ("ring_attention", "zigzag")])
def test_shard_map_soft_cap_and_alibi(mesh, strategy, layout):
  """logits_soft_cap and alibi_slopes (global positions: each block's kernel gets its slices'
  offset) inside shard_map, causal, with lengths, through every strategy and ring_attention,
  against the single device; and they matter (without them the result differs)."""
  q, k, v, g = _inputs(11 + len(strategy) + len(layout))
  options = dict(is_causal=True, logits_soft_cap=2.5,
                 alibi_slopes=jnp.asarray([0.5, -0.25, 0.125, 1.0], jnp.float32),
                 query_seq_lengths=jnp.asarray([32, 29], jnp.int32),
                 key_value_seq_lengths=jnp.asarray([32, 21], jnp.int32))
  want = _single(q, k, v, g, **options)
  plain = _single(q, k, v, g, is_causal=True)
  assert not np.allclose(want[0], plain[0], atol=1e-3)

  def local(q, k, v):
    common = dict(axis_name="seq", layout=layout, implementation="cpu", return_residual=True)
    if strategy == "ring_attention":
      return jax_flash.ring_attention(q, k, v, **common, **options)
    return jax_flash.context_parallel_attention(q, k, v, strategy=strategy, **common, **options)

  _assert_close(_shard_map_results(mesh, local, layout, q, k, v, g), want)


@pytest.mark.parametrize("strategy", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_shard_map_query_and_key_lengths_differ(mesh, strategy, is_causal):
  """T != S (causal top-left aligned, as jax.nn), MQA: one kv head."""
  q, k, v, g = _inputs(11 + is_causal, seq_q=16, seq_k=48, heads_k=1)
  want = _single(q, k, v, g, is_causal=is_causal)
  local = lambda q, k, v: jax_flash.context_parallel_attention(
      q, k, v, axis_name="seq", strategy=strategy, is_causal=is_causal, implementation="cpu",
      return_residual=True)
  sharded = jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 3,
                          out_specs=(SPEC, P(None, "seq", None)))
  _assert_close(jax.jit(_vjp_outputs, static_argnums=0)(sharded, q, k, v, g), want)


def _jit_run(mesh, q, k, v, g, **options):
  """Forward and VJP under jit with the sequence sharded; the results and the HLO's collectives
  of the forward alone and of forward + backward."""
  sharding = NamedSharding(mesh, SPEC)
  placed = [jax.device_put(x, sharding) for x in (q, k, v, g)]
  attention = lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, implementation="cpu", return_residual=True, **options)
  both = jax.jit(lambda q, k, v, g: _vjp_outputs(attention, q, k, v, g))
  forward = jax.jit(attention)
  found = [set(COLLECTIVES.findall(f.lower(*args).compile().as_text()))
           for f, args in ((forward, placed[:3]), (both, placed))]
  return [np.asarray(x) for x in both(*placed)], found


JIT_CASES = [
    # context_parallel, options, collectives of the forward, of forward + backward
    ("ring", dict(), {"collective-permute"}, {"collective-permute"}),
    ("ring", dict(is_causal=True), {"collective-permute"}, {"collective-permute"}),
    ("ring:contiguous", dict(is_causal=True), {"collective-permute"}, {"collective-permute"}),
    ("all_to_all", dict(), {"all-to-all"}, {"all-to-all"}),
    ("all_to_all", dict(is_causal=True), {"all-to-all"}, {"all-to-all"}),
    ("all_to_all", dict(local_window_size=3), {"all-to-all"}, {"all-to-all"}),
    ("all_gather:contiguous", dict(), {"all-gather"}, {"all-gather", "reduce-scatter"}),
    ("all_gather:contiguous", dict(is_causal=True), {"all-gather"},
     {"all-gather", "reduce-scatter"}),
    ("all_gather:contiguous", dict(local_window_size=(4, 1)), {"all-gather"},
     {"all-gather", "reduce-scatter"}),
    # zig-zag queries: the slices move by collective-permute, K/V are gathered as they lie.
    ("all_gather", dict(is_causal=True), {"all-gather", "collective-permute"},
     {"all-gather", "reduce-scatter", "collective-permute"}),
    (None, dict(is_causal=True), {"collective-permute"}, {"collective-permute"}),
    (None, dict(local_window_size=(3, 0)), {"all-to-all"}, {"all-to-all"}),
]


@pytest.mark.parametrize("context_parallel,options,forward,both", JIT_CASES,
                         ids=[f"{c}-{'-'.join(o) or 'full'}" for c, o, _, _ in JIT_CASES])
def test_jit_strategies_match_single_device_and_communicate_as_stated(
    mesh, context_parallel, options, forward, both):
  q, k, v, g = _inputs(20 + len(options), heads_q=8, heads_k=4)
  got, found = _jit_run(mesh, q, k, v, g, context_parallel=context_parallel, **options)
  _assert_close(got, _single(q, k, v, g, **options))
  assert found == [forward, both], found


def test_jit_all_to_all_repeats_kv_heads_that_do_not_split(mesh):
  """8 query heads, 2 kv heads over 4 devices: each kv head twice; dK/dV summed back."""
  q, k, v, g = _inputs(30, heads_q=8, heads_k=2)
  got, found = _jit_run(mesh, q, k, v, g, context_parallel="all_to_all", is_causal=True)
  _assert_close(got, _single(q, k, v, g, is_causal=True))
  assert found == [{"all-to-all"}, {"all-to-all"}], found


def test_jit_causal_with_unequal_lengths_runs_a_strategy(mesh):
  """Causal T != S: the ring cannot, all_to_all (automatic here) can."""
  q, k, v, g = _inputs(31, seq_q=16, seq_k=32)
  got, found = _jit_run(mesh, q, k, v, g, is_causal=True)
  _assert_close(got, _single(q, k, v, g, is_causal=True))
  assert found == [{"all-to-all"}, {"all-to-all"}], found


def _config(**options):
  return _ops.KernelConfig("cpu", 0.25, options.get("is_causal", False),
                           options.get("window_left", -1), options.get("window_right", -1))


def test_automatic_choice():
  """The documented rule: the ring where it runs (zig-zag when causal), else all_to_all where
  the heads split, else all_gather; None where the sequence does not split."""
  choose = lambda heads_q=8, seq_q=64, seq_k=64, **options: _context_parallel.choose(
      None, num=4, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, config=_config(**options))
  Strategy = _context_parallel.Strategy
  assert choose() == Strategy("ring")
  assert choose(is_causal=True) == Strategy("ring", "zigzag", relayout=True)
  assert choose(is_causal=True, seq_q=68, seq_k=68) == Strategy("ring")  # no 8 chunks
  assert choose(window_left=3) == Strategy("all_to_all")
  assert choose(is_causal=True, seq_q=32) == Strategy("all_to_all")
  assert choose(heads_q=6, window_left=3) == Strategy("all_gather")
  assert choose(heads_q=6, is_causal=True, seq_q=32) == Strategy("all_gather", "zigzag", True)
  assert choose(seq_q=30) is None


def test_requests_that_cannot_run_raise(mesh):
  q, k, v, _ = _inputs(32, heads_q=6, heads_k=2)
  sharding = NamedSharding(mesh, SPEC)
  placed = [jax.device_put(x, sharding) for x in (q, k, v)]
  run = lambda cp, **o: jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, implementation="cpu", context_parallel=cp, **o)).lower(*placed).compile()
  # Raised in the partitioner, while XLA compiles: JAX hands the ValueError on as a
  # JaxRuntimeError carrying its message.
  compile_error = (ValueError, jax.errors.JaxRuntimeError)
  with pytest.raises(compile_error, match=r"query heads on each device \(6\) to split"):
    run("all_to_all")
  with pytest.raises(compile_error, match="ring takes no local window"):
    run("ring", local_window_size=2)
  with pytest.raises(ValueError, match="context_parallel must be None"):
    run("ulysses")
  with pytest.raises(ValueError, match="plain XLA"):
    jax_flash.dot_product_attention(q, k, v, implementation="xla", context_parallel="ring")
  local = lambda q, k, v: jax_flash.context_parallel_attention(
      q, k, v, axis_name="seq", strategy="all_to_all", implementation="cpu")
  with pytest.raises(ValueError, match=r"strategy='all_to_all' cannot run query\(2, 8, 6, 16\)"):
    jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC)(q, k, v)


def test_zigzag_relayout_round_trips(mesh):
  """contiguous_to_zigzag gives device r chunks r and 2P-1-r; zigzag_to_contiguous undoes it."""
  from jax_flash._chunks import contiguous_to_zigzag, zigzag_to_contiguous
  x = jnp.arange(2 * 32 * 3, dtype=jnp.float32).reshape(2, 32, 3)
  spec = P(None, "seq", None)
  there = jax.shard_map(lambda x: contiguous_to_zigzag((x,), "seq", (1,))[0], mesh=mesh,
                        in_specs=spec, out_specs=spec)(x)
  np.testing.assert_array_equal(np.asarray(there), np.asarray(x)[:, jax_flash.zigzag_indices(32, 4)])
  back = jax.shard_map(lambda x: zigzag_to_contiguous((x,), "seq", (1,))[0], mesh=mesh,
                       in_specs=spec, out_specs=spec)(there)
  np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


@pytest.mark.parametrize("context_parallel", ["all_to_all", "all_gather"])
def test_jit_strategies_under_gspmd(mesh, context_parallel):
  """The GSPMD partitioner (no Shardy) runs the same partition callbacks."""
  previous = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", False)
  try:
    q, k, v, g = _inputs(40, heads_q=8, heads_k=4)
    got, _ = _jit_run(mesh, q, k, v, g, context_parallel=context_parallel, is_causal=True)
  finally:
    jax.config.update("jax_use_shardy_partitioner", previous)
  _assert_close(got, _single(q, k, v, g, is_causal=True))


@pytest.mark.parametrize("strategy", ["all_to_all", "all_gather"])
def test_shard_map_gradients_on_a_mesh_with_other_axes(strategy):
  """Inputs that also vary over a data axis: the VJP's cotangents must carry the same types
  (shard_map's default check_vma=True)."""
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  mesh2d = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "seq"))
  spec = P("data", "seq", None, None)
  sharded = jax.shard_map(lambda q, k, v: jax_flash.context_parallel_attention(
      q, k, v, axis_name="seq", strategy=strategy, is_causal=True, implementation="cpu"),
      mesh=mesh2d, in_specs=(spec,) * 3, out_specs=spec)
  q, k, v, g = _inputs(41)
  loss = lambda attention: lambda q, k, v: jnp.sum(attention(q, k, v) * g)
  got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
  single = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True,
                                                           implementation="cpu")
  want = jax.grad(loss(single), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCE)
