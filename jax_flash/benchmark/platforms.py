"""What each platform measures (cases, peers) and how its table reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import jax

from jax_flash.benchmark.cases import Case, cpu_cases, gpu_cases
from jax_flash.benchmark.columns import (BLOCKS_COLUMN, CAUSAL_COLUMN, DOCUMENTS_COLUMN,
                                         HEAD_DIM_COLUMN, HEADS_COLUMN, PASS_COLUMN, SEQ_COLUMN,
                                         Column, rate_column, ratio_column, temp_column,
                                         time_column)
from jax_flash.benchmark.measure import RateUnit, failure_reason
from jax_flash.benchmark.peers import (CUDNN_GPU, FLASH_CPU, FLASH_GPU, PALLAS_GPU, TOKAMAX_GPU,
                                       TORCH_CPU, XLA_CPU, XLA_GPU, Peer, flash_peer)


@dataclasses.dataclass(frozen=True)
class Platform:
  """What one platform measures and how it reports it.

  `device_kind` is the jax.devices() kind its JAX peers run on; `make_cases` takes sequence
  lengths, head dims and causal modes (and, as keyword `heads`, the query heads of every case,
  None for the grid's own); the first peer is jax_flash; `warm_up_runs` untimed runs
  precede the timed ones; `progress` prints a line per case or per peer and pass;
  `settle_s`: the pause before each timed run of the alternating rounds (--interleave), so
  that the run before it has left the cores: PyTorch's OpenMP workers spin for a while after
  its call, which read the next peer's run 10-25% slow at seq 2048 on a 2-core CPU.
  `min_run_s`: each timed run of the alternating rounds repeats its step back to back until it
  lasts about this long (the time a call, the total over the repeats): after the pause the
  first call pays the cores' wake-up (a 3 ms forward read 4.75 ms alone, session 37), which a
  training loop's back-to-back calls never see.
  """

  name: str
  device_kind: str
  default_seqs: tuple[int, ...]
  quick_seqs: tuple[int, ...]
  default_head_dims: tuple[int, ...]
  quick_head_dims: tuple[int, ...]
  make_cases: Callable[..., list[Case]]
  peers: tuple[Peer, ...]
  warm_up_runs: int
  rate_unit: RateUnit
  columns: tuple[Column, ...]
  progress: Literal["case", "pass"]
  settle_s: float = 0.0
  min_run_s: float = 0.0


CPU = Platform(
    name="cpu",
    device_kind="cpu",
    default_seqs=(512, 1024, 2048, 4096, 8192),
    quick_seqs=(512, 1024),
    default_head_dims=(64,),
    quick_head_dims=(64,),
    make_cases=cpu_cases,
    peers=(FLASH_CPU, XLA_CPU, TORCH_CPU),
    warm_up_runs=1,
    rate_unit="GFLOP/s",
    columns=(SEQ_COLUMN, HEAD_DIM_COLUMN, CAUSAL_COLUMN, PASS_COLUMN, time_column(FLASH_CPU),
             rate_column(FLASH_CPU, "GFLOP/s", header="GFLOP/s"),
             rate_column(XLA_CPU, "GFLOP/s"), rate_column(TORCH_CPU, "GFLOP/s"),
             ratio_column(FLASH_CPU, XLA_CPU), ratio_column(FLASH_CPU, TORCH_CPU),
             temp_column(FLASH_CPU), temp_column(XLA_CPU)),
    progress="case",
    settle_s=0.02,
    min_run_s=0.1,
)

# tokamax sits beside cuDNN: the two fastest JAX attentions on Hopper, read side by side.
GPU = Platform(
    name="gpu",
    device_kind="gpu",
    default_seqs=(512, 1024, 2048, 4096, 8192, 16384),
    quick_seqs=(1024, 4096),
    default_head_dims=(64, 128, 256),
    quick_head_dims=(128,),
    make_cases=gpu_cases,
    peers=(FLASH_GPU, CUDNN_GPU, TOKAMAX_GPU, XLA_GPU, PALLAS_GPU),
    warm_up_runs=2,
    rate_unit="TFLOP/s",
    columns=(SEQ_COLUMN, HEAD_DIM_COLUMN, CAUSAL_COLUMN, PASS_COLUMN,
             *(rate_column(p, "TFLOP/s")
               for p in (FLASH_GPU, CUDNN_GPU, TOKAMAX_GPU, XLA_GPU, PALLAS_GPU)),
             ratio_column(FLASH_GPU, CUDNN_GPU), ratio_column(FLASH_GPU, TOKAMAX_GPU),
             ratio_column(FLASH_GPU, PALLAS_GPU),
             temp_column(FLASH_GPU), temp_column(CUDNN_GPU), temp_column(TOKAMAX_GPU),
             temp_column(XLA_GPU)),
    progress="pass",
)

PLATFORMS = {"cpu": CPU, "gpu": GPU}
# The jax_flash kernels each platform times.
FLASH_KERNELS = {"cpu": "cpu", "gpu": "cuda"}


def with_deterministic_flash(platform: Platform) -> Platform:
  """The platform with its jax_flash peer (the first) running the deterministic backward."""
  kernel = FLASH_KERNELS[platform.name]
  return dataclasses.replace(
      platform, peers=(flash_peer(kernel, platform.device_kind, deterministic=True),
                       *platform.peers[1:]))


# The columns that say which case and pass a row is (kept by beside_baseline).
KEY_COLUMNS = (SEQ_COLUMN, HEADS_COLUMN, HEAD_DIM_COLUMN, CAUSAL_COLUMN, BLOCKS_COLUMN,
               DOCUMENTS_COLUMN, PASS_COLUMN)


def with_case_column(platform: Platform, column: Column) -> Platform:
  """The platform's table with `column` after the causal one."""
  columns = list(platform.columns)
  columns.insert(columns.index(CAUSAL_COLUMN) + 1, column)
  return dataclasses.replace(platform, columns=tuple(columns))


def with_heads_column(platform: Platform) -> Platform:
  """The platform's table with the heads column ("N", or "N/K" with K key/value heads) after
  the seq one, for a run given --heads or --kv-heads."""
  columns = list(platform.columns)
  columns.insert(columns.index(SEQ_COLUMN) + 1, HEADS_COLUMN)
  return dataclasses.replace(platform, columns=tuple(columns))


def with_block_sparse(platform: Platform) -> Platform:
  """The platform's table with the blocks column (a row's share of the dense FLOPs, or
  "dense") after the causal one, for a run of block-sparse cases beside their dense twins."""
  return with_case_column(platform, BLOCKS_COLUMN)


def beside_baseline(platform: Platform, baseline: Peer, subject: Peer, others: Sequence[Peer],
                    ratio_header: str,
                    base: Callable[[Peer], Peer] = lambda peer: peer) -> tuple[Column, ...]:
  """The table of a run that times jax_flash (`subject`) beside a baseline of jax_flash
  (`baseline`) on the same inputs: the platform's case columns (KEY_COLUMNS); the baseline's
  and the subject's times (where the platform has a time column for jax_flash), rates, and the
  subject's time over the baseline's (`ratio_header`); then each other peer's rate, the
  subject's speed over it and the memory columns, where the platform's layout has them for
  jax_flash and for the peer's `base` (the platform peer it was made from)."""
  flash, unit = platform.peers[0], platform.rate_unit
  headers = {column.header for column in platform.columns}

  def has(column: Column) -> bool:
    return column.header in headers

  columns = [c for c in platform.columns if c in KEY_COLUMNS]
  if has(time_column(flash)):
    columns += [time_column(baseline), time_column(subject)]
  columns += [rate_column(baseline, unit), rate_column(subject, unit),
              ratio_column(baseline, subject, header=ratio_header)]
  columns += [rate_column(p, unit) for p in others if has(rate_column(base(p), unit))]
  columns += [ratio_column(subject, p) for p in others if has(ratio_column(flash, base(p)))]
  if has(temp_column(flash)):
    columns += [temp_column(baseline), temp_column(subject)]
  columns += [temp_column(p) for p in others if has(temp_column(base(p)))]
  return tuple(columns)


def no_devices(device_kind: str) -> str | None:
  """Why JAX has no `device_kind` device here, or None when it has one."""
  try:
    jax.devices(device_kind)
  except RuntimeError as e:
    return f"jax_flash benchmark: JAX sees no {device_kind} device ({failure_reason(e)})"
  return None
