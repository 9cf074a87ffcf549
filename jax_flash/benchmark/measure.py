"""How a pass is measured: compiled, timed (median of repetitions) and its memory read; and the
record of one measurement."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Literal

import jax

from jax_flash.benchmark.cases import Case

# Time one peer may spend repeating one pass of one case; slow peers get fewer repetitions.
TIME_BUDGET_S = 5.0
# Calls launched back to back per timed step on an accelerator (see Compiled).
ACCELERATOR_CALLS_PER_STEP = 10
MIB = 2**20
# Failure reasons longer than this (a compiler's one-line dump) are cut.
REASON_MAX_CHARS = 300

# A step runs one pass to completion (results ready) and returns nothing.
Step = Callable[[], None]
# "unavailable": the peer cannot run here; "fails": it raised while building or running.
Status = Literal["ok", "unavailable", "fails"]
RateUnit = Literal["GFLOP/s", "TFLOP/s"]
RATE_SCALE: dict[str, float] = {"GFLOP/s": 1e9, "TFLOP/s": 1e12}


@dataclasses.dataclass(frozen=True)
class Compiled:
  """A pass ready to run: its step, XLA's compiled temp bytes (None for a peer that is not
  an XLA program), and how many calls of the pass one step makes (a step on an accelerator
  launches several calls back to back and waits once, so host dispatch and synchronisation do
  not pad the time of short kernels)."""

  step: Step
  temp_bytes: int | None
  calls_per_step: int = 1


# Makes one pass of a case ready to run (compiling it, for a JAX peer).
Prepare = Callable[[], Compiled]


@dataclasses.dataclass(frozen=True)
class Measurement:
  """One peer's result for one pass of one case."""

  peer: str
  case: Case
  pass_name: str
  status: Status
  reason: str = ""
  times_s: tuple[float, ...] = ()
  temp_bytes: int | None = None
  peak_bytes: int | None = None

  @property
  def ok(self) -> bool:
    """Whether the pass ran (and has times)."""
    return self.status == "ok"

  @property
  def median_s(self) -> float:
    """The median of the timed runs, seconds."""
    return statistics.median(self.times_s)

  def flop_rate(self, unit: RateUnit) -> float:
    """FLOPs per second of the median run, in `unit`."""
    return self.case.flops(self.pass_name) / self.median_s / RATE_SCALE[unit]

  def to_json(self) -> dict[str, object]:
    """The record results.json holds for this measurement."""
    record: dict[str, object] = {
        "peer": self.peer, **dataclasses.asdict(self.case), "pass": self.pass_name,
        "status": self.status, "reason": self.reason, "flop": self.case.flops(self.pass_name),
        "times_ms": [t * 1e3 for t in self.times_s], "temp_bytes": self.temp_bytes,
        "peak_bytes": self.peak_bytes}
    if self.ok:
      record.update(reps=len(self.times_s), median_ms=self.median_s * 1e3,
                    gflops=self.flop_rate("GFLOP/s"))
    return record


def compile_step(fn: Callable[..., object], args: Sequence[jax.Array], calls: int) -> Compiled:
  """Compiles `fn` for `args`: a step that runs it `calls` times back to back and waits for
  the last, and its temp bytes."""
  compiled = jax.jit(fn).lower(*args).compile()

  def step() -> None:
    for _ in range(calls - 1):
      compiled(*args)
    jax.block_until_ready(compiled(*args))

  analysis = compiled.memory_analysis()  # None where the backend does not analyse memory
  return Compiled(step, None if analysis is None else analysis.temp_size_in_bytes, calls)


def run_timed(step: Step) -> float:
  """Wall-clock seconds of one run of `step`."""
  start = time.perf_counter()
  step()
  return time.perf_counter() - start


def time_step(step: Step, warm_up_runs: int, max_reps: int,
              budget_s: float = TIME_BUDGET_S) -> tuple[float, ...]:
  """Wall-clock seconds of repeated runs of `step` after `warm_up_runs` (at least one) untimed.

  Runs `max_reps` times, or fewer so that the repetitions take about `budget_s` judging by the
  last warm-up run (at least one); stops early after a run that alone took over `budget_s`.
  """
  warm_up_s = [run_timed(step) for _ in range(max(1, warm_up_runs))][-1]
  reps = max(1, min(max_reps, int(budget_s / max(warm_up_s, 1e-9))))
  times = []
  for _ in range(reps):
    times.append(run_timed(step))
    if times[-1] > budget_s:
      break
  return tuple(times)


def check_fits(temp_bytes: int | None, device_kind: str) -> None:
  """Raises MemoryError when a compiled pass needs more temp memory than the device has free:
  a clear failure now instead of the allocator's retries (which stall for minutes)."""
  stats = jax.devices(device_kind)[0].memory_stats()
  if temp_bytes is None or not stats or "bytes_limit" not in stats:
    return
  free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  if temp_bytes > free:
    raise MemoryError(f"needs {temp_bytes / 2**30:.1f} GiB of temp memory, "
                      f"{free / 2**30:.1f} GiB free on the device")


def peak_bytes_in_use(device_kind: str) -> int | None:
  """The first `device_kind` device's peak bytes in use so far in this process, where its
  runtime reports them (GPUs do; the CPU does not)."""
  stats = jax.devices(device_kind)[0].memory_stats()
  return None if stats is None else stats.get("peak_bytes_in_use")


def failure_reason(error: Exception) -> str:
  """The exception's type and the first line of its message (cut if very long)."""
  message = str(error).strip().splitlines()
  reason = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
  return reason if len(reason) <= REASON_MAX_CHARS else reason[:REASON_MAX_CHARS - 3] + "..."
