"""Context parallelism by all-to-all over heads (DeepSpeed-Ulysses, Jacobs et al. 2023,
arXiv:2309.14509).

Each device holds a slice of the sequence of every head. One all-to-all turns that into the
whole sequence of a slice of the heads; the kernel then runs unchanged over the whole sequence
(every mask, window and length as on one device, and causal work equal on every device); a
second all-to-all turns the output back into sequence slices. The backward pass does the same
with q, k, v, o, dO and the log-sum-exp, and returns dQ, dK, dV by all-to-all.

Heads: the query heads must split over the axis. Key/value heads that do not (GQA with fewer kv
heads than devices) are repeated, each r times with r the smallest factor making them split;
their gradients are summed back over the copies.

Segment ids are per position, not per head: every device needs the ids of the whole sequence.
They are gathered by the same all-to-all (each device's slice of ids sent whole to every device:
the bytes of an all-gather, (P-1) L/P int32 per device and side, negligible beside q, k, v),
which keeps "all-to-all only" true of the compiled program.

ALiBi slopes ((B, N), per head) need no communication: each device takes the slopes of the head
slice it receives, and the kernel sees the whole sequence, so its positions are the global ones.
So do dropout's seeds ((B, N, SEED_WORDS): jax_flash._dropout.seeds, which hold the global head
index): the kernel draws every element's decision at its global position, as on one device.

Block masks (B, N, L/128, S/128: the block rows of each device's queries, every key block's
column; blocks of jax_flash.BLOCK_MASK_BLOCK) go by one more all-to-all, as the queries do: heads
split, block rows gathered, so the kernel gets the whole (T/128, S/128) mask of its head slice.
Each device's query slice (zig-zag chunk) must be whole 128-row blocks
(jax_flash._context_parallel checks it).

jax.nn's bias and mask arrays (jax_flash._logit_rows: the rows of each device's queries,
(B|1, N|1, L|1, S|1), every key's column) go as the queries do where they have the heads: one
more all-to-all each, heads split and rows gathered; without the heads their rows are gathered
whole (by all-to-all, as the ids), and without the query dim a head slice is taken or nothing
moves. The bias's gradient goes back the same way: by all-to-all; summed over the devices' head
slices into each device's rows (reduce-scatter) where the bias has no head dim; into this
device's heads of a zero (B, N, 1, S) where it has no query dim, for the caller's sum over the
sequence's devices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_flash import _ops
from jax_flash._chunks import from_layout_order, to_layout_order
from jax_flash._logit_rows import HEADS, ROWS, LogitRows, full
from jax_flash._ring import _varying_like


def kv_repeats(heads_q: int, heads_k: int, num: int) -> int:
  """How many copies of each kv head make them split over `num` devices with the query heads
  (1: none needed). heads_q % num == 0 is the caller's to check."""
  return num // math.gcd(heads_k, num)


def _to_heads(x, axis_name, layout: str, num: int):
  """(B, L/P, heads, H) sequence slices -> (B, L, heads/P, H), the sequence in natural order."""
  x = jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)
  return from_layout_order(x, 1, num, layout)


def _to_sequence(x, axis_name, layout: str, num: int):
  """The inverse of _to_heads."""
  x = to_layout_order(x, 1, num, layout)
  return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def _lse_to_heads(lse, axis_name, layout: str, num: int):
  """(B, N, T/P) -> (B, N/P, T)."""
  lse = jax.lax.all_to_all(lse, axis_name, split_axis=1, concat_axis=2, tiled=True)
  return from_layout_order(lse, 2, num, layout)


def _lse_to_sequence(lse, axis_name, layout: str, num: int):
  lse = to_layout_order(lse, 2, num, layout)
  return jax.lax.all_to_all(lse, axis_name, split_axis=2, concat_axis=1, tiled=True)


