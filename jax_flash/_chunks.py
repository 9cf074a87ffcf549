"""Sequence layouts over the devices of a mesh axis, and moving between them.

"contiguous": device r holds rows [r L, (r+1) L). "zigzag": the sequence in 2P chunks, device r
holding chunks r and 2P-1-r (so that causal work is equal on every device; see
``jax_flash.zigzag_indices``).

Two kinds of move: a whole sequence gathered from the devices (all-gather, all-to-all) lies in
*layout order*, the devices' slices one after another, which ``from_layout_order`` turns into
the natural order by static chunk indexing (no communication); and ``contiguous_to_zigzag`` /
``zigzag_to_contiguous`` move slices between devices (two collective-permutes of half a slice
each), for a partitioned call whose caller holds the sequence contiguously but whose work is
balanced in the zig-zag layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def layout_chunks(num: int, layout: str) -> list[int]:
  """The chunk ids of a sequence gathered from `num` devices in `layout`, in the order they lie
  (contiguous: num chunks in order; zigzag: 2 num chunks, 0, 2num-1, 1, 2num-2, ...)."""
  if layout == "contiguous":
    return list(range(num))
  return [c for r in range(num) for c in (r, 2 * num - 1 - r)]


def _reorder_chunks(x, axis: int, order: list[int]):
  if order == sorted(order):
    return x
  chunks = jnp.split(x, len(order), axis=axis)
  return jnp.concatenate([chunks[i] for i in order], axis=axis)


def from_layout_order(x, axis: int, num: int, layout: str):
  """A sequence gathered in `layout` order (along `axis`) in its natural order."""
  lying = layout_chunks(num, layout)
  position = {chunk: i for i, chunk in enumerate(lying)}
  return _reorder_chunks(x, axis, [position[c] for c in range(len(lying))])


def to_layout_order(x, axis: int, num: int, layout: str):
  """The inverse of from_layout_order."""
  return _reorder_chunks(x, axis, layout_chunks(num, layout))


def _zigzag_owner(chunk: int, num: int) -> int:
  return chunk if chunk < num else 2 * num - 1 - chunk


def _select(rank, even, odd):
  return jax.tree.map(lambda a, b: jnp.where(rank % 2 == 0, a, b), even, odd)


def contiguous_to_zigzag(xs, axis_name, axes):
  """This device's contiguous slices `xs` (a tuple of arrays, the sequence along `axes[i]` of
  `xs[i]`, of even length) -> its zig-zag slices. Device d holds chunks 2d and 2d+1; the first
  goes to chunk 2d's zig-zag owner, the second to chunk 2d+1's (each a permutation of the
  devices: one collective-permute each); a receiving device r puts chunk r first."""
  num = jax.lax.axis_size(axis_name)
  rank = jax.lax.axis_index(axis_name)
  halves = [jnp.split(x, 2, axis=a) for x, a in zip(xs, axes)]
  first = tuple(h[0] for h in halves)
  second = tuple(h[1] for h in halves)
  got_first = jax.lax.ppermute(first, axis_name,
                               [(d, _zigzag_owner(2 * d, num)) for d in range(num)])
  got_second = jax.lax.ppermute(second, axis_name,
                                [(d, _zigzag_owner(2 * d + 1, num)) for d in range(num)])
  # An even rank r received chunk r (even) from the first move; an odd one from the second.
  lead = _select(rank, got_first, got_second)
  tail = _select(rank, got_second, got_first)
  return tuple(jnp.concatenate([a, b], axis=ax) for a, b, ax in zip(lead, tail, axes))


def zigzag_to_contiguous(xs, axis_name, axes):
  """The inverse of contiguous_to_zigzag."""
  num = jax.lax.axis_size(axis_name)
  rank = jax.lax.axis_index(axis_name)
  halves = [jnp.split(x, 2, axis=a) for x, a in zip(xs, axes)]
  own = tuple(h[0] for h in halves)     # chunk rank
  mirror = tuple(h[1] for h in halves)  # chunk 2num-1-rank
  # Even chunks go home by the inverse of the first move, odd ones by that of the second. An
  # even rank holds its even chunk first, an odd rank second.
  even_chunks = _select(rank, own, mirror)
  odd_chunks = _select(rank, mirror, own)
  got_even = jax.lax.ppermute(even_chunks, axis_name,
                              [(_zigzag_owner(2 * d, num), d) for d in range(num)])
  got_odd = jax.lax.ppermute(odd_chunks, axis_name,
                             [(_zigzag_owner(2 * d + 1, num), d) for d in range(num)])
  return tuple(jnp.concatenate([a, b], axis=ax) for a, b, ax in zip(got_even, got_odd, axes))
