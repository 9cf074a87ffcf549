"""A value head dim Hv other than the query/key head dim H (issue 17 item 5): MLA-style attention
(DeepSeek-V2: q/k 192, v 128). value is (B, S, K, Hv), the output (B, T, N, Hv); dq and dk keep H,
dv has Hv.

Each path ("cpu": its tiled kernel and its split-KV decode kernel, "blockwise", "xla") is checked
against a float32 reference written from the definition (score_variant_attention of
tests/attention_testing.py, differentiated by JAX: jax.nn refuses Hv != H), by the FlashAttention
rule: max error <= 2x the error of the same reference with the input dtype's rounding, plus the
tiny floor. Forward, lse and dq, dk, dv, alone and with causal, windows, lengths (empty rows),
GQA/MQA, T != S, unbatched inputs, float32/bfloat16/float16, with soft cap, ALiBi and segment ids;
then batch/head-sharded and context-parallel calls, paged attention, the Flax function, the
trace-time errors, the FFI handlers' shape checks and the CUDA kernels' padding to one head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import _decode, _dispatch, _ops, _registry
from test_cuda_ffi_validation import valid_bwd as cuda_valid_bwd
from test_cuda_ffi_validation import valid_fwd as cuda_valid_fwd
from test_ffi_validation import with_shape, with_shapes
from tests.attention_testing import (F32, Case, assert_within_rule, check_score_variant,
                                     check_score_variant_output, ffi_calls, outputs_and_grads,
                                     packed_segment_ids, random_array, score_variant_attention,
                                     score_variant_references, simulate_cuda_host, visible_keys)

IMPLEMENTATIONS = ["cpu", "blockwise", "xla"]


@dataclasses.dataclass(frozen=True)
class ValueCase:
  case: Case  # its head_dim is H, q's and k's
  head_dim_v: int  # Hv, v's and the output's
  cap: float | None = None
  alibi: bool = False
  segment_ids: bool = False  # documents of random lengths, sorted by position
  deterministic: bool = False

  @property
  def id(self) -> str:
    return (f"{self.case.id}_hv{self.head_dim_v}" + (f"_cap{self.cap}" if self.cap else "")
            + ("_alibi" if self.alibi else "") + ("_ids" if self.segment_ids else "")
            + ("_deterministic" if self.deterministic else ""))

  def inputs(self):
    """q, k (..., H), v (..., Hv) in the case's dtype, and a float32 cotangent (..., T, N, Hv)
    whose values that dtype holds exactly (as Case.inputs)."""
    c = self.case
    rng = np.random.default_rng(c.seed)
    b = () if c.rank3 else (c.batch,)
    q = random_array(rng, (*b, c.seq_q, c.heads_q, c.head_dim), c.jdtype)
    k = random_array(rng, (*b, c.seq_k, c.heads_k, c.head_dim), c.jdtype)
    v = random_array(rng, (*b, c.seq_k, c.heads_k, self.head_dim_v), c.jdtype)
    g = random_array(rng, (*b, c.seq_q, c.heads_q, self.head_dim_v), c.jdtype).astype(F32)
    return q, k, v, g

  def slopes(self):
    if not self.alibi:
      return None
    return jnp.asarray(-np.linspace(0.05, 0.4, self.case.heads_q), F32)

  def ids(self):
    return packed_segment_ids(self.case) if self.segment_ids else None

  def options(self) -> dict:
    opts = self.case.options()
    if self.cap is not None:
      opts["logits_soft_cap"] = self.cap
    if self.alibi:
      opts["alibi_slopes"] = self.slopes()
    if self.segment_ids:
      opts.update(q_segment_ids=self.ids(), kv_segment_ids=self.ids())
    if self.deterministic:
      opts["deterministic"] = True
    return opts

  def visible(self) -> np.ndarray:
    """(B, T, S) bool."""
    return visible_keys(self.case, self.ids())


def _live(vc: ValueCase) -> np.ndarray:
  live = vc.visible().any(-1)
  return live[0] if vc.case.rank3 else live


@functools.lru_cache(maxsize=16)
def references(vc: ValueCase):
  return score_variant_references(vc.case, vc.inputs(), vc.visible(), cap=vc.cap,
                                  slopes=vc.slopes())


def run(vc: ValueCase, implementation: str) -> dict:
  q, k, v, g = vc.inputs()
  opts = vc.options()

  def attention(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, implementation=implementation,
                                           return_residual=True, **opts)

  got = outputs_and_grads(attention, q, k, v, g)
  assert got["out"].shape == (*q.shape[:-1], vc.head_dim_v)
  for name, x in (("dq", q), ("dk", k), ("dv", v)):
    assert got[name].shape == x.shape, name
  return got


C = Case
CASES = [
    # DeepSeek-V2's dims alone (no mask), T != S.
    ValueCase(C(batch=1, seq_q=70, seq_k=90, heads_q=2, heads_k=2, head_dim=192), 128),
    # Several tiles of the CPU kernel both ways, causal, MQA, bfloat16.
    ValueCase(C(batch=2, seq_q=80, seq_k=130, heads_q=4, heads_k=1, head_dim=128,
                dtype="bfloat16", is_causal=True), 64),
    # A window and lengths, one batch element with no keys (empty rows), a negative scale, and
    # Hv > H.
    ValueCase(C(batch=2, seq_q=65, seq_k=80, heads_q=2, heads_k=2, head_dim=64,
                local_window_size=(8, 3), q_lens=(60, 65), kv_lens=(0, 77), scale=-0.3), 128),
    # Odd head dims (neither a multiple of 16), GQA 2:1, float16, causal with a key length,
    # unbatched inputs.
    ValueCase(C(batch=1, seq_q=33, seq_k=48, heads_q=4, heads_k=2, head_dim=40, dtype="float16",
                is_causal=True, kv_lens=(20,), rank3=True), 24),
    # A decode shape: the CPU runs it on its split-KV decode kernel (and its backward on the
    # tiled one).
    ValueCase(C(batch=2, seq_q=2, seq_k=300, heads_q=8, heads_k=2, head_dim=192,
                kv_lens=(300, 123)), 128),
    # With the score variants the tiled kernel takes: soft cap, ALiBi, segment ids.
    ValueCase(C(batch=2, seq_q=80, seq_k=80, heads_q=2, heads_k=1, head_dim=48, is_causal=True),
              32, cap=2.0, alibi=True, segment_ids=True),
]


# The CPU kernel on every case; "blockwise" and "xla" (whose changes are their output's and
# dV's shapes) on fewer, to keep the file fast: every compile of a value-and-grad costs about a
# second on a 2-core machine.
_PATHS = {"cpu": range(len(CASES)), "blockwise": (1, 2, 5), "xla": (0, 1)}
RUNS = [(vc, impl) for i, vc in enumerate(CASES) for impl in IMPLEMENTATIONS if i in _PATHS[impl]]


@pytest.mark.parametrize("vc,implementation", RUNS,
                         ids=[f"{vc.id}-{impl}" for vc, impl in RUNS])
def test_against_reference(vc, implementation):
  check_score_variant(run(vc, implementation), *references(vc), _live(vc))


def test_sinks_dropout_and_block_mask_combine_with_it():
  """The options the references above leave out, together, on the kernel against "xla" (which
  drops the same elements): sinks (joined after the kernel, their gradient from o and dO of Hv
  values), fused dropout and a block mask."""
  vc = ValueCase(C(batch=1, seq_q=140, seq_k=260, heads_q=2, heads_k=1, head_dim=48,
                   is_causal=True), 24)
  q, k, v, g = vc.inputs()
  blocks = np.random.default_rng(5).random(jax_flash.block_mask_shape(140, 260)) < 0.7
  blocks[np.arange(2), np.arange(2)] = True
  sinks = jnp.asarray([0.3, -0.5], F32)
  results = {}
  for implementation in ("cpu", "xla"):
    def attention(q, k, v, sinks):
      return jax_flash.dot_product_attention(
          q, k, v, is_causal=True, sinks=sinks, dropout_rate=0.2, dropout_key=jax.random.key(1),
          block_mask=jnp.asarray(blocks), implementation=implementation, return_residual=True)

    def loss(q, k, v, sinks):
      out, lse = attention(q, k, v, sinks)
      return jnp.sum(out * g), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                        has_aux=True))(q, k, v, sinks)
    results[implementation] = [np.asarray(x, np.float64) for x in (out, lse, *grads)]
  magnitude = max(np.max(np.abs(x)) for x in results["xla"][2:5])
  for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), results["cpu"],
                             results["xla"]):
    assert_within_rule(name, got, want, want,
                       magnitude=magnitude if name[0] == "d" and name != "dsinks" else None)


def test_decode_shapes_reach_the_decode_kernel():
  """The decode cases above run the CPU's split-KV decode kernel, not the tiled one."""
  c = CASES[4].case
  assert _decode.kv_splits("cpu", c.batch, c.seq_q, c.heads_q, c.heads_k, c.seq_k) >= 1


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_chunks(splits):
  """The decode kernel itself, with one key chunk (o written directly) and three (partial
  outputs of Hv values a row, then the combine)."""
  vc = ValueCase(C(batch=2, seq_q=3, seq_k=700, heads_q=6, heads_k=2, head_dim=96,
                   kv_lens=(700, 250)), 40)
  q, k, v, _ = vc.inputs()
  lens = jnp.asarray([3, 3], jnp.int32), jnp.asarray(vc.case.kv_lens, jnp.int32)
  scale = 1 / np.sqrt(96)
  o, lse = jax.jit(lambda q, k, v, *lens: _decode.decode_fwd(
      q, k, v, *lens, scale=scale, is_causal=False, window_left=-1, window_right=-1,
      splits=splits))(q, k, v, *lens)
  assert o.shape == (2, 3, 6, 40)
  want, want_lse = jax.jit(functools.partial(score_variant_attention, vis=vc.visible(),
                                             scale=scale))(q, k, v)
  np.testing.assert_allclose(o, want, rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(jnp.swapaxes(lse, -1, -2), want_lse, rtol=1e-6, atol=1e-6)


def test_vmap_folds_into_the_batch():
  vc = CASES[1]
  q, k, v, _ = vc.inputs()
  f = lambda q, k, v: jax_flash.dot_product_attention(  # noqa: E731
      q, k, v, is_causal=True, implementation="cpu")
  got = jax.vmap(f)(q[:, None], k[:, None], v[:, None])[:, 0]
  np.testing.assert_array_equal(got, f(q, k, v))


# ---------------------------------------------------------------------------------------------
# Sharded calls: the shapes flow through the partitioning (v's head dim is its own factor of the
# sharding rule, kept whole) and every context-parallel strategy.


def _vjp_outputs(attention, q, k, v, g):
  (out, lse), vjp = jax.vjp(attention, q, k, v)
  return out, lse, *vjp((g, jnp.zeros_like(lse)))


def _assert_close(got, want):
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)


