"""Benchmark CLI: jax_flash beside its peers, measured in one run.

    python -m jax_flash.benchmark [--platform cpu|gpu] [--seqs 512 1024 ...]
                                  [--head-dims 64,128,256] [--causal both|yes|no]
                                  [--reps N] [--out DIR] [--quick] [--deterministic]

Each platform has a list of cases, a list of peers and a table layout:

- gpu: the FlashAttention benchmark's shapes: 16k tokens in all (batch = 16384 // seq), hidden
  2048 (heads = 2048 // head dim), bfloat16, seq 512 ... 16384, head dims 64, 128, 256; peers
  jax_flash's CUDA kernels, cuDNN and XLA through jax.nn.dot_product_attention, and Pallas'
  Triton FlashAttention (`mha`).
- cpu: B=1, 4 heads, head dim 64, float32, seq 512 ... 8192; peers jax_flash's CPU kernels, XLA
  and PyTorch's scaled_dot_product_attention.

A peer builds, for one case, a step per pass that runs the forward pass to completion and one that
runs forward and backward; or it reports why it is unavailable, or fails and the benchmark records
the reason (and goes on). Every step is compiled, warmed up, then repeated (fewer times for slow
peers) and the median time is reported.

FLOPs follow the FlashAttention benchmarks: forward 4·B·S²·N·H, halved when causal; forward plus
backward 3.5× the forward. The table's "bwd" rows are the backward alone, derived: the median
fwd+bwd time less the median fwd time of the same peer in the same run (2.5× the forward's FLOPs). Memory: XLA's compiled temp bytes of each pass (the figure to compare),
and the device's peak bytes in use after it where the runtime reports them (a high-water mark
over the whole process, so it only grows). Absolute times drift between machines; compare peers
of one run.

With --deterministic, jax_flash runs with `deterministic=True` (its bit-reproducible backward),
beside the same peers.

With --out DIR: results.json (environment, settings, every measurement) and table.md, rewritten
after each case so that an interrupted run keeps what it measured, and plot.png at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import inspect
import json
import math
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

PASSES = ("fwd", "fwd+bwd")
# Table rows per case: the measured passes and the backward alone, derived from them.
TABLE_PASSES = ("fwd", "bwd", "fwd+bwd")
# Forward plus backward costs 3.5 forwards (the backward 2.5).
FWD_BWD_FLOP_FACTOR = 3.5
# Time one peer may spend repeating one pass of one case; slow peers get fewer repetitions.
TIME_BUDGET_S = 5.0
MIB = 2**20
# The FlashAttention benchmark's GPU shapes: tokens per batch and model width.
GPU_TOKENS = 16384
GPU_HIDDEN = 2048
# Failure reasons longer than this (a compiler's one-line dump) are cut.
REASON_MAX_CHARS = 300

# A step runs one pass to completion (results ready) and returns nothing.
Step = Callable[[], None]
# "unavailable": the peer cannot run here; "fails": it raised while building or running.
Status = Literal["ok", "unavailable", "fails"]
# An attention function over (B, S, N, H) arrays: (query, key, value, is_causal) -> output.
AttentionFn = Callable[..., jax.Array]
RateUnit = Literal["GFLOP/s", "TFLOP/s"]
RATE_SCALE: dict[str, float] = {"GFLOP/s": 1e9, "TFLOP/s": 1e12}


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: self-attention of `seq` tokens, shapes (B, S, N, H)."""

  batch: int
  seq: int
  heads: int
  head_dim: int
  dtype: str
  causal: bool

  def flops(self, pass_name: str) -> float:
    """FLOPs of one pass by the FlashAttention convention."""
    forward = 4.0 * self.batch * self.seq**2 * self.heads * self.head_dim
    if self.causal:
      forward /= 2
    factor = {"fwd": 1.0, "bwd": FWD_BWD_FLOP_FACTOR - 1.0, "fwd+bwd": FWD_BWD_FLOP_FACTOR}
    return forward * factor[pass_name]


