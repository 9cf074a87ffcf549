"""Split-KV decoding for kernels without a decode kernel of their own, as a JAX program around
their tiled forward (the CUDA kernels; the CPU kernel has a native one, jax_flash._decode).

A decode step attends a few query rows to a long key sequence. The tiled forward gives each
(batch, query head, block of query rows) one CTA that walks every key: with T = 1 that is a
handful of CTAs, each reading its kv head's whole K/V, and query heads that share a kv head read
it again. Here, before the kernel runs,

* the T x G query rows of the G = N / K query heads that share a kv head become the rows of one
  query head of an MHA problem (pack-GQA: each K/V block is read once per group), and
* the key sequence is cut into `splits` chunks that become batch elements of that problem (each
  chunk's valid length from the caller's key lengths), so batch x kv heads x chunks CTAs share
  the work;

the kernel writes each chunk's output (in float32) and lse, and a combine merges them:
lse = log sum_s exp(lse_s), o = sum_s exp(lse_s - lse) o_s. Rows with no visible key in any
chunk keep the kernels' empty-row output (zeros, EMPTY_ROW_LSE); a NaN in any chunk stays NaN.

It applies to calls whose masks depend on key positions only through the lengths (no causal
mask, no window: those depend on each row's own position, which packing and chunking move).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_flash._reference import EMPTY_ROW_LSE

# A chunk holds at least this many keys: the combine's cost per chunk (a row of partial output
# per query row) stays small beside the chunk's work.
MIN_CHUNK_KEYS = 512
# At most this many chunks.
MAX_SPLITS = 32
# Packed query rows a tile of the CUDA forward holds (its kBlockM): the rule packs only what fits.
MAX_PACKED_ROWS = 128


def applies(seq_q: int, heads_q: int, heads_k: int, is_causal: bool, window_left: int,
            window_right: int) -> bool:
  """Whether a call takes the split-KV path: no position-dependent mask and every query row of
  a kv head fits one packed tile."""
  if is_causal or window_left >= 0 or window_right >= 0 or heads_k < 1:
    return False
  return seq_q * (heads_q // heads_k) <= MAX_PACKED_ROWS


def num_splits(batch: int, heads_k: int, seq_k: int, processors: int) -> int:
  """Key chunks: enough that batch x kv heads x chunks fills `processors` twice, each chunk at
  least MIN_CHUNK_KEYS keys, at most MAX_SPLITS."""
  units = batch * heads_k
  if units == 0:
    return 1
  wanted = math.ceil(2 * processors / units)
  return max(1, min(wanted, math.ceil(seq_k / MIN_CHUNK_KEYS), MAX_SPLITS))


def pack_queries(q: jax.Array, heads_k: int) -> jax.Array:
  """(B, T, N, H) -> (B, T * G, K, H): row t * G + g of packed head k is query head k * G + g's
  row t."""
  batch, seq_q, heads_q, head_dim = q.shape
  group = heads_q // heads_k
  q = q.reshape(batch, seq_q, heads_k, group, head_dim).transpose(0, 1, 3, 2, 4)
  return q.reshape(batch, seq_q * group, heads_k, head_dim)


def unpack_output(o: jax.Array, seq_q: int, heads_q: int) -> jax.Array:
  """The inverse of pack_queries."""
  batch, _, heads_k, head_dim = o.shape
  group = heads_q // heads_k
  o = o.reshape(batch, seq_q, group, heads_k, head_dim).transpose(0, 1, 3, 2, 4)
  return o.reshape(batch, seq_q, heads_q, head_dim)


def unpack_lse(lse: jax.Array, seq_q: int, heads_q: int) -> jax.Array:
  """(B, K, T * G) -> (B, N, T), the lse layout of the unpacked heads."""
  batch, heads_k, _ = lse.shape
  group = heads_q // heads_k
  lse = lse.reshape(batch, heads_k, seq_q, group).transpose(0, 1, 3, 2)
  return lse.reshape(batch, heads_q, seq_q)


def combine(o_parts: jax.Array, lse_parts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Merges chunk results: o_parts (S, ...rows, H) float32 normalised per chunk, lse_parts
  (S, ...rows); returns (o float32, lse). Chunks with no visible key (EMPTY_ROW_LSE) weigh 0; a
  row empty in every chunk gets 0 and EMPTY_ROW_LSE; NaN stays NaN."""
  empty = lse_parts == EMPTY_ROW_LSE
  top = jnp.max(jnp.where(empty, -jnp.inf, lse_parts), axis=0)
  all_empty = jnp.all(empty, axis=0)
  top = jnp.where(all_empty, 0.0, top)
  weights = jnp.where(empty, 0.0, jnp.exp(lse_parts - top))
  total = jnp.sum(weights, axis=0)
  o = jnp.sum(weights[..., None] * o_parts, axis=0) / jnp.where(all_empty, 1.0, total)[..., None]
  lse = jnp.where(all_empty, EMPTY_ROW_LSE, top + jnp.log(total))
  return jnp.where(all_empty[..., None], 0.0, o), lse


