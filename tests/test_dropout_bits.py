"""The random bits of fused dropout (issue 17 item 4): Philox4x32-10 in JAX (jax_flash/_dropout.py)
against the generator's published known-answer vectors, against the C++ header the kernels use
(cuda/common/dropout_bits.h, compiled here into a small program), and the keep rate's statistics."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash import _dropout

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Random123's known-answer vectors for philox4x32 with 10 rounds: (counter, key) -> output.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
  words = _dropout.philox4x32_10(tuple(jnp.uint32(c) for c in counter), tuple(jnp.uint32(k) for k in key))
  assert tuple(int(w) for w in words) == expected


def _compile(tmp_path, name: str):
  """tests/cpp/<name>.cc built against cuda/ (skips without a C++ compiler): the binary's path."""
  compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if compiler is None:
    pytest.skip("no C++ compiler")
  binary = tmp_path / name
  subprocess.run([compiler, "-std=c++17", "-O1", f"-I{ROOT / 'cuda'}",
                  str(ROOT / "tests" / "cpp" / f"{name}.cc"), "-o", str(binary)], check=True)
  return binary


def test_the_kernels_header_gives_the_same_bits(tmp_path):
  """Every element of a grid with odd sizes (rows past a 16-row group, columns past a 16-column
  group, odd columns)."""
  binary = _compile(tmp_path, "dropout_bits_check")
  key = jax.random.key(2024)
  k0, k1 = (int(w) for w in _dropout.key_words(key))
  shape = (2, 3, 37, 41)
  out = subprocess.run([str(binary), str(k0), str(k1), *map(str, shape)], check=True,
                       capture_output=True, text=True).stdout
  native = np.array(out.split(), np.uint64).reshape(shape)
  ours = np.asarray(_dropout.dropout_bits(key, *shape), np.uint64)
  np.testing.assert_array_equal(native, ours)


@pytest.mark.parametrize("offset", [(0, 0), (32, 4096)], ids=["start", "offset"])
@pytest.mark.parametrize("layout", ["forward", "transposed"])
@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_the_cuda_fragments_keep_the_references_elements(tmp_path, layout, rate, offset):
  """cuda/gpu/dropout_fragments.h, run for every lane of every 16-row warp tile (the CUDA kernels'
  accumulator layouts: the forward's S, the backward's transposed S^T), keeps exactly the elements
  the reference keeps, for one (batch, head) stream with nonzero head and batch words, at the
  sequence's start and with its row and column words moved (a context-parallel block's seeds:
  _dropout.at_offset)."""
  binary = _compile(tmp_path, "dropout_fragments_check")
  seed_words = _dropout.seeds(jax.random.key(11), 3, 5)[2, 3]  # (key0, key1, head 3, batch 2)
  seed_words = _dropout.at_offset(seed_words, *offset)
  seq_q, seq_k = 48, 80
  words = [str(int(w)) for w in seed_words]
  out = subprocess.run([str(binary), layout, *words, str(_dropout.threshold(rate)), str(seq_q), str(seq_k)],
                       check=True, capture_output=True, text=True).stdout
  native = np.array([[c == "1" for c in line] for line in out.split()])
  expected = np.asarray(_dropout.keep_from_seeds(seed_words, rate, jnp.arange(seq_q), jnp.arange(seq_k)))
  assert native.shape == expected.shape
  np.testing.assert_array_equal(native, expected)
  assert 0 < native.mean() < 1


def test_keep_rate_within_three_standard_errors():
  """Over 10^7 elements the kept fraction is 1 - rate within 3 standard errors, for each rate."""
  key = jax.random.key(7)
  shape = (4, 8, 512, 640)  # 10,485,760 elements
  count = np.prod(shape)
  bits = _dropout.dropout_bits(key, *shape)
  for rate in (0.1, 0.5, 0.9, 0.123456):
    kept = float(jnp.mean(bits >= jnp.uint32(_dropout.threshold(rate)), dtype=jnp.float32))
    stderr = np.sqrt(rate * (1 - rate) / count)
    assert abs(kept - (1 - rate)) < 3 * stderr, (rate, kept, stderr)