def _gather_rows(x, axis: int, axis_name, layout: str, num: int):
  """x with this device's slice of the sequence along `axis` -> the whole sequence's, in
  natural order, on every device: an all-gather done by all-to-all (the slice repeated once per
  device), so that the program holds only all-to-alls."""
  x = jnp.broadcast_to(x[..., None], (*x.shape, num))
  x = jax.lax.all_to_all(x, axis_name, split_axis=x.ndim - 1, concat_axis=axis, tiled=True)
  return from_layout_order(x[..., 0], axis, num, layout)


def _heads_for_rows(x, axis_name, layout: str, num: int):
  """(B, N, L, ...) rows of this device's queries -> (B, N/P, T, ...): this device's heads of
  every row, in natural order (one all-to-all)."""
  x = jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)
  return from_layout_order(x, 2, num, layout)


def _blocks_to_heads(block_mask, axis_name, layout: str, num: int):
  """(B, N, L/128, S/128) block rows -> (B, N/P, T/128, S/128), the rows in natural order (None
  without a block mask)."""
  return None if block_mask is None else _heads_for_rows(block_mask, axis_name, layout, num)


def _logit_to_heads(x, axis_name, layout: str, num: int):
  """A bias's or mask's rows (B|1, N|1, L|1, S|1) -> what the kernel over this device's head
  slice takes: (B|1, N/P|1, T|1, S|1), rows in natural order (None stays None)."""
  if x is None:
    return None
  heads, rows = full(x, HEADS), full(x, ROWS)
  if heads and rows:
    return _heads_for_rows(x, axis_name, layout, num)
  if rows:  # every device needs every row
    return _gather_rows(x, ROWS, axis_name, layout, num)
  if heads:
    return _head_slice(x, axis_name, num)
  return x


def _dbias_to_sequence(dbias, bias, axis_name, layout: str, num: int):
  """The inverse of _logit_to_heads for the gradient (float32) of `bias` (this device's rows):
  this device's rows, its share of a sum over the devices where the bias lacks the heads or the
  query dim."""
  heads, rows = full(bias, HEADS), full(bias, ROWS)
  if heads and rows:
    dbias = to_layout_order(dbias, 2, num, layout)
    return jax.lax.all_to_all(dbias, axis_name, split_axis=2, concat_axis=1, tiled=True)
  if rows:  # every device's heads' part of every row: summed, each device keeping its rows
    return jax.lax.psum_scatter(to_layout_order(dbias, 2, num, layout), axis_name,
                                scatter_dimension=2, tiled=True)
  if heads:  # this device's heads of the device's part (the caller sums it over the devices)
    whole = jnp.zeros((dbias.shape[0], dbias.shape[1] * num, *dbias.shape[2:]), dbias.dtype)
    return jax.lax.dynamic_update_slice_in_dim(
        whole, dbias, jax.lax.axis_index(axis_name) * dbias.shape[1], axis=1)
  return dbias


def _logits_to_heads(logits: LogitRows | None, axis_name, layout: str, num: int) -> dict:
  """The kernel call's `bias` and `mask` arguments (none without them)."""
  if logits is None:
    return {}
  return dict(bias=_logit_to_heads(logits.bias, axis_name, layout, num),
              mask=_logit_to_heads(logits.mask, axis_name, layout, num))


def _whole_ids(segment_ids, axis_name, layout: str, num: int):
  if segment_ids is None:
    return None
  return tuple(_gather_rows(x, 1, axis_name, layout, num) for x in segment_ids)  # (B, T)


def _head_slice(x, axis_name, num: int):
  """Of x (B, N, ...: the slopes, a bias or a mask), the query heads _to_heads gives this
  device: N/P of them, chunk `axis_index` (None stays None)."""
  if x is None:
    return None
  heads = x.shape[1] // num
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * heads, heads, axis=1)


def _repeat_kv(k, v, repeats: int):
  if repeats == 1:
    return k, v
  return jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)


