"""The collectives of a compiled SPMD step, read from its HLO text: their kind, the mesh axes
they run over, how many and how many bytes (train_lm_sharded.py --dump-collectives)."""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import numpy as np
from jax.sharding import Mesh


_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)"
    r"(?:-start)?\((.*)$", re.M)
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")


def _iota(dims: str, perm: str | None) -> np.ndarray:
  """XLA's iota device list: iota(dims), transposed by perm."""
  ids = np.arange(math.prod(int(s) for s in dims.split(","))).reshape(
      [int(s) for s in dims.split(",")])
  return ids.transpose([int(s) for s in perm.split(",")]) if perm else ids


def _groups(attrs: str) -> list[list[int]] | None:
  """Device groups of a collective, from its replica_groups (explicit, iota or mesh-axes form)
  or, for a collective-permute, its source-target pairs."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\]"
                r"(?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", attrs)
  if m:  # mesh['a'=2,'b'=4], device_ids=([..]T(..)) {'b'}: groups span the listed axes
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    sizes = [int(n) for _, n in axes]
    ids = (_iota(m.group(2), m.group(3)) if m.group(2) else np.arange(math.prod(sizes)))
    ids = ids.reshape(sizes)
    reduced = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m.group(4)]
    kept = [i for i in range(len(axes)) if i not in reduced]
    size = math.prod(sizes[i] for i in reduced)
    return ids.transpose(kept + reduced).reshape(-1, size).tolist()
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    return _iota(m.group(2), m.group(3)).reshape([int(s) for s in m.group(1).split(",")]).tolist()
  m = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,{}]*\})\}", attrs)
  if m:
    return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  return None


def _axes_of(groups: list[list[int]] | None, mesh: Mesh) -> str:
  """The mesh axes along which a collective's groups vary (device id = position in the mesh)."""
  if not groups:
    return "?"
  varying = set()
  for g in groups:
    coords = np.array([np.unravel_index(i, mesh.devices.shape) for i in g])
    if len(coords) > 1:
      varying |= {mesh.axis_names[a] for a in np.flatnonzero(np.ptp(coords, axis=0))}
  return "+".join(a for a in mesh.axis_names if a in varying) or "none"


def _nbytes(shape: str) -> int:
  """Bytes of the arrays in an HLO result shape (a tuple for combined collectives)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype) or 8)
    total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
  return total


def dump_collectives(compiled: Any, mesh: Mesh, path: str) -> None:
  """Counts the collectives of the compiled step by kind and by the mesh axes they span, prints
  them, and writes the step's HLO text to `path`."""
  hlo = compiled.as_text()
  with open(path, "w") as f:
    f.write(hlo)
  count: Counter = Counter()
  size: Counter = Counter()
  for m in _COLLECTIVE.finditer(hlo):
    shape, op, attrs = m.groups()
    key = (op, _axes_of(_groups(attrs), mesh))
    count[key] += 1
    size[key] += _nbytes(shape)
  print(f"collectives in the compiled train step, per device (HLO written to {path}):")
  if not count:
    print("  none")
  for key in sorted(count):
    op, axes = key
    print(f"  {op:20s} over {axes:12s} x{count[key]:<3d} {size[key] / 2**10:10,.1f} KiB")

