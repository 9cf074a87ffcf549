"""The table's layout: a row per case and pass, columns that say how a row fills each cell."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from jax_flash.benchmark.cases import Case
from jax_flash.benchmark.measure import MIB, Measurement, RateUnit
from jax_flash.benchmark.peers import Peer


@dataclasses.dataclass(frozen=True)
class Row:
  """One table row: one pass of one case, with every peer's measurement by peer name."""

  case: Case
  pass_name: str
  results: Mapping[str, Measurement]


@dataclasses.dataclass(frozen=True)
class Column:
  """A table column: its header and how a row fills its cell."""

  header: str
  cell: Callable[[Row], str]


SEQ_COLUMN = Column("seq", lambda row: str(row.case.seq))
# Runs given --heads or --kv-heads: the query heads, "N/K" with K key/value heads ("16/4";
# grouped-query attention). Other runs' tables have no such column.
HEADS_COLUMN = Column("heads", lambda row: row.case.heads_label)
# The head dim, "H/Hv" in a run with a value head dim (--value-head-dim: "192/128").
HEAD_DIM_COLUMN = Column("hdim", lambda row: row.case.head_dim_label)
CAUSAL_COLUMN = Column("causal", lambda row: "Y" if row.case.causal else "N")
PASS_COLUMN = Column("pass", lambda row: row.pass_name)
# Block-sparse runs: the share of the dense FLOPs a row's case computes ("dense": no block mask).
BLOCKS_COLUMN = Column("blocks", lambda row: "dense" if row.case.block_density is None
                       else f"{100 * row.case.computed_fraction():.1f}%")
# Packed-document runs: the documents of a row and their length ("16x1024").
DOCUMENTS_COLUMN = Column("docs", lambda row: "-" if row.case.documents is None
                          else f"{row.case.documents}x{row.case.seq // row.case.documents}")


def _ok_cell(measurement: Measurement, value: Callable[[Measurement], str]) -> str:
  """The value of a measurement that ran, else its status."""
  return value(measurement) if measurement.ok else measurement.status


def time_column(peer: Peer) -> Column:
  """The peer's median milliseconds."""
  return Column(f"{peer.name} ms",
                lambda row: _ok_cell(row.results[peer.name], lambda m: f"{m.median_s * 1e3:.2f}"))


def rate_column(peer: Peer, unit: RateUnit, header: str | None = None) -> Column:
  """The peer's FLOP rate in `unit` (header "<name> <unit>" unless given)."""
  return Column(header or f"{peer.name} {unit}",
                lambda row: _ok_cell(row.results[peer.name], lambda m: f"{m.flop_rate(unit):.1f}"))


def ratio_column(subject: Peer, peer: Peer, header: str | None = None) -> Column:
  """How many times faster the subject is than the peer (the peer's time over the subject's;
  header "<subject label>/<peer label>" unless given)."""

  def cell(row: Row) -> str:
    mine, theirs = row.results[subject.name], row.results[peer.name]
    if not (mine.ok and theirs.ok):
      return "-"
    return f"{theirs.median_s / mine.median_s:.2f}x"

  return Column(header or f"{subject.label}/{peer.label}", cell)


def temp_column(peer: Peer) -> Column:
  """XLA's compiled temp memory of the peer's pass, MiB."""

  def cell(row: Row) -> str:
    temp = row.results[peer.name].temp_bytes
    return "-" if temp is None else f"{temp / MIB:.1f}"

  return Column(f"temp MiB {peer.label}", cell)


def peak_fraction_column(peer: Peer, peak_flops_per_s: float) -> Column:
  """The peer's FLOP rate as a share of a measured peak (FLOP/s) of the whole machine."""

  def cell(row: Row) -> str:
    m = row.results[peer.name]
    return _ok_cell(m, lambda m: f"{100 * m.case.flops(m.pass_name) / m.median_s / peak_flops_per_s:.0f}%")

  return Column(f"{peer.label} % FMA peak", cell)
