"""Loads the native extension and registers its XLA FFI targets with JAX, once, at import."""

from __future__ import annotations

import functools

import jax

try:
  from jax_flash import _native
except ImportError as e:  # pragma: no cover - only on broken installs
  raise ImportError(
      "jax_flash's native extension is missing; reinstall with `pip install -e .`"
  ) from e

_PLATFORM_NAMES = {"cpu": "cpu", "cuda": "CUDA"}


def _native_modules() -> list:
  modules = [_native]
  try:  # built only where a CUDA compiler was found; imports without a driver (static runtime)
    from jax_flash import _native_cuda
    modules.append(_native_cuda)
  except ImportError:
    pass
  return modules


def _register_all() -> dict[str, set[str]]:
  registered: dict[str, set[str]] = {}
  for module in _native_modules():
    for platform, targets in module.registrations().items():
      for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform=_PLATFORM_NAMES[platform])
      registered.setdefault(platform, set()).update(targets)
  return registered


REGISTERED = _register_all()


def has_platform(platform: str) -> bool:
  """Whether kernels for `platform` ("cpu" or "cuda") were built and registered."""
  return bool(REGISTERED.get(platform))


def cpu_kernel_isa() -> str:
  """The instruction set of the CPU kernel variant this processor runs."""
  return _native.cpu_kernel_isa()


@functools.cache
def cuda_gpu_present() -> bool:
  """Whether JAX has a CUDA device (asked lazily: it initialises JAX's backends)."""
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False
