"""``train_lm.py --pack``: training on packed documents with segment ids, against padding.

The documents are Python files (by default this repository's own source: jax_flash/, examples/,
tests/), one document per file; a file longer than a row is cut into row-length pieces, each
its own document. Two runs of the same model from the same initialisation, the same steps and
batch shape, over the same shuffled stream of documents:

* padded: one document per row, padded to the row length (plain causal attention; the padding's
  loss masked out);
* packed: documents laid end to end in the rows (first fit), ``q_segment_ids = kv_segment_ids`` = each
  token's document (attention stays within a document), positions restarting at 0 in every
  document, the unused tail of a row masked out of the loss.

Each reports useful tokens/s (tokens with a target that is not padding, per second of training
steps, compile excluded); the gain is their ratio. With jax_flash's CPU kernel the packed
attention also skips the tiles of other documents.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lm.config import Config, RunOptions
from lm.data import text_files
from lm.reporting import write_json
from lm.training import init_state

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO_SOURCE = ("jax_flash", "examples", "tests")


def document_files(config: Config) -> list[str]:
  """The files, one document each: --data's (with --data-glob), or this repository's source."""
  if config.data is not None:
    return list(text_files(config.data, config.data_glob))
  return [p for folder in REPO_SOURCE
          for p in text_files(os.path.join(REPO_ROOT, folder), config.data_glob)]


def documents(config: Config) -> list[np.ndarray]:
  """The documents as uint8 arrays, at most max_data_bytes in all; a file longer than a row
  (seq_len + 1 bytes: inputs and their next-byte targets) cut into pieces of that length, each
  a document; pieces of one byte (no target) dropped. Shuffled by the seed."""
  piece, total, out = config.seq_len + 1, 0, []
  for path in document_files(config):
    with open(path, "rb") as f:
      text = np.frombuffer(f.read(max(0, config.max_data_bytes - total)), np.uint8)
    total += len(text)
    out.extend(text[i:i + piece] for i in range(0, len(text), piece) if len(text[i:i + piece]) > 1)
    if total >= config.max_data_bytes:
      break
  if not out:
    raise ValueError(f"no documents in {config.data or REPO_ROOT}")
  order = np.random.default_rng(config.seed).permutation(len(out))
  return [out[i] for i in order]


@dataclasses.dataclass
class Rows:
  """Training rows, (rows, seq_len) each: inputs, targets, loss weights (0 on padding), segment
  ids and positions."""

  inputs: np.ndarray
  targets: np.ndarray
  weights: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray

  def batch(self, step: int, size: int) -> tuple[np.ndarray, ...]:
    idx = (np.arange(size) + step * size) % len(self.inputs)
    return tuple(x[idx] for x in (self.inputs, self.targets, self.weights, self.segment_ids,
                                  self.positions))


def _rows(layout: list[list[np.ndarray]], seq_len: int) -> Rows:
  n = len(layout)
  arrays = [np.zeros((n, seq_len), np.int32) for _ in range(5)]
  inputs, targets, weights, ids, positions = arrays
  ids[:] = -1  # padding: an id no document has
  for r, docs in enumerate(layout):
    at = 0
    for d, doc in enumerate(docs):
      m = len(doc) - 1
      inputs[r, at:at + m], targets[r, at:at + m] = doc[:-1], doc[1:]
      weights[r, at:at + m], ids[r, at:at + m] = 1, d
      positions[r, at:at + m] = np.arange(m)
      at += m
  return Rows(inputs, targets, weights.astype(np.float32), ids, positions)


def padded_rows(docs: list[np.ndarray], seq_len: int) -> Rows:
  """One document per row, padded to seq_len."""
  return _rows([[d] for d in docs], seq_len)


def packed_rows(docs: list[np.ndarray], seq_len: int) -> Rows:
  """The documents end to end (first fit: each goes into the first row, in order, with room
  for it; a new row where none has)."""
  layout, free = [], []
  for doc in docs:
    size = len(doc) - 1
    for r, room in enumerate(free):
      if room >= size:
        layout[r].append(doc)
        free[r] -= size
        break
    else:
      layout.append([doc])
      free.append(seq_len - size)
  return _rows(layout, seq_len)


def _loss(model, inputs, targets, weights, ids, positions, packed: bool):
  """Mean next-byte cross-entropy over the weighted (non-padding) tokens."""
  if packed:
    logits = model(inputs, segment_ids=ids, positions=positions)
  else:
    logits = model(inputs)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _train_step(graphdef, packed: bool, state, *batch):
  model, optimizer = nnx.merge(graphdef, state)
  loss, grads = nnx.value_and_grad(_loss)(model, *batch, packed)
  optimizer.update(model, grads)
  return nnx.state((model, optimizer)), loss


def _run(config: Config, rows: Rows, packed: bool) -> dict[str, Any]:
  graphdef, state = init_state(config)
  batches = [rows.batch(s, config.batch_size) for s in range(config.steps + 1)]
  start = time.perf_counter()
  state, loss = _train_step(graphdef, packed, state, *batches[0])  # compiles; not timed
  jax.block_until_ready(loss)
  compile_seconds = time.perf_counter() - start
  losses, start = [], time.perf_counter()
  for batch in batches[1:]:
    state, loss = _train_step(graphdef, packed, state, *batch)
    losses.append(loss)
  losses = [float(x) for x in jax.device_get(losses)]
  seconds = time.perf_counter() - start
  useful = float(sum(b[2].sum() for b in batches[1:]))
  slots = config.steps * config.batch_size * config.seq_len
  return dict(mode="packed" if packed else "padded", steps=config.steps, seconds=seconds,
              compile_seconds=compile_seconds, useful_tokens=int(useful),
              fill=useful / slots, useful_tokens_per_s=useful / seconds,
              first_loss=losses[0], final_loss=losses[-1])


def compare(config: Config, options: RunOptions) -> dict[str, Any]:
  """Trains padded, then packed (same init, steps, batch shape and document order); prints
  useful tokens/s of both and the gain; writes packing.json to --out (when given)."""
  docs = documents(config)
  print(f"data: {len(docs)} documents ({sum(len(d) for d in docs):,} bytes; files cut to "
        f"{config.seq_len + 1} bytes) from {config.data or REPO_ROOT + ' ' + str(REPO_SOURCE)}")
  print(f"model: {config.layers} layers, width {config.width}, {config.heads} heads, "
        f"{config.positions} positions, {config.dtype}; attention: {config.attention}; "
        f"{config.steps} steps of {config.batch_size} x {config.seq_len}; "
        f"device: {jax.devices()[0].device_kind}")
  results = {}
  for packed in (False, True):
    rows = packed_rows(docs, config.seq_len) if packed else padded_rows(docs, config.seq_len)
    r = _run(config, rows, packed)
    results[r["mode"]] = r
    print(f"{r['mode']:>6}: {len(rows.inputs)} rows, {r['fill']:.0%} of the positions useful; "
          f"{r['useful_tokens_per_s']:,.0f} useful tokens/s ({r['useful_tokens']:,} in "
          f"{r['seconds']:.2f}s; compile {r['compile_seconds']:.1f}s); loss "
          f"{r['first_loss']:.3f} -> {r['final_loss']:.3f}", flush=True)
  gain = results["packed"]["useful_tokens_per_s"] / results["padded"]["useful_tokens_per_s"]
  print(f"packing gain: {gain:.2f}x useful tokens/s over padding each document to the row")
  report = dict(config=dataclasses.asdict(config), device=jax.devices()[0].device_kind,
                documents=len(docs), gain=gain, **results)
  if options.out:
    os.makedirs(options.out, exist_ok=True)
    write_json(os.path.join(options.out, "packing.json"), report)
    print(f"wrote {options.out}/packing.json")
  return report
