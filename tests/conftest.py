"""pytest configuration of the jax_flash tests (helpers live in attention_testing.py)."""

from __future__ import annotations

import os
import zlib

# 8 host devices for the sharding tests; must be set before JAX initialises its backends.
_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()

import jax
import numpy as np
import pytest

import jax_flash


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