@dataclasses.dataclass(frozen=True)
class Inputs:
  """Query, key, value and output cotangent of one case, (B, S, N, H) host arrays."""

  query: np.ndarray
  key: np.ndarray
  value: np.ndarray
  d_out: np.ndarray

  def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return self.query, self.key, self.value, self.d_out


def make_inputs(case: Case, seed: int = 0) -> Inputs:
  """Random normal inputs of the case's shape and dtype (never zeros)."""
  return _random_inputs((case.batch, case.seq, case.heads, case.head_dim), case.dtype, seed)


@functools.lru_cache(maxsize=1)  # a causal case and its non-causal twin share their inputs
def _random_inputs(shape: tuple[int, ...], dtype: str, seed: int) -> Inputs:
  rng = np.random.default_rng(seed)
  return Inputs(*(rng.standard_normal(shape, np.float32).astype(jnp.dtype(dtype))
                  for _ in range(4)))


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
class Peer:
  """An attention implementation to measure.

  `name` names it in results and rate columns, `label` in ratio and memory columns;
  `unavailable` returns why it cannot run here (None when it can); `build` puts a case's inputs
  where the peer runs and returns a `Prepare` per pass, called just before that pass is timed
  (so a pass that fails to compile leaves the other one measured).
  """

  name: str
  label: str
  unavailable: Callable[[], str | None]
  build: Callable[[Case, Inputs], dict[str, Prepare]]


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
    return self.status == "ok"

  @property
  def median_s(self) -> float:
    return statistics.median(self.times_s)

  def flop_rate(self, unit: RateUnit) -> float:
    """FLOPs per second of the median run, in `unit`."""
    return self.case.flops(self.pass_name) / self.median_s / RATE_SCALE[unit]

  def to_json(self) -> dict[str, object]:
    record: dict[str, object] = {
        "peer": self.peer, **dataclasses.asdict(self.case), "pass": self.pass_name,
        "status": self.status, "reason": self.reason, "flop": self.case.flops(self.pass_name),
        "times_ms": [t * 1e3 for t in self.times_s], "temp_bytes": self.temp_bytes,
        "peak_bytes": self.peak_bytes}
    if self.ok:
      record.update(reps=len(self.times_s), median_ms=self.median_s * 1e3,
                    gflops=self.flop_rate("GFLOP/s"))
    return record


# ---------------------------------------------------------------------------------------------
# Table layout


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
HEAD_DIM_COLUMN = Column("hdim", lambda row: str(row.case.head_dim))
CAUSAL_COLUMN = Column("causal", lambda row: "Y" if row.case.causal else "N")
PASS_COLUMN = Column("pass", lambda row: row.pass_name)


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


def ratio_column(subject: Peer, peer: Peer) -> Column:
  """How many times faster the subject is than the peer."""

  def cell(row: Row) -> str:
    mine, theirs = row.results[subject.name], row.results[peer.name]
    if not (mine.ok and theirs.ok):
      return "-"
    return f"{theirs.median_s / mine.median_s:.2f}x"

  return Column(f"{subject.label}/{peer.label}", cell)


def temp_column(peer: Peer) -> Column:
  """XLA's compiled temp memory of the peer's pass, MiB."""

  def cell(row: Row) -> str:
    temp = row.results[peer.name].temp_bytes
    return "-" if temp is None else f"{temp / MIB:.1f}"

  return Column(f"temp MiB {peer.label}", cell)


# ---------------------------------------------------------------------------------------------
# Platforms


@dataclasses.dataclass(frozen=True)
class Platform:
  """What one platform measures and how it reports it.

  `device_kind` is the jax.devices() kind its JAX peers run on; `make_cases` takes sequence
  lengths, head dims and causal modes; the first peer is jax_flash; `warm_up_runs` untimed runs
  precede the timed ones; `progress` prints a line per case or per peer and pass.
  """

  name: str
  device_kind: str
  default_seqs: tuple[int, ...]
  quick_seqs: tuple[int, ...]
  default_head_dims: tuple[int, ...]
  quick_head_dims: tuple[int, ...]
  make_cases: Callable[[Sequence[int], Sequence[int], Sequence[bool]], list[Case]]
  peers: tuple[Peer, ...]
  warm_up_runs: int
  rate_unit: RateUnit
  columns: tuple[Column, ...]
  progress: Literal["case", "pass"]


