"""Context parallelism: which strategy runs attention over a sharded sequence, and running it.

Three strategies, each over one mesh axis (or a tuple of axes) of P devices:

* ``"ring"`` (jax_flash._ring): K/V blocks travel around the devices by collective-permute,
  partial results merge through their log-sum-exps. Memory per device O(L/P); communication
  2(P-1) K/V slices forward, twice that backward, overlappable with compute. No local windows;
  causal only with T == S.
* ``"all_to_all"`` (jax_flash._all_to_all, DeepSpeed-Ulysses): sequence slices of every head
  become the whole sequence of a slice of the heads; the kernel runs unchanged. Communication:
  q, k, v and o once each by all-to-all, whatever P. Needs the query heads on each device to
  split over P (kv heads are repeated as needed). Takes every mask.
* ``"all_gather"`` (jax_flash._all_gather): each device keeps its queries and gathers K/V.
  Memory per device O(S) for K/V. Takes every mask and T != S.

Under ``jax.jit`` the caller's sequence is contiguous (device r holds rows [rL, (r+1)L)). Under
a causal mask that gives device r the work of r + 1/2 blocks (2P-1 times device 0's on device
P-1); the zig-zag layout
balances it, and the partitioned op moves the slices into it and back itself (two
collective-permutes of half a slice each per operand, :mod:`jax_flash._chunks`): the user's
data layout is unchanged. Inside ``jax.shard_map`` (``context_parallel_attention``) the caller
chooses the layout and holds the data in it; nothing is moved.

The automatic choice (``context_parallel=None``) is provisional, a rule from what each strategy
can run and from the one measurement made so far (the ring on two H200s, README); it is to be
revisited with measurements of all three on GPUs:

1. ``"ring"`` where it can run (no window; causal only with T == S), balanced by the zig-zag
   layout when causal (and the sequence splits into 2P chunks): the smallest memory, and its
   communication overlaps compute;
2. else ``"all_to_all"`` where the heads split over the axis: every mask, work balanced;
3. else ``"all_gather"`` (causal without a window balanced by zig-zag queries);
4. else (the sequence does not split over the axis) no strategy: the sequence is gathered and
   the op runs on it whole.

ALiBi slopes ((B, N), per head) go with every strategy too: the all-to-all takes its head
slice's slopes; the ring and the all-gather move each block's lse by the slope times the offset
of its slices' positions (jax_flash._reference.alibi_lse_shift).

Segment ids (packed documents) go with every strategy: sharded like their operands' sequence,
moved with them by the zig-zag relayout; the ring passes the key-side ids around with K/V, the
all-gather gathers them with K/V, the all-to-all gathers both sides' ids whole (they are per
position, not per head) by all-to-all.

jax.nn's bias and mask arrays ((B|1, N|1, T|1, S|1)) go with every strategy: each device holds
the rows of its own queries (under jax.jit sharded and moved by the zig-zag relayout like them,
where the array has the query dim; inside shard_map passed so) with every key's column
(jax_flash._logit_rows), and the bias's gradient comes back in the same rows. Nothing of them
travels in the ring and the all-gather; the all-to-all sends them with the queries.

Fused dropout goes with every strategy: the all-to-all's kernel sees the whole sequence of its
heads and takes those heads' seeds; the ring's and the all-gather's kernels see slices and take
the seeds moved to their slices' first row and key (jax_flash._dropout.at_offset), which must
start 16-row and 16-key groups of the decisions' layout (_dropout_problem). Every strategy drops
what one device drops.

Block masks (block-sparse attention: one bool per 128 x 128 block, jax_flash.BLOCK_MASK_BLOCK)
go with every strategy where the shards are whole blocks: each device holds the block rows of its
own queries (sharded and moved by the zig-zag relayout like the queries), with every key block's
column in the sequence's order (B, N, L/128, S/128). The ring cuts each visiting K/V chunk's
columns from them (nothing travels; a pair the mask hides whole is skipped), the all-gather each
query slice's key range, the all-to-all sends them with the queries (heads split, rows
gathered). The rule (_block_mask_problem): each device's query slice, in the zig-zag layout each
of its two chunks, is a multiple of 128 rows; for the ring the key slices (chunks) too; for the
all-gather a window's left size is a multiple of 128 (its key ranges start on a block). Where no
strategy and layout meets it, the automatic choice gathers the sequence (as without a strategy),
and a requested strategy raises.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_flash import (_all_gather, _all_to_all, _derivatives, _dispatch, _dropout, _ops,
                       _ring, _validation)
from jax_flash._logit_rows import ROWS, LogitRows, full, logit_rows
from jax_flash._block_sparse import BLOCK_MASK_BLOCK
from jax_flash._chunks import contiguous_to_zigzag, zigzag_to_contiguous

STRATEGIES = ("ring", "all_to_all", "all_gather")
# What dot_product_attention's `context_parallel` takes (None: the automatic choice).
REQUESTS = ("ring", "ring:contiguous", "ring:zigzag", "all_to_all", "all_gather",
            "all_gather:contiguous", "all_gather:zigzag")


def check_request(context_parallel) -> None:
  """Raises ValueError unless `context_parallel` is None or one of REQUESTS."""
  if context_parallel is not None and context_parallel not in REQUESTS:
    raise ValueError(f"context_parallel must be None (automatic) or one of {REQUESTS}; got "
                     f"{context_parallel!r}")


@dataclasses.dataclass(frozen=True)
class Strategy:
  """How a sequence-sharded call runs: `name` of STRATEGIES, computing in `layout`; with
  `relayout` the caller's contiguous slices are moved into it (and the results back)."""
  name: str
  layout: str = "contiguous"
  relayout: bool = False


