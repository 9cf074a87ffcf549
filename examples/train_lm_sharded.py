"""Train a small byte-level GPT on a device mesh: data, tensor (heads) and sequence parallelism.

    python examples/train_lm_sharded.py                       # 8 simulated CPU devices, mesh 2,2,2
    python examples/train_lm_sharded.py --mesh 8,1,1          # data parallel only
    python examples/train_lm_sharded.py --mesh 1,1,8          # sequence (context) parallel only
    python examples/train_lm_sharded.py --mesh 2,4,1 --dump-collectives   # + the step's collectives
    python examples/train_lm_sharded.py --devices 4 --mesh 1,2,2 --layout contiguous
    python examples/train_lm_sharded.py                       # on a GPU host: all its GPUs, bf16

Several processes (one per host, or one per GPU), under ``jax.distributed``: every process runs
the same command with its own ``--process-id`` (or ``JAX_PROCESS_ID``), and ``--devices`` and
``--mesh`` are global; on the CPU each process simulates ``--devices / --num-processes``
devices and the processes talk through Gloo. Two processes on one machine:

    python examples/train_lm_sharded.py --coordinator-address localhost:12345 \
        --num-processes 2 --process-id 0 &
    python examples/train_lm_sharded.py --coordinator-address localhost:12345 \
        --num-processes 2 --process-id 1

Under SLURM or Open MPI, ``--distributed`` alone lets ``jax.distributed.initialize`` read the
coordinator, the process count and id from the cluster's environment. The losses are those of
one process with the same ``--devices`` and ``--mesh`` (the batches are built identically on
every process; each process places only its devices' slices).

The mesh has three axes, ``("data", "tensor", "seq")``:

* ``data``: the batch is split over it (parameters replicated along it; gradients are summed).
* ``tensor``: Megatron-style tensor parallelism. The q/k/v projections are column-parallel
  (sharded by heads), the attention output projection is row-parallel; the MLP's up projection is
  column-parallel and its down projection row-parallel; the byte embedding (tied to the output
  layer) is vocabulary-parallel. Each device runs attention on its own heads.
* ``seq``: the sequence is split over it (context parallelism). Everything but attention is
  position-wise; attention is ``jax_flash.context_parallel_attention`` inside ``jax.shard_map``:
  by default (``--context-parallel ring``) keys and values travel around the ring of the ``seq``
  devices; ``all_to_all`` turns the sequence slices into head slices of the whole sequence and
  back (DeepSpeed-Ulysses), ``all_gather`` gathers K/V. With the (default) ``zigzag`` layout each
  device holds chunks ``r`` and ``2P-1-r`` of the sequence, so under the causal mask every device
  has the same work: the tokens of every batch are permuted into that order once, when the batch
  is built (targets and rotary positions with them; the mean loss does not depend on the order).
  With a ``seq`` axis of size 1, attention is ``jax_flash.dot_product_attention``, whose kernels
  partition over batch and heads under ``jax.jit`` with no communication.

Parameters and optimizer state are placed with ``NamedSharding``; activations are pinned with
``jax.lax.with_sharding_constraint``; the training step is one ``jax.jit`` with in/out shardings
that donates the state. On the CPU the devices are simulated
(``--xla_force_host_platform_device_count``, set from ``--devices`` before JAX is imported); on
GPUs the real ones are used, unchanged. The script prints the mesh, the parameter and activation
shardings, per-device memory, the loss, tokens/s and a final validation loss; with
``--dump-collectives``, the collectives of the compiled step and the mesh axes they run over.
Data: the Python standard library's own source, as bytes (no download), or ``--data PATH``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

# The lm library lives beside this script: importable from any working directory, uninstalled.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lm.host_devices import force_host_device_count  # noqa: E402  (imports no JAX)

DEFAULT_CPU_DEVICES = 8
AXES = ("data", "tensor", "seq")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows defaults, except None (the help says what None means)."""

  def _get_help_string(self, action):
    if action.default is None or action.default is False:
      return action.help
    return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                              formatter_class=_HelpFormatter)
  g = p.add_argument_group("devices")
  g.add_argument("--devices", type=int, default=None,
                 help=f"devices to use; on the CPU, the number simulated (default "
                      f"{DEFAULT_CPU_DEVICES}); on GPUs, all of them by default")
  g.add_argument("--mesh", default=None,
                 help="data,tensor,seq axis sizes, product = --devices (default: the device count "
                      "factored over the three axes, e.g. 2,2,2 for 8)")
  g.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag",
                 help="the sequence layout over the seq axis")
  g.add_argument("--context-parallel", choices=("ring", "all_to_all", "all_gather"),
                 default="ring",
                 help="how attention runs over the seq axis (jax_flash.context_parallel_attention"
                      "'s strategy): K/V around a ring, all-to-all to head slices "
                      "(DeepSpeed-Ulysses), or K/V gathered")
  g.add_argument("--coordinator-address", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                 help="host:port of process 0's coordinator: run under jax.distributed "
                      "(default: $JAX_COORDINATOR_ADDRESS)")
  g.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"),
                 help="processes in the run (default: $JAX_NUM_PROCESSES, or the cluster's)")
  g.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"),
                 help="this process's index, 0..num-processes-1 (default: $JAX_PROCESS_ID, or "
                      "the cluster's)")
  g.add_argument("--distributed", action="store_true",
                 help="call jax.distributed.initialize even without the three flags above "
                      "(it reads SLURM's, Open MPI's or other clusters' variables)")
  g.add_argument("--dump-collectives", action="store_true",
                 help="list the collectives of the compiled training step (kind, mesh axes, "
                      "count, bytes) and write its HLO text to the temp folder")
  m = p.add_argument_group("model")
  m.add_argument("--layers", type=int, default=2,
                 help="transformer blocks")
  m.add_argument("--width", type=int, default=128,
                 help="model width")
  m.add_argument("--heads", type=int, default=4,
                 help="attention heads (split over the tensor axis)")
  m.add_argument("--mlp-ratio", type=int, default=4,
                 help="MLP hidden size / width")
  m.add_argument("--positions", choices=("rope", "learned"), default="rope",
                 help="rotary or learned positions")
  m.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                 help="activation dtype (parameters stay float32); auto: float32 on the CPU, "
                      "bfloat16 on GPUs (jax_flash's CUDA kernels take bf16/fp16)")
  t = p.add_argument_group("training")
  t.add_argument("--seq-len", type=int, default=256,
                 help="tokens (bytes) per sequence (split over the seq axis)")
  t.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
  t.add_argument("--steps", type=int, default=1000,
                 help="training steps (the schedule spans them)")
  t.add_argument("--learning-rate", type=float, default=4e-3,
                 help="peak AdamW learning rate (warmup, cosine decay to a tenth)")
  t.add_argument("--warmup-steps", type=int, default=20,
                 help="linear warmup steps")
  t.add_argument("--weight-decay", type=float, default=0.1,
                 help="AdamW weight decay (matrices only)")
  t.add_argument("--grad-clip", type=float, default=1.0,
                 help="global gradient-norm clip")
  t.add_argument("--seed", type=int, default=0,
                 help="initialisation and data order")
  t.add_argument("--log-every", type=int, default=50,
                 help="print the loss and tokens/s every N steps")
  t.add_argument("--eval-batches", type=int, default=4,
                 help="validation batches for the final validation loss (and the first)")
  t.add_argument("--data", default=None,
                 help="a text file or folder (*.py read recursively); default: the stdlib source")
  t.add_argument("--max-data-bytes", type=int, default=4_000_000,
                 help="read at most this much text")
  t.add_argument("--metrics-out", default=None,
                 help="write every step's loss and the validation losses (full precision) to "
                      "this JSON file (process 0)")
  return p


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return int(value) if value else None


