"""jax.nn's bias and mask arrays under context parallelism.

Each device holds the rows of its own queries, ``(B|1, N|1, L|1, S|1)`` (L its query slice, in
the strategy's layout; a dim of 1 is broadcast), with every key's column in the sequence's
order; nothing travels. A strategy cuts each kernel call's rows (a query chunk) and columns
(the keys the call sees) from them, and adds the bias's gradient of each call into the same
rows and columns of a float32 accumulator of the device's rows: a full dim's parts each land in
their own place, a broadcast dim's are summed. The caller casts the sum to the bias's dtype
(after summing it over the devices too, where the bias is broadcast along the sequence).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

HEADS, ROWS, COLUMNS = 1, 2, 3  # the head, query and key dims of a (B|1, N|1, T|1, S|1) array


def full(x, axis: int) -> bool:
  """Whether x has its own entries along `axis` (not broadcast: a dim of 1)."""
  return x.shape[axis] != 1


def _rows(x, parts: int) -> list:
  """x's rows split into `parts` query chunks (x as it is, `parts` times, where broadcast)."""
  if x is None or parts == 1 or not full(x, ROWS):
    return [x] * parts
  return jnp.split(x, parts, axis=ROWS)


def _columns(x, start, size: int):
  """x's columns [start, start + size) (`start` static or traced); x where broadcast."""
  if x is None or not full(x, COLUMNS):
    return x
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=COLUMNS)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("bias", "mask"),
                   meta_fields=("dbias",))
@dataclasses.dataclass(frozen=True)
class LogitRows:
  """A device's rows of the bias and the mask (None each where not given); `dbias`: whether
  the backward forms the bias's gradient."""
  bias: jax.Array | None = None
  mask: jax.Array | None = None
  dbias: bool = False

  def chunks(self, parts: int) -> list[LogitRows]:
    """The rows of each of the device's `parts` query chunks."""
    return [dataclasses.replace(self, bias=b, mask=m)
            for b, m in zip(_rows(self.bias, parts), _rows(self.mask, parts))]

  def cut(self, start, size: int) -> LogitRows:
    """These rows' columns of the keys [start, start + size)."""
    return dataclasses.replace(self, bias=_columns(self.bias, start, size),
                               mask=_columns(self.mask, start, size))

  def kernel_arrays(self, backward: bool = False) -> dict:
    """The `bias` and `mask` arguments of a kernel call (_ops.flash_fwd, flash_bwd). For the
    backward a 16-bit bias broadcast along the query or key dim goes in as float32 (the same
    values): the kernel then returns its gradient's partial sums in float32, and the strategy's
    sums of them round once, at the end, as one device's kernel does."""
    bias = self.bias
    if (backward and self.dbias and bias.dtype != jnp.float32
        and not (full(bias, ROWS) and full(bias, COLUMNS))):
      bias = bias.astype(jnp.float32)
    return dict(bias=bias, mask=self.mask)

  def zero_dbias(self):
    """A float32 accumulator of the bias's gradient over these rows (None without one)."""
    return jnp.zeros(self.bias.shape, jnp.float32) if self.dbias else None

  def add_dbias(self, total, part, row0, column0):
    """`total` (zero_dbias's) with a kernel call's gradient `part` added at rows [row0, ...)
    and columns [column0, ...) where those dims are full (row0 static or traced; column0 too)."""
    if total is None:
      return None
    start = (0, 0, row0 if full(total, ROWS) else 0, column0 if full(total, COLUMNS) else 0)
    current = jax.lax.dynamic_slice(total, start, part.shape)
    return jax.lax.dynamic_update_slice(total, current + part.astype(jnp.float32), start)


def logit_rows(bias=None, mask=None, dbias: bool = False) -> LogitRows | None:
  """LogitRows of the arrays, or None where neither is given."""
  if bias is None and mask is None:
    return None
  return LogitRows(bias, mask, dbias=dbias and bias is not None)
