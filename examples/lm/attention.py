"""The model's attention: jax_flash, or jax.nn's own implementations to compare against. The only
place in the example that chooses an attention function."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jax_flash
from lm.config import Config

IMPLEMENTATIONS = ("jax_flash", "xla", "cudnn")


def attention_fn(config: Config) -> Callable[..., jax.Array]:
  """The attention of the model: (q, k, v) -> output, causal, all of the same signature."""
  if config.attention == "jax_flash":
    return functools.partial(jax_flash.dot_product_attention, is_causal=True)
  return functools.partial(jax.nn.dot_product_attention, is_causal=True,
                           implementation=config.attention)


def packed_attention_fn(config: Config) -> Callable[..., jax.Array]:
  """The attention of packed rows: (q, k, v, segment_ids (B, T)) -> output, causal within each
  document. jax_flash takes the ids (q_segment_ids = kv_segment_ids); jax.nn gets the same
  as a (B, 1, T, T) mask."""
  if config.attention == "jax_flash":
    return lambda q, k, v, ids: jax_flash.dot_product_attention(
        q, k, v, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids)
  return lambda q, k, v, ids: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, mask=(ids[:, :, None] == ids[:, None, :])[:, None],
      implementation=config.attention)


def cached_attention_fn(config: Config) -> Callable[..., jax.Array]:
  """The attention of a decode step: (q, k, v, key_value_seq_lengths=...) -> output, where each
  sequence's query attends to its cached keys before its length (no causal mask: the query is
  the newest position)."""
  if config.attention == "jax_flash":
    return jax_flash.dot_product_attention
  return functools.partial(jax.nn.dot_product_attention, implementation=config.attention)


def check_attention_backend(config: Config) -> None:
  """Fails early, with a message saying what to do, where the chosen attention cannot run."""
  backend = jax.default_backend()
  on_gpu = backend in ("gpu", "cuda")
  if config.attention == "cudnn":
    if not on_gpu:
      devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
      raise SystemExit(
          f"error: --attention cudnn runs jax.nn.dot_product_attention(implementation='cudnn'), "
          f"which needs an NVIDIA GPU with cuDNN; JAX's backend here is {backend!r} ({devices}). "
          "Use --attention jax_flash or xla here, or a CUDA-enabled jax on a GPU machine.")
    if config.dtype == "float32":
      raise SystemExit("error: cuDNN attention takes bfloat16/float16 inputs: add --dtype bfloat16")
    if config.head_dim % 8 or config.head_dim > 256:
      raise SystemExit(f"error: cuDNN attention needs a head dim that is a multiple of 8 and at "
                       f"most 128 (256 from Hopper on); --width/--heads give {config.head_dim}")
  if config.attention == "jax_flash" and on_gpu and config.dtype == "float32":
    raise SystemExit("error: jax_flash's CUDA kernels take bfloat16/float16 so far: add "
                     "--dtype bfloat16 (or use --attention xla for float32)")
  # Anything else the implementation rejects for these shapes (head dim, a missing kernel, the
  # GPU's generation) is raised when it is traced or lowered: do both now, before any data is read.
  dtype = jnp.dtype(config.dtype)
  q = jax.ShapeDtypeStruct((1, config.seq_len, config.heads, config.head_dim), dtype)
  kv = jax.ShapeDtypeStruct((1, config.seq_len, config.num_kv_heads, config.head_dim), dtype)
  try:
    jax.jit(attention_fn(config)).lower(q, kv, kv)
  except Exception as e:  # the library's own message says what is wrong
    raise SystemExit(f"error: --attention {config.attention} cannot run this model here: "
                     f"{type(e).__name__}: {e}") from None
