"""Split-KV decoding (flash-decoding) on the CPU and CUDA kernels: when it runs, how many key
chunks it uses, and its custom call.

A decode step attends a few query rows to a long key sequence. The tiled forward runs one task
per (batch, query head, block of 64 query rows): with T = 1 that is one row per task, K/V read
once per query head, and at small batch x heads too few tasks for the cores. The decode kernel
(``cuda/cpu/flash_decode.h``) instead

* packs the T x G query rows of the G = N / K query heads that share a kv head into one query
  tile (pack-GQA), so each K/V tile is read once per group, not once per query head;
* cuts each tile's key range into ``kv_splits`` chunks that run in parallel, each writing its
  rows' partial output and lse into float32 workspaces (outputs of the custom call, so XLA sees
  the memory), which a combine pass merges (lse = log sum exp lse_s, o = sum exp(lse_s - lse) o_s).

The rule (:func:`kv_splits`) on the "cpu" kernel: the decode kernel runs when every query
row of a kv head fits one query tile, ``T * (N / K) <= 64`` (``cpu_block_q``); then with enough
chunks that batch x kv heads x chunks covers the cores twice, chunks of at least 256 keys, at
most 64 chunks. ``KernelConfig.kv_splits`` carries the choice (0: the tiled forward). It computes
what the tiled forward computes (masks, lengths, empty rows, NaN propagation; o and lse are the
backward's usual residuals), so the choice changes speed, not results beyond float32 rounding.
On CUDA (bfloat16/float16) the same rule picks the CUDA decode kernel
(``cuda/gpu/flash_decode_kernel.cuh``: the same contract, one CTA per (batch, kv head, key
chunk, 16 packed rows); 1.00-1.02x cuDNN and 96-99% of the copy bandwidth at T = 1 on an H200,
cuda/PERF_NOTES.md v7) for ``T * (N / K) <= CUDA_MAX_PACKED_ROWS``, with the key chunks of
:func:`cuda_num_splits`; more packed rows (chunked prefill) take the tiled forward, which reads
K/V once per 128 query rows. ``jax_flash.paged_attention`` runs the kernel over the pages for
the same shapes and gathers the pages for the tiled forward beyond (:func:`cuda_paged_route`).
The environment variable ``JAX_FLASH_CUDA_DECODE``, read once when jax_flash is imported,
overrides this for comparisons: ``kernel`` (the default, also when unset or empty), ``tiled``
(the tiled forward for every shape; paged calls gather their pages) or ``split`` (the split-KV
JAX program of jax_flash._split_kv around the tiled forward, read by jax_flash._ops). Another
value warns and means ``kernel``.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _registry, _switches

# A chunk holds at least this many keys (4 key blocks): the combine's cost per chunk (one
# row of partial output per query row) stays small beside the chunk's work.
MIN_CHUNK_KEYS = 256
# At most this many chunks: the workspace is kv_splits partial outputs.
MAX_SPLITS = 64


# How decode-shaped calls run on CUDA (see the module docstring): read once, at import; the first
# mode is the default.
CUDA_DECODE_VARIABLE = "JAX_FLASH_CUDA_DECODE"
CUDA_DECODE_MODES = ("kernel", "tiled", "split")


def _read_cuda_decode_mode(value: str | None) -> str:
  """The mode for a value of JAX_FLASH_CUDA_DECODE: unset or empty is the default; an unknown
  value warns (naming the values) and means the default."""
  return _switches.read_choice(CUDA_DECODE_VARIABLE, value, CUDA_DECODE_MODES)


_CUDA_DECODE_MODE = _read_cuda_decode_mode(os.environ.get(CUDA_DECODE_VARIABLE))
# The CUDA decode kernel runs for at most this many packed query rows per kv head (4 CTAs of 16
# rows per key chunk, each reading the chunk's K/V); more rows (chunked prefill) take the tiled
# forward, which reads K/V once per 128 query rows.
CUDA_MAX_PACKED_ROWS = 64
# The split rule's target: the smallest chunk count whose CTAs fill the SMs' waves within this
# fraction of the best count's.
CUDA_WAVE_EFFICIENCY = 0.85


def cuda_decode_mode() -> str:
  """How decode-shaped CUDA calls run in this process: "kernel", "tiled" or "split"."""
  return _CUDA_DECODE_MODE


def cuda_kernel_enabled() -> bool:
  """Whether the CUDA decode kernel runs (JAX_FLASH_CUDA_DECODE unset, empty or "kernel" when
  jax_flash was imported)."""
  return _CUDA_DECODE_MODE == "kernel"


def cuda_takes_kernel(seq_q: int, heads_q: int, heads_k: int) -> bool:
  """Whether a CUDA call with these shapes runs the decode kernel (contiguous or paged): the
  kernel is on and the T * (N / K) packed query rows of a kv head are at most
  CUDA_MAX_PACKED_ROWS."""
  return (cuda_kernel_enabled() and heads_k >= 1
          and seq_q * (heads_q // heads_k) <= CUDA_MAX_PACKED_ROWS)


def cuda_paged_route(seq_q: int, heads_q: int, heads_k: int) -> str:
  """How jax_flash.paged_attention runs on CUDA: "kernel" (the decode kernel reading the pages)
  where the contiguous call would take the decode kernel (cuda_takes_kernel), else "gather"
  (the pages gathered into a contiguous cache for the tiled forward, as a contiguous call of
  that shape runs: chunked prefill, where the kernel's 16-row tiles would read the cache once
  per tile, or JAX_FLASH_CUDA_DECODE=tiled/split)."""
  return "kernel" if cuda_takes_kernel(seq_q, heads_q, heads_k) else "gather"


def _cuda_constant(name: str) -> int:
  constants = _registry.CUDA_KERNEL_CONSTANTS
  if constants is None:
    raise NotImplementedError(
        "the CUDA decode kernel: this jax_flash build has no CUDA kernels (no CUDA compiler when "
        "it was built)")
  return int(constants[name])


def cuda_splits_rule(units: int, seq_k: int, sm_count: int, block_n: int) -> int:
  """Key chunks of the CUDA decode for `units` = batch x kv heads x row tiles CTAs per chunk:
  the fewest chunks whose CTAs fill the SMs' waves (units * chunks / SMs over its ceiling)
  within CUDA_WAVE_EFFICIENCY of the best count, among 1 .. min(MAX_SPLITS, S / 256) chunks,
  each a multiple of block_n keys (the kernel rounds chunks to whole key blocks)."""
  if units <= 0 or sm_count <= 0:
    return 1
  keys = max(1, math.ceil(seq_k / block_n)) * block_n
  most = max(1, min(MAX_SPLITS, math.ceil(seq_k / MIN_CHUNK_KEYS), keys // block_n))
  efficiency = []
  for splits in range(1, most + 1):
    waves = units * splits / sm_count
    efficiency.append(waves / math.ceil(waves))
  best = max(efficiency)
  return next(s for s, e in enumerate(efficiency, 1) if e >= CUDA_WAVE_EFFICIENCY * best)


@functools.cache
def _cuda_sm_count() -> int:
  """Streaming multiprocessors of the current GPU, asked once through the native module (132,
  an H100/H200's, if CUDA cannot say)."""
  native = _registry._native_cuda
  return int((native.device_sm_count() if native is not None else 0) or 132)


# For measurements only: a fixed number of key chunks for the CUDA decode kernel instead of the
# rule (read when a call is traced; clamped to 1 .. MAX_SPLITS and to whole key blocks), e.g. to
# time finer chunks on ragged batches.
CUDA_SPLITS_VARIABLE = "JAX_FLASH_CUDA_DECODE_SPLITS"


def _splits_override(seq_k: int, block_n: int) -> int | None:
  value = os.environ.get(CUDA_SPLITS_VARIABLE, "")
  if not value:
    return None
  try:
    splits = int(value)
  except ValueError:
    raise ValueError(f"{CUDA_SPLITS_VARIABLE}={value!r}: expected a positive integer") from None
  if splits < 1:
    raise ValueError(f"{CUDA_SPLITS_VARIABLE}={value!r}: expected a positive integer")
  return max(1, min(splits, MAX_SPLITS, math.ceil(seq_k / block_n)))


def cuda_num_splits(batch: int, seq_q: int, heads_q: int, heads_k: int, seq_k: int,
                    sm_count: int | None = None) -> int:
  """Key chunks for the CUDA decode kernel (cuda_splits_rule on its CTAs per chunk, or
  JAX_FLASH_CUDA_DECODE_SPLITS where set)."""
  override = _splits_override(seq_k, _cuda_constant("decode_block_n"))
  if override is not None:
    return override
  rows = _cuda_constant("decode_rows_per_cta")
  row_tiles = max(1, math.ceil(seq_q * (heads_q // max(heads_k, 1)) / rows))
  return cuda_splits_rule(batch * heads_k * row_tiles, seq_k, sm_count or _cuda_sm_count(),
                          _cuda_constant("decode_block_n"))


def block_q() -> int:
  """Query rows per tile of the CPU kernels: the decode kernel runs when T * group fits one."""
  return _registry.KERNEL_CONSTANTS["cpu_block_q"]


def num_splits(batch: int, seq_q: int, heads_q: int, heads_k: int, seq_k: int,
               cores: int | None = None) -> int:
  """Key chunks for the decode kernel: enough that (batch x kv heads x row tiles) x chunks covers
  the cores twice, each chunk at least MIN_CHUNK_KEYS keys, at most MAX_SPLITS."""
  cores = cores or os.cpu_count() or 1
  row_tiles = max(1, math.ceil(seq_q * (heads_q // max(heads_k, 1)) / block_q()))
  units = batch * heads_k * row_tiles
  if units == 0:
    return 1
  wanted = math.ceil(2 * cores / units)
  return max(1, min(wanted, math.ceil(seq_k / MIN_CHUNK_KEYS), MAX_SPLITS))


def kv_splits(implementation: str, batch: int, seq_q: int, heads_q: int, heads_k: int,
              seq_k: int, cores: int | None = None) -> int:
  """What dot_product_attention runs: 0 for the tiled forward, n >= 1 for the split-KV decode
  kernel with n key chunks (see the module docstring for the rule)."""
  if heads_k < 1:
    return 0
  if implementation == "cuda":
    if not cuda_takes_kernel(seq_q, heads_q, heads_k):
      return 0
    return cuda_num_splits(batch, seq_q, heads_q, heads_k, seq_k)
  if implementation != "cpu" or seq_q * (heads_q // heads_k) > block_q():
    return 0
  return num_splits(batch, seq_q, heads_q, heads_k, seq_k, cores)


def workspace_shapes(splits: int, batch: int, seq_q: int, heads_q: int,
                     head_dim_v: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
  """The float32 workspaces (partial outputs, partial lse), flat, of the sizes the handlers
  check (empty with one chunk); `head_dim_v` is the output's (v's) head dim."""
  o_elements, lse_elements = _registry._native.decode_workspace_elements(
      splits, batch, seq_q, heads_q, head_dim_v)
  return (jax.ShapeDtypeStruct((int(o_elements),), jnp.float32),
          jax.ShapeDtypeStruct((int(lse_elements),), jnp.float32))


def attributes(scale: float, is_causal: bool, window_left: int, window_right: int,
               splits: int) -> dict:
  return dict(scale=float(scale), is_causal=bool(is_causal),
              window_left=np.int64(window_left), window_right=np.int64(window_right),
              num_splits=np.int64(splits))


def decode_fwd(q, k, v, q_lens, kv_lens, *, scale: float, is_causal: bool, window_left: int,
               window_right: int, splits: int, o_float32: bool = False,
               implementation: str = "cpu"):
  """(o, lse) of the contiguous decode kernel of `implementation` ("cpu", or "cuda": 16-bit
  inputs, head dim padded to a multiple of 8), with the tiled forward's arguments and results
  (q (..., T, N, H), k (..., S, K, H), v (..., S, K, Hv), Hv == H but on "cpu"; o like q with
  v's head dim Hv, float32 with o_float32; lse (..., N, T))."""
  *batch, seq_q, heads_q, _ = q.shape
  head_dim_v = v.shape[-1]
  workspaces = workspace_shapes(splits, math.prod(batch), seq_q, heads_q, head_dim_v)
  call = jax.ffi.ffi_call(
      f"jax_flash_{implementation}_decode",
      (jax.ShapeDtypeStruct((*batch, seq_q, heads_q, head_dim_v),
                            jnp.float32 if o_float32 else q.dtype),
       jax.ShapeDtypeStruct((*batch, heads_q, seq_q), jnp.float32),
       *workspaces),
      vmap_method="broadcast_all")
  o, lse, _, _ = call(q, k, v, q_lens, kv_lens,
                      **attributes(scale, is_causal, window_left, window_right, splits))
  return o, lse
