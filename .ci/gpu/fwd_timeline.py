"""Records and summarises the Hopper forward's per-block timeline (a debug build's instrument).

    cmake -S . -B build/tl -G Ninja -DJAX_FLASH_CUDA=ON -DJAX_FLASH_CUDA_TIMELINE=TILES ...  # or BLOCKS, CHAIN
    python3 .ci/gpu/fwd_timeline.py [--seq 4096] [--head-dim 64] [--causal] [--for-backward]
                                    [--out DIR]

with that build's jax_flash._native_cuda on the path (cuda/sm90/fwd_timeline.h: the first thread
of each consumer warpgroup of the grid's first CTAs stamps the SM's clock at each phase of each
key block). One jitted forward at the benchmark's shape (16k tokens, hidden 2048, bf16) is
compiled and run, the record zeroed, the forward run once more and its record read. Printed, per
recorder and over all: the key-block loop's phases in cycles (median and mean) and the share of
the CTA's time in the loop, the tiles' prologues and epilogues. `--for-backward` records the
forward of a differentiated call (its statistics saved; the tensor-core row sums) instead of the
inference forward (the TMA store). `--out` keeps the raw entries (.npy) and the summary (.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

# The events of the key-block loop (an iteration's, arg > 0), in their order (the names are the
# native module's: cuda/sm90/fwd_timeline.h kFwdEventNames).
LOOP_EVENTS = ("key_full", "turn", "issued", "scores", "masked", "maxed", "softmax", "output", "converted")


def decode(words: np.ndarray, events: list[str]) -> tuple[int, list[tuple[int, str, int]]]:
  """A recorder's absolute start clock and its entries as (cycles since it, event name, arg), up
  to the first empty one (entry 0 is the start clock itself)."""
  out = []
  for w in words[1:]:
    w = int(w)
    event = w & 0xFF
    if event == 0:
      break
    out.append((w >> 32, events[event], (w >> 8) & 0xFFFFFF))
  return int(words[0]), out


def summarise(entries: list[tuple[int, str, int]]) -> dict:
  """The recorder's time between consecutive events, keyed "from->to" (the loop's pairs prefixed
  "loop "), the loop's periods (conversion to conversion), the tiles' key blocks and the time from
  the first tile to the last store."""
  pairs: dict[str, list[int]] = {}
  periods: list[int] = []
  blocks_per_tile = []
  previous = None
  last_converted = None
  first_tile = end = None
  for cycles, name, arg in entries:
    if name == "tile":
      first_tile = cycles if first_tile is None else first_tile
      blocks_per_tile.append(arg)
      last_converted = None
    if name == "store_end":
      end = cycles
    if name == "converted" and arg > 0 and last_converted is not None:
      periods.append(cycles - last_converted)
    if name == "converted":
      last_converted = cycles
    if previous is not None:
      in_loop = name in LOOP_EVENTS and arg > 0
      key = ("loop " if in_loop else "") + f"{previous[1]}->{name}"
      pairs.setdefault(key, []).append(cycles - previous[0])
    previous = (cycles, name)
  total = (end - first_tile) if end is not None and first_tile is not None else 0
  return {"pairs": pairs, "periods": periods, "blocks_per_tile": blocks_per_tile, "total": total}


def intervals(entries, start_clock: int, begin: str, stop: str) -> list[tuple[int, int]]:
  """Absolute (begin, stop) clock intervals of the loop's iterations between two of its events."""
  out, opened = [], None
  for cycles, name, arg in entries:
    if name == begin and arg > 0:
      opened = start_clock + cycles
    elif name == stop and arg > 0 and opened is not None:
      out.append((opened, start_clock + cycles))
      opened = None
  return out


def overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
  """Cycles during which an interval of a and one of b both run (each list sorted, disjoint)."""
  total, j = 0, 0
  for x0, x1 in a:
    while j < len(b) and b[j][1] <= x0:
      j += 1
    k = j
    while k < len(b) and b[k][0] < x1:
      total += max(0, min(x1, b[k][1]) - max(x0, b[k][0]))
      k += 1
  return total


