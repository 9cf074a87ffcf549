"""jax_flash.dot_product_attention: the public drop-in for jax.nn.dot_product_attention."""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from jax_flash import _ops, _registry, _sharding, _validation
from jax_flash._blockwise import blockwise_attention
from jax_flash._reference import attention_reference

Implementation = Literal["cpu", "cuda", "xla", "blockwise"]
# The paths that are plain XLA, not jax_flash's kernels.
_XLA_PATHS = {"xla": attention_reference, "blockwise": blockwise_attention}

# The CUDA kernels read rows in 16-byte chunks: head dims are padded to a multiple of 8.
_CUDA_HEAD_DIM_MULTIPLE = 8


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_attention(q, k, v, q_lens, kv_lens, config: _ops.KernelConfig):
  return _sharding.flash_fwd(q, k, v, q_lens, kv_lens, config)


def _flash_attention_fwd(q, k, v, q_lens, kv_lens, config):
  o, lse = _sharding.flash_fwd(q, k, v, q_lens, kv_lens, config)
  return (o, lse), (q, k, v, o, lse, q_lens, kv_lens)


def _flash_attention_bwd(config, residuals, cotangents):
  q, k, v, o, lse, q_lens, kv_lens = residuals
  d_o, _ = cotangents  # lse leaves through stop_gradient: its cotangent is always zero
  dq, dk, dv = _sharding.flash_bwd(q, k, v, o, lse, d_o, q_lens, kv_lens, config)
  return dq, dk, dv, None, None


_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)


def _resolve_implementation(implementation: str | None, dtype) -> str:
  """The path `implementation` names; for None, the best one for the default backend and the
  input dtype (the CUDA kernels take 16-bit inputs: float32 runs the blockwise XLA path)."""
  if implementation == "cuda" and not _registry.has_platform("cuda"):
    raise ValueError(
        "implementation='cuda' was requested but this jax_flash build has no CUDA kernels "
        "(no CUDA compiler when it was built); use implementation='cpu' or 'xla'")
  if implementation == "cuda" and not _registry.cuda_gpu_present():
    raise ValueError(
        "implementation='cuda' was requested but JAX sees no CUDA GPU; use "
        "implementation='cpu' or 'xla'")
  if implementation is not None:
    return implementation
  backend = jax.default_backend()
  if backend == "cpu":
    return "cpu"
  if backend in ("gpu", "cuda") and _registry.has_platform("cuda") and _registry.cuda_gpu_present():
    return "blockwise" if jnp.dtype(dtype) == jnp.float32 else "cuda"
  raise NotImplementedError(
      f"jax_flash has no kernel for the default backend {backend!r} in this build; pass "
      "implementation='blockwise' for the linear-memory XLA path, 'xla' for the plain "
      "reference (or 'cpu' to run on host devices)")


def resolve_kernel(implementation: str | None, query: jax.Array) -> str:
  """The kernel ("cpu" or "cuda") for `implementation`, checked as dot_product_attention does;
  for the callers that need a kernel (ring attention has no plain-XLA path)."""
  _validation.check_implementation(implementation)
  if implementation in _XLA_PATHS:
    raise ValueError("this function needs a kernel: implementation must be None, 'cpu' or 'cuda'")
  resolved = _resolve_implementation(implementation, query.dtype)
  if resolved == "blockwise" or (resolved == "cuda" and (query.dtype == jnp.float32 or
                                                         query.shape[-1] % 8)):
    raise NotImplementedError(
        f"ring attention on the CUDA kernels needs bfloat16/float16 and a head dim that is a "
        f"multiple of 8; got query{query.shape} {query.dtype}")
  _validation.check_kernel_head_dim(query.shape[-1], resolved)
  return resolved


