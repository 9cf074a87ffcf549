"""Batched generation with a KV cache: a jit-compiled prefill of the prompts, then a
jit-compiled decode loop (``lax.scan``) that samples one byte per sequence per step.

Prompts of different lengths are right-padded into one (B, P) batch; every sequence then
decodes at its own position (its prompt's length, then one more each step), which is what lets
them share the loop: the attention of a step sees each sequence's cache entries 0 .. position
only (``key_value_seq_lengths``), so the padding written by the prefill past a prompt's end is
overwritten before any query could see it.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lm.model import LayerCache


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next byte is drawn from the logits: greedy at temperature 0, else from the
  softmax of logits / temperature over the top_k most likely bytes (all when top_k is 0)."""

  temperature: float = 0.0
  top_k: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0; got {self.temperature}")
    if not 0 <= self.top_k <= 256:
      raise ValueError(f"top_k must be in [0, 256] (0: no cut); got {self.top_k}")


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """One byte per row of logits (B, 256), int32 (B,)."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if sampling.top_k:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits / sampling.temperature).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def prefill(graphdef: nnx.GraphDef, state: nnx.State, prompts: jax.Array, lengths: jax.Array,
            key: jax.Array, max_len: int, sampling: Sampling
            ) -> tuple[jax.Array, list[LayerCache]]:
  """Runs the model `graphdef`/`state` on prompts (B, P) (right-padded; lengths (B,)) and
  samples each sequence's first new byte from its logits at position length - 1. Returns the
  bytes (B,) and the caches of max_len positions."""
  model = nnx.merge(graphdef, state)
  logits, caches = model.prefill(prompts, max_len)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return sample(last, key, sampling), caches


@functools.partial(jax.jit, static_argnums=(0, 6, 7))
def decode(graphdef: nnx.GraphDef, state: nnx.State, caches: list[LayerCache],
           tokens: jax.Array, positions: jax.Array, key: jax.Array, steps: int,
           sampling: Sampling) -> jax.Array:
  """`steps` more bytes per sequence (B, steps): each step feeds the last byte (B,) at its
  position (B,) and samples the next."""
  model = nnx.merge(graphdef, state)

  def step(carry, key):
    caches, tokens, positions = carry
    logits, caches = model.decode(tokens, positions, caches)
    tokens = sample(logits, key, sampling)
    return (caches, tokens, positions + 1), tokens

  _, out = jax.lax.scan(step, (caches, tokens, positions), jax.random.split(key, steps))
  return out.T


@dataclasses.dataclass
class Generation:
  """What `generate` returns: the new bytes and how long the two phases took."""

  tokens: np.ndarray  # (B, new_tokens) int32: the bytes after each prompt
  prompt_tokens: int  # B * P: positions the prefill ran (padding included)
  prefill_seconds: float
  decode_seconds: float  # the steps after the first byte
  compile_seconds: float

  @property
  def decode_tokens(self) -> int:
    return self.tokens.shape[0] * (self.tokens.shape[1] - 1)


def pad_prompts(prompts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
  """Byte prompts -> right-padded (B, P) int32 and their lengths (B,) int32."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError(f"need at least one prompt and no empty one; got {prompts!r}")
  lengths = np.array([len(p) for p in prompts], np.int32)
  batch = np.zeros((len(prompts), lengths.max()), np.int32)
  for row, prompt in zip(batch, prompts):
    row[:len(prompt)] = list(prompt)
  return batch, lengths


def generate(graphdef: nnx.GraphDef, state: nnx.State, prompts: list[bytes], new_tokens: int,
             sampling: Sampling, key: jax.Array, max_positions: int, repeats: int = 3
             ) -> Generation:
  """`new_tokens` bytes after each prompt, from the model `graphdef`/`state`.

  Both phases are compiled first (compile_seconds), then run `repeats` times; the times are the
  medians (the tokens are the same every time: the same key). Raises ValueError when a prompt
  plus the new bytes would need more than `max_positions` (the model's trained length).
  """
  if new_tokens < 1:
    raise ValueError(f"new_tokens must be at least 1; got {new_tokens}")
  batch, lengths = pad_prompts(prompts)
  max_len = batch.shape[1] + new_tokens - 1  # the last byte is sampled, never fed back
  if max_len > max_positions:
    raise ValueError(
        f"the longest prompt ({batch.shape[1]} bytes) + {new_tokens} new bytes need {max_len} "
        f"positions (the last new byte is not fed back); the model was trained on "
        f"{max_positions}")
  first_key, loop_key = jax.random.split(key)
  start = time.perf_counter()
  prefill_args = (graphdef, state, batch, lengths, first_key, max_len, sampling)
  first, caches = jax.block_until_ready(prefill(*prefill_args))
  steps = new_tokens - 1
  decode_args = lambda caches: (graphdef, state, caches, first, jnp.asarray(lengths), loop_key,
                                steps, sampling)
  if steps:
    jax.block_until_ready(decode(*decode_args(caches)))
  compile_seconds = time.perf_counter() - start

  prefill_times, decode_times, rest = [], [], np.zeros((len(prompts), 0), np.int32)
  for _ in range(repeats):
    start = time.perf_counter()
    first, caches = jax.block_until_ready(prefill(*prefill_args))
    prefill_times.append(time.perf_counter() - start)
    if steps:
      start = time.perf_counter()
      rest = jax.block_until_ready(decode(*decode_args(caches)))
      decode_times.append(time.perf_counter() - start)
  tokens = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)
  return Generation(tokens, batch.size, float(np.median(prefill_times)),
                    float(np.median(decode_times)) if decode_times else 0.0, compile_seconds)