def _why_not(name: str, *, num: int, seq_q: int, seq_k: int, heads_q: int,
             config: _ops.KernelConfig) -> str | None:
  """Why strategy `name` cannot run this call over `num` devices (None: it can)."""
  if seq_q % num or seq_k % num:
    return (f"the query and key lengths ({seq_q}, {seq_k}) must split over the {num} devices "
            "of the sequence axis")
  windowed = config.window_left >= 0 or config.window_right >= 0
  if name == "ring":
    if windowed:
      return "the ring takes no local window (use 'all_to_all' or 'all_gather')"
    if config.is_causal and seq_q != seq_k:
      return (f"the causal ring needs equal query and key lengths; got T={seq_q}, S={seq_k} "
              "(use 'all_to_all' or 'all_gather')")
  if name == "all_to_all" and heads_q % num:
    return (f"all_to_all needs the query heads on each device ({heads_q}) to split over the "
            f"{num} devices of the sequence axis")
  return None


def _slices_problem(name: str, layout: str, *, num: int, seq_q: int, seq_k: int,
                    config: _ops.KernelConfig, what: str, rows: int, keys: int,
                    unit: str) -> str | None:
  """Why the slices of strategy `name` in `layout` over `num` devices do not start on the
  `rows` x `keys` units (`unit`: "blocks", "groups") that `what` needs (None: they do; the
  lengths split over the devices, and in the zig-zag layout into 2 `num` chunks): each
  device's query slice (each zig-zag chunk), the ring's key slices (the K/V chunks), the
  all-gather's key ranges (_all_gather.key_ranges_aligned: a window's left size cuts them)."""
  parts = 2 if layout == "zigzag" else 1
  where = "zig-zag chunk" if parts == 2 else "slice"
  slice_rows, slice_keys = seq_q // (num * parts), seq_k // (num * parts)
  if slice_rows % rows:
    return (f"{what} needs each device's query {where} to be whole {rows}-row {unit}; "
            f"T={seq_q} over {num} devices ({layout}) gives {slice_rows} rows")
  if name == "ring" and slice_keys % keys:
    return (f"the ring with {what} needs each device's key {where} to be whole {keys}-key "
            f"{unit}; S={seq_k} over {num} devices ({layout}) gives {slice_keys} keys")
  if name == "all_gather" and not _all_gather.key_ranges_aligned(config, num, layout, seq_q,
                                                                 seq_k, keys):
    return (f"the all-gather with {what} needs each query slice's key range to start on "
            f"whole {keys}-key {unit}: the left size of local_window_size "
            f"({config.window_left}) must be a multiple of {keys}")
  return None


def _block_mask_problem(name: str, layout: str, *, num: int, seq_q: int, seq_k: int,
                        config: _ops.KernelConfig) -> str | None:
  """Why strategy `name` in `layout` cannot carry a block mask over `num` devices (None: it
  can). Each device holds the block rows of its queries, so its query slice must be whole
  blocks; the ring cuts the columns of each K/V chunk, the all-gather each key range, so
  those must start on blocks too."""
  return _slices_problem(name, layout, num=num, seq_q=seq_q, seq_k=seq_k, config=config,
                         what="a block_mask", rows=BLOCK_MASK_BLOCK[0], keys=BLOCK_MASK_BLOCK[1],
                         unit="blocks")


def _dropout_problem(name: str, layout: str, *, num: int, seq_q: int, seq_k: int,
                     config: _ops.KernelConfig) -> str | None:
  """Why strategy `name` in `layout` cannot carry fused dropout over `num` devices (None: it
  can). The all-to-all's kernel sees the whole sequence of its heads. The ring's and the
  all-gather's kernels see slices: each takes the seeds moved to its slice's first row and key
  (jax_flash._dropout.at_offset), which must start 16 x 16 groups of the decisions' layout."""
  if name == "all_to_all":
    return None
  multiple = _dropout.OFFSET_MULTIPLE
  return _slices_problem(name, layout, num=num, seq_q=seq_q, seq_k=seq_k, config=config,
                         what=f"dropout_rate={config.dropout_rate!r}", rows=multiple,
                         keys=multiple, unit="groups")


def _zigzag_fits(name: str, num: int, seq_q: int, seq_k: int) -> bool:
  if num < 2 or seq_q % (2 * num):
    return False
  return name == "all_gather" or seq_k % (2 * num) == 0


