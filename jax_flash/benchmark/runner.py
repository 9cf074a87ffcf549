"""A run: every peer on every case, one pass after another, progress on stderr.

A peer that cannot run, or raises while building or running, is recorded with the reason and the
run goes on.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Sequence

from jax_flash.benchmark.cases import PASSES, Case, Inputs, make_inputs
from jax_flash.benchmark.measure import (MIB, TIME_BUDGET_S, Measurement, Prepare, RateUnit,
                                         check_fits, failure_reason, peak_bytes_in_use,
                                         run_timed, time_step)
from jax_flash.benchmark.peers import Peer
from jax_flash.benchmark.platforms import Platform

SKIPPED_REASON = "skipped (--skip)"


def log(line: str) -> None:
  """Prints a progress or warning line on stderr (stdout holds only the table)."""
  print(line, file=sys.stderr, flush=True)


def measure_peer(platform: Platform, peer: Peer, unavailable: str | None, case: Case,
                 inputs: Inputs, reps: int) -> list[Measurement]:
  """Both passes of one peer on one case; a peer that cannot run or raises is recorded so."""
  if unavailable is not None:
    return [Measurement(peer.name, case, p, "unavailable", unavailable) for p in PASSES]
  try:
    prepares = peer.build(case, inputs)
  except Exception as e:  # any failure of a peer is a result to report, not a crash
    return [Measurement(peer.name, case, p, "fails", failure_reason(e)) for p in PASSES]
  return [_measure_pass(platform, peer, case, p, prepares[p], reps) for p in PASSES]


def _measure_pass(platform: Platform, peer: Peer, case: Case, pass_name: str,
                  prepare: Prepare, reps: int) -> Measurement:
  """One pass: made ready (compiled), warmed up and timed; then the device's peak memory."""
  temp = None
  try:
    compiled = prepare()
    temp = compiled.temp_bytes
    check_fits(temp, platform.device_kind)
    times = tuple(t / compiled.calls_per_step
                  for t in time_step(compiled.step, platform.warm_up_runs, reps))
  except Exception as e:  # as above
    return Measurement(peer.name, case, pass_name, "fails", failure_reason(e), temp_bytes=temp,
                       peak_bytes=peak_bytes_in_use(platform.device_kind))
  return Measurement(peer.name, case, pass_name, "ok", times_s=times, temp_bytes=temp,
                     peak_bytes=peak_bytes_in_use(platform.device_kind))


def _case_progress(index: int, total: int, case: Case, results: Sequence[Measurement]) -> str:
  """One line per case: each peer's median milliseconds per pass."""
  parts = []
  for peer in dict.fromkeys(r.peer for r in results):
    cells = [f"{r.median_s * 1e3:.2f}" if r.ok else r.status for r in results if r.peer == peer]
    parts.append(f"{peer} {'/'.join(cells)}")
  causal = "Y" if case.causal else "N"
  return (f"[{index}/{total}] seq {case.seq} causal {causal}{_case_kind(case)} ms "
          f"({'/'.join(PASSES)}): " + ", ".join(parts))


def _case_kind(case: Case) -> str:
  """' heads 16/4' for a grouped-query case (query/key-value heads), ' blocks 25%' for a
  block-sparse one (the share of the dense FLOPs it computes), ' docs 16x1024' for a packed
  one; '' for the rest."""
  kind = "" if case.kv_heads is None else f" heads {case.heads_label}"
  if case.block_density is not None:
    kind += f" blocks {100 * case.computed_fraction():.1f}%"
  if case.documents is not None:
    kind += f" docs {case.documents}x{case.seq // case.documents}"
  return kind


def _pass_progress(index: int, total: int, measurement: Measurement, unit: RateUnit) -> str:
  """One line per peer and pass of a case: its median time and rate, or why it did not run."""
  m, case = measurement, measurement.case
  where = (f"[{index}/{total}] seq {case.seq} hdim {case.head_dim_label} "
           f"causal {'Y' if case.causal else 'N'}{_case_kind(case)} {m.peer} {m.pass_name}:")
  if m.ok:
    result = (f"{m.median_s * 1e3:.3f} ms {m.flop_rate(unit):.1f} {unit} "
              f"({len(m.times_s)} reps)")
  else:
    result = f"{m.status}: {m.reason}"
  memory = "".join(f", {what} {value / MIB:.1f} MiB"
                   for what, value in (("temp", m.temp_bytes), ("peak", m.peak_bytes))
                   if value is not None)
  return f"{where} {result}{memory}"


# A peer on a case: the peer, why it cannot run the case (None: it can), the case, its inputs.
Entry = tuple[Peer, str | None, Case, Inputs]


