"""Fused attention dropout (issue 17 item 4): ``dropout_rate`` and ``dropout_key`` on
dot_product_attention. Each normalised probability p_ij of query head h is multiplied by
Z = keep / (1 - rate) before P V, keep = jax_flash._dropout.keep_mask(key, rate, B, N, T, S)
[b, h, i, j] on every path; the lse is the undropped softmax's.

Each path ("cpu" kernel, "blockwise", "xla") is checked against a float32 reference that
materialises the (T, S) probabilities and multiplies them by that mask
(attention_testing.score_variant_attention, differentiated by JAX), by the FlashAttention rule
of tests/attention_testing.py (max error <= 2x the error of the same reference with the input
dtype's rounding, plus the tiny floor): forward, lse and dq, dk, dv, alone and with causal,
windows, lengths with empty rows, GQA, T != S, segment ids, a decode shape, unbatched inputs.
Then: the mask elements themselves read off the output (one-hot values), two runs bit-identical,
keys that differ give masks that differ, rate 0 is no dropout exactly, sinks, a block mask, the
errors, the CUDA refusal, vmap, batch- and sequence-sharded calls, the Flax function and
modules.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _dispatch, _dropout, _ops
from tests.attention_testing import (Case, F32, check_score_variant, ffi_calls,
                                     gpu_tests_in_a_process, outputs_and_grads,
                                     packed_segment_ids, score_variant_references,
                                     simulate_cuda_host, visible_keys)

IMPLEMENTATIONS = ["cpu", "blockwise", "xla"]


@dataclasses.dataclass(frozen=True)
class DropoutCase:
  case: Case
  rate: float = 0.3
  segment_ids: bool = False  # documents of random lengths, sorted by position
  seed: int = 5  # the dropout key's
  deterministic: bool = False

  @property
  def id(self) -> str:
    return (f"{self.case.id}_p{self.rate}" + ("_ids" if self.segment_ids else "")
            + ("_det" if self.deterministic else ""))

  def key(self) -> jax.Array:
    return jax.random.key(self.seed)

  def ids(self):
    return packed_segment_ids(self.case) if self.segment_ids else None

  def visible(self) -> np.ndarray:
    """(B, T, S) bool."""
    return visible_keys(self.case, self.ids())

  def multipliers(self) -> jax.Array:
    """(B, N, T, S) float32: keep / (1 - rate), the kernels' own decisions."""
    c = self.case
    keep = _dropout.keep_mask(self.key(), self.rate, c.batch, c.heads_q, c.seq_q, c.seq_k)
    return jnp.where(keep, jnp.float32(1.0 / (1.0 - self.rate)), 0.0)


def _live(dc: DropoutCase) -> np.ndarray:
  live = dc.visible().any(-1)
  return live[0] if dc.case.rank3 else live


@functools.lru_cache(maxsize=16)
def references(dc: DropoutCase):
  return score_variant_references(dc.case, dc.case.inputs(), dc.visible(),
                                  dropout=dc.multipliers())


def run(dc: DropoutCase, implementation: str, **extra):
  q, k, v, g = dc.case.inputs()
  opts = dc.case.options()
  ids = dc.ids()
  if ids is not None:
    opts.update(q_segment_ids=ids, kv_segment_ids=ids)
  if dc.deterministic:
    opts.update(deterministic=True)

  def attention(q, k, v):
    return jax_flash.dot_product_attention(
        q, k, v, implementation=implementation, return_residual=True, dropout_rate=dc.rate,
        dropout_key=dc.key(), **opts, **extra)

  return outputs_and_grads(attention, q, k, v, g)