def multi_process(args: argparse.Namespace) -> bool:
  return bool(args.distributed or args.coordinator_address or
              (args.num_processes or 1) > 1)


def local_cpu_devices(args: argparse.Namespace) -> int:
  """Simulated CPU devices in this process: --devices split over the processes."""
  total = args.devices or DEFAULT_CPU_DEVICES
  processes = args.num_processes or 1
  if total % processes:
    raise SystemExit(f"error: --devices {total} does not split over {processes} processes")
  return total // processes


if __name__ == "__main__":
  ARGS = build_parser().parse_args()
  force_host_device_count(local_cpu_devices(ARGS))

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_flash  # noqa: E402
from lm.collectives import dump_collectives  # noqa: E402
from lm.data import STDLIB_DIR, read_bytes  # noqa: E402
from lm.model import VOCAB_SIZE, rope  # noqa: E402
from lm.training import make_optimizer  # noqa: E402


def start_processes(args: argparse.Namespace) -> None:
  """jax.distributed.initialize with what the flags (or the environment) give; None lets it
  detect a cluster. On the CPU the processes' collectives go through Gloo (jaxlib's CPU
  backend has no cross-process collectives otherwise). Call before anything touches a
  device."""
  if not multi_process(args):
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU backend only
  jax.distributed.initialize(coordinator_address=args.coordinator_address,
                             num_processes=args.num_processes, process_id=args.process_id)


