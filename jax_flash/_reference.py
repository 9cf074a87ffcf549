"""Plain-XLA attention with jax_flash's semantics: the ``implementation="xla"`` path.

It materialises the (T, S) scores, so its memory is quadratic: a reference, not a kernel. It
differs from ``jax.nn.dot_product_attention`` only where jax.nn's answer is an artefact of its
large-negative fill: a query row with no key to attend to gives 0 here (jax.nn averages every
value row), and its log-sum-exp is ``EMPTY_ROW_LSE``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _dropout, _registry
from jax_flash._block_sparse import with_block_mask

# The lse of a row with no key to attend to, as the kernels write it (the most negative float32).
EMPTY_ROW_LSE: float = _registry.KERNEL_CONSTANTS["empty_row_lse"]

# What the plain-XLA paths take a masked score for when they look for a row's maximum, and where
# that maximum starts: below every finite score, and finite (a -inf would trip jax.debug_infs,
# though it never reaches a result). A row with no unmasked score is empty; its maximum is unused.
MASKED_SCORE: float = -float(np.finfo(np.float32).max)


def masked_exp(allowed: jax.Array, x: jax.Array, shift: jax.Array) -> jax.Array:
  """exp(x - shift) where `allowed`, exactly 0 elsewhere. A masked position computes exp(0)
  and is dropped, so neither its x (any value, NaN or inf included) nor an overflow of
  x - shift reaches the result, its derivatives or jax.debug_infs."""
  return jnp.where(allowed, jnp.exp(jnp.where(allowed, x, shift) - shift), 0.0)


def empty_lse(batch: int, heads: int, seq_q: int, sinks=None) -> jax.Array:
  """(B, N, T) float32: the lse of rows with no key at all: EMPTY_ROW_LSE, or with `sinks` (N,)
  each head's sink (the sink is then the row's only term)."""
  if sinks is None:
    return jnp.full((batch, heads, seq_q), EMPTY_ROW_LSE, jnp.float32)
  sinks = jax.lax.stop_gradient(sinks.astype(jnp.float32))
  return jnp.broadcast_to(sinks[None, :, None], (batch, heads, seq_q))


def key_mask(seq_q: int, seq_k: int, q_lens, kv_lens, is_causal: bool,
             window_left: int, window_right: int, key_offset=0, segment_ids=None) -> jax.Array:
  """(B, T, S) bool: which keys each query row may attend to (window bounds < 0: unbounded),
  for the S keys from position `key_offset` on; with `segment_ids` (q_ids (B, T), kv_ids
  (B, S) of those S keys) only keys of the row's own segment."""
  i = jnp.arange(seq_q)[None, :, None]
  j = key_offset + jnp.arange(seq_k)[None, None, :]
  mask = (i < q_lens[:, None, None]) & (j < kv_lens[:, None, None])
  if is_causal:
    mask &= j <= i
  if window_left >= 0:
    mask &= j >= i - window_left
  if window_right >= 0:
    mask &= j <= i + window_right
  if segment_ids is not None:
    q_ids, kv_ids = segment_ids
    mask &= q_ids[:, :, None] == kv_ids[:, None, :]
  return mask


def alibi_bias(slopes, heads_k: int, seq_q: int, seq_k: int, key_offset=0) -> jax.Array:
  """(1, K, G, T, S) float32: ALiBi's bias slopes[h] * (j - i) of query row i and key j (the S
  keys from position `key_offset` on), laid out like the grouped scores; `slopes` (N,). The
  positions are those key_mask compares (row and key indices, top-left aligned as the causal
  mask); j - i is formed as an integer and converted once, as the kernels form it."""
  i = jnp.arange(seq_q, dtype=jnp.int32)[:, None]
  j = key_offset + jnp.arange(seq_k, dtype=jnp.int32)[None, :]
  distance = (j - i).astype(jnp.float32)
  slopes5 = slopes.astype(jnp.float32).reshape(1, heads_k, -1, 1, 1)
  return slopes5 * distance