def _mesh(shape, names):
  devices = int(np.prod(shape))
  if len(jax.devices()) < devices:
    pytest.skip(f"needs {devices} devices (conftest sets 8 host devices)")
  return Mesh(np.array(jax.devices()[:devices]).reshape(shape), names)


@pytest.mark.parametrize("spec,context_parallel", [
    (P("data", None, "model", None), None),  # batch and heads: no communication
    (P(None, "data", None, None), "ring"),
    (P(None, "data", None, None), "all_to_all"),
], ids=["batch+heads", "ring", "all_to_all"])
def test_sharded_calls_match_single_device(spec, context_parallel):
  mesh = _mesh((2, 2), ("data", "model"))
  vc = ValueCase(C(batch=2, seq_q=32, seq_k=32, heads_q=4, heads_k=2, head_dim=24,
                   is_causal=True, kv_lens=(32, 19)), 40)
  q, k, v, g = vc.inputs()
  opts = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([32, 19], jnp.int32))

  def attention(q, k, v, **extra):
    return jax_flash.dot_product_attention(q, k, v, implementation="cpu", return_residual=True,
                                           **opts, **extra)

  want = jax.jit(_vjp_outputs, static_argnums=0)(attention, q, k, v, g)
  placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, g)]
  sharded = functools.partial(attention, context_parallel=context_parallel)
  got = jax.jit(_vjp_outputs, static_argnums=0)(sharded, *placed)
  assert got[0].shape == (2, 32, 4, 40)
  _assert_close(got, want)


