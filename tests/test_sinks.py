"""Attention sinks (gpt-oss, issue 17 item 2): ``sinks`` (N,), one logit per query head that
joins every row's softmax denominator without a value:
p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)), lse including the sink.

Each path ("cpu" kernel, "blockwise", "xla") is checked against a float32 reference written here
from that definition (jax.nn.softmax over the scores with the sink as one more column, its
probability dropped; differentiated by JAX), by the FlashAttention rule of
tests/attention_testing.py: max error <= 2x the error of the same reference with the input dtype's
rounding, plus the tiny floor. Forward, lse and dq, dk, dv and dsinks, alone and with causal,
windows, lengths (empty rows: 0 output, lse = the sink), GQA, T != S, soft cap, segment ids,
decode shapes, unbatched inputs; then the errors, the CUDA kernels (GPU tests) and sharded
calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _dispatch
from tests.attention_testing import (F32, HIGHEST, Case, assert_within_rule, gradient_magnitude,
                                     packed_segment_ids, rounded, visible_keys)

IMPLEMENTATIONS = ["cpu", "blockwise", "xla"]


@dataclasses.dataclass(frozen=True)
class SinkCase:
  case: Case
  sink_mean: float = 0.0  # the sinks are this plus standard normal draws
  cap: float | None = None
  segment_ids: bool = False  # documents of random lengths, sorted by position
  sink_dtype: str = "float32"

  @property
  def id(self) -> str:
    return (f"{self.case.id}_sink{self.sink_mean}" + (f"_cap{self.cap}" if self.cap else "")
            + ("_ids" if self.segment_ids else "") + f"_{self.sink_dtype}")

  def inputs(self):
    q, k, v, g = self.case.inputs()
    rng = np.random.default_rng(self.case.seed + 7)
    sinks = self.sink_mean + rng.standard_normal(self.case.heads_q)
    return q, k, v, g, jnp.asarray(sinks, self.sink_dtype), self.ids()

  def ids(self):
    return packed_segment_ids(self.case) if self.segment_ids else None

  def visible(self) -> np.ndarray:
    """(B, T, S) bool."""
    return visible_keys(self.case, self.ids())


def sink_attention(q, k, v, sinks, vis, *, scale, cap=None, dtype=None):
  """(out, lse (..., T, N)) of attention with sinks on float32 inputs, from the definition:
  s = scale * q.k (capped: cap * tanh(s / cap)), masked, the sink appended as one more column,
  softmax, the sink's column dropped. With `dtype` (16-bit) the scores and probabilities are
  rounded to it. `vis` (B, T, S) bool; a row with no visible key gives 0 and lse = its sink."""
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  batch, seq_q, heads_q, head_dim = q.shape
  heads_k = k.shape[2]
  group = heads_q // heads_k
  rnd = (lambda x: x) if dtype is None else functools.partial(rounded, dtype=dtype)
  q5 = q.reshape(batch, seq_q, heads_k, group, head_dim)
  s = rnd(jnp.einsum("btkgh,bskh->bkgts", q5, k, precision=HIGHEST) * scale)
  if cap is not None:
    s = rnd(cap * jnp.tanh(s / cap))
  vis = jnp.asarray(vis)[:, None, None]
  s = jnp.where(vis, s, -jnp.inf)
  column = jnp.broadcast_to(sinks.astype(F32).reshape(1, heads_k, group, 1, 1),
                            (batch, heads_k, group, seq_q, 1))
  full = jnp.concatenate([s, column], axis=-1)
  p = rnd(jax.nn.softmax(full, axis=-1)[..., :-1])
  out = jnp.einsum("bkgts,bskh->btkgh", p, v, precision=HIGHEST).reshape(q.shape)
  lse = jax.nn.logsumexp(full, axis=-1)
  lse = jnp.moveaxis(lse.reshape(batch, heads_q, seq_q), -1, -2)
  if unbatched:
    out, lse = out[0], lse[0]
  return out, lse


def _results(attention, q, k, v, sinks, g):
  def loss(q, k, v, sinks):
    out, lse = attention(q, k, v, sinks)
    return jnp.sum(out.astype(F32) * g), (out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
  names = dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv", "dsinks"), grads)))
  return {n: np.asarray(jnp.asarray(x, F32), np.float64) for n, x in names.items()}


def _scale(sc: SinkCase) -> float:
  return sc.case.scale if sc.case.scale is not None else 1.0 / np.sqrt(sc.case.head_dim)


@functools.lru_cache(maxsize=16)
def references(sc: SinkCase):
  q, k, v, g, sinks, _ = sc.inputs()
  upcast = [x.astype(F32) for x in (q, k, v)]
  f32 = functools.partial(sink_attention, vis=sc.visible(), scale=_scale(sc), cap=sc.cap)
  ref32 = _results(jax.jit(f32), *upcast, sinks.astype(F32), g)
  if sc.case.dtype == "float32":
    return ref32, ref32
  refd = _results(jax.jit(functools.partial(f32, dtype=sc.case.jdtype)), *upcast,
                  sinks.astype(F32), g)
  return ref32, refd


def run(sc: SinkCase, implementation: str):
  q, k, v, g, sinks, ids = sc.inputs()
  opts = sc.case.options()
  if ids is not None:
    opts.update(q_segment_ids=ids, kv_segment_ids=ids)

  def attention(q, k, v, sinks):
    return jax_flash.dot_product_attention(
        q, k, v, implementation=implementation, return_residual=True, sinks=sinks,
        logits_soft_cap=sc.cap, **opts)

  got = _results(jax.jit(attention), q, k, v, sinks, g)
  return got


def check(sc: SinkCase, got: dict):
  ref32, refd = references(sc)
  for name, x in got.items():
    assert np.all(np.isfinite(x)), name
  live = sc.visible().any(-1)
  live = live[0] if sc.case.rank3 else live
  assert_within_rule("out", got["out"], ref32["out"], refd["out"])
  assert_within_rule("lse", got["lse"], ref32["lse"], refd["lse"])
  for name in ("dq", "dk", "dv"):
    assert_within_rule(name, got[name], ref32[name], refd[name],
                       magnitude=gradient_magnitude(ref32))
  assert_within_rule("dsinks", got["dsinks"], ref32["dsinks"], refd["dsinks"])
  # Rows with no visible key: 0 output and dq, lse the sink's alone.
  dead = np.broadcast_to(~live[..., None, None], got["out"].shape)
  assert np.all(got["out"][dead] == 0) and np.all(got["dq"][dead] == 0)
  sinks = np.asarray(sc.inputs()[4].astype(F32), np.float64)
  lse_dead = np.broadcast_to(~live[..., None], got["lse"].shape)
  np.testing.assert_array_equal(got["lse"][lse_dead],
                                np.broadcast_to(sinks, got["lse"].shape)[lse_dead])


CASES = [
    # Alone (no mask), with GQA and T != S; sinks of the scores' size, so they matter.
    SinkCase(Case(batch=2, seq_q=50, seq_k=70, heads_q=4, heads_k=2, head_dim=40), sink_mean=3.0),
    # Several tiles of the CPU kernel both ways, causal, GQA 4:1, T != S, bf16, sinks that
    # dominate the first rows.
    SinkCase(Case(batch=1, seq_q=130, seq_k=200, heads_q=4, heads_k=1, head_dim=64,
                  dtype="bfloat16", is_causal=True), sink_mean=2.0, sink_dtype="bfloat16"),
    # A window and lengths, one batch element with no keys (empty rows: lse = sink), a
    # negative scale, with the soft cap.
    SinkCase(Case(batch=2, seq_q=65, seq_k=80, heads_q=2, heads_k=2, head_dim=24,
                  local_window_size=(8, 3), q_lens=(60, 65), kv_lens=(0, 77), scale=-0.3),
             cap=1.5),
    SinkCase(Case(batch=2, seq_q=80, seq_k=80, heads_q=2, heads_k=1, head_dim=16,
                  is_causal=True), segment_ids=True, sink_mean=-1.0),
    SinkCase(Case(batch=1, seq_q=33, seq_k=48, heads_q=2, heads_k=2, head_dim=32,
                  dtype="float16", rank3=True), cap=3.0),
    # A decode shape: the CPU runs the split-KV decode kernel, the sink joins its result.
    SinkCase(Case(batch=2, seq_q=1, seq_k=300, heads_q=8, heads_k=2, head_dim=32,
                  kv_lens=(300, 123)), sink_mean=3.0),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("sc", CASES, ids=[c.id for c in CASES])
def test_against_reference(sc, implementation):
  check(sc, run(sc, implementation))


def test_the_sinks_change_the_result():
  """The cases above would pass vacuously if the sinks had no effect: they do, and a very
  negative sink is no sink."""
  sc = CASES[0]
  q, k, v, _, sinks, _ = sc.inputs()
  plain = jax_flash.dot_product_attention(q, k, v, implementation="cpu", return_residual=True)
  with_sinks = jax_flash.dot_product_attention(q, k, v, implementation="cpu", sinks=sinks,
                                               return_residual=True)
  assert np.max(np.abs(np.asarray(plain[0] - with_sinks[0]))) > 0.05
  assert np.all(np.asarray(with_sinks[1]) > np.asarray(plain[1]))
  far = jax_flash.dot_product_attention(q, k, v, implementation="cpu",
                                        sinks=jnp.full((4,), -1e4), return_residual=True)
  np.testing.assert_allclose(far[0], plain[0], atol=1e-6)
  np.testing.assert_allclose(far[1], plain[1], atol=1e-6)


def test_no_keys_at_all():
  """S = 0: every row is empty: 0 output, lse the sink, zero gradients."""
  q = jnp.ones((2, 5, 4, 8))
  kv = jnp.ones((2, 0, 2, 8))
  sinks = jnp.arange(4.0)
  for implementation in IMPLEMENTATIONS:
    f = lambda q, sinks: jax_flash.dot_product_attention(
        q, kv, kv, sinks=sinks, implementation=implementation, return_residual=True)
    out, lse = f(q, sinks)
    assert np.all(np.asarray(out) == 0)
    np.testing.assert_array_equal(lse, np.broadcast_to(np.arange(4.0), (2, 5, 4)))
    dsinks = jax.grad(lambda s: f(q, s)[0].sum())(sinks)
    np.testing.assert_array_equal(dsinks, np.zeros(4))


@pytest.mark.parametrize("sinks, match", [
    (jnp.zeros((3,)), r"sinks must have shape \(4,\).*query\(1, 6, 4, 8\).*sinks\(3,\)"),
    (jnp.zeros(()), r"sinks must have shape \(4,\).*got sinks\(\)"),
    (jnp.zeros((1, 4)), r"sinks must have shape \(4,\).*got sinks\(1, 4\)"),
    (jnp.zeros((4,), jnp.int32), r"sinks must be float32, bfloat16 or float16.*int32"),
    ("x", r"sinks must"),
])
def test_invalid_sinks_raise(sinks, match):
  q = jnp.ones((1, 6, 4, 8))
  kv = jnp.ones((1, 6, 2, 8))
  with pytest.raises(ValueError, match=match):
    jax_flash.dot_product_attention(q, kv, kv, sinks=sinks, implementation="cpu")


def test_cuda_kernels_take_the_sinks(monkeypatch):
  """Where None picks the CUDA kernels, a call with sinks runs on them (their float32 o and lse
  joined with the sinks in XLA, as on the CPU); what they still refuse is refused by name."""
  monkeypatch.setattr(_dispatch, "default_implementation", lambda dtype: "cuda")
  q = jnp.ones((2, 8, 2, 16), jnp.bfloat16)
  assert _dispatch.select(None, _dispatch.Call(q.shape, q.dtype, sinks=(2,))) == "cuda"
  assert _dispatch.select(None, _dispatch.Call(q.shape, q.dtype, sinks=(2,),
                                               segment_ids=((2, 8), (2, 8)))) == "cuda"
  with pytest.raises(NotImplementedError, match=r"'cuda' kernels .* take no dropout_rate"):
    _dispatch.select(None, _dispatch.Call(q.shape, q.dtype, sinks=(2,), dropout_rate=0.1))


# The CUDA kernels (16-bit inputs): GQA and T != S, causal
# across several tiles, a window with lengths and a batch element with no keys, a decode shape
# (which runs the tiled forward: its o can be float32 for the join) and a head dim of 128.
CUDA_CASES = [
    SinkCase(Case(batch=2, seq_q=50, seq_k=70, heads_q=4, heads_k=2, head_dim=40,
                  dtype="bfloat16"), sink_mean=3.0),
    CASES[1],
    SinkCase(Case(batch=2, seq_q=65, seq_k=80, heads_q=2, heads_k=2, head_dim=64,
                  dtype="float16", local_window_size=(8, 3), q_lens=(60, 65), kv_lens=(0, 77),
                  scale=-0.3), sink_dtype="float16"),
    SinkCase(Case(batch=2, seq_q=1, seq_k=300, heads_q=8, heads_k=2, head_dim=64,
                  dtype="bfloat16", kv_lens=(300, 123)), sink_mean=3.0),
    SinkCase(Case(batch=1, seq_q=200, seq_k=333, heads_q=4, heads_k=4, head_dim=128,
                  dtype="bfloat16", is_causal=True), sink_mean=1.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("sc", CUDA_CASES, ids=[c.id for c in CUDA_CASES])
def test_cuda_against_reference(sc):
  check(sc, run(sc, "cuda"))


def test_vmap():
  sc = CASES[0]
  q, k, v, _, sinks, _ = sc.inputs()
  f = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, sinks=sinks, implementation="cpu")
  np.testing.assert_allclose(jax.vmap(f)(q[:, None], k[:, None], v[:, None])[:, 0], f(q, k, v),
                             atol=1e-6)


@pytest.mark.parametrize("spec", ["batch", "heads"])
def test_batch_and_head_sharding_carry_the_sinks(spec):
  from jax.sharding import NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  sc = CASES[0]
  q, k, v, _, sinks, _ = sc.inputs()
  mesh = jax.make_mesh((2,), ("x",))
  sharding = NamedSharding(mesh, P("x") if spec == "batch" else P(None, None, "x", None))
  qs, ks, vs = (jax.device_put(x, sharding) for x in (q, k, v))
  ss = jax.device_put(sinks, NamedSharding(mesh, P("x") if spec == "heads" else P()))

  def fg(q, k, v, s):
    return jax.value_and_grad(lambda *a: (jax_flash.dot_product_attention(
        *a[:3], sinks=a[3], is_causal=True, implementation="cpu") ** 2).sum(), (0, 1, 2, 3))(
            q, k, v, s)

  want, want_g = fg(q, k, v, sinks)
  got, got_g = jax.jit(fg)(qs, ks, vs, ss)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(got_g, want_g):
    np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("strategy", ["ring:zigzag", "all_to_all", "all_gather"])
def test_sequence_sharding_carries_the_sinks(strategy):
  """The sink joins the rows' global (o, lse) outside the kernels' partitioned ops: sequence-
  sharded calls give the single-device output and gradients, dsinks included."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  ks = jax.random.split(jax.random.key(3), 4)
  q, k, v = (jax.random.normal(x, (2, 128, 4, 32)) for x in ks[:3])
  sinks = jax.random.normal(ks[3], (4,))

  def f(q, k, v, s, **cp):
    return jax_flash.dot_product_attention(q, k, v, is_causal=True, sinks=s,
                                           implementation="cpu", **cp)

  def fg(**cp):
    return jax.jit(jax.value_and_grad(lambda *a: (f(*a, **cp) ** 2).sum(), (0, 1, 2, 3)))

  want, want_g = fg()(q, k, v, sinks)
  mesh = jax.make_mesh((4,), ("x",))
  sharded = [jax.device_put(x, NamedSharding(mesh, P(None, "x", None, None))) for x in (q, k, v)]
  got, got_g = fg(context_parallel=strategy)(*sharded, sinks)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(got_g, want_g):
    np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("seed, alibi", [(0, False), (1, False), (2, False), (3, False),
                                         (4, True), (5, True)])
