"""Property test: random shapes and masks, float32, forward and gradients of the CPU kernel
against the float32 reference within the rule of attention_testing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from attention_testing import Case, check_against_references, run_jax_flash


@st.composite
def cases(draw) -> Case:
  batch = draw(st.integers(1, 3))
  seq_q = draw(st.integers(1, 200))
  seq_k = draw(st.integers(1, 200))
  heads_k = draw(st.integers(1, 3))
  heads_q = heads_k * draw(st.sampled_from([1, 2, 4]))
  side = st.integers(0, 80)
  window = draw(st.none() | side | st.tuples(side, side))

  def lengths(full):
    # Out-of-range lengths are allowed: -1 means no rows, > full means all rows (as jax.nn).
    return draw(st.none() | st.tuples(*[st.integers(-1, full + 2)] * batch))

  head_dim = draw(st.integers(1, 256))
  # An explicit scale keeps the logits' standard deviation (scale * sqrt(H) for these unit
  # normal inputs) at most 4: the float32 floor of the rule (1e-5 relative) assumes moderate
  # logits. Float32 round-off grows with |logits|: at std 16 jax.nn's own float32 gradients are
  # ~5e-6 relative off a float64 computation, and the kernel's about the same, so a 1e-5 bound
  # against jax.nn would then measure the reference's error as much as the kernel's.
  logit_std = draw(st.none() | st.floats(0.05, 4.0))
  return Case(
      batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_k=heads_k,
      head_dim=head_dim, dtype="float32", is_causal=draw(st.booleans()),
      local_window_size=window, q_lens=lengths(seq_q), kv_lens=lengths(seq_k),
      rank3=batch == 1 and draw(st.booleans()),
      scale=None if logit_std is None else logit_std / head_dim**0.5,
      return_residual=draw(st.booleans()),
      seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=25, deadline=None)
@given(cases())
def test_random_cases_match_reference(case):
  check_against_references(case, run_jax_flash(case, "cpu"))