def test_context_parallel_attention_in_shard_map():
  mesh = _mesh((4,), ("seq",))
  vc = ValueCase(C(batch=1, seq_q=32, seq_k=32, heads_q=4, heads_k=2, head_dim=16), 24)
  q, k, v, g = vc.inputs()
  want = jax.jit(_vjp_outputs, static_argnums=0)(
      lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation="cpu",
                                                      return_residual=True), q, k, v, g)
  spec = P(None, "seq", None, None)
  local = lambda q, k, v: jax_flash.context_parallel_attention(  # noqa: E731
      q, k, v, axis_name="seq", strategy="all_gather", layout="contiguous", is_causal=True,
      implementation="cpu", return_residual=True)
  sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3,
                          out_specs=(spec, P(None, "seq", None)))
  _assert_close(jax.jit(_vjp_outputs, static_argnums=0)(sharded, q, k, v, g), want)


# ---------------------------------------------------------------------------------------------
# Paged attention and the Flax function


@pytest.mark.parametrize("implementation", ["cpu", "xla"])
def test_paged_attention(implementation):
  """value_pages (num_pages, page_size, K, Hv): the CPU decode kernel reads them through the
  table as it reads the keys; "xla" gathers them. Against the contiguous reference with the
  bottom-right aligned causal mask."""
  rng = np.random.default_rng(3)
  batch, seq_q, heads_q, heads_k, h, hv, page, per_seq = 2, 3, 4, 2, 64, 32, 16, 6
  num_pages = batch * per_seq + 3
  q = random_array(rng, (batch, seq_q, heads_q, h), F32)
  kp = random_array(rng, (num_pages, page, heads_k, h), F32)
  vp = random_array(rng, (num_pages, page, heads_k, hv), F32)
  table = jnp.asarray(rng.permutation(num_pages)[:batch * per_seq].reshape(batch, per_seq),
                      jnp.int32)
  lens = jnp.asarray([96, 41], jnp.int32)
  out, lse = jax.jit(functools.partial(jax_flash.paged_attention, is_causal=True,
                                       implementation=implementation, return_residual=True))(
                                           q, kp, vp, table, lens)
  assert out.shape == (batch, seq_q, heads_q, hv)
  gather = lambda pages: pages[table].reshape(batch, per_seq * page, heads_k, -1)  # noqa: E731
  position = np.asarray(lens)[:, None, None] - seq_q + np.arange(seq_q)[None, :, None]
  j = np.arange(per_seq * page)[None, None, :]
  vis = (j < np.asarray(lens)[:, None, None]) & (j <= position)
  want, want_lse = jax.jit(functools.partial(score_variant_attention, vis=vis,
                                             scale=1 / np.sqrt(h)))(q, gather(kp), gather(vp))
  for name, a, b in (("out", out, want), ("lse", lse, want_lse)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert_within_rule(name, a, b, b)


def test_flax_function_takes_its_own_value_depth():
  """jax_flash.flax.dot_product_attention, like Flax's (v_depth_per_head), with batch dims."""
  jflax = pytest.importorskip("jax_flash.flax")
  rng = np.random.default_rng(4)
  q = random_array(rng, (2, 3, 10, 4, 32), F32)
  k = random_array(rng, (2, 3, 12, 2, 32), F32)
  v = random_array(rng, (2, 3, 12, 2, 16), F32)
  out = jax.jit(functools.partial(jflax.dot_product_attention, deterministic=True,
                                  implementation="cpu"))(q, k, v)
  assert out.shape == (2, 3, 10, 4, 16)
  want = jax.jit(functools.partial(jax_flash.dot_product_attention, implementation="xla"))(
      *(x.reshape(6, *x.shape[2:]) for x in (q, k, v)))
  np.testing.assert_allclose(out.reshape(want.shape), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Errors at trace time


def _pattern(*fragments: str) -> str:
  return "(?s)" + ".*".join(re.escape(f) for f in fragments)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("v_shape,fragments", [
    ((2, 8, 4, 32), ("key and value must have the same shape but for the head dim",
                     "key(2, 8, 2, 16), value(2, 8, 4, 32)")),
    ((2, 9, 2, 32), ("key and value must have the same shape", "value(2, 9, 2, 32)")),
    ((2, 8, 2, 0), ("value head dim Hv=0", "value(2, 8, 2, 0)")),
    ((8, 2, 32), ("rank", "value(8, 2, 32)")),
], ids=["kv_heads", "kv_length", "hv_0", "rank"])
def test_shape_errors(v_shape, fragments, implementation):
  q, k, v = jnp.ones((2, 8, 4, 16)), jnp.ones((2, 8, 2, 16)), jnp.ones(v_shape)
  with pytest.raises(ValueError, match=_pattern(*fragments)):
    jax_flash.dot_product_attention(q, k, v, implementation=implementation)


def test_value_head_dim_past_the_kernels_limit():
  q, v = jnp.ones((1, 4, 2, 16)), jnp.ones((1, 4, 2, 300))
  with pytest.raises(ValueError, match=_pattern("value head dim Hv=300", "value(1, 4, 2, 300)",
                                                "Hv <= 256", "'blockwise'")):
    jax_flash.dot_product_attention(q, q, v, implementation="cpu")
  out = jax.eval_shape(functools.partial(jax_flash.dot_product_attention,
                                          implementation="blockwise"), q, q, v)
  assert out.shape == (1, 4, 2, 300)


@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (64, 32), (40, 72)])
def test_cuda_calls_pad_to_one_head_dim(monkeypatch, head_dim, head_dim_v):
  """The CUDA kernels take one head dim: where None picks them (or "cuda" is forced), a call
  with Hv != H traces to forward and backward custom calls whose q, k, v, o and dO all have the
  larger head dim, rounded up to the kernels' multiple of 8 (zero columns: no score changes, the
  extra output columns are sliced off), and the output and dv come back with Hv. A GPU host with
  the kernels built is simulated (traced, never run; test_cuda_matches_padded_reference runs
  them). The kernel calls themselves still refuse unequal head dims."""
  simulate_cuda_host(monkeypatch)
  monkeypatch.setattr(_dispatch, "default_implementation", lambda dtype: "cuda")
  q = jnp.ones((2, 128, 2, head_dim), jnp.bfloat16)
  v = jnp.ones((2, 128, 2, head_dim_v), jnp.bfloat16)
  common = -(-max(head_dim, head_dim_v) // 8) * 8
  for implementation in (None, "cuda"):
    def loss(q, k, v):
      out = jax_flash.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
      assert out.shape == (2, 128, 2, head_dim_v)
      return out.astype(F32).sum()

    assert [x.shape for x in jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, q, v)] == [
        q.shape, q.shape, v.shape]
    calls = ffi_calls(jax.grad(loss, argnums=(0, 1, 2)), q, q, v)
    assert [name for name, *_ in calls] == ["jax_flash_cuda_fwd", "jax_flash_cuda_bwd"]
    for name, _, operands, results in calls:
      heads = {x.shape[-1] for x in (*operands, *results) if x.ndim == 4 and x.dtype == jnp.bfloat16}
      assert heads == {common}, (name, implementation, operands, results)


