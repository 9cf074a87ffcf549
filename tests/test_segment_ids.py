"""Segment ids (packed documents, issue 16 item 1): q_segment_ids / kv_segment_ids on the "cpu"
kernel, the "blockwise" path and the "xla" reference.

The reference is jax.nn.dot_product_attention(implementation="xla") on float32 inputs with the
segment mask built here, independently, as a (B, 1, T, S) bool `mask` (combined by jax.nn with
is_causal, the lengths and the window); the tolerance is the rule of tests/attention_testing.py
(2x the error of the same reference in the input dtype, plus a tiny floor). Rows whose document
has no visible key are checked exactly (0 output, 0 dq, EMPTY_ROW_LSE) and left out of the
comparisons, where jax.nn puts artefacts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from attention_testing import (F32, assert_within_rule, ffi_calls, key_visibility, max_abs,
                               random_array, simulate_cuda_host)
from jax_flash import _dispatch, _ops
from jax_flash._reference import EMPTY_ROW_LSE

IMPLEMENTATIONS = ["cpu", "blockwise", "xla"]


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int = 2
  seq_q: int = 100
  seq_k: int = 100
  heads_q: int = 4
  heads_k: int = 2
  head_dim: int = 40
  dtype: str = "float32"
  is_causal: bool = False
  window: tuple[int, int] | None = None
  q_lens: tuple[int, ...] | None = None
  kv_lens: tuple[int, ...] | None = None
  rank3: bool = False
  sorted_ids: bool = True  # documents laid end to end; else ids at random per position
  seed: int = 0

  def ids(self):
    """(q_ids (B, T), kv_ids (B, S)) int32 numpy: documents of random lengths (sorted), or
    random ids per position. The query side has an id no key has, so some rows' documents
    have no visible key at all."""
    rng = np.random.default_rng(self.seed + 1)
    if not self.sorted_ids:
      return (rng.integers(-2, 3, size=(self.batch, self.seq_q)).astype(np.int32),
              rng.integers(-2, 2, size=(self.batch, self.seq_k)).astype(np.int32))
    out = []
    for seq, top in ((self.seq_q, 6), (self.seq_k, 5)):
      cuts = np.sort(rng.integers(0, seq, size=(self.batch, top - 1)), axis=1)
      ids = np.zeros((self.batch, seq), np.int32)
      for b in range(self.batch):
        for c in cuts[b]:
          ids[b, c:] += 1
      out.append(ids)
    return out[0], out[1]

  def inputs(self):
    rng = np.random.default_rng(self.seed)
    dtype = jnp.dtype(self.dtype)
    q = random_array(rng, (self.batch, self.seq_q, self.heads_q, self.head_dim), dtype)
    k = random_array(rng, (self.batch, self.seq_k, self.heads_k, self.head_dim), dtype)
    v = random_array(rng, (self.batch, self.seq_k, self.heads_k, self.head_dim), dtype)
    g = random_array(rng, q.shape, F32)
    return q, k, v, g

  def options(self) -> dict:
    opts = dict(is_causal=self.is_causal, local_window_size=self.window)
    if self.q_lens is not None:
      opts["query_seq_lengths"] = jnp.asarray(self.q_lens, jnp.int32)
    if self.kv_lens is not None:
      opts["key_value_seq_lengths"] = jnp.asarray(self.kv_lens, jnp.int32)
    return opts

  def visibility(self) -> np.ndarray:
    """(B, T, S) bool, built independently of jax_flash."""
    q_ids, kv_ids = self.ids()
    vis = key_visibility(np, self.seq_q, self.seq_k, self.q_lens, self.kv_lens, self.is_causal,
                         self.window)
    return vis & (q_ids[:, :, None] == kv_ids[:, None, :])


def _grads(attention, q, k, v, g):
  """attention(q, k, v) -> (out, lse): out, lse and the gradients of sum(out * g), compiled,
  as float64 numpy arrays."""

  @jax.jit
  def run(q, k, v, g):
    def loss(q, k, v):
      out, lse = attention(q, k, v)
      return jnp.sum(out.astype(F32) * g), (out, lse)

    (_, (out, lse)), (dq, dk, dv) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

  return {n: np.asarray(jnp.asarray(x, F32), np.float64) for n, x in run(q, k, v, g).items()}


def _reference(case: Case, q, k, v, g):
  """jax.nn in the inputs' dtype with the segment mask; the cotangent is zero on rows with no
  visible key (jax.nn's value there is an artefact)."""
  vis = case.visibility()
  mask = jnp.asarray(vis[:, None])
  g = jnp.where(jnp.asarray(vis.any(-1))[..., None, None], g, 0.0)
  opts = {**case.options(), "mask": mask}
  del opts["is_causal"]  # in the mask already (jax.nn takes both; one source of truth here)

  def attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", return_residual=True,
                                        **opts)

  return _grads(attention, q, k, v, g)


