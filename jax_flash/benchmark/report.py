"""What a run leaves behind: the derived backward rows, the markdown table, results.json."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence

from jax_flash.benchmark.cases import Case
from jax_flash.benchmark.columns import Row
from jax_flash.benchmark.measure import Measurement
from jax_flash.benchmark.platforms import Platform

# Table rows per case: the measured passes and the backward alone, derived from them.
TABLE_PASSES = ("fwd", "bwd", "fwd+bwd")


def with_backward(measurements: Sequence[Measurement]) -> list[Measurement]:
  """The measurements plus, per peer and case, the backward pass alone: its time is the median
  fwd+bwd time less the median fwd time (both taken in this run), marked as derived."""
  by_key = {(m.peer, m.case, m.pass_name): m for m in measurements}
  derived = []
  for m in measurements:
    if m.pass_name != "fwd+bwd":
      continue
    forward = by_key.get((m.peer, m.case, "fwd"))
    if forward is None:
      continue
    if not (m.ok and forward.ok):
      failed = m if not m.ok else forward
      derived.append(Measurement(m.peer, m.case, "bwd", failed.status, failed.reason))
      continue
    backward_s = m.median_s - forward.median_s
    if backward_s <= 0:
      derived.append(Measurement(m.peer, m.case, "bwd", "fails",
                                 "fwd+bwd no slower than fwd: no backward time to derive"))
      continue
    derived.append(Measurement(m.peer, m.case, "bwd", "ok",
                               "derived: median fwd+bwd time - median fwd time",
                               times_s=(backward_s,)))
  return [*measurements, *derived]


def format_table(platform: Platform, measurements: Sequence[Measurement],
                 caption: str | None = None) -> str:
  """A markdown table in the platform's columns, one row per case and pass, then one note per
  distinct reason a peer did not run; `caption` (the machine, on the CPU) above it."""
  by_row: dict[tuple[Case, str], dict[str, Measurement]] = {}
  for m in measurements:
    by_row.setdefault((m.case, m.pass_name), {})[m.peer] = m
  rows = [Row(case, pass_name, by_row[(case, pass_name)])
          for case in dict.fromkeys(m.case for m in measurements) for pass_name in TABLE_PASSES
          if (case, pass_name) in by_row]
  lines = [caption, ""] if caption else []
  lines += ["| " + " | ".join(c.header for c in platform.columns) + " |",
           "|" + "---|" * len(platform.columns)]
  lines += ["| " + " | ".join(c.cell(row) for c in platform.columns) + " |" for row in rows]
  return "\n".join(lines + _notes(measurements))


def block_sparse_speedups(measurements: Sequence[Measurement], peer: str = "jax_flash") -> str:
  """One line per block-sparse case that `peer` ran beside its dense twin (no block mask, the
  same run): how many times faster the block-sparse case ran, per pass ("" without such cases).
  The measurements include the derived bwd rows (with_backward)."""
  by_key = {(m.case, m.pass_name): m for m in measurements if m.peer == peer and m.ok}
  lines = []
  for case in dict.fromkeys(m.case for m in measurements if m.case.block_density is not None):
    ratios = [f"{p} {by_key[(case.dense(), p)].median_s / by_key[(case, p)].median_s:.2f}x"
              for p in TABLE_PASSES if (case, p) in by_key and (case.dense(), p) in by_key]
    if ratios:
      lines.append(f"- {peer} block-sparse ({100 * case.computed_fraction():.1f}% of the blocks, "
                   f"density {case.block_density:g}) against dense, seq {case.seq} hdim "
                   f"{case.head_dim_label} causal {'Y' if case.causal else 'N'}: "
                   f"{', '.join(ratios)} faster")
  return "\n".join(lines)


def _notes(measurements: Sequence[Measurement]) -> list[str]:
  """One line per distinct reason a peer did not run."""
  reasons = dict.fromkeys((m.peer, m.status, m.reason) for m in measurements if not m.ok)
  if not reasons:
    return []
  return [""] + [f"- {peer} {status}: {reason}" for peer, status, reason in reasons]


def write_results(out_dir: pathlib.Path, env: Mapping[str, object],
                  settings: Mapping[str, object], measurements: Sequence[Measurement],
                  table: str) -> None:
  """Writes results.json (environment, settings, every measurement) and table.md."""
  out_dir.mkdir(parents=True, exist_ok=True)
  results = dict(environment=env, settings=settings,
                 measurements=[m.to_json() for m in measurements])
  _write_whole(out_dir / "results.json", json.dumps(results, indent=2) + "\n")
  _write_whole(out_dir / "table.md", table + "\n")


def _write_whole(path: pathlib.Path, text: str) -> None:
  """Replaces the file at once, so that a run killed while writing leaves the previous one."""
  partial = path.with_name(path.name + ".partial")
  partial.write_text(text)
  partial.replace(path)
