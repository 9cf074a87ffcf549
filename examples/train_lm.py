"""Train a small GPT-style byte-level language model whose attention is jax_flash.

    python examples/train_lm.py                      # 1-2 minutes on a 2-core CPU
    python examples/train_lm.py --attention xla      # the same model on jax.nn's XLA attention
    python examples/train_lm.py --kv-heads 1 --positions learned --data README.md

The model is a decoder-only transformer in Flax NNX: byte embeddings (tied to the output layer),
pre-norm blocks (RMSNorm -> causal self-attention -> residual, RMSNorm -> GELU MLP -> residual),
rotary or learned positions, and optional grouped-query attention (``--kv-heads``). Attention is
``jax_flash.dot_product_attention(q, k, v, is_causal=True)``, a drop-in for
``jax.nn.dot_product_attention``. It trains with optax AdamW in one jit-compiled step that donates
the model and optimizer state, on bytes of real text: by default the Python standard library's
own source files (no download), or the file or folder given with ``--data``.

Needs the ``examples`` extra: ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import math
import os
import sys
import time
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_flash

VOCAB_SIZE = 256  # bytes


# ---- configuration ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on; every field is also a command-line flag (``--kv-heads``)."""

  # data
  data: str | None = None  # a text file or a folder; default: the standard library's *.py files
  data_glob: str = "*.py"  # which files of a --data folder to read (recursively)
  max_data_bytes: int = 4_000_000
  val_fraction: float = 0.1
  # model
  layers: int = 4
  width: int = 128
  heads: int = 4
  kv_heads: int | None = None  # None: as many as query heads; fewer: GQA; 1: MQA
  mlp_ratio: int = 4
  positions: Literal["rope", "learned"] = "rope"
  rope_base: float = 10_000.0
  dtype: Literal["float32", "bfloat16"] = "float32"  # activations; parameters stay float32
  attention: Literal["jax_flash", "xla"] = "jax_flash"
  # training
  seq_len: int = 128
  batch_size: int = 16
  steps: int = 600
  learning_rate: float = 3e-3
  warmup_steps: int = 50
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  seed: int = 0
  # reporting
  log_every: int = 50
  eval_every: int = 100
  eval_batches: int = 8
  # sampling
  prompt: str = "def "
  sample_bytes: int = 300
  temperature: float = 0.7  # 0: greedy

  @property
  def num_kv_heads(self) -> int:
    return self.heads if self.kv_heads is None else self.kv_heads

  @property
  def head_dim(self) -> int:
    return self.width // self.heads

  def validate(self) -> None:
    if self.width % self.heads:
      raise ValueError(f"--width {self.width} must be a multiple of --heads {self.heads}")
    if self.heads % self.num_kv_heads:
      raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
    if self.positions == "rope" and self.head_dim % 2:
      raise ValueError(f"rotary positions need an even head dim; got {self.head_dim}")


def parse_config(argv: list[str] | None = None) -> Config:
  """Builds a flag for every Config field (``kv_heads`` -> ``--kv-heads``) and parses argv."""
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  for field in dataclasses.fields(Config):
    flag = "--" + field.name.replace("_", "-")
    kind = field.type
    kwargs = dict(default=field.default, help=" ")
    if kind.startswith("Literal["):
      kwargs["choices"] = [c.strip().strip("\"'") for c in kind[len("Literal["):-1].split(",")]
    elif kind in ("int", "int | None"):
      kwargs["type"] = int
    elif kind == "float":
      kwargs["type"] = float
    parser.add_argument(flag, **kwargs)
  config = Config(**vars(parser.parse_args(argv)))
  config.validate()
  return config


# ---- data ---------------------------------------------------------------------------------------


def text_files(config: Config) -> list[str]:
  if config.data is None:
    # The standard library's own source: present on every machine with Python.
    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
  if os.path.isdir(config.data):
    pattern = os.path.join(config.data, "**", config.data_glob)
    return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  return [config.data]