def log(*args, **kwargs) -> None:
  """print, on process 0 only."""
  if jax.process_index() == 0:
    print(*args, **kwargs)


def global_array(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A global array from the same host array on every process: each process places its own
  devices' slices."""
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

ROPE_BASE = 10_000.0

# Activation layouts. B batch, T sequence, D width, N heads, H head dim, F MLP hidden, V vocab.
X_SPEC = P("data", "seq", None)                 # residual stream (B, T, D)
HEADS_SPEC = P("data", "seq", "tensor", None)   # q, k, v, attention output (B, T, N, H)
HIDDEN_SPEC = P("data", "seq", "tensor")        # MLP hidden (B, T, F)
LOGITS_SPEC = P("data", "seq", "tensor")        # logits (B, T, V), vocabulary-parallel
TOKENS_SPEC = P("data", "seq")                  # tokens and targets (B, T)


# ---- devices and mesh ---------------------------------------------------------------------------


def pick_devices(requested: int | None) -> list:
  devices = jax.devices()
  if jax.default_backend() == "cpu":
    n = requested or DEFAULT_CPU_DEVICES
  else:
    n = requested or len(devices)
  if n > len(devices):
    raise SystemExit(f"error: --devices {n} but JAX sees {len(devices)} {jax.default_backend()} "
                     f"devices")
  return devices[:n]


def default_mesh_shape(n: int) -> tuple[int, int, int]:
  """n's prime factors dealt out over (data, tensor, seq), the smallest axis first: 8 -> 2,2,2."""
  shape, rest, f = [1, 1, 1], n, 2
  factors = []
  while rest > 1:
    while rest % f == 0:
      factors.append(f)
      rest //= f
    f += 1
  for f in sorted(factors, reverse=True):
    i = min(range(3), key=lambda a: shape[a])
    shape[i] *= f
  return tuple(shape)


def parse_mesh(spec: str | None, n: int) -> tuple[int, int, int]:
  if spec is None:
    return default_mesh_shape(n)
  try:
    shape = tuple(int(s) for s in spec.split(","))
  except ValueError:
    shape = ()
  if len(shape) != 3 or min(shape) < 1:
    raise SystemExit(f"error: --mesh takes three positive sizes data,tensor,seq; got {spec!r}")
  if math.prod(shape) != n:
    raise SystemExit(f"error: --mesh {spec} has {math.prod(shape)} devices but --devices is {n} "
                     f"(on the CPU, pass --devices {math.prod(shape)})")
  return shape


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int
  width: int
  heads: int
  mlp_ratio: int
  positions: str
  dtype: str
  seq_len: int
  batch_size: int
  steps: int
  learning_rate: float
  warmup_steps: int
  weight_decay: float
  grad_clip: float
  seed: int
  layout: str
  context_parallel: str = "ring"

  @property
  def head_dim(self) -> int:
    return self.width // self.heads

  @property
  def hidden(self) -> int:
    return self.mlp_ratio * self.width


def validate(config: Config, mesh_shape: tuple[int, int, int]) -> None:
  """The sizes must split evenly over the mesh axes that shard them."""
  data, tensor, seq = mesh_shape
  problems = []
  if config.width % config.heads:
    problems.append(f"--width {config.width} is not a multiple of --heads {config.heads}")
  if config.positions == "rope" and config.head_dim % 2:
    problems.append(f"rotary positions need an even head dim (got {config.head_dim})")
  if config.batch_size % data:
    problems.append(f"--batch-size {config.batch_size} does not split over data={data}")
  if config.heads % tensor:
    problems.append(f"--heads {config.heads} does not split over tensor={tensor}")
  elif config.context_parallel == "all_to_all" and (config.heads // tensor) % seq:
    problems.append(f"--context-parallel all_to_all needs the {config.heads // tensor} heads "
                    f"of each tensor slice to split over seq={seq}")
  if config.hidden % tensor or VOCAB_SIZE % tensor:
    problems.append(f"the MLP hidden size {config.hidden} and the vocabulary {VOCAB_SIZE} must "
                    f"split over tensor={tensor}")
  chunks = 2 * seq if (seq > 1 and config.layout == "zigzag") else seq
  if config.seq_len % chunks:
    problems.append(f"--seq-len {config.seq_len} must be a multiple of {chunks} (seq={seq}, "
                    f"{config.layout} layout)")
  if problems:
    raise SystemExit("error: " + "; ".join(problems))


# ---- data ---------------------------------------------------------------------------------------


class Batches:
  """Random training windows and fixed validation windows, with their tokens permuted into the
  ring layout's order (zig-zag) once, here, on the host: position ``i`` of a batch row holds the
  token at original position ``order[i]``, its target is the byte after that one, and the model
  is told ``order`` as the positions (rotary angles / learned embeddings)."""

  def __init__(self, config: Config, raw: np.ndarray, order: np.ndarray, val_fraction=0.1):
    n_val = max(int(len(raw) * val_fraction), config.seq_len + 1)
    self.train, self.val = raw[:-n_val], raw[-n_val:]
    self.config, self.order = config, order

  def _windows(self, data: np.ndarray, starts: np.ndarray):
    idx = starts[:, None] + self.order[None, :]
    return data[idx].astype(np.int32), data[idx + 1].astype(np.int32)

  def train_batch(self, step: int):
    rng = np.random.default_rng((self.config.seed, step))
    starts = rng.integers(0, len(self.train) - self.config.seq_len - 1,
                          size=self.config.batch_size)
    return self._windows(self.train, starts)

  def val_batches(self, count: int):
    n = count * self.config.batch_size
    starts = np.linspace(0, len(self.val) - self.config.seq_len - 1, n).astype(np.int64)
    return [self._windows(self.val, s) for s in np.split(starts, count)]


# ---- model: parameters as a pytree with a PartitionSpec per leaf --------------------------------


def param_specs(config: Config) -> dict:
  """Megatron-style tensor parallelism over "tensor"; every parameter replicated over "data"
  and "seq"."""
  block = {
      "attn_norm": P(None),
      "wq": P(None, "tensor", None),   # (D, N, H) column-parallel: heads split
      "wk": P(None, "tensor", None),
      "wv": P(None, "tensor", None),
      "wo": P("tensor", None, None),   # (N, H, D) row-parallel: partial sums over heads
      "mlp_norm": P(None),
      "w_up": P(None, "tensor"),       # (D, F) column-parallel
      "b_up": P("tensor"),
      "w_down": P("tensor", None),     # (F, D) row-parallel
      "b_down": P(None),
  }
  specs = {"embed": P("tensor", None),  # (V, D) vocabulary-parallel, tied to the output layer
           "final_norm": P(None),
           "blocks": [dict(block) for _ in range(config.layers)]}
  if config.positions == "learned":
    specs["pos_embed"] = P(None, None)  # (T, D)
  return specs


def init_params(config: Config, key: jax.Array) -> dict:
  d, n, h, f = config.width, config.heads, config.head_dim, config.hidden
  normal = lambda k, shape, std: std * jax.random.normal(k, shape, jnp.float32)
  out_std = 0.02 / math.sqrt(2 * config.layers)
  keys = iter(jax.random.split(key, 2 + 6 * config.layers))
  params = {"embed": normal(next(keys), (VOCAB_SIZE, d), 0.02),
            "final_norm": jnp.ones((d,), jnp.float32), "blocks": []}
  pos_key = next(keys)
  if config.positions == "learned":
    params["pos_embed"] = normal(pos_key, (config.seq_len, d), 0.02)
  for _ in range(config.layers):
    params["blocks"].append({
        "attn_norm": jnp.ones((d,), jnp.float32),
        "wq": normal(next(keys), (d, n, h), d ** -0.5),
        "wk": normal(next(keys), (d, n, h), d ** -0.5),
        "wv": normal(next(keys), (d, n, h), d ** -0.5),
        "wo": normal(next(keys), (n, h, d), out_std),
        "mlp_norm": jnp.ones((d,), jnp.float32),
        "w_up": normal(next(keys), (d, f), d ** -0.5),
        "b_up": jnp.zeros((f,), jnp.float32),
        "w_down": normal(next(keys), (f, d), out_std),
        "b_down": jnp.zeros((d,), jnp.float32),
    })
  return params


def rms_norm(x, scale, eps=1e-6):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale).astype(x.dtype)


class Model:
  """A pre-norm causal transformer over bytes, as pure functions of the parameter pytree."""

  def __init__(self, config: Config, mesh: jax.sharding.Mesh, positions: np.ndarray):
    self.config, self.mesh = config, mesh
    self.positions = positions  # (T,) the original position of each (permuted) token
    self.seq_parallel = mesh.shape["seq"] > 1
    if self.seq_parallel:
      def local(q, k, v):  # this device's (B/data, T/seq, N/tensor, H) slices
        return jax_flash.context_parallel_attention(
            q, k, v, axis_name="seq", strategy=config.context_parallel, layout=config.layout,
            is_causal=True, implementation=None)
      self._ring = jax.shard_map(local, mesh=mesh, in_specs=(HEADS_SPEC,) * 3,
                                 out_specs=HEADS_SPEC)

  def constrain(self, x, spec):
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def attention(self, q, k, v):
    if self.seq_parallel:
      return self._ring(q, k, v)
    # Sequence whole on every device: the kernels partition over batch and heads by themselves.
    return jax_flash.dot_product_attention(q, k, v, is_causal=True, implementation=None)

  def block(self, p, x, positions):
    c = self.config
    h = rms_norm(x, p["attn_norm"])
    q, k, v = (self.constrain(jnp.einsum("btd,dnh->btnh", h, p[w].astype(h.dtype)), HEADS_SPEC)
               for w in ("wq", "wk", "wv"))
    if c.positions == "rope":
      q, k = rope(q, ROPE_BASE, positions), rope(k, ROPE_BASE, positions)
    o = self.constrain(self.attention(q, k, v), HEADS_SPEC)
    x = self.constrain(x + jnp.einsum("btnh,nhd->btd", o, p["wo"].astype(o.dtype)), X_SPEC)
    h = rms_norm(x, p["mlp_norm"])
    h = self.constrain(h @ p["w_up"].astype(h.dtype) + p["b_up"].astype(h.dtype), HIDDEN_SPEC)
    h = jax.nn.gelu(h)
    return self.constrain(x + h @ p["w_down"].astype(h.dtype) + p["b_down"].astype(h.dtype),
                          X_SPEC)

  def logits(self, params, tokens):
    c = self.config
    dtype = jnp.dtype(c.dtype)
    positions = jnp.asarray(self.positions)
    x = params["embed"].astype(dtype)[tokens]
    if c.positions == "learned":
      x = x + params["pos_embed"].astype(dtype)[positions][None]
    x = self.constrain(x, X_SPEC)
    for p in params["blocks"]:
      x = self.block(p, x, positions)
    x = rms_norm(x, params["final_norm"])
    logits = jnp.einsum("btd,vd->btv", x, params["embed"].astype(dtype))  # tied output layer
    return self.constrain(logits.astype(jnp.float32), LOGITS_SPEC)

  def loss(self, params, tokens, targets):
    logits = self.logits(params, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ---- training -----------------------------------------------------------------------------------


def state_shardings(config: Config, mesh, tx):
  """NamedShardings of (params, optimizer state): AdamW's moments like their parameters, the
  step counters replicated."""
  specs = param_specs(config)
  params = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))
  abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  abstract_opt = jax.eval_shape(tx.init, abstract)
  replicated = NamedSharding(mesh, P())
  opt = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, params,
                              transform_non_params=lambda _: replicated)
  return params, opt


