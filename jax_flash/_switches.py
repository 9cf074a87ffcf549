"""The environment variables that switch jax_flash's experimental CUDA paths, read once at import
(JAX_FLASH_CUDA_DECODE, JAX_FLASH_CUDA_DROPOUT, JAX_FLASH_CUDA_LOGIT_ARRAYS; the native module
reads its own JAX_FLASH_CUDA_* kernel choices)."""

from __future__ import annotations

import warnings


def read_choice(variable: str, value: str | None, choices: tuple[str, ...]) -> str:
  """The choice a value of `variable` names: unset or empty is the first of `choices` (the
  default); an unknown value warns, naming the choices, and means the default."""
  if not value:
    return choices[0]
  if value not in choices:
    warnings.warn(f"{variable}={value!r} is not one of {choices}; using {choices[0]!r}", stacklevel=3)
    return choices[0]
  return value
