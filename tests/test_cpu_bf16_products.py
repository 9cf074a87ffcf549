"""bfloat16 on the CPU kernel's avx512_amx variant (the forward's and backward's products on AMX
tiles, P rounded to bfloat16 and scale dS split into two bfloat16 values; the same products on
vdpbf16ps in avx512_bf16, which JAX_FLASH_CPU_ISA=avx512_bf16 runs here): the tolerance rule of
attention_testing against the float32 reference on shapes that are not whole tiles (tiles of
16 x 32, blocks of 64, head dims padded to 32), the NaN rules of test_nan_propagation on
bfloat16 inputs, and inputs past the lengths inside a partial chunk of 32, which those rules
would let through as NaN but the float32 path never reads. Skipped where the running variant has
no bfloat16 tiles (a CPU without AMX, or JAX_FLASH_CPU_ISA naming another)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from attention_testing import Case, check_against_references, random_array, run_jax_flash
from test_nan_propagation import MASKS, POISONS, check_poisoned

pytestmark = pytest.mark.skipif(jax_flash.cpu_kernel_isa() not in ("avx512_amx", "avx512_bf16"),
                                reason="the CPU kernel variant here has no bfloat16 tiles")

C = Case
CASES = [
    # Head dims 40 and 96: K's rows padded to 32 in a copy (not read in place); 64, 128, 256:
    # read in place where a block has whole strips of 32 keys.
    C(batch=2, seq_q=113, seq_k=203, heads_q=8, heads_k=4, head_dim=40, dtype="bfloat16",
      is_causal=True, kv_lens=(203, 0), local_window_size=(50, 3)),
    C(batch=1, seq_q=97, seq_k=97, heads_q=4, heads_k=4, head_dim=64, dtype="bfloat16"),
    C(batch=2, seq_q=65, seq_k=130, heads_q=6, heads_k=2, head_dim=96, dtype="bfloat16",
      q_lens=(65, 33), kv_lens=(130, 47)),
    C(batch=1, seq_q=300, seq_k=257, heads_q=4, heads_k=1, head_dim=128, dtype="bfloat16",
      is_causal=True),
    C(batch=2, seq_q=31, seq_k=1025, heads_q=2, heads_k=2, head_dim=256, dtype="bfloat16",
      local_window_size=(600, 40), kv_lens=(1025, 700)),
    # One query row, one key; a window that leaves each block a few keys at both ends.
    C(batch=1, seq_q=1, seq_k=1, heads_q=2, heads_k=1, head_dim=64, dtype="bfloat16"),
    C(batch=1, seq_q=190, seq_k=190, heads_q=4, heads_k=2, head_dim=128, dtype="bfloat16",
      local_window_size=(7, 9), return_residual=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bfloat16_on_amx_meets_the_rule(case):
  check_against_references(case, run_jax_flash(case, "cpu"))


@pytest.mark.parametrize("poison", POISONS, ids=[p.name for p in POISONS])
@pytest.mark.parametrize("mask", list(MASKS))
def test_poisoned_bfloat16_inputs_on_amx(mask, poison, monkeypatch):
  """NaN and inf inputs (among them keys past the lengths, which a partial chunk of 32 keys
  would read) reach exactly the outputs they reach in exact arithmetic."""
  check_poisoned("cpu", mask, poison, jnp.bfloat16, monkeypatch)


@pytest.mark.parametrize("kv_len", [30, 64 + 17])
def test_values_past_the_length_in_a_partial_chunk(rng, kv_len):
  """A key block's last chunk of 32 keys ends past the length: its keys there (NaN here) must
  not reach the output, which equals the clean inputs' bit for bit (their probabilities are 0,
  and 0 * NaN would be NaN had the product read them)."""
  q = random_array(rng, (1, 72, 4, 64), jnp.bfloat16)
  k = random_array(rng, (1, 96, 2, 64), jnp.bfloat16)
  v = random_array(rng, (1, 96, 2, 64), jnp.bfloat16)
  lengths = np.array([kv_len], np.int32)
  attend = lambda v: np.asarray(jax_flash.dot_product_attention(
      q, k, v, key_value_seq_lengths=lengths, implementation="cpu").astype(jnp.float32))
  clean = attend(v)
  poisoned = attend(v.at[:, kv_len:].set(jnp.nan))
  assert np.all(np.isfinite(clean))
  np.testing.assert_array_equal(poisoned, clean)


@pytest.mark.parametrize("q_len", [50, 64 + 9])
def test_queries_past_the_length_in_a_partial_chunk(rng, q_len):
  """The backward's dK and dV run over the query rows of a block in chunks of 32: rows past the
  length (NaN here) in the block's last, partial chunk must not reach dK or dV (nor the live
  rows' output and dQ), which equal the clean inputs' bit for bit."""
  q = random_array(rng, (1, 96, 4, 64), jnp.bfloat16)
  k = random_array(rng, (1, 80, 2, 64), jnp.bfloat16)
  v = random_array(rng, (1, 80, 2, 64), jnp.bfloat16)
  g = random_array(rng, q.shape, jnp.bfloat16)
  lengths = np.array([q_len], np.int32)

  def run(q):
    f = lambda q, k, v: jax_flash.dot_product_attention(
        q, k, v, query_seq_lengths=lengths, implementation="cpu")
    out, vjp = jax.vjp(f, q, k, v)
    return [np.asarray(x.astype(jnp.float32)) for x in (out, *vjp(g))]

  clean = run(q)
  poisoned = run(q.at[:, q_len:].set(jnp.nan))
  for name, want, got in zip(("out", "dq", "dk", "dv"), clean, poisoned):
    if name in ("out", "dq"):
      want, got = want[:, :q_len], got[:, :q_len]
    assert np.all(np.isfinite(want)), name
    np.testing.assert_array_equal(got, want, err_msg=name)
