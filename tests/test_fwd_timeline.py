"""The Hopper forward's timeline reader (.ci/gpu/fwd_timeline.py), on records built here: the
debug build that writes them (CMake JAX_FLASH_CUDA_TIMELINE, cuda/sm90/fwd_timeline.h) runs only
on a GPU, so its decoding and the phases it reports are checked against entries whose cycles are
known."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def timeline():
  spec = importlib.util.spec_from_file_location("fwd_timeline", ROOT / ".ci" / "gpu" / "fwd_timeline.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def event_names() -> list[str]:
  """kFwdEventNames as the header spells them (what the native module reports)."""
  header = (ROOT / "cuda" / "sm90" / "fwd_timeline.h").read_text()
  body = re.search(r"kFwdEventNames\[\] = \{(.*?)\};", header, re.S).group(1)
  return re.findall(r'"([a-z_]+)"', body)


def record(start_clock: int, entries: list[tuple[int, str, int]]) -> np.ndarray:
  """A recorder's words: its start clock, then (cycles << 32 | arg << 8 | event), then a zero."""
  names = event_names()
  words = [start_clock] + [cycles << 32 | arg << 8 | names.index(name) for cycles, name, arg in entries] + [0, 7]
  return np.array(words, dtype=np.uint64)


def tile_of_two_blocks(shift: int) -> list[tuple[int, str, int]]:
  """One tile of three key blocks: its first block, then two loop iterations of known phases."""
  entries = [(5 + shift, "tile_ready", 0), (10 + shift, "tile", 3), (100 + shift, "first_s", 0),
             (300 + shift, "converted", 0)]
  cycles = 300 + shift
  for block in (1, 2):
    for name, step in (("key_full", 5), ("turn", 20), ("issued", 30), ("scores", 200), ("masked", 10),
                       ("maxed", 100), ("softmax", 300), ("output", 50), ("converted", 100)):
      cycles += step
      entries.append((cycles, name, block))
  entries += [(cycles + 300, "store_start", 0), (cycles + 350, "store_synced", 0), (cycles + 380, "store_written", 0),
              (cycles + 400, "store_end", 0)]
  return entries


def test_the_header_names_every_event_the_reader_uses(timeline):
  assert set(timeline.LOOP_EVENTS) <= set(event_names())
  assert event_names()[0] == "none"


def test_phases_of_a_tile(timeline):
  start, entries = timeline.decode(record(1000, tile_of_two_blocks(0)), event_names())
  assert start == 1000 and len(entries) == 4 + 18 + 4  # up to the zero, not past it
  summary = timeline.summarise(entries)
  pairs = summary["pairs"]
  assert pairs["loop scores->masked"] == [10, 10]
  assert pairs["loop maxed->softmax"] == [300, 300]
  assert pairs["loop converted->key_full"] == [5, 5]
  assert pairs["first_s->converted"] == [200]
  assert pairs["store_synced->store_written"] == [30]
  assert summary["periods"] == [815, 815]  # conversion to conversion
  assert summary["blocks_per_tile"] == [3]
  assert summary["total"] == 300 + 2 * 815 + 400 - 10  # from the tile to its store's end


def test_a_chain_record(timeline):
  """A CHAIN build's record (cuda/sm90/fwd_timeline.h fwd_event_recorded level 3: of each block
  only S in, the exponentials done and the conversion): the pairs are the warpgroup's own chain."""
  kept = {"scores", "softmax", "converted"}
  entries = [e for e in tile_of_two_blocks(0) if e[2] == 0 or e[1] in kept]
  start, decoded = timeline.decode(record(1000, entries), event_names())
  summary = timeline.summarise(decoded)
  pairs = summary["pairs"]
  assert pairs["loop converted->scores"] == [255, 255]  # the next turn, the products' issue, S's wait
  assert pairs["loop scores->softmax"] == [410, 410]
  assert pairs["loop softmax->converted"] == [150, 150]
  assert summary["periods"] == [815, 815]


def test_softmaxes_beside_each_other(timeline):
  names = event_names()
  start_a, a = timeline.decode(record(1000, tile_of_two_blocks(0)), names)
  start_b, b = timeline.decode(record(1200, tile_of_two_blocks(0)), names)
  mine = timeline.intervals(a, start_a, "scores", "softmax")
  other = timeline.intervals(b, start_b, "scores", "softmax")
  assert [y - x for x, y in mine] == [410, 410]
  # The second recorder started 200 cycles later: each softmax overlaps its twin by 210.
  assert timeline.overlap(mine, other) == 2 * 210
  assert timeline.overlap(mine, []) == 0
