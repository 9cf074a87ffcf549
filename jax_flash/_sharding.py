"""Partitioning of the attention custom calls, so they shard like native ops under jax.jit.

A bare custom call does not partition: XLA would gather its operands onto every device. Each
kernel call here is wrapped, innermost first, in
  * ``custom_partitioning`` with a Shardy sharding rule (and the GSPMD callbacks for partitioners
    without Shardy): batch and head axes shard with no communication at all; a sharded sequence
    axis runs a context-parallel strategy over it (jax_flash._context_parallel: the ring, the
    all-to-all over heads or the all-gather of K/V, by the call's ``context_parallel`` or the
    automatic choice, causal work balanced by the zig-zag layout); the head dims are kept whole
    (v's, and so the output's, may differ from q's and k's: MLA-style calls on "cpu");
  * ``custom_vmap``, whose rule folds a mapped axis into the batch axis (custom_partitioning has
    no batching rule of its own).

Grouped-query attention: query heads (K groups of G) shard over the same mesh axes as the K
key/value heads. With one kv head (MQA) the query heads shard alone and the kv head is
replicated: no communication in the forward; the backward sums dK/dV over the head axis (one
all-reduce of kv-sized arrays). When the axes divide the query heads but not K > 1 kv
heads, the heads are kept whole instead (the op is replicated over those axes: correct, but
without the head parallelism).

Segment ids ((B, T) and (B, S), the "cpu" kernel's) have their own pair of partitioned ops:
the ids shard with the batch (heads need nothing of them: still no communication) and with the
sequence where a context-parallel strategy runs over it, which carries them (see
jax_flash._context_parallel).

ALiBi slopes ((B, N) float32, the "cpu" kernel's) come last among the operands, in ops of their
own too: they shard with the batch and the query heads (no communication), and a
context-parallel strategy takes this device's slopes as they are (jax_flash._context_parallel).

Block masks ((B, N, Tb, Sb) bool, the "cpu" kernel's) come after the slopes: they shard with the
batch and the query heads (no communication), and their block rows with the sequence where a
context-parallel strategy runs over it, which carries them where the shards are whole 128 x 128
blocks (jax_flash._context_parallel); where no strategy can, a sequence-sharded call gathers the
sequence, and a requested strategy raises naming block_mask.

Dropout seeds ((B, N, SEED_WORDS) uint32: jax_flash._dropout.seeds) come after the block mask:
they shard with the batch and the query heads (no communication; they hold the global batch and
head indices, so every shard draws the mask of its own elements). Every context-parallel
strategy carries dropout (the ring's and the all-gather's kernels take the seeds moved to their
slices' first row and key) where the slices start 16-row and 16-key groups of the decisions'
layout (jax_flash._context_parallel); where none can, a sequence-sharded call gathers the
sequence, and a requested strategy raises naming dropout_rate.

jax.nn's bias and mask arrays ((B|1, N|1, T|1, S|1), the "cpu" kernel's, never broadcast
further) come after them: a full batch dim shards with the batch and a full head dim with the
query heads, a full query dim with the sequence where a context-parallel strategy runs over it
(each carries them: jax_flash._logit_rows), a dim of 1 is replicated, and so is the key dim;
the backward sums dbias over the mesh axes its bias is replicated on (psum).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flash import _context_parallel, _derivatives, _ops, _rounding
from jax_flash._logit_rows import LogitRows, logit_rows

# Factors: b batch, t query positions, s key positions, n query heads, k kv heads, h the head
# dim of q and k, e the head dim of v (and o, do, dv: MLA-style calls have e != h).
# The head factors are independent: the partition callback below keeps them consistent (a
# compound n = (k g) would let Shardy split mesh axes into sub-axes when K does not divide).
_FWD_RULE = "b t n h, b s k h, b s k e, b, b -> b t n e, b n t"
# The forward that also returns o's int8 rounding error (KernelConfig.o_split).
_FWD_SPLIT_RULE = _FWD_RULE + ", b t n e"
_BWD_RULE = ("b t n h, b s k h, b s k e, b t n e, b n t, b t n e, b, b "
             "-> b t n h, b s k h, b s k e")
# Optional operands after the lengths, in this order: o's int8 rounding error (the CUDA
# backward's; jax_flash._rounding), the segment ids q_ids (b t) and kv_ids (b s), the ALiBi
# slopes (b n).
_ERROR_RULE = ", b t n e"
_IDS_RULE = ", b t, b s"
_ALIBI_RULE = ", b n"
# The block mask (b n x y): x query blocks, y key blocks.
_BLOCKS_RULE = ", b n x y"
# The dropout seeds (b n w): w their words (jax_flash._dropout.SEED_WORDS).
_DROPOUT_RULE = ", b n w"
# The bias and the mask: b n t where a dim is full, a factor of their own where it is 1; the key
# dim a factor of its own either way (each device holds every key's column of its rows, also
# where K/V are sharded along the sequence: a shared s would have Shardy shard a (B, 1, 1, S)
# bias's keys like K's, only for the partition to gather them back).
_BIAS_FACTORS = (("b", "c"), ("n", "d"), ("t", "f"), ("g", "g"))
_MASK_FACTORS = (("b", "i"), ("n", "j"), ("t", "l"), ("m", "m"))


def _logit_factors(dims, factors) -> str:
  """The rule's factors of a bias or mask whose dims are full where `dims` (4 bools) says."""
  return " ".join(full if f else own for f, (full, own) in zip(dims, factors))


