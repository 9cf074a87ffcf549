"""ALiBi (issue 17 item 3): ``alibi_slopes`` (N,), one slope per query head; the score of query
i and key j becomes s_ij + slope_h * (j - i), with i and j the positions the causal mask
compares (row and key indices, top-left aligned), after the soft cap, before masks and softmax.

Each path ("cpu" kernel, "blockwise", "xla") is checked against a float32 reference written here
that materialises the (T, S) bias (plain jax.numpy, differentiated by JAX), by the FlashAttention
rule of tests/attention_testing.py: max error <= 2x the error of the same reference with the input
dtype's rounding, plus the tiny floor. Forward, lse and dq, dk, dv, alone and with causal,
windows, lengths, GQA, T != S, soft cap, segment ids, decode shapes, unbatched inputs; then the
position convention in closed form, the slopes' zero gradient, the errors, the CUDA kernels
(GPU tests), vmap, batch-, head- and sequence-sharded calls (each context-parallel strategy) and the Flax
function.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _dispatch, _ops
from jax_flash._reference import EMPTY_ROW_LSE
from tests.attention_testing import (Case, F32, check_score_variant, check_score_variant_output,
                                     outputs_and_grads, packed_segment_ids, score_variant_references,
                                     visible_keys)

IMPLEMENTATIONS = ["cpu", "blockwise", "xla"]


def geometric_slopes(heads: int) -> np.ndarray:
  """The ALiBi paper's slopes: 2^(-8 (h + 1) / N)."""
  return 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)


@dataclasses.dataclass(frozen=True)
class AlibiCase:
  case: Case
  slopes: str = "geometric"  # or "mixed": random slopes of both signs
  cap: float | None = None
  segment_ids: bool = False  # documents of random lengths, sorted by position

  @property
  def id(self) -> str:
    return (f"{self.case.id}_{self.slopes}" + (f"_cap{self.cap}" if self.cap else "")
            + ("_ids" if self.segment_ids else ""))

  def slope_values(self) -> jax.Array:
    if self.slopes == "geometric":
      return jnp.asarray(geometric_slopes(self.case.heads_q), F32)
    rng = np.random.default_rng(self.case.seed + 11)
    return jnp.asarray(rng.standard_normal(self.case.heads_q) * 0.3, F32)

  def inputs(self):
    q, k, v, g = self.case.inputs()
    return q, k, v, g, self.slope_values(), self.ids()

  def ids(self):
    return packed_segment_ids(self.case) if self.segment_ids else None

  def visible(self) -> np.ndarray:
    """(B, T, S) bool."""
    return visible_keys(self.case, self.ids())


def _live(ac: AlibiCase) -> np.ndarray:
  live = ac.visible().any(-1)
  return live[0] if ac.case.rank3 else live


@functools.lru_cache(maxsize=16)
def references(ac: AlibiCase):
  q, k, v, g, slopes, _ = ac.inputs()
  return score_variant_references(ac.case, (q, k, v, g), ac.visible(), slopes=slopes, cap=ac.cap)


def run(ac: AlibiCase, implementation: str):
  q, k, v, g, slopes, ids = ac.inputs()
  opts = ac.case.options()
  if ids is not None:
    opts.update(q_segment_ids=ids, kv_segment_ids=ids)

  def attention(q, k, v):
    return jax_flash.dot_product_attention(
        q, k, v, implementation=implementation, return_residual=True, alibi_slopes=slopes,
        logits_soft_cap=ac.cap, **opts)

  return outputs_and_grads(attention, q, k, v, g)


def check(ac: AlibiCase, got: dict):
  check_score_variant(got, *references(ac), _live(ac))


