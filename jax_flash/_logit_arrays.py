"""jax.nn's bias and mask arrays on the CUDA kernels: the switch and the operands.

The Hopper kernels' kLogitArrays instantiations (cuda/gpu/logit_arrays.cuh) read both where they
lie, as the CPU kernel does; experimental (written without a GPU in session 33, not yet run), so
the "cuda" implementation takes them only under JAX_FLASH_CUDA_LOGIT_ARRAYS=on when jax_flash is
imported. Off, jax_flash._dispatch refuses them on "cuda" and names implementation="blockwise".
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jax_flash import _registry, _switches

CUDA_LOGIT_ARRAYS_VARIABLE = "JAX_FLASH_CUDA_LOGIT_ARRAYS"
CUDA_LOGIT_ARRAYS_VALUES = ("off", "on")


def _read_cuda_logit_arrays(value: str | None) -> bool:
  """Whether a value of JAX_FLASH_CUDA_LOGIT_ARRAYS turns the CUDA kernels' bias and mask arrays
  on: unset or empty is "off"; an unknown value warns (naming the values) and means "off"."""
  return _switches.read_choice(CUDA_LOGIT_ARRAYS_VARIABLE, value, CUDA_LOGIT_ARRAYS_VALUES) == "on"


_CUDA_LOGIT_ARRAYS = _read_cuda_logit_arrays(os.environ.get(CUDA_LOGIT_ARRAYS_VARIABLE))


def cuda_kernels_take_logit_arrays() -> bool:
  """Whether the "cuda" implementation takes `bias` and `mask` arrays in this process
  (JAX_FLASH_CUDA_LOGIT_ARRAYS=on when jax_flash was imported; experimental)."""
  return _CUDA_LOGIT_ARRAYS


def cuda_bias(bias: jax.Array, dtype) -> jax.Array:
  """The bias as the CUDA kernels read it: float32 or the inputs' 16-bit `dtype` as it is, any
  other float dtype cast to float32 (exact: every 16-bit float is a float32)."""
  if bias.dtype in (jnp.dtype(jnp.float32), jnp.dtype(dtype)):
    return bias
  return bias.astype(jnp.float32)


def block_mask_of(mask: jax.Array, rows: int, keys: int) -> jax.Array:
  """The block mask (..., N|1, Tb, Sb) of a bool mask (..., N|1, T|1, S|1): a block is live where
  some element of the mask in it is True (rows x keys blocks, the last ones partial), so that the
  kernels skip the blocks the mask hides whole. A dim of size 1 stays 1."""
  *lead, t, s = mask.shape
  tb = -(-t // rows) if t > 1 else 1
  sb = -(-s // keys) if s > 1 else 1
  pad = [(0, 0)] * len(lead) + [(0, tb * rows - t if t > 1 else 0), (0, sb * keys - s if s > 1 else 0)]
  padded = jnp.pad(mask, pad)
  shape = (*lead, tb, rows if t > 1 else 1, sb, keys if s > 1 else 1)
  return jnp.any(padded.reshape(shape), axis=(-3, -1))


# The CUDA kernels read a mask as bits in the order their score fragments hold them
# (cuda/gpu/logit_arrays.cuh mask_bits_word): a row's keys in groups of MASK_BITS_GROUP (128),
# each group MASK_BITS_WORDS (4) uint32 words, word q holding bit 2 nt + c for key
# 128 g + 8 nt + 2 q + c (nt < 16, c < 2): a thread with quad lane q reads its two rows' bits of
# a 128-key block as two words. Both sizes are the native module's (common/attention_params.h).
MASK_BITS_GROUP = int(_registry.KERNEL_CONSTANTS["mask_bits_group"])
MASK_BITS_WORDS = int(_registry.KERNEL_CONSTANTS["mask_bits_words"])


def cuda_mask_bits(mask: jax.Array, seq_q: int, seq_k: int, transposed: bool = False) -> jax.Array:
  """A bool mask (..., N|1, T|1, S|1) packed as the CUDA kernels read it: uint32 (..., N|1,
  R|1, ceil(C / 128) * 4) with rows R and columns C the queries T = seq_q and keys S = seq_k
  (the forward's order), or with `transposed` the keys and queries (the backward's: its tiles
  hold keys in rows); bit 2 nt + c of word 4 g + q is column 128 g + 8 nt + 2 q + c, columns
  past C false. A column dim of size 1 is broadcast to C first (T S / 8 bytes at most); a row
  dim of 1 stays 1. Formed by XLA beside each pass's call: 1/8 of the bool mask's bytes."""
  rows, columns = (seq_k, seq_q) if transposed else (seq_q, seq_k)
  if transposed:
    mask = jnp.swapaxes(mask, -1, -2)
  *lead, r, c = mask.shape
  assert r in (1, rows) and c in (1, columns), (mask.shape, rows, columns)
  groups = -(-columns // MASK_BITS_GROUP)
  mask = jnp.broadcast_to(mask, (*lead, r, columns))
  mask = jnp.pad(mask, [(0, 0)] * (len(lead) + 1) + [(0, groups * MASK_BITS_GROUP - columns)])
  # (.., g, nt, q, c) -> (.., g, q, nt, c): each word's 32 bits in order.
  bits = mask.reshape(*lead, r, groups, MASK_BITS_GROUP // (2 * MASK_BITS_WORDS), MASK_BITS_WORDS, 2)
  bits = jnp.swapaxes(bits, -3, -2).reshape(*lead, r, groups * MASK_BITS_WORDS, 32)
  weights = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
  return jnp.sum(jnp.where(bits, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)