def _rule(base: str, error: bool, ids: bool, alibi: bool, blocks: bool = False,
          dropout: bool = False, bias=None, mask=None, dbias: bool = False) -> str:
  extras = (_ERROR_RULE if error else "") + (_IDS_RULE if ids else "") + (
      _ALIBI_RULE if alibi else "") + (_BLOCKS_RULE if blocks else "") + (
      _DROPOUT_RULE if dropout else "")
  if bias is not None:
    extras += ", " + _logit_factors(bias, _BIAS_FACTORS)
  if mask is not None:
    extras += ", " + _logit_factors(mask, _MASK_FACTORS)
  rule = base.replace(" ->", extras + " ->")
  return rule + ", " + _logit_factors(bias, _BIAS_FACTORS) if dbias else rule


# Kept whole: the head dims.
_WHOLE_FACTORS = ("h", "e")


def _axis_size(mesh, axes) -> int:
  if axes is None:
    return 1
  names = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[name] for name in names)


def _spec_entry(sharding, index: int):
  spec = getattr(sharding, "spec", None)
  return spec[index] if spec is not None and len(spec) > index else None


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The mesh axes the op runs sharded over (None: kept whole)."""
  batch: object
  q_heads: object
  kv_heads: object
  seq: object  # query and key positions: a context-parallel strategy over these axes
  strategy: _context_parallel.Strategy | None = None  # how, where seq is not None


def _heads_plan(mesh, q_shape, k_shape, heads) -> tuple[object, object]:
  """The kv heads shard with the query heads when they split evenly, one kv head (MQA) is
  replicated, otherwise all heads stay whole."""
  if heads is None or q_shape[2] % _axis_size(mesh, heads):
    return None, None
  if k_shape[2] % _axis_size(mesh, heads) == 0:
    return heads, heads
  if k_shape[2] == 1:
    return heads, None
  return None, None


def _plan(mesh, arg_shapes, config: _ops.KernelConfig, blocks: bool = False) -> _Plan:
  """Read off the query's sharding: batch as it is; heads by _heads_plan; a sharded sequence
  runs the strategy _context_parallel.choose picks for the call (or the one it asks for), and
  is gathered where none can run. A block mask (`blocks`) goes only with a strategy that can
  carry it (_context_parallel.choose), and so does dropout (config.dropout_rate)."""
  q, k = arg_shapes[0], arg_shapes[1]
  batch = _spec_entry(q.sharding, 0)
  seq = _spec_entry(q.sharding, 1)
  if q.shape[0] % _axis_size(mesh, batch):
    batch = None
  q_heads, kv_heads = _heads_plan(mesh, q.shape, k.shape, _spec_entry(q.sharding, 2))
  strategy = None
  if seq is not None:
    strategy = _context_parallel.choose(
        config.context_parallel, num=_axis_size(mesh, seq), seq_q=q.shape[1], seq_k=k.shape[1],
        heads_q=q.shape[2] // _axis_size(mesh, q_heads), config=config, block_mask=blocks)
    seq = seq if strategy is not None else None
  return _Plan(batch, q_heads, kv_heads, seq, strategy)


def _shardings(mesh, plan: _Plan):
  q_rows = NamedSharding(mesh, P(plan.batch, plan.seq, plan.q_heads, None))  # q, o, do, dq
  kv_rows = NamedSharding(mesh, P(plan.batch, plan.seq, plan.kv_heads, None))  # k, v, dk, dv
  lse = NamedSharding(mesh, P(plan.batch, plan.q_heads, plan.seq))
  lens = NamedSharding(mesh, P(plan.batch))
  return q_rows, kv_rows, lse, lens


@dataclasses.dataclass(frozen=True)
class _Extras:
  """Which optional operands an op takes after the lengths, in this order: o_error (the CUDA
  backward's), the segment ids (two), the ALiBi slopes, the block mask, the dropout seeds. For
  the forward, `error` is a third result instead: o's rounding error (KernelConfig.o_split)."""
  error: bool = False
  ids: bool = False
  alibi: bool = False
  blocks: bool = False  # the block mask, after the slopes
  dropout: bool = False  # the dropout seeds, after the block mask
  # jax.nn's bias and mask, last: None without, else which of their (B, N, T, S) dims are full
  bias: tuple[bool, bool, bool, bool] | None = None
  mask: tuple[bool, bool, bool, bool] | None = None
  dbias: bool = False  # the backward's: the bias's gradient a fourth result

  @property
  def trailing(self) -> int:
    """How many operands come after the dropout seeds: the bias and the mask, where taken."""
    return (self.bias is not None) + (self.mask is not None)

  def split(self, extras) -> tuple:
    """(o_error or None, segment ids or None, alibi slopes or None) of the operands (the block
    mask and the dropout seeds, where taken, are the last operands: see block_mask and
    dropout_seeds)."""
    extras = list(extras)
    o_error = extras.pop(0) if self.error else None
    ids = (extras.pop(0), extras.pop(0)) if self.ids else None
    alibi = extras.pop(0) if self.alibi else None
    return o_error, ids, alibi

  def block_mask(self, extras):
    """The block mask among the operands, or None."""
    return extras[len(extras) - 1 - self.dropout - self.trailing] if self.blocks else None

  def dropout_seeds(self, extras):
    """The dropout seeds among the operands, or None."""
    return extras[len(extras) - 1 - self.trailing] if self.dropout else None

  def bias_array(self, extras):
    """The bias among the operands, or None."""
    return extras[len(extras) - 1 - (self.mask is not None)] if self.bias is not None else None

  def mask_array(self, extras):
    """The mask among the operands, or None."""
    return extras[-1] if self.mask is not None else None

  @staticmethod
  def logit_sharding(mesh, plan: _Plan, dims):
    """A bias's or mask's sharding: its full batch dim with the batch, its full head dim with
    the query heads, its full query dim with the sequence (where a strategy runs over it), the
    rest replicated."""
    return NamedSharding(mesh, P(plan.batch if dims[0] else None,
                                 plan.q_heads if dims[1] else None,
                                 plan.seq if dims[2] else None, None))

  def logit_rows(self, rest) -> LogitRows | None:
    """The bias and mask among the operands as a strategy takes them (None without)."""
    return logit_rows(self.bias_array(rest), self.mask_array(rest), self.dbias)

  def shardings(self, mesh, plan: _Plan, q_rows) -> tuple:
    """Their shardings: o_error like q; the ids with the batch (and the sequence where a
    strategy runs over it); the slopes with the batch and the query heads; the block mask with
    the batch and the query heads, its block rows with the sequence where a strategy runs."""
    out = (q_rows,) if self.error else ()
    if self.ids:
      out += (NamedSharding(mesh, P(plan.batch, plan.seq)),) * 2
    if self.alibi:
      out += (NamedSharding(mesh, P(plan.batch, plan.q_heads)),)
    if self.blocks:
      out += (NamedSharding(mesh, P(plan.batch, plan.q_heads, plan.seq, None)),)
    if self.dropout:
      out += (NamedSharding(mesh, P(plan.batch, plan.q_heads, None)),)
    out += tuple(self.logit_sharding(mesh, plan, dims) for dims in (self.bias, self.mask)
                 if dims is not None)
    return out


def _fwd_op(extras: _Extras):
  """The partitioned forward taking `extras` after the lengths, its config the static
  argument after them (extras.error: o's rounding error a third result, not an operand)."""
  split, extras = extras.error, dataclasses.replace(extras, error=False)

  def impl(q, k, v, q_lens, kv_lens, *extras_and_config):
    *rest, config = extras_and_config
    _, ids, alibi = extras.split(rest)
    return _ops.flash_fwd(q, k, v, q_lens, kv_lens, config, ids, alibi, extras.block_mask(rest),
                          extras.dropout_seeds(rest), extras.bias_array(rest),
                          extras.mask_array(rest))

  def partition(config, mesh, arg_shapes, result_shape):
    plan = _plan(mesh, arg_shapes, config, blocks=extras.blocks)
    q_rows, kv_rows, lse, lens = _shardings(mesh, plan)

    def lower(q, k, v, q_lens, kv_lens, *rest):
      if plan.seq is not None:
        _, ids, alibi = extras.split(rest)
        # The strategies merge float32 partial outputs: o is split after them.
        whole = dataclasses.replace(config, o_split=False, o_float32=True) if split else config
        o, lse = _context_parallel.sharded_fwd(plan.strategy, q, k, v, q_lens, kv_lens, whole,
                                               ids, alibi, extras.block_mask(rest),
                                               extras.logit_rows(rest),
                                               extras.dropout_seeds(rest), axis_name=plan.seq)
        if not split:
          return o, lse
        o, o_error = _rounding.split_rounding(o, q.dtype)
        return o, lse, o_error
      return impl(q, k, v, q_lens, kv_lens, *rest, config)

    results = (q_rows, lse, q_rows) if split else (q_rows, lse)
    return (mesh, lower, results,
            (q_rows, kv_rows, kv_rows, lens, lens, *extras.shardings(mesh, plan, q_rows)))

  def infer(config, mesh, arg_shapes, result_shape):
    plan = _plan(mesh, arg_shapes, config, blocks=extras.blocks)
    q_rows, _, lse, _ = _shardings(mesh, plan)
    return (q_rows, lse, q_rows) if split else (q_rows, lse)

  inputs = 5 + 2 * extras.ids + extras.alibi + extras.blocks + extras.dropout + extras.trailing
  return _partitioned(impl, inputs,
                      _rule(_FWD_SPLIT_RULE if split else _FWD_RULE, False, extras.ids,
                            extras.alibi, extras.blocks, extras.dropout, extras.bias,
                            extras.mask),
                      partition, infer)


def _bwd_op(extras: _Extras):
  """The partitioned backward taking `extras` after the lengths, its config the static
  argument after them."""

  def impl(q, k, v, o, lse, d_o, q_lens, kv_lens, *extras_and_config):
    *rest, config = extras_and_config
    o_error, ids, alibi = extras.split(rest)
    return _ops.flash_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config, ids, o_error, alibi,
                          extras.block_mask(rest), extras.dropout_seeds(rest),
                          extras.bias_array(rest), extras.mask_array(rest), extras.dbias)

  def partition(config, mesh, arg_shapes, result_shape):
    plan = _plan(mesh, arg_shapes, config, blocks=extras.blocks)
    q_rows, kv_rows, lse, lens = _shardings(mesh, plan)

    def lower(q, k, v, o, lse, d_o, q_lens, kv_lens, *rest):
      if plan.seq is not None:
        o_error, ids, alibi = extras.split(rest)
        if o_error is not None:  # the strategies take o whole, in float32
          o = _rounding.join_rounding(o, o_error)
        dq, dk, dv, *dbias = _context_parallel.sharded_bwd(
            plan.strategy, q, k, v, o, lse, d_o, q_lens, kv_lens, config, ids, alibi,
            extras.block_mask(rest), extras.logit_rows(rest), extras.dropout_seeds(rest),
            axis_name=plan.seq)
        dbias = dbias[0] if dbias else None  # float32: cast below, once summed
      else:
        grads = impl(q, k, v, o, lse, d_o, q_lens, kv_lens, *rest, config)
        (dq, dk, dv), dbias = grads[:3], (grads[3] if extras.dbias else None)
      if plan.q_heads is not None and plan.kv_heads is None:
        # One kv head, query heads split: each device holds the dK/dV of its query heads only.
        dk, dv = jax.lax.psum((dk, dv), plan.q_heads)
      if not extras.dbias:
        return dq, dk, dv
      # A bias replicated over sharded batch, heads or sequence: each device holds its shard's
      # part.
      summed = tuple(axes for axes, full in ((plan.batch, extras.bias[0]),
                                             (plan.q_heads, extras.bias[1]),
                                             (plan.seq, extras.bias[2]))
                     if axes is not None and not full)
      for axes in summed:
        dbias = jax.lax.psum(dbias, axes)
      return dq, dk, dv, dbias.astype(extras.bias_array(rest).dtype)

    return (mesh, lower, _bwd_results(mesh, plan),
            (q_rows, kv_rows, kv_rows, q_rows, lse, q_rows, lens, lens,
             *extras.shardings(mesh, plan, q_rows)))

  def _bwd_results(mesh, plan):
    q_rows, kv_rows, _, _ = _shardings(mesh, plan)
    if not extras.dbias:
      return q_rows, kv_rows, kv_rows
    return q_rows, kv_rows, kv_rows, extras.logit_sharding(mesh, plan, extras.bias)

  def infer(config, mesh, arg_shapes, result_shape):
    plan = _plan(mesh, arg_shapes, config, blocks=extras.blocks)
    return _bwd_results(mesh, plan)

  inputs = (8 + extras.error + 2 * extras.ids + extras.alibi + extras.blocks + extras.dropout
            + extras.trailing)
  return _partitioned(impl, inputs,
                      _rule(_BWD_RULE, extras.error, extras.ids, extras.alibi, extras.blocks,
                            extras.dropout, extras.bias, extras.mask,
                            dbias=extras.dbias),
                      partition, infer)