def test_masks_are_deterministic_and_depend_on_the_key():
  shape = (1, 2, 40, 24)
  a = _dropout.keep_mask(jax.random.key(1), 0.5, *shape)
  assert np.array_equal(a, _dropout.keep_mask(jax.random.key(1), 0.5, *shape))
  assert not np.array_equal(a, _dropout.keep_mask(jax.random.key(2), 0.5, *shape))
  # Neighbouring heads, batch elements, 16-row groups and 16-column groups get different bits,
  # and so do the eight elements of one Philox call (rows 8 apart, columns 1 and 8 apart).
  bits = np.asarray(_dropout.dropout_bits(jax.random.key(1), 2, 2, 32, 32))
  assert bits.max() < 2**16 and bits.max() >= 2**15
  assert not np.array_equal(bits[0, 0], bits[0, 1])
  assert not np.array_equal(bits[0, 0], bits[1, 0])
  assert not np.array_equal(bits[0, 0, :16], bits[0, 0, 16:])
  assert not np.array_equal(bits[0, 0, :, :16], bits[0, 0, :, 16:])
  group = bits[0, 0, :16, :16].reshape(2, 8, 2, 4, 2)  # (row half, r, column half, pair, parity)
  group = group.transpose(1, 3, 0, 2, 4).reshape(32, 8)  # the 32 calls' eight elements
  for i in range(8):
    for j in range(i):
      assert not np.array_equal(group[:, i], group[:, j]), (i, j)


@pytest.mark.parametrize("row0,column0", [(16, 0), (0, 48), (4096, 208), (0, 0)])
def test_seeds_at_an_offset_draw_that_places_bits(row0, column0):
  """Seeds moved to (row0, column0) (a context-parallel block's: _dropout.at_offset) give the
  bits the unmoved seeds give at rows row0 + i and keys column0 + j, every element of an odd
  grid (groups cut at both ends); traced offsets the same; offsets off the 16 x 16 groups are
  refused."""
  seed_words = _dropout.seeds(jax.random.key(5), 2, 3)
  rows, cols = jnp.arange(37), jnp.arange(41)
  want = _dropout.bits_from_seeds(seed_words, row0 + rows, column0 + cols)
  moved = _dropout.at_offset(seed_words, row0, column0)
  np.testing.assert_array_equal(_dropout.bits_from_seeds(moved, rows, cols), want)
  traced = jax.jit(_dropout.at_offset)(seed_words, jnp.int32(row0), jnp.int32(column0))
  np.testing.assert_array_equal(traced, moved)
  if row0 or column0:  # (a check that the move is seen at all)
    assert not np.array_equal(_dropout.bits_from_seeds(seed_words, rows, cols), want)
  for bad in ((8, 0), (0, 4)):
    with pytest.raises(ValueError, match="multiple of 16"):
      _dropout.at_offset(seed_words, *bad)


def test_rate_zero_keeps_everything_and_bad_rates_are_errors():
  assert bool(_dropout.keep_mask(jax.random.key(0), 0.0, 1, 1, 16, 16).all())
  for rate in (-0.1, 1.0, 1.5):
    with pytest.raises(ValueError, match="dropout rate"):
      _dropout.keep_mask(jax.random.key(0), rate, 1, 1, 4, 4)


def test_raw_and_typed_keys_agree_and_other_keys_are_refused():
  typed = jax.random.key(3)
  raw = jax.random.key_data(typed)
  assert np.array_equal(_dropout.dropout_bits(typed, 1, 1, 8, 8), _dropout.dropout_bits(raw, 1, 1, 8, 8))
  with pytest.raises(ValueError, match="two uint32 words"):
    _dropout.key_words(jnp.zeros((4,), jnp.uint32))
