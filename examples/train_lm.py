"""Train a small GPT-style byte-level language model whose attention is jax_flash.

    python examples/train_lm.py                          # a few minutes on a 2-core CPU
    python examples/train_lm.py --attention xla          # the same model on jax.nn's XLA attention
    python examples/train_lm.py --compare jax_flash,xla  # both, same seed and data; plot, table
    python examples/train_lm.py --kv-heads 1 --positions learned --data README.md
    python examples/train_lm.py --checkpoint-dir /tmp/ckpt --stop-after 300   # then add --resume
    python examples/train_lm.py --preset gpt2-small --compare jax_flash,xla,cudnn   # on a GPU

The model is a decoder-only transformer in Flax NNX: byte embeddings (tied to the output layer),
pre-norm blocks (RMSNorm -> causal self-attention -> residual, RMSNorm -> GELU MLP -> residual),
rotary or learned positions, and optional grouped-query attention (``--kv-heads``). Attention is
``jax_flash.dot_product_attention(q, k, v, is_causal=True)``, a drop-in for
``jax.nn.dot_product_attention``; ``--attention xla`` / ``cudnn`` run jax.nn's implementations
instead. It trains with optax AdamW in one jit-compiled step that donates the model and optimizer
state, on bytes of real text: by default the Python standard library's own source files (no
download), or the file or folder given with ``--data``. The batch of step ``s`` is a function of
``(seed, s)`` alone, so runs with the same seed see the same data and a resumed run continues
exactly where it stopped.

Each run writes to ``--out`` (default ``runs/<time>-<attention>``): ``config.json``,
``metrics.json`` (per-step loss, validation loss, tokens/s, compile time, XLA's compiled memory of
the step and the peak device memory where the device reports it), ``loss.png`` and ``sample.txt``.
``--compare`` trains once per implementation, each in its own process (so peak memory is its own),
and writes ``compare.png``, ``compare.md`` and ``compare.json`` beside the runs' folders.
Checkpoints (orbax; model, optimizer, step, config and history) go to ``--checkpoint-dir``.

Needs the ``examples`` extra: ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import glob
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_flash

VOCAB_SIZE = 256  # bytes
IMPLEMENTATIONS = ("jax_flash", "xla", "cudnn")
STDLIB_DIR = os.path.dirname(os.__file__)


# ---- configuration ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
  """The experiment: everything that decides the numbers a run produces. Saved with every run and
  checkpoint; every field is also a command-line flag (``kv_heads`` -> ``--kv-heads``)."""

  # data
  data: str | None = None  # a text file or a folder; default: the standard library's *.py files
  data_glob: str = "*.py"  # which files of a folder to read (recursively)
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
  attention: Literal["jax_flash", "xla", "cudnn"] = "jax_flash"
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
  log_every: int = 20  # progress-bar refresh (and the tokens/s interval)
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
    """Raises ValueError for settings that cannot build a model."""
    if self.width % self.heads:
      raise ValueError(f"--width {self.width} must be a multiple of --heads {self.heads}")
    if self.heads % self.num_kv_heads:
      raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
    if self.positions == "rope" and self.head_dim % 2:
      raise ValueError(f"rotary positions need an even head dim; got {self.head_dim}")
    for name in ("steps", "seq_len", "batch_size", "log_every", "eval_every", "eval_batches"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be at least 1")

  @classmethod
  def from_dict(cls, values: dict[str, Any]) -> Config:
    """Builds a Config from a saved dict, ignoring keys this version does not know."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


# Fields that fix the shapes of the saved state or the data stream: a resumed run keeps them.
RESUME_FIXED = ("data", "data_glob", "max_data_bytes", "val_fraction", "layers", "width", "heads",
                "kv_heads", "mlp_ratio", "positions", "rope_base", "seq_len", "batch_size", "seed")

PRESETS: dict[str, dict[str, Any]] = {
    # Finishes in a few minutes on a 2-core CPU (the Config defaults).
    "demo": {},
    # GPT-2 small's shape (124M parameters with GPT-2's vocabulary; 85M here with 256 bytes) on
    # one GPU: bf16 activations, 16 x 1024 tokens a step. For --seq-len 4096 pass --batch-size 4
    # to keep the tokens per step (XLA attention materialises B*heads*T*T scores per layer).
    "gpt2-small": dict(
        layers=12, width=768, heads=12, seq_len=1024, batch_size=16, dtype="bfloat16",
        steps=500, learning_rate=6e-4, warmup_steps=50, max_data_bytes=64_000_000,  # all of it
        log_every=10, eval_every=100, eval_batches=16, sample_bytes=400),
}


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """How and where this invocation runs; not part of the experiment (not saved in checkpoints)."""

  out: str | None = None  # output folder; default runs/<time>-<attention> (or -compare)
  compare: str | None = None  # comma-separated implementations, e.g. jax_flash,xla,cudnn
  checkpoint_dir: str | None = None  # orbax checkpoints; none saved without it
  checkpoint_every: int = 200
  keep_checkpoints: int = 3
  resume: bool = False  # continue from the latest checkpoint in --checkpoint-dir
  stop_after: int | None = None  # end this invocation after that step (the schedule keeps --steps)
  progress: bool = True  # a progress bar (tqdm if installed); off: a log line per --log-every