def _partitioned(impl, inputs: int, rule: str, partition, infer):
  """`impl` under custom_partitioning, its config the static argument after `inputs` arrays."""
  op = custom_partitioning(impl, static_argnums=(inputs,))
  op.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                   need_replication_factors=_WHOLE_FACTORS)
  return op


# Every combination of optional operands, each op made once (on first use).
@functools.cache
def _fwd_op_for(extras: _Extras):
  return _fwd_op(extras)


@functools.cache
def _bwd_op_for(extras: _Extras):
  return _bwd_op(extras)


def _fold_into_batch(axis_size: int, in_batched, args):
  """Every argument with the mapped axis in front (broadcast where unmapped), folded into the
  batch axis: (V, B, ...) -> (V * B, ...)."""
  folded = []
  for x, batched in zip(args, in_batched):
    if not batched:
      x = jnp.broadcast_to(x, (axis_size, *x.shape))
    folded.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
  return folded


def _unfold(axis_size: int, outputs):
  return tuple(x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:]) for x in outputs)


@functools.cache
def _batched_op(partitioned, config: _ops.KernelConfig):
  """partitioned(..., config) as a function of arrays only, with a vmap rule (and, as every
  kernel op, a JVP rule that refuses: see jax_flash._derivatives)."""

  @jax.custom_batching.custom_vmap
  def op(*args):
    return partitioned(*args, config)

  @op.def_vmap
  def op_vmap(axis_size, in_batched, *args):
    outputs = op(*_fold_into_batch(axis_size, in_batched, args))
    return _unfold(axis_size, outputs), tuple(True for _ in outputs)

  return _derivatives.first_order_only(op)


