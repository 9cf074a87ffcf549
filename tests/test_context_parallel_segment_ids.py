"""Context parallelism with segment ids (issue 16 item 4, issue 18 item 2) on 4 simulated CPU
devices: every strategy (ring contiguous and zig-zag, all-to-all over heads, all-gather of K/V)
inside shard_map and under jax.jit with a sequence-sharded input, against the single-device
kernel (output, log-sum-exp, dq, dk, dv) and against the float32 reference with the segment
mask by the 2x rule (tests/test_segment_ids.check: rows whose document has no visible key
exactly 0 / EMPTY_ROW_LSE, keys no row sees exactly 0 gradient); and the collectives each
leaves in the compiled HLO (the ring: collective-permute only; all-to-all: all-to-all only).

The cases' documents span the shard boundaries (sorted ids: random cuts; unsorted: an id per
position), and the query side has an id no key has, so some rows see no key in any ring step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from test_context_parallel import COLLECTIVES, DEVICES, SPEC, TOLERANCE, mesh  # noqa: F401 (fixture)
from test_segment_ids import Case, check

IDS_SPEC = P(None, "seq")


def _case(**options) -> Case:
  return Case(**{**dict(batch=2, seq_q=32, seq_k=32, heads_q=4, heads_k=2, head_dim=8),
                 **options})


def _results(fn, q, k, v, g, q_ids, kv_ids):
  """fn(q, k, v, q_ids, kv_ids) -> (out, lse): out, lse and the gradients of sum(out * g),
  compiled, as float64 numpy (ids are not differentiated)."""

  @jax.jit
  def run(q, k, v, g, q_ids, kv_ids):
    def loss(q, k, v):
      out, lse = fn(q, k, v, q_ids, kv_ids)
      return jnp.sum(out.astype(jnp.float32) * g), (out, lse)

    (_, (out, lse)), (dq, dk, dv) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

  return {n: np.asarray(x, np.float64) for n, x in run(q, k, v, g, q_ids, kv_ids).items()}


def _single(case: Case) -> dict:
  q, k, v, g = case.inputs()
  q_ids, kv_ids = (jnp.asarray(x) for x in case.ids())
  return _results(lambda q, k, v, qi, ki: jax_flash.dot_product_attention(
      q, k, v, q_segment_ids=qi, kv_segment_ids=ki, is_causal=case.is_causal,
      implementation="cpu", return_residual=True), q, k, v, g, q_ids, kv_ids)


def _assert_matches_single_and_reference(case: Case, got: dict) -> None:
  want = _single(case)
  for name in got:
    np.testing.assert_allclose(got[name], want[name], err_msg=name, **TOLERANCE)
  check(case, got)


def _spans_a_boundary(case: Case) -> bool:
  """Whether some query document crosses a device's slice boundary."""
  q_ids, _ = case.ids()
  cuts = np.arange(1, DEVICES) * (case.seq_q // DEVICES)
  return bool(np.any(q_ids[:, cuts - 1] == q_ids[:, cuts]))


SHARD_MAP_CASES = [
    # strategy, layout, case options
    ("ring", "contiguous", dict()),
    ("ring", "contiguous", dict(is_causal=True)),
    ("ring", "zigzag", dict(is_causal=True, sorted_ids=False, seed=3)),
    ("all_to_all", "contiguous", dict(is_causal=True)),
    ("all_to_all", "zigzag", dict(sorted_ids=False, seed=4)),
    ("all_gather", "contiguous", dict()),
    ("all_gather", "zigzag", dict(is_causal=True)),
    ("all_gather", "contiguous", dict(is_causal=True, sorted_ids=False, seed=5)),
]


@pytest.mark.parametrize(
    "strategy,layout,options", SHARD_MAP_CASES,
    ids=[f"{s}-{l}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'full'}"
         for s, l, o in SHARD_MAP_CASES])
def test_shard_map_strategies_with_segment_ids(mesh, strategy, layout, options):
  case = _case(**options)
  assert _spans_a_boundary(case)
  q, k, v, g = case.inputs()
  q_ids, kv_ids = (jnp.asarray(x) for x in case.ids())

  def local(q, k, v, qi, ki):
    return jax_flash.context_parallel_attention(
        q, k, v, axis_name="seq", strategy=strategy, layout=layout, is_causal=case.is_causal,
        q_segment_ids=qi, kv_segment_ids=ki, implementation="cpu", return_residual=True)

  sharded = jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 3 + (IDS_SPEC,) * 2,
                          out_specs=(SPEC, P(None, "seq", None)))
  order = jax_flash.zigzag_indices(32, DEVICES) if layout == "zigzag" else np.arange(32)
  got = _results(sharded, *(x[:, order] for x in (q, k, v, g, q_ids, kv_ids)))
  _assert_matches_single_and_reference(
      case, {n: x[:, np.argsort(order)] for n, x in got.items()})


