"""Where the figures came from: the versions and machine facts recorded beside them."""

from __future__ import annotations

import datetime
import importlib.metadata
import sys

import jax

import jax_flash
from jax_flash.benchmark.machine import cpu_model, cpu_vector_flags, usable_cores
from jax_flash.benchmark.platforms import Platform


def package_version(name: str) -> str | None:
  """The installed version of the distribution `name`, None where it is not installed."""
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def cpu_fma_peak_gflops_per_core() -> float | None:
  """One core's float32 FMA peak, GFLOP/s, measured by the native micro-benchmark (the best of
  a few short runs of independent FMA chains in the kernel's ISA variant); None where this
  build has none."""
  try:
    from jax_flash import _native
  except ImportError:
    return None
  measure = getattr(_native, "cpu_fma_peak_gflops", None)
  if measure is None:
    return None
  return max(float(measure()) for _ in range(5))


def accelerator_packages() -> dict[str, str]:
  """Versions of the installed JAX CUDA plugins and NVIDIA library wheels (cuDNN, cuBLAS...)."""
  versions = {}
  for distribution in importlib.metadata.distributions():
    name = distribution.metadata["Name"] or ""
    if name.lower().replace("_", "-").startswith(("jax-cuda", "nvidia-")):
      versions[name] = distribution.version
  return dict(sorted(versions.items()))


def environment(platform: Platform) -> dict[str, object]:
  """Versions and machine facts that go with the measurements."""
  devices = jax.devices(platform.device_kind)
  return dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      platform=platform.name,
      python=sys.version.split()[0],
      jax=jax.__version__,
      jaxlib=importlib.metadata.version("jaxlib"),
      jax_flash=jax_flash.__version__,
      jax_backend=jax.default_backend(),
      device_kind=devices[0].device_kind,
      device_count=len(devices),
      accelerator_packages=accelerator_packages(),
      cpu_kernel_isa=jax_flash.cpu_kernel_isa(),
      cpu_model=cpu_model(),
      cpu_count=usable_cores(),
      cpu_vector_flags=cpu_vector_flags(),
      cpu_fma_peak_gflops_per_core=(cpu_fma_peak_gflops_per_core()
                                    if platform.name == "cpu" else None),
      torch=package_version("torch"),
      tokamax=package_version("tokamax"),
  )
