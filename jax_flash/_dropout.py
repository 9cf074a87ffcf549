"""The random bits of fused dropout, in JAX: the same Philox4x32-10 bits and keep decisions as
cuda/common/dropout_bits.h, which the kernels use (its header comment gives the layout: one call
per 2 x 4 group of score elements, rows r and r + 8, columns c, c + 1, c + 8 and c + 9, 16 bits
each). The kernels' tests build their reference from keep_mask(), so a kernel and its reference
drop the same elements."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from jax_flash import _registry, _switches

# Fused dropout on the CUDA kernels (both families' dropout instantiations: cuda/gpu/
# dropout_fragments.h) is experimental: tested on the H200, but 1.5x the plain fwd+bwd at head
# dim 128 (cuda/PERF_NOTES.md v32), so off unless JAX_FLASH_CUDA_DROPOUT=on when jax_flash is
# imported. Off, the "cuda" implementation takes no dropout_rate (jax_flash._dispatch says to
# pass implementation="blockwise").
CUDA_DROPOUT_VARIABLE = "JAX_FLASH_CUDA_DROPOUT"
CUDA_DROPOUT_VALUES = ("off", "on")


def _read_cuda_dropout(value: str | None) -> bool:
  """Whether a value of JAX_FLASH_CUDA_DROPOUT turns the CUDA kernels' dropout on: unset or
  empty is "off"; an unknown value warns (naming the values) and means "off"."""
  return _switches.read_choice(CUDA_DROPOUT_VARIABLE, value, CUDA_DROPOUT_VALUES) == "on"


_CUDA_DROPOUT = _read_cuda_dropout(os.environ.get(CUDA_DROPOUT_VARIABLE))


def cuda_kernels_take_dropout() -> bool:
  """Whether the "cuda" implementation takes dropout_rate in this process
  (JAX_FLASH_CUDA_DROPOUT=on when jax_flash was imported; experimental)."""
  return _CUDA_DROPOUT

# The words of the seeds a kernel takes per (batch element, query head), in
# cuda/common/dropout_bits.h's DropoutSeedWord order: the key's two, the counter's head, batch,
# row and column words (the last two those of the kernel's first row and key); and the multiple
# a kernel's row and key offsets in the sequence must be (at_offset).
SEED_WORDS: int = _registry.KERNEL_CONSTANTS["dropout_seed_words"]
OFFSET_MULTIPLE: int = _registry.KERNEL_CONSTANTS["dropout_offset_multiple"]
_KEY0, _KEY1, _HEAD, _BATCH, _ROW_WORD, _COLUMN_WORD = range(6)
if SEED_WORDS != 6:  # (a native module of another layout: its seeds would be misread)
  raise ImportError(f"jax_flash._dropout reads 6 seed words; the native module has {SEED_WORDS}")

_MUL = (0xD2511F53, 0xCD9E8D57)
_BUMP = (0x9E3779B9, 0xBB67AE85)


def _mul_hi_lo(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
  """The high and low words of the 64-bit product of uint32 `a` and the constant `b`, in uint32
  arithmetic (JAX runs without 64-bit integers by default): 16-bit halves, carries added."""
  a0, a1 = a & 0xFFFF, a >> 16
  b0, b1 = jnp.uint32(b & 0xFFFF), jnp.uint32(b >> 16)
  p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
  middle = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
  high = p11 + (p01 >> 16) + (p10 >> 16) + (middle >> 16)
  return high, a * jnp.uint32(b)


def philox4x32_10(counter: tuple[jax.Array, ...], key: tuple[jax.Array, jax.Array]) -> tuple:
  """Philox4x32-10 of the four uint32 counter words (arrays broadcast together) under the two
  key words: four uint32 arrays."""
  c0, c1, c2, c3 = (jnp.asarray(c, jnp.uint32) for c in counter)
  k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
  for _ in range(10):
    hi0, lo0 = _mul_hi_lo(c0, _MUL[0])
    hi1, lo1 = _mul_hi_lo(c2, _MUL[1])
    c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    k0, k1 = k0 + jnp.uint32(_BUMP[0]), k1 + jnp.uint32(_BUMP[1])
  return c0, c1, c2, c3


def threshold(rate: float) -> int:
  """16-bit values below this drop their element, in [0, 2^16] (dropout_threshold in the
  header)."""
  return int(rate * 65536.0 + 0.5)


def key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two uint32 words of a JAX PRNG key (new-style typed keys and raw uint32[2] keys);
  other key implementations are rejected by name."""
  data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  if data.shape != (2,) or data.dtype != jnp.uint32:
    raise ValueError(f"dropout needs a single threefry PRNG key (two uint32 words); got key data of "
                     f"shape {data.shape} and dtype {data.dtype}")
  return data[0], data[1]


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def dropout_bits(key: jax.Array, batch: int, heads: int, seq_q: int, seq_k: int) -> jax.Array:
  """The 16 Philox bits of every score element: uint32 in [0, 2^16), (batch, heads, seq_q, seq_k)."""
  return bits_from_seeds(seeds(key, batch, heads), jnp.arange(seq_q), jnp.arange(seq_k))


