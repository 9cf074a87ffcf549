"""Shared helpers of the attention tests: random inputs, the two references and the tolerance rule.

The rule is FlashAttention's (DESIGN.md, "Numerics and tests"): for every result x (out, lse,
dq, dk, dv),

    max|x_kernel - x_f32| <= 2 * max|x_dtype - x_f32| + floor

where x_f32 is ``jax.nn.dot_product_attention(implementation="xla")`` run on inputs upcast to
float32 and x_dtype is the same math with the input dtype's rounding emulated. The floor is tiny:
1e-5 * M + 1e-6, with M = max|x_f32| for out and lse. For float32 inputs x_dtype == x_f32, so the
floor is all there is (the kernels' float32 errors are about 1e-7 relative). For bfloat16/float16
the 2x term dominates; the floor stays for them because the kernels accumulate in float32 whatever
the input dtype.

For the gradients M is the largest |reference gradient| of dq, dk and dv together: dq and dk are
both computed from dS = P * (dP - D), whose float32 round-off is relative to dP = dO.V, i.e. to the
size of the gradients, not to dq's own. Where every row sees a single key (S == 1, or a window of
0), dS and so dq, dk are exactly 0 in exact arithmetic and jax.nn happens to produce exact zeros,
while a FlashAttention backward (D = rowsum(dO * O) summed in a different order than dP) leaves
~1e-6 of round-off: relative to max|dq| = 0 that would be an "error", relative to the gradients'
scale it is 1e-7.

jax.nn gives rows with no key to attend to (key_value_seq_lengths[b] == 0, or a window that
excludes every key) the mean of V and a meaningless lse; jax_flash gives 0 and EMPTY_ROW_LSE
(and contributes no gradient). Those rows are left out of the comparisons and checked exactly
instead, and the references' loss masks the cotangent there.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _decode, _registry
from jax_flash._reference import EMPTY_ROW_LSE

F32 = jnp.float32
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
HIGHEST = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------------------
# Cases and inputs


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: shapes, dtype and masking. Hashable, so results can be cached."""

  batch: int = 2
  seq_q: int = 17
  seq_k: int = 17
  heads_q: int = 8
  heads_k: int = 8
  head_dim: int = 32
  dtype: str = "float32"
  is_causal: bool = False
  local_window_size: int | tuple[int, int] | None = None
  q_lens: tuple[int, ...] | None = None  # query_seq_lengths, one per batch element
  kv_lens: tuple[int, ...] | None = None  # key_value_seq_lengths
  rank3: bool = False  # unbatched (T, N, H) inputs; batch must be 1
  scale: float | None = None
  return_residual: bool = False
  seed: int = 0

  def __post_init__(self):
    assert not self.rank3 or self.batch == 1, "rank-3 inputs have batch 1"
    for lens in (self.q_lens, self.kv_lens):
      assert lens is None or len(lens) == self.batch

  @property
  def jdtype(self):
    return jnp.dtype(DTYPES[self.dtype])

  @property
  def id(self) -> str:
    parts = [f"b{self.batch}", f"t{self.seq_q}", f"s{self.seq_k}", f"n{self.heads_q}",
             f"k{self.heads_k}", f"h{self.head_dim}", self.dtype]
    if self.is_causal:
      parts.append("causal")
    if self.local_window_size is not None:
      w = self.local_window_size
      parts.append(f"win{w}" if isinstance(w, int) else f"win{w[0]}-{w[1]}")
    if self.q_lens is not None:
      parts.append("qlens" + "-".join(map(str, self.q_lens)))
    if self.kv_lens is not None:
      parts.append("kvlens" + "-".join(map(str, self.kv_lens)))
    if self.rank3:
      parts.append("rank3")
    if self.scale is not None:
      parts.append(f"scale{self.scale}")
    if self.return_residual:
      parts.append("residual")
    return "_".join(parts)

  def options(self) -> dict:
    """The keyword arguments of dot_product_attention (and jax.nn's) for this case."""
    opts = dict(scale=self.scale, is_causal=self.is_causal,
                local_window_size=self.local_window_size)
    if self.q_lens is not None:
      opts["query_seq_lengths"] = jnp.asarray(self.q_lens, jnp.int32)
    if self.kv_lens is not None:
      opts["key_value_seq_lengths"] = jnp.asarray(self.kv_lens, jnp.int32)
    return opts

  def inputs(self):
    """(q, k, v, g): q, k, v in the case's dtype, g a float32 cotangent shaped like the output
    whose values the case's dtype holds exactly. A 16-bit output's cotangent reaches the kernels
    in that dtype, so the float32 reference must get the same values, as q, k, v are upcast for
    it (tests/differential.py draws its cotangent in the input dtype too); a float32 g would
    charge the kernels with its rounding, which only the references see (issue 13: the bf16 dk
    "misses" of causal calls of two query rows were that)."""
    rng = np.random.default_rng(self.seed)
    b = () if self.rank3 else (self.batch,)
    q = random_array(rng, (*b, self.seq_q, self.heads_q, self.head_dim), self.jdtype)
    k = random_array(rng, (*b, self.seq_k, self.heads_k, self.head_dim), self.jdtype)
    v = random_array(rng, (*b, self.seq_k, self.heads_k, self.head_dim), self.jdtype)
    g = random_array(rng, q.shape, self.jdtype).astype(F32)
    return q, k, v, g