FLAG_HELP = {
    "data": "a text file or a folder; None: the Python standard library's *.py files",
    "data_glob": "files of a --data folder to read, recursively",
    "max_data_bytes": "read at most this much text",
    "val_fraction": "the last fraction of the text is the validation set",
    "kv_heads": "key/value heads: fewer than --heads is grouped-query attention, 1 multi-query",
    "dtype": "activation dtype (parameters and optimizer state stay float32)",
    "attention": "jax_flash, or jax.nn.dot_product_attention with implementation xla or cudnn",
    "steps": "training steps (the learning-rate schedule spans them)",
    "learning_rate": "peak AdamW learning rate (linear warmup, cosine decay to a tenth)",
    "seed": "initialisation, data order and sampling",
    "log_every": "refresh the progress bar (and measure tokens/s) every N steps",
    "eval_every": "validation loss every N steps (and at the end)",
    "eval_batches": "validation batches (fixed windows) per evaluation",
    "prompt": "the sample's prompt",
    "sample_bytes": "bytes to generate at the end",
    "temperature": "sampling temperature; 0 is greedy",
    "out": "output folder; None: runs/<time>-<attention> (runs/<time>-compare)",
    "compare": "train once per implementation, e.g. jax_flash,xla,cudnn, with the same seed and "
               "data; one plot and one table",
    "checkpoint_dir": "save orbax checkpoints (model, optimizer, step, config) there",
    "checkpoint_every": "save every N steps (and at the end) when --checkpoint-dir is given",
    "keep_checkpoints": "keep the latest N checkpoints",
    "resume": "continue from the latest checkpoint in --checkpoint-dir with its config (flags "
              "given now may change e.g. --steps, --attention, --dtype, not shapes or data)",
    "stop_after": "end this invocation after step N, checkpointed; the schedule still spans "
                  "--steps (resume later with --resume)",
    "progress": "show a progress bar (tqdm if installed); without it, a log line per --log-every",
}


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, help_for) -> None:
  """One flag per dataclass field; defaults are SUPPRESSed so that only given flags are parsed."""
  for field in dataclasses.fields(cls):
    flag = "--" + field.name.replace("_", "-")
    kind = field.type
    kwargs: dict[str, Any] = dict(default=argparse.SUPPRESS, help=help_for(field))
    if kind.startswith("Literal["):
      kwargs["choices"] = [c.strip().strip("\"'") for c in kind[len("Literal["):-1].split(",")]
    elif kind in ("int", "int | None"):
      kwargs["type"] = int
    elif kind == "float":
      kwargs["type"] = float
    elif kind == "bool":
      kwargs["action"] = argparse.BooleanOptionalAction
    parser.add_argument(flag, **kwargs)


def _config_help(field: dataclasses.Field) -> str:
  presets = [f"{name}: {values[field.name]}" for name, values in PRESETS.items()
             if field.name in values]
  default = f"default {field.default}" + (f"; {', '.join(presets)}" if presets else "")
  return f"{FLAG_HELP[field.name]} ({default})" if field.name in FLAG_HELP else default


def _run_help(field: dataclasses.Field) -> str:
  default = f"default {field.default}"
  return f"{FLAG_HELP[field.name]} ({default})" if field.name in FLAG_HELP else default


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0], allow_abbrev=False,
      epilog="Flags given explicitly override --config, which overrides --preset.")
  parser.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                      help="base settings: demo (2-core CPU, minutes) or gpt2-small (one GPU)")
  parser.add_argument("--config", metavar="FILE", default=None,
                      help="start from the config.json of an earlier run")
  _add_dataclass_flags(parser.add_argument_group("experiment"), Config, _config_help)
  _add_dataclass_flags(parser.add_argument_group("run"), RunOptions, _run_help)
  return parser


@dataclasses.dataclass(frozen=True)
class Invocation:
  """The parsed command line: the resolved config and the flags that were given explicitly."""

  config: Config
  options: RunOptions
  preset: str
  config_file: str | None
  overrides: dict[str, Any]  # Config fields given on the command line


def parse_args(argv: Sequence[str] | None = None) -> Invocation:
  """Resolves the Config as preset <- --config file <- explicit flags, and the RunOptions."""
  parser = build_parser()
  args = vars(parser.parse_args(argv))
  preset, config_file = args.pop("preset"), args.pop("config")
  config_names = {f.name for f in dataclasses.fields(Config)}
  overrides = {k: v for k, v in args.items() if k in config_names}
  options = RunOptions(**{k: v for k, v in args.items() if k not in config_names})
  values = dict(PRESETS[preset])
  if config_file:
    with open(config_file) as f:
      values.update(json.load(f))
  values.update(overrides)
  config = Config.from_dict(values)
  try:
    config.validate()
  except ValueError as e:
    parser.error(str(e))
  return Invocation(config, options, preset, config_file, overrides)


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