@functools.lru_cache(maxsize=16)
def references(case: Case):
  q, k, v, g = case.inputs()
  ref32 = _reference(case, *(x.astype(F32) for x in (q, k, v)), g)
  refd = ref32 if case.dtype == "float32" else _reference(case, q, k, v, g)
  return ref32, refd


def run(case: Case, implementation: str) -> dict:
  q, k, v, g = case.inputs()
  q_ids, kv_ids = (jnp.asarray(x) for x in case.ids())
  if case.rank3:
    q, k, v, g, q_ids, kv_ids = (x[0] for x in (q, k, v, g, q_ids, kv_ids))

  def attention(q, k, v):
    return jax_flash.dot_product_attention(
        q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, implementation=implementation,
        return_residual=True, **case.options())

  got = _grads(attention, q, k, v, g)
  if case.rank3:
    got = {n: x[None] for n, x in got.items()}
  return got


def check(case: Case, got: dict) -> None:
  ref32, refd = references(case)
  vis = case.visibility()
  live, seen = vis.any(-1), vis.any(1)  # (B, T) rows with a key; (B, S) keys some row sees
  for name, x in got.items():
    assert np.all(np.isfinite(x)), name
  assert_within_rule("out", got["out"], ref32["out"], refd["out"], live[..., None, None])
  assert_within_rule("lse", got["lse"], ref32["lse"], refd["lse"], live[..., None])
  magnitude = max(max_abs(ref32[n]) for n in ("dq", "dk", "dv"))
  for name in ("dq", "dk", "dv"):
    assert_within_rule(name, got[name], ref32[name], refd[name], magnitude=magnitude)
  dead = np.broadcast_to(~live[..., None, None], got["out"].shape)
  assert np.all(got["out"][dead] == 0) and np.all(got["dq"][dead] == 0)
  assert np.all(got["lse"][np.broadcast_to(~live[..., None], got["lse"].shape)] == EMPTY_ROW_LSE)
  unseen = np.broadcast_to(~seen[..., None, None], got["dk"].shape)
  assert np.all(got["dk"][unseen] == 0) and np.all(got["dv"][unseen] == 0)
  assert (~live).any(), "the cases hold rows whose document has no visible key"


CASES = {
    "plain": Case(),
    "causal": Case(is_causal=True),
    "window": Case(window=(9, 4), seq_q=130, seq_k=130),
    "lengths": Case(q_lens=(90, 41), kv_lens=(70, 100), is_causal=True),
    "mqa_t_ne_s": Case(seq_q=70, seq_k=150, heads_q=3, heads_k=1, is_causal=True),
    "t_gt_s_window": Case(seq_q=150, seq_k=61, window=(20, 0)),
    "rank3": Case(batch=1, rank3=True, is_causal=True, head_dim=16),
    "unsorted": Case(sorted_ids=False, is_causal=True, kv_lens=(80, 100)),
    "bf16_all": Case(dtype="bfloat16", seq_q=140, seq_k=120, is_causal=True, window=(50, 3),
                     q_lens=(140, 100), kv_lens=(119, 120)),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, implementation):
  """Forward, lse and every gradient against jax.nn with the segment mask, alone and combined
  with causal, windows, lengths, GQA/MQA, T != S, rank-3 inputs and unsorted ids."""
  case = CASES[name]
  check(case, run(case, implementation))


_LAYOUT = Case(batch=2, seq_q=67, seq_k=67, heads_q=2, heads_k=1, head_dim=8)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(st.integers(-3, 3), min_size=2 * 67, max_size=2 * 67),
       kv_perm=st.permutations(range(67)), causal=st.booleans())
