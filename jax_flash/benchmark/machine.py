"""Facts about the host machine that the measurements depend on: the processor, its vector
features, and the cores this process may run on."""

from __future__ import annotations

import os
import pathlib


def cpu_model() -> str | None:
  """The processor's model name from /proc/cpuinfo, where there is one."""
  try:
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return None
  return next((line.split(":", 1)[1].strip() for line in lines
               if line.startswith("model name")), None)


def usable_cores() -> int:
  """The cores this process may run on (its affinity, e.g. under taskset), else the machine's."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def cpu_vector_flags() -> list[str]:
  """The processor's AVX-512 and AMX feature flags from /proc/cpuinfo (which kernel variants and
  16-bit dot products it can run), empty where there are none or no /proc/cpuinfo."""
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return []
  flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                if line.startswith("flags")), [])
  return sorted(flag for flag in flags if flag.startswith(("avx512", "amx", "avx_vnni")))
