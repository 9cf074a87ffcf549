"""The Hopper forward's wgmma building blocks (shared tiles, descriptors, register fragments)
against a host reference, apart from attention: builds and runs tests/cuda/wgmma_layout_check.cu.
Marked `gpu`; skipped without nvcc or a compute capability 9.x GPU."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import jax
import pytest

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_wgmma_layouts(tmp_path):
  nvcc = shutil.which("nvcc")
  if nvcc is None:
    pytest.skip("no nvcc")
  try:
    gpu = jax.devices("gpu")[0]
  except RuntimeError:
    pytest.skip("no GPU")
  if not str(gpu.compute_capability).startswith("9."):
    pytest.skip("wgmma needs compute capability 9.x")
  binary = tmp_path / "wgmma_layout_check"
  subprocess.run([nvcc, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                  "--expt-relaxed-constexpr", f"-I{ROOT / 'cuda'}",
                  str(ROOT / "tests" / "cuda" / "wgmma_layout_check.cu"), "-o", str(binary)],
                 check=True, capture_output=True, timeout=300)
  result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr
