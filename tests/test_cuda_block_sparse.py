"""Block-sparse attention in the CUDA kernels (issue 16 item 2): the lists XLA forms for them (jax_flash._ops.block_sparse_lists,
checked against numpy here, on the CPU), the operands a CUDA call traces to (on the CPU, a GPU
host simulated), and on a GPU (marked `gpu`) the kernels against the float32 reference of
tests/test_block_sparse.py by the FlashAttention rule: Hopper forward and backward (head dims
64, 128), the split head-dim backward (256), deterministic dQ, GQA, T != S with partial blocks, causal,
lengths, segment ids, empty rows; and that a hidden block's keys and values are never read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ops
from attention_testing import Case, ffi_calls, simulate_cuda_host
from test_block_sparse import SparseCase, check, run


def numpy_lists(mask: np.ndarray, heads_k: int):
  """block_sparse_lists written with loops: live blocks ascending, then the rest ascending."""
  *batch, n, tb, sb = mask.shape
  group = n // heads_k

  def live_first(row):
    return [i for i, x in enumerate(row) if x] + [i for i, x in enumerate(row) if not x]

  kv_lists = np.zeros(mask.shape, np.int32)
  kv_counts = np.zeros(mask.shape[:-1], np.int32)
  q_visits = np.zeros((*batch, heads_k, sb, group * tb), np.int32)
  q_counts = np.zeros((*batch, heads_k, sb), np.int32)
  for idx in np.ndindex(*batch):
    for h in range(n):
      for i in range(tb):
        kv_lists[idx + (h, i)] = live_first(mask[idx + (h, i)])
        kv_counts[idx + (h, i)] = mask[idx + (h, i)].sum()
    for hk in range(heads_k):
      for j in range(sb):
        entries = [mask[idx + (hk * group + g, i, j)] for g in range(group) for i in range(tb)]
        q_visits[idx + (hk, j)] = live_first(entries)
        q_counts[idx + (hk, j)] = sum(entries)
  return kv_lists, kv_counts, q_visits, q_counts


@pytest.mark.parametrize("shape,heads_k", [((2, 4, 3, 5), 2), ((1, 3, 1, 1), 1), ((2, 3, 4, 4, 6), 2)])
def test_lists_match_a_loop(shape, heads_k):
  """Per query block its live key blocks first (ascending) and their count; per key block the
  live (head in group, query block) entries head * Tb + block first (ascending) and their
  count; extra leading (vmap) dims carried through."""
  mask = np.random.default_rng(0).random(shape) < 0.4
  got = _ops.block_sparse_lists(jnp.asarray(mask), heads_k)
  for name, g, want in zip(("kv_lists", "kv_counts", "q_visits", "q_counts"), got,
                           numpy_lists(mask, heads_k)):
    assert g.dtype == jnp.int32, name
    np.testing.assert_array_equal(np.asarray(g), want, err_msg=name)


def test_cuda_calls_take_the_lists(monkeypatch):
  """Forward and backward trace to the CUDA custom calls with block_sparse=True and the lists of
  the mask's shape: the forward the two per query block, the backward all four."""
  simulate_cuda_host(monkeypatch)
  batch, seq_q, seq_k, heads_q, heads_k = 2, 300, 200, 4, 2
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((batch, seq_q, heads_q, 64)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((batch, seq_k, heads_k, 64)), jnp.bfloat16)
          for _ in range(2))
  tb, sb = jax_flash.block_mask_shape(seq_q, seq_k)
  mask = jnp.asarray(rng.random((heads_q, tb, sb)) < 0.5)

  def loss(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, implementation="cuda",
                                           block_mask=mask).astype(jnp.float32).sum()

  calls = ffi_calls(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
  assert [name for name, *_ in calls] == ["jax_flash_cuda_fwd", "jax_flash_cuda_bwd"]
  lists = [(batch, heads_q, tb, sb), (batch, heads_q, tb)]
  for name, attributes, operands, _ in calls:
    assert bool(attributes["block_sparse"]), name
    got = [tuple(x.shape) for x in operands if x.dtype == jnp.int32 and x.ndim >= 2]
    want = lists + ([(batch, heads_k, sb, heads_q // heads_k * tb), (batch, heads_k, sb)]
                    if name.endswith("bwd") else [])
    assert got == want, (name, operands)


# ---------------------------------------------------------------------------------------------
# On the GPU


CUDA_CASES = [
    # Hopper forward and 128-row backward (head dim 64): GQA 2:1, T != S with partial blocks,
    # 40% of the blocks, one query block with no key block (empty rows).
    SparseCase(Case(batch=2, seq_q=300, seq_k=520, heads_q=4, heads_k=2, head_dim=64,
                    dtype="bfloat16"), density=0.4, empty_rows=True),
    # Head dim 128 (64-row backward with bulk dQ), causal, lengths, mask over (N, Tb, Sb).
    SparseCase(Case(batch=2, seq_q=520, seq_k=520, heads_q=2, heads_k=2, head_dim=128,
                    dtype="bfloat16", is_causal=True, q_lens=(500, 200), kv_lens=(520, 300)),
               density=0.5, shape="heads"),
    # Head dim 256 (Hopper forward with 64-key blocks, mma.sync backward), float16, 25%.
    SparseCase(Case(batch=1, seq_q=260, seq_k=390, heads_q=2, heads_k=1, head_dim=256,
                    dtype="float16"), density=0.25),
    # A local window beside the mask (the one case whose forward tracks which rows met a key:
    # a row's window may lie in hidden blocks while its tile visits others), head dim 128.
    SparseCase(Case(batch=1, seq_q=500, seq_k=460, heads_q=2, heads_k=1, head_dim=128,
                    dtype="bfloat16", local_window_size=(40, 10)), density=0.5),
    # With segment ids (both narrowings at once), causal, head dim 64.
    SparseCase(Case(batch=1, seq_q=400, seq_k=400, heads_q=2, heads_k=2, head_dim=64,
                    dtype="bfloat16", is_causal=True), density=0.6, segment_ids=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("sc", CUDA_CASES, ids=[c.id for c in CUDA_CASES])
def test_cuda_against_reference(sc, deterministic, monkeypatch):
  if deterministic:
    original = jax_flash.dot_product_attention
    monkeypatch.setattr(jax_flash, "dot_product_attention",
                        functools.partial(original, deterministic=True))
  check(sc, run(sc, "cuda"))


@pytest.mark.gpu
def test_cuda_never_reads_a_hidden_block():
  """NaN keys and values in a key block hidden from every query block: the output and gradients
  equal those of the same call with zeros there (a kernel that read them would turn them into
  NaN; the hidden keys' own dK and dV are 0 both ways). Deterministic, so that dQ is
  bit-identical between the two runs (atomics add in any order: 1-ulp differences, session
  15's call 5)."""
  rng = np.random.default_rng(3)
  seq, heads = 512, 2
  q, k, v = (jnp.asarray(rng.standard_normal((1, seq, heads, 128)), jnp.bfloat16) for _ in range(3))
  mask = np.ones((1, 1, 4, 4), bool)
  mask[..., 1] = False  # key block 1 hidden from every query block
  keys_hidden = np.zeros((1, seq, 1, 1), bool)
  keys_hidden[:, 128:256] = True

  def fill(x, value):
    return jnp.where(jnp.asarray(keys_hidden), jnp.asarray(value, x.dtype), x)

  def grads(k, v):
    def loss(q, k, v):
      out = jax_flash.dot_product_attention(q, k, v, implementation="cuda", deterministic=True,
                                            block_mask=jnp.asarray(mask))
      return out.astype(jnp.float32).sum(), out
    (_, out), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *g)]

  with_nan = grads(fill(k, np.nan), fill(v, np.nan))
  with_zero = grads(fill(k, 0.0), fill(v, 0.0))
  for name, a, b in zip(("out", "dq", "dk", "dv"), with_nan, with_zero):
    assert np.all(np.isfinite(a)), name
    np.testing.assert_array_equal(a, b, err_msg=name)