# ---- data ---------------------------------------------------------------------------------------


def text_files(data: str | None, data_glob: str = "*.py") -> Iterator[str]:
  """The files to read, in a fixed order: `data` itself, the files matching `data_glob` in the
  folder `data` (recursively), or by default the standard library's own source, present on every
  machine with Python: its top-level ``*.py`` files first, then those of its packages
  (site-packages excluded)."""
  if data is None:
    yield from sorted(glob.glob(os.path.join(STDLIB_DIR, "*.py")))
    skip = {"site-packages", "dist-packages"}
    deeper = glob.glob(os.path.join(STDLIB_DIR, "*", "**", "*.py"), recursive=True)
    yield from sorted(p for p in deeper
                      if not skip & set(os.path.relpath(p, STDLIB_DIR).split(os.sep)))
  elif os.path.isdir(data):
    pattern = os.path.join(data, "**", data_glob)
    yield from sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  else:
    yield data


def read_bytes(data: str | None, data_glob: str, max_bytes: int) -> np.ndarray:
  """The text files of text_files concatenated into one uint8 array of at most max_bytes."""
  chunks, total = [], 0
  for path in text_files(data, data_glob):
    with open(path, "rb") as f:
      chunk = f.read(max_bytes - total)
    chunks.append(chunk)
    total += len(chunk)
    if total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def load_bytes(config: Config) -> np.ndarray:
  """The training text: at most max_data_bytes, and enough for two sequences."""
  data = read_bytes(config.data, config.data_glob, config.max_data_bytes)
  if len(data) < 2 * (config.seq_len + 1):
    raise ValueError(f"not enough text: {len(data)} bytes from {config.data or 'the stdlib'}")
  return data