CASES = [
    # Alone (no mask), GQA 2:1 and T < S, odd sizes across the 16-row groups of the counter.
    DropoutCase(Case(batch=2, seq_q=50, seq_k=90, heads_q=4, heads_k=2, head_dim=40)),
    # Several tiles of the CPU kernel both ways, causal, GQA 2:1, bf16, half of P dropped.
    DropoutCase(Case(batch=1, seq_q=130, seq_k=150, heads_q=2, heads_k=1, head_dim=64,
                     dtype="bfloat16", is_causal=True), rate=0.5),
    # T > S, causal (rows past the last key see every key); a low rate.
    DropoutCase(Case(batch=1, seq_q=150, seq_k=70, heads_q=2, heads_k=2, head_dim=32,
                     is_causal=True), rate=0.1),
    # A window (the forward's key tiles then start at odd keys) and lengths, one batch element
    # with no keys (empty rows), a negative scale, float16.
    DropoutCase(Case(batch=2, seq_q=65, seq_k=80, heads_q=2, heads_k=2, head_dim=24,
                     dtype="float16", local_window_size=(8, 3), q_lens=(60, 65), kv_lens=(0, 77),
                     scale=-0.3), rate=0.2),
    # Packed documents.
    DropoutCase(Case(batch=2, seq_q=80, seq_k=80, heads_q=2, heads_k=1, head_dim=16,
                     is_causal=True), rate=0.4, segment_ids=True),
    # Unbatched inputs, a high rate.
    DropoutCase(Case(batch=1, seq_q=40, seq_k=100, heads_q=2, heads_k=2, head_dim=32,
                     rank3=True), rate=0.8),
    # A decode shape: the CPU runs it on the tiled kernel (split-KV takes no dropout).
    DropoutCase(Case(batch=2, seq_q=1, seq_k=300, heads_q=8, heads_k=2, head_dim=32,
                     kv_lens=(300, 123))),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dc", CASES, ids=[c.id for c in CASES])
def test_against_reference(dc, implementation):
  check_score_variant(run(dc, implementation), *references(dc), _live(dc))


# The CUDA kernels' dropout (experimental: JAX_FLASH_CUDA_DROPOUT=on, read at import; the GPU
# tests below run in a subprocess with it, test_cuda_kernels_under_the_switch, once as the
# kernels are chosen and once with every call on the mma.sync kernels): 16-bit inputs, no
# segment ids (refused beside dropout there yet).
CUDA_CASES = [
    # Head dim 64 (the 128-row backward), GQA 2:1, T < S.
    DropoutCase(Case(batch=2, seq_q=200, seq_k=300, heads_q=4, heads_k=2, head_dim=64,
                     dtype="bfloat16")),
    # Head dim 128 causal (dQ's bulk hand-off), float16, half of P dropped.
    DropoutCase(Case(batch=1, seq_q=130, seq_k=150, heads_q=2, heads_k=1, head_dim=128,
                     dtype="float16", is_causal=True), rate=0.5),
    # Head dim 96 (the kernels of 96), a window and lengths with an empty batch element.
    DropoutCase(Case(batch=2, seq_q=65, seq_k=180, heads_q=2, heads_k=2, head_dim=96,
                     dtype="bfloat16", local_window_size=(40, 3), q_lens=(60, 65),
                     kv_lens=(0, 177)), rate=0.2),
    # Head dims 256 and 192: the split backward (32-query halves of a visit a warpgroup).
    DropoutCase(Case(batch=1, seq_q=70, seq_k=150, heads_q=2, heads_k=1, head_dim=256,
                     dtype="bfloat16", is_causal=True), rate=0.1),
    DropoutCase(Case(batch=1, seq_q=100, seq_k=90, heads_q=2, heads_k=2, head_dim=192,
                     dtype="bfloat16"), rate=0.4),
    # A decode shape: the tiled forward (the decode kernel takes no dropout).
    DropoutCase(Case(batch=2, seq_q=1, seq_k=300, heads_q=8, heads_k=2, head_dim=128,
                     dtype="bfloat16", kv_lens=(300, 123))),
    # Head dim 32: the mma.sync kernels on any GPU; causal, GQA 2:1, T < S.
    DropoutCase(Case(batch=2, seq_q=70, seq_k=130, heads_q=4, heads_k=2, head_dim=32,
                     dtype="bfloat16", is_causal=True), rate=0.25),
    # deterministic=True: the dQ kernel of its own (and, with dropout, the mma.sync main
    # backward); MQA, lengths.
    DropoutCase(Case(batch=2, seq_q=130, seq_k=200, heads_q=4, heads_k=1, head_dim=128,
                     dtype="bfloat16", q_lens=(130, 97), kv_lens=(200, 150)), rate=0.3,
                deterministic=True),
]


def _needs_the_cuda_switch():
  if not _dropout.cuda_kernels_take_dropout():
    pytest.skip("runs under JAX_FLASH_CUDA_DROPOUT=on (test_cuda_kernels_under_the_switch)")


@pytest.mark.gpu
@pytest.mark.parametrize("dc", CUDA_CASES, ids=[c.id for c in CUDA_CASES])
def test_cuda_against_reference(dc):
  _needs_the_cuda_switch()
  check_score_variant(run(dc, "cuda"), *references(dc), _live(dc))


@pytest.mark.gpu
def test_cuda_each_element_is_the_masks():
  """test_each_element_is_the_masks on the CUDA kernels (bfloat16: the one-hot outputs 1 / (S (1 -
  rate)) round to 0.4% at most, far from the next integer once scaled back)."""
  _needs_the_cuda_switch()
  batch, seq_q, seq_k, heads_q, heads_k, rate = 2, 37, 41, 4, 2, 0.4
  q = jnp.zeros((batch, seq_q, heads_q, seq_k), jnp.bfloat16)
  k = jnp.ones((batch, seq_k, heads_k, seq_k), jnp.bfloat16)
  v = jnp.broadcast_to(jnp.eye(seq_k, dtype=jnp.bfloat16)[None, :, None, :], k.shape)
  key = jax.random.key(11)
  out = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, dropout_rate=rate, dropout_key=key, implementation="cuda"))(q, k, v)
  got = np.rint(np.asarray(out, np.float32) * seq_k * (1 - rate))
  want = np.asarray(_dropout.keep_mask(key, rate, batch, heads_q, seq_q, seq_k))
  np.testing.assert_array_equal(got, np.moveaxis(want, 1, 2).astype(np.float64))