def random_array(rng: np.random.Generator, shape, dtype) -> jax.Array:
  """Standard normal values with |x| >= 1e-2, so no element is (or rounds to) zero."""
  x = rng.standard_normal(shape, dtype=np.float32)
  x = np.copysign(np.maximum(np.abs(x), 1e-2), x)
  return jnp.asarray(x, dtype=dtype)


def random_qkv_and_cotangent(rng: np.random.Generator, batch: int, seq: int, heads_q: int, heads_k: int,
                             head_dim: int, dtype=jnp.float32):
  """q, k, v of (batch, seq, heads, head_dim) and a cotangent shaped like q."""
  q = random_array(rng, (batch, seq, heads_q, head_dim), dtype)
  k = random_array(rng, (batch, seq, heads_k, head_dim), dtype)
  v = random_array(rng, (batch, seq, heads_k, head_dim), dtype)
  return q, k, v, random_array(rng, q.shape, dtype)


# ---------------------------------------------------------------------------------------------
# Which query rows see keys (computed independently of jax_flash)


def key_visibility(xp, seq_q: int, seq_k: int, q_lens=None, kv_lens=None, is_causal=False,
                   local_window_size=None):
  """(B or 1, T, S) bool, in numpy or jax.numpy (`xp`): key j is visible to query row i of batch
  element b, with jax.nn's semantics (lengths out of [0, T] / [0, S] simply compare)."""
  t = xp.arange(seq_q)[None, :, None]
  s = xp.arange(seq_k)[None, None, :]
  vis = xp.ones((1, seq_q, seq_k), bool)
  if q_lens is not None:
    vis = vis & (t < xp.asarray(q_lens)[:, None, None])
  if kv_lens is not None:
    vis = vis & (s < xp.asarray(kv_lens)[:, None, None])
  if is_causal:
    vis = vis & (s <= t)
  if local_window_size is not None:
    w = local_window_size
    left, right = (w, w) if isinstance(w, int) else w
    vis = vis & (s >= t - left) & (s <= t + right)
  return vis


def visibility(case: Case) -> np.ndarray:
  """(B, T, S) bool: key j is visible to query row i of batch element b."""
  vis = key_visibility(np, case.seq_q, case.seq_k, case.q_lens, case.kv_lens, case.is_causal,
                       case.local_window_size)
  return np.broadcast_to(vis, (case.batch, case.seq_q, case.seq_k))


def row_has_keys(case: Case) -> np.ndarray:
  """(B, T) bool: query rows that attend to at least one key (all others must give exactly 0)."""
  return visibility(case).any(axis=-1)


def key_is_seen(case: Case) -> np.ndarray:
  """(B, S) bool: keys some live query row attends to (dk, dv of all others must be exactly 0)."""
  return visibility(case).any(axis=1)


def _unbatch(case: Case, x: np.ndarray) -> np.ndarray:
  return x[0] if case.rank3 else x


