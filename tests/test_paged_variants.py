"""jax_flash.paged_attention with logits_soft_cap, sinks and alibi_slopes (issue 17: the same
arguments in every entry point).

The reference is built here from the definitions, independently of jax_flash: each sequence's
pages gathered in numpy (tests/test_paged.py's construction), query row t of sequence b at
position p = kv_lengths[b] - T + t (bottom-right, as paged_attention's masks place it), scores
s = scale * q.k, capped c * tanh(s / c), biased by slope[h] * (j - p), masked, and the sink of
head h one more column of the softmax with no value. Results are held to the rule of
attention_testing (2x the error of the same math in the input dtype); rows with no key give 0
and EMPTY_ROW_LSE, or lse sinks[h] with sinks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from attention_testing import HIGHEST, assert_within_rule, random_array, rounded
from jax_flash import _dispatch, _paged
from jax_flash._reference import EMPTY_ROW_LSE
from test_paged import P, contiguous, paged_mask

F32 = jnp.float32
MASKED = -0.7 * float(np.finfo(np.float32).max)

# Each variant alone and all three together: (cap, sinks given, slopes given).
VARIANTS = {"cap": (5.0, False, False), "sinks": (None, True, False),
            "alibi": (None, False, True), "all": (2.0, True, True)}


def variant_arguments(case, name: str) -> dict:
  """The keyword arguments of variant `name` for `case`: sinks around 1 (so that they matter
  beside the scores), the ALiBi paper's slopes for N heads."""
  cap, with_sinks, with_slopes = VARIANTS[name]
  heads = case.heads_q
  sinks = jnp.asarray(np.linspace(-1.0, 3.0, heads), case.dtype) if with_sinks else None
  slopes = jnp.asarray(2.0 ** (-8.0 * np.arange(1, heads + 1) / heads), F32) if with_slopes else None
  return dict(logits_soft_cap=cap, sinks=sinks, alibi_slopes=slopes)


def positions(case) -> np.ndarray:
  """(B, T): each query row's position among its sequence's keys (the last T)."""
  lens = np.clip(np.asarray(case.kv_lens), 0, case.seq_k)
  return lens[:, None] - case.seq_q + np.arange(case.seq_q)[None, :]


@functools.cache
def references(case, variant: str):
  """(ref32, refd): reference() of `variant` in float32, and rounded to the case's dtype
  (ref32 itself for float32), each (out, lse) as float64 numpy arrays."""
  arguments = variant_arguments(case, variant)
  ref32 = reference(case, **arguments)
  if case.dtype == "float32":
    return ref32, ref32
  return ref32, reference(case, dtype=jnp.dtype(case.dtype), **arguments)


def reference(case, *, logits_soft_cap=None, sinks=None, alibi_slopes=None, dtype=None):
  """(out (B, T, N, H) float32, lse (B, T, N)) from the definition on the upcast inputs; with
  `dtype` the scores, each variant's result and the probabilities rounded to it."""
  q, kp, vp, table, _ = case.inputs()
  k, v = (jnp.asarray(contiguous(x, table, case.page_size)) for x in (kp, vp))
  return _definition(case, q, k, v, sinks, alibi_slopes, logits_soft_cap=logits_soft_cap,
                     dtype=dtype)


@functools.partial(jax.jit, static_argnames=("case", "logits_soft_cap", "dtype"))
def _definition(case, q, k, v, sinks, alibi_slopes, *, logits_soft_cap, dtype):
  rnd = (lambda x: x) if dtype is None else (lambda x: rounded(x, dtype))  # noqa: E731
  group = case.heads_q // case.heads_k
  q5 = q.astype(F32).reshape(case.batch, case.seq_q, case.heads_k, group, case.head_dim)
  s = rnd(jnp.einsum("btkgh,bskh->bkgts", q5, k, precision=HIGHEST) / np.sqrt(case.head_dim))
  if logits_soft_cap is not None:
    s = rnd(logits_soft_cap * jnp.tanh(s / logits_soft_cap))
  if alibi_slopes is not None:
    distance = np.arange(case.seq_k)[None, None, :] - positions(case)[:, :, None]  # (B, T, S)
    slopes5 = alibi_slopes.astype(F32).reshape(1, case.heads_k, group, 1, 1)
    s = rnd(s + slopes5 * jnp.asarray(distance, F32)[:, None, None])
  vis = jnp.asarray(paged_mask(case))[:, None, None]  # (B, 1, 1, T, S)
  scores = jnp.where(vis, s, MASKED)
  if sinks is not None:
    column = jnp.broadcast_to(sinks.astype(F32).reshape(1, case.heads_k, group, 1, 1),
                              (*scores.shape[:-1], 1))
    scores = jnp.concatenate([scores, column], axis=-1)
  p = rnd(jax.nn.softmax(scores, axis=-1)[..., :case.seq_k])
  out = jnp.einsum("bkgts,bskh->btkgh", p, v, precision=HIGHEST)
  out = out.reshape(case.batch, case.seq_q, case.heads_q, case.head_dim)
  lse = jax.nn.logsumexp(scores, axis=-1).reshape(case.batch, case.heads_q, case.seq_q)
  return out, jnp.swapaxes(lse, -1, -2)