@pytest.mark.gpu
def test_cuda_with_the_soft_cap_matches_xla():
  """Dropout beside the soft cap on the CUDA kernels (the cap's chain rule folds into Z dP):
  output and gradients against "xla" in float32 with the same key, by the FlashAttention rule
  (at most twice the error of "xla" run on the bfloat16 inputs, plus a small floor)."""
  _needs_the_cuda_switch()
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv((1, 140, 4, 64), kv_heads=2))
  rate, key = 0.35, jax.random.key(8)

  def fg(implementation, dtype):
    def loss(q, k, v):
      out = jax_flash.dot_product_attention(q, k, v, dropout_rate=rate, dropout_key=key,
                                            implementation=implementation, logits_soft_cap=2.0)
      out = out.astype(F32)
      return jnp.sum(out * jnp.sin(out)), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
        *(x.astype(dtype) for x in (q, k, v)))
    return [np.asarray(x, np.float32) for x in (out, *grads)]

  exact = fg("xla", F32)
  rounded = fg("xla", jnp.bfloat16)
  got = fg("cuda", jnp.bfloat16)
  for name, g, r, e in zip(("out", "dq", "dk", "dv"), got, rounded, exact):
    assert np.abs(g - e).max() <= 2 * np.abs(r - e).max() + 1e-3, name


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["chosen", "sm80"])
def test_cuda_kernels_under_the_switch(kernels):
  """The CUDA dropout tests above, in a process with JAX_FLASH_CUDA_DROPOUT=on: with the kernels
  each call runs (on Hopper the wgmma ones, at head dim 32 and deterministic the mma.sync ones),
  and with every call on the mma.sync kernels (JAX_FLASH_CUDA_FORWARD/BACKWARD=sm80)."""
  env = dict(JAX_FLASH_CUDA_DROPOUT="on")
  if kernels == "sm80":
    env.update(JAX_FLASH_CUDA_FORWARD="sm80", JAX_FLASH_CUDA_BACKWARD="sm80")
  gpu_tests_in_a_process(__file__, "test_cuda_against_reference or test_cuda_each_element or "
                         "test_cuda_with_the_soft_cap", env)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_each_element_is_the_masks(implementation):
  """With q = 0 every visible key gets weight 1 / S, and with one-hot values (value j is e_j)
  output column j of query row i in head h is keep[b, h, i, j] / (S (1 - rate)): the mask is
  read off element by element and must be keep_mask's exactly (rows across the counter's
  16-row groups, an odd S across its key pairs, GQA: h is the query head)."""
  batch, seq_q, seq_k, heads_q, heads_k, rate = 2, 37, 41, 4, 2, 0.4
  q = jnp.zeros((batch, seq_q, heads_q, seq_k), F32)
  k = jnp.ones((batch, seq_k, heads_k, seq_k), F32)
  v = jnp.broadcast_to(jnp.eye(seq_k, dtype=F32)[None, :, None, :], k.shape)
  key = jax.random.key(11)
  out = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, dropout_rate=rate, dropout_key=key, implementation=implementation))(q, k, v)
  got = np.rint(np.asarray(out) * seq_k * (1 - rate))  # (B, T, N, S): 0 or 1
  want = np.asarray(_dropout.keep_mask(key, rate, batch, heads_q, seq_q, seq_k))
  np.testing.assert_array_equal(got, np.moveaxis(want, 1, 2).astype(np.float64))
  assert 0.5 < want.mean() < 0.7  # and the mask is not trivial


def test_mask_helpers_agree():
  """keep_from_seeds over every row and key of seeds() is keep_mask; shared seeds give
  keep_mask's (0, 0) for every batch element and head."""
  key = jax.random.PRNGKey(3)  # a raw key
  rows, cols = jnp.arange(21), jnp.arange(35)

  @functools.partial(jax.jit, static_argnums=1)
  def keep(key, shared):
    return _dropout.keep_from_seeds(_dropout.seeds(key, 2, 3, shared=shared), 0.3, rows, cols)
  np.testing.assert_array_equal(keep(key, False), _dropout.keep_mask(key, 0.3, 2, 3, 21, 35))
  shared = keep(key, True)
  np.testing.assert_array_equal(shared, jnp.broadcast_to(
      _dropout.keep_mask(key, 0.3, 1, 1, 21, 35), shared.shape))


def _qkv(shape=(1, 40, 2, 16), kv_heads=1, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal(shape), F32)
  k, v = (jnp.asarray(rng.standard_normal((*shape[:2], kv_heads, shape[3])), F32)
          for _ in range(2))
  return q, k, v


def _value_and_grads(implementation, **options):
  def loss(q, k, v, key):
    out = jax_flash.dot_product_attention(q, k, v, dropout_key=key, implementation=implementation,
                                          **options)
    return jnp.sum(out * jnp.cos(out)), out
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_same_key_same_bits_other_key_other_mask(implementation):
  """Two runs with one key are bit-identical (forward and gradients); another key drops other
  elements (a different output)."""
  q, k, v = _qkv()
  f = _value_and_grads(implementation, dropout_rate=0.25, is_causal=True)
  (_, a), ga = f(q, k, v, jax.random.key(1))
  (_, b), gb = f(q, k, v, jax.random.key(1))
  np.testing.assert_array_equal(a, b)
  for x, y in zip(ga, gb):
    np.testing.assert_array_equal(x, y)
  (_, c), _ = f(q, k, v, jax.random.key(2))
  assert np.max(np.abs(np.asarray(a - c))) > 0.1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_rate_zero_is_no_dropout(implementation):
  """dropout_rate=0 (with or without a key) is the call without dropout, exactly: no mask is
  drawn and the same program runs."""
  q, k, v = _qkv()

  @functools.partial(jax.jit, static_argnums=3)
  def call(q, k, v, rate, key=None):
    return jax_flash.dot_product_attention(q, k, v, implementation=implementation,
                                           return_residual=True, dropout_rate=rate,
                                           dropout_key=key)
  plain = call(q, k, v, 0.0)
  got = call(q, k, v, 0.0, jax.random.key(4))
  np.testing.assert_array_equal(got[0], plain[0])
  np.testing.assert_array_equal(got[1], plain[1])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_lse_is_the_undropped_softmaxs(implementation):
  q, k, v = _qkv()
  _, want = jax.jit(functools.partial(jax_flash.dot_product_attention, implementation="xla",
                                      return_residual=True))(q, k, v)
  _, got = jax.jit(functools.partial(
      jax_flash.dot_product_attention, implementation=implementation, return_residual=True,
      dropout_rate=0.6, dropout_key=jax.random.key(0)))(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("options", [
    dict(sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0], F32), logits_soft_cap=2.0),
    dict(alibi_slopes=jnp.asarray([0.25, -0.1, 0.05, 0.0], F32), is_causal=True),
    # T = S = 140: 2 x 2 blocks of 128 (rows 118..127 would see keys 128..137 but for the mask)
    dict(block_mask=jnp.asarray([[True, False], [True, True]]), local_window_size=(70, 10)),
], ids=["sinks_cap", "alibi", "block_mask"])
@pytest.mark.parametrize("implementation", ["cpu", "blockwise"])
def test_with_the_other_score_variants(implementation, options):
  """Dropout beside sinks (which join after the kernel: the dropped weights are normalised with
  the sink), the soft cap, ALiBi and a block mask: the same outputs and gradients (sinks
  included) as "xla" with the same key."""
  q, k, v = _qkv((1, 140, 4, 16), kv_heads=2)
  rate, key = 0.35, jax.random.key(8)

  def fg(implementation):
    def loss(q, k, v, sinks):
      opts = dict(options, sinks=sinks) if sinks is not None else options
      out, lse = jax_flash.dot_product_attention(
          q, k, v, dropout_rate=rate, dropout_key=key, implementation=implementation,
          return_residual=True, **opts)
      return jnp.sum(out * jnp.sin(out)), (out, lse)
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))

  sinks = options.get("sinks")
  (_, want), want_g = fg("xla")(q, k, v, sinks)
  (_, got), got_g = fg(implementation)(q, k, v, sinks)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
  for a, b in zip(got_g, want_g):
    if b is not None:
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=5e-5)