def test_random_shapes_against_xla(seed, alibi):
  """A small sweep: random shapes, masks, GQA, cap and sinks, and ALiBi slopes in the last two;
  "cpu" and "blockwise" against "xla" (itself checked against the definition above), forward
  and every gradient."""
  rng = np.random.default_rng(100 + seed)
  heads_k = int(rng.choice([1, 2]))
  heads_q = heads_k * int(rng.choice([1, 3]))
  seq_q, seq_k = (int(x) for x in rng.integers(1, 40, size=2))
  batch = int(rng.integers(1, 3))
  opts = dict(is_causal=bool(rng.integers(2)),
              logits_soft_cap=[None, 2.0][int(rng.integers(2))],
              local_window_size=[None, (int(rng.integers(0, 9)), int(rng.integers(0, 9)))][
                  int(rng.integers(2))],
              key_value_seq_lengths=jnp.asarray(rng.integers(0, seq_k + 1, size=batch),
                                                jnp.int32))
  q = jnp.asarray(rng.standard_normal((batch, seq_q, heads_q, 16)), F32)
  k = jnp.asarray(rng.standard_normal((batch, seq_k, heads_k, 16)), F32)
  v = jnp.asarray(rng.standard_normal((batch, seq_k, heads_k, 16)), F32)
  sinks = jnp.asarray(rng.standard_normal(heads_q) * 2, F32)
  g = jnp.asarray(rng.standard_normal(q.shape), F32)
  if alibi:
    opts["alibi_slopes"] = jnp.asarray(rng.standard_normal(heads_q) * 0.2, F32)

  def results(implementation):
    def loss(q, k, v, s):
      out, lse = jax_flash.dot_product_attention(q, k, v, sinks=s, return_residual=True,
                                                 implementation=implementation, **opts)
      return jnp.sum(out * g), (out, lse)
    (_, aux), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v,
                                                                                     sinks)
    return [*aux, *grads]

  want = results("xla")
  for implementation in ("cpu", "blockwise"):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), results(implementation),
                          want):
      np.testing.assert_allclose(a, b, atol=5e-5 if alibi else 2e-5, rtol=2e-5,
                                 err_msg=f"{implementation} {name}")


def test_flax_function_takes_the_sinks():
  """jax_flash.flax.dot_product_attention passes sinks through (any number of batch dims) and
  differentiates them as the core call does."""
  pytest.importorskip("flax")
  import jax_flash.flax as jf

  sc = CASES[0]
  q, k, v, _, sinks, _ = sc.inputs()
  f = lambda s: jf.dot_product_attention(q[None], k[None], v[None], sinks=s, is_causal=True)[0]
  want = lambda s: jax_flash.dot_product_attention(q, k, v, sinks=s, is_causal=True)
  np.testing.assert_allclose(f(sinks), want(sinks), atol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda s: f(s).sum())(sinks),
                             jax.grad(lambda s: want(s).sum())(sinks), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
    jf.dot_product_attention(q, k, v, sinks=jnp.zeros((2,)))