# ---------------------------------------------------------------------------------------------
# References


def reference_f32(q, k, v, *, return_residual=False, **options):
  """jax.nn.dot_product_attention(implementation="xla") on inputs upcast to float32.

  Returns out (float32), or (out, lse) with lse (..., T, N) float32. Rows with no key to attend
  to hold jax.nn's artefacts (mean of V, a meaningless lse): leave them out of comparisons.
  """
  return jax.nn.dot_product_attention(
      q.astype(F32), k.astype(F32), v.astype(F32), implementation="xla",
      return_residual=return_residual, **options)


def packed_segment_ids(case: "Case") -> jax.Array:
  """Segment ids of packed rows for `case` (seq_q == seq_k: queries and keys share positions):
  per batch element four documents of random lengths, sorted by position ((B, T) int32, (T,)
  for rank-3 cases)."""
  assert case.seq_q == case.seq_k, "packed rows: queries and keys share positions"
  rng = np.random.default_rng(case.seed + 1)
  rows = []
  for _ in range(case.batch):
    cuts = np.sort(rng.choice(np.arange(1, case.seq_q), size=3, replace=False))
    rows.append(np.searchsorted(cuts, np.arange(case.seq_q), side="right"))
  ids = jnp.asarray(np.stack(rows), jnp.int32)
  return ids[0] if case.rank3 else ids


def visible_keys(case: "Case", ids=None) -> np.ndarray:
  """(B, T, S) bool: the keys each query row of `case` sees, with segment ids `ids` (as
  packed_segment_ids gives them) on top of its masks and lengths."""
  vis = np.broadcast_to(key_visibility(np, case.seq_q, case.seq_k, case.q_lens, case.kv_lens,
                                       case.is_causal, case.local_window_size),
                        (case.batch, case.seq_q, case.seq_k))
  if ids is not None:
    ids = np.asarray(ids).reshape(case.batch, case.seq_q)
    vis = vis & (ids[:, :, None] == ids[:, None, :])
  return vis


def rounded(x, dtype):
  """x rounded to `dtype` and back to float32 (under grad, the cotangent is rounded the same)."""
  return x.astype(dtype).astype(F32)


def reference_in_dtype(q, k, v, *, scale=None, is_causal=False, query_seq_lengths=None,
                       key_value_seq_lengths=None, local_window_size=None,
                       return_residual=False):
  """The reference with the input dtype's rounding: what plain attention in that dtype gives.

  float32: jax.nn xla with default precision. bfloat16/float16: scores computed in float32 and
  rounded to the dtype, softmax in float32, probabilities rounded to the dtype, P.V in float32
  and rounded (jax.nn cannot run float16 on the CPU, DESIGN.md). Returns out in the input dtype
  (and lse (..., T, N) float32). Rows with no key give 0 and EMPTY_ROW_LSE here, but like the
  float32 reference's they are left out of the comparisons.
  """
  dtype = q.dtype
  if dtype == jnp.float32:
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
        implementation="xla", return_residual=return_residual)
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  batch, seq_q, heads_q, head_dim = q.shape
  seq_k, heads_k = k.shape[1], k.shape[2]
  group = heads_q // heads_k
  scale = 1.0 / np.sqrt(head_dim) if scale is None else scale

  qf = q.astype(F32).reshape(batch, seq_q, heads_k, group, head_dim)
  scores = jnp.einsum("btkgh,bskh->bkgts", qf, k.astype(F32), precision=HIGHEST)
  scores = rounded(scores * scale, dtype)

  vis = key_visibility(jnp, seq_q, seq_k, query_seq_lengths, key_value_seq_lengths, is_causal,
                       local_window_size)
  vis = jnp.broadcast_to(vis, (batch, seq_q, seq_k))[:, None, None]  # (B, 1, 1, T, S)
  has_keys = vis.any(axis=-1, keepdims=True)

  # A finite fill (as jax.nn's) keeps rows without keys NaN-free under grad; they are zeroed.
  masked = jnp.where(vis, scores, -0.7 * float(np.finfo(np.float32).max))
  probs = jnp.where(has_keys, jax.nn.softmax(masked, axis=-1), 0.0)
  probs = rounded(probs, dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(F32), precision=HIGHEST)
  out = out.reshape(batch, seq_q, heads_q, head_dim).astype(dtype)
  lse = jax.nn.logsumexp(masked, axis=-1)  # (B, K, G, T)
  lse = jnp.where(has_keys[..., 0], lse, EMPTY_ROW_LSE)
  lse = jnp.moveaxis(lse.reshape(batch, heads_q, seq_q), -1, -2)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