def test_decode_shapes_run_the_tiled_kernel():
  """A decode-shaped call with dropout lowers to the tiled forward, not the decode kernel."""
  q = jnp.ones((2, 1, 8, 32))
  kv = jnp.ones((2, 300, 2, 32))

  def hlo(**dropout):
    return jax.jit(lambda q, kv: jax_flash.dot_product_attention(
        q, kv, kv, implementation="cpu", **dropout)).lower(q, kv).as_text()
  assert "jax_flash_cpu_decode" in hlo()
  with_dropout = hlo(dropout_rate=0.1, dropout_key=jax.random.key(0))
  assert "jax_flash_cpu_decode" not in with_dropout and "jax_flash_cpu_fwd" in with_dropout


@pytest.mark.parametrize("rate, key, match", [
    (1.0, None, r"dropout_rate must be in \[0, 1\); got 1.0"),
    (-0.1, None, r"dropout_rate must be in \[0, 1\); got -0.1"),
    (float("nan"), None, r"dropout_rate must be in \[0, 1\); got nan"),
    (jnp.float32(0.1), None, r"dropout_rate must be a Python float.*got Array"),
    (True, None, r"dropout_rate must be a Python float.*got True"),
    ("0.1", None, r"dropout_rate must be a Python float.*got '0.1'"),
    (0.1, None, r"dropout_rate=0.1 needs a dropout_key.*got dropout_key=None"),
    (0.1, jnp.zeros((3,), jnp.uint32), r"dropout_key must be one JAX PRNG key.*"
                                       r"got dropout_key\(3,\) uint32"),
    (0.1, jnp.zeros((2,), F32), r"dropout_key must be one JAX PRNG key.*float32"),
    (0.1, jax.random.split(jax.random.key(0)), r"dropout_key must be one JAX PRNG key.*"
                                               r"typed key array of shape \(2,\)"),
    (0.1, jax.random.key(0, impl="rbg"), r"dropout_key must be one JAX PRNG key.*"
                                          r"data is uint32\(4,\)"),
    (0.1, "key", r"dropout_key must be one JAX PRNG key"),
])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_invalid_rate_or_key_raises(rate, key, match, implementation):
  q = jnp.ones((1, 6, 4, 8))
  with pytest.raises(ValueError, match=match):
    jax_flash.dot_product_attention(q, q, q, dropout_rate=rate, dropout_key=key,
                                    implementation=implementation)


def test_a_traced_rate_raises_a_traced_key_is_fine():
  q = jnp.ones((1, 6, 4, 8))
  with pytest.raises(ValueError, match="dropout_rate must be a Python float"):
    jax.jit(lambda r: jax_flash.dot_product_attention(q, q, q, dropout_rate=r,
                                                      dropout_key=jax.random.key(0)))(0.1)
  raw = jax.random.PRNGKey(1)
  got = jax.jit(lambda key: jax_flash.dot_product_attention(q, q, q, dropout_rate=0.5,
                                                            dropout_key=key))(raw)
  want = jax_flash.dot_product_attention(q, q, q, dropout_rate=0.5,
                                         dropout_key=jax.random.wrap_key_data(raw))
  np.testing.assert_array_equal(got, want)  # a raw key and its typed form: the same mask


def test_cuda_kernels_refuse_dropout(monkeypatch):
  """By default (JAX_FLASH_CUDA_DROPOUT unset, as here) the CUDA kernels take no dropout: the
  dispatch raises at trace time, before any custom call, naming the argument, its value and the implementations that take it; where None picks
  CUDA and where "cuda" is forced (its GPU check stubbed out: this machine has none). A rate of
  0 is no dropout, which CUDA runs."""
  q = jnp.ones((2, 8, 2, 16), jnp.bfloat16)
  key = jax.random.key(0)
  match = (r"'cuda' kernels .* take no dropout_rate yet; got dropout_rate=0.1 with "
           r"query\(2, 8, 2, 16\).*'cpu', 'blockwise', 'xla'")
  monkeypatch.setattr(_dispatch, "default_implementation", lambda dtype: "cuda")
  with pytest.raises(NotImplementedError, match=match):
    jax_flash.dot_product_attention(q, q, q, dropout_rate=0.1, dropout_key=key)
  monkeypatch.setattr(_dispatch, "_check_cuda_runs", lambda: None)
  with pytest.raises(NotImplementedError, match=match):
    jax_flash.dot_product_attention(q, q, q, dropout_rate=0.1, dropout_key=key,
                                    implementation="cuda")
  call = _dispatch.Call(q.shape, q.dtype, dropout_rate=None)
  assert _dispatch.select("cuda", call) == "cuda"
  with pytest.raises(NotImplementedError, match="take no dropout_rate"):
    _dispatch.select("cuda", dataclasses.replace(call, dropout_rate=0.5))
  # And the op layer itself never builds a CUDA call with dropout without the switch.
  assert not _dropout.cuda_kernels_take_dropout()
  config = _ops.KernelConfig("cuda", 1.0, False, -1, -1, dropout_rate=0.1)
  with pytest.raises(NotImplementedError, match="dropout_rate"):
    _ops._dropout_operands(config, jnp.zeros((2, 2, _dropout.SEED_WORDS), jnp.uint32))


