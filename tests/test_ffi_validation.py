"""The CPU custom calls called by name, as anyone can through jax.ffi.ffi_call, with operands and
attributes the Python API never passes: each must fail with an error that names the operand
(never read or write past a buffer). The checks live in cuda/common/ffi_params.h, which the CUDA
handlers share, so these tests cover those too (the CUDA handlers' own checks, 16-bit dtypes and a
padded head dim, need a GPU)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _dropout, _registry

INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min

# An FFI handler's error comes back from the compiled call as a runtime error, INVALID_ARGUMENT.
FFI_ERROR = jax.errors.JaxRuntimeError


def pattern(*fragments: str) -> str:
  """A regex matching the literal fragments, in order, anywhere in the message."""
  return "(?s)" + ".*".join(re.escape(f) for f in fragments)


def spec(shape, dtype="float32") -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def array(rng, shape, dtype="float32") -> jax.Array:
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.asarray(rng.integers(0, 8, size=shape), dtype)
  return jnp.asarray(rng.standard_normal(shape), dtype)


@dataclasses.dataclass
class Call:
  """One direct call of jax_flash_cpu_fwd or jax_flash_cpu_bwd: operand shapes and dtypes, the
  specs of the outputs and the attributes, valid as built by `valid_fwd` / `valid_bwd`, then
  spoiled one field at a time by a test."""

  target: str
  shapes: dict  # operand name -> (shape, dtype), in the binding's order
  outputs: dict  # output name -> (shape, dtype), in the binding's order
  attributes: dict

  def run(self, rng):
    operands = [array(rng, s, d) for s, d in self.shapes.values()]
    call = jax.ffi.ffi_call(self.target, tuple(spec(s, d) for s, d in self.outputs.values()))
    return jax.block_until_ready(jax.jit(lambda *a: call(*a, **self.attributes))(*operands))


B, T, S, N, K, H = 2, 5, 7, 4, 2, 8
Q, KV, ROWS = (B, T, N, H), (B, S, K, H), (B, N, T)
W = _dropout.SEED_WORDS  # dropout's seed words, as the native module gives them


# The CPU passes' segment-id operands without ids: int32 placeholders with no elements; and
# their ALiBi operand without slopes, a float32 one; their block mask without one, a bool one;
# their dropout seeds without dropout, a uint32 one; their bias and mask without them, a float32
# and a bool one.
NO_IDS = dict(q_segment_ids=((0,), "int32"), kv_segment_ids=((0,), "int32"),
              alibi_slopes=((0,), "float32"), block_mask=((0,), "bool"),
              dropout_seeds=((0,), "uint32"), bias=((0,), "float32"), mask=((0,), "bool"))


def attributes(**overrides) -> dict:
  base = dict(scale=0.5, is_causal=False, window_left=np.int64(-1), window_right=np.int64(-1),
              segment_ids=False, logits_soft_cap=0.0, alibi=False, block_sparse=False,
              dropout_rate=0.0, bias=False, mask=False)
  return {**base, **overrides}


def valid_fwd() -> Call:
  return Call("jax_flash_cpu_fwd",
              dict(q=(Q, "float32"), k=(KV, "float32"), v=(KV, "float32"), q_lens=((B,), "int32"),
                   kv_lens=((B,), "int32"), **NO_IDS),
              dict(o=(Q, "float32"), lse=(ROWS, "float32")), attributes())


def dq_accum_elements(splits: int, shape=Q) -> int:
  *batch, t, n, h = shape
  return _registry.cpu_dq_accum_elements(splits, int(np.prod(batch)), t, n, h)


def valid_bwd(splits: int = 2) -> Call:
  return Call("jax_flash_cpu_bwd",
              dict(q=(Q, "float32"), k=(KV, "float32"), v=(KV, "float32"), o=(Q, "float32"),
                   lse=(ROWS, "float32"), do=(Q, "float32"), q_lens=((B,), "int32"),
                   kv_lens=((B,), "int32"), **NO_IDS),
              dict(dq=(Q, "float32"), dk=(KV, "float32"), dv=(KV, "float32"),
                   delta=(ROWS, "float32"), dq_accum=((dq_accum_elements(splits),), "float32"),
                   dbias=((0,), "float32"), dbias_accum=((0,), "float32")),
              attributes(dq_splits=np.int64(splits), deterministic=False))


def with_dtype(call: Call, dtype: str, *names: str) -> Call:
  """`names` given `dtype`, those of them the call has."""
  for name in names:
    for table in (call.shapes, call.outputs):
      if name in table:
        table[name] = (table[name][0], dtype)
  return call


def with_shape(call: Call, name: str, shape) -> Call:
  table = call.shapes if name in call.shapes else call.outputs
  table[name] = (tuple(shape), table[name][1])
  return call


def with_shapes(call: Call, q_shape, kv_shape) -> Call:
  """q, k, v and everything shaped like them (outputs, cotangents) reshaped together."""
  for name in ("q", "o", "do", "dq"):
    for table in (call.shapes, call.outputs):
      if name in table:
        table[name] = (tuple(q_shape), table[name][1])
  for name in ("k", "v", "dk", "dv"):
    for table in (call.shapes, call.outputs):
      if name in table:
        table[name] = (tuple(kv_shape), table[name][1])
  return call


def with_attributes(call: Call, **overrides) -> Call:
  call.attributes.update(overrides)
  return call


def with_ids(call: Call, q_ids=(B, T), kv_ids=(B, S), dtype="int32") -> Call:
  """Segment ids switched on, with operands of these shapes."""
  call.shapes["q_segment_ids"] = (tuple(q_ids), dtype)
  call.shapes["kv_segment_ids"] = (tuple(kv_ids), dtype)
  return with_attributes(call, segment_ids=True)


def with_alibi(call: Call, shape=(B, N), dtype="float32") -> Call:
  """ALiBi switched on, with a slopes operand of this shape."""
  call.shapes["alibi_slopes"] = (tuple(shape), dtype)
  return with_attributes(call, alibi=True)


def with_block_mask(call: Call, shape=(B, N, 1, 1), dtype="bool") -> Call:
  """The block mask switched on, with an operand of this shape (T = 5, S = 7: one block)."""
  call.shapes["block_mask"] = (tuple(shape), dtype)
  return with_attributes(call, block_sparse=True)


# Sequences of several blocks of the block mask's 128 x 128 (and more of 64 x 64, the CPU
# kernel's tiles): T = 200, S = 300 are (2, 3) blocks, (4, 5) of 64.
LONG_T, LONG_S = 200, 300


def with_long_sequences(call: Call) -> Call:
  """The call on T = LONG_T queries and S = LONG_S keys (everything shaped by them)."""
  q_shape = (B, LONG_T, N, H)
  call = with_shapes(call, q_shape, (B, LONG_S, K, H))
  for name in ("lse", "delta"):
    for table in (call.shapes, call.outputs):
      if name in table:
        table[name] = ((B, N, LONG_T), table[name][1])
  if "dq_accum" in call.outputs:
    splits = int(call.attributes["dq_splits"])
    call.outputs["dq_accum"] = ((dq_accum_elements(splits, q_shape),), "float32")
  return call


def with_dropout(call: Call, shape=(B, N, W), dtype="uint32", rate=0.25) -> Call:
  """Dropout switched on (a rate > 0), with a seeds operand of this shape."""
  call.shapes["dropout_seeds"] = (tuple(shape), dtype)
  return with_attributes(call, dropout_rate=rate)


def with_bias(call: Call, shape=(1, N, T, S), dtype="float32", accum=None) -> Call:
  """A bias switched on, with an operand of this shape; the backward's dbias like it and its
  float32 workspace of `accum` elements (by default as the native module sizes it)."""
  call.shapes["bias"] = (tuple(shape), dtype)
  if "dbias" in call.outputs:
    call.outputs["dbias"] = (tuple(shape), dtype)
    if accum is None:
      one_each = len(shape) >= 3 and _registry.cpu_dbias_one_each(shape, B, N, T, S)
      accum = _registry.cpu_dbias_accum_elements(int(np.prod(shape)), shape[-1] == 1,
                                                 dtype == "float32",
                                                 int(call.attributes["dq_splits"]), one_each)
    call.outputs["dbias_accum"] = ((accum,), "float32")
  return with_attributes(call, bias=True)


def with_mask(call: Call, shape=(B, 1, T, S), dtype="bool") -> Call:
  """A mask array switched on, with an operand of this shape."""
  call.shapes["mask"] = (tuple(shape), dtype)
  return with_attributes(call, mask=True)


# Errors both passes share (the checks of cuda/common/ffi_params.h): (id, spoil, fragments).
COMMON_ERRORS = [
    ("k_bf16", lambda c: with_dtype(c, "bfloat16", "k", "v"),
     ("one dtype", "q(2, 5, 4, 8) float32", "k(2, 7, 2, 8) bfloat16")),
    ("v_f16", lambda c: with_dtype(c, "float16", "v"), ("one dtype", "v(2, 7, 2, 8) float16")),
    ("k_f32_q_bf16", lambda c: with_dtype(c, "bfloat16", "q", "o", "do", "dq"),
     ("one dtype", "q(2, 5, 4, 8) bfloat16", "k(2, 7, 2, 8) float32")),
    ("int_inputs", lambda c: with_dtype(c, "int32", "q", "k", "v"),
     ("q(2, 5, 4, 8) int32", "unsupported dtype")),
    ("o_shape", lambda c: with_shape(c, "o", (B, T, N, H + 1)),
     ("o(2, 5, 4, 9) float32", "must match", "q(2, 5, 4, 8)")),
    ("o_dtype", lambda c: with_dtype(c, "bfloat16", "o"), ("o(2, 5, 4, 8) bfloat16", "must match")),
    ("lse_short", lambda c: with_shape(c, "lse", (B, N, T - 1)),
     ("lse(2, 4, 4) float32", "32 elements, expected 40")),
    ("lse_transposed_long", lambda c: with_shape(c, "lse", (B, N, T, 2)), ("lse(2, 4, 5, 2)",)),
    ("lse_bf16", lambda c: with_dtype(c, "bfloat16", "lse"), ("lse(2, 4, 5) bfloat16", "float32")),
    ("q_lens_short", lambda c: with_shape(c, "q_lens", (B - 1,)),
     ("q_lens(1,) int32", "one entry per batch element", "(2)")),
    ("kv_lens_long", lambda c: with_shape(c, "kv_lens", (B, 2)), ("kv_lens(2, 2) int32",)),
    ("q_lens_float", lambda c: with_dtype(c, "float32", "q_lens"), ("q_lens(2,) float32", "int32")),
    ("kv_lens_int16", lambda c: with_dtype(c, "int16", "kv_lens"), ("kv_lens(2,) int16", "int32")),
    ("head_dim_0", lambda c: with_shapes(c, (B, T, N, 0), (B, S, K, 0)), ("head dim H=0", "q(2, 5, 4, 0)")),
    ("head_dim_300", lambda c: with_shapes(c, (B, T, N, 300), (B, S, K, 300)),
     ("head dim H=300", "1..256", "q(2, 5, 4, 300)")),
    ("head_dim_differs", lambda c: with_shapes(c, Q, (B, S, K, H * 2)),
     ("same head dim", "q(2, 5, 4, 8)", "k(2, 7, 2, 16)")),
    ("rank_mismatch", lambda c: with_shapes(c, Q, (S, K, H)),
     ("one rank", "q(2, 5, 4, 8)", "k(7, 2, 8)")),
    ("rank_2", lambda c: with_shapes(c, (T, H), (S, H)), ("rank >= 3", "q(5, 8)")),
    ("v_rank", lambda c: with_shape(c, "v", (1,) + KV), ("one rank", "v(1, 2, 7, 2, 8)")),
    ("batch_mismatch", lambda c: with_shapes(c, Q, (B + 1, S, K, H)),
     ("batch dimensions", "q(2, 5, 4, 8)", "k(3, 7, 2, 8)")),
    # Same batch size, different batch dims: (2, 3) against (3, 2).
    ("batch_dims_permuted", lambda c: with_shapes(with_shape(with_shape(c, "q_lens", (6,)), "kv_lens", (6,)),
                                                  (2, 3, T, N, H), (3, 2, S, K, H)),
     ("batch dimensions", "q(2, 3, 5, 4, 8)", "k(3, 2, 7, 2, 8)")),
    ("heads_not_multiple", lambda c: with_shapes(c, (B, T, 3, H), KV),
     ("multiple of key/value heads", "q(2, 5, 3, 8)", "k(2, 7, 2, 8)")),
    ("kv_heads_0", lambda c: with_shapes(c, Q, (B, S, 0, H)), ("K >= 1", "k(2, 7, 0, 8)")),
    ("k_v_differ", lambda c: with_shape(c, "v", (B, S + 1, K, H)),
     ("k and v shapes differ", "k(2, 7, 2, 8)", "v(2, 8, 2, 8)")),
    ("scale_nan", lambda c: with_attributes(c, scale=float("nan")), ("scale", "got nan")),
    ("scale_inf", lambda c: with_attributes(c, scale=float("inf")), ("scale", "got inf")),
    ("scale_negative", lambda c: with_attributes(c, scale=-0.5), ("scale", "got -0.5")),
    ("scale_zero", lambda c: with_attributes(c, scale=0.0), ("scale", "got 0")),
    ("scale_float32_inf", lambda c: with_attributes(c, scale=1e39), ("scale", "float32", "got 1e+39")),
    # Finite in float32, but not once the kernels multiply it by log2(e).
    ("scale_times_log2e_inf", lambda c: with_attributes(c, scale=3e38), ("scale", "log2(e)", "got 3e+38")),
    ("scale_float32_zero", lambda c: with_attributes(c, scale=1e-50), ("scale", "got 1e-50")),
    ("scale_subnormal", lambda c: with_attributes(c, scale=1e-44), ("scale", "normal", "got 1e-44")),
    ("window_left_-2", lambda c: with_attributes(c, window_left=np.int64(-2)), ("window_left", "got -2")),
    ("window_right_min", lambda c: with_attributes(c, window_right=np.int64(INT64_MIN)),
     ("window_right", str(INT64_MIN))),
    # Segment ids: the switch and the operands must agree, int32, shaped like q and k's rows.
    ("segment_ids_on_empty", lambda c: with_attributes(c, segment_ids=True),
     ("q_segment_ids(0,) int32", "without its last two dims", "q(2, 5, 4, 8)")),
    ("segment_ids_off_given", lambda c: with_attributes(with_ids(c), segment_ids=False),
     ("segment_ids=false takes empty", "q_segment_ids(2, 5) int32", "kv_segment_ids(2, 7) int32")),
    ("q_ids_transposed", lambda c: with_ids(c, q_ids=(T, B)), ("q_segment_ids(5, 2) int32", "q(2, 5, 4, 8)")),
    ("kv_ids_long", lambda c: with_ids(c, kv_ids=(B, S + 1)),
     ("kv_segment_ids(2, 8) int32", "one id per key row", "k(2, 7, 2, 8)")),
    ("kv_ids_rank", lambda c: with_ids(c, kv_ids=(B, S, 1)), ("kv_segment_ids(2, 7, 1) int32",)),
    ("q_ids_int16", lambda c: with_ids(c, dtype="int16"), ("q_segment_ids(2, 5) int16", "int32")),
    ("kv_ids_float", lambda c: with_dtype(c, "float32", "kv_segment_ids"),
     ("kv_segment_ids(0,) float32", "int32")),
    # logits_soft_cap: 0 is off; otherwise a positive normal float32 whose product with log2(e)
    # is finite.
    ("soft_cap_negative", lambda c: with_attributes(c, logits_soft_cap=-1.0),
     ("logits_soft_cap", "0 (off) or a positive", "got -1")),
    ("soft_cap_nan", lambda c: with_attributes(c, logits_soft_cap=float("nan")),
     ("logits_soft_cap", "got nan")),
    ("soft_cap_inf", lambda c: with_attributes(c, logits_soft_cap=float("inf")),
     ("logits_soft_cap", "got inf")),
    ("soft_cap_float32_inf", lambda c: with_attributes(c, logits_soft_cap=1e39),
     ("logits_soft_cap", "got 1e+39")),
    ("soft_cap_times_log2e_inf", lambda c: with_attributes(c, logits_soft_cap=3e38),
     ("logits_soft_cap", "log2(e)", "got 3e+38")),
    ("soft_cap_subnormal", lambda c: with_attributes(c, logits_soft_cap=1e-40),
     ("logits_soft_cap", "normal", "got 1e-40")),
    # ALiBi: the switch and the operand must agree; float32 slopes shaped (batch dims..., N).
    ("alibi_on_empty", lambda c: with_attributes(c, alibi=True),
     ("alibi_slopes(0,) float32", "batch dims and query heads", "q(2, 5, 4, 8)")),
    ("alibi_off_given", lambda c: with_attributes(with_alibi(c), alibi=False),
     ("alibi=false takes an empty", "alibi_slopes(2, 4) float32")),
    ("alibi_unbatched", lambda c: with_alibi(c, shape=(N,)), ("alibi_slopes(4,) float32", "(..., N)")),
    ("alibi_kv_heads", lambda c: with_alibi(c, shape=(B, K)), ("alibi_slopes(2, 2) float32", "q(2, 5, 4, 8)")),
    ("alibi_transposed", lambda c: with_alibi(c, shape=(N, B)), ("alibi_slopes(4, 2) float32",)),
    ("alibi_rank", lambda c: with_alibi(c, shape=(B, N, 1)), ("alibi_slopes(2, 4, 1) float32",)),
    ("alibi_bf16", lambda c: with_alibi(c, dtype="bfloat16"), ("alibi_slopes(2, 4) bfloat16", "float32")),
    ("alibi_empty_f16", lambda c: with_dtype(c, "float16", "alibi_slopes"),
     ("alibi_slopes(0,) float16", "float32")),
    # Block mask: the switch and the operand must agree; bool (batch dims..., N, Tb, Sb).
    ("blocks_on_empty", lambda c: with_attributes(c, block_sparse=True),
     ("block_mask(0,) bool", "(1, 1) blocks of 128 x 128", "q(2, 5, 4, 8)")),
    # Blocks of 128 x 128, not of the CPU kernel's 64 x 64 tiles: T = 200, S = 300 take (2, 3).
    ("blocks_of_64", lambda c: with_block_mask(with_long_sequences(c), shape=(B, N, 4, 5)),
     ("block_mask(2, 4, 4, 5) bool", "(2, 3) blocks of 128 x 128", "q(2, 200, 4, 8)",
      "seq_k 300")),
    ("blocks_short_by_one", lambda c: with_block_mask(with_long_sequences(c), shape=(B, N, 2, 2)),
     ("block_mask(2, 4, 2, 2) bool", "(2, 3) blocks")),
    ("blocks_off_given", lambda c: with_attributes(with_block_mask(c), block_sparse=False),
     ("block_sparse=false takes an empty", "block_mask(2, 4, 1, 1) bool")),
    ("blocks_unbatched", lambda c: with_block_mask(c, shape=(N, 1, 1)), ("block_mask(4, 1, 1) bool",)),
    ("blocks_kv_heads", lambda c: with_block_mask(c, shape=(B, K, 1, 1)), ("block_mask(2, 2, 1, 1) bool",)),
    ("blocks_too_many", lambda c: with_block_mask(c, shape=(B, N, 2, 1)), ("block_mask(2, 4, 2, 1) bool",)),
    ("blocks_elements", lambda c: with_block_mask(c, shape=(B, N, T, S)), ("block_mask(2, 4, 5, 7) bool",)),
    ("blocks_uint8", lambda c: with_block_mask(c, dtype="uint8"), ("block_mask(2, 4, 1, 1) uint8", "bool")),
    ("blocks_empty_int32", lambda c: with_dtype(c, "int32", "block_mask"), ("block_mask(0,) int32", "bool")),
    # Dropout: a rate in [0, 1); rate > 0 takes uint32 seeds (batch dims..., N, W), rate 0 none.
    ("dropout_on_empty", lambda c: with_attributes(c, dropout_rate=0.5),
     ("dropout_seeds(0,) uint32", f"(..., N, {W})", "q(2, 5, 4, 8)")),
    ("dropout_off_given", lambda c: with_dropout(c, rate=0.0),
     ("dropout_rate=0 takes an empty", f"dropout_seeds(2, 4, {W}) uint32")),
    ("dropout_rate_1", lambda c: with_dropout(c, rate=1.0), ("dropout_rate", "[0, 1)", "got 1")),
    ("dropout_rate_negative", lambda c: with_attributes(c, dropout_rate=-0.5),
     ("dropout_rate", "got -0.5")),
    ("dropout_rate_nan", lambda c: with_dropout(c, rate=float("nan")), ("dropout_rate", "got nan")),
    ("dropout_kv_heads", lambda c: with_dropout(c, shape=(B, K, W)), (f"dropout_seeds(2, 2, {W}) uint32",)),
    ("dropout_words", lambda c: with_dropout(c, shape=(B, N, 4)), ("dropout_seeds(2, 4, 4) uint32",)),
    ("dropout_unbatched", lambda c: with_dropout(c, shape=(N, W)), (f"dropout_seeds(4, {W}) uint32",)),
    ("dropout_int32", lambda c: with_dropout(c, dtype="int32"), (f"dropout_seeds(2, 4, {W}) int32", "uint32")),
]

LOGIT_ERRORS = [
    ("bias_kv_heads", lambda c: with_bias(c, shape=(1, K, T, S)), ("bias(1, 2, 5, 7) float32", "N|1")),
    ("bias_rank2", lambda c: with_bias(c, shape=(T, S)), ("bias(5, 7) float32", "q's rank")),
    ("bias_batch_3", lambda c: with_bias(c, shape=(3, N, T, S)), ("bias(3, 4, 5, 7)", "divides")),
    ("bias_keys", lambda c: with_bias(c, shape=(1, N, T, S + 1)), ("bias(1, 4, 5, 8)", "S=7")),
    ("bias_int32", lambda c: with_bias(c, dtype="int32"), ("bias(1, 4, 5, 7) int32", "float32, bfloat16")),
    ("bias_off_not_empty", lambda c: with_attributes(with_bias(c), bias=False),
     ("bias=false takes an empty", "bias(1, 4, 5, 7)")),
    ("mask_float", lambda c: with_mask(c, dtype="float32"), ("mask(2, 1, 5, 7) float32", "bool")),
    ("mask_rows", lambda c: with_mask(c, shape=(B, 1, T + 1, S)), ("mask(2, 1, 6, 7) bool", "T=5")),
    ("mask_off_not_empty", lambda c: with_attributes(with_mask(c), mask=False),
     ("mask=false takes an empty",)),
]

BWD_ERRORS = [
    ("do_dtype", lambda c: with_dtype(c, "bfloat16", "do"), ("do(2, 5, 4, 8) bfloat16", "must match")),
    ("do_shape", lambda c: with_shape(c, "do", (B, T + 1, N, H)), ("do(2, 6, 4, 8)", "must match")),
    ("dq_shape", lambda c: with_shape(c, "dq", (B, T, N, H - 1)), ("dq(2, 5, 4, 7)", "must match")),
    ("dk_dtype", lambda c: with_dtype(c, "bfloat16", "dk"), ("dk(2, 7, 2, 8) bfloat16", "must match", "k(")),
    ("dv_shape", lambda c: with_shape(c, "dv", (B, S - 1, K, H)), ("dv(2, 6, 2, 8)", "must match", "v(")),
    ("delta_short", lambda c: with_shape(c, "delta", (B, N)), ("delta(2, 4) float32", "expected 40")),
    ("delta_bf16", lambda c: with_dtype(c, "bfloat16", "delta"), ("delta(2, 4, 5) bfloat16", "float32")),
    ("dq_accum_short", lambda c: with_shape(c, "dq_accum", (dq_accum_elements(2) - 1,)),
     ("dq_accum(", f"expected {dq_accum_elements(2)}")),
    ("dq_accum_one_split_for_two", lambda c: with_shape(c, "dq_accum", (dq_accum_elements(1),)),
     ("dq_accum(", f"expected {dq_accum_elements(2)}")),
    ("dq_accum_bf16", lambda c: with_dtype(c, "bfloat16", "dq_accum"), ("dq_accum(", "bfloat16", "float32")),
    ("dq_splits_0", lambda c: with_attributes(c, dq_splits=np.int64(0)), ("dq_splits", "got 0")),
    ("dq_splits_negative", lambda c: with_attributes(c, dq_splits=np.int64(-3)), ("dq_splits", "got -3")),
    ("dq_splits_65", lambda c: with_attributes(c, dq_splits=np.int64(65)), ("dq_splits", "[1, 64]; got 65")),
    # A huge split count whose workspace size wraps around int64 must not pass the size check.
    ("dq_splits_huge", lambda c: with_attributes(c, dq_splits=np.int64(1 << 62)), ("dq_splits", "[1, 64]")),
    ("dbias_shape", lambda c: with_shape(with_bias(c), "dbias", (N, T, S)), ("dbias(4, 5, 7)", "must match", "bias(")),
    ("dbias_without_bias", lambda c: with_shape(c, "dbias", (1, N, T, S)), ("dbias(1, 4, 5, 7) float32", "expected 0")),
    # A bias without a key dim sums a partial per dQ split (2 here).
    ("dbias_accum_one_split", lambda c: with_bias(c, shape=(1, N, T, 1), accum=N * T),
     ("dbias_accum(", f"expected {2 * N * T}")),
    ("dbias_accum_bf16_missing", lambda c: with_bias(c, dtype="bfloat16", accum=0),
     ("dbias_accum(0,) float32", f"expected {N * T * S}")),
    # A bias of the call's every dim gives each dbias element one dS: stored directly, no workspace.
    ("dbias_accum_one_each", lambda c: with_bias(c, shape=(B, N, T, S), dtype="bfloat16", accum=B * N * T * S),
     ("dbias_accum(", "expected 0")),
]


def expect_invalid_argument(call: Call, rng, fragments) -> None:
  """Running `call` fails with an INVALID_ARGUMENT from jax_flash holding the fragments."""
  with pytest.raises(FFI_ERROR, match=pattern("INVALID_ARGUMENT", "jax_flash", *fragments)):
    call.run(rng)


@pytest.mark.parametrize("spoil,fragments", [e[1:] for e in COMMON_ERRORS], ids=[e[0] for e in COMMON_ERRORS])
@pytest.mark.parametrize("make", [valid_fwd, valid_bwd], ids=["fwd", "bwd"])
def test_common_errors(rng, make, spoil, fragments):
  expect_invalid_argument(spoil(make()), rng, fragments)


@pytest.mark.parametrize("spoil,fragments", [e[1:] for e in LOGIT_ERRORS], ids=[e[0] for e in LOGIT_ERRORS])
@pytest.mark.parametrize("make", [valid_fwd, valid_bwd], ids=["fwd", "bwd"])
def test_bias_and_mask_errors(rng, make, spoil, fragments):
  expect_invalid_argument(spoil(make()), rng, fragments)


@pytest.mark.parametrize("bias_shape,dtype,mask_shape", [
    ((1, N, T, S), "float32", (B, 1, T, S)), ((B, 1, 1, S), "bfloat16", None),
    ((1, 1, T, 1), "float16", (1, 1, 1, S)), (None, None, (1, N, T, S))])
@pytest.mark.parametrize("make", [valid_fwd, valid_bwd], ids=["fwd", "bwd"])
def test_bias_and_mask_calls_run(rng, make, bias_shape, dtype, mask_shape):
  """Valid bias and mask operands of every dtype and broadcast form run (their errors above are
  the spoiled field's), their results finite."""
  call = make()
  call = call if bias_shape is None else with_bias(call, bias_shape, dtype)
  call = call if mask_shape is None else with_mask(call, mask_shape)
  for out in call.run(rng):
    assert np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("spoil,fragments", [e[1:] for e in BWD_ERRORS], ids=[e[0] for e in BWD_ERRORS])
def test_bwd_errors(rng, spoil, fragments):
  expect_invalid_argument(spoil(valid_bwd()), rng, fragments)


@pytest.mark.parametrize("ids,alibi,blocks,dropout", [
    (False, False, False, False), (True, False, False, False), (True, True, False, False),
    (False, False, True, False), (True, False, True, True)])
@pytest.mark.parametrize("make", [valid_fwd, valid_bwd], ids=["fwd", "bwd"])
def test_valid_calls_run(rng, make, ids, alibi, blocks, dropout):
  """The calls the error tests spoil are valid as built (so each error is the spoiled field's),
  with segment ids, ALiBi slopes, a block mask and dropout too."""
  call = with_ids(make()) if ids else make()
  call = with_alibi(call) if alibi else call
  call = with_block_mask(call) if blocks else call
  call = with_dropout(call) if dropout else call
  for out in call.run(rng):
    assert np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("make", [valid_fwd, valid_bwd], ids=["fwd", "bwd"])
def test_block_mask_of_several_blocks_runs(rng, make):
  """T = 200, S = 300 with their (2, 3) block mask of 128 x 128 blocks: taken, finite."""
  call = with_block_mask(with_long_sequences(make()), shape=(B, N, 2, 3))
  for out in call.run(rng):
    assert np.isfinite(np.asarray(out, np.float32)).all()


def test_dq_splits_at_the_bound_runs(rng):
  valid_bwd(splits=64).run(rng)


@pytest.mark.parametrize("scale", [np.finfo(np.float32).tiny, 2.3e38])
@pytest.mark.parametrize("make", [valid_fwd, valid_bwd], ids=["fwd", "bwd"])
def test_scales_at_the_bounds_run(rng, make, scale):
  """The smallest normal float32 scale, and one just under FLT_MAX / log2(e), are taken."""
  with_attributes(make(), scale=float(scale)).run(rng)


@pytest.mark.parametrize("cap", [np.finfo(np.float32).tiny, 2.3e38, 1.0])
@pytest.mark.parametrize("make", [valid_fwd, valid_bwd], ids=["fwd", "bwd"])
def test_soft_caps_at_the_bounds_run(rng, make, cap):
  """logits_soft_cap at the smallest normal float32 and just under FLT_MAX / log2(e) is taken,
  with finite results."""
  for out in with_attributes(make(), logits_soft_cap=float(cap)).run(rng):
    assert np.isfinite(np.asarray(out, np.float32)).all()


# Windows at the edge: exactly T + S (the handler's clamp), past it, and up to INT64_MAX, where
# i + window + 1 would overflow int64 unclamped. Each masks nothing a window of T + S does not.
WIDE_WINDOWS = [T + S, T + S + 1, 1 << 40, INT64_MAX - 1, INT64_MAX]


def _direct_fwd(q, k, v, q_lens, kv_lens, scale, causal, left, right):
  *batch, t, n, _ = q.shape
  call = jax.ffi.ffi_call("jax_flash_cpu_fwd", (spec(q.shape, q.dtype), spec((*batch, n, t))))
  no_ids = jnp.zeros((0,), jnp.int32)
  no_slopes = jnp.zeros((0,), jnp.float32)
  no_blocks = jnp.zeros((0,), jnp.bool_)
  no_seeds = jnp.zeros((0,), jnp.uint32)
  return call(q, k, v, q_lens, kv_lens, no_ids, no_ids, no_slopes, no_blocks, no_seeds,
              no_slopes, no_blocks, scale=float(scale), is_causal=causal,
              window_left=np.int64(left), window_right=np.int64(right), segment_ids=False,
              logits_soft_cap=0.0, alibi=False, block_sparse=False, dropout_rate=0.0, bias=False,
              mask=False)


def _inputs(rng, dtype="float32"):
  q, k, v = (array(rng, s, dtype) for s in (Q, KV, KV))
  q_lens = jnp.array([T, 3], jnp.int32)
  kv_lens = jnp.array([S, 6], jnp.int32)
  return q, k, v, q_lens, kv_lens


def _close(a, b, atol=1e-5):
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("window", WIDE_WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_wide_windows_match_the_api(rng, window, causal):
  """A direct call with a window at or past the bound gives what jax_flash.dot_product_attention
  gives with that window (which clamps it to T + S itself) and without one."""
  q, k, v, q_lens, kv_lens = _inputs(rng)
  o, lse = jax.jit(_direct_fwd, static_argnums=(5, 6, 7, 8))(q, k, v, q_lens, kv_lens, 0.5, causal, window,
                                                             window)
  api = dict(scale=0.5, is_causal=causal, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
             implementation="cpu", return_residual=True)
  want, want_lse = jax_flash.dot_product_attention(q, k, v, local_window_size=(T + S, T + S), **api)
  unbounded, _ = jax_flash.dot_product_attention(q, k, v, **api)
  _close(o, want)
  _close(o, unbounded)
  _close(jnp.swapaxes(lse, -1, -2), want_lse)


@pytest.mark.parametrize("left,right", [(0, 0), (2, 1), (T + S, 0), (0, INT64_MAX), (INT64_MAX, 3)])
def test_windows_match_the_api(rng, left, right):
  q, k, v, q_lens, kv_lens = _inputs(rng)
  o, _ = jax.jit(_direct_fwd, static_argnums=(5, 6, 7, 8))(q, k, v, q_lens, kv_lens, 0.5, False, left, right)
  want = jax_flash.dot_product_attention(q, k, v, scale=0.5, query_seq_lengths=q_lens,
                                         key_value_seq_lengths=kv_lens, implementation="cpu",
                                         local_window_size=(min(left, T + S), min(right, T + S)))
  _close(o, want)


@pytest.mark.parametrize("window", [T + S, INT64_MAX])
def test_wide_window_backward_matches_unbounded(rng, window):
  """The backward with a window at or past the bound: the gradients of an unbounded call."""
  call = valid_bwd()
  q, k, v, q_lens, kv_lens = _inputs(rng)
  o, lse = _direct_fwd(q, k, v, q_lens, kv_lens, 0.5, False, -1, -1)
  d_o = array(rng, Q)
  outputs = tuple(spec(s, d) for s, d in call.outputs.values())
  bwd = jax.ffi.ffi_call("jax_flash_cpu_bwd", outputs)

  def grads(left, right):
    attrs = {**call.attributes, "window_left": np.int64(left), "window_right": np.int64(right)}
    no_ids = jnp.zeros((0,), jnp.int32)
    return jax.jit(lambda *a: bwd(*a, **attrs))(q, k, v, o, lse, d_o, q_lens, kv_lens, no_ids,
                                                no_ids, jnp.zeros((0,), jnp.float32),
                                                jnp.zeros((0,), jnp.bool_),
                                                jnp.zeros((0,), jnp.uint32),
                                                jnp.zeros((0,), jnp.float32),
                                                jnp.zeros((0,), jnp.bool_))[:3]

  for got, want in zip(grads(window, window), grads(-1, -1)):
    _close(got, want, atol=0)