# ---------------------------------------------------------------------------------------------
# Running a case: out, lse and the gradients of sum(out * g)


def _outputs_and_grads(attention, q, k, v, g):
  """attention(q, k, v) -> (out, lse). Returns dict(out, lse, dq, dk, dv)."""

  def loss(q, k, v):
    out, lse = attention(q, k, v)
    return jnp.sum(out.astype(F32) * g), (out, lse)

  (_, (out, lse)), (dq, dk, dv) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      q, k, v)
  return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def _as_numpy(results: dict) -> dict:
  return {name: np.asarray(jnp.asarray(x, F32), np.float64) for name, x in results.items()}


def _masked_cotangent(case: Case, g):
  mask = jnp.asarray(_unbatch(case, row_has_keys(case)))[..., None, None]
  return jnp.where(mask, g, 0.0)


@functools.lru_cache(maxsize=8)
def references(case: Case) -> tuple[dict, dict]:
  """(f32, in_dtype) results of the references for `case`: dicts of out, lse, dq, dk, dv.

  Their loss masks the cotangent on rows without keys (jax.nn puts mean(V) there; the true
  function is 0 there, so those rows carry no gradient).
  """
  q, k, v, g = case.inputs()
  options = case.options()
  g_ref = _masked_cotangent(case, g)

  def f32(q, k, v):
    return reference_f32(q, k, v, return_residual=True, **options)

  def in_dtype(q, k, v):
    return reference_in_dtype(q, k, v, return_residual=True, **options)

  upcast = tuple(x.astype(F32) for x in (q, k, v))
  ref32 = _as_numpy(jax.jit(functools.partial(_outputs_and_grads, f32))(*upcast, g_ref))
  if case.dtype == "float32":
    return ref32, ref32
  refd = _as_numpy(jax.jit(functools.partial(_outputs_and_grads, in_dtype))(q, k, v, g_ref))
  return ref32, refd


def run_jax_flash(case: Case, implementation: str, **extra) -> dict:
  """jax_flash's out, lse, dq, dk, dv for `case` (loss with the full, unmasked cotangent);
  `extra` are further keyword arguments of jax_flash's own (e.g. deterministic=True).

  With case.return_residual the gradient flows through the (out, lse) call; otherwise through
  the plain call, and lse comes from a second call with return_residual=True.
  """
  q, k, v, g = case.inputs()
  options = case.options()

  def attention(q, k, v):
    call = functools.partial(jax_flash.dot_product_attention, implementation=implementation,
                             **options, **extra)
    if case.return_residual:
      return call(q, k, v, return_residual=True)
    return call(q, k, v), call(q, k, v, return_residual=True)[1]

  results = jax.jit(functools.partial(_outputs_and_grads, attention))(q, k, v, g)
  assert results["out"].dtype == case.jdtype and results["out"].shape == q.shape
  assert results["lse"].dtype == jnp.float32 and results["lse"].shape == q.shape[:-1]
  for name, x in zip(("dq", "dk", "dv"), (q, k, v)):
    assert results[name].dtype == x.dtype and results[name].shape == x.shape, name
  return _as_numpy(results)


# ---------------------------------------------------------------------------------------------
# The tolerance rule and the exact checks


def max_abs(x: np.ndarray) -> float:
  return float(np.max(np.abs(x))) if x.size else 0.0


def tolerance(ref32: np.ndarray, refd: np.ndarray, magnitude: float | None = None) -> float:
  """2 * max|ref_dtype - ref_f32| + 1e-5 * magnitude + 1e-6 (see the module docstring);
  magnitude defaults to max|ref_f32|."""
  magnitude = max_abs(ref32) if magnitude is None else magnitude
  return 2.0 * max_abs(refd - ref32) + 1e-5 * magnitude + 1e-6


