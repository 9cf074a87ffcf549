"""Context parallelism by all-gather of K/V.

Each device keeps its query slice and gathers the keys and values of the whole sequence (one
all-gather each); the backward pass gathers them again and returns dK/dV to their owners by a
reduce-scatter.

The kernels mask by positions local to their operands: a query slice starting at global row
``off`` has its causal and window masks shifted by ``off``. The kernels take no position
offset, but a window does the same work: with keys cut to the static range [ks, ke) the query
can see, global ``j <= i + off + right`` is local ``j' <= i' + (off - ks) + right`` and global
``j >= i + off - left`` is local ``j' >= i' - (left - (off - ks))``, both bounds >= 0 (ks is
off - left, or 0 when that is negative). The offset is static per device: a ``lax.switch`` over
the device index picks one kernel call per possible slice (P of them, each with its own
constants), so the kernels see only what their slice attends to (causal: the keys up to the
slice's end, a window: the window's span).

Segment ids: the key-side ids are gathered with K/V (one more all-gather, of int32 per key) and
cut to the same key range; the query-side ids stay with their queries.

ALiBi slopes ((B, N), per head: nothing to gather): a slice's kernel biases by positions local
to its query rows and key range, off from the global ones by (key range start - query slice
start) for every score of a row; the slice's lse is moved by slope times that, and moved back
for its backward kernel (jax_flash._reference.alibi_lse_shift). The offset is traced (the
query slice's start depends on the device), so the plans, and the switch, are unchanged.

jax.nn's bias and mask arrays (jax_flash._logit_rows): each device holds the rows of its own
queries, with every key's column (B|1, N|1, L|1, S|1); nothing is gathered. A slice's kernel
takes its rows and the columns of its key range; its bias gradient goes to the same columns of
the slice's rows (the keys outside the range get none: the masks hide them).

Block masks (one bool per 128 x 128 block, jax_flash.BLOCK_MASK_BLOCK): each device holds the
block rows of its queries, with every key block's column in the sequence's order (B, N, L/128,
S/128);
nothing is gathered. A slice's kernel takes its rows and the columns of its key range, so the
query chunks must be whole blocks and each key range must start on a block: a range cut by a
window's left edge starts at a block boundary only when the left size is a multiple of 128
(key_ranges_aligned; jax_flash._context_parallel falls back where not). Its end may cut a
block (the kernel's last key block is then partial, as the mask's last column is at S).

Fused dropout (jax_flash._dropout; seeds (B, N, SEED_WORDS) per head: nothing is gathered): a
slice's kernel takes the seeds with their row and column words moved to the slice's first row
and its key range's first key (jax_flash._dropout.at_offset), so it drops what one kernel over
the whole sequence drops there. The query chunks must be whole 16-row groups of the decisions'
layout and each key range must start on a 16-key group (a window's left size a multiple of 16
where it cuts the range: key_ranges_aligned).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_flash import _dropout, _ops
from jax_flash._block_sparse import BLOCK_MASK_BLOCK
from jax_flash._chunks import from_layout_order, to_layout_order
from jax_flash._logit_rows import LogitRows
from jax_flash._reference import EMPTY_ROW_LSE, alibi_lse_shift
from jax_flash._ring import _varying_like

_UNBOUNDED = -1


@dataclasses.dataclass(frozen=True)
class _Slice:
  """What the query rows [off, off + rows) attend to: keys [start, stop) under `config`."""
  start: int
  stop: int
  config: _ops.KernelConfig


def _slice_plan(config: _ops.KernelConfig, off: int, rows: int, seq_k: int) -> _Slice:
  """The key range and kernel constants of the query rows [off, off + rows)."""
  left = config.window_left  # -1: unbounded
  right = config.window_right
  if config.is_causal:
    right = 0
  start = 0 if left < 0 else max(0, off - left)
  stop = seq_k if right < 0 else min(seq_k, off + rows + right)
  shift = off - start
  local = dataclasses.replace(
      config, is_causal=False,
      window_left=_UNBOUNDED if left < 0 else left - shift,
      window_right=_UNBOUNDED if right < 0 else shift + right)
  return _Slice(start, max(start, stop), local)


def _chunk_ids(num: int, layout: str):
  """Which chunks (of P or 2P) a device's query rows are, as functions of its rank (a Python
  int or the traced axis index)."""
  if layout == "contiguous":
    return [lambda r: r]
  return [lambda r: r, lambda r: 2 * num - 1 - r]


def _gather_kv(k, v, axis_name, layout: str, num: int, kv_ids=None):
  """K, V (and the key-side segment ids, None without them) of the whole sequence."""
  xs = (k, v) if kv_ids is None else (k, v, kv_ids)
  xs = [from_layout_order(jax.lax.all_gather(x, axis_name, axis=1, tiled=True), 1, num, layout)
        for x in xs]
  return xs[0], xs[1], (xs[2] if kv_ids is not None else None)


def _ids_for(plan: _Slice, ids):
  """The kernel's segment ids of a slice: None without ids, else (q ids, key ids in range)."""
  if ids is None:
    return None
  q_ids, kv_ids = ids
  return q_ids, kv_ids[:, plan.start:plan.stop]


