"""What the benchmark measures: attention problems (cases), their passes and their inputs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The passes each peer runs on each case.
PASSES = ("fwd", "fwd+bwd")
# Forward plus backward costs 3.5 forwards (the backward 2.5) where the value head dim is the
# query's (Case.flops counts a value head dim of its own product by product).
FWD_BWD_FLOP_FACTOR = 3.5
# The matrix products of each pass, by the head dim each contracts or produces over: the forward
# S = Q K^T (H) and O = P V (Hv); the backward S again (H), dP = dO V^T (Hv), dV = P^T dO (Hv),
# dQ = dS K (H) and dK = dS^T Q (H). Each costs 2 T S times its head dim per batch row and head
# (halved when causal): with Hv = H, 2 products forward and 5 backward (2.5x the forward, 3.5x
# in all: FWD_BWD_FLOP_FACTOR).
PASS_PRODUCTS = {"fwd": (1, 1), "bwd": (3, 2), "fwd+bwd": (4, 3)}  # (over H, over Hv)
# The FlashAttention benchmark's GPU shapes: tokens per batch and model width.
GPU_TOKENS = 16384
GPU_HIDDEN = 2048
# The CPU grid's heads.
CPU_HEADS = 4
# Block-sparse cases (--block-density): the random block mask's seed, fixed so that every run
# and every peer of a run sees the same mask.
BLOCK_MASK_SEED = 0


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: self-attention of `seq` tokens, shapes (B, S, N, H); with
  `block_density` block-sparse, under block_mask() (None: dense, no block mask); with
  `documents` D packed: each row holds D documents of seq / D tokens end to end
  (document_ids), and a token attends only within its document (None: one sequence a row);
  with `value_head_dim` Hv, v (and so the output and its cotangent) is (B, S, N, Hv) while q
  and k keep H (MLA; None: Hv = H); with `kv_heads` K, k and v have K heads, (B, S, K, H) and
  (B, S, K, Hv), each shared by N / K query heads (grouped-query attention, multi-query with
  K = 1; N % K == 0; None: K = N), while q, the output and its cotangent keep N.
  """

  batch: int
  seq: int
  heads: int
  head_dim: int
  dtype: str
  causal: bool
  block_density: float | None = None
  documents: int | None = None
  value_head_dim: int | None = None
  kv_heads: int | None = None

  def __post_init__(self) -> None:
    if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
      raise ValueError(f"kv_heads {self.kv_heads} does not divide the {self.heads} query heads "
                       "(grouped-query attention needs N % K == 0)")

  @property
  def num_kv_heads(self) -> int:
    """The key's and value's heads K: kv_heads, else heads (one per query head)."""
    return self.heads if self.kv_heads is None else self.kv_heads

  @property
  def heads_label(self) -> str:
    """The heads as the table shows them: "16", or "16/4" (N/K) with kv_heads."""
    return str(self.heads) if self.kv_heads is None else f"{self.heads}/{self.kv_heads}"

  @property
  def hv(self) -> int:
    """The value's (and the output's) head dim: value_head_dim, else head_dim."""
    return self.head_dim if self.value_head_dim is None else self.value_head_dim

  @property
  def head_dim_label(self) -> str:
    """The head dim as the table shows it: "64", or "192/128" (H/Hv) with a value head dim."""
    return str(self.head_dim) if self.value_head_dim is None else f"{self.head_dim}/{self.hv}"

  def flops(self, pass_name: str) -> float:
    """FLOPs of one pass by the FlashAttention convention, product by product (PASS_PRODUCTS):
    2 B N T S per unit of head dim, halved when causal; forward 2 B N T S (H + Hv), backward
    2 B N T S (3 H + 2 Hv) (with Hv = H: 4 B N S^2 H and 2.5x that). A block-sparse case counts
    only the blocks its mask lets through, a packed one only the pairs within documents
    (computed_fraction). N is the query heads: with kv_heads K < N (grouped-query attention)
    every query head still computes its T x S scores, so the count is the same as with K = N.
    """
    pairs = 2.0 * self.batch * self.seq**2 * self.heads
    if self.causal:
      pairs /= 2
    over_h, over_hv = PASS_PRODUCTS[pass_name]
    return pairs * (over_h * self.head_dim + over_hv * self.hv) * self.computed_fraction()

  def block_mask(self) -> np.ndarray | None:
    """The case's (Tb, Sb) block mask (jax_flash.BLOCK_MASK_BLOCK blocks; None when dense):
    random with `block_density` of the blocks set (seed BLOCK_MASK_SEED), and every query block
    row's diagonal block, so that no row is empty. Shared by the batch and the heads."""
    if self.block_density is None:
      return None
    return _block_mask(self.seq, self.block_density)

  def computed_fraction(self) -> float:
    """The share of the dense convention's FLOPs the case computes (1 when dense, one sequence
    a row).

    Block-sparse: its visible blocks, each a whole block, a diagonal one half a block when
    causal (so that an all-True mask gives 1 exactly), over the dense count; blocks above the
    diagonal of a causal case compute nothing whatever the mask says. Packed: 1 / D, the
    document-diagonal pairs (D documents of (S/D)^2 pairs each, halved when causal as the
    convention halves S^2), which is also what D separate rows of S/D tokens compute.
    """
    fraction = 1.0 if self.documents is None else 1.0 / self.documents
    mask = self.block_mask()
    if mask is None:
      return fraction
    return fraction * (_visible_blocks(mask, self.causal)
                       / _visible_blocks(np.ones_like(mask), self.causal))

  def dense(self) -> Case:
    """The same problem without a block mask."""
    return dataclasses.replace(self, block_density=None)

  def document_ids(self) -> np.ndarray | None:
    """A packed case's (S,) int32 document id of each token (None when not packed)."""
    return None if self.documents is None else document_ids(self.seq, self.documents)