def assert_within_rule(name: str, got: np.ndarray, ref32: np.ndarray, refd: np.ndarray,
                       where: np.ndarray | None = None, magnitude: float | None = None) -> None:
  """The FlashAttention rule on the elements selected by `where` (all when None)."""
  got, ref32, refd = (np.asarray(x, np.float64) for x in (got, ref32, refd))
  if where is not None:
    where = np.broadcast_to(where, got.shape)
    got, ref32, refd = got[where], ref32[where], refd[where]
  err = max_abs(got - ref32)
  bound = tolerance(ref32, refd, magnitude)
  assert err <= bound, (
      f"{name}: max|jax_flash - ref_f32| = {err:.4g} > bound {bound:.4g} "
      f"(2 * max|ref_dtype - ref_f32| = {2 * max_abs(refd - ref32):.4g}, "
      f"max|ref_f32| = {max_abs(ref32):.4g})")


def gradient_magnitude(ref32: dict) -> float:
  """The scale of the gradients: max |reference dq, dk, dv| together."""
  return max(max_abs(ref32[name]) for name in ("dq", "dk", "dv"))


def check_against_references(case: Case, got: dict) -> None:
  """Every element finite; out/lse/dq/dk/dv within the rule; rows and keys outside every mask
  exactly 0 (out, dq, dk, dv) and EMPTY_ROW_LSE (lse)."""
  ref32, refd = references(case)
  for name, x in got.items():
    assert np.all(np.isfinite(x)), f"{name} has non-finite elements"

  live = _unbatch(case, row_has_keys(case))  # (..., T)
  seen = _unbatch(case, key_is_seen(case))  # (..., S)
  live_rows = live[..., None, None]
  _check_output(got["out"], ref32, refd, live_rows)
  assert_within_rule("lse", got["lse"], ref32["lse"], refd["lse"], live[..., None])
  for name in ("dq", "dk", "dv"):
    assert_within_rule(name, got[name], ref32[name], refd[name],
                       magnitude=gradient_magnitude(ref32))

  dead_rows = np.broadcast_to(~live_rows, got["out"].shape)
  assert np.all(got["dq"][dead_rows] == 0), "dq of rows with no key must be exactly 0"
  dead_lse = np.broadcast_to(~live[..., None], got["lse"].shape)
  assert np.all(got["lse"][dead_lse] == EMPTY_ROW_LSE), (
      "lse of rows with no key must be EMPTY_ROW_LSE")
  dead_keys = np.broadcast_to(~seen[..., None, None], got["dk"].shape)
  assert np.all(got["dk"][dead_keys] == 0), "dk of keys no query sees must be exactly 0"
  assert np.all(got["dv"][dead_keys] == 0), "dv of keys no query sees must be exactly 0"


def _check_output(out: np.ndarray, ref32: dict, refd: dict, live_rows: np.ndarray) -> None:
  """out within the rule on the rows with keys (`live_rows`), exactly 0 on the others."""
  assert_within_rule("out", out, ref32["out"], refd["out"], live_rows)
  dead_rows = np.broadcast_to(~live_rows, out.shape)
  assert np.all(out[dead_rows] == 0), "rows with no key to attend to must be exactly 0"


def check_output_against_references(case: Case, out: np.ndarray) -> None:
  """A forward-only result (no gradients): every element finite, out within the rule, rows
  outside every mask exactly 0."""
  ref32, refd = references(case)
  assert np.all(np.isfinite(out)), "out has non-finite elements"
  _check_output(out, ref32, refd, _unbatch(case, row_has_keys(case))[..., None, None])


# ---------------------------------------------------------------------------------------------
# Score variants (logit soft-capping, ALiBi): their reference from the definition, and the check
# of a jax_flash result against it, shared by test_softcap and test_alibi.


