"""Context parallelism: ring attention over a sequence sharded along a mesh axis (the algorithm;
its entry points, ``jax_flash.ring_attention`` and ``context_parallel_attention``, are
jax_flash._context_parallel's).

Each device holds a slice of the sequence of every operand. Keys and values travel around the
ring (``ppermute``) while each device attends its queries to the block it holds; partial
results merge through their log-sum-exps. The backward pass goes around the ring again, with
each block's dK/dV accumulators travelling with it until they are back on their owner.

Layouts: "contiguous" gives device r rows [r L, (r+1) L); "zigzag" splits the sequence into
2P chunks and gives device r chunks r and 2P-1-r, so under a causal mask every device has the
same amount of work (see ``zigzag_indices``). Block pairs are chunk-aligned, so each is fully
visible, causal on its diagonal, or invisible (skipped) — the kernels need no position offsets.

ALiBi slopes ((B, N) float32, per head: nothing travels): each block's kernel biases by the
positions within its chunks, which differ from the global ones by (key chunk start - query
chunk start) for every score of the pair; so a block's lse is moved by slope times that (its
output is unchanged) before the merge, and the backward hands each block's kernel the lse moved
back (jax_flash._reference.alibi_lse_shift).

Segment ids (packed documents): the key-side ids travel around the ring with their K/V slice
(one more int32 operand of the same collective-permute), the query-side ids stay; each block
runs the kernel with the local query ids and the visiting key ids. A row that sees no key in a
block gets 0 and EMPTY_ROW_LSE there, which weighs nothing in the merge, so a row with no key in
any block ends at 0 and EMPTY_ROW_LSE as on one device.

jax.nn's bias and mask arrays (jax_flash._logit_rows): each device holds the rows of its own
queries, with every key's column (B|1, N|1, L|1, S|1); nothing travels. Each block pair takes
its query chunk's rows and the visiting key chunk's columns, and the bias's gradient of each
pair is added into the same place of a float32 accumulator of the device's rows (summed where a
dim is broadcast). A row the mask empties in a block pair weighs nothing in the merge, as with
segment ids.

Block masks (block-sparse attention, one bool per 128 x 128 block, jax_flash.BLOCK_MASK_BLOCK):
each device holds the block rows of its own queries, every key block's column, in the order of
the whole sequence (B, N, L/128, S/128); nothing travels. Each block pair takes its query chunk's
rows and the visiting key chunk's columns (a dynamic slice at the chunk's first key block), so
every chunk must be whole blocks (jax_flash._context_parallel checks it). A pair whose block
mask hides every block is skipped like an invisible causal pair; within a pair the kernel skips
the hidden blocks.

Fused dropout (jax_flash._dropout; seeds (B, N, SEED_WORDS) per head: nothing travels): each
block's kernel takes this device's heads' seeds with their row and column words moved to its
query chunk's first row and its key chunk's first key (jax_flash._dropout.at_offset), so it
draws the decisions of those places in the sequence and drops what one kernel over the whole
sequence drops; the chunks must be whole 16-row and 16-key groups of the decisions' layout
(jax_flash._context_parallel checks it). The backward regenerates them the same way. (The
output's merge is unchanged: dropout leaves the lse alone.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _dropout, _ops
from jax_flash._block_sparse import BLOCK_MASK_BLOCK
from jax_flash._logit_rows import LogitRows
from jax_flash._reference import EMPTY_ROW_LSE, alibi_lse_shift

LAYOUTS = ("contiguous", "zigzag")


def zigzag_indices(seq_len: int, num_devices: int) -> np.ndarray:
  """Positions in the zig-zag order: x[:, zigzag_indices(...)] laid out contiguously over the
  devices gives device r the chunks r and 2P-1-r of the original sequence."""
  if seq_len % (2 * num_devices):
    raise ValueError(f"the zigzag layout needs the sequence length ({seq_len}) to be a multiple "
                     f"of 2 x the number of devices ({2 * num_devices})")
  chunks = np.arange(seq_len).reshape(2 * num_devices, -1)
  order = [c for r in range(num_devices) for c in (r, 2 * num_devices - 1 - r)]
  return chunks[order].reshape(-1)


def _chunk_ids(rank, num_devices: int, layout: str):
  if layout == "contiguous":
    return [rank]
  return [rank, 2 * num_devices - 1 - rank]


def _local_lengths(lengths, chunk_id, chunk_len: int):
  """Global lengths -> the lengths within chunk `chunk_id` (positions past them are padding)."""
  return jnp.clip(lengths - chunk_id * chunk_len, 0, chunk_len).astype(jnp.int32)


def _relation(q_id, k_id, is_causal: bool):
  """0: the pair is invisible (skip), 1: causal diagonal, 2: fully visible."""
  if not is_causal:
    return jnp.int32(2)
  return jnp.where(q_id > k_id, 2, jnp.where(q_id == k_id, 1, 0)).astype(jnp.int32)


def _configs(config: _ops.KernelConfig):
  diagonal = dataclasses.replace(config, is_causal=True, window_left=-1, window_right=-1)
  full = dataclasses.replace(config, is_causal=False, window_left=-1, window_right=-1)
  return diagonal, full


def _varying_like(x, like):
  """`x` typed as varying over every mesh axis `like` varies over: inside shard_map the branches
  of a switch (and a VJP's cotangents) must carry their inputs' types, and constants (skipped
  blocks) or custom-call results come out unvarying. Outside shard_map (a custom_partitioning
  lowering) nothing is typed varying and `x` stays as it is."""
  missing = tuple(sorted(_varying_axes(like) - _varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)  # the name in some jax versions
  return vma if vma is not None else aval.manual_axis_type.varying


def _block_fwd(config, relation, q, k, v, q_lens, kv_lens, ids=(), alibi=None, blocks=None,
               logits: LogitRows | None = None, seeds=None):
  """(o float32, lse) of one block pair, by its relation; `ids`: () or (q_ids, kv_ids) of the
  pair; `alibi`: None or (slopes (B, N), key chunk start - query chunk start); `blocks`: None
  or the pair's block mask (_pair_blocks); `logits`: None or the pair's bias and mask; `seeds`:
  None or the pair's dropout seeds (_pair_seeds)."""
  diagonal, full = _configs(config)
  slopes = None if alibi is None else alibi[0]
  arrays = {} if logits is None else logits.kernel_arrays()

  def skip(q, k, v, q_lens, kv_lens, ids, slopes, blocks, seeds, arrays):
    batch, seq, heads, _ = q.shape
    return (_varying_like(jnp.zeros((batch, seq, heads, v.shape[-1]), jnp.float32), q),
            _varying_like(jnp.full((batch, heads, seq), EMPTY_ROW_LSE, jnp.float32), q))

  def run(cfg):
    def branch(q, k, v, q_lens, kv_lens, ids, slopes, blocks, seeds, arrays):
      o, lse = _ops.flash_fwd(q, k, v, q_lens, kv_lens, cfg, tuple(ids) or None, slopes, blocks,
                              seeds, **arrays)
      return _varying_like(o.astype(jnp.float32), q), _varying_like(lse, q)
    return branch

  o, lse = jax.lax.switch(relation, [skip, run(diagonal), run(full)], q, k, v, q_lens, kv_lens,
                          tuple(ids), slopes, blocks, seeds, arrays)
  if alibi is not None:
    lse = alibi_lse_shift(lse, slopes, alibi[1])
  return o, lse


def _merge(o, lse, o_part, lse_part):
  """Combines two partial softmax results over disjoint key sets (empty parts weigh 0)."""
  new_lse = jnp.logaddexp(lse, lse_part)
  def weight(x):  # (B, N, T) -> (B, T, N, 1)
    return jnp.exp(x - new_lse).transpose(0, 2, 1)[..., None]
  return o * weight(lse) + o_part * weight(lse_part), new_lse


def _split(x, parts: int, axis: int):
  return jnp.split(x, parts, axis=axis) if parts > 1 else [x]


def _pair_ids(q_ids_c, kv_ids_c):
  return () if q_ids_c is None else (q_ids_c, kv_ids_c)


def _split_ids(segment_ids, parts: int):
  """(q id chunks, kv id chunks) of this device's (q_ids, kv_ids) slices; None chunks without
  ids."""
  if segment_ids is None:
    return [None] * parts, [None] * parts
  return _split(segment_ids[0], parts, 1), _split(segment_ids[1], parts, 1)


def _alibi_pair(alibi_slopes, q_id, k_id, chunk_q: int, chunk_k: int):
  """None without slopes, else (slopes, key chunk start - query chunk start) of a block pair."""
  if alibi_slopes is None:
    return None
  return alibi_slopes, k_id * chunk_k - q_id * chunk_q


def _pair_blocks(rows, k_id, chunk_k: int):
  """The block mask of a block pair: its query chunk's block `rows` (B, N, chunk_q / 128, S / 128),
  cut to the columns of key chunk `k_id` (traced: the visiting chunk); None without a mask."""
  if rows is None:
    return None
  columns = chunk_k // BLOCK_MASK_BLOCK[1]
  return jax.lax.dynamic_slice_in_dim(rows, k_id * columns, columns, axis=3)


def _pair_seeds(dropout_seeds, q_id, k_id, chunk_q: int, chunk_k: int):
  """The dropout seeds of a block pair: this device's heads' seeds at its query chunk's first
  row and its key chunk's first key (chunks of whole 16-row and 16-key groups:
  jax_flash._context_parallel checks), so that its kernel drops what one kernel over the whole
  sequence drops there; None without dropout."""
  if dropout_seeds is None:
    return None
  return _dropout.at_offset(dropout_seeds, q_id * chunk_q, k_id * chunk_k)


def _pair_logits(rows: LogitRows | None, k_id, chunk_k: int) -> LogitRows | None:
  """The bias and mask of a block pair: its query chunk's `rows`, cut to the columns of key
  chunk `k_id` (traced: the visiting chunk); None without them."""
  return None if rows is None else rows.cut(k_id * chunk_k, chunk_k)


def _unless_hidden(relation, blocks):
  """The pair's relation, or 0 (skip) where its block mask hides every block."""
  return relation if blocks is None else jnp.where(jnp.any(blocks), relation, 0)


def _split_blocks(block_mask, parts: int):
  """This device's block rows (None: no block mask) split into its query chunks'."""
  return [None] * parts if block_mask is None else _split(block_mask, parts, 2)


def ring_fwd(q, k, v, q_lens, kv_lens, config: _ops.KernelConfig, segment_ids=None, *,
             axis_name, layout: str, alibi_slopes=None, block_mask=None,
             logits: LogitRows | None = None, dropout_seeds=None):
  """(o, lse) of the ring over `axis_name`, with _ops.flash_fwd's arguments and results (this
  device's slices in `layout`, segment ids too; q_lens and kv_lens global; the ALiBi slopes
  (B, N) of this device's heads; the block mask (B, N, L / 128, S / 128) of this device's query
  rows, in `layout`, and every key block, in the sequence's order; each chunk whole blocks; the
  bias and mask rows of its queries likewise, `logits`). Inside shard_map or a partitioned
  lowering."""
  num = jax.lax.axis_size(axis_name)
  rank = jax.lax.axis_index(axis_name)
  q_ids = _chunk_ids(rank, num, layout)
  parts = len(q_ids)
  chunk_q, chunk_k = q.shape[1] // parts, k.shape[1] // parts
  qs = _split(q, parts, 1)
  outs = [jnp.zeros((*x.shape[:-1], v.shape[-1]), jnp.float32) for x in qs]  # v's head dim
  lses = [jnp.full((x.shape[0], x.shape[2], x.shape[1]), EMPTY_ROW_LSE, jnp.float32) for x in qs]
  q_seg = _split_ids(segment_ids, parts)[0]
  kv_seg = None if segment_ids is None else segment_ids[1]
  block_rows = _split_blocks(block_mask, parts)
  logit_rows = [None] * parts if logits is None else logits.chunks(parts)
  perm = [(i, (i + 1) % num) for i in range(num)]
  for step in range(num):
    src = (rank - step) % num
    k_ids = _chunk_ids(src, num, layout)
    kv_seg_cs = _split(kv_seg, parts, 1) if kv_seg is not None else [None] * parts
    for c, (q_c, q_id) in enumerate(zip(qs, q_ids)):
      for k_c, v_c, k_id, kv_seg_c in zip(_split(k, parts, 1), _split(v, parts, 1), k_ids,
                                          kv_seg_cs):
        blocks = _pair_blocks(block_rows[c], k_id, chunk_k)
        o_p, lse_p = _block_fwd(config,
                                _unless_hidden(_relation(q_id, k_id, config.is_causal), blocks),
                                q_c, k_c, v_c, _local_lengths(q_lens, q_id, chunk_q),
                                _local_lengths(kv_lens, k_id, chunk_k),
                                _pair_ids(q_seg[c], kv_seg_c),
                                _alibi_pair(alibi_slopes, q_id, k_id, chunk_q, chunk_k), blocks,
                                _pair_logits(logit_rows[c], k_id, chunk_k),
                                _pair_seeds(dropout_seeds, q_id, k_id, chunk_q, chunk_k))
        outs[c], lses[c] = _merge(outs[c], lses[c], o_p, lse_p)
    if step + 1 < num:  # the key-side ids travel with their K/V slice
      if kv_seg is None:
        k, v = jax.lax.ppermute((k, v), axis_name, perm)
      else:
        k, v, kv_seg = jax.lax.ppermute((k, v, kv_seg), axis_name, perm)
  out = jnp.concatenate(outs, axis=1).astype(jnp.float32 if config.o_float32 else q.dtype)
  return out, jnp.concatenate(lses, axis=2)


def _block_bwd(config, relation, q, k, v, o, lse, d_o, q_lens, kv_lens, ids=(), alibi=None,
               blocks=None, logits: LogitRows | None = None, seeds=None):
  """(dq, dk, dv, dbias) of one block pair, `lse` the rows' global one; `ids`, `alibi`, `blocks`,
  `logits` and `seeds` as in _block_fwd; dbias float32, None unless logits asks for it."""
  diagonal, full = _configs(config)
  slopes = None if alibi is None else alibi[0]
  if alibi is not None:  # the lse the block's kernel formed its scores against
    lse = alibi_lse_shift(lse, slopes, alibi[1], sign=-1)
  arrays = {} if logits is None else logits.kernel_arrays(backward=True)
  wants_dbias = logits is not None and logits.dbias

  def skip(q, k, v, o, lse, d_o, q_lens, kv_lens, ids, slopes, blocks, seeds, arrays):
    dbias = _varying_like(jnp.zeros(arrays["bias"].shape, jnp.float32), q) if wants_dbias else None
    return (_varying_like(jnp.zeros(q.shape, q.dtype), q), _varying_like(jnp.zeros(k.shape, k.dtype), k),
            _varying_like(jnp.zeros(v.shape, v.dtype), v), dbias)

  def run(cfg):
    def branch(q, k, v, o, lse, d_o, q_lens, kv_lens, ids, slopes, blocks, seeds, arrays):
      grads = _ops.flash_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, cfg, tuple(ids) or None,
                             None, slopes, blocks, seeds, dbias=wants_dbias, **arrays)
      dbias = _varying_like(grads[3].astype(jnp.float32), q) if wants_dbias else None
      return (_varying_like(grads[0], q), _varying_like(grads[1], k), _varying_like(grads[2], v),
              dbias)
    return branch

  return jax.lax.switch(relation, [skip, run(diagonal), run(full)], q, k, v, o, lse, d_o, q_lens,
                        kv_lens, tuple(ids), slopes, blocks, seeds, arrays)