def load_bytes(config: Config) -> np.ndarray:
  """Concatenates the text files into one uint8 array of at most max_data_bytes."""
  chunks, total = [], 0
  for path in text_files(config):
    with open(path, "rb") as f:
      data = f.read(config.max_data_bytes - total)
    chunks.append(data)
    total += len(data)
    if total >= config.max_data_bytes:
      break
  if total < 2 * (config.seq_len + 1):
    raise ValueError(f"not enough text: {total} bytes from {config.data or 'the stdlib'}")
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def split_data(data: np.ndarray, config: Config) -> tuple[np.ndarray, np.ndarray]:
  """The last val_fraction of the bytes is held out for validation."""
  n_val = max(int(len(data) * config.val_fraction), config.seq_len + 1)
  return data[:-n_val], data[-n_val:]


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Inputs and next-byte targets, (len(starts), seq_len) int32 each."""
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  tokens = data[idx].astype(np.int32)
  return tokens[:, :-1], tokens[:, 1:]


def train_batches(data: np.ndarray, config: Config):
  """An endless stream of random training windows."""
  rng = np.random.default_rng(config.seed)
  while True:
    starts = rng.integers(0, len(data) - config.seq_len - 1, size=config.batch_size)
    yield windows(data, starts, config.seq_len)


def val_batches(data: np.ndarray, config: Config) -> list[tuple[np.ndarray, np.ndarray]]:
  """A fixed set of evenly spaced validation windows, so losses compare across evaluations."""
  n = config.eval_batches * config.batch_size
  starts = np.linspace(0, len(data) - config.seq_len - 1, n).astype(np.int64)
  return [windows(data, s, config.seq_len) for s in np.split(starts, config.eval_batches)]


# ---- model --------------------------------------------------------------------------------------


def attention_fn(config: Config):
  if config.attention == "jax_flash":
    return functools.partial(jax_flash.dot_product_attention, is_causal=True)
  return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")


def rope(x: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding of x (B, T, heads, H), rotating pairs (i, i + H/2)."""
  seq_len, head_dim = x.shape[1], x.shape[-1]
  freqs = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freqs[None, :]  # (T, H/2)
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


