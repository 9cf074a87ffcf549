"""`bias` and `mask` arrays on the "cpu" kernel (issue 16 item 3), against jax.nn on float32
inputs by FlashAttention's rule (attention_testing.py): the output and the gradients of q, k, v
and the bias, for every way the arrays broadcast (B|1, N|1, T|1, S|1, and fewer dims), with
is_causal, windows, lengths, GQA and T != S, in float32 and bfloat16; dbias is bit-identical run
after run; a NaN in the bias shows in its row (issue 13: never a NaN turned into a number); a
row the mask empties gives zeros, as any empty row.

jax.nn gives a row with no key the mean of the values and jax_flash 0: such rows are left out of
the comparisons (their cotangent zeroed in the references) and checked exactly instead."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_flash
from jax_flash import _ops, _registry
from jax_flash._reference import EMPTY_ROW_LSE
from attention_testing import (F32, assert_within_rule, ffi_calls, key_visibility, max_abs,
                               random_array)

B, T, S, N, K, H = 2, 70, 150, 4, 2, 16  # T, S span several 64-row and 128-key tiles


def _rank4(x):
  return None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)


def _inputs(seed, dtype, bias_shape, bias_dtype, mask_shape, t=T, s=S, heads=(N, K), head_dim=H):
  """q, k, v, the cotangent g (values the dtype holds), a bias and a mask of those shapes (None
  for none). The mask keeps each row's key i (i < S) visible, so only lengths, windows and the
  rows a test empties on purpose leave a row without keys."""
  rng = np.random.default_rng(seed)
  n, kv = heads
  q = random_array(rng, (B, t, n, head_dim), dtype)
  k = random_array(rng, (B, s, kv, head_dim), dtype)
  v = random_array(rng, (B, s, kv, head_dim), dtype)
  g = random_array(rng, q.shape, dtype).astype(F32)
  bias = None if bias_shape is None else random_array(rng, bias_shape, bias_dtype)
  mask = None
  if mask_shape is not None:
    m = rng.random(mask_shape) < 0.6
    full = _rank4(jnp.asarray(m)).shape
    if full[3] == 1:  # no key dim: a row is all on or all off, so all on
      m = np.ones(mask_shape, bool)
    elif full[2] == 1:  # no row dim: the first T keys on
      m = m | (np.arange(s) < t)
    else:
      m = m | np.eye(t, s, dtype=bool).reshape((1,) * (len(mask_shape) - 2) + (t, s))
    mask = jnp.asarray(m)
  return q, k, v, g, bias, mask


def _live_rows(q_shape, s, mask, options) -> np.ndarray:
  """(B, N, T) bool: rows with a visible key (the masks, the lengths and the mask array)."""
  batch, t, n, _ = q_shape
  vis = key_visibility(np, t, s, options.get("query_seq_lengths"),
                       options.get("key_value_seq_lengths"), options.get("is_causal", False),
                       options.get("local_window_size"))
  vis = np.broadcast_to(vis[:, None], (batch, n, t, s))
  if mask is not None:
    vis = vis & np.asarray(_rank4(mask))
  return vis.any(-1)


def _vjp(attention, q, k, v, bias, g):
  """(out, dq, dk, dv, dbias or None) of attention(q, k, v, bias) for the cotangent g."""
  if bias is None:
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, None), q, k, v)
    return (out, *vjp(g.astype(out.dtype)), None)
  out, vjp = jax.vjp(attention, q, k, v, bias)
  return (out, *vjp(g.astype(out.dtype)))


def _numpy(results):
  return tuple(None if x is None else np.asarray(jnp.asarray(x, F32), np.float64)
               for x in results)


def _jax_nn(mask, options):
  def attention(q, k, v, bias):
    return jax.nn.dot_product_attention(q, k, v, _rank4(bias), _rank4(mask),
                                        implementation="xla", **options)
  return attention


def _flash(mask, options, implementation="cpu"):
  def attention(q, k, v, bias):
    return jax_flash.dot_product_attention(q, k, v, bias, mask,
                                           implementation=implementation, **options)
  return attention


def _check(seed, dtype, bias_shape=None, bias_dtype=None, mask_shape=None, t=T, s=S,
           heads=(N, K), implementation="cpu", head_dim=H, **options):
  """jax_flash (the "cpu" kernel, or `implementation`) against jax.nn on float32 inputs, by the
  rule (jax.nn in the input dtype gives the dtype's own error), on the rows with keys; exact
  zeros on the others."""
  bias_dtype = dtype if bias_dtype is None else bias_dtype
  q, k, v, g, bias, mask = _inputs(seed, dtype, bias_shape, bias_dtype, mask_shape, t, s, heads,
                                   head_dim)
  live = _live_rows(q.shape, s, mask, options)  # (B, N, T)
  live_btn = np.swapaxes(live, 1, 2)[..., None]  # (B, T, N, 1), like out
  g_ref = jnp.where(live_btn, g, 0.0)  # jax.nn's empty rows (the mean of V) carry no gradient

  got = _numpy(jax.jit(functools.partial(_vjp, _flash(mask, options, implementation)))(q, k, v, bias, g))
  up = lambda x: None if x is None else x.astype(F32)
  reference = jax.jit(functools.partial(_vjp, _jax_nn(mask, options)))
  ref32 = _numpy(reference(up(q), up(k), up(v), up(bias), g_ref))
  refd = ref32 if dtype == F32 else _numpy(reference(q, k, v, bias, g_ref))

  for x, name in zip(got, ("out", "dq", "dk", "dv", "dbias")):
    assert x is None or np.all(np.isfinite(x)), name
  assert_within_rule("out", got[0], ref32[0], refd[0], np.broadcast_to(live_btn, got[0].shape))
  assert np.all(got[0][~np.broadcast_to(live_btn, got[0].shape)] == 0), "empty rows give 0"
  magnitude = max(max_abs(x) for x in ref32[1:] if x is not None)
  for name, x, r32, rd in zip(("dq", "dk", "dv", "dbias"), got[1:], ref32[1:], refd[1:]):
    if r32 is None:
      continue
    assert x.shape == r32.shape, name
    if name == "dbias" and bias.shape[-1] == 1 and "sinks" not in options:
      # No key dim: the softmax cancels the bias and jax_flash's dbias is exactly 0; jax.nn's is
      # the rounding of its sum of dS over every key and broadcast element (CI drew a (1, 1, 1, 1)
      # bias whose reference, 5.2e-5, was past the rule's bound for a 0).
      assert np.all(x == 0), f"dbias of a bias with no key dim: max|dbias| = {max_abs(x):.4g}"
      continue
    assert_within_rule(name, x, r32, rd, magnitude=magnitude)
  if bias is not None:
    dbias = jax.jit(jax.grad(lambda b: jnp.sum(_flash(mask, options, implementation)(q, k, v, b)
                                               .astype(F32) * g)))(bias)
    assert dbias.dtype == bias.dtype and dbias.shape == bias.shape


BIAS_SHAPES = {
    "BNTS": (B, N, T, S), "1NTS": (1, N, T, S), "B1TS": (B, 1, T, S), "11TS": (1, 1, T, S),
    "TS": (T, S), "BN1S": (B, N, 1, S), "S": (S,), "BNT1": (B, N, T, 1), "NT1": (N, T, 1),
    "1111": (1, 1, 1, 1),
}


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=str)
def test_bias_shapes_float32(shape):
  _check(0, F32, bias_shape=BIAS_SHAPES[shape], is_causal=True)


@pytest.mark.parametrize("shape", ["BNTS", "1NTS", "B1TS", "TS", "BN1S", "BNT1"], ids=str)
def test_mask_shapes_float32(shape):
  _check(1, F32, mask_shape=BIAS_SHAPES[shape])


@pytest.mark.parametrize("bias, mask, options", [
    ("1NTS", "B1TS", dict(is_causal=True)),
    ("BNTS", "TS", dict(local_window_size=(20, 7))),
    ("TS", "BN1S", dict(query_seq_lengths=jnp.array([70, 31], jnp.int32),
                        key_value_seq_lengths=jnp.array([150, 90], jnp.int32))),
    ("BN1S", "1NTS", dict(is_causal=True, local_window_size=(40, 0))),
    ("NT1", "BNTS", dict(key_value_seq_lengths=jnp.array([100, 150], jnp.int32))),
], ids=["causal", "window", "lengths", "causal-window", "kvlens"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bias_and_mask_with_the_masks(bias, mask, options, dtype):
  _check(2, jnp.dtype(dtype), bias_shape=BIAS_SHAPES[bias], mask_shape=BIAS_SHAPES[mask],
         **options)


def test_bfloat16_inputs_with_a_float32_bias():
  _check(3, jnp.dtype(jnp.bfloat16), bias_shape=(1, N, T, S), bias_dtype=F32, is_causal=True)


@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_heads_and_t_above_s(heads):
  _check(4, F32, bias_shape=(1, heads[0], 130, 40), mask_shape=(B, 1, 130, 40), t=130, s=40,
         heads=heads)


@pytest.mark.parametrize("shape", ["11TS", "BNT1", "NT1", "1111", "BNTS"])
def test_dbias_from_several_dq_splits(monkeypatch, shape):
  """Key blocks dealt to 3 dQ splits: a bias without a key dim sums a partial per split, one
  with it has each split own its columns (a full one, BNTS, stores its dS directly)."""
  monkeypatch.setattr(_ops, "dq_splits", lambda *args: 3)
  _check(5, F32, bias_shape=BIAS_SHAPES[shape], mask_shape=(T, S), is_causal=True)


def test_dbias_is_stored_directly_where_each_element_takes_one_ds():
  """Where no dim of the bias is broadcast over more than one of the call's indices, each dbias
  element takes one dS: the backward stores it there, in the bias's dtype, with no float32
  workspace (the rule is the native module's, read by the handler and by the Python side)."""
  one_each = _registry.cpu_dbias_one_each
  assert one_each((B, N, T, S), B, N, T, S)
  assert one_each((1, N, T, S), 1, N, T, S)  # a batch of one
  assert one_each((B, N, 1, S), B, N, 1, S)  # a single query row
  assert not one_each((1, N, T, S), B, N, T, S)  # shared by the batch
  assert not one_each((B, 1, T, S), B, N, T, S)  # by the heads
  assert not one_each((B, N, 1, S), B, N, T, S)  # by the rows
  assert not one_each((B, N, T, 1), B, N, T, S)  # by the keys
  assert _registry.cpu_dbias_accum_elements(B * N * T * S, False, False, 1, True) == 0
  assert _registry.cpu_dbias_accum_elements(B * N * T * S, False, False, 1, False) == B * N * T * S
  # A full bfloat16 bias (stored directly) under a causal window, against jax.nn.
  _check(6, jnp.dtype(jnp.bfloat16), bias_shape=(B, N, T, S), is_causal=True, local_window_size=(30, 5))


@settings(max_examples=12, deadline=None)
@given(bias_dims=st.none() | st.tuples(*[st.booleans()] * 4),
       mask_dims=st.none() | st.tuples(*[st.booleans()] * 4),
       t=st.integers(1, 140), s=st.integers(1, 140), is_causal=st.booleans(),
       window=st.none() | st.tuples(st.integers(0, 50), st.integers(0, 50)),
       seed=st.integers(0, 2**16))
def test_random_shapes(bias_dims, mask_dims, t, s, is_causal, window, seed):
  def shape(dims):
    return None if dims is None else tuple(n if f else 1 for n, f in zip((B, N, t, s), dims))
  _check(seed, F32, bias_shape=shape(bias_dims), mask_shape=shape(mask_dims), t=t, s=s,
         is_causal=is_causal, local_window_size=window)


@pytest.mark.parametrize("policies", ["ids+cap+alibi", "blocks+dropout"])
def test_with_the_other_score_policies(policies):
  """The arrays on top of the other score policies, against jax_flash's own float32 "xla"
  path (jax.nn has none of them): the bias comes after the cap and ALiBi; segment ids, a
  block mask and dropout combine with the mask."""
  t = 200  # two 128-row mask blocks
  q, k, v, g, bias, mask = _inputs(6, F32, (1, N, t, t), F32, (B, 1, t, t), t=t, s=t)
  if policies == "ids+cap+alibi":
    ids = jnp.asarray(np.repeat(np.arange(2), [90, t - 90])[None].repeat(B, 0), jnp.int32)
    options = dict(is_causal=True, q_segment_ids=ids, kv_segment_ids=ids, logits_soft_cap=3.0,
                   alibi_slopes=jnp.linspace(0.1, 0.4, N))
  else:
    blocks = jnp.asarray([[True, False], [True, True]])
    options = dict(block_mask=blocks, dropout_rate=0.2, dropout_key=jax.random.key(3))
  got = _numpy(jax.jit(functools.partial(_vjp, _flash(mask, options)))(q, k, v, bias, g))
  want = _numpy(jax.jit(functools.partial(_vjp, _flash(mask, options, "xla")))(q, k, v, bias, g))
  for name, x, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    assert_within_rule(name, x, w, w, magnitude=max(max_abs(y) for y in want))


def test_dbias_is_the_same_bits_every_run(monkeypatch):
  """dbias sums dS over its broadcast dims in a fixed order: bit-identical run after run, also
  where several tasks and dQ splits add into it."""
  monkeypatch.setattr(_ops, "dq_splits", lambda *args: 3)
  q, k, v, g, _, mask = _inputs(7, F32, None, F32, (T, S))
  rng = np.random.default_rng(8)
  for shape in ((1, 1, T, S), (1, N, 1, S), (B, 1, T, 1), (1, 1, 1, 1)):
    bias = random_array(rng, shape, F32)
    fn = jax.jit(jax.grad(lambda q, b: jnp.sum(_flash(mask, dict(is_causal=True))(q, k, v, b)
                                               * g), argnums=(0, 1)))
    first = [np.asarray(x) for x in fn(q, bias)]
    for _ in range(3):
      again = [np.asarray(x) for x in fn(q, bias)]
      for a, b in zip(first, again):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), shape


def test_nan_in_the_bias_shows_in_its_row():
  """A NaN bias element a row attends to makes that row's output NaN (never a number); one the
  mask hides changes nothing; the other rows stay finite."""
  q, k, v, _, bias, _ = _inputs(9, F32, (B, N, T, S), F32, None)
  mask = jnp.ones((B, N, T, S), bool).at[1, 2, 5, 40].set(False)
  bias = bias.at[0, 1, 3, 17].set(jnp.nan).at[1, 2, 5, 40].set(jnp.nan)
  out = np.asarray(jax_flash.dot_product_attention(q, k, v, bias, mask, implementation="cpu"))
  nan_rows = np.isnan(out).any(-1)  # (B, T, N)
  want = np.zeros_like(nan_rows)
  want[0, 3, 1] = True
  assert np.array_equal(nan_rows, want)
  assert np.all(np.isnan(out[0, 3, 1]))


def test_row_the_mask_empties_gives_zero():
  """A row the mask empties: output 0, lse EMPTY_ROW_LSE, no gradient from it (dq, dbias 0)."""
  q, k, v, g, bias, _ = _inputs(10, F32, (1, N, T, S), F32, None)
  mask = jnp.ones((B, N, T, S), bool).at[:, 2, 5].set(False)

  def loss(q, bias):
    out, lse = jax_flash.dot_product_attention(q, k, v, bias, mask, implementation="cpu",
                                               return_residual=True)
    return jnp.sum(out * g), (out, lse)

  (_, (out, lse)), (dq, dbias) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(q, bias)
  assert np.all(np.asarray(out[:, 5, 2]) == 0) and np.all(np.asarray(lse[:, 5, 2]) == EMPTY_ROW_LSE)
  assert np.all(np.asarray(dq[:, 5, 2]) == 0) and np.all(np.asarray(dbias[0, 2, 5]) == 0)
  assert np.all(np.isfinite(np.asarray(out))) and np.all(np.isfinite(np.asarray(dbias)))


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped-bias", "shared-bias"])
def test_vmap(mapped):
  """vmap folds a mapped bias into the batch as q's, and a shared one broadcasts along it:
  each example's output and gradients are those of its own call."""
  q, k, v, g, _, mask = _inputs(11, F32, None, F32, (1, 1, T, S))
  rng = np.random.default_rng(12)
  bias = random_array(rng, (3, 1, N, T, S) if mapped else (1, N, T, S), F32)
  qs, ks, vs, gs = (jnp.stack([x, x * 0.5, -x]) for x in (q, k, v, g))

  def one(q, k, v, bias, g):
    out, vjp = jax.vjp(lambda q, b: _flash(mask, dict(is_causal=True))(q, k, v, b), q, bias)
    return out, *vjp(g)

  got = jax.jit(jax.vmap(one, in_axes=(0, 0, 0, 0 if mapped else None, 0)))(qs, ks, vs, bias, gs)
  for i in range(3):
    want = one(qs[i], ks[i], vs[i], bias[i] if mapped else bias, gs[i])
    for x, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(x[i]), np.asarray(w), rtol=2e-6, atol=2e-6)


