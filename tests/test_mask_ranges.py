"""The mask arithmetic the kernels walk their tiles by (cuda/common/mask.h: key_range,
query_range, queries_seeing_keys; static_keys_per_row, which picks the CUDA kernels' narrow calls),
against the reference mask of jax_flash._reference: the CPU and CUDA kernels skip, mask and visit
tiles by these ranges, so an off-by-one here is a wrong gradient there on some shape."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_flash import _native
from jax_flash._reference import key_mask


def _mask(causal: bool, left: int, right: int, q_len: int, kv_len: int, rows: int, keys: int) -> np.ndarray:
  """(rows, keys) bool from the reference: which keys each query row attends to."""
  return np.asarray(key_mask(rows, keys, np.array([q_len]), np.array([kv_len]), causal, left, right))[0]


def _as_set(begin: int, end: int) -> set[int]:
  return set(range(begin, end))


@settings(max_examples=300, deadline=None)
@given(causal=st.booleans(), left=st.integers(-1, 12), right=st.integers(-1, 12),
       q_len=st.integers(0, 40), kv_len=st.integers(0, 40), j0=st.integers(0, 45),
       width=st.integers(0, 20))
def test_ranges_match_the_reference_mask(causal, left, right, q_len, kv_len, j0, width):
  rows, keys = 45, 45  # past both lengths: rows/keys outside them see nothing
  mask = _mask(causal, left, right, q_len, kv_len, rows, keys)
  key_ranges, query_ranges, seeing = _native._mask_ranges(causal, left, right, q_len, kv_len, rows, keys,
                                                         j0, j0 + width)
  for i, (begin, end) in enumerate(key_ranges):
    assert _as_set(begin, end) == set(np.flatnonzero(mask[i])), f"key_range({i})"
  for j, (begin, end) in enumerate(query_ranges):
    assert _as_set(begin, end) == set(np.flatnonzero(mask[:, j])), f"query_range({j})"
  want = set(np.flatnonzero(mask[:, j0:j0 + width].any(axis=1)))
  assert _as_set(*seeing) == want, f"queries_seeing_keys({j0}, {j0 + width})"


@settings(max_examples=300, deadline=None)
@given(causal=st.booleans(), left=st.integers(-1, 12), right=st.integers(-1, 12),
       seq_q=st.integers(1, 40), seq_k=st.integers(1, 40), data=st.data())
def test_static_keys_per_row_bounds_every_row(causal, left, right, seq_q, seq_k, data):
  """static_keys_per_row (shape and window only) is at least the keys any row sees under any
  lengths, and exact without them for some row where the window fits the keys."""
  q_len = data.draw(st.integers(0, seq_q))
  kv_len = data.draw(st.integers(0, seq_k))
  bound = _native._static_keys_per_row(causal, left, right, seq_q, seq_k)
  assert 1 <= bound <= seq_k
  seen = _mask(causal, left, right, q_len, kv_len, seq_q, seq_k).sum(axis=1)
  assert seen.max(initial=0) <= bound
  full = _mask(causal, left, right, seq_q, seq_k, seq_q, seq_k).sum(axis=1)
  if seq_q >= seq_k + max(left, 0) + 1:  # some row has the whole window inside the keys
    assert full.max() == bound