def choose(request: str | None, *, num: int, seq_q: int, seq_k: int, heads_q: int,
           config: _ops.KernelConfig, block_mask: bool = False) -> Strategy | None:
  """The strategy of a call partitioned under jax.jit (see the module docstring for the
  automatic rule). `heads_q` are the query heads on each device of the sequence axis. A
  requested strategy that cannot run raises ValueError; the automatic choice returns None
  when none can (the caller then gathers the sequence). With `block_mask` only strategies and
  layouts that can carry it count (_block_mask_problem), and with dropout
  (config.dropout_rate) those that can carry that (_dropout_problem)."""
  check_request(request)
  facts = dict(num=num, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, config=config)

  def problem(name: str, layout: str = "contiguous") -> str | None:
    found = _why_not(name, **facts)
    if found is None and block_mask:
      found = _block_mask_problem(name, layout, num=num, seq_q=seq_q, seq_k=seq_k,
                                  config=config)
    if found is None and config.dropout_rate:
      found = _dropout_problem(name, layout, num=num, seq_q=seq_q, seq_k=seq_k, config=config)
    return found

  if request is None:
    names = [n for n in STRATEGIES if problem(n) is None]
    if not names:
      return None
    name, layout = names[0], None
  else:
    name, _, layout = request.partition(":")
    found = problem(name)
    if found:
      raise ValueError(f"context_parallel={request!r} cannot run this call: {found}")
    layout = layout or None
  if name == "all_to_all":
    return Strategy(name)
  if layout is None:  # balance causal work where the sequence splits into 2P chunks
    balanced = config.is_causal and config.window_left < 0
    zigzag = (balanced and _zigzag_fits(name, num, seq_q, seq_k)
              and problem(name, "zigzag") is None)
    layout = "zigzag" if zigzag else "contiguous"
  elif layout == "zigzag":
    if not _zigzag_fits(name, num, seq_q, seq_k):
      raise ValueError(f"context_parallel={request!r} needs the sequence lengths (T={seq_q}, "
                       f"S={seq_k}) to be multiples of 2 x {num} devices")
    found = problem(name, "zigzag")
    if found:
      raise ValueError(f"context_parallel={request!r} cannot run this call: {found}")
  return Strategy(name, layout, relayout=layout == "zigzag")


_FORWARD = {"ring": _ring.ring_fwd, "all_to_all": _all_to_all.all_to_all_fwd,
            "all_gather": _all_gather.all_gather_fwd}
_BACKWARD = {"ring": _ring.ring_bwd, "all_to_all": _all_to_all.all_to_all_bwd,
             "all_gather": _all_gather.all_gather_bwd}


def _moved(strategy: Strategy, kv: bool) -> bool:
  """Whether the relayout moves these operands: queries always, K/V for the ring only (the
  all-gather gathers K/V in whatever layout they are)."""
  return strategy.relayout and (not kv or strategy.name == "ring")


def _kv_layout(strategy: Strategy) -> str:
  """The layout K/V are in when the strategy runs (the caller's where they were not moved)."""
  return "contiguous" if strategy.relayout and not _moved(strategy, kv=True) else strategy.layout


def _options(strategy: Strategy, axis_name, alibi_slopes, block_mask, logits,
             dropout_seeds) -> dict:
  """A strategy's keyword arguments (the all-gather's also its K/V layout)."""
  options = dict(axis_name=axis_name, layout=strategy.layout, alibi_slopes=alibi_slopes,
                 block_mask=block_mask, logits=logits, dropout_seeds=dropout_seeds)
  if strategy.name == "all_gather":
    options["kv_layout"] = _kv_layout(strategy)
  return options


def _run_fwd(strategy: Strategy, q, k, v, q_lens, kv_lens, config, axis_name,
             segment_ids=None, alibi_slopes=None, block_mask=None, logits=None,
             dropout_seeds=None):
  return _FORWARD[strategy.name](q, k, v, q_lens, kv_lens, config, segment_ids,
                                 **_options(strategy, axis_name, alibi_slopes, block_mask,
                                            logits, dropout_seeds))


def _run_bwd(strategy: Strategy, q, k, v, o, lse, d_o, q_lens, kv_lens, config, axis_name,
             segment_ids=None, alibi_slopes=None, block_mask=None, logits=None,
             dropout_seeds=None):
  return _BACKWARD[strategy.name](q, k, v, o, lse, d_o, q_lens, kv_lens, config, segment_ids,
                                  **_options(strategy, axis_name, alibi_slopes, block_mask,
                                             logits, dropout_seeds))


def _relayout_ids(strategy: Strategy, segment_ids, axis_name):
  """The segment ids moved as their operands are: the query ids with the queries, the key ids
  with K/V."""
  if segment_ids is None or not strategy.relayout:
    return segment_ids
  q_ids, kv_ids = segment_ids
  if _moved(strategy, kv=True):
    return contiguous_to_zigzag((q_ids, kv_ids), axis_name, (1, 1))
  (q_ids,) = contiguous_to_zigzag((q_ids,), axis_name, (1,))
  return q_ids, kv_ids


def _relayout_blocks(strategy: Strategy, block_mask, axis_name):
  """The block mask's rows (B, N, L/128, S/128) moved as the queries are (its columns are every
  key block's, in the sequence's order, whatever the layout)."""
  if block_mask is None or not strategy.relayout:
    return block_mask
  (block_mask,) = contiguous_to_zigzag((block_mask,), axis_name, (2,))
  return block_mask


