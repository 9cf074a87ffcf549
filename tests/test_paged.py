"""jax_flash.paged_attention (issue 15, item 2): attention over a paged KV cache, forward only.

The reference gathers each sequence's pages into a contiguous cache in numpy and runs
jax.nn.dot_product_attention (float32, implementation="xla") with the paged call's mask as a
mask array, built here independently: query row t of sequence b sits at position
kv_lengths[b] - T + t (bottom-right aligned) and sees keys j < kv_lengths[b], j <= position under
is_causal, position - left <= j <= position + right under a window. Results are held to the rule
of attention_testing (2x the input dtype's own error); rows with no key give exactly 0 and
EMPTY_ROW_LSE.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_flash
from attention_testing import HIGHEST, assert_within_rule, random_array
from jax_flash import _paged
from jax_flash._reference import EMPTY_ROW_LSE

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class PagedCase:
  batch: int = 2
  seq_q: int = 1
  heads_q: int = 8
  heads_k: int = 2
  head_dim: int = 64
  page_size: int = 16
  pages_per_seq: int = 8
  extra_pages: int = 5  # pages in the pool beyond those the sequences use
  kv_lens: tuple[int, ...] = (128, 50)
  dtype: str = "float32"
  is_causal: bool = False
  local_window_size: int | tuple[int, int] | None = None
  seed: int = 0

  @property
  def seq_k(self) -> int:
    return self.page_size * self.pages_per_seq

  def inputs(self):
    """q, key_pages, value_pages, page_table (a random permutation of the pool, unused entries
    -1), kv_lengths."""
    rng = np.random.default_rng(self.seed)
    dtype = jnp.dtype(self.dtype)
    num_pages = self.batch * self.pages_per_seq + self.extra_pages
    q = random_array(rng, (self.batch, self.seq_q, self.heads_q, self.head_dim), dtype)
    shape = (num_pages, self.page_size, self.heads_k, self.head_dim)
    key_pages, value_pages = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
    table = rng.permutation(num_pages)[:self.batch * self.pages_per_seq]
    table = table.reshape(self.batch, self.pages_per_seq).astype(np.int32)
    lens = np.asarray(self.kv_lens, np.int32)
    reached = np.arange(self.pages_per_seq)[None] * self.page_size < np.clip(lens, 0, None)[:, None]
    table = np.where(reached, table, -1)  # entries past a sequence's length: padding
    return q, key_pages, value_pages, jnp.asarray(table), jnp.asarray(lens)

  def options(self) -> dict:
    return dict(is_causal=self.is_causal, local_window_size=self.local_window_size)


def contiguous(pages, table, page_size):
  """(B, pages_per_seq * page_size, K, H): each sequence's pages gathered in order (numpy)."""
  pages, table = np.asarray(pages.astype(F32)), np.clip(np.asarray(table), 0, None)
  b, n = table.shape
  return pages[table].reshape(b, n * page_size, *pages.shape[2:])


def paged_mask(case: PagedCase) -> np.ndarray:
  """(B, T, S) bool, independently of jax_flash."""
  lens = np.clip(np.asarray(case.kv_lens), 0, case.seq_k)[:, None, None]
  pos = lens - case.seq_q + np.arange(case.seq_q)[None, :, None]
  j = np.arange(case.seq_k)[None, None, :]
  mask = j < lens
  if case.is_causal:
    mask = mask & (j <= pos)
  if case.local_window_size is not None:
    w = case.local_window_size
    left, right = (w, w) if isinstance(w, int) else w
    mask = mask & (j >= pos - left) & (j <= pos + right)
  return np.broadcast_to(mask, (case.batch, case.seq_q, case.seq_k))


def _references(case: PagedCase):
  """(out, lse) of the float32 reference and of the same math with the dtype's rounding."""
  q, kp, vp, table, _ = case.inputs()
  k, v = (jnp.asarray(contiguous(x, table, case.page_size)) for x in (kp, vp))
  mask = jnp.asarray(paged_mask(case))
  ref32 = jax.nn.dot_product_attention(q.astype(F32), k, v, mask=mask[:, None],
                                       implementation="xla", return_residual=True)
  if case.dtype == "float32":
    return ref32, ref32
  dtype = q.dtype
  rounded = lambda x: x.astype(dtype).astype(F32)  # noqa: E731
  group = case.heads_q // case.heads_k
  qf = q.astype(F32).reshape(case.batch, case.seq_q, case.heads_k, group, case.head_dim)
  scores = rounded(jnp.einsum("btkgh,bskh->bkgts", qf, rounded(k), precision=HIGHEST)
                   / np.sqrt(case.head_dim))
  masked = jnp.where(mask[:, None, None], scores, -0.7 * float(np.finfo(np.float32).max))
  probs = rounded(jax.nn.softmax(masked, axis=-1))
  out = jnp.einsum("bkgts,bskh->btkgh", probs, rounded(v), precision=HIGHEST)
  out = out.reshape(q.shape).astype(dtype)
  lse = jnp.moveaxis(jax.nn.logsumexp(masked, axis=-1).reshape(case.batch, case.heads_q,
                                                                 case.seq_q), -1, -2)
  return ref32, (out, lse)