def key_ranges_aligned(config: _ops.KernelConfig, num: int, layout: str, seq_q: int,
                       seq_k: int, multiple: int) -> bool:
  """Whether every query slice of the all-gather over `num` devices in `layout` starts its key
  range on a multiple of `multiple` keys: a key block of the block mask, or a 16-key group of
  dropout's decisions (see the module docstring); the query chunks' own alignment is the
  caller's to check."""
  parts = 1 if layout == "contiguous" else 2
  rows = seq_q // (num * parts)
  return all(_slice_plan(config, chunk * rows, rows, seq_k).start % multiple == 0
             for chunk in range(num * parts))


def _blocks_for(plan: _Slice, blocks):
  """The kernel's block mask of a slice: its rows' blocks, cut to the key range's columns
  (None without a block mask)."""
  if blocks is None:
    return None
  block_k = BLOCK_MASK_BLOCK[1]
  return blocks[..., plan.start // block_k:-(-plan.stop // block_k)]


def _logits_for(plan: _Slice, logits: LogitRows | None) -> LogitRows | None:
  """The kernel's bias and mask of a slice: its rows, cut to the key range's columns."""
  return None if logits is None else logits.cut(plan.start, plan.stop - plan.start)


def _seeds_for(plan: _Slice, seeds):
  """The kernel's dropout seeds of a slice: `seeds` (at its first row: _row_seeds) moved to the
  key range's first key (None without dropout)."""
  return None if seeds is None else _dropout.at_offset(seeds, 0, plan.start)


def _row_seeds(dropout_seeds, first_row):
  """The dropout seeds at a query slice's first global row (None without dropout)."""
  return None if dropout_seeds is None else _dropout.at_offset(dropout_seeds, first_row, 0)


def _local_kv_lens(kv_lens, plan: _Slice):
  return jnp.clip(kv_lens - plan.start, 0, plan.stop - plan.start).astype(jnp.int32)


def _slice_fwd(plan: _Slice, q, k, v, q_lens, kv_lens, alibi=None, ids=None, blocks=None,
               logits=None, seeds=None):
  """(o float32, lse) of one query slice (q_lens local to it) against the gathered K/V;
  `alibi`: None or (slopes (B, N), the slice's first global query row); `ids`: None or
  (the slice's query ids, the gathered key ids); `blocks`: None or the block mask of its rows
  (B, N, rows / 128, S / 128); `logits`: None or the bias and mask of its rows (LogitRows);
  `seeds`: None or the dropout seeds at the slice's first row (_seeds_for adds its keys')."""
  if plan.stop == plan.start:  # nothing visible: every row empty
    batch, rows, heads, _ = q.shape
    return (_varying_like(jnp.zeros((batch, rows, heads, v.shape[-1]), jnp.float32), q),
            _varying_like(jnp.full((batch, heads, rows), EMPTY_ROW_LSE, jnp.float32), q))
  arrays = {} if logits is None else _logits_for(plan, logits).kernel_arrays()
  o, lse = _ops.flash_fwd(q, k[:, plan.start:plan.stop], v[:, plan.start:plan.stop], q_lens,
                          _local_kv_lens(kv_lens, plan), plan.config, _ids_for(plan, ids),
                          None if alibi is None else alibi[0], _blocks_for(plan, blocks),
                          _seeds_for(plan, seeds), **arrays)
  if alibi is not None:
    lse = alibi_lse_shift(lse, alibi[0], plan.start - alibi[1])
  return _varying_like(o.astype(jnp.float32), q), _varying_like(lse, q)


def _slice_bwd(plan: _Slice, q, k, v, o, lse, d_o, q_lens, kv_lens, alibi=None, ids=None,
               blocks=None, logits=None, seeds=None):
  """(dq, dk float32, dv float32, dbias) of _slice_fwd, dK/dV over the whole gathered sequence;
  dbias float32 over the slice's bias rows and every key's column where `logits` asks for it,
  else None."""
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  dbias = None if logits is None else logits.zero_dbias()
  if plan.stop == plan.start:
    return (_varying_like(jnp.zeros(q.shape, q.dtype), q), _varying_like(dk, k),
            _varying_like(dv, v), None if dbias is None else _varying_like(dbias, q))
  slopes = None
  if alibi is not None:  # the lse the slice's kernel formed its scores against
    slopes = alibi[0]
    lse = alibi_lse_shift(lse, slopes, plan.start - alibi[1], sign=-1)
  arrays = {} if logits is None else _logits_for(plan, logits).kernel_arrays(backward=True)
  grads = _ops.flash_bwd(
      q, k[:, plan.start:plan.stop], v[:, plan.start:plan.stop], o, lse, d_o, q_lens,
      _local_kv_lens(kv_lens, plan), plan.config, _ids_for(plan, ids), None, slopes,
      _blocks_for(plan, blocks), _seeds_for(plan, seeds), dbias=dbias is not None, **arrays)
  dq, dk_part, dv_part = grads[:3]
  dk = dk.at[:, plan.start:plan.stop].set(dk_part.astype(jnp.float32))
  dv = dv.at[:, plan.start:plan.stop].set(dv_part.astype(jnp.float32))
  if dbias is not None:
    dbias = _varying_like(logits.add_dbias(dbias, grads[3], 0, plan.start), q)
  return _varying_like(dq, q), _varying_like(dk, k), _varying_like(dv, v), dbias


def _by_rank(rank, plans: list[_Slice], fn, *args):
  """fn(plan of this rank, *args): one call where every rank has the same plan, else a
  lax.switch over the ranks."""
  if all(p == plans[0] for p in plans):
    return fn(plans[0], *args)
  branches = [lambda *a, p=p: fn(p, *a) for p in plans]
  return jax.lax.switch(rank, branches, *args)


def _split_rows(x, parts: int, axis: int):
  return jnp.split(x, parts, axis=axis) if parts > 1 else [x]


def _slices(config, num: int, layout: str, rows: int, seq_k: int, rank, q_lens):
  """For each of this device's query chunks: (its plan for every rank, its local q_lens, its
  first global row)."""
  out = []
  for chunk in _chunk_ids(num, layout):
    plans = [_slice_plan(config, chunk(r) * rows, rows, seq_k) for r in range(num)]
    local_q_lens = jnp.clip(q_lens - chunk(rank) * rows, 0, rows).astype(jnp.int32)
    out.append((plans, local_q_lens, chunk(rank) * rows))
  return out


def _alibi_arg(alibi_slopes, first_row):
  return None if alibi_slopes is None else (alibi_slopes, first_row)


def _id_pair(q_ids_c, kv_ids):
  return None if q_ids_c is None else (q_ids_c, kv_ids)


def all_gather_fwd(q, k, v, q_lens, kv_lens, config: _ops.KernelConfig, segment_ids=None, *,
                   axis_name, layout: str, kv_layout: str | None = None, alibi_slopes=None,
                   block_mask=None, logits: LogitRows | None = None, dropout_seeds=None):
  """(o, lse) over a sequence sharded along `axis_name`, with _ops.flash_fwd's arguments and
  results (this device's query slices in `layout`, its K/V slices in `kv_layout`, by default
  the same, the segment ids with them; q_lens and kv_lens global; the ALiBi slopes (B, N) of
  this device's heads; the block mask (B, N, L / 128, S / 128) of its query rows, in `layout`,
  every key block in the sequence's order: see key_ranges_aligned; the bias and mask rows of its
  queries likewise, `logits`). Inside shard_map or a partitioned lowering."""
  num = jax.lax.axis_size(axis_name)
  rank = jax.lax.axis_index(axis_name)
  q_ids, kv_ids = segment_ids if segment_ids is not None else (None, None)
  k, v, kv_ids = _gather_kv(k, v, axis_name, kv_layout or layout, num, kv_ids)
  parts = 1 if layout == "contiguous" else 2
  rows = q.shape[1] // parts
  q_id_cs = _split_rows(q_ids, parts, 1) if q_ids is not None else [None] * parts
  block_cs = _split_rows(block_mask, parts, 2) if block_mask is not None else [None] * parts
  logit_cs = [None] * parts if logits is None else logits.chunks(parts)
  outs, lses = [], []
  for q_c, q_id_c, blocks_c, logits_c, (plans, q_lens_c, first_row) in zip(
      _split_rows(q, parts, 1), q_id_cs, block_cs, logit_cs,
      _slices(config, num, layout, rows, k.shape[1], rank, q_lens)):
    o, lse = _by_rank(rank, plans, _slice_fwd, q_c, k, v, q_lens_c, kv_lens,
                      _alibi_arg(alibi_slopes, first_row), _id_pair(q_id_c, kv_ids), blocks_c,
                      logits_c, _row_seeds(dropout_seeds, first_row))
    outs.append(o)
    lses.append(lse)
  out = jnp.concatenate(outs, axis=1).astype(jnp.float32 if config.o_float32 else q.dtype)
  return out, jnp.concatenate(lses, axis=2)


def all_gather_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config: _ops.KernelConfig,
                   segment_ids=None, *, axis_name, layout: str, kv_layout: str | None = None,
                   alibi_slopes=None, block_mask=None, logits: LogitRows | None = None,
                   dropout_seeds=None):
  """(dq, dk, dv) of all_gather_fwd, with _ops.flash_bwd's arguments and results; where
  `logits` asks for the bias's gradient, (dq, dk, dv, dbias), dbias float32 over this device's
  bias rows."""
  num = jax.lax.axis_size(axis_name)
  rank = jax.lax.axis_index(axis_name)
  kv_layout = kv_layout or layout
  q_ids, kv_ids = segment_ids if segment_ids is not None else (None, None)
  k_all, v_all, kv_ids = _gather_kv(k, v, axis_name, kv_layout, num, kv_ids)
  parts = 1 if layout == "contiguous" else 2
  rows = q.shape[1] // parts
  dqs = []
  dk = jnp.zeros(k_all.shape, jnp.float32)
  dv = jnp.zeros(v_all.shape, jnp.float32)
  q_id_cs = _split_rows(q_ids, parts, 1) if q_ids is not None else [None] * parts
  block_cs = _split_rows(block_mask, parts, 2) if block_mask is not None else [None] * parts
  logit_cs = [None] * parts if logits is None else logits.chunks(parts)
  dbias = None if logits is None else logits.zero_dbias()
  chunks = zip(_split_rows(q, parts, 1), _split_rows(o, parts, 1), _split_rows(lse, parts, 2),
               _split_rows(d_o, parts, 1), q_id_cs, block_cs, logit_cs,
               _slices(config, num, layout, rows, k_all.shape[1], rank, q_lens))
  for c, (q_c, o_c, lse_c, do_c, q_id_c, blocks_c, logits_c, (plans, q_lens_c, first_row)) in (
      enumerate(chunks)):
    dq_c, dk_c, dv_c, dbias_c = _by_rank(rank, plans, _slice_bwd, q_c, k_all, v_all, o_c, lse_c,
                                         do_c, q_lens_c, kv_lens,
                                         _alibi_arg(alibi_slopes, first_row),
                                         _id_pair(q_id_c, kv_ids), blocks_c, logits_c,
                                         _row_seeds(dropout_seeds, first_row))
    dqs.append(dq_c)
    dk, dv = dk + dk_c, dv + dv_c
    if dbias is not None:
      dbias = logits.add_dbias(dbias, dbias_c, c * rows, 0)
  # Back into the layout the devices hold the sequence in, then each device's slice summed.
  dk, dv = (jax.lax.psum_scatter(to_layout_order(x, 1, num, kv_layout), axis_name,
                                 scatter_dimension=1, tiled=True) for x in (dk, dv))
  grads = (_varying_like(jnp.concatenate(dqs, axis=1).astype(q.dtype), q),
           _varying_like(dk.astype(k.dtype), k), _varying_like(dv.astype(v.dtype), v))
  return grads if dbias is None else (*grads, dbias)