def split_data(data: np.ndarray, config: Config) -> tuple[np.ndarray, np.ndarray]:
  """The last val_fraction of the bytes is held out for validation."""
  n_val = max(int(len(data) * config.val_fraction), config.seq_len + 1)
  return data[:-n_val], data[-n_val:]


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Inputs and next-byte targets, (len(starts), seq_len) int32 each."""
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  tokens = data[idx].astype(np.int32)
  return tokens[:, :-1], tokens[:, 1:]


def train_batch(data: np.ndarray, config: Config, step: int) -> tuple[np.ndarray, np.ndarray]:
  """The random training windows of `step`: a function of (seed, step) only, so the data order is
  the same in every run with that seed, whichever attention it uses and wherever it resumed."""
  rng = np.random.default_rng((config.seed, step))
  starts = rng.integers(0, len(data) - config.seq_len - 1, size=config.batch_size)
  return windows(data, starts, config.seq_len)


def val_batches(data: np.ndarray, config: Config) -> list[tuple[np.ndarray, np.ndarray]]:
  """A fixed set of evenly spaced validation windows, so losses compare across evaluations."""
  n = config.eval_batches * config.batch_size
  starts = np.linspace(0, len(data) - config.seq_len - 1, n).astype(np.int64)
  return [windows(data, s, config.seq_len) for s in np.split(starts, config.eval_batches)]


# ---- model --------------------------------------------------------------------------------------


def attention_fn(config: Config):
  """The attention of the model: (q, k, v) -> output, causal, all of the same signature."""
  if config.attention == "jax_flash":
    return functools.partial(jax_flash.dot_product_attention, is_causal=True)
  return functools.partial(jax.nn.dot_product_attention, is_causal=True,
                           implementation=config.attention)


def rope(x: jax.Array, base: float, positions: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding of x (B, T, heads, H), rotating pairs (i, i + H/2), at the given
  positions (T,) (default 0 .. T-1)."""
  seq_len, head_dim = x.shape[1], x.shape[-1]
  if positions is None:
    positions = jnp.arange(seq_len)
  freqs = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # (T, H/2)
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with optional grouped-query (fewer) key/value heads."""

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
  """Two-layer GELU MLP."""

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


def count_params(state: nnx.State) -> int:
  """Parameters in the model half of the (model, optimizer) state."""
  return sum(x.size for x in jax.tree.leaves(state[0]))


# ---- training step ------------------------------------------------------------------------------


def make_optimizer(config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with gradient clipping, linear warmup and cosine decay; returns (tx, schedule). Any
  config with learning_rate, warmup_steps, steps, grad_clip and weight_decay (train_lm_sharded's
  too)."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
      decay_steps=max(config.steps, config.warmup_steps + 1), end_value=config.learning_rate / 10)
  # Decay matrices only, not norm scales or biases.
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay, mask=decay_mask),
  ), schedule


def init_state(config: Config) -> tuple[nnx.GraphDef, nnx.State]:
  """A fresh model and optimizer, split into a static graphdef and the (model, optimizer) state."""
  model = ByteLM(config, rngs=nnx.Rngs(config.seed))
  tx, _ = make_optimizer(config)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  return nnx.split((model, optimizer))


def loss_fn(model: ByteLM, inputs: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy in nats."""
  logits = model(inputs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def train_step(graphdef: nnx.GraphDef, state: nnx.State, inputs: jax.Array,
               targets: jax.Array) -> tuple[nnx.State, jax.Array]:
  """One AdamW step on (model, optimizer) state; the old state's buffers are donated."""
  model, optimizer = nnx.merge(graphdef, state)
  loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
  optimizer.update(model, grads)
  return nnx.state((model, optimizer)), loss


def compile_train_step(graphdef: nnx.GraphDef, state: nnx.State, config: Config):
  """Compiles train_step ahead of time for the run's shapes.

  Returns (step(state, inputs, targets) -> (state, loss), seconds, XLA's memory figures of it).
  """
  start = time.perf_counter()
  example = np.zeros((config.batch_size, config.seq_len), np.int32)
  compiled = train_step.lower(graphdef, state, example, example).compile()
  seconds = time.perf_counter() - start
  memory: dict[str, int] = {}
  try:
    analysis = compiled.memory_analysis()
    for name in ("temp", "argument", "output", "alias", "generated_code"):
      memory[f"{name}_bytes"] = int(getattr(analysis, f"{name}_size_in_bytes"))
  except Exception:  # not every backend reports it
    pass
  return compiled, seconds, memory


@functools.partial(jax.jit, static_argnums=0)
def eval_step(graphdef: nnx.GraphDef, state: nnx.State, inputs: jax.Array,
              targets: jax.Array) -> jax.Array:
  model, _ = nnx.merge(graphdef, state)
  return loss_fn(model, inputs, targets)


def evaluate(graphdef: nnx.GraphDef, state: nnx.State, batches) -> float:
  """Mean loss over the fixed validation batches."""
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


# ---- checkpointing ------------------------------------------------------------------------------


class CheckpointStore:
  """Orbax checkpoints of the (model, optimizer) state plus a JSON item (step, config, history).

  Saves are synchronous: the state is donated to the next step right after, and the tokens/s of
  the run should not share the machine with a background writer.
  """

  def __init__(self, directory: str, keep: int):
    import orbax.checkpoint as ocp
    from orbax.checkpoint.checkpoint_managers import preservation_policy

    self._ocp = ocp
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            preservation_policy=preservation_policy.LatestN(keep),
            enable_async_checkpointing=False, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: nnx.State, meta: dict[str, Any]) -> None:
    ocp = self._ocp
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore(self, step: int, like: nnx.State) -> tuple[nnx.State, dict[str, Any]]:
    """Restores `step` into arrays shaped, typed and placed like `like`."""
    ocp = self._ocp
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def read_meta(self, step: int) -> dict[str, Any]:
    ocp = self._ocp
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def close(self) -> None:
    self._manager.close()


def resume_config(store: CheckpointStore, step: int, overrides: dict[str, Any]) -> Config:
  """The config saved at `step`, with the flags given now applied; the data and shape fields must
  not change (a different --attention, --dtype, --steps or learning rate is fine)."""
  saved = Config.from_dict(store.read_meta(step)["config"])
  changed = [k for k in RESUME_FIXED if k in overrides and overrides[k] != getattr(saved, k)]
  if changed:
    raise SystemExit(
        "error: --resume keeps the checkpoint's " + ", ".join(
            f"--{k.replace('_', '-')} ({getattr(saved, k)!r}, not {overrides[k]!r})"
            for k in changed))
  config = dataclasses.replace(saved, **overrides)
  try:
    config.validate()
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  return config


# ---- reporting ----------------------------------------------------------------------------------


@dataclasses.dataclass
class History:
  """What a run measured, step by step; saved in checkpoints so a resumed run reports it all."""

  train_steps: list[int] = dataclasses.field(default_factory=list)
  train_loss: list[float] = dataclasses.field(default_factory=list)
  val: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, loss)
  throughput: list[dict[str, float]] = dataclasses.field(default_factory=list)  # per interval

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, values: dict[str, Any]) -> History:
    return cls(list(values["train_steps"]), list(values["train_loss"]),
               [tuple(v) for v in values["val"]], list(values["throughput"]))

  def tokens_per_second(self) -> float | None:
    """Training throughput over the timed intervals, the first one (warm-up) left out."""
    intervals = self.throughput[1:] or self.throughput
    seconds = sum(i["seconds"] for i in intervals)
    return sum(i["tokens"] for i in intervals) / seconds if seconds else None