class CausalSelfAttention(nnx.Module):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.dtype)
    hd, n, k = config.head_dim, config.heads, config.num_kv_heads
    self.query = nnx.Linear(config.width, n * hd, use_bias=False, dtype=dtype, rngs=rngs)
    self.key_value = nnx.Linear(config.width, 2 * k * hd, use_bias=False, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(n * hd, config.width, use_bias=False, dtype=dtype, rngs=rngs,
                          kernel_init=nnx.initializers.normal(0.02 / math.sqrt(2 * config.layers)))
    self.attend = attention_fn(config)

  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    batch, seq_len, _ = x.shape
    q = self.query(x).reshape(batch, seq_len, c.heads, c.head_dim)
    k, v = jnp.split(self.key_value(x).reshape(batch, seq_len, 2 * c.num_kv_heads, c.head_dim), 2,
                     axis=2)
    if c.positions == "rope":
      q, k = rope(q, c.rope_base), rope(k, c.rope_base)
    o = self.attend(q, k, v)  # (B, T, heads, head_dim); GQA when kv_heads < heads
    return self.out(o.reshape(batch, seq_len, c.heads * c.head_dim))


class MLP(nnx.Module):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(config.dtype)
    hidden = config.mlp_ratio * config.width
    self.up = nnx.Linear(config.width, hidden, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(hidden, config.width, dtype=dtype, rngs=rngs,
                           kernel_init=nnx.initializers.normal(0.02 / math.sqrt(2 * config.layers)))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(config.dtype)
    self.attn_norm = nnx.RMSNorm(config.width, dtype=dtype, rngs=rngs)
    self.attn = CausalSelfAttention(config, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(config.width, dtype=dtype, rngs=rngs)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class ByteLM(nnx.Module):
  """Decoder-only transformer over bytes; returns float32 logits (B, T, 256)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.dtype)
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(VOCAB_SIZE, config.width, dtype=dtype, embedding_init=init, rngs=rngs)
    if config.positions == "learned":
      self.pos_embed = nnx.Embed(config.seq_len, config.width, dtype=dtype, embedding_init=init,
                                 rngs=rngs)
    self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.layers)])
    self.final_norm = nnx.RMSNorm(config.width, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    if self.config.positions == "learned":
      x = x + self.pos_embed(jnp.arange(tokens.shape[1]))[None]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.final_norm(x)).astype(jnp.float32)  # tied output layer


def count_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ---- training -----------------------------------------------------------------------------------


def make_optimizer(config: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with gradient clipping, linear warmup and cosine decay; returns (tx, schedule)."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
      decay_steps=max(config.steps, config.warmup_steps + 1), end_value=config.learning_rate / 10)
  # Decay matrices only, not norm scales or biases.
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay, mask=decay_mask),
  ), schedule


def loss_fn(model: ByteLM, inputs: jax.Array, targets: jax.Array) -> jax.Array:
  logits = model(inputs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def train_step(graphdef, state, inputs, targets):
  """One AdamW step on (model, optimizer) state; the old state's buffers are donated."""
  model, optimizer = nnx.merge(graphdef, state)
  loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
  optimizer.update(model, grads)
  return nnx.state((model, optimizer)), loss


@functools.partial(jax.jit, static_argnums=0)
def eval_step(graphdef, state, inputs, targets):
  model, _ = nnx.merge(graphdef, state)
  return loss_fn(model, inputs, targets)


def evaluate(graphdef, state, batches) -> float:
  return float(np.mean([eval_step(graphdef, state, x, y) for x, y in batches]))


@functools.partial(jax.jit, static_argnums=0)
def next_byte(graphdef, state, window, position, temperature, key):
  """Samples the byte after window[0, position] (greedy when temperature is 0)."""
  model, _ = nnx.merge(graphdef, state)
  logits = model(window)[0, position]
  sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
  return jnp.where(temperature > 0, sampled, jnp.argmax(logits))


def generate(graphdef, state, config: Config, prompt: bytes, key: jax.Array) -> bytes:
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


def train(config: Config) -> dict:
  """Trains and samples; returns a summary of the losses and timings."""
  wall_start = time.perf_counter()
  data = load_bytes(config)
  train_data, val_data = split_data(data, config)
  val = val_batches(val_data, config)
  print(f"data: {len(train_data):,} train / {len(val_data):,} validation bytes from "
        f"{config.data or os.path.dirname(os.__file__) + '/*.py'}")

  model = ByteLM(config, rngs=nnx.Rngs(config.seed))
  tx, schedule = make_optimizer(config)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  del model, optimizer  # `state` holds the arrays from here on; train_step donates them
  isa = (f" (CPU kernel: {jax_flash.cpu_kernel_isa()})"
         if config.attention == "jax_flash" and jax.default_backend() == "cpu" else "")
  print(f"model: {count_params(nnx.merge(graphdef, state)[0]):,} parameters, {config.layers} "
        f"layers, width {config.width}, {config.heads} heads / {config.num_kv_heads} kv heads, "
        f"{config.positions} positions, {config.dtype}; attention: {config.attention}{isa}; "
        f"device: {jax.devices()[0].device_kind}")

  batches = train_batches(train_data, config)
  tokens_per_step = config.batch_size * config.seq_len
  first_loss = val_loss = None
  interval_losses, interval_start = [], time.perf_counter()
  for step in range(1, config.steps + 1):
    inputs, targets = next(batches)
    state, loss = train_step(graphdef, state, inputs, targets)
    interval_losses.append(loss)
    if step == 1:
      first_loss = float(loss)  # waits for the compile: the first interval is timed after it
      print(f"step {step:5d} | loss {first_loss:.3f} | compiled in "
            f"{time.perf_counter() - interval_start:.1f}s")
      interval_losses, interval_start = [], time.perf_counter()
      continue
    if step % config.log_every == 0 or step == config.steps:
      mean_loss = float(np.mean([float(l) for l in interval_losses]))
      elapsed = time.perf_counter() - interval_start
      print(f"step {step:5d} | loss {mean_loss:.3f} | lr {float(schedule(step)):.2e} | "
            f"{len(interval_losses) * tokens_per_step / elapsed:,.0f} tokens/s")
      interval_losses, interval_start = [], time.perf_counter()
    if step % config.eval_every == 0 or step == config.steps:
      val_loss = evaluate(graphdef, state, val)
      print(f"step {step:5d} | validation loss {val_loss:.3f} "
            f"({val_loss / math.log(2):.2f} bits/byte)")
      interval_start = time.perf_counter()  # do not charge the evaluation to training
  last_loss = float(loss)
  train_seconds = time.perf_counter() - wall_start

  key = jax.random.key(config.seed)
  sample = generate(graphdef, state, config, config.prompt.encode(), key)
  how = "greedy" if config.temperature == 0 else f"temperature {config.temperature}"
  print(f"\n---- sample ({how}) ----\n{sample.decode('utf-8', errors='replace')}\n----")
  summary = dict(first_loss=first_loss, last_loss=last_loss, val_loss=val_loss,
                 train_seconds=train_seconds, total_seconds=time.perf_counter() - wall_start)
  print(f"loss {first_loss:.3f} -> {last_loss:.3f} (validation {val_loss:.3f}); "
        f"trained in {train_seconds:.0f}s, {summary['total_seconds']:.0f}s in all")
  return summary


def main(argv: list[str] | None = None) -> None:
  config = parse_config(argv)
  train(config)


if __name__ == "__main__":
  main(sys.argv[1:])