@pytest.mark.parametrize("backward_kernel", [False, True])
@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (160, 120)])
def test_cuda_forward_of_the_pair_takes_v_as_it_is(monkeypatch, head_dim, head_dim_v,
                                                   backward_kernel):
  """Where a CUDA forward of the (H, Hv) pair runs (simulated: the native module says so, as it
  does on Hopper unless JAX_FLASH_CUDA_VALUE_HEAD_DIM=padded), the forward custom call takes v and
  gives o with Hv, q and k keeping H; the backward's takes v and dO as they are and gives dv with
  Hv where a backward kernel of the pair runs (`backward_kernel`: not deterministic, on Hopper),
  else v and dO zero-padded to H, dv's first Hv columns kept. The module is asked with the padded
  head dims (and the backward with `deterministic`). Decode shapes (the decode kernel) still
  pad."""
  simulate_cuda_host(monkeypatch)
  asked, asked_backward = [], []

  def takes(h, hv):
    asked.append((h, hv))
    return True

  def backward_takes(h, hv, deterministic):
    asked_backward.append((h, hv, deterministic))
    return backward_kernel

  monkeypatch.setattr(_registry._native_cuda, "forward_takes_value_head_dim", takes)
  monkeypatch.setattr(_registry._native_cuda, "backward_takes_value_head_dim", backward_takes)
  jax.clear_caches()  # (the backward's trace is cached across the parametrisations otherwise)
  q = jnp.ones((2, 128, 2, head_dim), jnp.bfloat16)
  v = jnp.ones((2, 128, 2, head_dim_v), jnp.bfloat16)

  def loss(q, k, v):
    out = jax_flash.dot_product_attention(q, k, v, is_causal=True, implementation="cuda")
    assert out.shape == (2, 128, 2, head_dim_v)
    return out.astype(F32).sum()

  grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, q, v)
  assert [x.shape for x in grads] == [q.shape, q.shape, v.shape]
  calls = ffi_calls(jax.grad(loss, argnums=(0, 1, 2)), q, q, v)
  assert [name for name, *_ in calls] == ["jax_flash_cuda_fwd", "jax_flash_cuda_bwd"]
  (_, _, fwd_in, fwd_out), (_, _, bwd_in, bwd_out) = calls
  assert [x.shape[-1] for x in fwd_in[:3]] == [head_dim, head_dim, head_dim_v]
  assert fwd_out[0].shape[-1] == head_dim_v  # o
  # q, k, v, lse, delta, dO: v and dO as they are, or padded to H; dq, dk, dv likewise.
  value = head_dim_v if backward_kernel else head_dim
  assert [x.shape[-1] for x in (*bwd_in[:3], bwd_in[5])] == [head_dim, head_dim, value, value]
  assert [x.shape[-1] for x in bwd_out[:3]] == [head_dim, head_dim, value]
  assert asked and set(asked) == {(head_dim, head_dim_v)}
  assert set(asked_backward) == {(head_dim, head_dim_v, False)}
  # One query row a kv head's group: the decode kernel, which pads.
  q1 = jnp.ones((2, 1, 2, head_dim), jnp.bfloat16)
  k1 = jnp.ones((2, 4096, 2, head_dim), jnp.bfloat16)
  v1 = jnp.ones((2, 4096, 2, head_dim_v), jnp.bfloat16)
  decode = ffi_calls(functools.partial(jax_flash.dot_product_attention, implementation="cuda"),
                     q1, k1, v1)
  assert decode and all(x.shape[-1] == head_dim for _, _, ins, _ in decode for x in ins[:3]
                        if x.ndim == 4), decode