def score_variant_attention(q, k, v, vis, *, scale, cap=None, slopes=None, dropout=None,
                            dtype=None):
  """(out, lse (..., T, N)) on float32 inputs from the definition, the (T, S) scores
  materialised: s = scale * q.k; with `cap`, s <- cap * tanh(s / cap); with `slopes` (N,),
  s <- s + slopes[h] * (j - i) for query i and key j; masked by `vis` ((B, T, S) bool), softmax;
  with `dropout` ((B, N, T, S) float32 Z = keep / (1 - rate)) the probabilities times Z before
  P V (the lse is the softmax's). With `dtype` (16-bit) the scores, each variant's result and
  the probabilities are rounded to it, as attention in that dtype does. Rows with no visible
  key give 0 and EMPTY_ROW_LSE. v's head dim may differ from q's and k's (the output has v's)."""
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  batch, seq_q, heads_q, head_dim = q.shape
  seq_k, heads_k = k.shape[1], k.shape[2]
  group = heads_q // heads_k
  rnd = (lambda x: x) if dtype is None else functools.partial(rounded, dtype=dtype)
  q5 = q.reshape(batch, seq_q, heads_k, group, head_dim)
  s = rnd(jnp.einsum("btkgh,bskh->bkgts", q5, k, precision=HIGHEST) * scale)
  if cap is not None:
    s = rnd(cap * jnp.tanh(s / cap))
  if slopes is not None:
    distance = np.arange(seq_k)[None, :] - np.arange(seq_q)[:, None]  # j - i, (T, S)
    s = rnd(s + slopes.reshape(1, heads_k, group, 1, 1) * jnp.asarray(distance, F32))
  vis = jnp.asarray(vis)[:, None, None]
  has = vis.any(-1, keepdims=True)
  masked = jnp.where(vis, s, -0.7 * float(np.finfo(np.float32).max))
  p = rnd(jnp.where(has, jax.nn.softmax(masked, axis=-1), 0.0))
  if dropout is not None:
    p = rnd(p * jnp.asarray(dropout, F32).reshape(batch, heads_k, group, seq_q, seq_k))
  out = jnp.einsum("bkgts,bskh->btkgh", p, v, precision=HIGHEST).reshape(*q.shape[:-1],
                                                                         v.shape[-1])
  lse = jnp.where(has[..., 0], jax.nn.logsumexp(masked, axis=-1), EMPTY_ROW_LSE)
  lse = jnp.moveaxis(lse.reshape(batch, heads_q, seq_q), -1, -2)
  if unbatched:
    out, lse = out[0], lse[0]
  return out, lse


def outputs_and_grads(attention, q, k, v, g) -> dict:
  """dict(out, lse, dq, dk, dv) of attention(q, k, v) -> (out, lse) and sum(out * g), jitted,
  as float64 numpy arrays."""
  return _as_numpy(jax.jit(functools.partial(_outputs_and_grads, attention))(q, k, v, g))


def score_variant_references(case: Case, inputs, vis, **variant) -> tuple[dict, dict]:
  """(ref32, refd) of score_variant_attention(**variant) on `inputs` (q, k, v, g): float32 on
  the upcast inputs, and rounded to the case's dtype (ref32 itself for float32): its
  intermediates, and its out, dq, dk and dv as attention in that dtype returns them (as
  `references`' in-dtype run does; lse stays float32). The cotangent is zeroed on rows with no
  visible key (the function is 0 there)."""
  q, k, v, g = inputs
  live = vis.any(-1)
  live = live[0] if case.rank3 else live
  g = jnp.where(jnp.asarray(live)[..., None, None], g, 0.0)
  upcast = [x.astype(F32) for x in (q, k, v)]
  scale = case.scale if case.scale is not None else 1.0 / np.sqrt(case.head_dim)
  f32 = functools.partial(score_variant_attention, vis=vis, scale=scale, **variant)
  ref32 = outputs_and_grads(f32, *upcast, g)
  if case.dtype == "float32":
    return ref32, ref32
  refd = outputs_and_grads(functools.partial(f32, dtype=case.jdtype), *upcast, g)
  for name in ("out", "dq", "dk", "dv"):
    refd[name] = np.asarray(jnp.asarray(refd[name]).astype(case.jdtype), np.float64)
  return ref32, refd