def ring_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config: _ops.KernelConfig, segment_ids=None,
             *, axis_name, layout: str, alibi_slopes=None, block_mask=None,
             logits: LogitRows | None = None, dropout_seeds=None):
  """(dq, dk, dv) of the ring over `axis_name`, with _ops.flash_bwd's arguments and results;
  where `logits` asks for the bias's gradient, (dq, dk, dv, dbias), dbias float32 over this
  device's bias rows."""
  num = jax.lax.axis_size(axis_name)
  rank = jax.lax.axis_index(axis_name)
  q_ids = _chunk_ids(rank, num, layout)
  parts = len(q_ids)
  chunk_q, chunk_k = q.shape[1] // parts, k.shape[1] // parts
  qs, os_, dos = _split(q, parts, 1), _split(o, parts, 1), _split(d_o, parts, 1)
  lses = _split(lse, parts, 2)
  dqs = [jnp.zeros(x.shape, jnp.float32) for x in qs]
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  q_seg = _split_ids(segment_ids, parts)[0]
  kv_seg = None if segment_ids is None else segment_ids[1]
  block_rows = _split_blocks(block_mask, parts)
  logit_rows = [None] * parts if logits is None else logits.chunks(parts)
  dbias = None if logits is None else logits.zero_dbias()
  perm = [(i, (i + 1) % num) for i in range(num)]
  for step in range(num):
    src = (rank - step) % num
    k_ids = _chunk_ids(src, num, layout)
    dks, dvs = _split(dk, parts, 1), _split(dv, parts, 1)
    kv_seg_cs = _split(kv_seg, parts, 1) if kv_seg is not None else [None] * parts
    for c, q_id in enumerate(q_ids):
      for j, (k_c, v_c, k_id) in enumerate(zip(_split(k, parts, 1), _split(v, parts, 1), k_ids)):
        blocks = _pair_blocks(block_rows[c], k_id, chunk_k)
        dq_p, dk_p, dv_p, dbias_p = _block_bwd(
            config, _unless_hidden(_relation(q_id, k_id, config.is_causal), blocks), qs[c], k_c,
            v_c, os_[c], lses[c], dos[c], _local_lengths(q_lens, q_id, chunk_q),
            _local_lengths(kv_lens, k_id, chunk_k), _pair_ids(q_seg[c], kv_seg_cs[j]),
            _alibi_pair(alibi_slopes, q_id, k_id, chunk_q, chunk_k), blocks,
            _pair_logits(logit_rows[c], k_id, chunk_k),
            _pair_seeds(dropout_seeds, q_id, k_id, chunk_q, chunk_k))
        if dbias is not None:
          dbias = logits.add_dbias(dbias, dbias_p, c * chunk_q, k_id * chunk_k)
        dqs[c] = dqs[c] + dq_p.astype(jnp.float32)
        dks[j] = dks[j] + dk_p.astype(jnp.float32)
        dvs[j] = dvs[j] + dv_p.astype(jnp.float32)
    dk, dv = jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)
    # The gradient accumulators travel with their blocks; after `num` moves they are home.
    if step + 1 < num:
      if kv_seg is None:
        k, v, dk, dv = jax.lax.ppermute((k, v, dk, dv), axis_name, perm)
      else:
        k, v, dk, dv, kv_seg = jax.lax.ppermute((k, v, dk, dv, kv_seg), axis_name, perm)
    else:
      dk, dv = jax.lax.ppermute((dk, dv), axis_name, perm)
  dq = jnp.concatenate(dqs, axis=1)
  grads = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
  return grads if dbias is None else (*grads, dbias)