def test_cuda_dropout_switch_reads_its_values():
  """JAX_FLASH_CUDA_DROPOUT (experimental, read at import): "on" turns the CUDA kernels' dropout
  on; unset, empty or "off" leave it off; another value warns, naming the values, and is off."""
  assert _dropout._read_cuda_dropout("on") is True
  for value in (None, "", "off"):
    assert _dropout._read_cuda_dropout(value) is False
  with pytest.warns(UserWarning, match=r"JAX_FLASH_CUDA_DROPOUT='yes' is not one of \('off', 'on'\)"):
    assert _dropout._read_cuda_dropout("yes") is False


def test_cuda_calls_carry_the_seeds_and_rate_under_the_switch(monkeypatch):
  """With JAX_FLASH_CUDA_DROPOUT=on (simulated here: the switch's value patched, this machine a
  CUDA host), a differentiated CUDA call with dropout traces to the forward and backward custom
  calls with the rate and the (B, N, SEED_WORDS) uint32 seeds of jax_flash._dropout.seeds; one
  without
  dropout passes rate 0 and an empty uint32 operand, deterministic=True and head dims up to 32
  (the mma.sync kernels) carry them too; what the kernels' dropout does not cover (segment ids,
  a block mask) is refused at trace time."""
  simulate_cuda_host(monkeypatch)
  monkeypatch.setattr(_dropout, "_CUDA_DROPOUT", True)
  assert _dispatch.capabilities("cuda").dropout_rate
  q, k, v = (jnp.ones((2, 40, 4, 64), jnp.bfloat16) for _ in range(3))
  key = jax.random.key(3)

  def loss(q, k, v, rate, deterministic=False):
    dropout = dict(dropout_rate=rate, dropout_key=key) if rate else {}
    out = jax_flash.dot_product_attention(q, k, v, implementation="cuda",
                                          deterministic=deterministic, **dropout)
    return out.astype(jnp.float32).sum()

  calls = ffi_calls(jax.grad(functools.partial(loss, rate=0.2), argnums=(0, 1, 2)), q, k, v)
  assert [name for name, *_ in calls] == ["jax_flash_cuda_fwd", "jax_flash_cuda_bwd"]
  # The uint32 operands: the seeds, then the mask's bits (an empty placeholder: no mask here).
  for name, attributes, operands, _ in calls:
    assert float(attributes["dropout_rate"]) == pytest.approx(0.2), name
    assert ([tuple(x.shape) for x in operands if x.dtype == jnp.uint32]
            == [(2, 4, _dropout.SEED_WORDS), (0,)]), name
  for name, attributes, operands, _ in ffi_calls(
      jax.grad(functools.partial(loss, rate=None), argnums=(0, 1, 2)), q, k, v):
    assert float(attributes["dropout_rate"]) == 0.0, name
    assert [tuple(x.shape) for x in operands if x.dtype == jnp.uint32] == [(0,), (0,)], name
  small = jnp.ones((2, 40, 4, 32), jnp.bfloat16)
  for args, deterministic in (((q, k, v), True), ((small, small, small), False)):
    calls = ffi_calls(jax.grad(functools.partial(loss, rate=0.2, deterministic=deterministic),
                               argnums=(0, 1, 2)), *args)
    assert [name for name, *_ in calls] == ["jax_flash_cuda_fwd", "jax_flash_cuda_bwd"]
    assert all(float(attributes["dropout_rate"]) == pytest.approx(0.2) for _, attributes, *_ in calls)
  # Segment ids or a block mask beside dropout are refused at trace time.
  ids = jnp.zeros((2, 40), jnp.int32)
  with pytest.raises(NotImplementedError, match="not with segment ids or a block mask"):
    jax_flash.dot_product_attention(q, k, v, implementation="cuda", dropout_rate=0.2,
                                    dropout_key=key, q_segment_ids=ids, kv_segment_ids=ids)
  with pytest.raises(NotImplementedError, match="not with segment ids or a block mask"):
    jax_flash.dot_product_attention(q, k, v, implementation="cuda", dropout_rate=0.2,
                                    dropout_key=key, block_mask=jnp.ones((1, 1), bool))


def test_vmap():
  """vmap over a leading axis with the key unmapped: each mapped call numbers its own batch
  from 0, so it equals the call on its slice; with mapped keys each slice draws its own."""
  q, k, v = _qkv((2, 40, 4, 16), kv_heads=2)
  q, k, v = (x.reshape(2, 1, *x.shape[1:]) for x in (q, k, v))

  def f(q, k, v, key):
    return jax_flash.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_key=key,
                                           implementation="cpu")
  key = jax.random.key(3)
  got = jax.jit(jax.vmap(f, (0, 0, 0, None)))(q, k, v, key)
  for i in range(2):
    np.testing.assert_allclose(got[i], f(q[i], k[i], v[i], key), atol=1e-6)
  keys = jax.random.split(key)
  got = jax.jit(jax.vmap(f))(q, k, v, keys)
  for i in range(2):
    np.testing.assert_allclose(got[i], f(q[i], k[i], v[i], keys[i]), atol=1e-6)


