"""Logit soft-capping (Gemma 2, issue 17 item 1): ``logits_soft_cap=c`` turns every score
s = scale * q.k into c * tanh(s / c) before the masks and the softmax.

Each path ("cpu" kernel, "blockwise", "xla") is checked against a float32 reference written here
from that definition (plain jax.numpy, differentiated by JAX), by the FlashAttention rule of
tests/attention_testing.py: max error <= 2x the error of the same reference with the input dtype's
rounding, plus the tiny floor. Forward, lse and dq, dk, dv, alone and with causal, windows,
lengths, GQA, T != S, segment ids, unbatched inputs; then the limits (a huge c is no cap, a tiny
one saturates), the errors and the CUDA kernels (GPU tests).
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
from tests.attention_testing import (Case, F32, check_score_variant, check_score_variant_output,
                                     outputs_and_grads, packed_segment_ids, score_variant_references,
                                     visible_keys)

IMPLEMENTATIONS = ["cpu", "blockwise", "xla"]


@dataclasses.dataclass(frozen=True)
class CapCase:
  case: Case
  cap: float
  segment_ids: bool = False  # documents of random lengths, sorted by position
  q_gain: float = 1.0  # q multiplied by this: larger scores, so the cap matters more

  @property
  def id(self) -> str:
    return f"{self.case.id}_cap{self.cap}" + ("_ids" if self.segment_ids else "") + (
        f"_gain{self.q_gain}" if self.q_gain != 1.0 else "")

  def inputs(self):
    q, k, v, g = self.case.inputs()
    q = (q.astype(F32) * self.q_gain).astype(q.dtype)
    return q, k, v, g, self.ids()

  def ids(self):
    return packed_segment_ids(self.case) if self.segment_ids else None

  def visible(self) -> np.ndarray:
    """(B, T, S) bool."""
    return visible_keys(self.case, self.ids())


def _live(cc: CapCase) -> np.ndarray:
  live = cc.visible().any(-1)
  return live[0] if cc.case.rank3 else live


@functools.lru_cache(maxsize=16)
def references(cc: CapCase):
  q, k, v, g, _ = cc.inputs()
  return score_variant_references(cc.case, (q, k, v, g), cc.visible(), cap=cc.cap)


def run(cc: CapCase, implementation: str, cap=None):
  q, k, v, g, ids = cc.inputs()
  opts = cc.case.options()
  if ids is not None:
    opts.update(q_segment_ids=ids, kv_segment_ids=ids)

  def attention(q, k, v):
    return jax_flash.dot_product_attention(
        q, k, v, implementation=implementation, return_residual=True,
        logits_soft_cap=cc.cap if cap is None else cap, **opts)

  return outputs_and_grads(attention, q, k, v, g)


def check(cc: CapCase, got: dict):
  check_score_variant(got, *references(cc), _live(cc))


CASES = [
    # Alone (no mask), with GQA and T != S.
    CapCase(Case(batch=2, seq_q=70, seq_k=90, heads_q=4, heads_k=2, head_dim=40), cap=2.0,
            q_gain=3.0),
    # Several tiles of the CPU kernel both ways, causal, GQA 4:1, T != S, large scores.
    CapCase(Case(batch=1, seq_q=130, seq_k=200, heads_q=4, heads_k=1, head_dim=64,
                 dtype="bfloat16", is_causal=True), cap=5.0, q_gain=4.0),
    # A window and lengths, one batch element with no keys (empty rows), a negative scale.
    CapCase(Case(batch=2, seq_q=65, seq_k=80, heads_q=2, heads_k=2, head_dim=24,
                 local_window_size=(8, 3), q_lens=(60, 65), kv_lens=(0, 77), scale=-0.3),
            cap=1.5, q_gain=2.0),
    CapCase(Case(batch=2, seq_q=80, seq_k=80, heads_q=2, heads_k=1, head_dim=16,
                 is_causal=True), cap=1.5, segment_ids=True, q_gain=2.0),
    CapCase(Case(batch=1, seq_q=33, seq_k=48, heads_q=2, heads_k=2, head_dim=32,
                 dtype="float16", rank3=True), cap=3.0, q_gain=3.0),
    # A decode shape: the CPU runs it on the tiled kernel (split-KV takes no cap).
    CapCase(Case(batch=2, seq_q=1, seq_k=300, heads_q=8, heads_k=2, head_dim=32,
                 kv_lens=(300, 123)), cap=2.0, q_gain=3.0),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("cc", CASES, ids=[c.id for c in CASES])
def test_against_reference(cc, implementation):
  check(cc, run(cc, implementation))


def test_the_cap_changes_the_result():
  """The cases above would pass vacuously if the cap had no effect: it does."""
  cc = CASES[0]
  capped = run(cc, "cpu")
  q, k, v, _, _ = cc.inputs()
  plain = jax_flash.dot_product_attention(q, k, v, implementation="cpu", **cc.case.options())
  assert np.max(np.abs(np.asarray(plain) - capped["out"])) > 0.1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_large_cap_is_no_cap(implementation):
  case = Case(batch=1, seq_q=70, seq_k=70, heads_q=2, heads_k=2, head_dim=32, is_causal=True)
  q, k, v, _ = case.inputs()
  def call(**cap):
    return jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
        q, k, v, is_causal=True, implementation=implementation, return_residual=True,
        **cap))(q, k, v)

  (o_cap, l_cap), (o, l) = call(logits_soft_cap=1e30), call()
  if implementation == "cpu":  # tanh(u) / u is exactly 1 in float32 for tiny u: bit-identical
    np.testing.assert_array_equal(o_cap, o)
    np.testing.assert_array_equal(l_cap, l)
  else:
    np.testing.assert_allclose(o_cap, o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(l_cap, l, rtol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_small_cap_saturates(implementation):
  """Every capped score lies in [-c, c]: with huge scores and a tiny c the lse of each row is
  within c of log(visible keys), attention is nearly uniform, and gradients stay finite."""
  case = Case(batch=1, seq_q=40, seq_k=40, heads_q=2, heads_k=2, head_dim=16, is_causal=True)
  q, k, v, _ = case.inputs()
  q = q * 1e3
  c = 1e-3

  def f(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=c,
                                           implementation=implementation, return_residual=True)

  out, lse = jax.jit(f)(q, k, v)
  n = np.arange(1, 41)[:, None]  # keys row i sees
  assert np.all(np.abs(np.asarray(lse) - np.log(n)) <= c + 1e-5)
  uniform = np.cumsum(np.asarray(v), axis=1) / n[None, :, :, None]  # mean of visible values
  np.testing.assert_allclose(out, uniform, atol=1e-2)
  grads = jax.jit(jax.grad(lambda *a: f(*a)[0].sum(), (0, 1, 2)))(q, k, v)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan"), float("inf"), 1e39, 3e38, 1e-40,
                                 "2.0", True, [1.0]])
def test_invalid_caps_raise(cap):
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="logits_soft_cap"):
    jax_flash.dot_product_attention(q, q, q, logits_soft_cap=cap, implementation="cpu")


def test_traced_cap_raises():
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="logits_soft_cap must be a positive Python float"):
    jax.jit(lambda c: jax_flash.dot_product_attention(q, q, q, logits_soft_cap=c))(1.0)


def test_ints_and_numpy_floats_are_taken():
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 4, 2, 8)), jnp.float32)
  a = jax_flash.dot_product_attention(q, q, q, logits_soft_cap=2, implementation="cpu")
  b = jax_flash.dot_product_attention(q, q, q, logits_soft_cap=np.float32(2.0),
                                      implementation="cpu")
  np.testing.assert_array_equal(a, b)


def test_cuda_kernels_take_the_cap(monkeypatch):
  """A capped call where None picks CUDA runs on the CUDA kernels (their kGeneral
  instantiations), and the op layer passes the cap to them as an attribute."""
  monkeypatch.setattr(_dispatch, "default_implementation", lambda dtype: "cuda")
  q = jnp.ones((2, 8, 2, 16), jnp.bfloat16)
  assert _dispatch.select(None, _dispatch.Call(q.shape, q.dtype, logits_soft_cap=30.0)) == "cuda"
  assert _dispatch.capabilities("cuda").logits_soft_cap


# The CUDA kernels (16-bit inputs): the CPU cases' shapes in bf16/f16 (without segment ids),
# and head dims that take the Hopper kernels (64, 128), the backward whose warpgroups split
# head dims 192 and 256 (sm90/traits.cuh kSplitHeadDim).
CUDA_CASES = [
    CapCase(Case(batch=2, seq_q=70, seq_k=90, heads_q=4, heads_k=2, head_dim=40,
                 dtype="bfloat16"), cap=2.0, q_gain=3.0),
    CASES[1],
    CapCase(Case(batch=2, seq_q=65, seq_k=80, heads_q=2, heads_k=2, head_dim=24,
                 dtype="float16", local_window_size=(8, 3), q_lens=(60, 65), kv_lens=(0, 77),
                 scale=-0.3), cap=1.5, q_gain=2.0),
    CapCase(Case(batch=2, seq_q=1, seq_k=300, heads_q=8, heads_k=2, head_dim=32,
                 dtype="bfloat16", kv_lens=(300, 123)), cap=2.0, q_gain=3.0),
    CapCase(Case(batch=1, seq_q=200, seq_k=333, heads_q=4, heads_k=4, head_dim=128,
                 dtype="bfloat16", is_causal=True), cap=4.0, q_gain=4.0),
    CapCase(Case(batch=1, seq_q=100, seq_k=140, heads_q=2, heads_k=1, head_dim=256,
                 dtype="bfloat16"), cap=3.0, q_gain=4.0),
    CapCase(Case(batch=1, seq_q=150, seq_k=130, heads_q=4, heads_k=2, head_dim=192,
                 dtype="float16", is_causal=True), cap=3.0, q_gain=4.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cc", CUDA_CASES, ids=[c.id for c in CUDA_CASES])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_cuda_against_reference(cc, deterministic):
  if deterministic and cc is not CUDA_CASES[1]:
    pytest.skip("deterministic: one case")
  q, k, v, g, _ = cc.inputs()
  attention = lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, implementation="cuda", return_residual=True, logits_soft_cap=cc.cap,
      deterministic=deterministic, **cc.case.options())
  check(cc, outputs_and_grads(attention, q, k, v, g))


@pytest.mark.gpu
@pytest.mark.parametrize("cc", [c for c in CUDA_CASES if c.case.head_dim in (64, 128)],
                         ids=[c.id for c in CUDA_CASES if c.case.head_dim in (64, 128)])
def test_cuda_inference_forward_against_reference(cc):
  """The capped inference forward (no residual: a 16-bit o stored by TMA on Hopper at head dims
  64 and 128) within the rule; rows without keys exactly 0."""
  q, k, v, _, _ = cc.inputs()
  out = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, implementation="cuda", logits_soft_cap=cc.cap, **cc.case.options()))(q, k, v)
  ref32, refd = references(cc)
  check_score_variant_output(out, ref32, refd, _live(cc))


def test_flax_module_and_attention_fn():
  """The Flax modules take the cap (NNX: constructor argument; Linen: attribute) and give what
  the core call gives on the same projections."""
  nnx = pytest.importorskip("flax.nnx")
  import jax_flash.flax as jf

  x = jax.random.normal(jax.random.key(0), (2, 24, 32))
  capped = jf.FlashMultiHeadAttention(4, 32, is_causal=True, logits_soft_cap=0.5, decode=False,
                                      rngs=nnx.Rngs(0))
  plain = jf.FlashMultiHeadAttention(4, 32, is_causal=True, decode=False, rngs=nnx.Rngs(0))
  assert np.max(np.abs(np.asarray(capped(x) - plain(x)))) > 1e-3
  fn = jf.make_attention_fn(is_causal=True, logits_soft_cap=0.5)
  q = jnp.einsum("btf,fnh->btnh", x, capped.query.kernel[...]) + capped.query.bias[...]
  k = jnp.einsum("btf,fnh->btnh", x, capped.key.kernel[...]) + capped.key.bias[...]
  v = jnp.einsum("btf,fnh->btnh", x, capped.value.kernel[...]) + capped.value.bias[...]
  np.testing.assert_allclose(
      fn(q, k, v), jax_flash.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=0.5),
      rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="logits_soft_cap"):
    jf.make_attention_fn(logits_soft_cap=0.0)

  linen = jf.FlashMultiHeadDotProductAttention(num_heads=4, is_causal=True, logits_soft_cap=0.5)
  variables = linen.init(jax.random.key(1), x)
  out = linen.apply(variables, x)
  plain_out = jf.FlashMultiHeadDotProductAttention(num_heads=4, is_causal=True).apply(variables, x)
  assert out.shape == x.shape and np.max(np.abs(np.asarray(out - plain_out))) > 1e-3


@pytest.mark.parametrize("spec", ["batch", "heads"])
def test_batch_and_head_sharding_carry_the_cap(spec):
  from jax.sharding import NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  cc = CASES[0]
  q, k, v, g, _ = cc.inputs()
  mesh = jax.make_mesh((2,), ("x",))
  sharding = NamedSharding(mesh, P("x") if spec == "batch" else P(None, None, "x", None))
  q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))
  f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, is_causal=True, logits_soft_cap=cc.cap, implementation="cpu"))
  want = jax_flash.dot_product_attention(*cc.inputs()[:3], is_causal=True,
                                         logits_soft_cap=cc.cap, implementation="cpu")
  np.testing.assert_allclose(f(q, k, v), want, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ring:zigzag", "all_to_all", "all_gather"])
def test_sequence_sharding_carries_the_cap(strategy):
  """Context parallelism runs the kernels on slices with the call's KernelConfig, cap included:
  the same output and gradients as the single-device call."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  ks = jax.random.split(jax.random.key(3), 3)
  q, k, v = (jax.random.normal(x, (2, 128, 4, 32)) * 2 for x in ks)

  def f(q, k, v, **cp):
    return jax_flash.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=1.5,
                                           implementation="cpu", **cp)

  def fg(**cp):
    return jax.jit(jax.value_and_grad(lambda *a: (f(*a, **cp) ** 2).sum(), (0, 1, 2)))

  want, want_g = fg()(q, k, v)
  mesh = jax.make_mesh((4,), ("x",))
  sharded = [jax.device_put(x, NamedSharding(mesh, P(None, "x", None, None))) for x in (q, k, v)]
  got, got_g = fg(context_parallel=strategy)(*sharded)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(got_g, want_g):
    np.testing.assert_allclose(a, b, atol=2e-5)