class Progress:
  """A progress bar over the steps: tqdm where installed, else one carriage-return line."""

  def __init__(self, total: int, initial: int, label: str, enabled: bool):
    self.enabled = enabled
    self._bar = None
    self._total, self._label = total, label
    self._written = -1  # the step whose line write() printed
    self._start = time.perf_counter()
    if enabled:
      try:
        from tqdm.auto import tqdm
        self._bar = tqdm(total=total, initial=initial, desc=label, unit="step",
                         dynamic_ncols=True, file=sys.stderr)
      except ImportError:
        pass

  def update(self, step: int, postfix: str | None = None) -> None:
    """Moves to `step`; with `postfix`, also shows the latest numbers."""
    if self._bar is not None:
      if postfix is not None:
        self._bar.set_postfix_str(postfix, refresh=False)
      self._bar.update(step - self._bar.n)
    elif self.enabled and postfix is not None:
      elapsed = time.perf_counter() - self._start
      sys.stderr.write(f"\r{self._label} {step}/{self._total} [{elapsed:.0f}s] {postfix}\033[K")
      sys.stderr.flush()
    elif postfix is not None and self._written != step:
      print(f"step {step:5d} | {postfix}", flush=True)

  def write(self, line: str, step: int | None = None) -> None:
    """Prints a line that stays above the bar; without a bar it replaces `step`'s log line."""
    if self._bar is not None:
      self._bar.write(line)
    else:
      if self.enabled:
        sys.stderr.write("\r\033[K")
      print(line, flush=True)
      self._written = step

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    elif self.enabled:
      sys.stderr.write("\n")