def measure_interleaved(platform: Platform, entries: Sequence[Entry],
                        reps: int) -> list[Measurement]:
  """Every entry's passes, timed in rounds: each round runs each (entry, pass) once, so load
  from other processes on a shared machine falls on all of them alike (the ratios hold where
  back-to-back timing would favour whoever ran in a quiet moment). Rounds: `reps`, or fewer
  (at least 3) so that they take about TIME_BUDGET_S per (entry, pass), judging by the warm-up
  round. The measurements come in the entries' order, PASSES each."""
  results: dict[tuple[int, str], Measurement] = {}
  ready = []  # (entry index, peer, case, pass, Compiled, warm-up seconds)
  for i, (peer, unavailable, case, inputs) in enumerate(entries):
    if unavailable is not None:
      for p in PASSES:
        results[(i, p)] = Measurement(peer.name, case, p, "unavailable", unavailable)
      continue
    try:
      prepares = peer.build(case, inputs)
    except Exception as e:  # any failure of a peer is a result to report, not a crash
      for p in PASSES:
        results[(i, p)] = Measurement(peer.name, case, p, "fails", failure_reason(e))
      continue
    for p in PASSES:
      try:
        compiled = prepares[p]()
        check_fits(compiled.temp_bytes, platform.device_kind)
        for _ in range(max(1, platform.warm_up_runs)):
          warm_s = run_timed(compiled.step)
        ready.append((i, peer, case, p, compiled, warm_s))
      except Exception as e:  # as above
        results[(i, p)] = Measurement(peer.name, case, p, "fails", failure_reason(e))
  # Each timed run repeats its step back to back for about Platform.min_run_s.
  repeats = {(i, p): max(1, math.ceil(platform.min_run_s / max(warm_s, 1e-9)))
             for i, _, _, p, _, warm_s in ready}
  round_s = sum(entry[5] * repeats[(entry[0], entry[3])] for entry in ready)
  rounds = max(min(reps, 3), min(reps, int(TIME_BUDGET_S * len(ready) / max(round_s, 1e-9))))
  times: dict[tuple[int, str], list[float]] = {(i, p): [] for i, _, _, p, _, _ in ready}
  for _ in range(rounds):
    for i, _, _, p, compiled, _ in ready:
      if platform.settle_s > 0:
        time.sleep(platform.settle_s)  # the last run's threads off the cores (Platform.settle_s)
      n = repeats[(i, p)]
      times[(i, p)].append(run_timed(lambda: [compiled.step() for _ in range(n)])
                           / (n * compiled.calls_per_step))
  for i, peer, case, p, compiled, _ in ready:
    results[(i, p)] = Measurement(peer.name, case, p, "ok", times_s=tuple(times[(i, p)]),
                                  temp_bytes=compiled.temp_bytes,
                                  peak_bytes=peak_bytes_in_use(platform.device_kind))
  return [results[(i, p)] for i in range(len(entries)) for p in PASSES]


def measure_case_interleaved(platform: Platform, peers: Sequence[Peer],
                             unavailable: dict[str, str | None], case: Case, inputs: Inputs,
                             reps: int) -> list[Measurement]:
  """Every peer's passes of one case, timed in rounds (measure_interleaved)."""
  return measure_interleaved(
      platform, [(peer, unavailable[peer.name], case, inputs) for peer in peers], reps)


def _interleave_groups(cases: Sequence[Case]) -> list[list[Case]]:
  """The cases timed together under `interleave`: a block-sparse case with its dense twin right
  after it (block_sparse_cases' order: their ratio is the figure that matters, so both are
  timed in the same rounds), every other case alone."""
  groups, i = [], 0
  while i < len(cases):
    twin = (cases[i].block_density is not None and i + 1 < len(cases)
            and cases[i + 1] == cases[i].dense())
    groups.append(list(cases[i:i + 2 if twin else i + 1]))
    i += 2 if twin else 1
  return groups


def run(platform: Platform, cases: Sequence[Case], reps: int,
        skip: Sequence[str] = (), interleave: bool = False) -> Iterator[list[Measurement]]:
  """Measures every peer on every case; yields each case's measurements once they are taken
  (under `interleave` a block-sparse case's and its dense twin's together). Peers named in
  `skip` are recorded as skipped, not run.

  Prints progress to stderr: a line per case, or a line per peer and pass as each peer finishes,
  as the platform says. `interleave` times each case's peers and passes in alternating rounds
  (measure_interleaved; a block-sparse case and its dense twin in the same rounds) instead of
  one after another. A peer that cannot run a kind of case (Peer.case_unavailable: block-sparse
  ones) is recorded unavailable for it.
  """
  everywhere = {peer.name: SKIPPED_REASON if peer.name in skip else peer.unavailable()
                for peer in platform.peers}

  def unavailable(peer: Peer, case: Case) -> str | None:
    return everywhere[peer.name] or peer.case_unavailable(case)

  def log_case(index: int, case: Case, results: Sequence[Measurement]) -> None:
    if platform.progress == "pass":
      for measurement in results:
        log(_pass_progress(index, len(cases), measurement, platform.rate_unit))
    else:
      log(_case_progress(index, len(cases), case, results))

  index = 0
  for group in _interleave_groups(cases) if interleave else [[case] for case in cases]:
    if interleave:
      results = measure_interleaved(
          platform, [(peer, unavailable(peer, case), case, make_inputs(case))
                     for case in group for peer in platform.peers], reps)
      for case in group:
        index += 1
        log_case(index, case, [m for m in results if m.case == case])
      yield results
      continue
    (case,) = group
    index += 1
    inputs = make_inputs(case)
    results = []
    for peer in platform.peers:
      peer_results = measure_peer(platform, peer, unavailable(peer, case), case, inputs, reps)
      if platform.progress == "pass":
        for measurement in peer_results:
          log(_pass_progress(index, len(cases), measurement, platform.rate_unit))
      results.extend(peer_results)
    if platform.progress == "case":
      log(_case_progress(index, len(cases), case, results))
    yield results
