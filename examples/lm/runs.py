"""Whole runs: `train` (one run from start or checkpoint to report) and `compare` (the same run
once per attention implementation, each in its own process, with one plot and one table)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

import jax

import jax_flash
from lm.attention import IMPLEMENTATIONS, check_attention_backend
from lm.checkpoints import open_checkpoints
from lm.config import Config, RunOptions
from lm.data import STDLIB_DIR, Dataset
from lm.flags import Invocation
from lm.reporting import (History, comparison_table, curve_differences, default_out,
                          format_bytes, plot_losses, run_metrics, run_title, write_json,
                          write_report)
from lm.sampling import generate
from lm.training import compile_train_step, count_params, init_state, train_loop


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


def parse_implementations(spec: str) -> list[str]:
  """The names of --compare ("jax_flash,xla"), checked: known and distinct."""
  names = [s.strip() for s in spec.split(",") if s.strip()]
  unknown = [n for n in names if n not in IMPLEMENTATIONS]
  if unknown or not names or len(set(names)) != len(names):
    raise SystemExit(f"error: --compare takes distinct names from {','.join(IMPLEMENTATIONS)}; "
                     f"got {spec!r}")
  return names


def compare(invocation: Invocation, names: list[str], script: str
            ) -> dict[str, dict[str, Any] | None]:
  """Trains the same config once per attention implementation, each in its own process (its peak
  memory is its own) running `script` (train_lm.py), with the same seed and data order; writes
  compare.{png,md,json}."""
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
    argv = [sys.executable, os.path.abspath(script), "--config", config_path, "--out", run_dir,
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