def _full_dims(x):
  """Which dims of a rank-4 bias or mask are not broadcast (None without one)."""
  return None if x is None else tuple(d != 1 for d in x.shape)


def _present(*xs) -> tuple:
  return tuple(x for x in xs if x is not None)


def flash_fwd(q, k, v, q_lens, kv_lens, config: _ops.KernelConfig, segment_ids=None,
              alibi_slopes=None, block_mask=None, dropout_seeds=None, bias=None, mask=None):
  """(o, lse) of the forward kernel ((o, lse, o_error) with config.o_split); q, k, v rank 4,
  lens rank 1, segment_ids None or (q_ids (B, T), kv_ids (B, S)), alibi_slopes None or (B, N)
  float32, block_mask None or (B, N, Tb, Sb) bool, dropout_seeds None or (B, N, SEED_WORDS) uint32,
  bias and mask None or (B|1, N|1, T|1, S|1); partitions and vmaps (vmap folds a bias's mapped
  axis into its batch as q's, and broadcasts an unmapped one along it)."""
  op = _fwd_op_for(_Extras(error=config.o_split, ids=segment_ids is not None,
                           alibi=alibi_slopes is not None, blocks=block_mask is not None,
                           dropout=dropout_seeds is not None, bias=_full_dims(bias),
                           mask=_full_dims(mask)))
  return _batched_op(op, config)(q, k, v, q_lens, kv_lens, *(segment_ids or ()),
                                 *_present(alibi_slopes, block_mask, dropout_seeds, bias, mask))


def flash_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config: _ops.KernelConfig,
              segment_ids=None, o_error=None, alibi_slopes=None, block_mask=None,
              dropout_seeds=None, bias=None, mask=None, dbias=True):
  """(dq, dk, dv) of the backward kernels, and dbias last where a `bias` is given and `dbias`
  asks for it; partitions and vmaps like flash_fwd. `o_error`: None, or the int8 rounding error
  of a 16-bit o (CUDA; jax_flash._rounding)."""
  op = _bwd_op_for(_Extras(o_error is not None, segment_ids is not None,
                           alibi_slopes is not None, block_mask is not None,
                           dropout_seeds is not None, _full_dims(bias), _full_dims(mask),
                           dbias=bias is not None and dbias))
  operands = (q, k, v, o, lse, d_o, q_lens, kv_lens, *_present(o_error),
              *tuple(segment_ids or ()),
              *_present(alibi_slopes, block_mask, dropout_seeds, bias, mask))
  return _batched_op(op, config)(*operands)
