"""Training: the optimizer, the (model, optimizer) state, the jit-compiled train and evaluation
steps, and the loop that runs them with logging, evaluation and checkpoints."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from lm.checkpoints import CheckpointStore
from lm.config import Config, RunOptions
from lm.data import Dataset, train_batch
from lm.model import ByteLM
from lm.reporting import History, Progress

# A compiled train step: (state, inputs, targets) -> (state, loss).
StepFn = Callable[[nnx.State, Any, Any], tuple[nnx.State, jax.Array]]


def make_optimizer(config: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
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


def compile_train_step(graphdef: nnx.GraphDef, state: nnx.State, config: Config
                       ) -> tuple[StepFn, float, dict[str, int]]:
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
  """The loss of the model in (model, optimizer) `state` on one batch."""
  model, _ = nnx.merge(graphdef, state)
  return loss_fn(model, inputs, targets)


def evaluate(graphdef: nnx.GraphDef, state: nnx.State,
             batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
  """Mean loss over the fixed validation batches."""
  return float(np.mean([eval_step(graphdef, state, x, y) for x, y in batches]))


def count_params(state: nnx.State) -> int:
  """Parameters in the model half of the (model, optimizer) state."""
  return sum(x.size for x in jax.tree.leaves(state[0]))


def train_loop(config: Config, options: RunOptions, graphdef: nnx.GraphDef, state: nnx.State,
               step_fn: StepFn, dataset: Dataset, start_step: int, history: History,
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