def check(case: PagedCase, out, lse) -> None:
  (out32, lse32), (outd, lsed) = _references(case)
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  live = paged_mask(case).any(-1)  # (B, T)
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
  assert_within_rule("out", out, np.asarray(out32, np.float64), np.asarray(outd, np.float64),
                     live[..., None, None])
  assert_within_rule("lse", lse, np.asarray(lse32), np.asarray(lsed), live[..., None])
  assert np.all(out[~live] == 0), "rows with no key must be exactly 0"
  assert np.all(lse[~live] == EMPTY_ROW_LSE)


P = PagedCase
CASES = [
    P(),  # GQA 4, T = 1, one full sequence and one ending mid-page
    P(batch=3, heads_q=8, heads_k=1, head_dim=128, kv_lens=(0, 1, 77), dtype="bfloat16"),  # MQA
    P(batch=2, heads_q=4, heads_k=4, head_dim=40, page_size=1, pages_per_seq=300,
      kv_lens=(300, 123), dtype="float16"),
    P(batch=2, seq_q=2, head_dim=96, page_size=100, pages_per_seq=7, kv_lens=(700, 333),
      is_causal=True),
    P(batch=3, seq_q=4, heads_q=16, heads_k=2, head_dim=256, page_size=64, pages_per_seq=4,
      kv_lens=(256, 3, 70), is_causal=True, local_window_size=(40, 0), dtype="bfloat16"),
    P(batch=2, seq_q=4, head_dim=80, page_size=32, pages_per_seq=20, kv_lens=(640, 600),
      local_window_size=(100, 1)),
    # Chunked prefill: T * group > 64 query rows, several row tiles per kv head.
    P(batch=2, seq_q=40, heads_q=8, heads_k=2, head_dim=32, page_size=16, pages_per_seq=12,
      kv_lens=(192, 55), is_causal=True),
    # Lengths past the capacity mean all of it; negative ones none.
    P(batch=2, seq_q=2, kv_lens=(1000, -5), is_causal=True),
]
# More than 64 packed rows per kv head (T * N / K): on CUDA the pages are gathered for the tiled
# forward (jax_flash._decode.cuda_paged_route); masks of every kind, lengths below T, empty and
# over-long sequences.
GATHER_CASES = [
    P(batch=3, seq_q=70, heads_q=4, heads_k=4, head_dim=64, page_size=16, pages_per_seq=10,
      kv_lens=(160, 30, 0), is_causal=True),
    P(batch=2, seq_q=33, heads_q=8, heads_k=2, head_dim=128, page_size=64, pages_per_seq=4,
      kv_lens=(256, 100), local_window_size=(40, 3)),
    P(batch=2, seq_q=20, heads_q=16, heads_k=4, head_dim=80, page_size=1, pages_per_seq=300,
      kv_lens=(300, 250), is_causal=True, local_window_size=(50, 0), dtype="bfloat16"),
    P(batch=2, seq_q=65, heads_q=2, heads_k=2, head_dim=40, page_size=100, pages_per_seq=5,
      kv_lens=(500, 20), dtype="float16"),
    P(batch=2, seq_q=66, heads_q=1, heads_k=1, kv_lens=(1000, -5), is_causal=True),
]
CASES += GATHER_CASES


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c}"[10:80])
@pytest.mark.parametrize("implementation", ["cpu", "xla"])
def test_paged_matches_the_reference(case, implementation):
  out, lse = jax.jit(lambda *a: jax_flash.paged_attention(
      *a, implementation=implementation, return_residual=True, **case.options()))(*case.inputs())
  assert out.dtype == jnp.dtype(case.dtype) and out.shape == (case.batch, case.seq_q,
                                                               case.heads_q, case.head_dim)
  assert lse.dtype == F32 and lse.shape == out.shape[:-1]
  check(case, out, lse)


