"""The training text as bytes: which files, read into one array, split into training and
validation, and cut into (input, next-byte target) windows."""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Iterator

import numpy as np

from lm.config import Config

STDLIB_DIR = os.path.dirname(os.__file__)


def text_files(data: str | None, data_glob: str = "*.py") -> Iterator[str]:
  """The files to read, in a fixed order: `data` itself, the files matching `data_glob` in the
  folder `data` (recursively), or by default the standard library's own source, present on every
  machine with Python: its top-level ``*.py`` files first, then those of its packages
  (site-packages excluded)."""
  if data is None:
    yield from sorted(glob.glob(os.path.join(STDLIB_DIR, "*.py")))
    skip = {"site-packages", "dist-packages"}
    deeper = glob.glob(os.path.join(STDLIB_DIR, "*", "**", "*.py"), recursive=True)
    yield from sorted(p for p in deeper
                      if not skip & set(os.path.relpath(p, STDLIB_DIR).split(os.sep)))
  elif os.path.isdir(data):
    pattern = os.path.join(data, "**", data_glob)
    yield from sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  else:
    yield data


def read_bytes(data: str | None, data_glob: str, max_bytes: int) -> np.ndarray:
  """The text files of text_files concatenated into one uint8 array of at most max_bytes."""
  chunks, total = [], 0
  for path in text_files(data, data_glob):
    with open(path, "rb") as f:
      chunk = f.read(max_bytes - total)
    chunks.append(chunk)
    total += len(chunk)
    if total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def load_bytes(config: Config) -> np.ndarray:
  """The training text: at most max_data_bytes, and enough for two sequences."""
  data = read_bytes(config.data, config.data_glob, config.max_data_bytes)
  if len(data) < 2 * (config.seq_len + 1):
    raise ValueError(f"not enough text: {len(data)} bytes from {config.data or 'the stdlib'}")
  return data


def split_data(data: np.ndarray, config: Config) -> tuple[np.ndarray, np.ndarray]:
  """The last val_fraction of the bytes is held out for validation."""
  n_val = max(int(len(data) * config.val_fraction), config.seq_len + 1)
  return data[:-n_val], data[-n_val:]


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Inputs and next-byte targets, (len(starts), seq_len) int32 each."""
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  tokens = data[idx].astype(np.int32)
  return tokens[:, :-1], tokens[:, 1:]


def train_batch(data: np.ndarray, config: Config, step: int) -> tuple[np.ndarray, np.ndarray]:
  """The random training windows of `step`: a function of (seed, step) only, so the data order is
  the same in every run with that seed, whichever attention it uses and wherever it resumed."""
  rng = np.random.default_rng((config.seed, step))
  starts = rng.integers(0, len(data) - config.seq_len - 1, size=config.batch_size)
  return windows(data, starts, config.seq_len)


def val_batches(data: np.ndarray, config: Config) -> list[tuple[np.ndarray, np.ndarray]]:
  """A fixed set of evenly spaced validation windows, so losses compare across evaluations."""
  n = config.eval_batches * config.batch_size
  starts = np.linspace(0, len(data) - config.seq_len - 1, n).astype(np.int64)
  return [windows(data, s, config.seq_len) for s in np.split(starts, config.eval_batches)]


@dataclasses.dataclass
class Dataset:
  """The run's text, split, with its fixed validation batches."""

  train: np.ndarray
  val: np.ndarray
  val_batches: list[tuple[np.ndarray, np.ndarray]]

  @classmethod
  def load(cls, config: Config) -> Dataset:
    train_data, val_data = split_data(load_bytes(config), config)
    return cls(train_data, val_data, val_batches(val_data, config))