def build_steps(model: Model, tx, shardings, mesh):
  tokens = NamedSharding(mesh, TOKENS_SPEC)
  replicated = NamedSharding(mesh, P())

  def train_step(state, inputs, targets):
    params, opt_state = state
    loss, grads = jax.value_and_grad(model.loss)(params, inputs, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  train = jax.jit(train_step, in_shardings=(shardings, tokens, tokens),
                  out_shardings=(shardings, replicated), donate_argnums=0)
  evaluate = jax.jit(model.loss, in_shardings=(shardings[0], tokens, tokens),
                     out_shardings=replicated)
  return train, evaluate


# ---- reporting ----------------------------------------------------------------------------------


def mib(n) -> str:
  return f"{n / 2**20:,.2f} MiB"


def spec_str(spec: P) -> str:
  return "(" + ", ".join("-" if s is None else str(s) for s in spec) + ")"


def print_shardings(config: Config, mesh, params) -> None:
  log("parameter shardings (global shape -> per-device shard; '-' = not split):")
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  for path, x in flat:
    name = jax.tree_util.keystr(path)
    if "['blocks'][" in name and not name.startswith("['blocks'][0]"):
      continue  # the other blocks are laid out like block 0
    shard = x.sharding.shard_shape(x.shape)
    log(f"  {name:32s} {str(x.shape):16s} {spec_str(x.sharding.spec):22s} -> {shard}")
  if config.layers > 1:
    log(f"  (blocks 1..{config.layers - 1} like block 0)")
  b, t, d, n, h, f = (config.batch_size, config.seq_len, config.width, config.heads,
                      config.head_dim, config.hidden)
  log("activation shardings (pinned with with_sharding_constraint):")
  for what, shape, spec in [("tokens, targets", (b, t), TOKENS_SPEC),
                            ("residual stream x", (b, t, d), X_SPEC),
                            ("q, k, v, attention out", (b, t, n, h), HEADS_SPEC),
                            ("MLP hidden", (b, t, f), HIDDEN_SPEC),
                            ("logits", (b, t, VOCAB_SIZE), LOGITS_SPEC)]:
    shard = NamedSharding(mesh, spec).shard_shape(shape)
    log(f"  {what:32s} {str(shape):16s} {spec_str(spec):22s} -> {shard}")


def print_memory(mesh, state, compiled, label: str) -> None:
  """Per device: the bytes of the (params, optimizer) state it holds, and the allocator's figures
  where the device reports them (GPUs); plus XLA's compiled per-device memory of the step."""
  held: Counter = Counter()
  for x in jax.tree.leaves(state):
    for s in x.addressable_shards:
      held[s.device] += s.data.nbytes
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  others = "" if len(local) == mesh.devices.size else f", those of process {jax.process_index()}"
  log(f"per-device memory ({label}{others}):")
  for d in local:
    stats = d.memory_stats() or {}
    extra = ""
    if "bytes_in_use" in stats:
      extra = (f"; in use {mib(stats['bytes_in_use'])}, peak "
               f"{mib(stats.get('peak_bytes_in_use', 0))}"
               + (f" of {mib(stats['bytes_limit'])}" if "bytes_limit" in stats else ""))
    coords = dict(zip(mesh.axis_names, np.argwhere(mesh.devices == d)[0]))
    where = ",".join(f"{a}={int(i)}" for a, i in coords.items())
    log(f"  {str(d):18s} [{where}] params+optimizer {mib(held[d])}{extra}")
  if not any(d.memory_stats() for d in local):
    log("  (the devices report no allocator statistics here: see XLA's figures below)")
  try:
    a = compiled.memory_analysis()
    log(f"  XLA's compiled train step, per device: arguments {mib(a.argument_size_in_bytes)}, "
        f"outputs {mib(a.output_size_in_bytes)} (aliased to donated inputs "
        f"{mib(a.alias_size_in_bytes)}), temporaries {mib(a.temp_size_in_bytes)}, "
        f"code {mib(a.generated_code_size_in_bytes)}")
  except Exception as e:  # not every backend reports it
    log(f"  (no compiled memory analysis: {type(e).__name__})")


# ---- main ---------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> None:
  wall = time.perf_counter()
  start_processes(args)
  devices = pick_devices(args.devices)
  mesh_shape = parse_mesh(args.mesh, len(devices))
  backend = jax.default_backend()
  dtype = args.dtype if args.dtype != "auto" else ("float32" if backend == "cpu" else "bfloat16")
  config = Config(args.layers, args.width, args.heads, args.mlp_ratio, args.positions, dtype,
                  args.seq_len, args.batch_size, args.steps, args.learning_rate,
                  args.warmup_steps, args.weight_decay, args.grad_clip, args.seed, args.layout,
                  args.context_parallel)
  validate(config, mesh_shape)
  mesh = jax.make_mesh(mesh_shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)

  seq = mesh.shape["seq"]
  if seq > 1 and config.layout == "zigzag":
    order = jax_flash.zigzag_indices(config.seq_len, seq)
  else:
    order = np.arange(config.seq_len)
  isa = f" (CPU kernel {jax_flash.cpu_kernel_isa()})" if backend == "cpu" else ""
  log(f"backend: {backend}, {len(devices)} x {devices[0].device_kind}{isa}; "
      f"jax {jax.__version__}")
  if jax.process_count() > 1:
    log(f"processes: {jax.process_count()} (jax.distributed), {jax.local_device_count()} "
        f"devices each")
  log(f"mesh: {dict(mesh.shape)}")
  log("  device ids by (data, tensor, seq):\n  "
      + np.array2string(np.vectorize(lambda d: d.id)(mesh.devices), prefix="  "))
  attention = (f"jax_flash.context_parallel_attention, strategy {config.context_parallel!r}, "
               f"over 'seq' ({seq} devices, {config.layout} layout) in shard_map" if seq > 1 else
               "jax_flash.dot_product_attention (partitioned over batch and heads)")
  log(f"attention: {attention}; activations {dtype}")

  raw = read_bytes(args.data, "*.py", args.max_data_bytes)
  batches = Batches(config, raw, order)
  log(f"data: {len(batches.train):,} train / {len(batches.val):,} validation bytes from "
      f"{args.data or STDLIB_DIR + ' (*.py)'}")

  tx, schedule = make_optimizer(config)
  shardings = state_shardings(config, mesh, tx)
  params = jax.jit(lambda key: init_params(config, key), out_shardings=shardings[0])(
      jax.random.key(config.seed))
  state = (params, jax.jit(tx.init, out_shardings=shardings[1])(params))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  log(f"model: {n_params:,} parameters; {config.layers} layers, width {config.width}, "
      f"{config.heads} heads of {config.head_dim}, MLP {config.hidden}, {config.positions} "
      f"positions; batch {config.batch_size} x {config.seq_len} tokens")
  print_shardings(config, mesh, params)

  model = Model(config, mesh, order)
  train_step, eval_step = build_steps(model, tx, shardings, mesh)
  start = time.perf_counter()
  example = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
  compiled = train_step.lower(state, example, example).compile()
  log(f"train step compiled in {time.perf_counter() - start:.1f}s")
  print_memory(mesh, state, compiled, "before training")
  if args.dump_collectives and jax.process_index() == 0:
    name = f"train_lm_sharded_step_{'x'.join(map(str, mesh_shape))}.hlo.txt"
    dump_collectives(compiled, mesh, os.path.join(tempfile.gettempdir(), name))

  token_sharding = NamedSharding(mesh, TOKENS_SPEC)
  put = lambda a: global_array(a, token_sharding)
  val = [(put(x), put(y)) for x, y in batches.val_batches(args.eval_batches)]
  # One batch at a time (float() waits): see wait_each_step below.
  evaluate = lambda params: float(np.mean([float(eval_step(params, x, y)) for x, y in val]))
  log(f"validation loss before training: {evaluate(state[0]):.3f} "
      f"(uniform over bytes: {math.log(VOCAB_SIZE):.3f})")

  tokens_per_step = config.batch_size * config.seq_len
  # On the simulated CPU devices, XLA (jaxlib 0.10.2, 2 cores) can deadlock in a collective's
  # rendezvous when several executions of an SPMD step are queued at once (asynchronous
  # dispatch): wait for each step there. GPUs keep steps queued between log lines.
  wait_each_step = backend == "cpu"
  losses, rates, pending = [], [], []
  train_seconds, t0 = 0.0, time.perf_counter()
  for step in range(1, config.steps + 1):
    inputs, targets = batches.train_batch(step)
    state, loss = compiled(state, put(inputs), put(targets))
    if wait_each_step:
      loss.block_until_ready()
    pending.append(loss)
    if step % args.log_every and step != config.steps:
      continue
    values = [float(x) for x in jax.device_get(pending)]  # waits for the interval's steps
    elapsed = time.perf_counter() - t0
    losses += values
    rate = len(values) * tokens_per_step / elapsed
    if step > len(values):  # the first interval (warm-up) is left out of the average
      rates.append((len(values) * tokens_per_step, elapsed))
    train_seconds += elapsed
    log(f"step {step:4d} | loss {np.mean(values):.3f} | {rate:8,.0f} tokens/s | "
        f"lr {float(schedule(step)):.2e}", flush=True)
    pending.clear()
    t0 = time.perf_counter()

  if any(d.memory_stats() for d in jax.local_devices()):  # the allocators' peaks (GPUs)
    print_memory(mesh, state, compiled, "after training")
  val_loss = evaluate(state[0])
  tokens_per_s = (sum(t for t, _ in rates) / sum(s for _, s in rates) if rates
                  else len(losses) * tokens_per_step / train_seconds)
  first, last = np.mean(losses[:args.log_every]), np.mean(losses[-args.log_every:])
  log(f"loss {losses[0]:.3f} (first step) -> {last:.3f} (mean of the last {args.log_every}); "
      f"first {args.log_every} steps' mean {first:.3f}")
  log(f"final validation loss {val_loss:.3f} ({val_loss / math.log(2):.2f} bits/byte)")
  log(f"throughput {tokens_per_s:,.0f} tokens/s over mesh {dict(mesh.shape)} "
      f"({tokens_per_s / len(devices):,.0f} per device); trained {train_seconds:.0f}s, "
      f"{time.perf_counter() - wall:.0f}s in all")
  if args.metrics_out and jax.process_index() == 0:
    with open(args.metrics_out, "w") as f:
      json.dump({"losses": losses, "final_val_loss": val_loss, "mesh": dict(mesh.shape),
                 "processes": jax.process_count()}, f)


if __name__ == "__main__":
  main(ARGS)