def test_random_id_layouts(ids, kv_perm, causal):
  """Any id values in any order (the keys' ids a permutation of the queries'): the kernel's
  block skipping is by each block's id range, correct whether or not ids are sorted."""
  q_ids = np.asarray(ids, np.int32).reshape(2, 67)
  kv_ids = q_ids[:, list(kv_perm)]
  case = dataclasses.replace(_LAYOUT, is_causal=causal)
  q, k, v, _ = case.inputs()
  vis = key_visibility(np, 67, 67, is_causal=causal) & (q_ids[:, :, None] == kv_ids[:, None, :])
  got_out, got_lse = _jit_cpu(q, k, v, jnp.asarray(q_ids), jnp.asarray(kv_ids), causal)
  want_out, want_lse = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(vis[:, None]),
                                                    implementation="xla", return_residual=True)
  live = vis.any(-1)
  np.testing.assert_allclose(np.asarray(got_out)[live], np.asarray(want_out)[live], atol=2e-6)
  np.testing.assert_allclose(np.asarray(got_lse)[live], np.asarray(want_lse)[live], atol=2e-6)
  assert np.all(np.asarray(got_out)[~live] == 0)
  assert np.all(np.asarray(got_lse)[~live] == EMPTY_ROW_LSE)


@functools.partial(jax.jit, static_argnums=(5,))
def _jit_cpu(q, k, v, q_ids, kv_ids, causal):
  return jax_flash.dot_product_attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                         is_causal=causal, implementation="cpu",
                                         return_residual=True)


def test_packed_row_equals_separate_rows(rng):
  """Four causal documents packed into one row give, row for row, what each gives alone: the
  output, lse and gradients (positions restart at each document: causal within it)."""
  lengths = [37, 64, 1, 90]
  total = sum(lengths)
  q, k, v, g = (random_array(rng, (1, total, 4, 24), jnp.float32) for _ in range(4))
  ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
  # Causal within each document == causal over the packed row with document ids.
  packed = _grads(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids,
      implementation="cpu", return_residual=True), q, k, v, g)
  start = 0
  for n in lengths:
    part = slice(start, start + n)
    alone = _grads(lambda q, k, v: jax_flash.dot_product_attention(
        q, k, v, is_causal=True, implementation="cpu", return_residual=True),
        q[:, part], k[:, part], v[:, part], g[:, part])
    for name in alone:
      np.testing.assert_allclose(packed[name][:, part], alone[name], atol=3e-6, rtol=1e-5,
                                 err_msg=f"{name} of the document at {start}")
    start += n


def test_cpu_kernel_skips_blocks_of_other_documents(rng):
  """The CPU kernel never visits a (query block, key block) tile whose documents cannot meet.

  Probe: NaN in the values of document 0's keys. A visited tile multiplies its masked (zero)
  probabilities by those values, so any row of a visited tile turns NaN, masked or not; that is
  what the blockwise path (which scans every block) shows, so the probe can fail. Documents of
  128 rows (2 blocks of the kernel's 64) are block-aligned: on the kernel document 1's rows
  stay finite, forward and backward (dq, which a visited tile would reach through dP = dO V^T)."""
  half = 128
  q, k, v, g = (random_array(rng, (1, 2 * half, 2, 16), jnp.float32) for _ in range(4))
  v = v.at[:, :half].set(jnp.nan)  # document 0's values
  ids = jnp.asarray(np.repeat([0, 1], half)[None], jnp.int32)
  results = {}
  for implementation in ("cpu", "blockwise"):
    results[implementation] = _grads(lambda q, k, v: jax_flash.dot_product_attention(
        q, k, v, q_segment_ids=ids, kv_segment_ids=ids, implementation=implementation,
        return_residual=True), q, k, v, g)
  cpu, blockwise = results["cpu"], results["blockwise"]
  for name in ("out", "dq"):
    assert np.isnan(blockwise[name][:, half:]).any(), f"the probe must show a visited {name}"
    assert np.isfinite(cpu[name][:, half:]).all(), f"{name}: the kernel visited a skipped tile"
    assert np.isnan(cpu[name][:, :half]).all()  # document 0 attends its NaN values
  assert np.isfinite(cpu["dk"][:, half:]).all() and np.isfinite(cpu["dv"][:, half:]).all()
  # Document 1 alone on the kernel: exactly what it gives packed.
  alone = _grads(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, implementation="cpu", return_residual=True),
      q[:, half:], k[:, half:], v[:, half:], g[:, half:])
  for name in ("out", "lse", "dq", "dk", "dv"):
    np.testing.assert_allclose(cpu[name][:, half:], alone[name], atol=2e-6, rtol=1e-6)