def document_ids(seq: int, documents: int) -> np.ndarray:
  """(seq,) int32: `documents` documents of seq // documents tokens, end to end, ids sorted
  (0, ..., 0, 1, ..., D - 1)."""
  if documents < 1 or seq % documents:
    raise ValueError(f"packed documents: seq {seq} is not divisible by {documents} documents "
                     "(each row holds D documents of seq / D tokens)")
  return np.arange(seq, dtype=np.int32) // (seq // documents)


@functools.lru_cache(maxsize=8)
def _block_mask(seq: int, density: float) -> np.ndarray:
  from jax_flash import block_mask_shape  # the benchmark's other modules import it as well

  blocks_q, blocks_k = block_mask_shape(seq, seq)
  mask = np.random.default_rng(BLOCK_MASK_SEED).random((blocks_q, blocks_k)) < density
  diagonal = np.arange(min(blocks_q, blocks_k))
  mask[diagonal, diagonal] = True
  mask.flags.writeable = False  # cached: one mask for every caller
  return mask


def _visible_blocks(mask: np.ndarray, causal: bool) -> float:
  """The blocks of `mask` that compute, diagonal ones counting half when causal."""
  if not causal:
    return float(mask.sum())
  return float(np.tril(mask, -1).sum()) + 0.5 * float(np.diagonal(mask).sum())


def block_sparse_cases(cases: Sequence[Case], density: float) -> list[Case]:
  """Each case block-sparse at `density`, followed by its dense twin (timed in the same run)."""
  return [c for case in cases
          for c in (dataclasses.replace(case, block_density=density), case.dense())]


def packed_cases(cases: Sequence[Case], documents: int) -> list[Case]:
  """Each case packed: rows of `documents` documents (a ValueError naming the seq where it is
  not divisible by `documents`)."""
  for case in cases:
    document_ids(case.seq, documents)  # raises for a seq it does not divide
  return [dataclasses.replace(case, documents=documents) for case in cases]