def _sharded_value_and_grads(is_causal=True, **options):
  def loss(q, k, v):
    out = jax_flash.dot_product_attention(q, k, v, dropout_rate=0.3,
                                          dropout_key=jax.random.key(6), is_causal=is_causal,
                                          implementation="cpu", **options)
    return jnp.sum(out * jnp.cos(out))
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def _two_device_mesh():
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  return jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))


def _assert_as_one_device(sharded, q, k, v, **options):
  """The sharded call's value and gradients are one device's (the same mask: the same output
  to rounding); returns its compiled HLO."""
  want, want_g = _sharded_value_and_grads(**options)(q, k, v)
  got, got_g = _sharded_value_and_grads(**options)(*sharded)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(got_g, want_g):
    np.testing.assert_allclose(a, b, atol=2e-5)
  return _sharded_value_and_grads(**options).lower(*sharded).compile().as_text()


@pytest.mark.parametrize("spec", ["batch", "heads"])
def test_batch_and_head_sharded_calls_draw_the_global_mask(spec):
  """Batch- and head-sharded calls draw each element's mask by its global indices (the seeds
  hold them): the same output and gradients as one device."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = _two_device_mesh()
  q, k, v = _qkv((2, 64, 4, 16), kv_heads=4)
  spec = {"batch": P("x"), "heads": P(None, None, "x", None)}[spec]
  _assert_as_one_device([jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)],
                        q, k, v)


SEQUENCE_CASES = [
    # context_parallel, query heads, T, S, options, a collective the HLO must hold
    (None, 4, 64, 64, dict(), "collective-permute"),  # automatic, causal: the zig-zag ring
    ("ring", 4, 64, 64, dict(is_causal=False), "collective-permute"),
    ("ring:zigzag", 1, 64, 64, dict(), "collective-permute"),
    ("ring", 2, 64, 96, dict(is_causal=False), "collective-permute"),
    ("all_gather", 4, 64, 64, dict(), "all-gather"),
    ("all_gather:zigzag", 2, 128, 128, dict(), "all-gather"),
    ("all_gather", 2, 64, 96, dict(is_causal=False, local_window_size=(16, 8)), "all-gather"),
    ("all_to_all", 4, 64, 64, dict(), "all-to-all"),
]


@pytest.mark.parametrize(
    "request_,heads,t,s,options,collective", SEQUENCE_CASES,
    ids=[f"{r}-N{n}-T{t}-S{s}-{'-'.join(f'{k}{v}' for k, v in o.items()) or 'causal'}"
         for r, n, t, s, o, _ in SEQUENCE_CASES])
def test_sequence_sharded_strategies_drop_as_one_device(request_, heads, t, s, options,
                                                        collective):
  """A sequence-sharded call with dropout runs every context-parallel strategy and drops what
  one device drops: the all-to-all's kernel sees the whole sequence of its heads (the seeds
  hold the global head indices); the ring's and the all-gather's kernels see slices and take
  the seeds moved to their slices' first row and key (_dropout.at_offset; the test fails with
  the move left out: each slice would draw the sequence's first rows' decisions). The HLO holds
  the strategy's collective."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = _two_device_mesh()
  q, _, _ = _qkv((2, t, heads, 16), kv_heads=1, seed=1)
  _, k, v = _qkv((2, s, heads, 16), kv_heads=1, seed=2)
  spec = NamedSharding(mesh, P(None, "x", None, None))
  sharded = [jax.device_put(x, spec) for x in (q, k, v)]
  hlo = _assert_as_one_device(sharded, q, k, v, context_parallel=request_, **options)
  assert collective in hlo
  assert request_ == "all_gather" or "all-gather" not in hlo or collective == "all-gather"