@pytest.mark.gpu
@pytest.mark.parametrize("index", [0, 1, 2, 3, 5])
def test_cuda_matches_padded_reference(index):
  """The CUDA kernels on the cases above in 16-bit (float32 ones cast to bfloat16): Hv != H
  through their zero-padded head dims (192 / 128's forward, on Hopper, on the pair's kernels),
  forward and every gradient against the float32 reference, by the FlashAttention rule."""
  vc = CASES[index]
  if vc.case.jdtype == jnp.float32:
    vc = dataclasses.replace(vc, case=dataclasses.replace(vc.case, dtype="bfloat16"))
  check_score_variant(run(vc, "cuda"), *references(vc), _live(vc))


# Cases for the CUDA forward of the (192, 128) pair (cuda/gpu/tile_shapes.cuh
# JF_SM90_FWD_VALUE_HEAD_DIMS): several 128-row tiles and 128-key blocks, partial last ones.
PAIR_CASES = [
    # Causal GQA, lengths: a batch element with no keys (empty rows), one with part of them.
    ValueCase(C(batch=3, seq_q=200, seq_k=300, heads_q=4, heads_k=2, head_dim=192,
                dtype="bfloat16", is_causal=True, kv_lens=(300, 150, 0)), 128),
    # H 160 and Hv 120 run the pair's kernels (columns past them zero-filled and not stored);
    # a local window, query lengths, MQA, float16.
    ValueCase(C(batch=2, seq_q=257, seq_k=257, heads_q=2, heads_k=1, head_dim=160,
                dtype="float16", local_window_size=(64, 16), q_lens=(250, 257)), 120),
    # The general kernels: soft cap, ALiBi and segment ids, causal.
    ValueCase(C(batch=2, seq_q=256, seq_k=256, heads_q=2, heads_k=2, head_dim=192,
                dtype="bfloat16", is_causal=True), 128, cap=30.0, alibi=True, segment_ids=True),
    # Non-causal, T != S, several kv blocks: the persistent grid's tile counter.
    ValueCase(C(batch=2, seq_q=384, seq_k=520, heads_q=3, heads_k=3, head_dim=192,
                dtype="bfloat16"), 128),
    # Deterministic: the backward on the kernels of H (v and dO padded), the forward the pair's.
    ValueCase(C(batch=2, seq_q=200, seq_k=300, heads_q=4, heads_k=2, head_dim=192,
                dtype="bfloat16", is_causal=True, kv_lens=(300, 150)), 128, deterministic=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("vc", PAIR_CASES, ids=[vc.id for vc in PAIR_CASES])
def test_cuda_value_head_dim_pairs(vc):
  """The PAIR_CASES on the CUDA kernels, differentiated (forward, lse, every gradient) and as an
  inference call (the 16-bit o straight from the forward), against the float32 reference by
  the FlashAttention rule. On Hopper the forward and the backward (not deterministic) take v
  (and dO) as they are (the pair's kernels), unless JAX_FLASH_CUDA_VALUE_HEAD_DIM=padded
  (test_cuda_value_head_dim_kernel_choices_on_hopper runs these so)."""
  padded = os.environ.get("JAX_FLASH_CUDA_VALUE_HEAD_DIM") == "padded"
  hopper = jax.devices("gpu")[0].compute_capability.startswith("9.")
  # (The backward of the pair is head dim 192's split kernel: not where 192 runs other kernels.)
  split_192 = (os.environ.get("JAX_FLASH_CUDA_HD192_BWD", "native") == "native"
               and os.environ.get("JAX_FLASH_CUDA_BACKWARD", "sm90ws") != "sm80")
  assert _registry.cuda_forward_takes_value_head_dim(192, 128) == (hopper and not padded)
  assert _registry.cuda_backward_takes_value_head_dim(192, 128, False) == (
      hopper and not padded and split_192)
  assert not _registry.cuda_backward_takes_value_head_dim(192, 128, True)
  check_score_variant(run(vc, "cuda"), *references(vc), _live(vc))
  q, k, v, _ = vc.inputs()
  out = jax.jit(functools.partial(jax_flash.dot_product_attention, implementation="cuda",
                                  **vc.options()))(q, k, v)
  check_score_variant_output(out, *references(vc), _live(vc))


@pytest.mark.gpu
def test_cuda_value_head_dim_kernel_choices_on_hopper():
  """The Hopper forward and backward of 192 / 128 (and the head dims that run at that pair) take
  v (and dO) as they are by default (gpu/tile_shapes.cuh ValueHeadDimShapes); the pair cases
  also pass on the forward's wide tiles with the TMA store (JAX_FLASH_CUDA_FORWARD=sm90ws_wide),
  with the backward padded where head dim 192's runs on 256's kernels
  (JAX_FLASH_CUDA_HD192_BWD=padded), and, with the padded cases, under
  JAX_FLASH_CUDA_VALUE_HEAD_DIM=padded (v zero-padded to H, as before session 30)."""
  from tests.test_cuda import _run_cuda_tests_on_hopper_with
  files = ("test_value_head_dim.py",)
  _run_cuda_tests_on_hopper_with({"JAX_FLASH_CUDA_FORWARD": "sm90ws_wide"},
                                 "test_cuda_value_head_dim_pairs", files=files)
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_VALUE_HEAD_DIM": "padded"},
      "test_cuda_value_head_dim_pairs or test_cuda_matches_padded_reference", files=files)
  # The backward padded where head dim 192's backward runs 256's kernels (the forward the pair's).
  _run_cuda_tests_on_hopper_with({"JAX_FLASH_CUDA_HD192_BWD": "padded"},
                                 "test_cuda_value_head_dim_pairs", files=files)


def test_cuda_paged_kernel_refuses_it(monkeypatch):
  monkeypatch.setattr(_dispatch, "_check_cuda_runs", lambda: None)
  q = jnp.ones((1, 1, 2, 64), jnp.bfloat16)
  kp, vp = jnp.ones((4, 8, 2, 64), jnp.bfloat16), jnp.ones((4, 8, 2, 32), jnp.bfloat16)
  table, lens = jnp.zeros((1, 4), jnp.int32), jnp.full((1,), 20, jnp.int32)
  with pytest.raises(NotImplementedError, match=_pattern(
      "'cuda' kernel", "no value head dim", "value_pages(4, 8, 2, 32) (Hv=32)", "'xla'")):
    jax_flash.paged_attention(q, kp, vp, table, lens, implementation="cuda")


def test_paged_shape_errors():
  q = jnp.ones((1, 1, 2, 64))
  kp, table, lens = jnp.ones((4, 8, 2, 64)), jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32)
  with pytest.raises(ValueError, match=r"value_pages must have the shape of key_pages but for the "
                                       r"head dim .*value_pages\(4, 8, 1, 32\)"):
    jax_flash.paged_attention(q, kp, jnp.ones((4, 8, 1, 32)), table, lens)
  with pytest.raises(ValueError, match=r"value head dim Hv=0"):
    jax_flash.paged_attention(q, kp, jnp.ones((4, 8, 2, 0)), table, lens)


