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

Block masks (B, N, L/128, S/128: the block rows of each device's queries, every key block's
column; blocks of jax_flash.BLOCK_MASK_BLOCK) go by one more all-to-all, as the queries do: heads
split, block rows gathered, so the kernel gets the whole (T/128, S/128) mask of its head slice.
Each device's query slice (zig-zag chunk) must be whole 128-row blocks
(jax_flash._context_parallel checks it).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_flash import _ops
from jax_flash._chunks import from_layout_order, to_layout_order
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


def _gather_ids(ids, axis_name, layout: str, num: int):
  """(B, L/P) int32 slices -> (B, L), the whole sequence's ids in natural order, on every
  device: an all-gather done by all-to-all (the slice repeated once per device)."""
  x = jnp.broadcast_to(ids[..., None], (*ids.shape, num))
  x = jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)
  return from_layout_order(x[..., 0], 1, num, layout)


def _blocks_to_heads(block_mask, axis_name, layout: str, num: int):
  """(B, N, L/128, S/128) block rows -> (B, N/P, T/128, S/128), the rows in natural order (None
  without a block mask)."""
  if block_mask is None:
    return None
  x = jax.lax.all_to_all(block_mask, axis_name, split_axis=1, concat_axis=2, tiled=True)
  return from_layout_order(x, 2, num, layout)


def _whole_ids(segment_ids, axis_name, layout: str, num: int):
  if segment_ids is None:
    return None
  return tuple(_gather_ids(x, axis_name, layout, num) for x in segment_ids)


def _head_slice(alibi_slopes, axis_name, num: int):
  """The slopes (B, N) of the query heads _to_heads gives this device: N/P of them, chunk
  `axis_index` (None without slopes)."""
  if alibi_slopes is None:
    return None
  heads = alibi_slopes.shape[1] // num
  return jax.lax.dynamic_slice_in_dim(alibi_slopes, jax.lax.axis_index(axis_name) * heads,
                                      heads, axis=1)


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
                   axis_name, layout: str, alibi_slopes=None, block_mask=None):
  """(o, lse) over a sequence sharded along `axis_name`, with _ops.flash_fwd's arguments and
  results (this device's slices in `layout`, segment ids and block mask rows too; q_lens and
  kv_lens global).
  Inside shard_map or a partitioned lowering; the local query heads must split over the axis."""
  num = jax.lax.axis_size(axis_name)
  like = q
  k, v = _repeat_kv(k, v, kv_repeats(q.shape[2], k.shape[2], num))
  q, k, v = (_to_heads(x, axis_name, layout, num) for x in (q, k, v))
  o, lse = _ops.flash_fwd(q, k, v, q_lens, kv_lens, config,
                          _whole_ids(segment_ids, axis_name, layout, num),
                          _head_slice(alibi_slopes, axis_name, num),
                          _blocks_to_heads(block_mask, axis_name, layout, num))
  # Typed as varying where q was (inside shard_map, over the mesh's other axes too).
  return (_varying_like(_to_sequence(o, axis_name, layout, num), like),
          _varying_like(_lse_to_sequence(lse, axis_name, layout, num), like))


def all_to_all_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config: _ops.KernelConfig,
                   segment_ids=None, *, axis_name, layout: str, alibi_slopes=None,
                   block_mask=None):
  """(dq, dk, dv) of all_to_all_fwd, with _ops.flash_bwd's arguments and results."""
  num = jax.lax.axis_size(axis_name)
  repeats = kv_repeats(q.shape[2], k.shape[2], num)
  q_in, k_in, v_in = q, k, v
  k, v = _repeat_kv(k, v, repeats)
  q, k, v, o, d_o = (_to_heads(x, axis_name, layout, num) for x in (q, k, v, o, d_o))
  lse = _lse_to_heads(lse, axis_name, layout, num)
  dq, dk, dv = _ops.flash_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config,
                              _whole_ids(segment_ids, axis_name, layout, num), None,
                              _head_slice(alibi_slopes, axis_name, num),
                              _blocks_to_heads(block_mask, axis_name, layout, num))
  dq, dk, dv = (_to_sequence(x, axis_name, layout, num) for x in (dq, dk, dv))
  return (_varying_like(dq, q_in), _varying_like(_sum_kv_copies(dk, repeats), k_in),
          _varying_like(_sum_kv_copies(dv, repeats), v_in))