def test_vmap_folds_ids_into_batch(rng):
  """vmap over a leading axis of q, k, v and the ids (the kernel folds it into the batch)."""
  case = Case(batch=3, seq_q=50, seq_k=50, head_dim=8)
  q, k, v, _ = case.inputs()
  q_ids, kv_ids = (jnp.asarray(x) for x in case.ids())

  def one(implementation, q, k, v, qi, ki):
    return jax_flash.dot_product_attention(q, k, v, q_segment_ids=qi, kv_segment_ids=ki,
                                           is_causal=True, implementation=implementation)

  got = jax.jit(jax.vmap(functools.partial(one, "cpu")))(q, k, v, q_ids, kv_ids)
  want = jax.jit(jax.vmap(functools.partial(one, "xla")))(q, k, v, q_ids, kv_ids)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


# ---------------------------------------------------------------------------------------------
# Errors


def _qkv(batch=2, t=8, s=8):
  q = jnp.ones((batch, t, 2, 8))
  k = jnp.ones((batch, s, 2, 8))
  return q, k, k


@pytest.mark.parametrize("given_name", ["q_segment_ids", "kv_segment_ids"])
def test_one_alone_raises(given_name):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=f"{given_name} was given without"):
    jax_flash.dot_product_attention(q, k, v, implementation="cpu",
                                    **{given_name: jnp.zeros((2, 8), jnp.int32)})


@pytest.mark.parametrize("q_shape,kv_shape,bad,fragment", [
    ((8, 2), (2, 8), "q_segment_ids", r"q_segment_ids must have shape \(B, T\) = \(2, 8\).*got q_segment_ids\(8, 2\)"),
    ((2, 8), (2, 9), "kv_segment_ids", r"kv_segment_ids must have shape \(B, S\) = \(2, 8\).*\(2, 9\)"),
    ((2, 8), (2,), "kv_segment_ids", r"kv_segment_ids.*got kv_segment_ids\(2,\)"),
])
def test_shapes_are_checked(q_shape, kv_shape, bad, fragment):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=fragment):
    jax_flash.dot_product_attention(q, k, v, q_segment_ids=jnp.zeros(q_shape, jnp.int32),
                                    kv_segment_ids=jnp.zeros(kv_shape, jnp.int32))


def test_rank3_takes_rank1_ids():
  q, k, v = (x[0] for x in _qkv())
  with pytest.raises(ValueError, match=r"q_segment_ids must have shape \(T,\) = \(8,\).*\(1, 8\)"):
    jax_flash.dot_product_attention(q, k, v, q_segment_ids=jnp.zeros((1, 8), jnp.int32),
                                    kv_segment_ids=jnp.zeros((8,), jnp.int32))


@pytest.mark.parametrize("dtype,advice", [(jnp.int16, "astype"), (jnp.uint32, "astype"),
                                          (jnp.float32, ""), (jnp.bool_, "")])
def test_dtype_must_be_int32(dtype, advice):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=f"kv_segment_ids must be an integer array of dtype int32; "
                                       f"got {jnp.dtype(dtype)}.*{advice}"):
    jax_flash.dot_product_attention(q, k, v, q_segment_ids=jnp.zeros((2, 8), jnp.int32),
                                    kv_segment_ids=jnp.zeros((2, 8), dtype))


def _loss(q, k, v, **options):
  return jax_flash.dot_product_attention(q, k, v, **options).astype(jnp.float32).sum()


