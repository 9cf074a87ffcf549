"""The forward and backward custom calls, as JAX functions over the kernels' own layouts.

Kernel layouts: q, o, dq (..., T, N, H); k, v, dk, dv (..., S, K, H); lse (..., N, T) float32;
q_lens, kv_lens (...,) int32. Leading dimensions are batch; vmap adds more (``broadcast_all``),
and the kernels fold them all into one batch dimension.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

# Alignment of the head dim in the kernels' float32 tiles (cpu_kernels.h: kHeadDimAlign).
_HEAD_DIM_ALIGN = 16
# Key block size of the CPU backward (cpu_kernels.h: kBlockK).
_CPU_BLOCK_K = 64
# At most this many float32 dQ partials: the workspace stays a small multiple of dQ however many
# cores the host has.
_MAX_DQ_SPLITS = 8


def positive_scale(q: jax.Array, scale: float) -> tuple[jax.Array, float]:
  """(q', scale') with scale' > 0 and the same logits scale' * q'.k as scale * q.k: the kernels
  take positive scales only (the CUDA forward keeps row maxima of unscaled scores, and masks set
  scores to -inf, which a negative or zero scale would turn into +inf or NaN). Applied outside
  the kernels' custom VJPs, so JAX differentiates the sign flip (or the zeroing) itself."""
  if scale > 0:
    return q, scale
  if scale < 0:
    return -q, -scale
  return jnp.zeros_like(q), 1.0  # every logit is 0: uniform attention over the visible keys


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static settings of one attention call (hashable: it is a custom_vjp nondiff argument)."""

  implementation: str  # "cpu" or "cuda"
  scale: float
  is_causal: bool
  window_left: int  # -1: unbounded
  window_right: int  # -1: unbounded
  deterministic: bool = False  # backward: bit-identical gradients run after run

  def attributes(self) -> dict:
    return dict(
        scale=float(self.scale),
        is_causal=bool(self.is_causal),
        window_left=np.int64(self.window_left),
        window_right=np.int64(self.window_right),
    )


def _target(config: KernelConfig, pass_name: str) -> str:
  return f"jax_flash_{config.implementation}_{pass_name}"


def _lse_shape(q: jax.Array) -> tuple[int, ...]:
  *batch, t, n, _ = q.shape
  return (*batch, n, t)


def flash_fwd(q, k, v, q_lens, kv_lens, config: KernelConfig):
  """Returns (o, lse) with o like q and lse (..., N, T) float32."""
  call = jax.ffi.ffi_call(
      _target(config, "fwd"),
      (
          jax.ShapeDtypeStruct(q.shape, q.dtype),
          jax.ShapeDtypeStruct(_lse_shape(q), jnp.float32),
      ),
      vmap_method="broadcast_all",
  )
  return call(q, k, v, q_lens, kv_lens, **config.attributes())


def dq_splits(batch: int, heads_k: int, seq_k: int) -> int:
  """How many float32 dQ partials the CPU backward keeps so every core has key blocks to work
  on: one when batch x kv heads already covers the cores twice, never more than
  _MAX_DQ_SPLITS."""
  units = batch * heads_k
  cores = os.cpu_count() or 1
  if units >= 2 * cores:
    return 1
  wanted = min(math.ceil(seq_k / _CPU_BLOCK_K), math.ceil(2 * cores / units), _MAX_DQ_SPLITS)
  return max(1, wanted)


def flash_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config: KernelConfig):
  """Returns (dq, dk, dv); the kernel's workspaces come back as extra outputs and are dropped.

  Workspaces: delta (..., N, T) float32, and the float32 dQ accumulator: on the CPU one flat
  partial per dQ split with the head dim padded to 16; on CUDA one shaped like q, or none in
  deterministic mode.
  """
  *batch, seq_q, heads_q, head_dim = q.shape
  seq_k, heads_k = k.shape[-3], k.shape[-2]
  attributes = config.attributes()
  attributes["deterministic"] = bool(config.deterministic)
  if config.implementation == "cpu":
    batch_size = math.prod(batch)
    splits = dq_splits(batch_size, heads_k, seq_k)
    padded = -(-head_dim // _HEAD_DIM_ALIGN) * _HEAD_DIM_ALIGN
    dq_accum = jax.ShapeDtypeStruct(
        (splits * batch_size * seq_q * heads_q * padded,), jnp.float32)
    attributes["dq_splits"] = np.int64(splits)
  elif config.deterministic:  # dQ computed per query block, no accumulator
    dq_accum = jax.ShapeDtypeStruct((0,), jnp.float32)
  else:
    dq_accum = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  call = jax.ffi.ffi_call(
      _target(config, "bwd"),
      (
          jax.ShapeDtypeStruct(q.shape, q.dtype),
          jax.ShapeDtypeStruct(k.shape, k.dtype),
          jax.ShapeDtypeStruct(v.shape, v.dtype),
          jax.ShapeDtypeStruct(_lse_shape(q), jnp.float32),  # delta
          dq_accum,
      ),
      vmap_method="broadcast_all",
  )
  dq, dk, dv, _, _ = call(q, k, v, o, lse, d_o, q_lens, kv_lens, **attributes)
  return dq, dk, dv