def test_ring_attention_takes_segment_ids(mesh):
  """jax_flash.ring_attention (the ring alone) with ids, zig-zag layout, causal, sorted ids."""
  case = _case(is_causal=True, seed=6)
  q, k, v, g = case.inputs()
  q_ids, kv_ids = (jnp.asarray(x) for x in case.ids())
  local = lambda q, k, v, qi, ki: jax_flash.ring_attention(
      q, k, v, axis_name="seq", layout="zigzag", is_causal=True, q_segment_ids=qi,
      kv_segment_ids=ki, implementation="cpu", return_residual=True)
  sharded = jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 3 + (IDS_SPEC,) * 2,
                          out_specs=(SPEC, P(None, "seq", None)))
  order = jax_flash.zigzag_indices(32, DEVICES)
  got = _results(sharded, *(x[:, order] for x in (q, k, v, g, q_ids, kv_ids)))
  _assert_matches_single_and_reference(
      case, {n: x[:, np.argsort(order)] for n, x in got.items()})


JIT_CASES = [
    # context_parallel, case options, collectives of the forward, of forward + backward
    ("ring:contiguous", dict(), {"collective-permute"}, {"collective-permute"}),
    ("all_to_all", dict(is_causal=True, sorted_ids=False, seed=7), {"all-to-all"},
     {"all-to-all"}),
    ("all_gather", dict(is_causal=True), {"all-gather", "collective-permute"},
     {"all-gather", "reduce-scatter", "collective-permute"}),
    ("all_gather:contiguous", dict(), {"all-gather"}, {"all-gather", "reduce-scatter"}),
    # automatic: the ring, zig-zag (q, k, v and the ids moved there and back by permutes)
    (None, dict(is_causal=True, q_lens=(32, 21), kv_lens=(27, 32)), {"collective-permute"},
     {"collective-permute"}),
]


@pytest.mark.parametrize("context_parallel,options,forward,both", JIT_CASES,
                         ids=[f"{c}-{'-'.join(o) or 'full'}" for c, o, _, _ in JIT_CASES])
def test_jit_sequence_sharded_with_segment_ids(mesh, context_parallel, options, forward, both):
  """dot_product_attention under jit, q, k, v and the ids sharded along the sequence."""
  case = _case(heads_q=8, heads_k=4, **options)
  q, k, v, g = case.inputs()
  q_ids, kv_ids = (jnp.asarray(x) for x in case.ids())
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  args = (*(put(x, SPEC) for x in (q, k, v, g)), put(q_ids, IDS_SPEC), put(kv_ids, IDS_SPEC))
  lens = {n: v for n, v in case.options().items() if n.endswith("lengths")}

  def attention(q, k, v, qi, ki):
    return jax_flash.dot_product_attention(
        q, k, v, q_segment_ids=qi, kv_segment_ids=ki, is_causal=case.is_causal,
        implementation="cpu", return_residual=True, context_parallel=context_parallel, **lens)

  got = _results(attention, *args)
  want = _results(lambda q, k, v, qi, ki: jax_flash.dot_product_attention(
      q, k, v, q_segment_ids=qi, kv_segment_ids=ki, is_causal=case.is_causal,
      implementation="cpu", return_residual=True, **lens), q, k, v, g, q_ids, kv_ids)
  for name in got:
    np.testing.assert_allclose(got[name], want[name], err_msg=name, **TOLERANCE)
  check(case, got)

  def both_passes(q, k, v, g, qi, ki):
    (out, lse), vjp = jax.vjp(lambda q, k, v: attention(q, k, v, qi, ki), q, k, v)
    return out, lse, *vjp((g, jnp.zeros_like(lse)))

  found = [set(COLLECTIVES.findall(jax.jit(f).lower(*a).compile().as_text()))
           for f, a in ((attention, args[:3] + args[4:]), (both_passes, args))]
  assert found == [forward, both], found
