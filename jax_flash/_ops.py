"""The forward and backward custom calls, as JAX functions over the kernels' own layouts, and
what every entry point does around them (:func:`call_kernels`: a positive scale, the head dim
padded as the kernels need).

Kernel layouts: q, dq (..., T, N, H); k, dk (..., S, K, H); v, dv (..., S, K, Hv); o, do
(..., T, N, Hv) (Hv == H but on the "cpu" kernel, which takes v's own head dim Hv: MLA); lse
(..., N, T) float32;
q_lens, kv_lens (...,) int32; segment ids, where given, (..., T) and (..., S) int32, and ALiBi
slopes, where given, (..., N) float32, the block mask, where given, (..., N, Tb, Sb) bool, and
the dropout seeds, where given, (..., N, SEED_WORDS) uint32 (jax_flash._dropout.seeds; the
"cpu" kernel only), and jax.nn's bias and mask, where given, (..., N|1, T|1, S|1) as the caller
broadcast them (the "cpu" kernel only: LogitArray in cuda/common/attention_params.h). Leading
dimensions are batch; vmap adds more (``broadcast_all``), and the kernels fold them all into one
batch dimension.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import (_decode, _derivatives, _dispatch, _dropout, _logit_arrays, _registry, _rounding,
                       _split_kv)
from jax_flash._block_sparse import BLOCK_MASK_BLOCK, block_mask_shape
from jax_flash._reference import empty_lse

# At most this many float32 dQ partials: the workspace stays a small multiple of dQ however many
# cores the host has.
_MAX_DQ_SPLITS = 8


def positive_scale(q: jax.Array, scale: float) -> tuple[jax.Array, float]:
  """(q', scale') with scale' a positive normal float32 and the same logits scale' * q'.k as
  scale * q.k: the kernels take only those (the CUDA forward keeps row maxima of unscaled
  scores, and masks set scores to -inf, which a negative or zero scale would turn into +inf or
  NaN; a subnormal scale is flushed to 0 on XLA's threads, and the handlers refuse it). Applied
  outside the kernels' custom VJPs, so JAX differentiates the sign flip (or the zeroing)
  itself."""
  if abs(np.float32(scale)) < np.finfo(np.float32).tiny:
    # Every logit is 0, as it is (or rounds to) in jax.nn's float32 logits: uniform attention
    # over the visible keys. q * 0, not zeros, so that a NaN or inf in q stays NaN, as 0 * NaN
    # is in jax.nn.
    return q * 0, 1.0
  if scale < 0:
    return -q, -scale
  return q, scale


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static settings of one attention call (hashable: it is a custom_vjp nondiff argument)."""

  implementation: str  # "cpu" or "cuda"
  scale: float
  is_causal: bool
  window_left: int  # -1: unbounded
  window_right: int  # -1: unbounded
  deterministic: bool = False  # backward: bit-identical gradients run after run
  # forward: o in float32 for 16-bit inputs. A differentiated call keeps that o as the backward's
  # residual, so delta = rowsum(dO * O) is formed from O at full precision, not from O rounded
  # to 16 bits (that rounding cost dq/dk their accuracy on peaked softmaxes: issue 13).
  o_float32: bool = False
  # forward, "cuda" only: the differentiated call's o split for the backward by the kernel
  # itself: o rounded to the 16-bit dtype and its int8 rounding error (jax_flash._rounding), so
  # the forward returns (o, lse, o_error). Instead of o_float32, whose float32 o XLA would then
  # read back to split (4 bytes an element written, 4 read and 3 written again, not 3).
  o_split: bool = False
  # A sequence-sharded call under jax.jit: the strategy asked for (None: the automatic choice;
  # see jax_flash._context_parallel). Not a kernel attribute.
  context_parallel: str | None = None
  # forward: 0 runs the tiled kernel; n >= 1 split-KV decoding with n key chunks: the CPU decode
  # kernel (jax_flash._decode: chosen by call_kernels for T * (N / K) <= 64 query rows per kv
  # head), or on CUDA pack-GQA and key chunks around the tiled forward (jax_flash._split_kv:
  # calls without causal mask or window, T * (N / K) <= 128).
  kv_splits: int = 0
  # Logit soft-capping c (Gemma 2), 0.0 for off: the "cpu" passes take it as their attribute
  # "logits_soft_cap"; the CUDA kernels do not take it (jax_flash._dispatch refuses it there).
  logits_soft_cap: float = 0.0
  # Fused dropout's rate, 0.0 for off: the "cpu" passes take it as their attribute
  # "dropout_rate" (with the seeds operand); the CUDA kernels do not take it (jax_flash._dispatch
  # refuses it there).
  dropout_rate: float = 0.0

  def attributes(self) -> dict:
    return dict(
        scale=float(self.scale),
        is_causal=bool(self.is_causal),
        window_left=np.int64(self.window_left),
        window_right=np.int64(self.window_right),
    )


def _target(config: KernelConfig, pass_name: str) -> str:
  return f"jax_flash_{config.implementation}_{pass_name}"


def _output_shape(q: jax.Array, v: jax.Array) -> tuple[int, ...]:
  """o's shape: q's with v's head dim Hv."""
  return (*q.shape[:-1], v.shape[-1])


def _lse_shape(q: jax.Array) -> tuple[int, ...]:
  *batch, t, n, _ = q.shape
  return (*batch, n, t)


def _segment_operands(config: KernelConfig, segment_ids) -> tuple[tuple, dict]:
  """The segment-id operands and attribute of a kernel call: the "cpu" and "cuda" passes always
  take the two int32 id arrays and the switch `segment_ids` ((0,) placeholders without ids); the
  "cuda" ones then also take the ids' spans (segment_id_spans; (0,) placeholders without)."""
  if segment_ids is None:
    empty = jnp.zeros((0,), jnp.int32)
    ids = (empty, empty)
  else:
    ids = tuple(segment_ids)
  if config.implementation == "cuda" and segment_ids is None:
    ids += ids
  elif config.implementation == "cuda":
    rows = _registry.CUDA_KERNEL_CONSTANTS["segment_id_span_rows"]
    ids += tuple(segment_id_spans(x, rows) for x in ids)
  return ids, {"segment_ids": segment_ids is not None}


def segment_id_spans(ids: jax.Array, rows: int) -> jax.Array:
  """(..., ceil(L / rows), 2) int32: the (lowest, highest) id of every run of `rows` ids of
  `ids` (..., L) from 0 (the last run padded with its own last id). The CUDA kernels take them
  with rows = their segment_id_span_rows, and narrow each tile's walk to the blocks whose spans
  can meet its own (cuda/gpu/segment_ids.cuh)."""
  length = ids.shape[-1]
  padded = jnp.pad(ids, [(0, 0)] * (ids.ndim - 1) + [(0, -length % rows)], mode="edge")
  runs = padded.reshape(*ids.shape[:-1], -1, rows)
  return jnp.stack([runs.min(-1), runs.max(-1)], axis=-1).astype(jnp.int32)


def _soft_cap_attribute(config: KernelConfig) -> dict:
  """The soft-cap attribute of a kernel call: the "cpu" and "cuda" passes always take
  "logits_soft_cap" (0.0: off)."""
  return {"logits_soft_cap": float(config.logits_soft_cap)}


def _alibi_operands(config: KernelConfig, alibi_slopes) -> tuple[tuple, dict]:
  """The ALiBi operand and attribute of a kernel call: the "cpu" and "cuda" passes always take
  the float32 slopes (..., N) (a (0,) placeholder without) and the switch `alibi`."""
  if alibi_slopes is None:
    return (jnp.zeros((0,), jnp.float32),), {"alibi": False}
  return (alibi_slopes,), {"alibi": True}


def _block_mask_operands(config: KernelConfig, block_mask, heads_k: int,
                         backward: bool = False) -> tuple[tuple, dict]:
  """The block-mask operands and attribute of a kernel call, with the switch `block_sparse`:
  the "cpu" passes take the bool block mask (..., N, Tb, Sb) itself ((0,) placeholder without);
  the "cuda" ones the lists block_sparse_lists forms from it, the forward two and the backward
  four ((0,) int32 placeholders without)."""
  sparse = {"block_sparse": block_mask is not None}
  if config.implementation == "cpu":
    return ((jnp.zeros((0,), jnp.bool_) if block_mask is None else block_mask),), sparse
  if block_mask is None:
    return (jnp.zeros((0,), jnp.int32),) * (4 if backward else 2), sparse
  lists = block_sparse_lists(block_mask, heads_k)
  return (lists if backward else lists[:2]), sparse


def block_sparse_lists(block_mask: jax.Array, heads_k: int) -> tuple[jax.Array, ...]:
  """What the CUDA kernels read of a bool block mask (..., N, Tb, Sb) (cuda/gpu/block_sparse.cuh),
  all int32: per (..., query head, query block) the live key blocks in ascending order, then
  the rest ((..., N, Tb, Sb)), and their count ((..., N, Tb)); per (..., kv head, key block) the
  live (query head in the group, query block) pairs as head * Tb + block, ascending
  ((..., K, Sb, N / K * Tb)), and their count ((..., K, Sb))."""
  *batch, heads_q, q_blocks, k_blocks = block_mask.shape
  group = heads_q // heads_k
  by_query = block_mask.astype(jnp.bool_)
  by_key = by_query.reshape(*batch, heads_k, group, q_blocks, k_blocks)
  by_key = jnp.moveaxis(by_key, -1, -3).reshape(*batch, heads_k, k_blocks, group * q_blocks)

  def live_first(mask):  # indices of the set entries first, each part ascending
    return jnp.argsort(~mask, axis=-1, stable=True).astype(jnp.int32)

  def count(mask):
    return mask.sum(axis=-1, dtype=jnp.int32)

  return live_first(by_query), count(by_query), live_first(by_key), count(by_key)


def _dropout_operands(config: KernelConfig, dropout_seeds) -> tuple[tuple, dict]:
  """The dropout operand and attribute of a kernel call: the "cpu" and "cuda" passes always take
  the uint32 seeds (..., N, SEED_WORDS) (a (0,) placeholder without) and the rate "dropout_rate"
  (0.0: off). The seeds come exactly with a rate > 0 (on "cuda" only where
  jax_flash._dropout.cuda_kernels_take_dropout; jax_flash._dispatch refuses it otherwise)."""
  if (dropout_seeds is None) != (not config.dropout_rate):
    raise ValueError(f"dropout_rate={config.dropout_rate!r} and dropout seeds go together "
                     f"(got seeds: {dropout_seeds is not None})")
  if config.implementation == "cuda" and dropout_seeds is not None and not _dropout.cuda_kernels_take_dropout():
    raise NotImplementedError(f"the 'cuda' kernels take dropout_rate only under "
                              f"{_dropout.CUDA_DROPOUT_VARIABLE}=on (experimental)")
  if dropout_seeds is None:
    return (jnp.zeros((0,), jnp.uint32),), {"dropout_rate": 0.0}
  return (dropout_seeds,), {"dropout_rate": float(config.dropout_rate)}


# The dtypes the "cpu" kernel reads a bias in (others are cast to float32 by call_kernels).
BIAS_DTYPES = frozenset(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def row_bias_gradient(dbias: jax.Array) -> jax.Array:
  """The gradient of a bias with no key dim from the kernel's: exactly 0 but for its NaNs and
  infs. Such a bias adds one constant to all of a row's scores, which the softmax cancels; the
  kernel's sum of dS over the row's keys leaves only rounding there (with 16-bit inputs that of
  the forward's 16-bit P, ~2^-9 of the gradients). (With sinks the row has one more term, which
  the bias does not shift: the sinks' backward keeps the sum.)"""
  return jnp.where(jnp.isfinite(dbias), jnp.zeros_like(dbias), dbias)


def _logit_operands(config: KernelConfig, bias, mask, seq_q: int, seq_k: int,
                    backward: bool = False) -> tuple[tuple, dict]:
  """The bias and mask operands and attributes of a kernel call: both passes of both kernels
  always take the bias (..., N|1, T|1, S|1) as it is (a float32 (0,) placeholder without) with
  the switch `bias`, and the mask with `mask`: the "cpu" kernel's as the bool array it is, the
  "cuda" kernels' as bits in their fragments' order (jax_flash._logit_arrays.cuda_mask_bits,
  keys in rows for the `backward`'s), placeholders (0,) of those dtypes without. The "cuda"
  kernels take the arrays only under JAX_FLASH_CUDA_LOGIT_ARRAYS=on (experimental:
  jax_flash._logit_arrays; jax_flash._dispatch refuses them otherwise)."""
  cuda = config.implementation == "cuda"
  if cuda and (bias is not None or mask is not None) and not _logit_arrays.cuda_kernels_take_logit_arrays():
    raise NotImplementedError(f"the 'cuda' kernels take bias and mask arrays only under "
                              f"{_logit_arrays.CUDA_LOGIT_ARRAYS_VARIABLE}=on (experimental)")
  if mask is None:
    mask_operand = jnp.zeros((0,), jnp.uint32 if cuda else jnp.bool_)
  elif cuda:
    mask_operand = _logit_arrays.cuda_mask_bits(mask, seq_q, seq_k, transposed=backward)
  else:
    mask_operand = mask
  operands = (jnp.zeros((0,), jnp.float32) if bias is None else bias, mask_operand)
  return operands, {"bias": bias is not None, "mask": mask is not None}


def _flash_fwd(q, k, v, q_lens, kv_lens, config: KernelConfig, segment_ids=None,
               alibi_slopes=None, block_mask=None, dropout_seeds=None, bias=None, mask=None):
  """Returns (o, lse) with o like q but for its head dim, v's Hv (float32 with
  config.o_float32), and lse (..., N, T) float32; with config.o_split (o, lse, o_error), o_error
  o's int8 rounding error (jax_flash._rounding). `segment_ids`: None or (q_ids (..., T),
  kv_ids (..., S)) int32; `alibi_slopes`: None or (..., N) float32 (one slope per batch element
  and query head); `dropout_seeds`: None or (..., N, SEED_WORDS) uint32, exactly when
  config.dropout_rate > 0; `bias` and `mask`: None or (..., N|1, T|1, S|1), float and bool
  (the "cuda" kernels' only under JAX_FLASH_CUDA_LOGIT_ARRAYS=on, the mask as its bits:
  _logit_operands)."""
  if config.kv_splits:
    for name, given in (("bias or mask", bias is not None or mask is not None),
                        ("segment ids", segment_ids is not None),
                        ("alibi_slopes", alibi_slopes is not None),
                        ("block_mask", block_mask is not None),
                        ("logits_soft_cap", bool(config.logits_soft_cap)),
                        ("dropout", bool(config.dropout_rate) or dropout_seeds is not None)):
      if given:
        raise ValueError(f"split-KV decoding takes no {name} (call_kernels sets kv_splits=0)")
  if config.kv_splits and config.implementation == "cuda" and not _decode.cuda_kernel_enabled():
    tiled = dataclasses.replace(config, kv_splits=0, o_float32=True)
    return _split_kv.split_kv_forward(
        lambda q, k, v, q_lens, kv_lens: _flash_fwd(q, k, v, q_lens, kv_lens, tiled), q, k, v,
        q_lens, kv_lens, config.kv_splits)
  if config.kv_splits:
    return _decode.decode_fwd(q, k, v, q_lens, kv_lens, scale=config.scale,
                              is_causal=config.is_causal, window_left=config.window_left,
                              window_right=config.window_right, splits=config.kv_splits,
                              o_float32=config.o_float32, implementation=config.implementation)
  if config.o_split and (config.implementation != "cuda" or config.o_float32):
    raise ValueError(f"o_split is for the 'cuda' kernels' 16-bit o; got {config}")
  results = (
      jax.ShapeDtypeStruct(_output_shape(q, v), jnp.float32 if config.o_float32 else q.dtype),
      jax.ShapeDtypeStruct(_lse_shape(q), jnp.float32),
  )
  if config.implementation == "cuda":  # o_error, or no elements for none; the scheduler workspace
    results += (jax.ShapeDtypeStruct(_output_shape(q, v) if config.o_split else (0,), jnp.int8),
                jax.ShapeDtypeStruct((_registry.CUDA_KERNEL_CONSTANTS["fwd_scheduler_elements"],), jnp.int32))
  call = jax.ffi.ffi_call(_target(config, "fwd"), results, vmap_method="broadcast_all")
  ids, id_attributes = _segment_operands(config, segment_ids)
  alibi, alibi_attributes = _alibi_operands(config, alibi_slopes)
  blocks, block_attributes = _block_mask_operands(config, block_mask, k.shape[-2])
  drop, drop_attributes = _dropout_operands(config, dropout_seeds)
  logits, logit_attributes = _logit_operands(config, bias, mask, q.shape[-3], k.shape[-3])
  outputs = call(q, k, v, q_lens, kv_lens, *ids, *alibi, *blocks, *drop, *logits,
                 **config.attributes(), **id_attributes, **_soft_cap_attribute(config),
                 **alibi_attributes, **block_attributes, **drop_attributes, **logit_attributes)
  return outputs[:3] if config.o_split else outputs[:2]


# The kernel ops have one derivative, their custom VJP's: differentiating them raises.
flash_fwd = _derivatives.first_order_only(_flash_fwd, nondiff_argnums=(5,))


def for_backward(config: KernelConfig, split: bool = False) -> KernelConfig:
  """`config` for the forward of a differentiated call: its output o in float32 (a no-op for
  float32 inputs), so that the backward forms delta = rowsum(dO * O) from O at full precision
  and not from O rounded to 16 bits (issue 13: that rounding cost dq/dk their accuracy on peaked
  softmaxes). The CPU backward takes that o as it is; on CUDA dot_product_attention keeps the
  16-bit o and its int8 rounding error instead (jax_flash._rounding: 3 bytes an element, not 4).
  A differentiated call of decode shape runs the tiled CUDA forward, not the decode kernel:
  the tiled one also normalises o by the sum of the rounded P its P V used (which the decode
  kernel's chunk merge does not keep), and without it the CUDA differential run kept 11 dq/dk
  misses on such calls (examples/results/h200/session11/).

  With `split` (for a caller that keeps o in 16 bits with its rounding error), a CUDA call's
  kernel forms them itself (o_split), the CPU's still returns float32 o."""
  if config.implementation == "cuda":
    if split:
      return dataclasses.replace(config, kv_splits=0, o_split=True)
    return dataclasses.replace(config, kv_splits=0, o_float32=True)
  return dataclasses.replace(config, o_float32=True)


def dq_splits(batch: int, heads_k: int, seq_k: int) -> int:
  """How many float32 dQ partials the CPU backward keeps so every core has key blocks to work
  on: one when batch x kv heads already covers the cores twice, never more than
  _MAX_DQ_SPLITS."""
  units = batch * heads_k
  cores = os.cpu_count() or 1
  if units == 0 or units >= 2 * cores:  # nothing to split (an empty batch), or no need
    return 1
  block_k = _registry.KERNEL_CONSTANTS["cpu_block_k"]
  wanted = min(math.ceil(seq_k / block_k), math.ceil(2 * cores / units), _MAX_DQ_SPLITS)
  return max(1, wanted)


def delta_rows(o, d_o, o_error=None) -> jax.Array:
  """delta = rowsum(dO * O), (..., N, T) float32, from o (float32, or 16-bit joined with its int8
  rounding error `o_error`: jax_flash._rounding) and the output cotangent d_o (..., T, N, Hv).
  Products and sums in float32 element-wise (not a dot, which XLA may run in TF32 on a GPU)."""
  o32 = o.astype(jnp.float32) if o_error is None else _rounding.join_rounding(o, o_error)
  return jnp.swapaxes(jnp.sum(o32 * d_o.astype(jnp.float32), axis=-1), -1, -2)


def _flash_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config: KernelConfig, segment_ids=None,
               o_error=None, alibi_slopes=None, block_mask=None, dropout_seeds=None, bias=None,
               mask=None, dbias=True, delta=None):
  """Returns (dq, dk, dv), and with a `bias` and `dbias` (dq, dk, dv, dbias), dbias in the
  bias's shape and dtype (dS summed over its broadcast dims; without `dbias` the kernel
  neither forms nor returns it: a bias nothing differentiates); the kernel's workspaces come
  back as extra outputs and are dropped:
  on the CPU delta (..., N, T) float32, and the float32 dQ accumulator, flat, of the size the
  native module gives (on the CPU one partial per dQ split; on CUDA one like q, none in
  deterministic mode). `o_error`: None, or the int8 rounding error of a 16-bit o
  (jax_flash._rounding.split_rounding): the CPU kernel gets o joined back into float32; on CUDA
  XLA forms delta from both here (delta_rows) and the kernels take delta instead of o, so that o
  and its error are dead before the call's dQ accumulator is live (the fwd+bwd's peak memory).
  `alibi_slopes`: those of the forward (the kernel recomputes the same biased scores; the slopes
  get no gradient). `dropout_seeds`: those of the forward (the kernel regenerates the same
  mask). `delta`: the CUDA kernels' rowsum(dO * O) where the caller formed it (o then unused).
  On CUDA a value head dim Hv < H runs a kernel of the pair where one runs the call
  (_registry.cuda_backward_takes_value_head_dim), else the kernels of H, v and dO zero-padded."""
  head_dim_v = v.shape[-1]
  if (config.implementation == "cuda" and head_dim_v != q.shape[-1]
      and not _registry.cuda_backward_takes_value_head_dim(q.shape[-1], head_dim_v,
                                                           bool(config.deterministic))):
    # Where no backward kernel of the pair runs the call, the kernels of H take v and dO
    # zero-padded to H (their zero columns leave every score, dP and delta as they are: delta
    # is formed below from o and dO as they came) and give dv's first Hv columns.
    if head_dim_v > q.shape[-1]:
      raise NotImplementedError(f"the CUDA backward takes Hv > H only padded: q{tuple(q.shape)}, "
                                f"v{tuple(v.shape)} (call_kernels pads q and k)")
    delta = delta_rows(o, d_o, o_error)
    widths = [(0, 0)] * (v.ndim - 1) + [(0, q.shape[-1] - head_dim_v)]
    dq, dk, dv, *rest = _flash_bwd(q, k, jnp.pad(v, widths), None, lse, jnp.pad(d_o, widths), q_lens,
                                   kv_lens, config, segment_ids, None, alibi_slopes, block_mask,
                                   dropout_seeds, bias, mask, dbias, delta=delta)
    return (dq, dk, dv[..., :head_dim_v], *rest)
  if o_error is not None and config.implementation != "cuda":
    o, o_error = _rounding.join_rounding(o, o_error), None
  *batch, seq_q, heads_q, head_dim = q.shape
  seq_k, heads_k = k.shape[-3], k.shape[-2]
  batch_size = math.prod(batch)
  attributes = config.attributes()
  attributes["deterministic"] = bool(config.deterministic)
  results = (
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct(k.shape, k.dtype),
      jax.ShapeDtypeStruct(v.shape, v.dtype),
  )
  if config.implementation == "cpu":
    if bias is None or not dbias:
      splits = dq_splits(batch_size, heads_k, seq_k)
    else:  # the backward's tasks: the bias's batch slices x its kv heads (flash_bwd.h)
      splits = dq_splits(math.prod(bias.shape[:-3]), heads_k if bias.shape[-3] > 1 else 1, seq_k)
    elements = _registry.cpu_dq_accum_elements(splits, batch_size, seq_q, heads_q, head_dim)
    attributes["dq_splits"] = np.int64(splits)
    results += (jax.ShapeDtypeStruct(_lse_shape(q), jnp.float32),)  # delta
    rows = (o, lse)
  else:
    elements = _registry.cuda_dq_accum_elements(batch_size, seq_q, seq_k, heads_q, heads_k,
                                                head_dim, bool(config.deterministic), v.shape[-1])
    rows = (lse, delta_rows(o, d_o, o_error) if delta is None else delta)
  results += (jax.ShapeDtypeStruct((elements,), jnp.float32),)  # dQ accumulator
  if config.implementation == "cpu":  # dbias and its float32 partials (none: dbias itself)
    # (none either where each dbias element takes one dS: then it is stored directly)
    if bias is None or not dbias:
      results += (jax.ShapeDtypeStruct((0,), jnp.float32),) * 2
    else:
      one_each = _registry.cpu_dbias_one_each(bias.shape, batch_size, heads_q, seq_q, seq_k)
      partials = _registry.cpu_dbias_accum_elements(bias.size, bias.shape[-1] == 1,
                                                    bias.dtype == jnp.float32, splits, one_each)
      results += (jax.ShapeDtypeStruct(bias.shape, bias.dtype),
                  jax.ShapeDtypeStruct((partials,), jnp.float32))
  else:  # dbias in float32 (the kernel's atomics add into it), cast below
    dbias_shape = (0,) if bias is None or not dbias else bias.shape
    results += (jax.ShapeDtypeStruct(dbias_shape, jnp.float32),)
  call = jax.ffi.ffi_call(_target(config, "bwd"), results, vmap_method="broadcast_all")
  ids, id_attributes = _segment_operands(config, segment_ids)
  alibi, alibi_attributes = _alibi_operands(config, alibi_slopes)
  blocks, block_attributes = _block_mask_operands(config, block_mask, heads_k, backward=True)
  drop, drop_attributes = _dropout_operands(config, dropout_seeds)
  logits, logit_attributes = _logit_operands(config, bias, mask, q.shape[-3], k.shape[-3],
                                             backward=True)
  outputs = call(q, k, v, *rows, d_o, q_lens, kv_lens, *ids, *alibi, *blocks, *drop, *logits,
                 **attributes, **id_attributes, **_soft_cap_attribute(config),
                 **alibi_attributes, **block_attributes, **drop_attributes, **logit_attributes)
  dq, dk, dv = outputs[:3]
  if bias is None or not dbias:
    return dq, dk, dv
  if config.implementation == "cuda":
    return dq, dk, dv, outputs[4].astype(bias.dtype)
  return dq, dk, dv, outputs[5]


flash_bwd = _derivatives.first_order_only(_flash_bwd, nondiff_argnums=(8, 16))


def cuda_kv_splits(batch: int, seq_q: int, heads_q: int, heads_k: int, seq_k: int,
                   is_causal: bool, window_left: int, window_right: int) -> int:
  """KernelConfig.kv_splits on CUDA: 0 for the tiled forward, else the key chunks of the
  split-KV program (jax_flash._split_kv), sized to fill the GPU's SMs twice. Called only when
  the decode kernel is off; experimental, not timed: only with JAX_FLASH_CUDA_DECODE=split
  (jax_flash._decode.cuda_decode_mode, read once at import)."""
  if _decode.cuda_decode_mode() != "split":
    return 0
  if not _split_kv.applies(seq_q, heads_q, heads_k, is_causal, window_left, window_right):
    return 0
  return _split_kv.num_splits(batch, heads_k, seq_k, _gpu_processors())


def _gpu_processors() -> int:
  """Streaming multiprocessors of the first GPU (132, an H100/H200's, if JAX does not say)."""
  try:
    return int(getattr(jax.devices("gpu")[0], "core_count", 132) or 132)
  except RuntimeError:
    return 132


def _forward_takes_value_head_dim(implementation: str, head_dim: int, head_dim_v: int,
                                  kv_splits: int) -> bool:
  """Whether a call of these padded head dims H != Hv gives v to the kernels as it is: the
  "cuda" tiled forward (not the decode kernel: `kv_splits` 0) where a kernel of the pair runs it
  (_registry.cuda_forward_takes_value_head_dim); its backward pads v and dO (_flash_bwd)."""
  if implementation != "cuda" or head_dim == head_dim_v or kv_splits:
    return False
  return _registry.cuda_forward_takes_value_head_dim(head_dim, head_dim_v)


def head_dim_padding(implementation: str, head_dim: int) -> int:
  """How many zero columns the `implementation` kernels need appended to the head dim (the CUDA
  kernels read rows in 16-byte chunks: a multiple of 8 16-bit values)."""
  multiple = _dispatch.capabilities(implementation).head_dim_multiple
  return -head_dim % multiple


# What call_kernels runs: (q, k, v, q_lens, kv_lens, config) -> (o, lse), differentiable in q,
# k and v (one device's custom VJP, or the ring's).
KernelAttention = Callable[..., tuple[jax.Array, jax.Array]]


def call_kernels(attention: KernelAttention, q: jax.Array, k: jax.Array, v: jax.Array,
                 q_lens: jax.Array, kv_lens: jax.Array, *, implementation: str, scale: float,
                 is_causal: bool, window_left: int = -1, window_right: int = -1,
                 deterministic: bool = False, context_parallel: str | None = None,
                 caller: str = "jax_flash.dot_product_attention",
                 segment_ids: tuple[jax.Array, jax.Array] | None = None,
                 logits_soft_cap: float | None = None,
                 sinks: jax.Array | None = None,
                 alibi_slopes: jax.Array | None = None,
                 block_mask: jax.Array | None = None,
                 dropout_rate: float | None = None,
                 dropout_seeds: jax.Array | None = None,
                 bias: jax.Array | None = None,
                 mask: jax.Array | None = None,
                 mask_keys: int | None = None,
                 ) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of `attention` with what every entry point does around the kernels: the scale
  made positive (positive_scale) and the head dim zero-padded as `implementation` needs
  (head_dim_padding), both outside the custom VJP so JAX differentiates them; the padding is
  sliced off the output again. q, k are rank 4 (B, T|S, N|K, H), v (B, S, K, Hv); Hv != H
  reaches the "cpu" kernels as it is, and the "cuda" forward where a kernel of the pair runs it
  (_forward_takes_value_head_dim: on Hopper unless JAX_FLASH_CUDA_VALUE_HEAD_DIM=padded),
  else the "cuda" ones with q and k, or v, zero-padded to the larger head dim
  (Capabilities.value_head_dim_by_padding); out is (B, T, N, Hv).

  On the "cpu" kernel a call with few query rows per kv head runs the split-KV decode kernel
  (jax_flash._decode.kv_splits decides; KernelConfig.kv_splits records it), except with
  `segment_ids` ((B, T), (B, S) int32), which only the tiled kernel takes: `attention` is then
  called with them as a seventh argument. So does a call with `logits_soft_cap` (the decode
  kernel has no cap; KernelConfig.logits_soft_cap carries it to the tiled kernel's passes).
  With `sinks` (N,) `attention` is called with the ids (or None) and the sinks as seventh and
  eighth arguments: the kernels themselves never see them (see
  jax_flash._attention._join_sinks), so every kernel form (tiled, decode) runs such calls.
  With `alibi_slopes` (N,) float32 `attention` gets them last, after the ids (or None) and the
  sinks where given, broadcast to (B, N) (the kernels take one slope per batch element and
  head, which vmap and batch sharding fold like any operand); only the tiled kernel takes them,
  so such calls never run the decode kernel. With `block_mask` (B|1, N|1, Tb, Sb) bool
  `attention` gets it broadcast to (B, N, Tb, Sb) after the slopes (None where not given); the
  tiled kernel only, as the slopes. With `dropout_rate` (> 0; KernelConfig.dropout_rate
  carries it) and `dropout_seeds` (B, N, SEED_WORDS) uint32 (jax_flash._dropout.seeds)
  `attention` gets the seeds as its keyword argument `dropout_seeds`; the tiled kernel only.
  With jax.nn's `bias` and `mask` ((B|1, N|1, T|1, S|1), float and bool: never broadcast
  further) `attention` gets them as its keyword arguments `bias` and `mask`; the tiled kernel
  only. A bias of a dtype the kernel does not read (BIAS_DTYPES) is cast to float32 here,
  outside the custom VJP. On "cuda" the blocks a mask hides whole join the block mask (the
  kernels skip them), with as many key blocks as `mask_keys` keys make: k's S by default; inside
  shard_map the sequence's, whose keys the mask's and the block mask's columns cover there.

  With nothing to compute (B, T or N is 0) or no key for any row (S is 0) no kernel runs: the
  output is zeros (every row empty, lse EMPTY_ROW_LSE), as jax.nn's is, and so are the
  gradients."""
  if q.size == 0 or k.shape[1] == 0:
    batch, seq_q, heads_q, _ = q.shape
    return jnp.zeros(_output_shape(q, v), q.dtype), empty_lse(batch, heads_q, seq_q, sinks)
  head_dim_v = v.shape[-1]
  q, scale = positive_scale(q, scale)
  batch, seq_q, heads_q, _ = q.shape
  if implementation == "cuda" and not _decode.cuda_kernel_enabled():
    splits = cuda_kv_splits(batch, seq_q, heads_q, k.shape[2], k.shape[1], bool(is_causal),
                            window_left, window_right)
  else:
    splits = _decode.kv_splits(implementation, batch, seq_q, heads_q, k.shape[2], k.shape[1])
  if (segment_ids is not None or logits_soft_cap is not None or alibi_slopes is not None
      or block_mask is not None or dropout_rate is not None or bias is not None
      or mask is not None):
    splits = 0
  # Zero columns change no score (q, k) and give zero output columns (v).
  pad, pad_v = (head_dim_padding(implementation, x.shape[-1]) for x in (q, v))
  if (_dispatch.capabilities(implementation).value_head_dim_by_padding
      and not _forward_takes_value_head_dim(implementation, q.shape[-1] + pad,
                                            head_dim_v + pad_v, splits)):
    # Kernels of one head dim take Hv != H at the larger of the two (MLA's 192 / 128: v padded).
    common = max(q.shape[-1] + pad, head_dim_v + pad_v)
    pad, pad_v = common - q.shape[-1], common - head_dim_v
  if pad:
    widths = [(0, 0)] * 3 + [(0, pad)]
    q, k = (jnp.pad(x, widths) for x in (q, k))
  if pad_v:
    v = jnp.pad(v, [(0, 0)] * 3 + [(0, pad_v)])
  config = KernelConfig(implementation, scale, bool(is_causal), window_left, window_right,
                        deterministic, context_parallel=context_parallel, kv_splits=splits,
                        logits_soft_cap=0.0 if logits_soft_cap is None else float(logits_soft_cap),
                        dropout_rate=0.0 if dropout_rate is None else float(dropout_rate))
  if implementation == "cuda" and mask is not None and mask.shape[0] in (1, batch):
    # The blocks the mask hides whole are skipped like a block mask's (the CUDA kernels' walk;
    # the CPU kernel finds them itself, tile by tile).
    hidden = _logit_arrays.block_mask_of(mask, *BLOCK_MASK_BLOCK)
    columns = k.shape[1] if mask_keys is None else mask_keys
    hidden = jnp.broadcast_to(hidden, (*hidden.shape[:-2], *block_mask_shape(seq_q, columns)))
    block_mask = hidden if block_mask is None else jnp.logical_and(block_mask, hidden)
  with _derivatives.explain_forward_mode(caller, implementation):
    extra = () if segment_ids is None else (tuple(segment_ids),)
    if sinks is not None or alibi_slopes is not None or block_mask is not None:
      extra = (None if segment_ids is None else tuple(segment_ids),)
    if sinks is not None:
      extra += (sinks,)
    if alibi_slopes is not None:
      extra += (jnp.broadcast_to(alibi_slopes.astype(jnp.float32), (batch, heads_q)),)
    elif block_mask is not None:
      extra += (None,)
    if block_mask is not None:
      extra += (jnp.broadcast_to(block_mask, (batch, heads_q, *block_mask.shape[-2:])),)
    dropout = {} if dropout_rate is None else {"dropout_seeds": dropout_seeds}
    if bias is not None and bias.dtype not in BIAS_DTYPES:
      bias = bias.astype(jnp.float32)
    if implementation == "cuda" and bias is not None:
      bias = _logit_arrays.cuda_bias(bias, q.dtype)
    logits = {name: x for name, x in (("bias", bias), ("mask", mask)) if x is not None}
    out, lse = attention(q, k, v, q_lens, kv_lens, config, *extra, **dropout, **logits)
  return out[..., :head_dim_v], lse