def _relayout_logits(strategy: Strategy, logits: LogitRows | None, axis_name):
  """The bias and mask rows moved as the queries are, where they have the query dim."""
  if logits is None or not strategy.relayout:
    return logits

  def moved(x):
    if x is None or not full(x, ROWS):
      return x
    (x,) = contiguous_to_zigzag((x,), axis_name, (ROWS,))
    return x

  return dataclasses.replace(logits, bias=moved(logits.bias), mask=moved(logits.mask))


def sharded_fwd(strategy: Strategy, q, k, v, q_lens, kv_lens, config: _ops.KernelConfig,
                segment_ids=None, alibi_slopes=None, block_mask=None, logits=None,
                dropout_seeds=None, *, axis_name):
  """(o, lse) of `strategy` over contiguous slices (a partitioned lowering's operands; the
  segment ids None or (q_ids, kv_ids) slices; the ALiBi slopes None or (B, N), per head, never
  moved; the block mask None or the block rows of the query slice, every key block's column;
  the bias and mask None or a LogitRows of the query slice's rows, every key's column; the
  dropout seeds None or (B, N, SEED_WORDS), per head, never moved): moved into the strategy's
  layout and back where it asks for that."""
  if _moved(strategy, kv=True):
    q, k, v = contiguous_to_zigzag((q, k, v), axis_name, (1, 1, 1))
  elif _moved(strategy, kv=False):
    (q,) = contiguous_to_zigzag((q,), axis_name, (1,))
  segment_ids = _relayout_ids(strategy, segment_ids, axis_name)
  block_mask = _relayout_blocks(strategy, block_mask, axis_name)
  logits = _relayout_logits(strategy, logits, axis_name)
  o, lse = _run_fwd(strategy, q, k, v, q_lens, kv_lens, config, axis_name, segment_ids,
                    alibi_slopes, block_mask, logits, dropout_seeds)
  if strategy.relayout:
    o, lse = zigzag_to_contiguous((o, lse), axis_name, (1, 2))
  return o, lse


def sharded_bwd(strategy: Strategy, q, k, v, o, lse, d_o, q_lens, kv_lens,
                config: _ops.KernelConfig, segment_ids=None, alibi_slopes=None, block_mask=None,
                logits=None, dropout_seeds=None, *, axis_name):
  """(dq, dk, dv) of sharded_fwd; where `logits` asks for the bias's gradient, (dq, dk, dv,
  dbias), dbias float32 over the query slice's bias rows (contiguous again)."""
  if strategy.relayout:
    q, o, d_o, lse = contiguous_to_zigzag((q, o, d_o, lse), axis_name, (1, 1, 1, 2))
  if _moved(strategy, kv=True):
    k, v = contiguous_to_zigzag((k, v), axis_name, (1, 1))
  segment_ids = _relayout_ids(strategy, segment_ids, axis_name)
  block_mask = _relayout_blocks(strategy, block_mask, axis_name)
  logits = _relayout_logits(strategy, logits, axis_name)
  dq, dk, dv, *dbias = _run_bwd(strategy, q, k, v, o, lse, d_o, q_lens, kv_lens, config,
                                axis_name, segment_ids, alibi_slopes, block_mask, logits,
                                dropout_seeds)
  if _moved(strategy, kv=True):
    dq, dk, dv = zigzag_to_contiguous((dq, dk, dv), axis_name, (1, 1, 1))
  elif strategy.relayout:
    (dq,) = zigzag_to_contiguous((dq,), axis_name, (1,))
  if dbias and strategy.relayout and full(dbias[0], ROWS):
    dbias = list(zigzag_to_contiguous((dbias[0],), axis_name, (2,)))
  return (dq, dk, dv, *dbias)


# ---- inside shard_map ---------------------------------------------------------------------------


# segment_ids: None or this device's (q_ids, kv_ids); alibi: None or the slopes (B, N) float32;
# dropout_seeds: None or (B, N, SEED_WORDS) uint32 (jax_flash._dropout.seeds, this device's
# batch and heads), exactly when config.dropout_rate > 0;
# block_mask: None or this device's block rows (B, N, L/128, S/128). Like the lengths, not
# differentiated. bias, mask: None or this device's rows of them (B|1, N|1, L|1, S|1); the bias
# differentiated where something differentiates it (symbolic zeros: `perturbed`, as in
# _attention._flash_attention), the mask not.
@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12, 13))
def _attention(q, k, v, q_lens, kv_lens, segment_ids, alibi, block_mask, bias, mask,
               dropout_seeds, config, strategy, axis_name):
  return _run_fwd(strategy, q, k, v, q_lens, kv_lens, config, axis_name, segment_ids, alibi,
                  block_mask, logit_rows(bias, mask), dropout_seeds)


