"""The CUDA custom calls called by name, as anyone can through jax.ffi.ffi_call, with operands and
attributes the Python API never passes (issue 13 item 3 on the GPU): each must fail with an error
that names the operand, before any kernel runs. The checks they share with the CPU handlers
(cuda/common/ffi_params.h) are covered operand by operand in test_ffi_validation.py; here the
CUDA handlers' own (16-bit inputs only, the padded head dim, the dQ workspace of each mode) and a
sample of the shared ones through the CUDA binding (the segment ids and their spans, the soft cap
and ALiBi slopes among them).
Marked `gpu`.

Under compute-sanitizer (no invalid access on any error path; `SANITIZE=1 .ci/gpu/check.sh` runs
it): compute-sanitizer --tool memcheck python3 -m pytest -q -m gpu tests/test_cuda_ffi_validation.py
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_flash import _registry
from test_ffi_validation import (Call, expect_invalid_argument, with_attributes, with_dtype,
                                 with_ids, with_shape, with_shapes)

pytestmark = pytest.mark.gpu

B, T, S, N, K, H = 2, 5, 7, 4, 2, 16  # a head dim the CUDA kernels take unpadded
Q, KV, ROWS = (B, T, N, H), (B, S, K, H), (B, N, T)


# The CUDA passes' segment-id operands without ids: the ids and their spans, int32 placeholders.
NO_IDS = dict(q_segment_ids=((0,), "int32"), kv_segment_ids=((0,), "int32"),
              q_segment_id_spans=((0,), "int32"), kv_segment_id_spans=((0,), "int32"))


# The block mask's lists without a block mask (the forward takes the first two).
NO_BLOCKS = dict(kv_block_lists=((0,), "int32"), kv_block_counts=((0,), "int32"),
                 q_block_visits=((0,), "int32"), q_block_visit_counts=((0,), "int32"))
NO_FWD_BLOCKS = {k: NO_BLOCKS[k] for k in ("kv_block_lists", "kv_block_counts")}
TB, SB = 1, 1  # mask blocks of 128 rows / keys: T = 5 and S = 7 make one each


# Dropout's seeds without dropout: a uint32 placeholder (its rate 0.0 in attributes()).
NO_DROPOUT = dict(dropout_seeds=((0,), "uint32"))


# jax.nn's bias and mask arrays without them: placeholders (their switches off in attributes());
# the CUDA handlers take the mask as its bits (jax_flash._logit_arrays.cuda_mask_bits).
NO_ARRAYS = dict(bias=((0,), "float32"), mask=((0,), "uint32"))


def attributes(**overrides) -> dict:
  base = dict(scale=0.25, is_causal=False, window_left=np.int64(-1), window_right=np.int64(-1),
              segment_ids=False, logits_soft_cap=0.0, alibi=False, block_sparse=False, dropout_rate=0.0,
              bias=False, mask=False)
  return {**base, **overrides}


def valid_fwd(dtype: str = "bfloat16", o_error: bool = False) -> Call:
  """With `o_error`, the kernel also writes o's int8 rounding error (a differentiated call's
  split o: KernelConfig.o_split); else that result is the empty placeholder."""
  return Call("jax_flash_cuda_fwd",
              dict(q=(Q, dtype), k=(KV, dtype), v=(KV, dtype), q_lens=((B,), "int32"),
                   kv_lens=((B,), "int32"), **NO_IDS, alibi_slopes=((0,), "float32"), **NO_FWD_BLOCKS,
                   **NO_DROPOUT, **NO_ARRAYS),
              dict(o=(Q, dtype), lse=(ROWS, "float32"), o_error=(Q if o_error else (0,), "int8"),
                   scheduler=((_registry.CUDA_KERNEL_CONSTANTS["fwd_scheduler_elements"],), "int32")),
              attributes())


def dq_accum_elements(deterministic: bool) -> int:
  return _registry.cuda_dq_accum_elements(B, T, S, N, K, H, deterministic)


def valid_bwd(dtype: str = "bfloat16", deterministic: bool = False) -> Call:
  """The CUDA backward takes delta = rowsum(dO * O), formed by XLA, in place of o."""
  return Call("jax_flash_cuda_bwd",
              dict(q=(Q, dtype), k=(KV, dtype), v=(KV, dtype), lse=(ROWS, "float32"),
                   delta=(ROWS, "float32"), do=(Q, dtype), q_lens=((B,), "int32"),
                   kv_lens=((B,), "int32"), **NO_IDS, alibi_slopes=((0,), "float32"), **NO_BLOCKS,
                   **NO_DROPOUT, **NO_ARRAYS),
              dict(dq=(Q, dtype), dk=(KV, dtype), dv=(KV, dtype),
                   dq_accum=((dq_accum_elements(deterministic),), "float32"),
                   dbias=((0,), "float32")),
              attributes(deterministic=deterministic))


@pytest.mark.parametrize("make", [valid_fwd, valid_bwd], ids=["fwd", "bwd"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_valid_calls_run(rng, make, dtype):
  """The calls the error cases spoil are valid: the errors below come from the spoiled field."""
  outputs = make(dtype).run(rng)
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in outputs[:2])


def test_forward_writing_the_rounding_error_of_o_runs(rng):
  o, lse, o_error, _ = valid_fwd(o_error=True).run(rng)
  assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
  assert np.asarray(o_error).dtype == np.int8 and np.asarray(o_error).shape == Q


def test_deterministic_backward_takes_no_dq_workspace(rng):
  valid_bwd(deterministic=True).run(rng)
  expect_invalid_argument(with_attributes(valid_bwd(deterministic=True), deterministic=False), rng,
                          ("dq_accum(", "elements, expected"))


# (id, spoil, fragments of the error), for both passes.
ERRORS = [
    ("float32_inputs", lambda c: with_dtype(c, "float32", "q", "k", "v", "o", "do", "dq", "dk", "dv"),
     ("CUDA kernels take bfloat16 or float16", "q(2, 5, 4, 16) float32")),
    ("head_dim_unpadded", lambda c: with_shapes(c, (B, T, N, 12), (B, S, K, 12)),
     ("head dims padded to a multiple of 8", "q(2, 5, 4, 12)")),
    ("k_f16_q_bf16", lambda c: with_dtype(c, "float16", "k", "v"),
     ("one dtype", "q(2, 5, 4, 16) bfloat16", "k(2, 7, 2, 16) float16")),
    ("lse_short", lambda c: with_shape(c, "lse", (B, N, T - 1)), ("lse(2, 4, 4) float32", "expected 40")),
    ("kv_lens_int16", lambda c: with_dtype(c, "int16", "kv_lens"), ("kv_lens(2,) int16", "int32")),
    ("heads_not_multiple", lambda c: with_shapes(c, (B, T, 3, H), KV),
     ("multiple of key/value heads", "q(2, 5, 3, 16)")),
    ("batch_mismatch", lambda c: with_shapes(c, Q, (B + 1, S, K, H)), ("batch dimensions",)),
    ("head_dim_300", lambda c: with_shapes(c, (B, T, N, 304), (B, S, K, 304)), ("head dim H=304",)),
    ("scale_nan", lambda c: with_attributes(c, scale=float("nan")), ("scale", "got nan")),
    ("window_left_-2", lambda c: with_attributes(c, window_left=np.int64(-2)), ("window_left", "got -2")),
    ("soft_cap_negative", lambda c: with_attributes(c, logits_soft_cap=-1.0), ("logits_soft_cap",)),
    ("alibi_without_slopes", lambda c: with_attributes(c, alibi=True), ("alibi_slopes(0,) float32",)),
    ("alibi_slopes_shape", lambda c: with_shape(with_attributes(c, alibi=True), "alibi_slopes", (B, N + 1)),
     ("alibi_slopes(2, 5) float32",)),
    ("segment_ids_on_empty", lambda c: with_attributes(c, segment_ids=True),
     ("q_segment_ids(0,) int32", "without its last two dims")),
    ("segment_ids_without_spans", lambda c: with_ids(c),
     ("q_segment_id_spans(0,) int32", "(lo, hi) of every 64 ids", "q_segment_ids(2, 5) int32")),
    ("segment_id_spans_short",
     lambda c: with_shape(with_shape(with_ids(c), "q_segment_id_spans", (B, 1, 2)),
                          "kv_segment_id_spans", (B, 1, 1)),
     ("kv_segment_id_spans(2, 1, 1) int32", "kv_segment_ids(2, 7) int32")),
    ("segment_id_spans_without_ids", lambda c: with_shape(c, "q_segment_id_spans", (B, 1, 2)),
     ("segment_ids=false takes empty segment-id span operands", "q_segment_id_spans(2, 1, 2) int32")),
    ("block_lists_without_switch", lambda c: with_shape(c, "kv_block_lists", (B, N, TB, SB)),
     ("block_sparse=false takes empty block-list operands", "kv_block_lists(2, 4, 1, 1) int32")),
    ("block_sparse_on_empty", lambda c: with_attributes(c, block_sparse=True),
     ("kv_block_lists(0,) int32", "(N, Tb, Sb)", "ceil(T / 128)")),
    ("block_counts_shape", lambda c: with_shape(with_shape(with_attributes(c, block_sparse=True),
                                                           "kv_block_lists", (B, N, TB, SB)),
                                                "kv_block_counts", (B, N, TB + 1)),
     ("kv_block_counts(2, 4, 2) int32", "(N, Tb)")),
    ("block_lists_int16", lambda c: with_dtype(c, "int16", "kv_block_lists"),
     ("kv_block_lists(0,) int16", "int32")),
    # jax.nn's arrays: the shared checks, and the CUDA kernels' own limits (head dim 16 runs the
    # mma.sync kernels, which take none).
    ("mask_off_not_empty", lambda c: with_shape(c, "mask", (B, 1, T, S)), ("mask=false takes an empty",)),
    ("bias_keys", lambda c: with_attributes(with_shape(c, "bias", (1, N, T, S + 1)), bias=True),
     ("bias(1, 4, 5, 8)", "S=7")),
    ("mask_bits_words", lambda c: with_attributes(with_shape(c, "mask", (B, 1, 1, 8)), mask=True),
     ("mask(2, 1, 1, 8) uint32", "the mask's bits must be", ", 4) with q's rank")),
    ("mask_on_the_mma_sync_kernels",
     lambda c: with_attributes(with_shape(c, "mask", (B, 1, 1, 4)), mask=True),
     ("bias and mask arrays on the CUDA kernels: the Hopper kernels only", "head dim 16")),
]

def with_block_lists(call: Call) -> Call:
  """`call` block-sparse, with lists of the right shapes (the forward's two, the backward's
  four)."""
  call = with_attributes(call, block_sparse=True)
  call = with_shape(with_shape(call, "kv_block_lists", (B, N, TB, SB)), "kv_block_counts", (B, N, TB))
  if "q_block_visits" in call.shapes:
    call = with_shape(with_shape(call, "q_block_visits", (B, K, SB, N // K * TB)),
                      "q_block_visit_counts", (B, K, SB))
  return call


# The forward's o and its o_error result (a differentiated call's split o).
FWD_ERRORS = [
    ("o_shape", lambda c: with_shape(c, "o", (B, T, N, H + 8)), ("o(2, 5, 4, 24)", "must match")),
    ("o_error_shape", lambda c: with_shape(c, "o_error", (B, T, N, H - 8)),
     ("o_error(2, 5, 4, 8) int8", "shape of a 16-bit")),
    ("o_error_int16", lambda c: with_dtype(c, "int16", "o_error"), ("o_error(0,) int16", "must be int8")),
    ("o_error_beside_float32_o", lambda c: with_shape(with_dtype(c, "float32", "o"), "o_error", Q),
     ("o_error(2, 5, 4, 16) int8", "shape of a 16-bit", "o(2, 5, 4, 16) float32")),
    # The scheduler workspace (the persistent grid's tile counter).
    ("scheduler_empty", lambda c: with_shape(c, "scheduler", (0,)),
     ("scheduler(0,) int32", "must hold at least 1 int32")),
    ("scheduler_int16", lambda c: with_dtype(c, "int16", "scheduler"), ("scheduler(1,) int16", "must be int32")),
]


BWD_ERRORS = [
    ("dbias_shape", lambda c: with_shape(with_attributes(with_shape(c, "bias", (1, N, T, S)), bias=True),
                                         "dbias", (1, N, T, S + 1)),
     ("dbias(1, 4, 5, 8) float32", "elements, expected 140")),
    ("dq_accum_short", lambda c: with_shape(c, "dq_accum", (dq_accum_elements(False) - 1,)),
     ("dq_accum(", "elements, expected")),
    ("dq_accum_bf16", lambda c: with_dtype(c, "bfloat16", "dq_accum"), ("dq_accum(", "bfloat16")),
    ("delta_short", lambda c: with_shape(c, "delta", (B, N)), ("delta(2, 4) float32", "expected 40")),
    ("dk_dtype", lambda c: with_dtype(c, "float16", "dk"), ("dk(2, 7, 2, 16) float16", "must match")),
    ("do_shape", lambda c: with_shape(c, "do", (B, T + 1, N, H)), ("do(2, 6, 4, 16)", "must match")),
    ("delta_bf16", lambda c: with_dtype(c, "bfloat16", "delta"), ("delta(2, 4, 5) bfloat16",)),
    ("q_block_visits_shape", lambda c: with_shape(with_block_lists(c), "q_block_visits", (B, K, SB, TB)),
     ("q_block_visits(2, 2, 1, 1) int32", "(K, Sb, N / K * Tb)")),
    ("q_block_visit_counts_without_switch", lambda c: with_shape(c, "q_block_visit_counts", (B, K, SB)),
     ("block_sparse=false takes empty block-list operands", "q_block_visit_counts(2, 2, 1) int32")),
]


@pytest.mark.parametrize("make", [valid_fwd, valid_bwd], ids=["fwd", "bwd"])
def test_block_sparse_call_with_its_lists_runs(rng, make):
  """The lists' shapes as the handlers expect them (their values random in 0..7 from the test's
  operand builder, mostly out of range, which the kernels clamp: no access outside the arrays;
  compute-sanitizer's memcheck of this file checks that)."""
  outputs = with_block_lists(make()).run(rng)
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in outputs[:2])


@pytest.mark.parametrize("spoil,fragments", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
@pytest.mark.parametrize("make", [valid_fwd, valid_bwd], ids=["fwd", "bwd"])
def test_errors(rng, make, spoil, fragments):
  expect_invalid_argument(spoil(make()), rng, fragments)


@pytest.mark.parametrize("spoil,fragments", [e[1:] for e in FWD_ERRORS], ids=[e[0] for e in FWD_ERRORS])
def test_fwd_errors(rng, spoil, fragments):
  expect_invalid_argument(spoil(valid_fwd()), rng, fragments)


@pytest.mark.parametrize("spoil,fragments", [e[1:] for e in BWD_ERRORS], ids=[e[0] for e in BWD_ERRORS])
def test_bwd_errors(rng, spoil, fragments):
  expect_invalid_argument(spoil(valid_bwd()), rng, fragments)
