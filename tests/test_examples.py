"""The README's main job, run as a user runs it: `python examples/train_lm.py` from the repository
root, a few steps of a tiny model, in a subprocess. It catches a broken import or flag in the
examples' library (examples/lm/) that no other test would see."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytest.importorskip("flax")
pytest.importorskip("optax")


def test_train_lm_runs_and_learns(tmp_path):
  out = tmp_path / "run"
  command = [
      sys.executable, "examples/train_lm.py", "--layers", "1", "--width", "32", "--heads", "2",
      "--seq-len", "64", "--batch-size", "4", "--steps", "12", "--eval-every", "12",
      "--eval-batches", "1", "--log-every", "4", "--sample-bytes", "8",
      "--max-data-bytes", "200000", "--learning-rate", "3e-3", "--no-progress", "--out", str(out)]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  metrics = json.loads((out / "metrics.json").read_text())
  assert metrics["config"]["attention"] == "jax_flash"
  summary = metrics["summary"]
  first, final = summary["first_train_loss"], summary["final_train_loss"]
  assert first == first and final == final, summary  # not NaN
  assert final < first, summary  # 12 steps at this rate move the byte loss down