def check(case, variant: str, out, lse) -> None:
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
  (out32, lse32), (outd, lsed) = (
      [np.asarray(x, np.float64) for x in ref] for ref in references(case, variant))
  live = paged_mask(case).any(-1)  # (B, T)
  assert_within_rule("out", out, out32, outd, live[..., None, None])
  sinks = variant_arguments(case, variant)["sinks"]
  if sinks is None:
    assert_within_rule("lse", lse, lse32, lsed, live[..., None])
    assert np.all(lse[~live] == EMPTY_ROW_LSE)
  else:  # a row with no key: its lse is its head's sink, exactly
    assert_within_rule("lse", lse, lse32, lsed)
    empty = np.broadcast_to(~live[..., None], lse.shape)
    sink_lse = np.broadcast_to(np.asarray(sinks.astype(F32), np.float64), lse.shape)
    assert np.all(lse[empty] == sink_lse[empty])
  assert np.all(out[~live] == 0), "rows with no key must be exactly 0"


CASES = [
    # GQA 4, T = 1 (the paged decode kernel), one sequence ending mid-page.
    P(batch=2, heads_q=8, heads_k=2, head_dim=32, page_size=16, pages_per_seq=6,
      kv_lens=(96, 41)),
    # Speculative decoding, ragged with a length below T (rows that see no key) and one of 0.
    P(batch=3, seq_q=3, heads_q=4, heads_k=1, head_dim=40, page_size=8, pages_per_seq=5,
      kv_lens=(40, 2, 0), is_causal=True, dtype="bfloat16"),
    # Chunked prefill: 40 * 2 packed rows per kv head, past the decode kernel's tile; a window.
    P(batch=2, seq_q=40, heads_q=4, heads_k=2, head_dim=16, page_size=16, pages_per_seq=5,
      kv_lens=(80, 50), is_causal=True, local_window_size=(30, 0)),
]


def _case_id(case) -> str:
  return f"t{case.seq_q}_n{case.heads_q}k{case.heads_k}_{case.dtype}"


def run(case, implementation: str, variant: str | None = None):
  """(out, lse) of paged_attention with `variant`'s arguments (none for None), jitted."""
  arguments = {} if variant is None else variant_arguments(case, variant)
  return jax.jit(lambda *a: jax_flash.paged_attention(
      *a, implementation=implementation, return_residual=True, **case.options(), **arguments))(
          *case.inputs())


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("implementation", ["cpu", "xla"])
def test_against_the_reference(implementation, case, variant):
  out, lse = run(case, implementation, variant)
  assert out.dtype == jnp.dtype(case.dtype) and lse.dtype == F32
  check(case, variant, out, lse)


def test_the_variants_change_the_result():
  """Each argument moves the output (the tests above would pass an ignored argument only if
  the reference ignored it too)."""
  case = CASES[0]
  base = reference(case)[0]
  for variant in VARIANTS:
    moved = references(case, variant)[0][0] - base
    assert float(jnp.max(jnp.abs(moved))) > 1e-2, variant


@pytest.mark.parametrize("implementation", ["cpu", "xla"])
def test_a_decode_step_equals_the_full_causal_forward(implementation):
  """ALiBi's positions, the cap and the sinks as dot_product_attention's: row p of the full
  causal call (T = S: top-left and bottom-right coincide) == a causal paged step of the rows
  p - 1, p at kv length p + 1."""
  case = P(batch=2, heads_q=4, heads_k=2, head_dim=32, page_size=16, pages_per_seq=4,
           kv_lens=(64, 64))
  q_full = random_array(np.random.default_rng(5), (2, 64, 4, 32), F32)
  _, kp, vp, table, _ = case.inputs()
  k, v = (jnp.asarray(contiguous(x, table, case.page_size)) for x in (kp, vp))
  arguments = variant_arguments(case, "all")
  full, full_lse = jax_flash.dot_product_attention(q_full, k, v, is_causal=True,
                                                   return_residual=True, **arguments)
  step = jax.jit(lambda q, lens: jax_flash.paged_attention(
      q, kp, vp, table, lens, is_causal=True, implementation=implementation,
      return_residual=True, **arguments))
  for p in (1, 16, 63):
    out, lse = step(q_full[:, p - 1:p + 1], jnp.full((2,), p + 1, jnp.int32))
    np.testing.assert_allclose(out, full[:, p - 1:p + 1], atol=3e-6)
    np.testing.assert_allclose(lse, full_lse[:, p - 1:p + 1], atol=3e-6)