def split_kv_forward(forward: Callable[..., tuple[jax.Array, jax.Array]], q: jax.Array,
                     k: jax.Array, v: jax.Array, q_lens: jax.Array, kv_lens: jax.Array,
                     splits: int) -> tuple[jax.Array, jax.Array]:
  """(o, lse) of attention without position-dependent masks, as `forward` computes it, through
  pack-GQA and `splits` key chunks.

  `forward(q, k, v, q_lens, kv_lens)` is the tiled kernel's forward for rank-4 inputs (no causal
  mask or window), returning o in float32 and lse (B, N, T). q: (B, T, N, H); k, v: (B, S, K, H);
  lengths (B,) int32. Returns o like q's dtype and lse (B, N, T) float32."""
  batch, seq_q, heads_q, _ = q.shape
  _, seq_k, heads_k, _ = k.shape
  group = heads_q // heads_k
  packed = pack_queries(q, heads_k)
  packed_lens = jnp.clip(q_lens, 0, seq_q) * group  # rows t * G + g live iff t < q_len
  chunk = -(-seq_k // splits)
  pad = chunk * splits - seq_k
  if pad:
    k, v = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (k, v))
  # Chunks become batch elements: (B, splits, chunk, K, H) -> (B * splits, chunk, K, H) (v's
  # own head dim kept).
  k, v = (x.reshape(batch * splits, chunk, heads_k, x.shape[-1]) for x in (k, v))
  starts = jnp.arange(splits, dtype=jnp.int32) * chunk
  chunk_lens = jnp.clip(jnp.clip(kv_lens, 0, seq_k)[:, None] - starts[None, :], 0, chunk)
  chunk_q = jnp.broadcast_to(packed[:, None], (batch, splits, *packed.shape[1:]))
  chunk_q = chunk_q.reshape(batch * splits, *packed.shape[1:])
  chunk_q_lens = jnp.repeat(packed_lens, splits)
  o_parts, lse_parts = forward(chunk_q, k, v, chunk_q_lens, chunk_lens.reshape(-1))
  # (B * splits, T * G, K, H) -> (splits, B, T * G, K, H); lse (B * splits, K, T * G) likewise.
  o_parts = jnp.moveaxis(o_parts.astype(jnp.float32).reshape(batch, splits, *o_parts.shape[1:]), 1, 0)
  lse_parts = jnp.moveaxis(lse_parts.reshape(batch, splits, *lse_parts.shape[1:]), 1, 0)
  if splits == 1:
    o, lse = o_parts[0], lse_parts[0]
  else:  # the combine works on rows (B, K, T * G): o's rows moved beside lse's
    o, lse = combine(jnp.moveaxis(o_parts, 3, 2), lse_parts)
    o = jnp.moveaxis(o, 1, 2)  # back to (B, T * G, K, H)
  return unpack_output(o, seq_q, heads_q).astype(q.dtype), unpack_lse(lse, seq_q, heads_q)
