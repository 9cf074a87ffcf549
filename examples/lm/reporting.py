"""What a run reports: its history (losses, throughput), the progress bar, memory figures, the
loss plot, metrics.json and the table and curve differences of a comparison."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import jax_flash
from lm.config import Config


@dataclasses.dataclass
class History:
  """What a run measured, step by step; saved in checkpoints so a resumed run reports it all."""

  train_steps: list[int] = dataclasses.field(default_factory=list)
  train_loss: list[float] = dataclasses.field(default_factory=list)
  val: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, loss)
  throughput: list[dict[str, float]] = dataclasses.field(default_factory=list)  # per interval

  def to_json(self) -> dict[str, Any]:
    """The history as plain lists and dicts (as saved in checkpoints and metrics.json)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, values: dict[str, Any]) -> History:
    """The inverse of to_json."""
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
    """Ends the bar (or the carriage-return line)."""
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
  """One line naming the model and the data shape, for plot titles and tables."""
  return (f"byte-level GPT: {config.layers} layers x {config.width}, {config.heads}/"
          f"{config.num_kv_heads} heads, seq {config.seq_len}, batch {config.batch_size}, "
          f"{config.dtype}, seed {config.seed}")


def default_out(label: str) -> str:
  """runs/<time>-<label>, relative to the working directory."""
  return os.path.join("runs", f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{label}")


def write_json(path: str, values: Any) -> None:
  """Writes `values` as indented JSON with a final newline."""
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


def format_bytes(n: int | None) -> str:
  """MiB below a GiB, GiB from there; "n/a" for None."""
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