def stats(values: list[int]) -> dict:
  a = np.asarray(values, dtype=np.float64)
  if a.size == 0:
    return {"n": 0}
  return {"n": int(a.size), "median": float(np.median(a)), "mean": float(a.mean()), "p10": float(np.percentile(a, 10)),
          "p90": float(np.percentile(a, 90)), "sum": float(a.sum())}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--for-backward", action="store_true")
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args()
  # (Imported here, so that tests can load this file's reader on any machine.)
  import jax
  import jax.numpy as jnp

  import jax_flash
  from jax_flash import _native_cuda

  if not hasattr(_native_cuda, "fwd_timeline"):
    raise SystemExit("this jax_flash._native_cuda was built without JAX_FLASH_CUDA_TIMELINE=TILES, BLOCKS or CHAIN")
  batch, heads = max(1, 16384 // args.seq), max(1, 2048 // args.head_dim)
  shape = (batch, args.seq, heads, args.head_dim)
  q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 3))

  def attention(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, is_causal=args.causal, implementation="cuda")

  if args.for_backward:
    # The forward of a differentiated call alone: its primal output (the residuals are formed).
    step = jax.jit(lambda q, k, v: jax.vjp(attention, q, k, v)[0])
  else:
    step = jax.jit(attention)
  reps = 20

  def seconds_a_call(fn) -> float:
    for _ in range(3):
      jax.block_until_ready(fn(q, k, v))
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(q, k, v)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps

  seconds = seconds_a_call(step)
  # cuDNN's forward of the same call in the same process, for scale (the stamps cost our kernel
  # nothing measurable at head dim 64 with TILES, far more at 128: cuda/PERF_NOTES.md v38).
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=args.causal, implementation="cudnn"))
  cudnn_seconds = seconds_a_call(cudnn)
  error = float(jnp.max(jnp.abs(step(q, k, v).astype(jnp.float32) - cudnn(q, k, v).astype(jnp.float32))))
  _native_cuda.fwd_timeline_reset()
  jax.block_until_ready(step(q, k, v))
  record = _native_cuda.fwd_timeline()
  words = np.frombuffer(record["words"], dtype=np.uint64).reshape(record["shape"])

  label = f"hd{args.head_dim} seq{args.seq} {'causal' if args.causal else 'non-causal'}" + (
      " for-backward" if args.for_backward else " inference")
  print(f"# {label}: shape {shape}, {seconds * 1e6:.1f} us a call (mean of {reps}); cuDNN's inference forward "
        f"{cudnn_seconds * 1e6:.1f} us; max |ours - cuDNN's| {error:.3g}")
  summaries = {}
  merged: dict[str, list[int]] = {}
  merged_periods: list[int] = []
  totals = 0
  for cta in range(words.shape[0]):
    recorders = {}
    for group in range(words.shape[1]):
      start_clock, entries = decode(words[cta, group], record["events"])
      if entries:
        recorders[group] = (start_clock, entries)
    for group, (start_clock, entries) in recorders.items():
      s = summarise(entries)
      key = f"cta{cta}_wg{group}"
      blocks = int(sum(s["blocks_per_tile"]))
      total = max(s["total"], 1)
      totals += total
      merged_periods.extend(s["periods"])
      for pair, vals in s["pairs"].items():
        merged.setdefault(pair, []).extend(vals)
      # How much of this warpgroup's softmax (S in -> exponentials done) runs beside another's.
      mine = intervals(entries, start_clock, "scores", "softmax")
      shared = sum(overlap(mine, intervals(e, c, "scores", "softmax")) for g, (c, e) in recorders.items() if g != group)
      busy = sum(b - a for a, b in mine)
      summaries[key] = {"total_cycles": s["total"], "tiles": len(s["blocks_per_tile"]), "blocks": blocks,
                        "softmax_beside_another": shared / max(busy, 1),
                        "pairs": {pair: stats(vals) for pair, vals in s["pairs"].items()},
                        "periods": stats(s["periods"])}
      beside = f"; its softmaxes run beside another warpgroup's {shared / busy:.0%} of their time" if busy else ""
      print(f"{key}: {len(s['blocks_per_tile'])} tiles, {blocks} blocks, {s['total']} cycles "
            f"({s['total'] / max(blocks, 1):.0f} a block); median period {np.median(s['periods']):.0f}{beside}")
  def row(name: str, st: dict, share: str) -> str:
    return f"| {name} | {st['n']} | {st['median']:.0f} | {st['mean']:.0f} | {st['p10']:.0f} | {st['p90']:.0f} | {share} |"

  print("\n| from -> to (cycles, all recorders) | n | median | mean | p10 | p90 | share of the time |")
  print("|---|---|---|---|---|---|---|")
  for pair, vals in sorted(merged.items(), key=lambda kv: -sum(kv[1])):
    st = stats(vals)
    print(row(pair, st, f"{st['sum'] / max(totals, 1):.1%}"))
  st = stats(merged_periods)
  if st["n"]:
    print(row("loop period", st, ""))
  if args.out:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = label.replace(" ", "_")
    np.save(args.out / f"{stem}.npy", words)
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"label": label, "shape": shape, "seconds": seconds, "cudnn_seconds": cudnn_seconds, "recorders": summaries,
         "merged": {pair: stats(vals) for pair, vals in merged.items()}, "periods": stats(merged_periods)}, indent=1))


if __name__ == "__main__":
  main()