def test_the_kernel_gets_the_arrays_as_given():
  """Never broadcast to (B, N, T, S) in XLA: the forward and backward custom calls take the
  (1, N, T, S) bias and (T, S) mask as (1, N, T, S) and (1, 1, T, S)."""
  q, k, v, g, bias, mask = _inputs(13, F32, (1, N, T, S), F32, (T, S))

  def loss(q, k, v, bias):
    return jnp.sum(jax_flash.dot_product_attention(q, k, v, bias, mask, implementation="cpu"))

  calls = ffi_calls(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, bias)
  names = [name for name, *_ in calls]
  assert names == ["jax_flash_cpu_fwd", "jax_flash_cpu_bwd"], names
  for name, attributes, operands, results in calls:
    assert attributes["bias"] and attributes["mask"]
    shapes = [tuple(a.shape) for a in operands]
    assert (1, N, T, S) in shapes and (1, 1, T, S) in shapes, shapes
    assert all(np.prod(s) <= N * T * S for s in shapes if len(s) == 4 and s[-1] == S), shapes
  *_, results = calls[1]
  assert tuple(results[5].shape) == (1, N, T, S)  # dbias, in the bias's own shape


@pytest.mark.parametrize("bias_shape", [(1, N, T, T), (N, T, 1)], ids=["1NTS", "NT1"])
def test_with_sinks(bias_shape):
  """Sinks join every row's softmax without the bias: a bias with no key dim then has a
  gradient, which the kernel's sum of dS gives (against jax_flash's float32 "xla" path)."""
  q, k, v, g, bias, mask = _inputs(14, F32, bias_shape, F32, (B, 1, T, T), s=T)
  options = dict(is_causal=True, sinks=jnp.linspace(-1.0, 1.0, N))
  got = _numpy(jax.jit(functools.partial(_vjp, _flash(mask, options)))(q, k, v, bias, g))
  want = _numpy(jax.jit(functools.partial(_vjp, _flash(mask, options, "xla")))(q, k, v, bias, g))
  assert max_abs(want[4]) > 1e-3  # not the shift-invariant case
  for name, x, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    assert_within_rule(name, x, w, w, magnitude=max(max_abs(y) for y in want))