# ---------------------------------------------------------------------------------------------
# The FFI handlers, called by name: every buffer's shape is checked with Hv


FFI_ERROR = jax.errors.JaxRuntimeError
B, T, S, N, K, H, HV = 2, 5, 7, 4, 2, 8, 12
NO_EXTRAS = dict(q_segment_ids=((0,), "int32"), kv_segment_ids=((0,), "int32"),
                 alibi_slopes=((0,), "float32"), block_mask=((0,), "bool"),
                 dropout_seeds=((0,), "uint32"), bias=((0,), "float32"), mask=((0,), "bool"))
ATTRIBUTES = dict(scale=0.5, is_causal=False, window_left=np.int64(-1), window_right=np.int64(-1),
                  segment_ids=False, logits_soft_cap=0.0, alibi=False, block_sparse=False,
                  dropout_rate=0.0, bias=False, mask=False)


def _operands(rng, shapes: dict):
  out = []
  for shape, dtype in shapes.values():
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
      out.append(jnp.full(shape, 3, dtype))
    else:
      out.append(jnp.asarray(rng.standard_normal(shape), dtype))
  return out


def _call(target, rng, operands: dict, outputs: dict, attributes: dict):
  call = jax.ffi.ffi_call(target, tuple(jax.ShapeDtypeStruct(s, jnp.dtype(d))
                                        for s, d in outputs.values()))
  return jax.block_until_ready(jax.jit(lambda *a: call(*a, **attributes))(
      *_operands(rng, operands)))


