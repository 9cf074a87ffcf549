"""FlashAttention in plain XLA: the ``implementation="blockwise"`` path.

Keys and values are visited in blocks of ``KEY_BLOCK`` inside a ``lax.scan`` with an online
softmax (running row maximum and sum, rescaled accumulator), and the backward pass recomputes each
block's probabilities from the saved log-sum-exp, as the kernels do. Memory grows linearly with the
sequence: one ``(T, KEY_BLOCK)`` tile of scores per head at a time, never ``(T, S)``.

Its products are XLA's at JAX's default precision for the input dtype, so float32 inputs are as
accurate as any float32 matmul in JAX on that device (TF32 tensor cores on recent NVIDIA GPUs,
full float32 on the CPU), with float32 softmax statistics and accumulation. It is what
``implementation=None`` runs for float32 inputs on a GPU, where the CUDA kernels take 16-bit
inputs. Semantics are the kernels': a row with no key to attend to gives 0 output, 0 gradient
and lse ``EMPTY_ROW_LSE``.

ALiBi slopes add slope * (j - i) to each scan step's score tile (the step's key positions known
from its index), so the (T, S) bias is never formed either.

Segment ids (packed documents) are one more element mask: each scan step compares the rows' ids
with its key block's. Every block is visited (a scan has a fixed trip count): unlike the CPU
kernel this path does not skip the blocks of other documents.

Unlike the kernels it also takes jax.nn's ``bias`` and ``mask`` arrays: each scan step adds and
applies the slice of its key block (arrays with no key dim broadcast over every block), and the
backward pass returns the bias's gradient, summed over the dims it broadcasts along.

A block mask (``block_mask``, one bool per 128 x 128 block) is sliced per step too: each step
takes the block mask's columns of its keys and expands only those to a (T, KEY_BLOCK) element
mask, so memory stays linear in S (the block mask itself holds T S / 16384 bools). Hidden blocks are
masked, not skipped, as segment ids are.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flash._block_sparse import BLOCK_MASK_BLOCK, expand_block_mask
from jax_flash._reference import (EMPTY_ROW_LSE, MASKED_SCORE, alibi_bias, dropout_multipliers,
                                  empty_lse, grouped_logit_array, key_mask, masked_exp)

# Keys per scan step. Scores of one step take batch * heads * T * KEY_BLOCK float32s.
KEY_BLOCK = 512


class _Config(NamedTuple):
  """Static settings of one call (hashable: the custom_vjp's nondiff argument)."""

  scale: float
  is_causal: bool
  window_left: int
  window_right: int
  block: int  # keys per scan step
  logits_soft_cap: float | None = None  # c: scores become c * tanh(s / c); None: off
  dropout_rate: float | None = None  # with the seeds (an argument of the passes); None: off


def _split_groups(x: jax.Array, heads_k: int) -> jax.Array:
  """(B, T, N, H) -> (B, T, K, G, H) float32: query heads grouped by the kv head they share."""
  batch, seq, heads, head_dim = x.shape
  return x.astype(jnp.float32).reshape(batch, seq, heads_k, heads // heads_k, head_dim)


def _key_blocks(x: jax.Array, block: int) -> jax.Array:
  """(B, S, K, H) -> (S / block, B, block, K, H) float32, S padded up with zeros."""
  batch, seq, heads, head_dim = x.shape
  blocks = -(-seq // block)
  x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, blocks * block - seq), (0, 0), (0, 0)])
  return jnp.moveaxis(x.reshape(batch, blocks, block, heads, head_dim), 1, 0)


def _grouped(x: jax.Array | None, heads_k: int) -> jax.Array | None:
  """A rank-4 bias or mask (B|1, N|1, T|1, S|1) laid out like the scores (see
  grouped_logit_array), or None without one."""
  return None if x is None else grouped_logit_array(x, heads_k)