def alibi_lse_shift(lse, slopes, offset, sign: int = 1) -> jax.Array:
  """The lse (B, N, T) of a kernel call on slices of a longer sequence, moved between the
  slices' ALiBi positions and the sequence's. A kernel biases query row i' and key j' of its
  slices by slope * (j' - i'); with the slices starting at global query row q0 and key k0 the
  global bias is that plus slope * (k0 - q0), the same for every score of a row: the output is
  unchanged and the lse moves by it. sign=1 gives the global lse from the kernel's (`offset`
  = k0 - q0, an integer, maybe traced), sign=-1 the lse a backward kernel on those slices
  takes from the global one. `slopes` (B, N) float32. Rows with no key (EMPTY_ROW_LSE) stay."""
  shift = slopes[..., None] * (sign * jnp.asarray(offset)).astype(jnp.float32)
  return jnp.where(lse == EMPTY_ROW_LSE, lse, lse + shift)


def dropout_multipliers(dropout_seeds, rate: float, heads_k: int, seq_q: int, seq_k: int,
                        key_offset=0) -> jax.Array:
  """(B, K, G, T, S) float32: Z = keep / (1 - rate) of the scores laid out as grouped (query
  head h = kv head * G + member), for the S keys from position `key_offset` on; `dropout_seeds`
  (B, N, SEED_WORDS) uint32 (jax_flash._dropout.seeds). The same decisions as the kernels'
  (jax_flash._dropout.keep_mask)."""
  batch, heads_q, words = dropout_seeds.shape
  seeds5 = dropout_seeds.reshape(batch, heads_k, heads_q // heads_k, words)
  return _dropout.multipliers(seeds5, rate, jnp.arange(seq_q),
                              key_offset + jnp.arange(seq_k))


def grouped_logit_array(x, heads_k: int):
  """A (B|1, N|1, T|1, S|1) bias or mask laid out like the grouped scores (B, K, G, T, S): its
  head dim split into (kv head, query head of the group), or (1, 1) when it broadcasts."""
  b, n, t, s = x.shape
  return x.reshape(b, 1, 1, t, s) if n == 1 else x.reshape(b, heads_k, n // heads_k, t, s)


def attention_reference(q, k, v, q_lens, kv_lens, *, scale: float, is_causal: bool,
                        window_left: int = -1, window_right: int = -1, bias=None, mask=None,
                        segment_ids=None, logits_soft_cap: float | None = None, sinks=None,
                        alibi_slopes=None, block_mask=None, dropout_rate: float | None = None,
                        dropout_seeds=None):
  """Returns (o, lse): o (B, T, N, Hv) in q's dtype, lse (B, N, T) float32. q and k are
  (B, T|S, N|K, H), v (B, S, K, Hv): its head dim Hv may differ from H (MLA-style).

  `dropout_rate` (None: off) with `dropout_seeds` (B, N, SEED_WORDS) uint32
  (jax_flash._dropout.seeds):
  the normalised probabilities are multiplied by keep / (1 - rate) before P V
  (dropout_multipliers: the kernels' decisions); the lse is not affected.

  `block_mask` (B|1, N|1, Tb, Sb) bool (None: off): block-sparse attention, expanded to an
  element mask (jax_flash._block_sparse) and combined with `mask`.

  `alibi_slopes` (N,) float32 (None: off): ALiBi, the score of query i and key j in head h
  gains alibi_slopes[h] * (j - i) (alibi_bias), after the soft cap, before the masks and the
  softmax. The caller stops its gradient (jax_flash does not differentiate the slopes).

  `sinks` (N,) (None: off; gpt-oss's attention sinks): one logit per query head, in the units
  of the scores after scale, cap and bias, joins every row's softmax as one more column with no
  value: p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)). The lse includes it; a row with no
  visible key gives 0 output and lse sink_h. JAX differentiates it.

  `logits_soft_cap` c (None: off): the scaled scores s become c * tanh(s / c) (Gemma 2), before
  the bias, the masks and the softmax; JAX differentiates the tanh.

  Computed in float32 whatever the input dtype (inputs are upcast first). `bias` (added to the
  scaled scores) and `mask` (True: attend) are rank 4, broadcastable to (B, N, T, S).
  `segment_ids`: None or (q_ids (B, T), kv_ids (B, S)) int32; a query attends only keys of
  its own id.

  A row is empty (0 output, EMPTY_ROW_LSE) when the masks leave it no key, and only then: a NaN
  or inf among the scores it attends makes it NaN, as in jax.nn. Masked scores are replaced by
  the finite MASKED_SCORE, never -inf, so finite inputs give no inf anywhere (under
  jax.debug_infs too).
  """
  batch, seq_q, heads_q, head_dim = q.shape
  seq_k, heads_k = k.shape[1], k.shape[2]
  if seq_k == 0 or q.size == 0:  # nothing to attend to anywhere, or no output
    lse = empty_lse(batch, heads_q, seq_q, sinks)
    return jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype), lse
  group = heads_q // heads_k
  mask = with_block_mask(mask, block_mask, seq_q, seq_k)
  allowed = key_mask(seq_q, seq_k, q_lens, kv_lens, is_causal, window_left, window_right,
                     segment_ids=segment_ids)
  allowed = allowed[:, None, None, :, :]
  if mask is not None:
    allowed = allowed & grouped_logit_array(mask, heads_k)
  has_keys = jnp.any(allowed, axis=-1, keepdims=True)  # (B, K|1, G|1, T, 1)
  rows_have_keys = jnp.moveaxis(has_keys, 3, 1)  # laid out like q and out: (B, T, K|1, G|1, 1)
  qf = q.astype(jnp.float32).reshape(batch, seq_q, heads_k, group, head_dim)
  # An empty row's q is never used: zeroed, so that nothing in it (a NaN) reaches a gradient.
  qf = jnp.where(rows_have_keys, qf, 0.0)
  kf = k.astype(jnp.float32)
  vf = v.astype(jnp.float32)
  scores = jnp.einsum("btkgh,bskh->bkgts", qf, kf, precision="highest") * scale
  if logits_soft_cap is not None:
    scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
  if alibi_slopes is not None:
    scores = scores + alibi_bias(alibi_slopes, heads_k, seq_q, seq_k)
  if bias is not None:
    scores = scores + grouped_logit_array(bias.astype(jnp.float32), heads_k)
  row_max = jnp.max(jnp.where(allowed, scores, MASKED_SCORE), axis=-1, keepdims=True)
  row_max = jnp.where(has_keys, row_max, 0.0)
  sink5 = None
  if sinks is not None:  # the extra column: it joins the maximum and the sum of every row
    sink5 = sinks.astype(jnp.float32).reshape(1, heads_k, group, 1, 1)
    row_max = jnp.where(has_keys, jnp.maximum(row_max, sink5), sink5)
  row_max = jax.lax.stop_gradient(row_max)
  probs = masked_exp(allowed, scores, row_max)
  row_sum = jnp.sum(probs, axis=-1, keepdims=True)
  if sink5 is not None:
    row_sum = row_sum + jnp.exp(sink5 - row_max)
    has_keys = jnp.broadcast_to(has_keys, row_sum.shape)
  safe_sum = jnp.where(has_keys, row_sum, 1.0)
  probs = probs / safe_sum
  if dropout_rate is not None:
    probs = probs * dropout_multipliers(dropout_seeds, dropout_rate, heads_k, seq_q, seq_k)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, vf, precision="highest")
  out = jnp.where(rows_have_keys, out, 0.0)  # 0 even where a masked value is NaN
  out = out.reshape(batch, seq_q, heads_q, v.shape[-1]).astype(q.dtype)
  lse = jnp.where(has_keys, jnp.log(safe_sum) + row_max, EMPTY_ROW_LSE)[..., 0]
  if sink5 is not None:  # a row with no visible key: its lse is the sink's alone
    lse = jnp.where(has_keys[..., 0], lse, jnp.broadcast_to(sink5[..., 0], lse.shape))
  lse = lse.reshape(batch, heads_q, seq_q)
  return out, jax.lax.stop_gradient(lse)