@dataclasses.dataclass(frozen=True)
class Inputs:
  """Query, key, value and output cotangent of one case, host arrays: query (B, S, N, H), key
  (B, S, K, H), value (B, S, K, Hv) and cotangent (B, S, N, Hv) (K = N but with the case's
  kv_heads); and its block mask (Tb, Sb), None when dense."""

  query: np.ndarray
  key: np.ndarray
  value: np.ndarray
  d_out: np.ndarray
  block_mask: np.ndarray | None = None

  def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The four arrays in argument order."""
    return self.query, self.key, self.value, self.d_out


def make_inputs(case: Case, seed: int = 0) -> Inputs:
  """Random normal inputs of the case's shapes and dtype (never zeros), with its block mask:
  query and key of head dim H, value and output cotangent of Hv (case.hv); query and
  cotangent of N heads, key and value of K (case.num_kv_heads). With K = N and Hv = H the
  arrays are those of a case without kv_heads and value_head_dim (the same draws)."""
  rows, kv_rows = (case.batch, case.seq, case.heads), (case.batch, case.seq, case.num_kv_heads)
  shapes = ((*rows, case.head_dim), (*kv_rows, case.head_dim), (*kv_rows, case.hv),
            (*rows, case.hv))
  inputs = _random_inputs(shapes, case.dtype, seed)
  return dataclasses.replace(inputs, block_mask=case.block_mask())


@functools.lru_cache(maxsize=1)  # a causal case and its non-causal twin share their inputs
def _random_inputs(shapes: tuple[tuple[int, ...], ...], dtype: str, seed: int) -> Inputs:
  """Query, key, value and cotangent of `shapes`, drawn in that order."""
  rng = np.random.default_rng(seed)
  return Inputs(*(rng.standard_normal(s, np.float32).astype(jnp.dtype(dtype)) for s in shapes))


def cpu_cases(seqs: Sequence[int], head_dims: Sequence[int], causal_modes: Sequence[bool],
              heads: int | None = None) -> list[Case]:
  """The CPU grid: B=1, 4 heads (or `heads`), float32."""
  heads = CPU_HEADS if heads is None else heads
  return [Case(batch=1, seq=seq, heads=heads, head_dim=head_dim, dtype="float32", causal=causal)
          for seq in seqs for head_dim in head_dims for causal in causal_modes]


def gpu_heads(head_dim: int) -> int:
  """The GPU grid's heads at a head dim: 2048 // head dim (the model width), at least 1."""
  return max(1, GPU_HIDDEN // head_dim)


def gpu_cases(seqs: Sequence[int], head_dims: Sequence[int], causal_modes: Sequence[bool],
              heads: int | None = None) -> list[Case]:
  """The FlashAttention benchmark's GPU grid: batch = 16384 // seq and heads = 2048 // head dim
  (each at least 1; `heads` instead where given, the batch still 16384 // seq), bfloat16."""
  return [Case(batch=max(1, GPU_TOKENS // seq), seq=seq,
               heads=gpu_heads(head_dim) if heads is None else heads,
               head_dim=head_dim, dtype="bfloat16", causal=causal)
          for seq in seqs for head_dim in head_dims for causal in causal_modes]


# ---------------------------------------------------------------------------------------------
# Decoding (--preset decode): a few query rows against a KV cache, contiguous or paged.

# The shapes of issue 15: (batch, query rows, query heads, kv heads, cache length, head dim).
DECODE_SHAPES = (
    (64, 1, 32, 8, 8192, 128),
    (16, 1, 16, 16, 16384, 128),
    (32, 4, 32, 8, 8192, 128),
    (4, 512, 32, 8, 8192, 128),  # chunked prefill
)
# Shapes also run as a ragged batch (issue 15: time in proportion to the tokens read): every
# other sequence at the full cache length, the rest at 1 / DECODE_SHORT_FRACTION of it.
DECODE_RAGGED_SHAPES = ((64, 1, 32, 8, 8192, 128),)
DECODE_SHORT_FRACTION = 8
DECODE_PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class DecodeCase:
  """One decode step: query (B, T, N, H) over a cache of S keys per sequence, (B, S, K, H)
  contiguous or in pages of `page_size` (a random page table). Every sequence holds S keys, or
  with `ragged` every other one S // DECODE_SHORT_FRACTION (the kv lengths say so to every
  peer); paged calls are causal (the T queries are the last T tokens), contiguous ones attend
  the whole cache up to each length."""

  batch: int
  seq_q: int
  heads_q: int
  heads_k: int
  seq_k: int
  head_dim: int
  dtype: str
  paged: bool
  page_size: int = DECODE_PAGE_SIZE
  ragged: bool = False

  @property
  def label(self) -> str:
    keys = f"S{self.seq_k}" + (f" (half {self.short_seq_k})" if self.ragged else "")
    return (f"B{self.batch} T{self.seq_q} {self.heads_q}/{self.heads_k} {keys} "
            f"hd{self.head_dim} {'paged' if self.paged else 'contiguous'}")

  @property
  def short_seq_k(self) -> int:
    """The length of the short sequences of a ragged batch (at least 1)."""
    return max(1, self.seq_k // DECODE_SHORT_FRACTION)

  def kv_lengths(self) -> np.ndarray:
    """(B,) int32: S for every sequence, or with `ragged` S and S / 8 alternately."""
    lengths = np.full((self.batch,), self.seq_k, np.int32)
    if self.ragged:
      lengths[1::2] = self.short_seq_k
    return lengths

  def full(self) -> DecodeCase:
    """The same case with every sequence at the full length (itself when not ragged)."""
    return dataclasses.replace(self, ragged=False)

  def kv_bytes(self) -> int:
    """Bytes of K and V a step must read at least once (each sequence's keys up to its length):
    what bounds decoding (memory bandwidth)."""
    per_key = 2 * self.heads_k * self.head_dim * jnp.dtype(self.dtype).itemsize
    return int(self.kv_lengths().astype(np.int64).sum()) * per_key

  def flops(self) -> float:
    """4 T N H per key read (Q K^T and P V; no causal halving: a step's queries see nearly
    every key)."""
    keys = float(self.kv_lengths().astype(np.int64).sum())
    return 4.0 * self.seq_q * keys * self.heads_q * self.head_dim


def decode_cases(dtype: str, reduce: int = 1) -> list[DecodeCase]:
  """DECODE_SHAPES, contiguous and paged, each followed by its ragged twin where
  DECODE_RAGGED_SHAPES has it, with batch and cache length divided by `reduce` (at least 1
  sequence, 2 for a shape with a ragged twin, and 256 keys; the CPU runs them reduced)."""
  cases = []
  for shape in DECODE_SHAPES:
    b, t, n, k, s, h = shape
    has_ragged = shape in DECODE_RAGGED_SHAPES
    batch, seq_k = max(2 if has_ragged else 1, b // reduce), max(256, s // reduce)
    for ragged in (False, True) if has_ragged else (False,):
      cases += [DecodeCase(batch, t, n, k, seq_k, h, dtype, paged, ragged=ragged)
                for paged in (False, True)]
  return cases


def decode_inputs(case: DecodeCase, seed: int = 0, device=None) -> dict:
  """query, key, value (contiguous) or query, key_pages, value_pages, page_table (a random
  permutation of the pages of S keys per sequence), and kv_lengths (case.kv_lengths()): JAX
  arrays made on `device` (the default device when None) by jax.random, so that the cache
  (gigabytes at the GPU shapes) is not drawn and copied from the host."""
  dtype = jnp.dtype(case.dtype)
  per_seq = -(-case.seq_k // case.page_size)
  q_shape = (case.batch, case.seq_q, case.heads_q, case.head_dim)
  kv_shape = ((case.batch * per_seq, case.page_size) if case.paged
              else (case.batch, case.seq_k)) + (case.heads_k, case.head_dim)

  @jax.jit
  def make(key):
    kq, kk, kv, kt = jax.random.split(key, 4)
    arrays = {"query": jax.random.normal(kq, q_shape, dtype),
              "kv_lengths": jnp.asarray(case.kv_lengths())}
    names = ("key_pages", "value_pages") if case.paged else ("key", "value")
    arrays[names[0]] = jax.random.normal(kk, kv_shape, dtype)
    arrays[names[1]] = jax.random.normal(kv, kv_shape, dtype)
    if case.paged:
      table = jax.random.permutation(kt, case.batch * per_seq).astype(jnp.int32)
      arrays["page_table"] = table.reshape(case.batch, per_seq)
    return arrays

  with jax.default_device(device):
    return make(jax.random.key(seed))
