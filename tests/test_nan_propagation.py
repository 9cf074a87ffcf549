"""A NaN or inf in the inputs shows up in the outputs, on every implementation (issue 13, (c)).

One element of q, k or v is poisoned (NaN, +inf, -inf), or query/key rows are made so large
that their scores overflow float32. Every result (out, lse, dq, dk, dv) of each implementation
("cpu", "xla", "blockwise", ring attention on simulated CPU devices, "cuda" on a GPU) is checked
element by element against an exact reference: attention computed row by row over the keys
each row may see (in float64, from float32 scores), which is what the poisoned inputs mean when
masked pairs take no part. jax.nn.dot_product_attention is checked against the same reference
by the same rules (its rows with no key aside), so an implementation that passes agrees with
jax.nn on every element that truly depends on the poison:

* where the reference is NaN or inf, the result is NaN or inf: never a 0, or any number;
* where the reference is finite (a -inf score is only a zero probability), the result matches
  it, with one exception. A masked (query, key) pair has probability 0, and 0 times a NaN or
  inf is NaN: a matrix product that multiplies such a zero by a poisoned row (the plain-XLA
  paths always do, the kernels within the key blocks they read, jax.nn as its matrix product
  happens to treat 0 * NaN) may turn elements NaN that do not depend on the poisoned one:
  output columns of a poisoned value column, dq of rows beside a poisoned key or value, dk/dv
  of keys beside a poisoned query or a row with NaN probabilities, in the same batch element
  and kv head. Those may be NaN (never another number); nothing else may;
* rows the masks leave without a key give exactly 0 (out, dq) and the empty-row lse, whatever
  the inputs hold.

Poisoned outputs: the kernels' outputs are written into buffers pre-filled with NaN (donated to
the call, so XLA hands the kernel that memory), and every element must be overwritten.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_flash
from attention_testing import key_visibility, random_array
from jax_flash import _blockwise, _ops
from jax_flash._reference import EMPTY_ROW_LSE

B, T, S, N, K, H = 2, 72, 72, 4, 2, 16  # S spans two of the CPU kernel's key blocks
GROUP = N // K
RING_DEVICES = 4
NAMES = ("out", "lse", "dq", "dk", "dv")

MASKS = {
    "full": {},
    "causal_lengths": dict(is_causal=True, query_seq_lengths=(72, 50),
                           key_value_seq_lengths=(72, 30)),
    "window": dict(local_window_size=(4, 2)),
}


@dataclasses.dataclass(frozen=True)
class Poison:
  """Elements set to a bad value: (array, (batch, position, head, column), value) each; a column
  of None sets the whole row (value may then be "overflow": see poisoned())."""

  name: str
  elements: tuple
  compare_affected: bool = True  # whether affected elements jax.nn keeps finite are compared


POISONS = [
    Poison("q_nan", (("q", (0, 5, 1, 3), np.nan),)),
    Poison("q_inf", (("q", (1, 7, 2, 0), np.inf),)),
    Poison("q_nan_in_padding_row", (("q", (1, 60, 0, 0), np.nan),)),
    Poison("k_nan", (("k", (0, 3, 1, 5), np.nan),)),
    Poison("k_inf", (("k", (1, 4, 0, 2), np.inf),)),
    Poison("k_neg_inf", (("k", (0, 6, 0, 1), -np.inf),)),
    Poison("v_nan", (("v", (0, 2, 1, 7), np.nan),)),
    Poison("v_inf", (("v", (1, 5, 0, 3), np.inf),)),
    Poison("v_nan_past_kv_length", (("v", (1, 65, 0, 0), np.nan),)),
    # Query row 9 of head 3 (kv head 1) scores +inf against key 8: 1e38 * |k| summed.
    Poison("overflowing_scores", (("q", (0, 9, 3, None), "overflow"),)),
    # |q|, |k| = 1e19 in one row each: their product overflows. Every row of kv head 1 sees key
    # 8's huge logits, finite but so ill-conditioned that only the NaN pattern is compared there.
    # float16 holds no 1e19 (it would pass inf to the kernel and 1e19 to the reference): 2^15
    # there, whose logits (~4e9 in the poisoned row) still need the softmax's exact path.
    Poison("overflowing_q_and_k", (("q", (0, 9, 3, None), 1e19), ("k", (0, 8, 1, None), 1e19)),
           compare_affected=False),
]


def _clean_inputs(dtype):
  """(q, k, v as float32 numpy arrays holding values of `dtype`, the float32 cotangent g)."""
  rng = np.random.default_rng(13)
  arrays = {}
  for name, shape in (("q", (B, T, N, H)), ("k", (B, S, K, H)), ("v", (B, S, K, H))):
    arrays[name] = np.array(random_array(rng, shape, dtype).astype(jnp.float32))
  return arrays, np.asarray(random_array(rng, (B, T, N, H), jnp.float32))


def poisoned(poison: Poison | None, dtype) -> dict:
  """q, k, v (as _clean_inputs) with `poison` applied (None: clean)."""
  arrays, _ = _clean_inputs(dtype)
  for name, (b, pos, head, col), value in (poison.elements if poison else ()):
    if isinstance(value, str):  # "overflow": 1e38 with the signs of key 8 (kv head 1)
      arrays[name][b, pos, head] = 1e38 * np.sign(arrays["k"][0, 8, 1])
    elif col is None:
      arrays[name][b, pos, head] = _held_by(value, dtype)
    else:
      arrays[name][b, pos, head, col] = _held_by(value, dtype)
  return arrays


def _held_by(value: float, dtype) -> float:
  """`value`, or where it is finite but past `dtype`'s range the largest power of two the dtype
  holds: the implementations and the exact reference then see the same input."""
  info = jnp.finfo(dtype)
  if np.isfinite(value) and abs(value) > float(info.max):
    return float(np.copysign(2.0 ** (info.maxexp - 1), value))
  return value


# ---------------------------------------------------------------------------------------------
# Which results depend on the poisoned elements (from the masks alone)


def visibility(mask: str) -> np.ndarray:
  """(B, T, S) bool: key j is visible to query row i of batch element b."""
  o = MASKS[mask]
  vis = key_visibility(np, T, S, o.get("query_seq_lengths"), o.get("key_value_seq_lengths"),
                       o.get("is_causal", False), o.get("local_window_size"))
  return np.broadcast_to(vis, (B, T, S))


def affected(mask: str, poison: Poison) -> dict:
  """For each result, a bool array: the elements that depend on a poisoned input element.

  A query row's probabilities depend on its q row and on the k rows it sees; its output on
  those and the v rows it sees; its lse not on v. dq of a row depends on everything its output
  does; dk and dv of a key on every row that sees it, through that row's probabilities (dv) or
  probabilities and output (dk)."""
  vis = visibility(mask)
  prob_rows = np.zeros((B, T, N), bool)  # rows whose probabilities (and lse) are affected
  value_rows = np.zeros((B, T, N), bool)  # rows whose output is affected through v only
  value_cols = np.zeros((B, T, N, H), bool)  # ... in these columns
  for name, (b, pos, head, col), _ in poison.elements:
    cols = slice(None) if col is None else slice(col, col + 1)
    if name == "q":
      prob_rows[b, pos, head] |= vis[b, pos].any()
      continue
    for n in range(head * GROUP, (head + 1) * GROUP):  # the query heads of kv head `head`
      if name == "k":
        prob_rows[b, :, n] |= vis[b, :, pos]
      else:
        value_rows[b, :, n] |= vis[b, :, pos]
        value_cols[b, :, n, cols] |= vis[b, :, pos, None]
  result = {
      "out": prob_rows[..., None] | value_cols,
      "lse": prob_rows.copy(),
      "dq": np.broadcast_to((prob_rows | value_rows)[..., None], (B, T, N, H)).copy(),
      "dk": np.zeros((B, S, K, H), bool),
      "dv": np.zeros((B, S, K, H), bool),
  }
  for n in range(N):
    # keys seen by an affected row: (B, S)
    seen_by_prob = np.any(vis & prob_rows[:, :, n, None], axis=1)
    seen_by_value = np.any(vis & value_rows[:, :, n, None], axis=1)
    result["dk"][:, :, n // GROUP] |= (seen_by_prob | seen_by_value)[..., None]
    result["dv"][:, :, n // GROUP] |= seen_by_prob[..., None]
  return result


def masked_products(mask: str, poison: Poison) -> dict:
  """For each result, the elements a masked pair's 0 times a poisoned row may turn NaN (see the
  module docstring): in the poisoned batch element and kv head only, never lse."""
  prob_rows = affected(mask, poison)["lse"]  # rows whose probabilities may be NaN
  result = {name: np.zeros(shape, bool) for name, shape in (
      ("out", (B, T, N, H)), ("lse", (B, T, N)), ("dq", (B, T, N, H)), ("dk", (B, S, K, H)),
      ("dv", (B, S, K, H)))}
  for name, (b, _, head, col), _ in poison.elements:
    kv = head // GROUP if name == "q" else head
    heads = slice(kv * GROUP, (kv + 1) * GROUP)
    cols = slice(None) if col is None else slice(col, col + 1)
    if name == "v":
      result["out"][b, :, heads, cols] = True
    if name in ("k", "v"):
      result["dq"][b, :, heads] = True
    result["dk"][b, :, kv] = True
    if prob_rows[b, :, heads].any():
      result["dv"][b, :, kv] = True
  return result


def empty_rows(mask: str) -> np.ndarray:
  """(B, T, N) bool: rows the masks leave without a key."""
  return np.broadcast_to(~visibility(mask).any(axis=-1)[..., None], (B, T, N))


# ---------------------------------------------------------------------------------------------
# The exact reference


@functools.lru_cache(maxsize=None)
def exact_results(mask: str, poison_name: str | None, dtype=jnp.float32) -> tuple:
  """(out, lse, dq, dk, dv) for the loss sum(out * g), computed row by row over the keys each
  row may see: scores q.k in float32 (where overflow happens as in the implementations), the
  rest in float64. Rows with no key: 0 output and gradient, EMPTY_ROW_LSE."""
  poison = None if poison_name is None else {p.name: p for p in POISONS}[poison_name]
  arrays, g = poisoned(poison, dtype), _clean_inputs(dtype)[1].astype(np.float64)
  q, k, v = (arrays[n] for n in "qkv")
  scale = 1.0 / np.sqrt(H)
  vis = visibility(mask)
  out, dq = np.zeros((B, T, N, H)), np.zeros((B, T, N, H))
  lse = np.full((B, T, N), EMPTY_ROW_LSE)
  dk, dv = np.zeros((B, S, K, H)), np.zeros((B, S, K, H))
  with np.errstate(all="ignore"):
    for b, n, i in np.ndindex(B, N, T):
      keys = np.flatnonzero(vis[b, i])
      if not keys.size:
        continue
      c = n // GROUP
      q_i, k_j, v_j, g_i = q[b, i, n], k[b, keys, c], v[b, keys, c], g[b, i, n]
      scores = (k_j @ q_i).astype(np.float64) * scale  # float32 products and sums
      top = np.max(scores)  # NaN if any score is
      e = np.exp(scores - top)
      probs = e / np.sum(e)
      out[b, i, n] = probs @ v_j.astype(np.float64)
      lse[b, i, n] = top + np.log(np.sum(e))
      d_scores = probs * (v_j.astype(np.float64) @ g_i - g_i @ out[b, i, n]) * scale
      dq[b, i, n] = d_scores @ k_j
      dk[b, keys, c] += np.outer(d_scores, q_i)
      dv[b, keys, c] += np.outer(probs, g_i)
  return out, lse, dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Running the implementations: (out, lse, dq, dk, dv) of loss sum(out * g), as float32 numpy


def _options(mask: str) -> dict:
  options = dict(MASKS[mask])
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if name in options:
      options[name] = jnp.asarray(options[name], jnp.int32)
  return options


def _results(attention, q, k, v, g):
  def loss(q, k, v):
    out, lse = attention(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * g), (out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return (out, lse, *grads)


def _ring(mask: str, implementation: str):
  if len(jax.devices()) < RING_DEVICES:
    pytest.skip(f"needs {RING_DEVICES} devices")
  mesh = Mesh(np.array(jax.devices()[:RING_DEVICES]), ("seq",))
  spec = P(None, "seq", None, None)
  options = _options(mask)

  def local(q, k, v):
    return jax_flash.ring_attention(q, k, v, axis_name="seq", implementation=implementation,
                                    return_residual=True, **options)

  return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3,
                       out_specs=(spec, P(None, "seq", None)))


@functools.lru_cache(maxsize=None)
def _compiled(implementation: str, mask: str):
  """The jitted results function of `implementation` for the mask: "jax.nn", "ring_cpu" (ring
  attention on the CPU kernels), "blockwise_block16" (the blockwise path with key blocks of
  16: see run()) or an implementation name."""
  options = _options(mask)
  if implementation == "jax.nn":
    def attention(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, implementation="xla", return_residual=True,
                                          **options)
  elif implementation.startswith("ring_"):
    attention = _ring(mask, implementation.removeprefix("ring_"))
  else:
    def attention(q, k, v):
      return jax_flash.dot_product_attention(
          q, k, v, implementation=implementation.removesuffix("_block16"),
          return_residual=True, **options)
  return jax.jit(functools.partial(_results, attention))


def run(implementation: str, mask: str, poison: Poison | None, dtype, monkeypatch) -> list:
  if implementation.endswith("_block16"):
    monkeypatch.setattr(_blockwise, "KEY_BLOCK", 16)  # read when the call is first traced
  arrays, g = poisoned(poison, dtype), _clean_inputs(dtype)[1]
  q, k, v = (jnp.asarray(arrays[n], dtype) for n in "qkv")
  results = _compiled(implementation, mask)(q, k, v, jnp.asarray(g))
  return [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in results]


# ---------------------------------------------------------------------------------------------
# The checks


def _tolerance(dtype, reference: np.ndarray) -> tuple[float, float]:
  finite = np.abs(reference[np.isfinite(reference)])
  magnitude = float(np.max(finite)) if finite.size else 1.0
  if jnp.dtype(dtype) == jnp.float32:
    return 1e-4, 1e-5 * magnitude + 1e-6
  return 3e-2, 3e-2 * magnitude + 1e-3


def check_poisoned(implementation, mask, poison, dtype, monkeypatch, empty_rows_zero=True):
  """The rules of the module docstring for one implementation and one poisoned input."""
  got = run(implementation, mask, poison, dtype, monkeypatch)
  exact = exact_results(mask, poison.name, jnp.dtype(dtype))
  depends = affected(mask, poison)
  may_be_nan = masked_products(mask, poison)
  empty = empty_rows(mask)

  for name, x, want in zip(NAMES, got, exact):
    bad, want_bad = ~np.isfinite(x), ~np.isfinite(want)
    live = np.ones(x.shape, bool)
    if name in ("out", "lse", "dq"):
      rows = np.broadcast_to(empty if name == "lse" else empty[..., None], x.shape)
      live = ~rows
      fill = EMPTY_ROW_LSE if name == "lse" else 0.0
      if empty_rows_zero:
        assert np.all(x[rows] == fill), f"{name}: rows with no key must be exactly {fill}"

    missing = want_bad & ~bad & live
    assert not missing.any(), (
        f"{name}: {missing.sum()} element(s) NaN/inf in the exact result but finite here, "
        f"e.g. at {np.argwhere(missing)[0].tolist()} (value {x[tuple(np.argwhere(missing)[0])]})")
    assert not (bad & ~want_bad & live & ~np.isnan(x)).any(), f"{name}: an inf, not a NaN"
    extra = bad & ~want_bad & ~may_be_nan[name] & live
    assert not extra.any(), (
        f"{name}: {extra.sum()} element(s) NaN here that no masked product can reach and the "
        f"exact result has finite, e.g. at {np.argwhere(extra)[0].tolist()}")
    compared = ~bad & ~want_bad & live
    if not poison.compare_affected:  # ill-conditioned where the poison reaches
      compared &= ~depends[name]
    rtol, atol = _tolerance(dtype, want)
    np.testing.assert_allclose(x[compared], want[compared], rtol=rtol, atol=atol,
                               err_msg=f"{name}: finite elements")


CPU_IMPLEMENTATIONS = ["cpu", "xla", "blockwise", "blockwise_block16"]


@pytest.mark.parametrize("poison", POISONS, ids=[p.name for p in POISONS])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("implementation", CPU_IMPLEMENTATIONS)
def test_poisoned_inputs(implementation, mask, poison, monkeypatch):
  check_poisoned(implementation, mask, poison, jnp.float32, monkeypatch)


@pytest.mark.parametrize("poison", POISONS, ids=[p.name for p in POISONS])
@pytest.mark.parametrize("mask", ["full", "causal_lengths"])
def test_poisoned_inputs_in_ring_attention(mask, poison, monkeypatch):
  check_poisoned("ring_cpu", mask, poison, jnp.float32, monkeypatch)


# Rows whose logits are finite but ~1e19 (overflowing_q_and_k) came out NaN on the CUDA kernels
# until the softmax formed exp2(s * c - max * c) from the rounded product for such rows (one FFMA
# left the maximum's argument up to half an ulp of max * c, ~1e12, above 0) and the backward
# clamped its argument at 0 (gpu/softmax.cuh, sm90/bwd_steps.cuh; the failures before:
# examples/results/h200/gpu_tests_bf0f5ea.log). Every case is expected to pass.
def _cuda_cases():
  for dtype in ("bfloat16", "float16"):
    for mask in MASKS:
      for poison in POISONS:
        yield pytest.param(dtype, mask, poison, id=f"{dtype}-{mask}-{poison.name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, mask, poison", list(_cuda_cases()))
def test_poisoned_inputs_on_cuda(mask, poison, dtype, monkeypatch):
  check_poisoned("cuda", mask, poison, jnp.dtype(dtype), monkeypatch)


@pytest.mark.parametrize("poison", POISONS, ids=[p.name for p in POISONS])
@pytest.mark.parametrize("mask", list(MASKS))
def test_jax_nn_obeys_the_same_rules(mask, poison, monkeypatch):
  """jax.nn on the same inputs, by the same rules (its rows with no key give the mean of the
  values, and are left out): the reference and the rules describe jax.nn, too."""
  check_poisoned("jax.nn", mask, poison, jnp.float32, monkeypatch, empty_rows_zero=False)


def test_clean_inputs_match_the_exact_reference(monkeypatch):
  """The exact reference itself, on clean inputs, against jax.nn (every element finite)."""
  for mask in MASKS:
    got = run("jax.nn", mask, None, jnp.float32, monkeypatch)
    live = ~empty_rows(mask)
    for name, x, want in zip(NAMES, got, exact_results(mask, None)):
      rows = {"out": live[..., None], "lse": live, "dq": live[..., None]}.get(name, True)
      rows = np.broadcast_to(rows, x.shape)
      np.testing.assert_allclose(x[rows], want[rows], rtol=1e-4, atol=1e-5, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Poisoned outputs: every element of the kernels' outputs is written


def _kernel_outputs_into_poisoned_buffers(implementation: str, dtype, o_float32: bool):
  rng = np.random.default_rng(7)
  q = random_array(rng, (B, T, N, H), dtype)
  k = random_array(rng, (B, S, K, H), dtype)
  v = random_array(rng, (B, S, K, H), dtype)
  d_o = random_array(rng, (B, T, N, H), dtype)
  q_lens = jnp.asarray([T, 50], jnp.int32)
  kv_lens = jnp.asarray([S, 0], jnp.int32)  # batch 1: every row empty
  config = _ops.KernelConfig(implementation, 0.25, True, -1, -1, o_float32=o_float32)
  o_dtype = jnp.float32 if o_float32 else dtype

  def forward(o_buffer, lse_buffer, q, k, v):
    del o_buffer, lse_buffer  # donated: XLA writes the results into their memory
    return _ops.flash_fwd(q, k, v, q_lens, kv_lens, config)

  def backward(dq_buffer, dk_buffer, dv_buffer, q, k, v, o, lse, d_o):
    del dq_buffer, dk_buffer, dv_buffer
    return _ops.flash_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config)

  buffers = [jnp.full(q.shape, jnp.nan, o_dtype), jnp.full((B, N, T), jnp.nan, jnp.float32)]
  addresses = [x.unsafe_buffer_pointer() for x in buffers]
  o, lse = jax.jit(forward, donate_argnums=(0, 1), keep_unused=True)(*buffers, q, k, v)
  results = [o, lse]
  reused = [x.unsafe_buffer_pointer() == a for x, a in zip(results, addresses)]

  buffers = [jnp.full(x.shape, jnp.nan, dtype) for x in (q, k, v)]
  addresses = [x.unsafe_buffer_pointer() for x in buffers]
  grads = jax.jit(backward, donate_argnums=(0, 1, 2), keep_unused=True)(
      *buffers, q, k, v, o, lse, d_o)
  results += list(grads)
  reused += [x.unsafe_buffer_pointer() == a for x, a in zip(grads, addresses)]
  return results, reused


@pytest.mark.parametrize("dtype,o_float32", [("float32", False), ("bfloat16", False),
                                             ("bfloat16", True)],
                         ids=["float32", "bfloat16", "bfloat16_o_float32"])
def test_cpu_kernels_write_every_output_element(dtype, o_float32):
  """Outputs pre-filled with NaN are overwritten everywhere: rows past the query length, rows
  of a batch element with no keys (0 and the empty-row lse), dk/dv of keys no row sees; o in
  the input dtype, or in float32 as a differentiated call's forward writes it."""
  results, reused = _kernel_outputs_into_poisoned_buffers("cpu", jnp.dtype(dtype), o_float32)
  if not all(reused):
    pytest.skip("XLA did not hand the donated buffers to the kernels here")
  for name, x in zip(NAMES, results):
    assert np.all(np.isfinite(np.asarray(x, np.float32))), f"{name} has unwritten elements"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("o_float32", [False, True])
def test_cuda_kernels_write_every_output_element(dtype, o_float32):
  results, reused = _kernel_outputs_into_poisoned_buffers("cuda", jnp.dtype(dtype), o_float32)
  if not all(reused):
    pytest.skip("XLA did not hand the donated buffers to the kernels here")
  for name, x in zip(NAMES, results):
    assert np.all(np.isfinite(np.asarray(x, np.float32))), f"{name} has unwritten elements"