def test_cuda_kernels_take_segment_ids(monkeypatch):
  """The CUDA kernels take segment ids by default, with no switch: where None picks them (a GPU
  with 16-bit inputs) or "cuda" is forced, a call with ids is theirs (it used to raise
  NotImplementedError at trace time), and its forward and backward trace to the CUDA custom
  calls with segment_ids=True and the ids and their spans as operands. A GPU host with the CUDA
  kernels built is simulated (an H200's SM count): the calls are traced, never run. 128 rows:
  without ids too the call takes the tiled kernels, not the decode kernel."""
  simulate_cuda_host(monkeypatch)
  monkeypatch.setattr(_dispatch, "default_implementation", lambda dtype: "cuda")
  assert _dispatch.capabilities("cuda").segment_ids
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(t=128, s=128))
  ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 32)[None].repeat(2, axis=0)  # (2, 128)
  call = _dispatch.Call(q.shape, q.dtype, segment_ids=((2, 128), (2, 128)))
  for implementation in (None, "cuda"):
    assert _dispatch.select(implementation, call) == "cuda"
    for with_ids in (True, False):
      options = dict(q_segment_ids=ids, kv_segment_ids=ids) if with_ids else {}
      loss = functools.partial(_loss, implementation=implementation, **options)
      calls = ffi_calls(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
      assert [name for name, *_ in calls] == ["jax_flash_cuda_fwd", "jax_flash_cuda_bwd"]
      for name, attributes, operands, _ in calls:
        assert bool(attributes["segment_ids"]) is with_ids, (name, implementation)
        # Its int32 operands besides the lengths (B,): the ids (B, T), (B, S) and their spans
        # (B, runs of 64 ids, 2), or (0,) placeholders without ids; then the block mask's
        # placeholders (none here: the forward's two, the backward's four).
        got = [tuple(x.shape) for x in operands if x.dtype == jnp.int32 and x.shape != (2,)]
        want = [(2, 128), (2, 128), (2, 2, 2), (2, 2, 2)] if with_ids else [(0,)] * 4
        want += [(0,)] * (2 if name.endswith("fwd") else 4)
        assert got == want, (name, implementation, operands)


@pytest.mark.parametrize("length, rows", [(1, 64), (64, 64), (65, 64), (200, 64), (10, 4)])
def test_segment_id_spans(length, rows):
  """The CUDA kernels' id spans: the lowest and highest id of every run of `rows` ids from 0
  (the last run shorter), for any ids, batched."""
  ids = np.random.default_rng(length).integers(-5, 5, size=(3, length)).astype(np.int32)
  got = np.asarray(_ops.segment_id_spans(jnp.asarray(ids), rows))
  runs = -(-length // rows)
  assert got.shape == (3, runs, 2) and got.dtype == np.int32
  for b in range(3):
    for r in range(runs):
      run = ids[b, r * rows:(r + 1) * rows]
      assert tuple(got[b, r]) == (run.min(), run.max())


# On the GPU (the CUDA kernels take segment ids by default): the cases above in 16 bits, head dims
# that take the Hopper kernels (64, 128) and the split head-dim backward (256), documents straddling
# the 64- and 128-row blocks, unsorted ids, and the deterministic backward.
CUDA_CASES = {
    "causal_h64": Case(dtype="bfloat16", seq_q=300, seq_k=300, head_dim=64, is_causal=True),
    "window_lengths_h128": Case(dtype="bfloat16", seq_q=260, seq_k=200, head_dim=128,
                                window=(70, 9), q_lens=(255, 130), kv_lens=(200, 77)),
    "mqa_t_ne_s_h40": Case(dtype="float16", seq_q=90, seq_k=333, heads_q=4, heads_k=1,
                           head_dim=40, is_causal=True),
    "unsorted_h64": Case(dtype="bfloat16", sorted_ids=False, seq_q=150, seq_k=170, head_dim=64),
    "h256": Case(dtype="bfloat16", seq_q=140, seq_k=130, head_dim=256, is_causal=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("name", list(CUDA_CASES))
def test_cuda_matches_reference(name, deterministic):
  case = CUDA_CASES[name]
  q, k, v, g = case.inputs()
  q_ids, kv_ids = (jnp.asarray(x) for x in case.ids())
  attention = lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, implementation="cuda",
      return_residual=True, deterministic=deterministic, **case.options())
  check(case, _grads(attention, q, k, v, g))


@pytest.mark.gpu
def test_cuda_packed_row_equals_separate_rows():
  """A row of eight documents of 64..448 tokens (lengths that straddle the kernels' blocks),
  causal, head dim 128: each document's output and gradients as if it ran alone (the kernels
  skip the blocks of other documents, and must lose nothing by it)."""
  lengths = [64, 200, 127, 448, 65, 300, 129, 203]
  seq = sum(lengths)
  rng = np.random.default_rng(7)
  q, k, v, g = (random_array(rng, (1, seq, 4, 128), dt)
                for dt in (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, F32))
  ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32))

  def grads(q, k, v, g, ids):
    attention = lambda q, k, v: jax_flash.dot_product_attention(
        q, k, v, is_causal=True, implementation="cuda", return_residual=True,
        **({} if ids is None else dict(q_segment_ids=ids, kv_segment_ids=ids)))
    return _grads(attention, q, k, v, g)

  packed = grads(q, k, v, g, ids)
  start = 0
  for n in lengths:
    part = slice(start, start + n)
    alone = grads(*(x[:, part] for x in (q, k, v, g)), None)
    for name in ("out", "lse", "dq", "dk", "dv"):
      np.testing.assert_allclose(packed[name][:, part], alone[name], atol=2e-2, rtol=2e-2,
                                 err_msg=f"{name} of the document of {n} tokens at {start}")
    start += n


# ---------------------------------------------------------------------------------------------
# Sharding: ids travel with their batch; heads need nothing


@pytest.mark.parametrize("spec", [P("x", None, None, None), P(None, None, "x", None),
                                  P("x", None, "y", None)], ids=["batch", "heads", "both"])
def test_batch_and_head_sharding(spec):
  case = Case(batch=4, seq_q=64, seq_k=64, heads_q=4, heads_k=2, head_dim=8, is_causal=True)
  q, k, v, g = case.inputs()
  q_ids, kv_ids = (jnp.asarray(x) for x in case.ids())
  mesh = jax.make_mesh((2, 2), ("x", "y"))
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  ids_spec = P(spec[0], None)

  def attention(impl, q, k, v, qi, ki):
    return jax_flash.dot_product_attention(q, k, v, q_segment_ids=qi, kv_segment_ids=ki,
                                           is_causal=True, implementation=impl,
                                           return_residual=True)

  args = (put(q, spec), put(k, spec), put(v, spec), put(q_ids, ids_spec), put(kv_ids, ids_spec))
  got = _grads(lambda *a: attention("cpu", *a, *args[3:]), *args[:3], put(g, spec))
  want = _grads(lambda *a: attention("xla", *a, q_ids, kv_ids), q, k, v, g)
  for name in got:
    np.testing.assert_allclose(got[name], want[name], atol=5e-6, err_msg=name)


# A sequence-sharded call with ids runs context parallelism:
# tests/test_context_parallel_segment_ids.py.


# ---------------------------------------------------------------------------------------------
# Flax


def test_flax_modules_match_the_stock_modules_with_a_segment_mask(rng):
  """Linen and NNX modules with segment ids == the stock modules with
  mask = make_attention_mask(ids, ids, jnp.equal) & causal (rows with a key, i.e. all here:
  each document sees its own first position)."""
  flax = pytest.importorskip("jax_flash.flax")
  import flax.linen as nn
  from flax import nnx

  x = jnp.asarray(rng.standard_normal((2, 40, 16)), jnp.float32)
  ids = jnp.asarray(np.stack([np.repeat([0, 1, 2, 3], 10), np.repeat([5, 2], [15, 25])]),
                    jnp.int32)
  mask = nn.make_attention_mask(ids, ids, jnp.equal) * nn.make_causal_mask(ids)  # float 0/1

  stock = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
  params = stock.init(jax.random.key(0), x, mask=mask)
  want = stock.apply(params, x, mask=mask)
  linen = flax.FlashMultiHeadDotProductAttention(num_heads=2, qkv_features=16, is_causal=True,
                                                 implementation="cpu")
  got = jax.jit(functools.partial(linen.apply, q_segment_ids=ids, kv_segment_ids=ids))(params, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6)

  stock_nnx = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False,
                                     rngs=nnx.Rngs(0))
  flash_nnx = flax.FlashMultiHeadAttention(num_heads=2, in_features=16, is_causal=True,
                                           implementation="cpu", rngs=nnx.Rngs(0))
  nnx.update(flash_nnx, nnx.state(stock_nnx))
  want = stock_nnx(x, mask=mask)
  got = nnx.jit(lambda m, x: m(x, q_segment_ids=ids, kv_segment_ids=ids))(flash_nnx, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6)

  # attention_fn with batch dims of its own: (2, 1, T) ids for (2, 1, T, N, H) inputs.
  q = jnp.asarray(rng.standard_normal((2, 1, 40, 2, 8)), jnp.float32)
  got = jax.jit(functools.partial(flax.dot_product_attention, implementation="cpu"))(
      q, q, q, q_segment_ids=ids[:, None], kv_segment_ids=ids[:, None])
  want = jax.nn.dot_product_attention(q[:, 0], q[:, 0], q[:, 0],
                                      mask=nn.make_attention_mask(ids, ids, jnp.equal) > 0)
  np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want), atol=3e-6)
  with pytest.raises(ValueError, match=r"q_segment_ids must have one id per position"):
    flax.dot_product_attention(q, q, q, q_segment_ids=ids, kv_segment_ids=ids)