def _attention_fwd(q, k, v, q_lens, kv_lens, segment_ids, alibi, block_mask, bias, mask,
                   dropout_seeds, config, strategy, axis_name):
  wants_dbias = _derivatives.wants_gradient(bias)
  q, k, v, q_lens, kv_lens, segment_ids, alibi, block_mask, bias, mask, dropout_seeds = (
      _derivatives.primal_values((q, k, v, q_lens, kv_lens, segment_ids, alibi, block_mask,
                                  bias, mask, dropout_seeds)))
  # The output in float32 for the backward, as dot_product_attention's forward keeps it.
  out32, lse = _run_fwd(strategy, q, k, v, q_lens, kv_lens, _ops.for_backward(config),
                        axis_name, segment_ids, alibi, block_mask, logit_rows(bias, mask),
                        dropout_seeds)
  return (out32.astype(q.dtype), lse), (q, k, v, q_lens, kv_lens, segment_ids, alibi,
                                        block_mask, bias, mask, dropout_seeds, out32, lse,
                                        wants_dbias)


def _unvarying_like(gradient, x):
  """`gradient` summed over the mesh axes it varies over and `x` does not: the gradient of an
  input each device holds the same of (inside shard_map, an unvarying bias) is the devices'
  sum, typed as the input is."""
  missing = tuple(sorted(_ring._varying_axes(gradient) - _ring._varying_axes(x)))
  return jax.lax.psum(gradient, missing) if missing else gradient