# ---------------------------------------------------------------------------------------------
# Sharded calls (8 simulated CPU devices, as tests/test_sharding.py)

SB, SN, SK, ST = 4, 8, 4, 48  # batch over "data" (2), heads over "model" (4)


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (conftest sets --xla_force_host_platform_device_count=8)")
  from jax.sharding import Mesh
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _sharded_run(mesh, spec, bias_shape, **options):
  """(sharded, single-device) results (out, dq, dk, dv, dbias) of a call whose q, k, v are laid
  out by `spec`, the bias by its own full dims, plus the compiled HLO."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  rng = np.random.default_rng(15)
  q = random_array(rng, (SB, ST, SN, H), F32)
  k, v = (random_array(rng, (SB, ST, SK, H), F32) for _ in range(2))
  g = random_array(rng, q.shape, F32)
  bias = random_array(rng, bias_shape, F32)
  mask = jnp.asarray(rng.random((SB, 1, ST, ST)) < 0.7) | jnp.eye(ST, dtype=bool)
  attention = _flash(mask, dict(is_causal=True, **options))
  fn = jax.jit(functools.partial(_vjp, attention))
  rows = NamedSharding(mesh, spec)
  full = _rank4(bias).shape
  bias_spec = P(spec[0] if full[0] > 1 else None, spec[2] if full[1] > 1 else None)
  placed = [jax.device_put(x, rows) for x in (q, k, v)]
  placed += [jax.device_put(bias, NamedSharding(mesh, bias_spec if bias.ndim == 4 else P())),
             jax.device_put(g, rows)]
  hlo = fn.lower(*placed).compile().as_text()
  return _numpy(fn(*placed)), _numpy(fn(q, k, v, bias, g)), hlo


@pytest.mark.parametrize("bias_shape", [(SB, SN, ST, ST), (1, SN, ST, ST), (SB, 1, ST, 1),
                                        (ST, ST)], ids=["BNTS", "1NTS", "B1T1", "TS"])
@pytest.mark.parametrize("spec", [("data", None, None, None), (None, None, "model", None),
                                  ("data", None, "model", None)],
                         ids=["batch", "heads", "batch+heads"])
def test_batch_and_head_sharding(mesh, spec, bias_shape):
  """A bias with the batch (heads) shards with the batch (heads), one without is replicated and
  its dbias summed over that axis: the single-device results either way; no communication at
  all where the bias has every sharded dim."""
  from jax.sharding import PartitionSpec as P
  got, want, hlo = _sharded_run(mesh, P(*spec), bias_shape)
  for name, x, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    np.testing.assert_allclose(x, w, rtol=2e-6, atol=2e-6, err_msg=name)
  if bias_shape == (SB, SN, ST, ST):
    assert not re.search(r"all-reduce|all-gather|all-to-all|collective-permute", hlo)


@pytest.mark.parametrize("context_parallel", [None, "all_to_all"])
def test_sequence_sharding_runs_a_strategy(mesh, context_parallel):
  """A sharded sequence runs a context-parallel strategy with the arrays' rows (automatic: the
  ring, zig-zag as causal; or the all-to-all) with the batch sharded beside it: the
  single-device results, and no all-gather of the sequence
  (tests/test_context_parallel_logit_arrays.py has the strategies' own cases)."""
  from jax.sharding import PartitionSpec as P
  got, want, hlo = _sharded_run(mesh, P("data", "model", None, None), (1, SN, ST, ST),
                                context_parallel=context_parallel)
  for name, x, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    np.testing.assert_allclose(x, w, rtol=2e-6, atol=2e-6, err_msg=name)
  assert ("all-to-all" if context_parallel else "collective-permute") in hlo


def test_sharding_with_gspmd(mesh):
  """The same under the GSPMD partitioner (the custom partitioning's callbacks)."""
  from jax.sharding import PartitionSpec as P
  previous = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", not previous)
  try:
    for bias_shape in ((1, SN, ST, ST), (SB, SN, ST, ST)):
      got, want, _ = _sharded_run(mesh, P("data", None, "model", None), bias_shape)
      for name, x, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        np.testing.assert_allclose(x, w, rtol=2e-6, atol=2e-6, err_msg=name)
  finally:
    jax.config.update("jax_use_shardy_partitioner", previous)


def test_a_bias_nothing_differentiates_gets_no_dbias():
  """The forward rule sees whether the bias is differentiated (symbolic zeros): where it is not,
  the backward kernel returns no dbias (a (0,) result) and forms none; dq, dk, dv as with it
  (up to the order of sums: the tasks may be split otherwise)."""
  q, k, v, g, bias, mask = _inputs(16, F32, (1, N, T, S), F32, (T, S))

  def loss(q, k, v, bias):
    return jnp.sum(jax_flash.dot_product_attention(q, k, v, bias, mask, implementation="cpu") * g)

  without = ffi_calls(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, bias)
  with_dbias = ffi_calls(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, bias)
  assert tuple(without[1][3][5].shape) == (0,) and tuple(with_dbias[1][3][5].shape) == (1, N, T, S)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, bias)
  grads_too = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)[:3]
  for a, b in zip(grads, grads_too):  # (the task split may differ: not the same bits)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