def dot_product_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.typing.ArrayLike | None = None,
    key_value_seq_lengths: jax.typing.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Implementation | None = None,
    return_residual: bool = False,
    deterministic: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Scaled dot-product attention computed by FlashAttention kernels.

  A drop-in for :func:`jax.nn.dot_product_attention`: the same arguments, shapes and masking
  semantics, computed in tiles with an online softmax so that memory grows linearly with the
  sequence length, and differentiated by a backward pass that recomputes the tiles.

  Args:
    query: ``(B, T, N, H)`` or ``(T, N, H)``; float32, bfloat16 or float16.
    key: ``(B, S, K, H)`` or ``(S, K, H)``, ``N % K == 0`` (grouped-query attention).
    value: same shape and dtype as ``key``.
    bias: added to the scaled logits, broadcastable to ``(B, N, T, S)`` (fewer dims gain
      leading ones; each dim 1 or full), differentiable. Only the ``"blockwise"`` and ``"xla"``
      paths take it: the kernels raise ``NotImplementedError`` (so does ``None`` where it
      picks a kernel).
    mask: bool, ``True`` where a query may attend a key, broadcastable like ``bias``; the same
      paths take it. Causal, padding and window masks go through ``is_causal``, the sequence
      lengths and ``local_window_size`` instead, which every path takes.
    scale: logit scale; ``1 / sqrt(H)`` by default.
    is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned, as jax.nn).
    query_seq_lengths: ``(B,)`` int32; output rows at or past the length are zero.
    key_value_seq_lengths: ``(B,)`` int32; keys at or past the length are ignored.
    local_window_size: ``w`` or ``(left, right)``: query ``i`` attends keys
      ``i - left <= j <= i + right``.
    implementation: ``None`` picks the path for the default backend: ``"cpu"`` on the host,
      ``"cuda"`` on NVIDIA GPUs for bfloat16/float16, ``"blockwise"`` there for float32.
      ``"cpu"``/``"cuda"`` force a kernel; ``"blockwise"`` is FlashAttention in plain XLA (key
      blocks in a scan, linear memory, products at JAX's default precision: TF32 on recent
      GPUs, as any float32 matmul in JAX); ``"xla"`` is the plain quadratic-memory reference.
    return_residual: also return the log-sum-exp of each query row's logits, ``(B, T, N)``
      (or ``(T, N)``) in float32, under ``stop_gradient`` as in jax.nn.
    deterministic: make the backward pass bit-identical run after run. The CUDA backward
      otherwise adds dQ with float32 atomics, whose order varies; deterministic mode computes
      dQ in a separate pass instead (slower). The CPU backward is always deterministic.

  Returns:
    The attention output, shaped and typed like ``query``; with ``return_residual``, the pair
    ``(output, lse)``. A query row with no key to attend to gives zeros (and a log-sum-exp of
    the most negative float32), never NaN.
  """
  _validation.check_implementation(implementation)
  if not isinstance(deterministic, bool):
    raise ValueError(f"deterministic must be a bool; got {deterministic!r}")
  query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  _validation.check_qkv(query, key, value)
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  batch, seq_q, _, head_dim = query.shape
  seq_k = key.shape[1]
  q_lens = _validation.check_seq_lengths("query_seq_lengths", query_seq_lengths, batch, seq_q)
  kv_lens = _validation.check_seq_lengths(
      "key_value_seq_lengths", key_value_seq_lengths, batch, seq_k)
  window = _validation.check_window(local_window_size, seq_q + seq_k)
  scale = _validation.check_scale(scale, head_dim)
  heads_q = query.shape[2]
  bias = _validation.check_logit_array("bias", bias, batch, heads_q, seq_q, seq_k)
  mask = _validation.check_logit_array("mask", mask, batch, heads_q, seq_q, seq_k)
  implementation = _resolve_implementation(implementation, query.dtype)
  if (bias is not None or mask is not None) and implementation not in _XLA_PATHS:
    given = " and ".join(f"{name}{x.shape}" for name, x in (("bias", bias), ("mask", mask))
                         if x is not None)
    raise NotImplementedError(
        f"jax_flash.dot_product_attention: the {implementation!r} kernels take no bias or mask "
        f"arrays (got {given}): they never build the (T, S) scores. Express a mask as "
        "is_causal / query_seq_lengths / key_value_seq_lengths / local_window_size, which the "
        "kernels take, or pass implementation='blockwise' (FlashAttention in XLA, which takes "
        "both arrays) or 'xla'")
  if implementation not in _XLA_PATHS:
    _validation.check_kernel_head_dim(head_dim, implementation)
  if implementation == "cuda" and query.dtype == jnp.float32:
    raise NotImplementedError(
        "jax_flash's CUDA kernels take bfloat16 or float16; for float32 inputs "
        f"(query{query.shape}) use implementation=None or 'blockwise' (FlashAttention in XLA "
        "at JAX's default float32 matmul precision)")

  if q_lens is None:
    q_lens = jnp.full((batch,), seq_q, jnp.int32)
  if kv_lens is None:
    kv_lens = jnp.full((batch,), seq_k, jnp.int32)
  window_left, window_right = window if window is not None else (-1, -1)
  if implementation in _XLA_PATHS:
    out, lse = _XLA_PATHS[implementation](
        query, key, value, q_lens, kv_lens, scale=scale, is_causal=bool(is_causal),
        window_left=window_left, window_right=window_right, bias=bias, mask=mask)
  else:
    query, scale = _ops.positive_scale(query, scale)
    config = _ops.KernelConfig(implementation, scale, bool(is_causal), window_left, window_right,
                               deterministic)
    pad = _CUDA_HEAD_DIM_MULTIPLE - head_dim % _CUDA_HEAD_DIM_MULTIPLE
    if implementation == "cuda" and pad != _CUDA_HEAD_DIM_MULTIPLE:
      # Zero columns change no score and give zero output columns, sliced off again.
      widths = [(0, 0)] * 3 + [(0, pad)]
      query, key, value = (jnp.pad(x, widths) for x in (query, key, value))
    out, lse = _flash_attention(query, key, value, q_lens, kv_lens, config)
    out = out[..., :head_dim]
  lse = jax.lax.stop_gradient(lse)

  if unbatched:
    out, lse = out[0], lse[0]
  if not return_residual:
    return out
  return out, jnp.swapaxes(lse, -1, -2)  # (..., N, T) -> (..., T, N)
