"""Sampling text from a trained model: one byte at a time over a sliding window of the context."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lm.config import Config


@functools.partial(jax.jit, static_argnums=0)
def next_byte(graphdef: nnx.GraphDef, state: nnx.State, window: jax.Array, position: int,
              temperature: float, key: jax.Array) -> jax.Array:
  """Samples the byte after window[0, position] (greedy when temperature is 0); `state` is the
  (model, optimizer) state, of which only the model is used."""
  model, _ = nnx.merge(graphdef, state)
  logits = model(window)[0, position]
  sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
  return jnp.where(temperature > 0, sampled, jnp.argmax(logits))


def generate(graphdef: nnx.GraphDef, state: nnx.State, config: Config, prompt: bytes,
             key: jax.Array) -> bytes:
  """Autoregressive sampling over a sliding window of the last seq_len bytes (no KV cache: every
  byte runs the model on one fixed-shape window, so it compiles once)."""
  out = list(prompt or b"\n")
  for _ in range(config.sample_bytes):
    context = out[-config.seq_len:]
    window = np.zeros((1, config.seq_len), np.int32)
    window[0, :len(context)] = context  # causal: the zero padding after `context` is never seen
    key, subkey = jax.random.split(key)
    out.append(int(next_byte(graphdef, state, window, len(context) - 1, config.temperature,
                             subkey)))
  return bytes(out)