def _logit_blocks(x5: jax.Array | None, block: int, fill):
  """A grouped bias or mask (B|1, K|1, G|1, T|1, S|1) as the scan sees it: (S / block, B|1, K|1,
  G|1, T|1, block) split along the keys (padded with `fill`), or None when it has no key dim to
  split (then every block uses the whole array: see _this_block)."""
  if x5 is None or x5.shape[4] == 1:
    return None
  blocks = -(-x5.shape[4] // block)
  x5 = jnp.pad(x5, [(0, 0)] * 4 + [(0, blocks * block - x5.shape[4])], constant_values=fill)
  return jnp.moveaxis(x5.reshape(*x5.shape[:4], blocks, block), 4, 0)


def _this_block(whole5: jax.Array | None, blocks: jax.Array | None) -> jax.Array | None:
  """A scan step's slice of a grouped bias or mask: its block if it was split, else the whole
  array, which broadcasts over the keys; None without one."""
  return blocks if blocks is not None else whole5


class _Masks(NamedTuple):
  """The array masks of a call: jax.nn's element `mask` (rank 4, (B|1, N|1, T|1, S|1)) and the
  block mask (B|1, N|1, Tb, Sb) of jax_flash.BLOCK_MASK_BLOCK blocks, each None when not given;
  grouped like the scores ((B|1, K|1, G|1, ...): _grouped_masks) inside the passes. The block
  mask is never expanded whole (T x S bools): each scan step expands only its own columns."""

  elements: jax.Array | None = None
  blocks: jax.Array | None = None


def _grouped_masks(masks: _Masks, heads_k: int) -> _Masks:
  return _Masks(_grouped(masks.elements, heads_k), _grouped(masks.blocks, heads_k))


def _mask_blocks(masks5: _Masks, block: int) -> _Masks:
  """What the scan takes of the grouped masks per step: the element mask's slice (_logit_blocks)
  and the block mask's columns of the step's keys, (steps, B|1, K|1, G|1, Tb, ceil(block /
  block_k)) (the last step's padded with False; block is KEY_BLOCK, a multiple of block_k, or S
  in a single step)."""
  columns = None
  if masks5.blocks is not None:
    per_step = -(-block // BLOCK_MASK_BLOCK[1])
    x = masks5.blocks
    steps = -(-x.shape[-1] // per_step)
    x = jnp.pad(x, [(0, 0)] * 4 + [(0, steps * per_step - x.shape[-1])])
    columns = jnp.moveaxis(x.reshape(*x.shape[:4], steps, per_step), 4, 0)
  return _Masks(_logit_blocks(masks5.elements, block, False), columns)


def _step_mask(masks5: _Masks, step: _Masks, seq_q: int, block: int) -> jax.Array | None:
  """A scan step's element mask (B|1, K|1, G|1, T|1, block|1): its slice of the element mask,
  and its block-mask columns expanded to (T, block), combined; None without either."""
  elements = _this_block(masks5.elements, step.elements)
  if step.blocks is None:
    return elements
  expanded = expand_block_mask(step.blocks, seq_q, block)
  return expanded if elements is None else elements & expanded


def _id_blocks(segment_ids, block: int):
  """The key ids (B, S) as the scan sees them, (S / block, B, block) (padding keys are past
  kv_lens, masked whatever their id); None without segment ids."""
  if segment_ids is None:
    return None
  kv_ids = segment_ids[1]
  batch, seq = kv_ids.shape
  blocks = -(-seq // block)
  kv_ids = jnp.pad(kv_ids, [(0, 0), (0, blocks * block - seq)])
  return jnp.moveaxis(kv_ids.reshape(batch, blocks, block), 1, 0)


def _scan_inputs(k: jax.Array, v: jax.Array, bias5, mask5, segment_ids, block: int):
  """What both passes scan over: each key block's index, K block and V block, its slices of
  the grouped bias and mask where those have a key dim, and its key segment ids."""
  return (jnp.arange(-(-k.shape[1] // block)), _key_blocks(k, block), _key_blocks(v, block),
          _logit_blocks(bias5, block, 0.0), _mask_blocks(mask5, block),
          _id_blocks(segment_ids, block))


def _block_scores(q5, k_block, index, q_lens, kv_lens, bias_block, mask_block, config: _Config,
                  segment_ids=None, kv_ids_block=None, alibi_slopes=None):
  """(scores, allowed, cap_grad) of key block `index`: its scaled scores (B, K, G, T, block),
  soft-capped where config.logits_soft_cap is set, plus ALiBi's slope * (j - i) where
  `alibi_slopes` (N,) are given, plus its bias; which of them the masks let
  through (the same shape), with segment ids the rows' ids against the block's key ids
  `kv_ids_block` (B, block); and the cap's derivative 1 - tanh^2(s / c) by each raw scaled
  score s (None without a cap), which the backward multiplies the scores' gradient by."""
  scores = jnp.einsum("btkgh,bskh->bkgts", q5, k_block) * config.scale
  cap_grad = None
  if config.logits_soft_cap is not None:
    capped = jnp.tanh(scores / config.logits_soft_cap)
    scores = config.logits_soft_cap * capped
    cap_grad = 1.0 - capped * capped
  if alibi_slopes is not None:
    scores = scores + alibi_bias(alibi_slopes, k_block.shape[2], q5.shape[1], config.block,
                                 key_offset=index * config.block)
  if bias_block is not None:
    scores = scores + bias_block
  ids = None if segment_ids is None else (segment_ids[0], kv_ids_block)
  allowed = key_mask(q5.shape[1], config.block, q_lens, kv_lens, config.is_causal,
                     config.window_left, config.window_right, key_offset=index * config.block,
                     segment_ids=ids)
  allowed = allowed[:, None, None]
  if mask_block is not None:
    allowed = allowed & mask_block
  return scores, jnp.broadcast_to(allowed, scores.shape), cap_grad


def _dropout_step(dropout_seeds, index, scores_shape, config: _Config):
  """Dropout's Z = keep / (1 - rate) of a step's scores (B, K, G, T, block), the kernels'
  decisions (jax_flash._dropout) drawn for this key block alone; None without dropout."""
  if dropout_seeds is None:
    return None
  _, heads_k, _, seq_q, block = scores_shape
  return dropout_multipliers(dropout_seeds, config.dropout_rate, heads_k, seq_q, block,
                             key_offset=index * block)


def _forward(q, k, v, q_lens, kv_lens, bias, mask, segment_ids, sinks, alibi_slopes,
             dropout_seeds, config):
  """(o (B, T, N, Hv) in float32, lse (B, N, T) float32, has_keys (B, N, T) bool): the caller
  casts o to q's dtype. `has_keys`: which rows the masks leave some key. Hv is v's head dim
  (q's and k's H where they agree; MLA-style calls have Hv != H).

  `sinks` (N,) (None: off) join each row after the scan, as one more term of its softmax: with
  the keys' lse l and the sink c, the row's lse is logaddexp(l, c) and its output is scaled by
  exp(l - logaddexp(l, c)) (a row with no key: 0 output, lse c).

  The online softmax carries, per row, whether the masks have let any key through yet (`seen`),
  the running maximum of those keys' scores (MASKED_SCORE before the first: never -inf, so
  finite inputs compute no inf), the running sum and the rescaled accumulator. A NaN or inf
  score among the keys a row attends makes its maximum, and so everything after it, NaN, as in
  jax.nn; a row the masks leave without keys is empty (0 output, EMPTY_ROW_LSE)."""
  batch, seq_q, heads_q, _ = q.shape
  heads_k, head_dim_v = k.shape[2], v.shape[3]
  q5 = _split_groups(q, heads_k)
  bias5, mask5 = _grouped(bias, heads_k), _grouped_masks(mask, heads_k)
  stats_shape = (batch, heads_k, heads_q // heads_k, seq_q)

  # The accumulator is kept divided by 2^exponent, the power of two of the running sum (exact
  # scalings): it stays within twice the values' range, so values near the float32 limit do not
  # overflow it (an unnormalised sum of up to S weights times values would), and the result is
  # what dividing the unscaled sum by the row sum gives.
  def step(carry, xs):
    seen, row_max, row_sum, exponent, acc = carry
    index, k_block, v_block, bias_blocks, mask_blocks, kv_ids_block = xs
    scores, allowed, _ = _block_scores(q5, k_block, index, q_lens, kv_lens,
                                       _this_block(bias5, bias_blocks),
                                       _step_mask(mask5, mask_blocks, seq_q, config.block),
                                       config, segment_ids, kv_ids_block, alibi_slopes)
    now_seen = seen | jnp.any(allowed, axis=-1)
    new_max = jnp.maximum(row_max, jnp.max(jnp.where(allowed, scores, MASKED_SCORE), axis=-1))
    base = jnp.where(now_seen, new_max, 0.0)  # no key seen yet: every exponential is 0
    probs = masked_exp(allowed, scores, base[..., None])
    correction = masked_exp(seen, row_max, base)  # 0 until a key was seen
    row_sum = row_sum * correction + jnp.sum(probs, axis=-1)
    new_exponent = jnp.frexp(row_sum)[1]  # 0 for a zero (or NaN) sum
    z = _dropout_step(dropout_seeds, index, probs.shape, config)
    probs = probs if z is None else probs * z  # the sum (and lse) keep every probability
    acc = (jnp.ldexp(acc * correction[..., None], (exponent - new_exponent)[..., None]) +
           jnp.einsum("bkgts,bskh->bkgth", jnp.ldexp(probs, -new_exponent[..., None]), v_block))
    return (now_seen, new_max, row_sum, new_exponent, acc), None

  init = (jnp.zeros(stats_shape, bool), jnp.full(stats_shape, MASKED_SCORE, jnp.float32),
          jnp.zeros(stats_shape), jnp.zeros(stats_shape, jnp.int32),
          jnp.zeros(stats_shape + (head_dim_v,)))
  (has_keys, row_max, row_sum, exponent, acc), _ = jax.lax.scan(
      step, init, _scan_inputs(k, v, bias5, mask5, segment_ids, config.block))
  scaled_sum = jnp.where(has_keys, jnp.ldexp(row_sum, -exponent), 1.0)
  out = jnp.where(has_keys[..., None], acc / scaled_sum[..., None], 0.0)
  safe_sum = jnp.where(has_keys, row_sum, 1.0)
  lse = jnp.where(has_keys, jnp.log(safe_sum) + row_max, EMPTY_ROW_LSE)
  if sinks is not None:
    sink4 = sinks.astype(jnp.float32).reshape(1, heads_k, heads_q // heads_k, 1)
    total = jnp.where(has_keys, jnp.logaddexp(lse, sink4), sink4)
    out = jnp.where(has_keys[..., None], out * jnp.exp(lse - total)[..., None], 0.0)
    lse = total
  out = jnp.moveaxis(out, 3, 1).reshape(batch, seq_q, heads_q, head_dim_v)  # float32
  return (out, lse.reshape(batch, heads_q, seq_q),
          jnp.broadcast_to(has_keys, stats_shape).reshape(batch, heads_q, seq_q))


def _backward(q, k, v, o, lse, has_keys, d_o, q_lens, kv_lens, bias, mask, segment_ids, sinks,
              alibi_slopes, dropout_seeds, config):
  """(dq, dk, dv, dbias, dsinks) in the dtypes of q, k, v, the bias and the sinks (None
  without them); dK and dV summed over each kv head's query heads, dbias over the dims the
  bias broadcasts along.

  The sinks change nothing here but the lse (which includes them, so P is the sinks' P) and
  add their own gradient: d sink_h = -sum over the rows of head h of exp(sink_h - lse) D, with
  D = rowsum(dO o) (o_i depends on sink_h only through the normaliser exp(sink_h) +
  sum_j exp(s_ij), whose derivative by sink_h is p_sink = exp(sink_h - lse_i): do_i / dsink_h
  = -p_sink o_i)."""
  batch, seq_q, heads_q, _ = q.shape
  seq_k, heads_k = k.shape[1], k.shape[2]
  lse = lse.reshape(batch, heads_k, heads_q // heads_k, seq_q)
  has_keys = has_keys.reshape(lse.shape)
  # Rows with no key to attend to (the forward found none, as the kernels decide it): their q
  # is zeroed and their dq is 0, whatever the masked keys and values hold.
  rows_have_keys = jnp.moveaxis(has_keys, 3, 1)[..., None]  # (B, T, K, G, 1)
  q5 = jnp.where(rows_have_keys, _split_groups(q, heads_k), 0.0)
  do5 = _split_groups(d_o, heads_k)
  delta = jnp.einsum("btkgh,btkgh->bkgt", do5, _split_groups(o, heads_k))
  dsinks = None
  if sinks is not None:
    sink4 = sinks.astype(jnp.float32).reshape(1, heads_k, heads_q // heads_k, 1)
    dsinks = -jnp.sum(jnp.where(has_keys, jnp.exp(sink4 - lse) * delta, 0.0), axis=(0, 3))
    dsinks = dsinks.reshape(heads_q).astype(sinks.dtype)
  bias5, mask5 = _grouped(bias, heads_k), _grouped_masks(mask, heads_k)

  def bias_gradient(d_logits):
    """The bias's share of the logits' gradient: summed over the dims it broadcasts along."""
    axes = tuple(i for i in range(5) if bias5.shape[i] == 1 and d_logits.shape[i] != 1)
    return jnp.sum(d_logits, axis=axes, keepdims=True)

  def step(carry, xs):
    dq, dbias_sum = carry
    index, k_block, v_block, bias_blocks, mask_blocks, kv_ids_block = xs
    scores, allowed, cap_grad = _block_scores(q5, k_block, index, q_lens, kv_lens,
                                              _this_block(bias5, bias_blocks),
                                              _step_mask(mask5, mask_blocks, seq_q,
                                                         config.block),
                                              config, segment_ids, kv_ids_block, alibi_slopes)
    # 0 where masked; a row with no key (lse EMPTY_ROW_LSE) has nothing allowed.
    probs = masked_exp(allowed, scores, lse[..., None])
    d_probs = jnp.einsum("btkgh,bskh->bkgts", do5, v_block)
    # Dropout: out = (P Z) V, so dV = (P Z)^T dO and P's gradient is dP Z.
    z = _dropout_step(dropout_seeds, index, probs.shape, config)
    kept, d_probs = (probs, d_probs) if z is None else (probs * z, d_probs * z)
    # Masked: no gradient. P == 1 (exactly: the row's only key, or every other key's P below
    # float32's resolution): dS is exactly 0, as jax.nn's P * (dP - sum P dP) is; delta, formed
    # from O by another summation than dP, would leave round-off there (issue 13).
    d_logits = jnp.where(allowed & (probs != 1.0), probs * (d_probs - delta[..., None]), 0.0)
    # The bias's gradient is d_logits; the raw scores' passes through the cap's derivative.
    d_scores = (d_logits if cap_grad is None else d_logits * cap_grad) * config.scale
    dq = dq + jnp.einsum("bkgts,bskh->btkgh", d_scores, k_block)
    dk_block = jnp.einsum("bkgts,btkgh->bskh", d_scores, q5)
    dv_block = jnp.einsum("bkgts,btkgh->bskh", kept, do5)
    dbias_block = None
    if bias5 is not None and bias5.shape[4] == 1:
      dbias_sum = dbias_sum + bias_gradient(d_logits)
    elif bias5 is not None:
      dbias_block = bias_gradient(d_logits)
    return (dq, dbias_sum), (dk_block, dv_block, dbias_block)

  dbias_init = None if bias5 is None else jnp.zeros(bias5.shape, jnp.float32)
  (dq, dbias_sum), (dk, dv, dbias_blocks) = jax.lax.scan(
      step, (jnp.zeros_like(q5), dbias_init),
      _scan_inputs(k, v, bias5, mask5, segment_ids, config.block))

  def unblock(x, like):
    x = jnp.moveaxis(x, 0, 1).reshape(batch, -1, heads_k, like.shape[-1])
    return x[:, :seq_k].astype(like.dtype)

  dbias = None
  if bias is not None:
    if dbias_blocks is None:
      dbias = dbias_sum
    else:  # (S / block, B|1, K|1, G|1, T|1, block) -> (B|1, K|1, G|1, T|1, S)
      dbias = jnp.moveaxis(dbias_blocks, 0, 4)
      dbias = dbias.reshape(*dbias.shape[:4], -1)[..., :seq_k]
    dbias = dbias.reshape(bias.shape).astype(bias.dtype)
  dq = jnp.where(rows_have_keys, dq, 0.0)
  return dq.reshape(q.shape).astype(q.dtype), unblock(dk, k), unblock(dv, v), dbias, dsinks


# alibi_slopes: None or (N,) float32; dropout_seeds: None or (B, N, SEED_WORDS) uint32
# (jax_flash._dropout.seeds). Neither is differentiated (their cotangents are None: zero).
@functools.partial(jax.custom_vjp, nondiff_argnums=(11,))
def _attention(q, k, v, q_lens, kv_lens, bias, mask, segment_ids, sinks, alibi_slopes,
               dropout_seeds, config):
  o32, lse, _ = _forward(q, k, v, q_lens, kv_lens, bias, mask, segment_ids, sinks,
                         alibi_slopes, dropout_seeds, config)
  return o32.astype(q.dtype), lse


def _attention_fwd(q, k, v, q_lens, kv_lens, bias, mask, segment_ids, sinks, alibi_slopes,
                   dropout_seeds, config):
  # The backward forms delta from the output in float32, not rounded to q's dtype (issue 13).
  o32, lse, has_keys = _forward(q, k, v, q_lens, kv_lens, bias, mask, segment_ids, sinks,
                                alibi_slopes, dropout_seeds, config)
  return ((o32.astype(q.dtype), lse),
          (q, k, v, o32, lse, has_keys, q_lens, kv_lens, bias, mask, segment_ids, sinks,
           alibi_slopes, dropout_seeds))


def _attention_bwd(config, residuals, cotangents):
  (q, k, v, o, lse, has_keys, q_lens, kv_lens, bias, mask, segment_ids, sinks,
   alibi_slopes, dropout_seeds) = residuals
  d_o, _ = cotangents  # lse leaves through stop_gradient
  dq, dk, dv, dbias, dsinks = _backward(q, k, v, o, lse, has_keys, d_o, q_lens, kv_lens, bias,
                                        mask, segment_ids, sinks, alibi_slopes, dropout_seeds,
                                        config)
  return dq, dk, dv, None, None, dbias, None, None, dsinks, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q, k, v, q_lens, kv_lens, *, scale: float, is_causal: bool,
                        window_left: int = -1, window_right: int = -1, bias=None, mask=None,
                        segment_ids=None, logits_soft_cap: float | None = None, sinks=None,
                        alibi_slopes=None, block_mask=None, dropout_rate: float | None = None,
                        dropout_seeds=None):
  """Returns (o, lse) as ``attention_reference`` does: o (B, T, N, Hv) in q's dtype (Hv: v's
  head dim, which may differ from q's and k's H), lse (B, N, T) float32, differentiable in q,
  k, v, the bias and the sinks with a recomputing backward pass. `sinks` (N,): one logit per query head in every row's softmax denominator
  (see attention_reference). `alibi_slopes` (N,) float32: ALiBi's slope * (j - i) added to
  each block's scores after the cap (not differentiated).
  `logits_soft_cap` c caps the scaled scores at c * tanh(s / c) before the bias and masks (the
  backward recomputes the tanh per block).
  `bias` (added to the scaled scores) and `mask` (True: attend) are rank 4, broadcastable to
  (B, N, T, S); each scan step takes their slice for its key block. `segment_ids`: None or
  (q_ids (B, T), kv_ids (B, S)) int32. `block_mask` (B|1, N|1, Tb, Sb) bool: block-sparse
  attention; each step expands only its key block's columns of it to an element mask and
  combines that with `mask` (never the whole (T, S); this path visits every block, the "cpu"
  kernel skips hidden ones). `dropout_rate` (None: off)
  with `dropout_seeds` (B, N, SEED_WORDS) uint32: each step multiplies its normalised probabilities
  by keep / (1 - rate), the kernels' decisions drawn for its key block alone (no (T, S)
  array), forward and backward."""
  mask = _Masks(mask, block_mask)
  if k.shape[1] == 0 or q.size == 0:  # no blocks to scan, or no rows (B, T or N is 0)
    lse = empty_lse(q.shape[0], q.shape[2], q.shape[1], sinks)
    return jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype), lse
  config = _Config(float(scale), bool(is_causal), int(window_left), int(window_right),
                   min(KEY_BLOCK, k.shape[1]),
                   None if logits_soft_cap is None else float(logits_soft_cap),
                   None if dropout_rate is None else float(dropout_rate))
  if bias is not None:
    bias = bias.astype(jnp.float32)
  if alibi_slopes is not None:
    alibi_slopes = alibi_slopes.astype(jnp.float32)
  return _attention(q, k, v, q_lens, kv_lens, bias, mask, segment_ids, sinks, alibi_slopes,
                    dropout_seeds if dropout_rate is not None else None, config)