def check_score_variant_output(out: np.ndarray, ref32: dict, refd: dict, live: np.ndarray) -> None:
  """An inference call's output (no residual: the kernels' 16-bit o) within the rule of the
  references' on the live rows (`live` (..., T) bool); finite; exact zeros on the others."""
  out = np.asarray(out, np.float64)
  assert np.all(np.isfinite(out))
  assert_within_rule("out", out, ref32["out"], refd["out"], live[..., None, None])
  assert np.all(out[np.broadcast_to(~live[..., None, None], out.shape)] == 0)


def check_score_variant(got: dict, ref32: dict, refd: dict, live: np.ndarray) -> None:
  """got (outputs_and_grads of a return_residual call) within the rule of the references on the
  live rows (`live` (..., T) bool); finite; exact zeros and EMPTY_ROW_LSE on the others."""
  for name, x in got.items():
    assert np.all(np.isfinite(x)), name
  assert_within_rule("out", got["out"], ref32["out"], refd["out"], live[..., None, None])
  assert_within_rule("lse", got["lse"], ref32["lse"], refd["lse"], live[..., None])
  for name in ("dq", "dk", "dv"):
    assert_within_rule(name, got[name], ref32[name], refd[name],
                       magnitude=gradient_magnitude(ref32))
  for name in ("out", "dq"):  # (their head dims differ where v's does from q's)
    dead = np.broadcast_to(~live[..., None, None], got[name].shape)
    assert np.all(got[name][dead] == 0), name
  assert np.all(got["lse"][np.broadcast_to(~live[..., None], got["lse"].shape)] == EMPTY_ROW_LSE)


def ffi_calls(fn, *args) -> list[tuple[str, dict, list, list]]:
  """(target name, attributes, operand avals, result avals) of every ffi_call that tracing
  fn(*args) binds, in order, nested jaxprs included (traced only: nothing is lowered or run)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "ffi_call":
        found.append((eqn.params["target_name"], dict(eqn.params["attributes"]),
                      [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars]))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


# Stand-ins for the CUDA module's constants (jax_flash._registry.CUDA_KERNEL_CONSTANTS as built
# with CUDA), for tests that trace CUDA calls on a machine without it: one dict, so that a
# constant the module gains is added once.
SIMULATED_CUDA_CONSTANTS = dict(head_dim_multiple=8, max_head_dim=256, decode_rows_per_cta=16,
                                decode_block_n=64, decode_max_head_dim=256, segment_id_span_rows=64,
                                fwd_scheduler_elements=1)


def simulate_cuda_host(monkeypatch) -> None:
  """This CPU machine as a GPU host with the CUDA kernels built (an H200's SM count, stand-in
  constants and dQ workspace size, no call narrow: JAX_FLASH_CUDA_NARROW=off), for tests that trace CUDA calls
  without running them."""
  monkeypatch.setattr(_registry, "has_platform", lambda platform: platform in ("cpu", "cuda"))
  monkeypatch.setattr(_registry, "cuda_gpu_present", lambda: True)
  monkeypatch.setattr(_registry, "CUDA_KERNEL_CONSTANTS", dict(SIMULATED_CUDA_CONSTANTS))
  monkeypatch.setattr(_registry, "_native_cuda",
                      types.SimpleNamespace(dq_accum_elements=lambda *args: 64,
                                            narrow_split_call=lambda *args: False,
                                            forward_takes_value_head_dim=lambda *args: False,
                                            backward_takes_value_head_dim=lambda *args: False))
  monkeypatch.setattr(_decode, "_cuda_sm_count", lambda: 132)


def gpu_tests_in_a_process(test_file: str, selection: str, env: dict[str, str],
                           expect_skips: bool = False, timeout_s: float = 1200) -> None:
  """Runs the GPU tests of `test_file` matching `selection` (pytest -k) in a process with the
  environment variables `env` added (jax_flash reads its switches once, at import), and asserts
  that they passed, and unless `expect_skips`, that none was skipped; a process past `timeout_s`
  fails the test (subprocess.TimeoutExpired)."""
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-k",
       selection, os.path.abspath(test_file)],
      env=dict(os.environ, **env), capture_output=True, text=True, timeout=timeout_s)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert " passed" in result.stdout, result.stdout[-3000:]
  if not expect_skips:
    assert " skipped" not in result.stdout, result.stdout[-3000:]