def test_paged_equals_contiguous_decode():
  """The same keys paged or contiguous: the same decode kernel, the same results."""
  case = P(batch=3, heads_q=8, heads_k=2, page_size=16, pages_per_seq=40, kv_lens=(640, 17, 300))
  q, kp, vp, table, lens = case.inputs()
  k, v = (jnp.asarray(contiguous(x, table, case.page_size)) for x in (kp, vp))
  paged = jax_flash.paged_attention(q, kp, vp, table, lens)
  dense = jax_flash.dot_product_attention(q, k, v, key_value_seq_lengths=lens)
  np.testing.assert_allclose(paged, dense, atol=1e-6, rtol=1e-6)


def test_paged_decode_step_equals_the_full_causal_forward():
  """Row p of the full causal forward == a causal paged step at kv length p + 1 (and two rows
  p - 1, p at kv length p + 1)."""
  case = P(batch=2, heads_q=8, heads_k=2, page_size=16, pages_per_seq=16, kv_lens=(256, 256))
  q_full = random_array(np.random.default_rng(3), (2, 256, 8, 64), F32)
  _, kp, vp, table, _ = case.inputs()
  k, v = (jnp.asarray(contiguous(x, table, case.page_size)) for x in (kp, vp))
  full = jax_flash.dot_product_attention(q_full, k, v, is_causal=True)
  step = jax.jit(lambda q, lens: jax_flash.paged_attention(q, kp, vp, table, lens, is_causal=True))
  for p in (0, 15, 16, 100, 255):
    lens = jnp.full((2,), p + 1, jnp.int32)
    np.testing.assert_allclose(step(q_full[:, p:p + 1], lens)[:, 0], full[:, p], atol=2e-6)
    if p:
      np.testing.assert_allclose(step(q_full[:, p - 1:p + 1], lens), full[:, p - 1:p + 1],
                                 atol=2e-6)


def test_unreached_entries_are_never_read():
  case = P(kv_lens=(20, 0))
  q, kp, vp, table, lens = case.inputs()
  base = jax_flash.paged_attention(q, kp, vp, table, lens)
  junk = table.at[0, 2:].set(10**6).at[1].set(-7)
  for implementation in ("cpu", "xla"):
    out = jax_flash.paged_attention(q, kp, vp, junk, lens, implementation=implementation)
    np.testing.assert_allclose(out, base, atol=1e-6)


@pytest.mark.parametrize("entry", [-1, 21, 2**31 - 1])
def test_reached_entries_out_of_range(entry):
  """The cpu kernel refuses the call, naming the entry (nothing is read); xla gives NaN for that
  sequence only."""
  case = P(kv_lens=(128, 50), extra_pages=5)  # 21 pages
  q, kp, vp, table, lens = case.inputs()
  bad = table.at[1, 3].set(entry)  # sequence 1 (50 keys) reaches pages 0..3
  with pytest.raises(Exception, match=rf"page_table\[1, 3\] = {entry} is outside \[0, "
                                      r"num_pages=21\)"):
    jax.block_until_ready(jax_flash.paged_attention(q, kp, vp, bad, lens))
  out = jax_flash.paged_attention(q, kp, vp, bad, lens, implementation="xla")
  assert np.all(np.isnan(out[1])) and np.all(np.isfinite(out[0]))


def test_forward_only():
  q, kp, vp, table, lens = P().inputs()
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda q: jax_flash.paged_attention(q, kp, vp, table, lens).sum())(q)
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda kp: jax_flash.paged_attention(q, kp, vp, table, lens).sum())(kp)
  # "xla" is plain JAX and differentiates.
  g = jax.grad(lambda q: jax_flash.paged_attention(q, kp, vp, table, lens,
                                                   implementation="xla").sum())(q)
  assert np.all(np.isfinite(g))


def test_cuda_where_it_cannot_run():
  """float32 on "cuda" names the dtypes and "xla"; without CUDA kernels or a GPU, "cuda" says
  so (on a GPU machine with the kernels it runs: tests/test_cuda_decode.py)."""
  q, kp, vp, table, lens = P().inputs()
  with pytest.raises(NotImplementedError, match="bfloat16 or float16.*implementation='xla'"):
    jax_flash.paged_attention(q, kp, vp, table, lens, implementation="cuda")
  if not (jax_flash.has_platform("cuda") and jax_flash._registry.cuda_gpu_present()):
    half = P(dtype="bfloat16").inputs()
    with pytest.raises(ValueError, match="implementation='cuda' was requested but"):
      jax_flash.paged_attention(*half, implementation="cuda")
  with pytest.raises(ValueError, match="implementation must be one of"):
    jax_flash.paged_attention(q, kp, vp, table, lens, implementation="blockwise")


