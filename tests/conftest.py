"""pytest configuration of the jax_flash tests (helpers live in attention_testing.py)."""

from __future__ import annotations

import os
import zlib

# 8 host devices for the sharding tests; must be set before JAX initialises its backends.
_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()

# XLA compiles the tests' functions without its LLVM backend optimisations (where XLA_FLAGS does
# not choose a level): the tests' time is mostly compiling many small functions, and this cuts
# the compile time of the blockwise path's and jax.nn's gradients by about 2x (user time of 48
# such compiles on the CI machine: 25.6 s -> 12.6 s). It changes no semantics (no fast math):
# results differ by float32 round-off at most, as tests/differential.py's references, compiled
# the same way, showed. The native kernels are built by CMake (-O3) and are not affected.
_OPT_FLAG = "--xla_backend_optimization_level"
if _OPT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"] + f" {_OPT_FLAG}=0"

import jax
import numpy as np
import pytest

import jax_flash


# The tests run in worker processes (pytest-xdist, one file per worker at a time) on a machine
# without an NVIDIA driver: their time is mostly XLA compiling many small functions, one core
# each. With a driver they run in this process, as before: every process would take its own
# share of the GPU's memory (JAX preallocates 75% of it), and the GPU scripts run them in one.
MAX_TEST_WORKERS = 4


def _worker_count() -> int:
  """How many worker processes the tests get when the command line does not say (-n): one per
  core this process may use (at most MAX_TEST_WORKERS), none with an NVIDIA driver present."""
  if os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version"):
    return 0
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  workers = min(cores or 1, MAX_TEST_WORKERS)
  return workers if workers > 1 else 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """`pytest tests` runs in _worker_count() processes when pytest-xdist is installed and the
  command line gives no -n (`-n 0` or `-p no:xdist`: one process). Files stay whole on a worker
  (--dist loadfile), in collection order (the module-level caches of compiled functions are
  shared within a file; the last files are short ones, so the workers finish together). Not
  with --collect-only, --pdb or -s."""
  if (not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER")
      or config.option.numprocesses is not None or config.option.collectonly
      or config.option.usepdb or config.option.capture == "no"):
    return
  workers = _worker_count()
  if not workers:
    return
  config.option.numprocesses = workers
  if config.option.dist == "no":
    config.option.dist = "loadfile"
    config.option.loadscopereorder = False  # xdist >= 3.6 would sort the files by test count


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu")) and jax_flash.has_platform("cuda")
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  """Tests marked `gpu` need an NVIDIA GPU and the CUDA kernels; skip them otherwise."""
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU and a jax_flash build with CUDA kernels")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def rng(request) -> np.random.Generator:
  """A numpy Generator seeded from the test's id: reproducible, different per test."""
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