CASES = [
    # Alone (no mask), with GQA (slopes per query head) and T < S: later keys gain, so the
    # bias decides which keys dominate.
    AlibiCase(Case(batch=2, seq_q=50, seq_k=90, heads_q=4, heads_k=2, head_dim=40)),
    # Several tiles of the CPU kernel both ways, causal, GQA 4:1, T < S, bf16.
    AlibiCase(Case(batch=1, seq_q=130, seq_k=200, heads_q=4, heads_k=1, head_dim=64,
                   dtype="bfloat16", is_causal=True)),
    # T > S, causal (rows past the last key see every key), slopes of both signs.
    AlibiCase(Case(batch=1, seq_q=150, seq_k=70, heads_q=2, heads_k=2, head_dim=32,
                   is_causal=True), slopes="mixed"),
    # A window and lengths, one batch element with no keys (empty rows), a negative scale, with
    # the soft cap (the bias is added after it).
    AlibiCase(Case(batch=2, seq_q=65, seq_k=80, heads_q=2, heads_k=2, head_dim=24,
                   local_window_size=(8, 3), q_lens=(60, 65), kv_lens=(0, 77), scale=-0.3),
              slopes="mixed", cap=1.5),
    # Packed documents: positions stay those of the packed row.
    AlibiCase(Case(batch=2, seq_q=80, seq_k=80, heads_q=2, heads_k=1, head_dim=16,
                   is_causal=True), segment_ids=True),
    # Unbatched inputs. (Small shapes of one batch element can take XLA's CPU compiler seconds
    # on the plain-XLA paths: LLVM unrolls a fused loop whole, e.g. T=33, S=48.)
    AlibiCase(Case(batch=1, seq_q=40, seq_k=100, heads_q=2, heads_k=2, head_dim=32,
                   dtype="bfloat16", rank3=True), cap=3.0),
    # A decode shape: the CPU runs it on the tiled kernel (split-KV takes no slopes).
    AlibiCase(Case(batch=2, seq_q=1, seq_k=300, heads_q=8, heads_k=2, head_dim=32,
                   kv_lens=(300, 123))),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("ac", CASES, ids=[c.id for c in CASES])
def test_against_reference(ac, implementation):
  check(ac, run(ac, implementation))


def test_the_slopes_change_the_result_and_zero_slopes_do_not():
  """The cases above would pass vacuously if the slopes had no effect: they do; zero slopes
  add exactly 0 (bit-identical to no slopes on the kernel; XLA may fuse the plain-XLA paths'
  programs differently, to the last bit)."""
  ac = CASES[0]
  q, k, v, _, slopes, _ = ac.inputs()
  for implementation in IMPLEMENTATIONS:
    @jax.jit
    def call(*slopes):
      return jax_flash.dot_product_attention(q, k, v, return_residual=True,
                                             implementation=implementation,
                                             alibi_slopes=slopes[0] if slopes else None)
    plain, biased, zero = call(), call(slopes), call(jnp.zeros(4))
    assert np.max(np.abs(np.asarray(plain[0] - biased[0]))) > 0.1, implementation
    tolerance = dict(rtol=0, atol=0) if implementation == "cpu" else dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(zero[0], plain[0], **tolerance)
    np.testing.assert_allclose(zero[1], plain[1], **tolerance)


@pytest.mark.parametrize("seq_q, seq_k, causal", [(6, 11, True), (11, 6, True), (7, 9, False)])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_positions_are_the_causal_masks(implementation, seq_q, seq_k, causal):
  """With q = 0 every score is the bias alone, so the lse of row i is, in closed form,
  log sum over its visible keys j of exp(slope * (j - i)): query i sits at key i (top-left, as
  is_causal), whatever T and S, and padding past the lengths moves nothing."""
  slopes = np.array([0.5, -0.25, 0.125])
  q_lens, kv_lens = np.array([seq_q, seq_q - 2]), np.array([seq_k, seq_k - 3])
  q = jnp.zeros((2, seq_q, 3, 8), F32)
  kv = jnp.asarray(np.random.default_rng(0).standard_normal((2, seq_k, 3, 8)), F32)
  _, lse = jax.jit(lambda q, kv: jax_flash.dot_product_attention(
      q, kv, kv, is_causal=causal, alibi_slopes=jnp.asarray(slopes, F32),
      query_seq_lengths=jnp.asarray(q_lens, jnp.int32),
      key_value_seq_lengths=jnp.asarray(kv_lens, jnp.int32), implementation=implementation,
      return_residual=True))(q, kv)
  i, j = np.arange(seq_q)[:, None], np.arange(seq_k)[None, :]
  for b in range(2):
    vis = (j < kv_lens[b]) & ((j <= i) if causal else True)
    for h, m in enumerate(slopes):
      want = np.log(np.sum(np.where(vis, np.exp(m * (j - i)), 0.0), axis=1))
      got = np.asarray(lse)[b, :, h]
      rows = np.arange(seq_q) < q_lens[b]
      np.testing.assert_allclose(got[rows], want[rows], rtol=1e-5, atol=1e-5)
      assert np.all(got[~rows] == EMPTY_ROW_LSE)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_slopes_get_no_gradient(implementation):
  """The slopes are not differentiated: their gradient is zero on every path (as the
  lengths')."""
  ac = CASES[0]
  q, k, v, _, slopes, _ = ac.inputs()
  grad = jax.jit(jax.grad(lambda s: jax_flash.dot_product_attention(
      q, k, v, alibi_slopes=s, implementation=implementation).sum()))(slopes)
  np.testing.assert_array_equal(grad, np.zeros(4))


def test_decode_shapes_run_the_tiled_kernel():
  """A decode-shaped call with slopes lowers to the tiled forward, not the decode kernel."""
  q = jnp.ones((2, 1, 8, 32))
  kv = jnp.ones((2, 300, 2, 32))
  def hlo(**alibi):
    return jax.jit(lambda q, kv: jax_flash.dot_product_attention(
        q, kv, kv, implementation="cpu", **alibi)).lower(q, kv).as_text()
  assert "jax_flash_cpu_decode" in hlo()
  with_slopes = hlo(alibi_slopes=jnp.ones(8))
  assert "jax_flash_cpu_decode" not in with_slopes and "jax_flash_cpu_fwd" in with_slopes


@pytest.mark.parametrize("slopes, match", [
    (jnp.zeros((3,)), r"alibi_slopes must have shape \(4,\).*query\(1, 6, 4, 8\).*"
                      r"alibi_slopes\(3,\)"),
    (jnp.zeros(()), r"alibi_slopes must have shape \(4,\).*got alibi_slopes\(\)"),
    (jnp.zeros((1, 4)), r"alibi_slopes must have shape \(4,\).*got alibi_slopes\(1, 4\)"),
    (jnp.zeros((2,)), r"alibi_slopes must have shape \(4,\).*query head N=4"),
    (jnp.zeros((4,), jnp.int32), r"alibi_slopes must be float32, bfloat16 or float16.*int32"),
    ("x", r"alibi_slopes must"),
])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_invalid_slopes_raise(slopes, match, implementation):
  q = jnp.ones((1, 6, 4, 8))
  kv = jnp.ones((1, 6, 2, 8))  # 2 kv heads: the slopes are per query head
  with pytest.raises(ValueError, match=match):
    jax_flash.dot_product_attention(q, kv, kv, alibi_slopes=slopes,
                                    implementation=implementation)


def test_16_bit_slopes_are_taken_as_float32():
  ac = CASES[0]
  q, k, v, _, slopes, _ = ac.inputs()
  a = jax_flash.dot_product_attention(q, k, v, alibi_slopes=slopes, implementation="cpu")
  b = jax_flash.dot_product_attention(q, k, v, alibi_slopes=slopes.astype(jnp.bfloat16),
                                      implementation="cpu")
  np.testing.assert_array_equal(a, b)  # the geometric slopes are powers of two


def test_cuda_kernels_take_the_slopes(monkeypatch):
  """A call with slopes where None picks CUDA runs on the CUDA kernels (their kGeneral
  instantiations), and the op layer builds the CUDA call with the slopes and their switch."""
  q = jnp.ones((2, 8, 2, 16), jnp.bfloat16)
  monkeypatch.setattr(_dispatch, "default_implementation", lambda dtype: "cuda")
  assert _dispatch.select(None, _dispatch.Call(q.shape, q.dtype, alibi_slopes=(2,))) == "cuda"
  config = _ops.KernelConfig("cuda", 1.0, False, -1, -1)
  slopes = jnp.ones((2, 2))
  operands, attributes = _ops._alibi_operands(config, slopes)
  assert operands[0] is slopes and attributes == {"alibi": True}
  operands, attributes = _ops._alibi_operands(config, None)
  assert operands[0].shape == (0,) and attributes == {"alibi": False}


# The CUDA kernels (16-bit inputs): the CPU cases' shapes in bf16/f16 (without segment ids),
# and head dims that take the Hopper kernels (64, 128) and the backward whose warpgroups split
# head dim 256 (sm90/traits.cuh kSplitHeadDim).
CUDA_CASES = [
    AlibiCase(Case(batch=2, seq_q=50, seq_k=90, heads_q=4, heads_k=2, head_dim=40,
                   dtype="bfloat16")),
    CASES[1],
    AlibiCase(Case(batch=1, seq_q=150, seq_k=70, heads_q=2, heads_k=2, head_dim=32,
                   dtype="float16", is_causal=True), slopes="mixed"),
    AlibiCase(Case(batch=2, seq_q=65, seq_k=80, heads_q=2, heads_k=2, head_dim=24,
                   dtype="bfloat16", local_window_size=(8, 3), q_lens=(60, 65),
                   kv_lens=(0, 77), scale=-0.3), slopes="mixed", cap=1.5),
    AlibiCase(Case(batch=2, seq_q=1, seq_k=300, heads_q=8, heads_k=2, head_dim=32,
                   dtype="bfloat16", kv_lens=(300, 123))),
    AlibiCase(Case(batch=1, seq_q=200, seq_k=333, heads_q=4, heads_k=4, head_dim=128,
                   dtype="bfloat16", is_causal=True), cap=4.0),
    AlibiCase(Case(batch=1, seq_q=100, seq_k=140, heads_q=2, heads_k=1, head_dim=256,
                   dtype="bfloat16"), slopes="mixed"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("ac", CUDA_CASES, ids=[c.id for c in CUDA_CASES])
def test_cuda_against_reference(ac):
  check(ac, run(ac, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("ac", [c for c in CUDA_CASES if c.case.head_dim in (64, 128)],
                         ids=[c.id for c in CUDA_CASES if c.case.head_dim in (64, 128)])
def test_cuda_inference_forward_against_reference(ac):
  """The inference forward with slopes (no residual: a 16-bit o stored by TMA on Hopper at head
  dims 64 and 128) within the rule; rows without keys exactly 0."""
  q, k, v, _, slopes, ids = ac.inputs()
  opts = ac.case.options()
  if ids is not None:
    opts.update(q_segment_ids=ids, kv_segment_ids=ids)
  out = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, implementation="cuda", alibi_slopes=slopes, logits_soft_cap=ac.cap, **opts))(q, k, v)
  ref32, refd = references(ac)
  check_score_variant_output(out, ref32, refd, _live(ac))


def test_vmap():
  """vmap over the batch, with the slopes unmapped or mapped (each element its own slopes):
  the kernels take one slope per (batch, head), so both fold into the batch."""
  ac = CASES[0]
  q, k, v, _, slopes, _ = ac.inputs()
  f = lambda q, k, v, s: jax_flash.dot_product_attention(q, k, v, alibi_slopes=s,
                                                         implementation="cpu")
  np.testing.assert_allclose(
      jax.vmap(f, (0, 0, 0, None))(q[:, None], k[:, None], v[:, None], slopes)[:, 0],
      f(q, k, v, slopes), atol=1e-6)
  per_element = jnp.stack([slopes, -slopes])
  got = jax.vmap(f)(q[:, None], k[:, None], v[:, None], per_element)[:, 0]
  for b in range(2):
    np.testing.assert_allclose(got[b], f(q[b:b + 1], k[b:b + 1], v[b:b + 1], per_element[b])[0],
                               atol=1e-6)


def _value_and_grads():
  def loss(q, k, v, s):
    return (jax_flash.dot_product_attention(q, k, v, alibi_slopes=s, is_causal=True,
                                            implementation="cpu") ** 2).sum()
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


@pytest.mark.parametrize("spec", ["batch", "heads"])
def test_batch_and_head_sharding_carry_the_slopes(spec):
  from jax.sharding import NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  ac = CASES[0]
  q, k, v, _, slopes, _ = ac.inputs()
  mesh = jax.make_mesh((2,), ("x",))
  sharding = NamedSharding(mesh, P("x") if spec == "batch" else P(None, None, "x", None))
  sharded = [jax.device_put(x, sharding) for x in (q, k, v)]
  want, want_g = _value_and_grads()(q, k, v, slopes)
  got, got_g = _value_and_grads()(*sharded, slopes)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(got_g, want_g):
    np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("strategy, devices, causal, seq_q, seq_k, window", [
    ("ring:zigzag", 2, True, 128, 128, None),  # two chunks a device (2 devices: compile time)
    ("ring", 4, False, 64, 128, None),  # T != S: query and key chunks of different lengths
    ("all_to_all", 4, True, 128, 128, None),
    ("all_gather:contiguous", 4, False, 64, 128, (20, 7)),  # key ranges cut by the window
])
def test_sequence_sharding_carries_the_slopes(strategy, devices, causal, seq_q, seq_k, window):
  """Context parallelism: the all-to-all takes its heads' slopes, the ring and the all-gather
  move each block's lse by slope * (its key start - its query start). The same output and
  gradients as the single-device call."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (2, seq_q, 4, 32))
  k, v = (jax.random.normal(x, (2, seq_k, 4, 32)) for x in ks[1:])
  slopes = jnp.asarray([0.25, -0.1, 0.05, 0.0], F32)  # signed: later keys matter too

  def fg(**cp):
    def loss(q, k, v):
      out, lse = jax_flash.dot_product_attention(
          q, k, v, alibi_slopes=slopes, is_causal=causal, local_window_size=window,
          implementation="cpu", return_residual=True, **cp)
      return (out ** 2).sum(), lse
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))

  (want, want_lse), want_g = fg()(q, k, v)
  mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices()[:devices])
  sharded = [jax.device_put(x, NamedSharding(mesh, P(None, "x", None, None))) for x in (q, k, v)]
  (got, got_lse), got_g = fg(context_parallel=strategy)(*sharded)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-5)
  for a, b in zip(got_g, want_g):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_flax_function_takes_the_slopes():
  """jax_flash.flax.dot_product_attention passes the slopes through (any number of batch dims)
  and checks them by the same rule."""
  pytest.importorskip("flax")
  import jax_flash.flax as jf

  ac = CASES[0]
  q, k, v, _, slopes, _ = ac.inputs()
  got = jf.dot_product_attention(q[None], k[None], v[None], alibi_slopes=slopes,
                                 is_causal=True)[0]
  want = jax_flash.dot_product_attention(q, k, v, alibi_slopes=slopes, is_causal=True)
  np.testing.assert_allclose(got, want, atol=1e-6)
  with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\)"):
    jf.dot_product_attention(q, k, v, alibi_slopes=jnp.zeros((2,)))