def _attention_bwd(config, strategy, axis_name, residuals, cotangents):
  (q, k, v, q_lens, kv_lens, segment_ids, alibi, block_mask, bias, mask, dropout_seeds, out, lse,
   wants_dbias) = residuals
  d_out, _ = cotangents  # lse leaves under stop_gradient
  dq, dk, dv, *dbias = _run_bwd(strategy, q, k, v, out, lse,
                                _derivatives.cotangent_array(d_out), q_lens, kv_lens, config,
                                axis_name, segment_ids, alibi, block_mask,
                                logit_rows(bias, mask, dbias=bool(wants_dbias)), dropout_seeds)
  dbias = _unvarying_like(dbias[0], bias).astype(bias.dtype) if dbias else None
  if dbias is not None and bias.shape[-1] == 1:
    dbias = _ops.row_bias_gradient(dbias)
  return dq, dk, dv, None, None, None, None, None, dbias, None, None


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def context_parallel_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, *, axis_name, strategy: str = "ring",
    layout: str = "contiguous", scale: float | None = None, is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None, deterministic: bool = False,
    return_residual: bool = False, q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    block_mask: jax.Array | None = None, logits_soft_cap: float | None = None,
    alibi_slopes: jax.Array | None = None, bias: jax.Array | None = None,
    mask: jax.Array | None = None, dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention over a sequence sharded along `axis_name`, for use inside ``jax.shard_map``.

  Args:
    query, key, value: this device's slices, ``(B, T/P, N, H)`` and ``(B, S/P, K, H)``, held
      in `layout`; rank 4.
    axis_name: the mesh axis (or tuple of axes) the sequence is sharded over (P devices).
    strategy: ``"ring"`` (K/V blocks passed around by collective-permute; no local window,
      causal only with T == S), ``"all_to_all"`` (DeepSpeed-Ulysses: all-to-all to head
      slices of the whole sequence and back; the N query heads on this device must split over
      P; kv heads that do not are repeated) or ``"all_gather"`` (K/V gathered, queries kept).
    layout: ``"contiguous"`` (device r holds rows [rL, (r+1)L)) or ``"zigzag"`` (chunks r and
      2P-1-r of 2P: equal causal work on every device; see ``jax_flash.zigzag_indices``).
    query_seq_lengths, key_value_seq_lengths: global lengths ``(B,)`` int32.
    local_window_size: as in ``dot_product_attention``, global positions; not with "ring".
    q_segment_ids, kv_segment_ids: this device's slices ``(B, T/P)``, ``(B, S/P)`` int32 of
      the packed documents' ids (as in ``dot_product_attention``), in `layout`; both or
      neither.
    block_mask: block-sparse attention (as in ``dot_product_attention``): this device's block
      rows, bool broadcastable to ``(B, N, L / 128, ceil(S / 128))`` (blocks of
      ``jax_flash.BLOCK_MASK_BLOCK`` = (128, 128); L = T/P this device's query rows): the rows
      of its query blocks, in `layout` (zig-zag: the whole mask's rows
      ``jax_flash.zigzag_indices(T // 128, P)`` sharded like the queries), and every key
      block's column, in the sequence's order. Each device's query slice (zig-zag: each chunk)
      must be whole 128-row blocks, with "ring" its key slice (chunks) too, with "all_gather"
      a window's left size a multiple of 128; else ValueError.
    logits_soft_cap, alibi_slopes: as in ``dot_product_attention`` (the slopes ``(N,)``, one
      per query head, positions the global ones: each block's kernel is handed its slices'
      offset); on the kernels that take them ("cpu" today).
    bias, mask: jax.nn's arrays (as in ``dot_product_attention``), this device's rows of them:
      broadcastable to ``(B, N, L, S)`` (each dim 1 or full; L = T/P this device's query rows,
      in `layout`; every key's column, in the sequence's order). Nothing of them travels in
      "ring" and "all_gather"; "all_to_all" sends them with the queries. The bias is
      differentiable: its gradient comes back over the same rows (a bias each device holds
      the same of, unvarying, gets the devices' sum). On the "cuda" kernels (experimental:
      JAX_FLASH_CUDA_LOGIT_ARRAYS=on) the blocks a mask hides whole are skipped, carried as a
      block mask is: a mask there needs the slices a block_mask needs (else
      ``NotImplementedError``).
    dropout_rate, dropout_key: fused dropout, as in ``dot_product_attention``: the decision of
      query row ``i`` and key ``j`` (global positions) of batch element ``b`` and query head
      ``h`` of this device's slices (numbered from 0 on each device, as under ``vmap``) is
      ``jax_flash._dropout.keep_mask(key, dropout_rate, B, N, T, S)[b, h, i, j]``, so the
      devices drop what one device over the whole sequence drops. ``key`` is `dropout_key`
      where the query varies over no mesh axis but `axis_name`'s; where it varies over others
      too (a data axis sharding the batch, a tensor axis the heads), ``jax.random.fold_in(
      dropout_key, i)`` with i this device's index along those axes (row-major, by name), so
      that the shards draw masks of their own. "ring" and
      "all_gather" need the slices to start dropout's 16 x 16 groups (each query slice,
      zig-zag chunk, a multiple of 16 rows; the ring's key slices a multiple of 16 keys; with
      "all_gather" a window's left size a multiple of 16 where it cuts the key ranges); else
      ValueError naming ``dropout_rate``.
    The other arguments are those of ``jax_flash.dot_product_attention`` on its kernels
    (``implementation`` None, "cpu" or "cuda").

  Returns:
    This device's slice of the output (and of the log-sum-exp, ``(B, T/P, N)`` float32, with
    ``return_residual``), in `layout`. Differentiable once, in reverse mode.
  """
  query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  _validation.check_qkv(query, key, value)
  if query.ndim != 4:
    raise ValueError("context_parallel_attention takes rank-4 slices (B, T, N, H); got "
                     f"query{query.shape}")
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")
  if layout not in _ring.LAYOUTS:
    raise ValueError(f"layout must be one of {_ring.LAYOUTS}; got {layout!r}")
  batch, rows_q, heads_q, _ = query.shape
  rows_k = key.shape[1]
  num = jax.lax.axis_size(axis_name)
  parts = 1 if layout == "contiguous" else 2
  if rows_q % parts or rows_k % parts:
    raise ValueError(f"the zigzag layout holds two chunks per device: query{query.shape} and "
                     f"key{key.shape} need even sequence slices")
  seq_q, seq_k = rows_q * num, rows_k * num
  window = _validation.check_window(local_window_size, seq_q + seq_k)
  window_left, window_right = window if window is not None else (-1, -1)
  probe = _ops.KernelConfig("cpu", 1.0, bool(is_causal), window_left, window_right)
  problem = _why_not(strategy, num=num, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, config=probe)
  if problem:
    raise ValueError(f"strategy={strategy!r} cannot run query{query.shape}, key{key.shape} "
                     f"over {num} devices: {problem}")
  masks = _dispatch.mask_forms(
      is_causal=bool(is_causal), local_window=window is not None,
      seq_lengths=query_seq_lengths is not None or key_value_seq_lengths is not None)
  caller = "jax_flash.context_parallel_attention"
  segment_ids = _validation.check_segment_ids(q_segment_ids, kv_segment_ids, batch, rows_q,
                                              rows_k, False)
  blocks_passed = None if block_mask is None else jnp.shape(block_mask)
  block_mask = _validation.check_block_mask(block_mask, batch, heads_q, rows_q, seq_k, False,
                                            query.shape, (batch, seq_k, *key.shape[2:]))
  if block_mask is not None:
    problem = _block_mask_problem(strategy, layout, num=num, seq_q=seq_q, seq_k=seq_k,
                                  config=probe)
    if problem:
      raise ValueError(f"strategy={strategy!r} in layout={layout!r} cannot run query"
                       f"{query.shape}, key{key.shape} over {num} devices: {problem}")
  return _run_in_shard_map(
      Strategy(strategy, layout), query, key, value, axis_name=axis_name, caller=caller,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
      masks=masks, seq_q=seq_q, seq_k=seq_k, scale=scale, is_causal=is_causal,
      window_left=window_left, window_right=window_right, implementation=implementation,
      deterministic=deterministic, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
      segment_id_shapes=None if segment_ids is None else (jnp.shape(q_segment_ids),
                                                          jnp.shape(kv_segment_ids)),
      block_mask=block_mask, blocks_passed=blocks_passed, return_residual=return_residual,
      bias=bias, mask=mask, dropout_rate=dropout_rate, dropout_key=dropout_key)


def _key_of_this_shard(key, query, axis_name):
  """The dropout key of this device's batch and heads: `key` as it is where the query varies
  over no mesh axis but the sequence's (every device holds the whole batch and every head, so
  each drops what one device drops), else folded (jax.random.fold_in) with this device's index
  along the others (say a data axis sharding the batch): there the kernels number the batch and
  heads from 0 on each device, and the shards must not draw the same masks."""
  sequence = set(axis_name) if isinstance(axis_name, (tuple, list)) else {axis_name}
  others = sorted(_ring._varying_axes(query) - sequence)
  if not others:
    return key
  index = jnp.int32(0)
  for name in others:
    index = index * jax.lax.axis_size(name) + jax.lax.axis_index(name)
  return jax.random.fold_in(key, index)


def _run_in_shard_map(plan: Strategy, query, key, value, *, axis_name, caller: str, masks,
                      seq_q: int, seq_k: int, scale, is_causal, window_left: int,
                      window_right: int, implementation, deterministic, query_seq_lengths,
                      key_value_seq_lengths, segment_ids, segment_id_shapes, block_mask,
                      blocks_passed, return_residual, logits_soft_cap=None, alibi_slopes=None,
                      bias=None, mask=None, dropout_rate=None, dropout_key=None):
  """What context_parallel_attention and ring_attention do once their own arguments are
  checked: the soft cap, the ALiBi slopes, the bias and mask rows and dropout checked (dropout
  against `plan`'s slices: _dropout_problem), the implementation chosen, the global lengths
  checked (full where absent), `plan` run on the kernels (through _ops.call_kernels: scale,
  padding) with _attention's VJP."""
  batch, rows_q, heads_q, head_dim = query.shape
  num = jax.lax.axis_size(axis_name)
  dropout_rate = _validation.check_dropout_rate(dropout_rate)
  dropout_key = _validation.check_dropout_key(dropout_key, dropout_rate)
  probe = _ops.KernelConfig("cpu", 1.0, bool(is_causal), window_left, window_right,
                            dropout_rate=dropout_rate or 0.0)
  if dropout_rate is not None:
    problem = _dropout_problem(plan.name, plan.layout, num=num, seq_q=seq_q, seq_k=seq_k,
                               config=probe)
    if problem:
      raise ValueError(f"{caller} with strategy={plan.name!r} in layout={plan.layout!r} cannot "
                       f"run query{query.shape}, key{key.shape} over {num} devices: {problem}")
  bias = _validation.check_logit_array("bias", bias, batch, heads_q, rows_q, seq_k)
  mask = _validation.check_logit_array("mask", mask, batch, heads_q, rows_q, seq_k)
  logits_soft_cap = _validation.check_logits_soft_cap(logits_soft_cap)
  alibi_slopes = _validation.check_alibi_slopes(alibi_slopes, heads_q, query.shape)
  implementation = _dispatch.select(
      implementation, _dispatch.Call(
          query.shape, query.dtype, mask_forms=masks, deterministic=deterministic, ring=True,
          segment_ids=segment_id_shapes, block_mask=blocks_passed,
          logits_soft_cap=logits_soft_cap,
          alibi_slopes=None if alibi_slopes is None else alibi_slopes.shape,
          value=None if value.shape[-1] == head_dim else value.shape,
          bias=None if bias is None else bias.shape, mask=None if mask is None else mask.shape,
          dropout_rate=dropout_rate),
      caller=caller)
  if mask is not None and implementation == "cuda":
    # The CUDA kernels skip the blocks a mask hides whole: call_kernels adds them to the block
    # mask, whose rows the strategy then carries as it carries a caller's.
    problem = _block_mask_problem(plan.name, plan.layout, num=num, seq_q=seq_q, seq_k=seq_k,
                                  config=probe)
    if problem:
      raise NotImplementedError(f"{caller}: a mask on the 'cuda' kernels inside shard_map goes "
                                f"with the blocks it hides, as a block_mask does: {problem}")
  q_lens = _validation.check_seq_lengths("query_seq_lengths", query_seq_lengths, batch, seq_q)
  kv_lens = _validation.check_seq_lengths("key_value_seq_lengths", key_value_seq_lengths, batch,
                                          seq_k)
  if q_lens is None:
    q_lens = jnp.full((batch,), seq_q, jnp.int32)
  if kv_lens is None:
    kv_lens = jnp.full((batch,), seq_k, jnp.int32)

  dropout_seeds = None
  if dropout_rate is not None:  # (this device's batch and heads, numbered from 0)
    dropout_key = _key_of_this_shard(dropout_key, query, axis_name)
    dropout_seeds = _dropout.seeds(dropout_key, batch, heads_q)

  def attention(q, k, v, q_lens, kv_lens, config, segment_ids=None, alibi=None,
                block_mask=None, bias=None, mask=None, dropout_seeds=None):
    return _attention(q, k, v, q_lens, kv_lens, segment_ids, alibi, block_mask, bias, mask,
                      dropout_seeds, config, plan, axis_name)

  out, lse = _ops.call_kernels(
      attention, query, key, value, q_lens, kv_lens, implementation=implementation,
      scale=_validation.check_scale(scale, head_dim), is_causal=bool(is_causal),
      window_left=window_left, window_right=window_right, deterministic=deterministic,
      caller=caller, segment_ids=segment_ids, block_mask=block_mask,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, bias=bias, mask=mask,
      mask_keys=seq_k, dropout_rate=dropout_rate, dropout_seeds=dropout_seeds)
  lse = jax.lax.stop_gradient(lse)
  return (out, jnp.swapaxes(lse, -1, -2)) if return_residual else out


def ring_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, *, axis_name, layout: str = "contiguous",
    scale: float | None = None, is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None, key_value_seq_lengths: jax.Array | None = None,
    implementation: str | None = None, deterministic: bool = False,
    return_residual: bool = False, q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    block_mask: jax.Array | None = None, logits_soft_cap: float | None = None,
    alibi_slopes: jax.Array | None = None, bias: jax.Array | None = None,
    mask: jax.Array | None = None, dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Ring attention over a sequence sharded along `axis_name`, for use inside ``jax.shard_map``
  (``context_parallel_attention`` with ``strategy="ring"``, which this runs).

  Args:
    query, key, value: this device's slices, ``(B, T/P, N, H)`` and ``(B, S/P, K, H)``, in the
      `layout` ("contiguous" or "zigzag", see ``zigzag_indices``); rank 4.
    axis_name: the mesh axis the sequence is sharded over (P devices).
    query_seq_lengths, key_value_seq_lengths: global lengths ``(B,)``.
    q_segment_ids, kv_segment_ids: this device's slices ``(B, T/P)`` and ``(B, S/P)`` int32 of
      the packed documents' ids (as in ``dot_product_attention``), in `layout`; the key-side
      ids travel around the ring with K/V.
    block_mask: block-sparse attention, this device's block rows as
      ``context_parallel_attention`` takes them: bool broadcastable to ``(B, N, L / 128,
      ceil(S / 128))`` (L = T/P), the rows of its query blocks in `layout` and every key
      block's column in the sequence's order; each device's query and key slices (zig-zag:
      each chunk) must be whole 128-row (128-key) blocks, else ValueError. Nothing of it
      travels.
    logits_soft_cap, alibi_slopes: as in ``dot_product_attention`` (global positions for the
      slopes); on the kernels that take them ("cpu" today).
    The other arguments are those of ``jax_flash.dot_product_attention``, on its kernels
    (``implementation`` None, "cpu" or "cuda", checked and padded as there); with
    ``is_causal`` the global query and key positions must coincide (T == S). Local windows
    are not supported here (``context_parallel_attention`` runs windows with its other
    strategies). ``bias`` and ``mask``: this device's rows of them, as
    ``context_parallel_attention`` takes them; nothing of them travels. ``dropout_rate`` and
    ``dropout_key``: as ``context_parallel_attention`` takes them (each device's query and key
    slices, zig-zag: chunks, a multiple of 16 rows and keys).

  Returns:
    This device's slice of the output (and of the log-sum-exp, ``(B, T/P, N)`` float32, with
    ``return_residual``). Differentiable once, in reverse mode, as the kernels of
    ``dot_product_attention`` are.
  """
  query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  _validation.check_qkv(query, key, value)
  if query.ndim != 4:
    raise ValueError(f"ring_attention takes rank-4 slices (B, T, N, H); got query{query.shape}")
  if layout not in _ring.LAYOUTS:
    raise ValueError(f"layout must be one of {_ring.LAYOUTS}; got {layout!r}")
  parts = 1 if layout == "contiguous" else 2
  if query.shape[1] % parts or key.shape[1] % parts:
    raise ValueError(f"the zigzag layout holds two chunks per device: query{query.shape} and "
                     f"key{key.shape} need even sequence slices")
  if is_causal and query.shape[1] != key.shape[1]:
    raise ValueError("ring_attention with is_causal needs query and key slices of one length "
                     f"(global T == S); got query{query.shape}, key{key.shape}")
  caller = "jax_flash.ring_attention"
  masks = _dispatch.mask_forms(
      is_causal=bool(is_causal), local_window=False,
      seq_lengths=query_seq_lengths is not None or key_value_seq_lengths is not None)
  batch, rows_q, heads_q, _ = query.shape
  num = jax.lax.axis_size(axis_name)
  seq_q, seq_k = rows_q * num, key.shape[1] * num
  segment_ids = _validation.check_segment_ids(q_segment_ids, kv_segment_ids, batch, rows_q,
                                              key.shape[1], False)
  blocks_passed = None if block_mask is None else jnp.shape(block_mask)
  block_mask = _validation.check_block_mask(block_mask, batch, heads_q, rows_q, seq_k, False,
                                            query.shape, (batch, seq_k, *key.shape[2:]))
  if block_mask is not None:
    probe = _ops.KernelConfig("cpu", 1.0, bool(is_causal), -1, -1)
    problem = _block_mask_problem("ring", layout, num=num, seq_q=seq_q, seq_k=seq_k,
                                  config=probe)
    if problem:
      raise ValueError(f"ring_attention in layout={layout!r} cannot run query{query.shape}, "
                       f"key{key.shape} over {num} devices: {problem}")
  return _run_in_shard_map(
      Strategy("ring", layout), query, key, value, axis_name=axis_name, caller=caller,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
      masks=masks, seq_q=seq_q, seq_k=seq_k, scale=scale, is_causal=is_causal, window_left=-1,
      window_right=-1, implementation=implementation, deterministic=deterministic,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      segment_ids=segment_ids,
      segment_id_shapes=None if segment_ids is None else (jnp.shape(q_segment_ids),
                                                          jnp.shape(kv_segment_ids)),
      block_mask=block_mask, blocks_passed=blocks_passed, return_residual=return_residual,
      bias=bias, mask=mask, dropout_rate=dropout_rate, dropout_key=dropout_key)