def seeds(key: jax.Array, batch: int, heads: int, *, shared: bool = False) -> jax.Array:
  """What the kernels take per (batch element, query head): uint32 (batch, heads, SEED_WORDS),
  the key's two words and the counter's head and batch words (key0, key1, h, b), then its row
  and column words of the kernel's first row and key (0: the operands start the sequence;
  at_offset moves them). With `shared` every (b, h) gets head and batch words 0: one mask for
  the whole batch and every head (Flax's broadcast_dropout), that of keep_mask(key, rate, 1, 1,
  T, S)[0, 0]."""
  k0, k1 = key_words(key)
  shape = (batch, heads)
  h = jnp.broadcast_to(jnp.arange(heads, dtype=jnp.uint32)[None, :], shape)
  b = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.uint32)[:, None], shape)
  if shared:
    h, b = jnp.zeros(shape, jnp.uint32), jnp.zeros(shape, jnp.uint32)
  zero = jnp.zeros(shape, jnp.uint32)
  return jnp.stack([jnp.broadcast_to(k0, shape), jnp.broadcast_to(k1, shape), h, b, zero, zero],
                   axis=-1)


def at_offset(seed_words: jax.Array, row0, column0) -> jax.Array:
  """`seed_words` (..., SEED_WORDS) for a kernel whose operands start at row `row0` and key
  `column0` of the sequence the seeds were made for (ints or traced scalars, multiples of
  OFFSET_MULTIPLE: the caller checks that statically, e.g. chunk sizes), so that it draws the
  decisions of those places: a context-parallel block pair's (jax_flash._ring,
  jax_flash._all_gather). The row word moves by row0 / 2, the column word by column0 / 4 (the
  layout's 16 x 16 groups: 8 row words, 4 column words each)."""
  for name, offset in (("row0", row0), ("column0", column0)):
    if isinstance(offset, int) and offset % OFFSET_MULTIPLE:
      raise ValueError(f"dropout's {name}={offset} must be a multiple of {OFFSET_MULTIPLE}")
  shift = jnp.stack([jnp.asarray(row0 // 2, jnp.uint32), jnp.asarray(column0 // 4, jnp.uint32)])
  return seed_words.at[..., _ROW_WORD:].add(shift)


def bits_from_seeds(seed_words: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
  """The 16 Philox bits of query rows `rows` (T,) and keys `cols` (S,) (int positions, from the
  seeds' first row and key) under `seed_words` (..., SEED_WORDS) as seeds() makes them: uint32 in
  [0, 2^16), (..., T, S), dropout_bits.h's layout."""
  seed_words = seed_words[..., None, None, :]
  r = jnp.asarray(rows).astype(jnp.uint32)[:, None]
  c = jnp.asarray(cols).astype(jnp.uint32)[None, :]
  column_word = seed_words[..., _COLUMN_WORD] + (c // 16) * 4 + (c % 8) // 2
  row_word = seed_words[..., _ROW_WORD] + (r // 16) * 8 + r % 8
  words = philox4x32_10((column_word, row_word, seed_words[..., _HEAD], seed_words[..., _BATCH]),
                        (seed_words[..., _KEY0], seed_words[..., _KEY1]))
  index = 2 * ((r // 8) % 2) + (c // 8) % 2
  word = jnp.select([index == 0, index == 1, index == 2], words[:3], words[3])
  return jnp.where(c % 2 == 1, word >> 16, word & 0xFFFF)


def keep_from_seeds(seed_words: jax.Array, rate: float, rows: jax.Array,
                    cols: jax.Array) -> jax.Array:
  """The keep decisions of query rows `rows` (T,) and keys `cols` (S,) (int positions) under
  `seed_words` (..., SEED_WORDS) as seeds() makes them: bool (..., T, S). keep_mask(key, rate,
  B, N, T, S) is this of seeds(key, B, N), every row and every key; the "blockwise" path asks it
  for one key block at a time."""
  return bits_from_seeds(seed_words, rows, cols) >= jnp.uint32(threshold(rate))


def multipliers(seed_words: jax.Array, rate: float, rows: jax.Array, cols: jax.Array) -> jax.Array:
  """Z = keep / (1 - rate) as float32 (..., T, S): what dropout multiplies the normalised
  probabilities by (keep_from_seeds)."""
  keep = keep_from_seeds(seed_words, rate, rows, cols)
  return jnp.where(keep, jnp.float32(1.0 / (1.0 - rate)), jnp.float32(0.0))


def keep_mask(key: jax.Array, rate: float, batch: int, heads: int, seq_q: int, seq_k: int) -> jax.Array:
  """Which score elements fused dropout at `rate` keeps: bool (batch, heads, seq_q, seq_k), the
  kernels' own decisions (kept elements are scaled by 1 / (1 - rate))."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout rate must be in [0, 1); got {rate}")
  return dropout_bits(key, batch, heads, seq_q, seq_k) >= jnp.uint32(threshold(rate))