def test_differentiation():
  """"xla" differentiates q and the sinks (not the slopes: constants, as in
  dot_product_attention); the kernels are forward only, but the sinks, joined to their result
  in XLA, get their gradient there too: the same as on "xla"."""
  case = CASES[0]
  q, kp, vp, table, lens = case.inputs()

  def loss(implementation, variant, q, sinks):
    arguments = dict(variant_arguments(case, variant), sinks=sinks)
    out = jax_flash.paged_attention(q, kp, vp, table, lens, implementation=implementation,
                                    **arguments)
    return jnp.sum(out * jnp.arange(out.shape[-1]))

  sinks = variant_arguments(case, "all")["sinks"]
  dq, dsinks = jax.jit(jax.grad(functools.partial(loss, "xla", "all"), argnums=(0, 1)))(q, sinks)
  assert np.all(np.isfinite(dq)) and np.all(dsinks != 0)
  for variant in ("sinks", "all"):  # the paged decode kernel; the gathered path
    kernel = jax.jit(jax.grad(functools.partial(loss, "cpu", variant), argnums=1))(q, sinks)
    xla = jax.jit(jax.grad(functools.partial(loss, "xla", variant), argnums=1))(q, sinks)
    np.testing.assert_allclose(kernel, xla, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="forward only"):
      jax.grad(functools.partial(loss, "cpu", variant))(q, sinks)


# What dot_product_attention refuses, refused by paged_attention in the same words.
BAD = [
    dict(logits_soft_cap=0.0), dict(logits_soft_cap=-1.0), dict(logits_soft_cap=float("nan")),
    dict(logits_soft_cap="x"), dict(logits_soft_cap=jnp.float32(2.0)),
    dict(sinks=jnp.zeros((3,))), dict(sinks=jnp.zeros(())), dict(sinks=jnp.zeros((8,), jnp.int32)),
    dict(alibi_slopes=jnp.zeros((1,))), dict(alibi_slopes=jnp.zeros((2, 8))),
    dict(alibi_slopes=jnp.zeros((8,), jnp.int32)), dict(alibi_slopes="x"),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: f"{b}"[:40])
def test_invalid_arguments_raise_as_in_dot_product_attention(bad):
  q, kp, vp, table, lens = CASES[0].inputs()
  k = jnp.asarray(contiguous(kp, table, CASES[0].page_size))
  with pytest.raises(ValueError) as contiguous_error:
    jax_flash.dot_product_attention(q, k, k, implementation="cpu", **bad)
  for implementation in ("cpu", "xla"):
    with pytest.raises(ValueError) as paged_error:
      jax_flash.paged_attention(q, kp, vp, table, lens, implementation=implementation, **bad)
    assert str(paged_error.value) == str(contiguous_error.value)


@pytest.mark.parametrize("argument, value", [("logits_soft_cap", 30.0),
                                             ("alibi_slopes", jnp.ones((8,), F32))])
def test_cuda_takes_the_cap_and_the_slopes_by_gathering(monkeypatch, argument, value):
  """dispatch lets the soft cap and the slopes through to CUDA (the check for a GPU stubbed
  out: this machine may have none), and the call gathers the pages for the tiled kernels, whose
  kGeneral instantiations take them (the paged decode kernel takes neither)."""
  monkeypatch.setattr(_dispatch, "_check_cuda_runs", lambda: None)
  q, _, vp, _, _ = dataclasses.replace(CASES[0], dtype="bfloat16").inputs()
  assert _paged._select("cuda", q, vp, **{argument: value}) == "cuda"
  options = dict(logits_soft_cap=None, sinks=None, alibi_slopes=None)
  options[argument] = value
  assert _paged._kernel_route("cuda", q, 2, **options) == "gather"


def test_cuda_takes_the_sinks(monkeypatch):
  """dispatch lets sinks through to CUDA (joined in XLA to the tiled forward's float32 o);
  blockwise, which has no paged form, is refused."""
  monkeypatch.setattr(_dispatch, "_check_cuda_runs", lambda: None)
  q, _, vp, _, _ = dataclasses.replace(CASES[0], dtype="bfloat16").inputs()
  assert _paged._select("cuda", q, vp, sinks=jnp.zeros((8,))) == "cuda"
  call = _dispatch.Call(q.shape, q.dtype, sinks=(8,), paged=True)
  with pytest.raises(NotImplementedError, match="'blockwise' has no paged form"):
    _dispatch.select("blockwise", call, caller="jax_flash.paged_attention")


# On the GPU: bfloat16/float16 with each variant, T = 1 (gathered for the tiled kernels: the
# decode kernel's o is 16-bit and it takes no cap or slopes) and chunked prefill.
CUDA_CASES = [dataclasses.replace(CASES[0], dtype="bfloat16"), CASES[1],
              dataclasses.replace(CASES[2], dtype="float16")]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", CUDA_CASES, ids=_case_id)
def test_cuda_against_the_reference(case, variant):
  out, lse = run(case, "cuda", variant)
  check(case, variant, out, lse)