def gathered(case: PagedCase, implementation: str = "cpu", table=None):
  """(out, lse (B, T, N)) of the gathered path (pages gathered in reverse, the tiled forward of
  `implementation`), with paged_attention's preparation of the arguments."""
  q, kp, vp, case_table, lens = case.inputs()
  table = case_table if table is None else table
  w = case.local_window_size
  left, right = (-1, -1) if w is None else ((w, w) if isinstance(w, int) else w)
  reach = case.seq_q + case.seq_k
  left, right = (min(x, reach) if x >= 0 else x for x in (left, right))
  lens = jnp.clip(lens, 0, case.seq_k)
  out, lse = jax.jit(lambda *a: _paged.paged_gathered(
      *a, 1 / np.sqrt(case.head_dim), case.is_causal, left, right, implementation))(
          q, kp, vp, table, lens)
  return out, jnp.swapaxes(lse, -1, -2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c}"[10:80])
def test_gathered_path_matches_the_reference(case):
  """The pages gathered in reverse order for the tiled forward (CUDA's chunked-prefill path) on
  the CPU kernel: the paged call's results for every case (tiled kernel past 64 packed rows,
  the decode kernel below)."""
  out, lse = gathered(case)
  assert out.dtype == jnp.dtype(case.dtype) and out.shape == (case.batch, case.seq_q,
                                                               case.heads_q, case.head_dim)
  check(case, out, lse)


@pytest.mark.parametrize("is_causal, window, expected", [
    (False, (-1, -1), None),
    (True, (-1, -1), (0, -1)),
    (False, (40, 3), (3, 40)),
    (True, (40, 3), (0, 40)),
    (True, (50, 0), (0, 50)),
    (False, (-1, 7), (7, -1)),
    (False, (7, -1), (-1, 7)),
])
def test_gathered_window(is_causal, window, expected):
  """Bottom-right masks on reversed keys and rows: causal j <= p becomes j' >= t' (left 0), a
  window (left, right) becomes (right, left)."""
  assert _paged.gathered_window(is_causal, *window) == expected


@pytest.mark.parametrize("entry", [-1, 21, 2**31 - 1])
def test_gathered_bad_entry_gives_nan_for_that_sequence(entry):
  """As "xla" and the CUDA kernel: the sequence that reaches a bad entry is NaN (out and lse),
  the other one is what it was; an entry past the length changes nothing."""
  case = P(batch=2, seq_q=40, kv_lens=(128, 50), extra_pages=5, is_causal=True)  # 21 pages
  _, _, _, table, _ = case.inputs()
  base_out, base_lse = gathered(case)
  out, lse = gathered(case, table=table.at[1, 3].set(entry))
  assert np.all(np.isnan(out[1])) and np.all(np.isnan(lse[1]))
  np.testing.assert_array_equal(out[0], base_out[0])
  np.testing.assert_array_equal(lse[0], base_lse[0])
  out, lse = gathered(case, table=table.at[1, 4:].set(entry))  # past 50 keys: never read
  np.testing.assert_array_equal(out, base_out)


def test_gathered_path_is_forward_only():
  case = P(seq_q=40, is_causal=True)
  q, kp, vp, table, lens = case.inputs()
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda q: _paged.paged_gathered(q, kp, vp, table, lens, 0.125, True, -1, -1,
                                             "cpu")[0].sum())(q)


def test_vmap_and_scale():
  case = P(batch=2, kv_lens=(128, 40))
  q, kp, vp, table, lens = case.inputs()
  mapped = jax.vmap(lambda q, t, l: jax_flash.paged_attention(q[None], kp, vp, t[None], l[None],
                                                              scale=-0.3)[0])(q, table, lens)
  direct = jax_flash.paged_attention(q, kp, vp, table, lens, scale=-0.3)
  np.testing.assert_allclose(mapped, direct, atol=1e-6)
  ref = jax_flash.paged_attention(q, kp, vp, table, lens, scale=-0.3, implementation="xla")
  np.testing.assert_allclose(direct, ref, atol=2e-6)


def _bad(**change):
  q, kp, vp, table, lens = P().inputs()
  args = dict(query=q, key_pages=kp, value_pages=vp, page_table=table, kv_lengths=lens)
  args.update(change)
  return args