def _fwd(**change):
  operands = dict(q=((B, T, N, H), "float32"), k=((B, S, K, H), "float32"),
                  v=((B, S, K, HV), "float32"), q_lens=((B,), "int32"),
                  kv_lens=((B,), "int32"), **NO_EXTRAS)
  outputs = dict(o=((B, T, N, HV), "float32"), lse=((B, N, T), "float32"))
  for name, shape in change.items():
    table = operands if name in operands else outputs
    table[name] = (shape, table[name][1])
  return "jax_flash_cpu_fwd", operands, outputs, ATTRIBUTES


def _bwd(**change):
  splits = 1
  elements = _registry.cpu_dq_accum_elements(splits, B, T, N, H)
  operands = dict(q=((B, T, N, H), "float32"), k=((B, S, K, H), "float32"),
                  v=((B, S, K, HV), "float32"), o=((B, T, N, HV), "float32"),
                  lse=((B, N, T), "float32"), do=((B, T, N, HV), "float32"),
                  q_lens=((B,), "int32"), kv_lens=((B,), "int32"), **NO_EXTRAS)
  outputs = dict(dq=((B, T, N, H), "float32"), dk=((B, S, K, H), "float32"),
                 dv=((B, S, K, HV), "float32"), delta=((B, N, T), "float32"),
                 dq_accum=((elements,), "float32"), dbias=((0,), "float32"),
                 dbias_accum=((0,), "float32"))
  for name, shape in change.items():
    table = operands if name in operands else outputs
    table[name] = (shape, table[name][1])
  return ("jax_flash_cpu_bwd", operands, outputs,
          dict(ATTRIBUTES, dq_splits=np.int64(splits), deterministic=False))


def _decode_call(splits=2, **change):
  o_elements, lse_elements = (int(x) for x in _registry._native.decode_workspace_elements(
      splits, B, T, N, HV))
  operands = dict(q=((B, T, N, H), "float32"), k=((B, S, K, H), "float32"),
                  v=((B, S, K, HV), "float32"), q_lens=((B,), "int32"), kv_lens=((B,), "int32"))
  outputs = dict(o=((B, T, N, HV), "float32"), lse=((B, N, T), "float32"),
                 o_partial=((o_elements,), "float32"), lse_partial=((lse_elements,), "float32"))
  for name, shape in change.items():
    table = operands if name in operands else outputs
    table[name] = (shape, table[name][1])
  return ("jax_flash_cpu_decode", operands, outputs,
          dict(scale=0.5, is_causal=False, window_left=np.int64(-1), window_right=np.int64(-1),
               num_splits=np.int64(splits)))


@pytest.mark.parametrize("make", [_fwd, _bwd, _decode_call], ids=["fwd", "bwd", "decode"])
def test_ffi_calls_with_their_own_value_head_dim_run(rng, make):
  target, operands, outputs, attributes = make()
  results = _call(target, rng, operands, outputs, attributes)
  for name, x in zip(outputs, results):
    if name != "lse_partial":  # -inf where a chunk holds none of a row's keys
      assert np.isfinite(np.asarray(x)).all(), name