def device_memory() -> dict[str, int]:
  """Peak and limit of device 0's memory where the device reports them (GPUs; not the CPU), and
  the process's peak resident host memory."""
  out = {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
  stats = jax.devices()[0].memory_stats() or {}
  for key in ("peak_bytes_in_use", "bytes_limit"):
    if key in stats:
      out[f"device_{key}"] = int(stats[key])
  return out


def smooth(values: Sequence[float], window: int) -> np.ndarray:
  """Trailing moving average (shorter at the start)."""
  values = np.asarray(values, np.float64)
  if window <= 1 or len(values) == 0:
    return values
  sums = np.cumsum(np.insert(values, 0, 0.0))
  idx = np.arange(1, len(values) + 1)
  lo = np.maximum(idx - window, 0)
  return (sums[idx] - sums[lo]) / (idx - lo)


def plot_losses(runs: dict[str, dict[str, Any]], path: str, title: str) -> bool:
  """Training loss (per step, light; moving average, solid) and validation loss (markers) of one
  or more runs against the step, to a PNG. Returns False where matplotlib is not installed."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"matplotlib is not installed: no {os.path.basename(path)} "
          "(pip install -e '.[examples]')")
    return False
  fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
  styles, markers = ("-", "--", ":", "-."), ("o", "s", "^", "D")
  for i, (label, metrics) in enumerate(runs.items()):
    history = metrics["history"]
    color = f"C{i}"
    steps, losses = history["train_steps"], history["train_loss"]
    if len(runs) == 1:
      ax.plot(steps, losses, color=color, alpha=0.25, lw=0.8, label="train (per step)")
    window = max(1, len(steps) // 40)
    what = "train" if window == 1 else f"train ({window}-step mean)"
    ax.plot(steps, smooth(losses, window), color=color, ls=styles[i % 4], lw=1.8 - 0.3 * i,
            label=f"{label} {what}" if len(runs) > 1 else what)
    if history["val"]:
      val_steps, val_losses = zip(*history["val"])
      ax.plot(val_steps, val_losses, color=color, ls="none", marker=markers[i % 4], ms=7 - i,
              mfc="none" if i else color, label=f"{label} validation" if len(runs) > 1
              else "validation")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/byte)")
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True


def run_title(config: Config) -> str:
  return (f"byte-level GPT: {config.layers} layers x {config.width}, {config.heads}/"
          f"{config.num_kv_heads} heads, seq {config.seq_len}, batch {config.batch_size}, "
          f"{config.dtype}, seed {config.seed}")


def default_out(label: str) -> str:
  return os.path.join("runs", f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{label}")


def write_json(path: str, values: Any) -> None:
  with open(path, "w") as f:
    json.dump(values, f, indent=1)
    f.write("\n")


def write_report(out: str, metrics: dict[str, Any]) -> None:
  """metrics.json, loss.png and sample.txt of one run."""
  write_json(os.path.join(out, "metrics.json"), metrics)
  with open(os.path.join(out, "sample.txt"), "w") as f:
    f.write(metrics["sample"])
  config = Config.from_dict(metrics["config"])
  plot_losses({config.attention: metrics}, os.path.join(out, "loss.png"),
              f"{run_title(config)}; attention {config.attention}")


# ---- the training loop --------------------------------------------------------------------------


@dataclasses.dataclass
class Dataset:
  """The run's text, split, with its fixed validation batches."""

  train: np.ndarray
  val: np.ndarray
  val_batches: list[tuple[np.ndarray, np.ndarray]]

  @classmethod
  def load(cls, config: Config) -> Dataset:
    train_data, val_data = split_data(load_bytes(config), config)
    return cls(train_data, val_data, val_batches(val_data, config))


def open_checkpoints(config: Config, options: RunOptions, overrides: dict[str, Any]
                     ) -> tuple[CheckpointStore | None, Config, int | None]:
  """Opens --checkpoint-dir; returns (store or None, the run's config, the step to resume from).

  With --resume and a checkpoint there, the config is the checkpoint's with `overrides` applied.
  Without --resume, a directory that already holds checkpoints is refused.
  """
  if options.checkpoint_dir is None:
    if options.resume:
      raise SystemExit("error: --resume needs --checkpoint-dir")
    return None, config, None
  store = CheckpointStore(options.checkpoint_dir, options.keep_checkpoints)
  latest = store.latest_step()
  if latest is None:
    if options.resume:
      print(f"no checkpoint in {store.directory} yet: starting from step 0")
    return store, config, None
  if not options.resume:
    store.close()
    raise SystemExit(f"error: {store.directory} already holds checkpoints (latest step "
                     f"{latest}): add --resume to continue from it, or use another directory")
  return store, resume_config(store, latest, overrides), latest


def train_loop(config: Config, options: RunOptions, graphdef: nnx.GraphDef, state: nnx.State,
               step_fn, dataset: Dataset, start_step: int, history: History,
               store: CheckpointStore | None) -> tuple[nnx.State, float]:
  """Steps from start_step to --steps (or --stop-after), appending to `history`: every step's
  loss, the tokens/s of each --log-every interval, the validation loss every --eval-every steps;
  saves checkpoints on the way. Returns the final state and the seconds spent in training steps
  (evaluation and checkpointing not counted)."""
  _, schedule = make_optimizer(config)
  last_step = config.steps if options.stop_after is None else min(options.stop_after, config.steps)
  tokens_per_step = config.batch_size * config.seq_len
  progress = Progress(last_step, start_step, config.attention, options.progress)
  pending: list[jax.Array] = []  # losses still on the device: fetched once per interval
  val_loss = history.val[-1][1] if history.val else None
  train_seconds, interval_start = 0.0, time.perf_counter()
  for step in range(start_step + 1, last_step + 1):
    inputs, targets = train_batch(dataset.train, config, step)
    state, loss = step_fn(state, inputs, targets)
    pending.append(loss)
    eval_due = step % config.eval_every == 0 or step == last_step
    save_due = store is not None and (step % options.checkpoint_every == 0 or step == last_step)
    if step % config.log_every and not (eval_due or save_due):
      progress.update(step)
      continue
    losses = [float(x) for x in jax.device_get(pending)]  # waits for the interval's steps
    elapsed = time.perf_counter() - interval_start
    pending.clear()
    train_seconds += elapsed
    history.train_steps.extend(range(step - len(losses) + 1, step + 1))
    history.train_loss.extend(losses)
    tokens = len(losses) * tokens_per_step
    history.throughput.append(dict(step=step, steps=len(losses), seconds=elapsed, tokens=tokens,
                                   tokens_per_s=tokens / elapsed))
    line = (f"loss {np.mean(losses):.3f} | {tokens / elapsed:,.0f} tok/s | "
            f"lr {float(schedule(step)):.2e}")
    if eval_due:
      val_loss = evaluate(graphdef, state, dataset.val_batches)
      history.val.append((step, val_loss))
      progress.write(f"step {step:5d} | {line} | validation {val_loss:.3f} "
                     f"({val_loss / math.log(2):.2f} bits/byte)", step)
    if save_due:
      store.save(step, state, dict(step=step, config=dataclasses.asdict(config),
                                   history=history.to_json()))
    progress.update(step, line + (f" | val {val_loss:.3f}" if val_loss is not None else ""))
    interval_start = time.perf_counter()
  progress.close()
  return state, train_seconds


def run_metrics(config: Config, history: History, **fields: Any) -> dict[str, Any]:
  """The run's metrics.json: config, environment, history, memory and a summary."""
  losses = history.train_loss
  last_interval = history.throughput[-1]["steps"] if history.throughput else 1
  return dict(
      config=dataclasses.asdict(config), backend=jax.default_backend(),
      device=jax.devices()[0].device_kind, jax_version=jax.__version__,
      cpu_kernel_isa=(jax_flash.cpu_kernel_isa() if config.attention == "jax_flash"
                      and jax.default_backend() == "cpu" else None),
      memory=device_memory(), history=history.to_json(), **fields,
      summary=dict(
          tokens_per_s=history.tokens_per_second(),
          first_train_loss=losses[0] if losses else None,
          final_train_loss=losses[-1] if losses else None,  # the last step's
          final_train_loss_mean=float(np.mean(losses[-last_interval:])) if losses else None,
          final_val_loss=history.val[-1][1] if history.val else None))


def train(config: Config, options: RunOptions, overrides: dict[str, Any] | None = None,
          preset: str = "demo") -> dict[str, Any]:
  """Trains (from scratch or from the latest checkpoint), validates, checkpoints, samples and
  writes the run's report; returns its metrics."""
  wall_start = time.perf_counter()
  store, config, resume_step = open_checkpoints(config, options, overrides or {})
  check_attention_backend(config)
  out = options.out or default_out(config.attention)
  os.makedirs(out, exist_ok=True)
  write_json(os.path.join(out, "config.json"), dataclasses.asdict(config))

  dataset = Dataset.load(config)
  print(f"data: {len(dataset.train):,} train / {len(dataset.val):,} validation bytes from "
        f"{config.data or STDLIB_DIR + ' (*.py)'}")
  graphdef, state = init_state(config)
  start_step, history = 0, History()
  if resume_step is not None:
    state, meta = store.restore(resume_step, state)
    start_step, history = int(meta["step"]), History.from_json(meta["history"])
    print(f"resumed from {store.directory} at step {start_step}")
  n_params = count_params(state)
  isa = (f" (CPU kernel: {jax_flash.cpu_kernel_isa()})"
         if config.attention == "jax_flash" and jax.default_backend() == "cpu" else "")
  print(f"model: {n_params:,} parameters, {config.layers} layers, width {config.width}, "
        f"{config.heads} heads / {config.num_kv_heads} kv heads, {config.positions} positions, "
        f"{config.dtype}; attention: {config.attention}{isa}; "
        f"device: {jax.devices()[0].device_kind}")

  step_fn, compile_seconds, step_memory = compile_train_step(graphdef, state, config)
  temp = (f"; XLA temp memory {step_memory['temp_bytes'] / 2**20:,.1f} MiB"
          if "temp_bytes" in step_memory else "")
  print(f"train step compiled in {compile_seconds:.1f}s{temp}")
  try:
    state, train_seconds = train_loop(config, options, graphdef, state, step_fn, dataset,
                                      start_step, history, store)
    if store is not None and store.latest_step() is not None:
      print(f"latest checkpoint: {store.directory}/{store.latest_step()}")
  finally:
    if store is not None:
      store.close()

  sample = generate(graphdef, state, config, config.prompt.encode(), jax.random.key(config.seed))
  text = sample.decode("utf-8", errors="replace")
  how = "greedy" if config.temperature == 0 else f"temperature {config.temperature}"
  print(f"\n---- sample ({how}) ----\n{text}\n----")

  metrics = run_metrics(
      config, history, preset=preset, parameters=n_params, resumed_from_step=resume_step,
      compile_seconds=compile_seconds, step_memory=step_memory, sample=text)
  s = metrics["summary"]
  s.update(train_seconds=train_seconds, total_seconds=time.perf_counter() - wall_start)
  write_report(out, metrics)
  val = f"{s['final_val_loss']:.3f}" if s["final_val_loss"] is not None else "n/a"
  peak = metrics["memory"].get("device_peak_bytes_in_use")
  print(f"loss {s['first_train_loss']:.3f} -> {s['final_train_loss']:.3f} (validation {val}); "
        f"{s['tokens_per_s'] or 0:,.0f} tokens/s"
        + (f"; peak device memory {format_bytes(peak)}" if peak else "")
        + f"; trained {train_seconds:.0f}s, {s['total_seconds']:.0f}s in all")
  print(f"wrote {out}/: config.json metrics.json loss.png sample.txt")
  return metrics


# ---- comparison ---------------------------------------------------------------------------------


def parse_implementations(spec: str) -> list[str]:
  names = [s.strip() for s in spec.split(",") if s.strip()]
  unknown = [n for n in names if n not in IMPLEMENTATIONS]
  if unknown or not names or len(set(names)) != len(names):
    raise SystemExit(f"error: --compare takes distinct names from {','.join(IMPLEMENTATIONS)}; "
                     f"got {spec!r}")
  return names


def format_bytes(n: int | None) -> str:
  return "n/a" if n is None else f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def peak_memory(metrics: dict[str, Any]) -> str:
  """The device's peak memory where it reports one (GPUs), else the process's peak host RSS."""
  memory = metrics["memory"]
  if "device_peak_bytes_in_use" in memory:
    return format_bytes(memory["device_peak_bytes_in_use"])
  return f"{format_bytes(memory.get('host_peak_rss_bytes'))} (host RSS)"


def comparison_table(results: dict[str, dict[str, Any] | None]) -> str:
  """A markdown table of the runs (None: the run failed)."""
  rows = ["| attention | tokens/s | peak memory | XLA temp memory of the step | compile s "
          "| final train loss | final val loss | train s |",
          "|---|---|---|---|---|---|---|---|"]
  for name, m in results.items():
    if m is None:
      rows.append(f"| {name} | failed | | | | | | |")
      continue
    s = m["summary"]
    rows.append(
        f"| {name} | {s['tokens_per_s'] or 0:,.0f} | {peak_memory(m)} | "
        f"{format_bytes(m['step_memory'].get('temp_bytes'))} | {m['compile_seconds']:.1f} | "
        f"{s['final_train_loss']:.4f} | {s['final_val_loss']:.4f} | {s['train_seconds']:.1f} |")
  return "\n".join(rows)


def curve_differences(done: dict[str, dict[str, Any]]) -> str:
  """How far each run's per-step training loss strays from the first run's, over common steps."""
  (first, reference), *others = done.items()
  ref = dict(zip(reference["history"]["train_steps"], reference["history"]["train_loss"]))
  lines = []
  for name, m in others:
    diffs = [abs(loss - ref[step]) for step, loss in
             zip(m["history"]["train_steps"], m["history"]["train_loss"]) if step in ref]
    if diffs:
      lines.append(f"- {name} vs {first}: per-step training loss differs by at most "
                   f"{max(diffs):.2e} (mean {np.mean(diffs):.2e}) over {len(diffs)} steps")
  return "\n".join(lines)


def compare(invocation: Invocation, names: list[str]) -> dict[str, dict[str, Any] | None]:
  """Trains the same config once per attention implementation, each in its own process (its peak
  memory is its own), with the same seed and data order; writes compare.{png,md,json}."""
  config, options = invocation.config, invocation.options
  for name in names:  # fail before training anything
    check_attention_backend(dataclasses.replace(config, attention=name))
  out = options.out or default_out("compare")
  os.makedirs(out, exist_ok=True)
  results: dict[str, dict[str, Any] | None] = {}
  for i, name in enumerate(names):
    run_dir = os.path.join(out, name)
    os.makedirs(run_dir, exist_ok=True)
    config_path = os.path.join(run_dir, "config.json")
    write_json(config_path, dataclasses.asdict(dataclasses.replace(config, attention=name)))
    argv = [sys.executable, os.path.abspath(__file__), "--config", config_path, "--out", run_dir,
            "--progress" if options.progress else "--no-progress",
            "--checkpoint-every", str(options.checkpoint_every),
            "--keep-checkpoints", str(options.keep_checkpoints)]
    if options.checkpoint_dir:
      argv += ["--checkpoint-dir", os.path.join(options.checkpoint_dir, name)]
    if options.resume:
      argv += ["--resume"]
    if options.stop_after is not None:
      argv += ["--stop-after", str(options.stop_after)]
    print(f"\n==== [{i + 1}/{len(names)}] attention {name} ====", flush=True)
    rc = subprocess.call(argv)
    metrics_path = os.path.join(run_dir, "metrics.json")
    if rc == 0 and os.path.exists(metrics_path):
      with open(metrics_path) as f:
        results[name] = json.load(f)
    else:
      print(f"attention {name} failed (exit status {rc}); the comparison goes on without it")
      results[name] = None

  done = {name: m for name, m in results.items() if m is not None}
  table = comparison_table(results)
  differences = curve_differences(done) if done else ""
  if differences:
    table += "\n\n" + differences
  if done:  # (a resumed comparison runs the checkpoints' configs)
    first = next(iter(done.values()))
    config, device = Config.from_dict(first["config"]), first["device"]
  else:
    device = "?"
  heading = f"{run_title(config)}; {config.steps} steps on {device}"
  with open(os.path.join(out, "compare.md"), "w") as f:
    f.write(f"{heading}\n\n{table}\n")
  write_json(os.path.join(out, "compare.json"), dict(
      config=dataclasses.asdict(config), implementations=names,
      results={n: (None if m is None else dict(summary=m["summary"], memory=m["memory"],
                                               step_memory=m["step_memory"],
                                               compile_seconds=m["compile_seconds"]))
               for n, m in results.items()}))
  if done:
    plot_losses(done, os.path.join(out, "compare.png"), heading)
  print(f"\n{heading}\n\n{table}\n\nwrote {out}/: compare.png compare.md compare.json "
        f"and one folder per implementation")
  return results


def main(argv: Sequence[str] | None = None) -> None:
  invocation = parse_args(argv)
  if invocation.options.resume and not invocation.options.checkpoint_dir:
    raise SystemExit("error: --resume needs --checkpoint-dir")
  if not invocation.options.resume:  # (a resumed run checks the checkpoint's config)
    check_attention_backend(invocation.config)
  if invocation.options.compare:
    compare(invocation, parse_implementations(invocation.options.compare))
  else:
    train(invocation.config, invocation.options, invocation.overrides, invocation.preset)


if __name__ == "__main__":
  main(sys.argv[1:])