@pytest.mark.parametrize("change, match", [
    (dict(query=jnp.ones((8, 8, 64))), r"query must be \(B, T, N, H\); got query\(8, 8, 64\)"),
    (dict(key_pages=jnp.ones((21, 16, 2, 2, 64))), r"key_pages must be \(num_pages, page_size"),
    (dict(value_pages=jnp.ones((21, 16, 1, 64))), r"value_pages must have the shape of key_pages"),
    (dict(key_pages=jnp.ones((21, 0, 2, 64)), value_pages=jnp.ones((21, 0, 2, 64))),
     r"page_size \(key_pages.shape\[1\]\) must be >= 1"),
    (dict(key_pages=jnp.ones((21, 16, 2, 32)), value_pages=jnp.ones((21, 16, 2, 32))),
     "same head dim"),
    (dict(key_pages=jnp.ones((21, 16, 3, 64)), value_pages=jnp.ones((21, 16, 3, 64))),
     "N=8 must be a multiple"),
    (dict(page_table=jnp.zeros((3, 8), jnp.int32)), r"page_table must be \(B, pages_per_sequence\) "
                                                    r"with B=2.*page_table\(3, 8\)"),
    (dict(page_table=jnp.zeros((2, 8), jnp.int64 if jax.config.x64_enabled else jnp.int16)),
     "page_table must be int32"),
    (dict(kv_lengths=jnp.zeros((3,), jnp.int32)), r"kv_lengths must have shape \(2,\).*"
                                                  r"kv_lengths\(3,\)"),
    (dict(kv_lengths=jnp.zeros((2,), jnp.uint32)), "kv_lengths must be int32"),
    (dict(key_pages=jnp.ones((21, 16, 2, 64), jnp.bfloat16)), "must share one dtype"),
    (dict(query=jnp.ones((2, 1, 8, 64), jnp.int32), key_pages=jnp.ones((21, 16, 2, 64), jnp.int32),
          value_pages=jnp.ones((21, 16, 2, 64), jnp.int32)), "float32, bfloat16 or float16"),
])
def test_validation(change, match):
  with pytest.raises(ValueError, match=match):
    jax_flash.paged_attention(**_bad(**change))


def test_option_validation():
  with pytest.raises(ValueError, match="local_window_size"):
    jax_flash.paged_attention(**_bad(), local_window_size=-1)
  with pytest.raises(ValueError, match="scale must be finite"):
    jax_flash.paged_attention(**_bad(), scale=float("inf"))
  with pytest.raises(ValueError, match="head dim H=300"):
    jax_flash.paged_attention(**_bad(query=jnp.ones((2, 1, 8, 300)),
                                     key_pages=jnp.ones((21, 16, 2, 300)),
                                     value_pages=jnp.ones((21, 16, 2, 300))))


def test_empty_inputs():
  q, kp, vp, table, lens = P().inputs()
  out = jax_flash.paged_attention(q[:, :0], kp, vp, table, lens)
  assert out.shape == (2, 0, 8, 64)
  out, lse = jax_flash.paged_attention(q, kp, vp, table[:, :0], lens, return_residual=True)
  assert np.all(out == 0) and np.all(lse == EMPTY_ROW_LSE)


@st.composite
def paged_cases(draw) -> PagedCase:
  batch = draw(st.integers(1, 3))
  heads_k = draw(st.integers(1, 3))
  page_size = draw(st.sampled_from([1, 3, 16, 64, 100]))
  pages_per_seq = draw(st.integers(1, max(1, 600 // page_size)))
  seq_k = page_size * pages_per_seq
  side = st.integers(0, 200)
  return PagedCase(
      batch=batch, seq_q=draw(st.sampled_from([1, 2, 4])), heads_k=heads_k,
      heads_q=heads_k * draw(st.sampled_from([1, 2, 4, 8])),
      head_dim=draw(st.sampled_from([16, 40, 64, 128])), page_size=page_size,
      pages_per_seq=pages_per_seq, extra_pages=draw(st.integers(0, 4)),
      kv_lens=tuple(draw(st.lists(st.integers(-1, seq_k + 3), min_size=batch, max_size=batch))),
      dtype=draw(st.sampled_from(["float32", "bfloat16"])), is_causal=draw(st.booleans()),
      local_window_size=draw(st.none() | side | st.tuples(side, side)),
      seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=15, deadline=None)
@given(paged_cases())
def test_random_paged_shapes(case):
  out, lse = jax_flash.paged_attention(*case.inputs(), return_residual=True, **case.options())
  check(case, out, lse)
