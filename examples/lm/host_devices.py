"""Simulated CPU devices for the multi-device examples. Imports no JAX: it must run before JAX
initialises its backends."""

from __future__ import annotations

import os
import re


def force_host_device_count(n: int) -> None:
  """Sets XLA's simulated host device count; must run before JAX initialises its backends. It
  only affects the CPU platform: on GPU hosts the GPUs are still the default devices."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                 os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