# ---------------------------------------------------------------------------------------------
# Timing


def _run_timed(step: Step) -> float:
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
  warm_up_s = [_run_timed(step) for _ in range(max(1, warm_up_runs))][-1]
  reps = max(1, min(max_reps, int(budget_s / max(warm_up_s, 1e-9))))
  times = []
  for _ in range(reps):
    times.append(_run_timed(step))
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


# ---------------------------------------------------------------------------------------------
# JAX peers


def _compile(fn: Callable[..., object], args: Sequence[jax.Array], calls: int) -> Compiled:
  """Compiles `fn` for `args`: a step that runs it `calls` times back to back and waits for
  the last, and its temp bytes."""
  compiled = jax.jit(fn).lower(*args).compile()

  def step() -> None:
    for _ in range(calls - 1):
      compiled(*args)
    jax.block_until_ready(compiled(*args))

  analysis = compiled.memory_analysis()  # None where the backend does not analyse memory
  return Compiled(step, None if analysis is None else analysis.temp_size_in_bytes, calls)


# Calls launched back to back per timed step on an accelerator (see Compiled).
ACCELERATOR_CALLS_PER_STEP = 10


def _build_jax(attention: AttentionFn, device_kind: str, case: Case,
               inputs: Inputs) -> dict[str, Prepare]:
  """Passes of a JAX attention function on the first `device_kind` device.

  The forward+backward pass returns the output with the gradients of query, key and value for a
  random output cotangent (those of sum(output · cotangent)): given only the gradients, XLA
  would drop the product P·V of its forward pass (and report less temp memory), while PyTorch
  and jax_flash compute it.
  """
  device = jax.devices(device_kind)[0]
  q, k, v, d_out = (jax.device_put(x, device) for x in inputs.arrays())

  def forward(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return attention(q, k, v, is_causal=case.causal)

  def forward_backward(q: jax.Array, k: jax.Array, v: jax.Array,
                       d_out: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, vjp = jax.vjp(forward, q, k, v)
    return out, vjp(d_out)

  calls = 1 if device_kind == "cpu" else ACCELERATOR_CALLS_PER_STEP
  return {"fwd": functools.partial(_compile, forward, (q, k, v), calls),
          "fwd+bwd": functools.partial(_compile, forward_backward, (q, k, v, d_out), calls)}


def jax_peer(name: str, label: str, device_kind: str, attention: AttentionFn,
             unavailable: Callable[[], str | None] = lambda: None) -> Peer:
  """A peer that runs `attention` under jax.jit on the platform's JAX device."""
  return Peer(name=name, label=label, unavailable=unavailable,
              build=functools.partial(_build_jax, attention, device_kind))


def _jax_flash_unavailable(kernel: str) -> str | None:
  if jax_flash.has_platform(kernel):
    return None
  return f"this jax_flash build has no {kernel!r} kernels"


def _pallas_unavailable() -> str | None:
  try:
    from jax.experimental.pallas.ops.gpu import attention  # noqa: F401  (only whether it imports)
  except ImportError as e:
    return f"Pallas' GPU attention does not import ({e})"
  return None


def _pallas_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                      is_causal: bool) -> jax.Array:
  """Pallas' Triton FlashAttention on (B, T, N, H) arrays, scaled by 1/sqrt(H) as jax.nn is.

  Its signature has changed between JAX versions: `segment_ids`, `sm_scale` and `causal` are
  passed only where `mha` has them, and a causal case fails where it has no `causal`.
  """
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention

  parameters = inspect.signature(pallas_attention.mha).parameters
  options: dict[str, object] = {}
  if "segment_ids" in parameters:
    options["segment_ids"] = None
  if "sm_scale" in parameters:
    options["sm_scale"] = 1.0 / math.sqrt(query.shape[-1])
  if "causal" in parameters:
    options["causal"] = is_causal
  elif is_causal:
    raise NotImplementedError("this JAX's Pallas mha has no `causal` parameter")
  return pallas_attention.mha(query, key, value, **options)


# ---------------------------------------------------------------------------------------------
# PyTorch peer


def _torch_unavailable() -> str | None:
  try:
    import torch  # noqa: F401  (only whether it imports)
  except ImportError as e:
    return f"PyTorch is not installed ({e})"
  return None


def _build_torch_cpu(case: Case, inputs: Inputs) -> dict[str, Prepare]:
  """Passes of PyTorch's CPU scaled_dot_product_attention, held to its flash kernel, on
  (B, N, S, H) tensors with os.cpu_count() threads."""
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel

  torch.set_num_threads(os.cpu_count() or 1)
  q, k, v, d_out = (torch.from_numpy(np.ascontiguousarray(x.swapaxes(1, 2)))
                    for x in inputs.arrays())
  leaves = [t.clone().requires_grad_() for t in (q, k, v)]
  attention = functools.partial(
      torch.nn.functional.scaled_dot_product_attention, is_causal=case.causal)

  def fwd() -> None:
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
      attention(q, k, v)

  def fwd_bwd() -> None:
    for leaf in leaves:
      leaf.grad = None
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
      attention(*leaves).backward(d_out)

  return {"fwd": lambda: Compiled(fwd, None), "fwd+bwd": lambda: Compiled(fwd_bwd, None)}


def _torch_version() -> str | None:
  try:
    return importlib.metadata.version("torch")
  except importlib.metadata.PackageNotFoundError:
    return None


# ---------------------------------------------------------------------------------------------
# The platforms


def _cpu_cases(seqs: Sequence[int], head_dims: Sequence[int],
               causal_modes: Sequence[bool]) -> list[Case]:
  """B=1, 4 heads, float32."""
  return [Case(batch=1, seq=seq, heads=4, head_dim=head_dim, dtype="float32", causal=causal)
          for seq in seqs for head_dim in head_dims for causal in causal_modes]


def _gpu_cases(seqs: Sequence[int], head_dims: Sequence[int],
               causal_modes: Sequence[bool]) -> list[Case]:
  """The FlashAttention benchmark's: batch = 16384 // seq and heads = 2048 // head dim (each at
  least 1), bfloat16."""
  return [Case(batch=max(1, GPU_TOKENS // seq), seq=seq, heads=max(1, GPU_HIDDEN // head_dim),
               head_dim=head_dim, dtype="bfloat16", causal=causal)
          for seq in seqs for head_dim in head_dims for causal in causal_modes]


def flash_peer(kernel: str, device_kind: str, deterministic: bool = False) -> Peer:
  """jax_flash's `kernel` ("cpu" or "cuda") on the `device_kind` device."""
  attention = functools.partial(jax_flash.dot_product_attention, implementation=kernel,
                                deterministic=deterministic)
  return jax_peer("jax_flash", "flash", device_kind, attention,
                  functools.partial(_jax_flash_unavailable, kernel))


FLASH_CPU = flash_peer("cpu", "cpu")
XLA_CPU = jax_peer("xla", "xla", "cpu",
                   functools.partial(jax.nn.dot_product_attention, implementation="xla"))
TORCH_CPU = Peer(name="torch", label="torch", unavailable=_torch_unavailable,
                 build=_build_torch_cpu)

CPU = Platform(
    name="cpu",
    device_kind="cpu",
    default_seqs=(512, 1024, 2048, 4096, 8192),
    quick_seqs=(512, 1024),
    default_head_dims=(64,),
    quick_head_dims=(64,),
    make_cases=_cpu_cases,
    peers=(FLASH_CPU, XLA_CPU, TORCH_CPU),
    warm_up_runs=1,
    rate_unit="GFLOP/s",
    columns=(SEQ_COLUMN, CAUSAL_COLUMN, PASS_COLUMN, time_column(FLASH_CPU),
             rate_column(FLASH_CPU, "GFLOP/s", header="GFLOP/s"),
             rate_column(XLA_CPU, "GFLOP/s"), rate_column(TORCH_CPU, "GFLOP/s"),
             ratio_column(FLASH_CPU, XLA_CPU), ratio_column(FLASH_CPU, TORCH_CPU),
             temp_column(FLASH_CPU), temp_column(XLA_CPU)),
    progress="case",
)

FLASH_GPU = flash_peer("cuda", "gpu")
CUDNN_GPU = jax_peer("cudnn", "cudnn", "gpu",
                     functools.partial(jax.nn.dot_product_attention, implementation="cudnn"))
XLA_GPU = jax_peer("xla", "xla", "gpu",
                   functools.partial(jax.nn.dot_product_attention, implementation="xla"))
PALLAS_GPU = jax_peer("pallas", "pallas", "gpu", _pallas_attention, _pallas_unavailable)

GPU = Platform(
    name="gpu",
    device_kind="gpu",
    default_seqs=(512, 1024, 2048, 4096, 8192, 16384),
    quick_seqs=(1024, 4096),
    default_head_dims=(64, 128, 256),
    quick_head_dims=(128,),
    make_cases=_gpu_cases,
    peers=(FLASH_GPU, CUDNN_GPU, XLA_GPU, PALLAS_GPU),
    warm_up_runs=2,
    rate_unit="TFLOP/s",
    columns=(SEQ_COLUMN, HEAD_DIM_COLUMN, CAUSAL_COLUMN, PASS_COLUMN,
             *(rate_column(p, "TFLOP/s") for p in (FLASH_GPU, CUDNN_GPU, XLA_GPU, PALLAS_GPU)),
             ratio_column(FLASH_GPU, CUDNN_GPU), ratio_column(FLASH_GPU, PALLAS_GPU),
             temp_column(FLASH_GPU), temp_column(CUDNN_GPU), temp_column(XLA_GPU)),
    progress="pass",
)

PLATFORMS = {"cpu": CPU, "gpu": GPU}


def with_deterministic_flash(platform: Platform) -> Platform:
  """The platform with its jax_flash peer (the first) running the deterministic backward."""
  kernel = {"cpu": "cpu", "gpu": "cuda"}[platform.name]
  return dataclasses.replace(
      platform, peers=(flash_peer(kernel, platform.device_kind, deterministic=True),
                       *platform.peers[1:]))


def _no_devices(device_kind: str) -> str | None:
  """Why JAX has no `device_kind` device here, or None when it has one."""
  try:
    jax.devices(device_kind)
  except RuntimeError as e:
    return f"jax_flash benchmark: JAX sees no {device_kind} device ({failure_reason(e)})"
  return None


# ---------------------------------------------------------------------------------------------
# Running


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


def failure_reason(error: Exception) -> str:
  """The exception's type and the first line of its message (cut if very long)."""
  message = str(error).strip().splitlines()
  reason = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
  return reason if len(reason) <= REASON_MAX_CHARS else reason[:REASON_MAX_CHARS - 3] + "..."


def _case_progress(index: int, total: int, case: Case, results: Sequence[Measurement]) -> str:
  """One line per case: each peer's median milliseconds per pass."""
  parts = []
  for peer in dict.fromkeys(r.peer for r in results):
    cells = [f"{r.median_s * 1e3:.2f}" if r.ok else r.status for r in results if r.peer == peer]
    parts.append(f"{peer} {'/'.join(cells)}")
  causal = "Y" if case.causal else "N"
  return (f"[{index}/{total}] seq {case.seq} causal {causal} ms ({'/'.join(PASSES)}): "
          + ", ".join(parts))


def _pass_progress(index: int, total: int, measurement: Measurement, unit: RateUnit) -> str:
  """One line per peer and pass of a case: its median time and rate, or why it did not run."""
  m, case = measurement, measurement.case
  where = (f"[{index}/{total}] seq {case.seq} hdim {case.head_dim} "
           f"causal {'Y' if case.causal else 'N'} {m.peer} {m.pass_name}:")
  if m.ok:
    result = (f"{m.median_s * 1e3:.3f} ms {m.flop_rate(unit):.1f} {unit} "
              f"({len(m.times_s)} reps)")
  else:
    result = f"{m.status}: {m.reason}"
  memory = "".join(f", {what} {value / MIB:.1f} MiB"
                   for what, value in (("temp", m.temp_bytes), ("peak", m.peak_bytes))
                   if value is not None)
  return f"{where} {result}{memory}"


def _log(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def run(platform: Platform, cases: Sequence[Case], reps: int,
        skip: Sequence[str] = ()) -> Iterator[list[Measurement]]:
  """Measures every peer on every case; yields each case's measurements once they are taken.
  Peers named in `skip` are recorded as skipped, not run.

  Prints progress to stderr: a line per case, or a line per peer and pass as each peer finishes,
  as the platform says.
  """
  unavailable = {peer.name: "skipped (--skip)" if peer.name in skip else peer.unavailable()
                 for peer in platform.peers}
  for index, case in enumerate(cases, 1):
    inputs = make_inputs(case)
    results: list[Measurement] = []
    for peer in platform.peers:
      peer_results = measure_peer(platform, peer, unavailable[peer.name], case, inputs, reps)
      if platform.progress == "pass":
        for measurement in peer_results:
          _log(_pass_progress(index, len(cases), measurement, platform.rate_unit))
      results.extend(peer_results)
    if platform.progress == "case":
      _log(_case_progress(index, len(cases), case, results))
    yield results


# ---------------------------------------------------------------------------------------------
# Reporting


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


def format_table(platform: Platform, measurements: Sequence[Measurement]) -> str:
  """A markdown table in the platform's columns, one row per case and pass, then one note per
  distinct reason a peer did not run."""
  by_row: dict[tuple[Case, str], dict[str, Measurement]] = {}
  for m in measurements:
    by_row.setdefault((m.case, m.pass_name), {})[m.peer] = m
  rows = [Row(case, pass_name, by_row[(case, pass_name)])
          for case in dict.fromkeys(m.case for m in measurements) for pass_name in TABLE_PASSES
          if (case, pass_name) in by_row]
  lines = ["| " + " | ".join(c.header for c in platform.columns) + " |",
           "|" + "---|" * len(platform.columns)]
  lines += ["| " + " | ".join(c.cell(row) for c in platform.columns) + " |" for row in rows]
  return "\n".join(lines + _notes(measurements))


def _notes(measurements: Sequence[Measurement]) -> list[str]:
  """One line per distinct reason a peer did not run."""
  reasons = dict.fromkeys((m.peer, m.status, m.reason) for m in measurements if not m.ok)
  if not reasons:
    return []
  return [""] + [f"- {peer} {status}: {reason}" for peer, status, reason in reasons]


def _cpu_model() -> str | None:
  """The processor's model name from /proc/cpuinfo, where there is one."""
  try:
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return None
  return next((line.split(":", 1)[1].strip() for line in lines
               if line.startswith("model name")), None)


def _accelerator_packages() -> dict[str, str]:
  """Versions of the installed JAX CUDA plugins and NVIDIA library wheels (cuDNN, cuBLAS...)."""
  versions = {}
  for distribution in importlib.metadata.distributions():
    name = distribution.metadata["Name"] or ""
    if name.lower().replace("_", "-").startswith(("jax-cuda", "nvidia-")):
      versions[name] = distribution.version
  return dict(sorted(versions.items()))


def environment(platform: Platform) -> dict[str, object]:
  """Versions and machine facts that go with the measurements."""
  devices = jax.devices(platform.device_kind)
  return dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      platform=platform.name,
      python=sys.version.split()[0],
      jax=jax.__version__,
      jaxlib=importlib.metadata.version("jaxlib"),
      jax_flash=jax_flash.__version__,
      jax_backend=jax.default_backend(),
      device_kind=devices[0].device_kind,
      device_count=len(devices),
      accelerator_packages=_accelerator_packages(),
      cpu_kernel_isa=jax_flash.cpu_kernel_isa(),
      cpu_model=_cpu_model(),
      cpu_count=os.cpu_count(),
      torch=_torch_version(),
  )


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


def write_plot(path: pathlib.Path, platform: Platform, measurements: Sequence[Measurement],
               title: str) -> None:
  """Writes a PNG of FLOP rate against sequence length: a panel per head dim (rows) and causal
  mode (columns), a line per peer (colour) and pass (forward solid with circles,
  forward+backward dashed with squares).

  Without matplotlib, warns on stderr and writes nothing.
  """
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError as e:
    _log(f"jax_flash benchmark: warning: no plot written, matplotlib is missing ({e})")
    return
  unit = platform.rate_unit
  seqs = sorted({m.case.seq for m in measurements})
  head_dims = sorted({m.case.head_dim for m in measurements})
  causal_modes = sorted({m.case.causal for m in measurements})
  figure = Figure(figsize=(6 * len(causal_modes), 4 * len(head_dims)), layout="constrained")
  FigureCanvasAgg(figure)
  axes = figure.subplots(len(head_dims), len(causal_modes), squeeze=False)
  for row, head_dim in enumerate(head_dims):
    for column, causal in enumerate(causal_modes):
      ax = axes[row][column]
      for colour, peer in enumerate(platform.peers):
        for pass_name, line_style, marker in zip(PASSES, ("-", "--"), "os", strict=True):
          points = sorted((m.case.seq, m.flop_rate(unit)) for m in measurements
                          if m.ok and m.peer == peer.name and m.pass_name == pass_name
                          and m.case.head_dim == head_dim and m.case.causal == causal)
          if points:
            seq_values, rates = zip(*points, strict=True)
            ax.plot(seq_values, rates, line_style, marker=marker, color=f"C{colour}",
                    label=f"{peer.name} {pass_name}")
      ax.set_xscale("log", base=2)
      ax.minorticks_off()
      ax.set_xticks(seqs, [str(seq) for seq in seqs])
      ax.set_ylim(bottom=0)
      ax.grid(alpha=0.3)
      ax.set_title(f"head dim {head_dim}, {'causal' if causal else 'not causal'}")
      ax.set_xlabel("sequence length")
      ax.set_ylabel(unit)
      if ax.lines:
        ax.legend(fontsize="x-small")
  figure.suptitle(title)
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# Command line


def positive_ints(text: str) -> list[int]:
  """An argument of positive integers separated by commas."""
  try:
    values = [int(part) for part in text.split(",") if part]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers (a,b,...), got {text!r}")
  return values


def _per_platform(attribute: str) -> str:
  """Each platform's value of a setting, for help texts: "cpu: 512,1024; gpu: 1024,4096"."""
  values = {p.name: getattr(p, attribute) for p in PLATFORMS.values()}
  return "; ".join(f"{name}: {','.join(map(str, v)) if isinstance(v, tuple) else v}"
                   for name, v in values.items())


def _skippable(platform: Platform) -> list[str]:
  """The peers --skip may name: all but jax_flash (the first)."""
  return [peer.name for peer in platform.peers[1:]]


def _peer_names() -> str:
  """The skippable peers of each platform, for the help text."""
  return "; ".join(f"{name}: {','.join(_skippable(platform))}"
                   for name, platform in PLATFORMS.items())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m jax_flash.benchmark",
      description="Time jax_flash beside other attention implementations, in one run.")
  parser.add_argument(
      "--platform", choices=tuple(PLATFORMS),
      default="gpu" if jax.default_backend() == "gpu" else "cpu",
      help="what to measure on (default: gpu when JAX's default backend is a GPU, else cpu)")
  seqs = parser.add_mutually_exclusive_group()
  seqs.add_argument("--seqs", type=positive_ints, nargs="+", metavar="SEQ",
                    help=f"sequence lengths (default: {_per_platform('default_seqs')})")
  seqs.add_argument("--quick", action="store_true",
                    help="a short smoke test: the platform's quick sequence lengths "
                         f"({_per_platform('quick_seqs')}) and head dims "
                         f"({_per_platform('quick_head_dims')})")
  parser.add_argument("--head-dims", type=positive_ints, nargs="+", metavar="HDIM",
                      help=f"head dims (default: {_per_platform('default_head_dims')}); only "
                           "platforms whose table shows the head dim take this option")
  parser.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                      help="causal cases, non-causal cases or both (default: both)")
  parser.add_argument("--reps", type=int, default=20,
                      help=f"timed repetitions after the warm-up ({_per_platform('warm_up_runs')} "
                           "runs); fewer for slow peers, so each spends about "
                           f"{TIME_BUDGET_S:g} s per pass of a case (default: 20)")
  parser.add_argument("--deterministic", action="store_true",
                      help="time jax_flash's deterministic backward (deterministic=True)")
  parser.add_argument("--skip", nargs="+", default=[], metavar="PEER",
                      help="peers not to run, for a shorter run (their cells read "
                           f"'unavailable'); jax_flash cannot be skipped ({_peer_names()})")
  parser.add_argument("--out", type=pathlib.Path, metavar="DIR",
                      help="write results.json (measurements and environment), table.md and "
                           "plot.png here")
  args = parser.parse_args(argv)
  if args.reps < 1:
    parser.error("--reps must be at least 1")
  # Flatten "--seqs 512,1024 2048" into one list.
  args.seqs = [n for group in args.seqs for n in group] if args.seqs else None
  args.head_dims = [n for group in args.head_dims for n in group] if args.head_dims else None
  platform = PLATFORMS[args.platform]
  skippable = _skippable(platform)
  for name in args.skip:
    if name not in skippable:
      parser.error(f"--skip: {name!r} is not a skippable {platform.name} peer "
                   f"(those are {', '.join(skippable)})")
  if args.head_dims and HEAD_DIM_COLUMN not in platform.columns:
    parser.error(f"--head-dims: the {platform.name} table has no head dim column (its cases "
                 f"have head dim {','.join(map(str, platform.default_head_dims))})")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the benchmark; returns the process exit status."""
  args = parse_args(argv)
  platform = PLATFORMS[args.platform]
  if args.deterministic:
    platform = with_deterministic_flash(platform)
  no_devices = _no_devices(platform.device_kind)
  if no_devices is not None:
    print(no_devices, file=sys.stderr)
    return 2
  seqs = args.seqs or (platform.quick_seqs if args.quick else platform.default_seqs)
  head_dims = args.head_dims or (
      platform.quick_head_dims if args.quick else platform.default_head_dims)
  causal_modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  cases = platform.make_cases(seqs, head_dims, causal_modes)
  env = environment(platform)
  settings = dict(seqs=list(seqs), head_dims=list(head_dims), causal=args.causal,
                  reps=args.reps, warm_up_runs=platform.warm_up_runs,
                  time_budget_s=TIME_BUDGET_S, quick=args.quick, cases=len(cases),
                  deterministic=args.deterministic, skip=list(args.skip))
  measurements: list[Measurement] = []
  for results in run(platform, cases, args.reps, args.skip):
    measurements.extend(results)
    if args.out is not None:
      reported = with_backward(measurements)
      write_results(args.out, env, settings, reported, format_table(platform, reported))
  print(format_table(platform, with_backward(measurements)))
  if args.out is not None:
    try:
      write_plot(args.out / "plot.png", platform, measurements,
                 f"{env['device_kind']}, {cases[0].dtype}: attention {platform.rate_unit}")
    except Exception as e:  # the plot only shows what results.json holds: warn, lose nothing
      _log(f"jax_flash benchmark: warning: no plot written ({failure_reason(e)})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