def _sum_kv_copies(dk, repeats: int):
  if repeats == 1:
    return dk
  batch, seq, heads, head_dim = dk.shape
  summed = dk.astype(jnp.float32).reshape(batch, seq, heads // repeats, repeats, head_dim).sum(3)
  return summed.astype(dk.dtype)


def all_to_all_fwd(q, k, v, q_lens, kv_lens, config: _ops.KernelConfig, segment_ids=None, *,
                   axis_name, layout: str, alibi_slopes=None, block_mask=None,
                   logits: LogitRows | None = None, dropout_seeds=None):
  """(o, lse) over a sequence sharded along `axis_name`, with _ops.flash_fwd's arguments and
  results (this device's slices in `layout`, segment ids, block mask rows and bias and mask
  rows, `logits`, too; q_lens and kv_lens global; the dropout seeds (B, N, SEED_WORDS) of this
  device's heads).
  Inside shard_map or a partitioned lowering; the local query heads must split over the axis."""
  num = jax.lax.axis_size(axis_name)
  like = q
  k, v = _repeat_kv(k, v, kv_repeats(q.shape[2], k.shape[2], num))
  q, k, v = (_to_heads(x, axis_name, layout, num) for x in (q, k, v))
  o, lse = _ops.flash_fwd(q, k, v, q_lens, kv_lens, config,
                          _whole_ids(segment_ids, axis_name, layout, num),
                          _head_slice(alibi_slopes, axis_name, num),
                          _blocks_to_heads(block_mask, axis_name, layout, num),
                          _head_slice(dropout_seeds, axis_name, num),
                          **_logits_to_heads(logits, axis_name, layout, num))
  # Typed as varying where q was (inside shard_map, over the mesh's other axes too).
  return (_varying_like(_to_sequence(o, axis_name, layout, num), like),
          _varying_like(_lse_to_sequence(lse, axis_name, layout, num), like))


def all_to_all_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config: _ops.KernelConfig,
                   segment_ids=None, *, axis_name, layout: str, alibi_slopes=None,
                   block_mask=None, logits: LogitRows | None = None, dropout_seeds=None):
  """(dq, dk, dv) of all_to_all_fwd, with _ops.flash_bwd's arguments and results; where
  `logits` asks for the bias's gradient, (dq, dk, dv, dbias), dbias float32 over this device's
  bias rows (_dbias_to_sequence)."""
  num = jax.lax.axis_size(axis_name)
  repeats = kv_repeats(q.shape[2], k.shape[2], num)
  q_in, k_in, v_in = q, k, v
  k, v = _repeat_kv(k, v, repeats)
  q, k, v, o, d_o = (_to_heads(x, axis_name, layout, num) for x in (q, k, v, o, d_o))
  lse = _lse_to_heads(lse, axis_name, layout, num)
  wants_dbias = logits is not None and logits.dbias
  arrays = {}
  if logits is not None:  # (a 16-bit bias the kernel broadcasts goes in float32: LogitRows)
    arrays = LogitRows(**_logits_to_heads(logits, axis_name, layout, num),
                       dbias=wants_dbias).kernel_arrays(backward=True)
  grads = _ops.flash_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config,
                         _whole_ids(segment_ids, axis_name, layout, num), None,
                         _head_slice(alibi_slopes, axis_name, num),
                         _blocks_to_heads(block_mask, axis_name, layout, num),
                         _head_slice(dropout_seeds, axis_name, num), dbias=wants_dbias, **arrays)
  dq, dk, dv = (_to_sequence(x, axis_name, layout, num) for x in grads[:3])
  out = (_varying_like(dq, q_in), _varying_like(_sum_kv_copies(dk, repeats), k_in),
         _varying_like(_sum_kv_copies(dv, repeats), v_in))
  if not wants_dbias:
    return out
  dbias = _dbias_to_sequence(grads[3].astype(jnp.float32), logits.bias, axis_name, layout, num)
  return (*out, _varying_like(dbias, q_in))
