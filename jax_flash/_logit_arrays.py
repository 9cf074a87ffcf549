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

from jax_flash import _switches

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