def test_sequence_sharded_dropout_off_the_groups_is_refused_or_gathered():
  """The ring's and the all-gather's slices must start dropout's 16 x 16 groups: T = 48 over 2
  devices (24 rows a slice) refuses a requested ring or all-gather, naming dropout_rate; the
  automatic choice takes the all-to-all where the heads split and gathers the sequence where
  they do not; a window whose left size (8) cuts the all-gather's key ranges off the groups is
  refused too."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = _two_device_mesh()
  spec = NamedSharding(mesh, P(None, "x", None, None))
  for heads, collective in ((4, "all-to-all"), (1, "all-gather")):
    q, k, v = _qkv((2, 48, heads, 16), kv_heads=1)
    sharded = [jax.device_put(x, spec) for x in (q, k, v)]
    assert collective in _assert_as_one_device(sharded, q, k, v)
    for request_ in ("ring", "all_gather"):
      # (raised where the call is partitioned: XLA's error carries the message)
      with pytest.raises(Exception, match="dropout_rate=0.3 needs each device's query slice"):
        _sharded_value_and_grads(context_parallel=request_)(*sharded)
  q, k, v = _qkv((2, 64, 2, 16), kv_heads=1)
  sharded = [jax.device_put(x, spec) for x in (q, k, v)]
  with pytest.raises(Exception, match="left size of local_window_size"):
    _sharded_value_and_grads(context_parallel="all_gather", is_causal=False,
                             local_window_size=(8, 8))(*sharded)


SHARD_MAP_CASES = [
    # entry point / strategy, layout, T, S, options
    ("ring", "contiguous", 64, 96, dict()),
    ("ring", "zigzag", 128, 128, dict(is_causal=True)),
    ("all_gather", "zigzag", 128, 128, dict(is_causal=True)),
    ("all_gather", "contiguous", 64, 64, dict(local_window_size=(16, 0))),
    ("all_to_all", "contiguous", 64, 64, dict(is_causal=True)),
    ("ring_attention", "zigzag", 128, 128, dict(is_causal=True)),
]


@pytest.mark.parametrize("strategy,layout,t,s,options", SHARD_MAP_CASES,
                         ids=[f"{st}-{l}-T{t}-S{s}-{'-'.join(o) or 'full'}"
                              for st, l, t, s, o in SHARD_MAP_CASES])
def test_shard_map_entry_points_drop_as_one_device(strategy, layout, t, s, options):
  """context_parallel_attention (every strategy) and ring_attention inside shard_map take
  dropout_rate and dropout_key and drop what dot_product_attention on one device drops (rows
  and keys at their global positions; the batch and heads are not sharded here, so their
  indices are the global ones): output and gradients."""
  from jax.sharding import PartitionSpec as P
  mesh = _two_device_mesh()
  key = jax.random.key(21)
  q, _, _ = _qkv((2, t, 2, 16), kv_heads=1, seed=3)
  _, k, v = _qkv((2, s, 2, 16), kv_heads=1, seed=4)
  order = jax_flash.zigzag_indices(t, 2) if layout == "zigzag" else np.arange(t)
  k_order = jax_flash.zigzag_indices(s, 2) if layout == "zigzag" else np.arange(s)

  def one_device(q, k, v):
    out = jax_flash.dot_product_attention(q, k, v, dropout_rate=0.25, dropout_key=key,
                                          implementation="cpu", **options)
    return jnp.sum(out * jnp.cos(out))

  def local(q, k, v):
    if strategy == "ring_attention":
      return jax_flash.ring_attention(q, k, v, axis_name="x", layout=layout, dropout_rate=0.25,
                                      dropout_key=key, implementation="cpu", **options)
    return jax_flash.context_parallel_attention(
        q, k, v, axis_name="x", strategy=strategy, layout=layout, dropout_rate=0.25,
        dropout_key=key, implementation="cpu", **options)

  spec = P(None, "x", None, None)
  sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

  def loss(q, k, v):
    out = sharded(q, k, v)
    return jnp.sum(out * jnp.cos(out))

  want, want_g = jax.jit(jax.value_and_grad(one_device, (0, 1, 2)))(q, k, v)
  got, got_g = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q[:, order], k[:, k_order],
                                                            v[:, k_order])
  np.testing.assert_allclose(got, want, rtol=1e-5)
  back = (np.argsort(order), np.argsort(k_order), np.argsort(k_order))
  for a, b, index in zip(got_g, want_g, back):
    np.testing.assert_allclose(np.asarray(a)[:, index], b, atol=2e-5)


def test_shard_map_dropout_folds_the_other_axes_into_the_key():
  """With the batch sharded over a data axis beside the sequence's (a 2 x 2 mesh), each data
  shard numbers its batch from 0, so its key is folded with its index along the data axis:
  shard d drops what one device drops with jax.random.fold_in(key, d) over its own batch
  elements (and the two shards draw different masks)."""
  from jax.sharding import Mesh, PartitionSpec as P
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "seq"))
  key = jax.random.key(8)
  q, k, v = _qkv((2, 64, 2, 16), kv_heads=1, seed=9)
  spec = P("data", "seq", None, None)
  local = lambda q, k, v: jax_flash.context_parallel_attention(
      q, k, v, axis_name="seq", strategy="ring", dropout_rate=0.4, dropout_key=key,
      implementation="cpu")
  got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(q, k, v)
  for d in range(2):
    want = jax_flash.dot_product_attention(q[d:d + 1], k[d:d + 1], v[d:d + 1], dropout_rate=0.4,
                                           dropout_key=jax.random.fold_in(key, d),
                                           implementation="cpu")
    np.testing.assert_allclose(got[d:d + 1], want, rtol=1e-5, atol=1e-6)
  unfolded = jax_flash.dot_product_attention(q[1:], k[1:], v[1:], dropout_rate=0.4,
                                             dropout_key=key, implementation="cpu")
  assert not np.allclose(got[1:], unfolded, atol=1e-3)


def test_shard_map_dropout_off_the_groups_is_refused():
  """Inside shard_map a ring or all-gather whose slices do not start dropout's 16 x 16 groups
  raises ValueError naming dropout_rate (24-row slices); a missing key raises naming
  dropout_key, as dot_product_attention does."""
  from jax.sharding import PartitionSpec as P
  mesh = _two_device_mesh()
  q, k, v = _qkv((1, 48, 2, 16), kv_heads=1)
  spec = P(None, "x", None, None)

  def run(**kwargs):
    local = lambda q, k, v: jax_flash.context_parallel_attention(
        q, k, v, axis_name="x", dropout_rate=0.25, implementation="cpu", **kwargs)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)

  for strategy in ("ring", "all_gather"):
    with pytest.raises(ValueError, match="dropout_rate=0.25 needs each device's query slice"):
      run(strategy=strategy, dropout_key=jax.random.key(0))
  with pytest.raises(ValueError, match="dropout_key"):
    run(strategy="all_to_all")


# ---------------------------------------------------------------------------------------------
# Flax


def _flax():
  pytest.importorskip("flax")
  import jax_flash.flax as jflax
  return jflax


@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("implementation", ["cpu", "xla"])
def test_flax_function_drops_as_flax(implementation, broadcast):
  """jax_flash.flax.dot_product_attention with dropout_rng, deterministic=False and any number
  of batch dims: broadcast_dropout=False is the core call's mask (per batch element and head,
  the batch dims folded in order); True one (T, S) mask for every batch element and head, as
  Flax shares its mask: keep_mask(key, rate, 1, 1, T, S)[0, 0]. deterministic=True: none."""
  jflax = _flax()
  q, k, v = _qkv((6, 21, 4, 16), kv_heads=2)
  q, k, v = (x.reshape(2, 3, *x.shape[1:]) for x in (q, k, v))
  key, rate = jax.random.key(9), 0.4
  got = jax.jit(functools.partial(
      jflax.dot_product_attention, dropout_rate=rate, broadcast_dropout=broadcast,
      deterministic=False, implementation=implementation))(q, k, v, dropout_rng=key)

  @jax.jit
  def reference(q, k, v, keep):
    keep = jnp.broadcast_to(keep, (6, 4, 21, 21)).reshape(2, 3, 4, 21, 21)
    s = jnp.einsum("...tnh,...snh->...nts", q, jnp.repeat(k, 2, axis=-2),
                   precision="highest") / 4.0
    p = jax.nn.softmax(s, axis=-1) * keep / (1 - rate)
    return jnp.einsum("...nts,...snh->...tnh", p, jnp.repeat(v, 2, axis=-2),
                      precision="highest")
  keep = _dropout.keep_mask(key, rate, 1 if broadcast else 6, 1 if broadcast else 4, 21, 21)
  np.testing.assert_allclose(got, reference(q, k, v, keep), atol=2e-6)
  off = jflax.dot_product_attention(q, k, v, dropout_rng=key, dropout_rate=rate,
                                    broadcast_dropout=broadcast, deterministic=True)
  np.testing.assert_array_equal(off, jflax.dot_product_attention(q, k, v))


def test_flax_function_needs_the_rng_only_when_dropout_applies(monkeypatch):
  jflax = _flax()
  q, _, _ = _qkv((2, 9, 4, 16), kv_heads=2)
  with pytest.raises(ValueError, match="dropout_rate=0.1, deterministic=False.*dropout_rng is "
                                       "None"):
    jflax.dot_product_attention(q, q, q, dropout_rate=0.1, deterministic=False)
  jflax.dot_product_attention(q, q, q, dropout_rate=0.1, deterministic=True)
  with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
    jflax.dot_product_attention(q, q, q, dropout_rate=1.5, deterministic=False,
                                dropout_rng=jax.random.key(0))
  # Where None picks the CUDA kernels, the Flax function refuses dropout by the same rule.
  monkeypatch.setattr(_dispatch, "default_implementation", lambda dtype: "cuda")
  with pytest.raises(NotImplementedError, match="take no dropout_rate yet; got "
                                                "dropout_rate=0.1"):
    jflax.dot_product_attention(q.astype(jnp.bfloat16), q, q, dtype=jnp.bfloat16,
                                dropout_rate=0.1, deterministic=False,
                                dropout_rng=jax.random.key(0))


def test_linen_module_drops_as_the_stock_module_draws_its_rng():
  """FlashMultiHeadDotProductAttention draws the key as nn.MultiHeadDotProductAttention does
  (the call's dropout_rng, else make_rng("dropout")): the stock module with the flash
  attention_fn gives the same output; two rngs give different outputs; deterministic=True none.
  """
  jflax = _flax()
  import flax.linen as nn
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 17, 32)), F32)
  flash = jflax.FlashMultiHeadDotProductAttention(num_heads=4, dropout_rate=0.3,
                                                  broadcast_dropout=False)
  stock = nn.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.3, broadcast_dropout=False,
                                          attention_fn=jflax.dot_product_attention)
  variables = flash.init(jax.random.key(0), x, deterministic=True)
  rngs = {"dropout": jax.random.key(1)}
  a = flash.apply(variables, x, deterministic=False, rngs=rngs)
  np.testing.assert_allclose(stock.apply(variables, x, deterministic=False, rngs=rngs), a,
                             atol=1e-6)
  b = flash.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
  assert np.max(np.abs(np.asarray(a - b))) > 1e-2
  explicit = flash.apply(variables, x, deterministic=False, dropout_rng=jax.random.key(7))
  np.testing.assert_array_equal(
      explicit, flash.apply(variables, x, deterministic=False, dropout_rng=jax.random.key(7),
                            rngs=rngs))  # an explicit dropout_rng takes precedence
  none = flash.apply(variables, x, deterministic=True)
  assert np.max(np.abs(np.asarray(a - none))) > 1e-2


def test_nnx_module_drops_with_its_rngs():
  """FlashMultiHeadAttention takes the key as nnx.MultiHeadAttention does: from the call's
  rngs (an nnx.Rngs' dropout stream), else the constructor's (keep_rngs); without either a
  ValueError names rngs. Gradients flow through the dropped weights."""
  jflax = _flax()
  from flax import nnx
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 17, 32)), F32)
  flash = jflax.FlashMultiHeadAttention(num_heads=4, in_features=32, dropout_rate=0.3,
                                        decode=False, rngs=nnx.Rngs(0, dropout=5))
  stock = nnx.MultiHeadAttention(num_heads=4, in_features=32, dropout_rate=0.3, decode=False,
                                 attention_fn=jflax.dot_product_attention,
                                 rngs=nnx.Rngs(0, dropout=5))
  a = flash(x, deterministic=False, rngs=nnx.Rngs(dropout=3))
  np.testing.assert_allclose(stock(x, deterministic=False, rngs=nnx.Rngs(dropout=3)), a,
                             atol=1e-6)
  kept_rngs = flash(x, deterministic=False)  # the constructor's stream
  assert np.max(np.abs(np.asarray(a - kept_rngs))) > 1e-2
  assert np.max(np.abs(np.asarray(a - flash(x, deterministic=True)))) > 1e-2
  no_rngs = jflax.FlashMultiHeadAttention(num_heads=4, in_features=32, dropout_rate=0.3,
                                          decode=False, keep_rngs=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rngs"):
    no_rngs(x, deterministic=False)
  grads = nnx.grad(lambda m: jnp.sum(m(x, deterministic=False, rngs=nnx.Rngs(dropout=3)) ** 2))(
      flash)
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