FFI_ERRORS = [
    # (id, the call, fragments of the message)
    ("fwd_o_with_h", _fwd(o=(B, T, N, H)), ("o(2, 5, 4, 8) float32", "must match",
                                            "q(2, 5, 4, 8)", "Hv=12")),
    ("fwd_v_heads", _fwd(v=(B, S, N, HV)), ("k and v shapes differ", "v(2, 7, 4, 12)")),
    ("fwd_v_length", _fwd(v=(B, S + 1, K, HV)), ("k and v shapes differ", "v(2, 8, 2, 12)")),
    ("fwd_hv_300", _fwd(v=(B, S, K, 300), o=(B, T, N, 300)), ("Hv=300", "1..256")),
    ("fwd_hv_0", _fwd(v=(B, S, K, 0), o=(B, T, N, 0)), ("Hv=0", "1..256")),
    ("bwd_o_with_h", _bwd(o=(B, T, N, H)), ("o(2, 5, 4, 8) float32", "must match", "Hv=12")),
    ("bwd_do_with_h", _bwd(do=(B, T, N, H)), ("do(2, 5, 4, 8) float32", "must match", "Hv=12")),
    ("bwd_dv_with_h", _bwd(dv=(B, S, K, H)), ("dv(2, 7, 2, 8) float32", "must match",
                                              "v(2, 7, 2, 12)")),
    ("bwd_dq_with_hv", _bwd(dq=(B, T, N, HV)), ("dq(2, 5, 4, 12) float32", "must match",
                                                "q(2, 5, 4, 8)")),
    ("bwd_dk_with_hv", _bwd(dk=(B, S, K, HV)), ("dk(2, 7, 2, 12) float32", "must match",
                                                "k(2, 7, 2, 8)")),
    ("decode_o_with_h", _decode_call(o=(B, T, N, H)), ("o(2, 5, 4, 8) float32", "must match")),
    ("decode_o_partial_with_h", _decode_call(
        o_partial=(int(2 * B * N * T * H),)), ("o_partial(", f"expected {2 * B * N * T * HV}")),
]


@pytest.mark.parametrize("call,fragments", [e[1:] for e in FFI_ERRORS],
                         ids=[e[0] for e in FFI_ERRORS])
def test_ffi_errors(rng, call, fragments):
  with pytest.raises(FFI_ERROR, match=_pattern("INVALID_ARGUMENT", "jax_flash", *fragments)):
    _call(call[0], rng, *call[1:])


def test_ffi_paged_checks_the_value_pages(rng):
  splits = 1
  o_elements, lse_elements = (int(x) for x in _registry._native.decode_workspace_elements(
      splits, B, 1, N, HV))
  operands = dict(q=((B, 1, N, H), "float32"), key_pages=((6, 4, K, H), "float32"),
                  value_pages=((6, 4, K, HV), "float32"), page_table=((B, 3), "int32"),
                  kv_lens=((B,), "int32"))
  outputs = dict(o=((B, 1, N, HV), "float32"), lse=((B, N, 1), "float32"),
                 o_partial=((o_elements,), "float32"), lse_partial=((lse_elements,), "float32"))
  attributes = dict(scale=0.5, is_causal=False, window_left=np.int64(-1),
                    window_right=np.int64(-1), num_splits=np.int64(splits))
  _call("jax_flash_cpu_paged", rng, operands, outputs, attributes)  # valid as built
  bad = dict(operands, value_pages=((6, 5, K, HV), "float32"))
  with pytest.raises(FFI_ERROR, match=_pattern("key_pages and value_pages shapes differ",
                                               "value_pages(6, 5, 2, 12)")):
    _call("jax_flash_cpu_paged", rng, bad, outputs, attributes)
  with pytest.raises(FFI_ERROR, match=_pattern("o(2, 1, 4, 8)", "must match", "Hv=12")):
    _call("jax_flash_cpu_paged", rng, operands, dict(outputs, o=((B, 1, N, H), "float32")),
          attributes)


@pytest.mark.gpu
def test_cuda_handler_refuses_it(rng):
  """The CUDA forward handler takes Hv != H only where a kernel of the pair runs it (never for
  16 / 8), whoever calls it. The call is the CUDA validation suite's valid one (every operand
  the handler takes), reshaped."""
  call = with_shapes(cuda_valid_fwd(), (B, T, N, 16), (B, S, K, 16))
  for name, shape in (("v", (B, S, K, 8)), ("o", (B, T, N, 8))):
    with_shape(call, name, shape)
  with pytest.raises(FFI_ERROR, match=_pattern("Hv=8 differs", "H=16",
                                               "JF_SM90_FWD_VALUE_HEAD_DIMS", "pad v to H")):
    call.run(rng)


@pytest.mark.gpu
def test_cuda_backward_handler_refuses_deterministic_pairs(rng):
  """The CUDA backward handler takes Hv != H only where a backward kernel of the pair runs it:
  never deterministic (the deterministic dQ kernel has one head dim), whoever calls it."""
  call = with_shapes(cuda_valid_bwd(deterministic=True), (B, T, N, 192), (B, S, K, 192))
  for name, shape in (("v", (B, S, K, 128)), ("dv", (B, S, K, 128)), ("do", (B, T, N, 128)),
                      ("dq_accum", (0,))):
    with_shape(call, name, shape)
  with pytest.raises(FFI_ERROR, match=_pattern("Hv=128 differs", "H=192", "no CUDA backward",
                                               "JF_SM90_BWD_VALUE_HEAD_DIMS", "not deterministic",
                                               "pad v and do to H")):
    call.run(rng)
