"""Ring attention on P devices against FlashAttention on one: scaling efficiency and longest sequence.

    python examples/bench_ring.py --out /tmp/ring                 # a GPU host: all its GPUs, bf16
    python examples/bench_ring.py --devices 2 --dtype float32 --heads 2 --head-dim 32 \\
        --seqs 256,512 --start-seq 512 --max-seq 2048 --out /tmp/br  # a CPU smoke run

Two measurements, in one run, of causal self-attention, forward plus backward (a jitted
``value_and_grad`` of ``sum(out * g)`` with respect to q, k and v), batch 1:

1. Scaling. For each per-device sequence L in ``--seqs``: ``jax_flash.dot_product_attention`` on
   one device at sequence L, and ``jax_flash.ring_attention`` (zig-zag layout, inside
   ``jax.shard_map`` over a 1-D mesh ``("seq",)`` of P devices) at total sequence P*L, the inputs
   permuted into zig-zag order (``jax_flash.zigzag_indices``) and sharded along the sequence.
   FLOPs follow the FlashAttention convention: forward 4*B*S^2*N*H, halved when causal; forward
   plus backward 3.5 times that. Efficiency = ring TFLOP/s / (P * one-device TFLOP/s): 1.0 means
   P devices do P times the work of one in the same time. Timing: compile, two warm-up calls, then
   ``--steps`` (10) timed steps of ``--calls`` (5) calls launched back to back and waited for once
   (``block_until_ready``); the median step time divided by the calls is the time per call.
2. Longest sequence. From ``--start-seq``, the sequence doubles until forward plus backward fails
   (out of memory, whatever the error: its first line is recorded) or passes ``--max-seq``; once
   on one device, once with the ring over P devices. The last sequence that ran is reported with
   its time (compile, ``--long-warm-up`` (1) untimed calls, then the median of ``--long-reps`` (1)
   timed calls; ``--longest single|ring|none`` runs only one search or none). A try
   is refused before it runs when XLA's compiled temp plus output bytes exceed a device's free
   memory (a clear failure instead of the allocator's slow retries). Since the cost grows as the
   square of the sequence, doubling also stops when the next try would take longer than
   ``--long-limit-s`` per call (4 times the last; 0: no such limit). Inputs of these tries are
   drawn on the devices, already sharded: i.i.d. normal noise, which any permutation (zig-zag
   order included) leaves i.i.d. normal noise. Arrays are freed between tries (``del`` and
   ``jax.clear_caches()``).

Prints a markdown table; with ``--out DIR`` writes results.json (environment, settings, every
measurement) and table.md there, rewritten after each measurement so an interrupted run keeps
what it measured.

Devices: ``--devices P`` uses the first P (default: all visible). On a CPU-only machine
``--devices P`` also sets ``--xla_force_host_platform_device_count=P`` in XLA_FLAGS before JAX is
imported, simulating P CPU devices; that flag does not affect GPUs. GPU memory: JAX preallocates
a fraction of each GPU (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default), which bounds the
longest sequence; ``--mem-fraction F`` sets that variable before JAX starts.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import pathlib
import statistics
import sys
import time

# Imports no backend: --devices still sets XLA_FLAGS before JAX starts (below).
from jax_flash.benchmark import FWD_BWD_FLOP_FACTOR, failure_reason, positive_ints

# The lm library lives beside this script: importable from any working directory, uninstalled.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lm.host_devices import force_host_device_count  # noqa: E402  (imports no JAX)

GIB = 2**30


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description="Ring attention scaling efficiency and longest causal sequence, P devices vs 1.")
  p.add_argument("--devices", type=int, default=None,
                 help="P: use the first P devices (default: all visible); on a CPU-only machine "
                      "also simulates P CPU devices")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                 help="input dtype (default bfloat16; float32 for CPU smoke runs)")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--seqs", type=positive_ints, default=[4096, 8192, 16384],
                 help="per-device sequence lengths of the scaling test (default 4096,8192,16384)")
  p.add_argument("--start-seq", type=int, default=16384,
                 help="first sequence of the longest-sequence search (default 16384)")
  p.add_argument("--max-seq", type=int, default=None,
                 help="do not try sequences longer than this in the longest-sequence search "
                      "(default: no cap)")
  p.add_argument("--long-limit-s", type=float, default=60.0,
                 help="stop doubling when the next try would take longer than this per call "
                      "(4x the last call; default 60; 0 for no limit)")
  p.add_argument("--long-reps", type=int, default=1,
                 help="timed calls per try of the longest-sequence search (default 1)")
  p.add_argument("--steps", type=int, default=10, help="timed steps per case (default 10)")
  p.add_argument("--calls", type=int, default=5,
                 help="back-to-back calls per timed step (default 5)")
  p.add_argument("--warm-up", type=int, default=2, help="untimed calls before timing (default 2)")
  p.add_argument("--implementation", default=None,
                 help="jax_flash kernel (default: jax_flash's choice for the device)")
  p.add_argument("--mem-fraction", type=float, default=None,
                 help="set XLA_PYTHON_CLIENT_MEM_FRACTION before JAX starts (GPU only)")
  p.add_argument("--skip-scaling", action="store_true", help="skip the scaling test")
  p.add_argument("--longest", choices=("both", "single", "ring", "none"), default="both",
                 help="which longest-sequence searches to run (default both; the searches are "
                      "the slow part: split them over invocations under a per-command time limit)")
  p.add_argument("--long-warm-up", type=int, default=1,
                 help="untimed calls before the timed ones in the longest-sequence search "
                      "(default 1; 0 halves its time, the timed call then includes first-run costs)")
  p.add_argument("--out", type=pathlib.Path, default=None, metavar="DIR",
                 help="write results.json and table.md here")
  return p


if __name__ == "__main__":
  ARGS = build_parser().parse_args()
  if ARGS.devices is not None:
    force_host_device_count(ARGS.devices)
  if ARGS.mem_fraction is not None:
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(ARGS.mem_fraction)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_flash  # noqa: E402

SPEC = P(None, "seq", None, None)


def _log(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def flops(batch: int, seq: int, heads: int, head_dim: int) -> float:
  """Causal forward plus backward FLOPs by the FlashAttention convention."""
  return 4.0 * batch * seq**2 * heads * head_dim / 2 * FWD_BWD_FLOP_FACTOR


# ---------------------------------------------------------------------------------------------
# The two fwd+bwd functions


def _loss(attention):
  def loss(q, k, v, g):
    return jnp.sum((attention(q, k, v) * g).astype(jnp.float32))
  return loss


def single_step(implementation):
  """jit(value_and_grad) of sum(out * g) over q, k, v: FlashAttention on one device."""
  attention = lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation)
  return jax.jit(jax.value_and_grad(_loss(attention), argnums=(0, 1, 2)))


def ring_step(mesh, implementation):
  """The same with ring attention (zig-zag) over the mesh's "seq" axis; inputs sharded by SPEC,
  in zig-zag order."""
  attention = jax.shard_map(
      lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="seq", layout="zigzag",
                                               is_causal=True, implementation=implementation),
      mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC)
  return jax.jit(jax.value_and_grad(_loss(attention), argnums=(0, 1, 2)))


# ---------------------------------------------------------------------------------------------
# Inputs


def host_inputs(shape, dtype, seed, order=None):
  """q, k, v, g as normal noise on the host, permuted along the sequence by `order`."""
  rng = np.random.default_rng(seed)
  arrays = [rng.standard_normal(shape, np.float32) for _ in range(4)]
  if order is not None:
    arrays = [a[:, order] for a in arrays]
  return [a.astype(jnp.dtype(dtype)) for a in arrays]


def device_inputs(shape, dtype, sharding, seed):
  """q, k, v, g as normal noise drawn where `sharding` places them (never whole on the host)."""
  draw = jax.jit(lambda key: jax.random.normal(key, shape, jnp.dtype(dtype)),
                 out_shardings=sharding)
  keys = jax.random.split(jax.random.key(seed), 4)
  return [draw(key) for key in keys]


# ---------------------------------------------------------------------------------------------
# Running and timing


def _block(result) -> None:
  jax.block_until_ready(result)


def compile_step(step, args, devices):
  """AOT-compiles `step` for `args`; raises MemoryError when XLA's temp plus output bytes exceed
  a device's free memory (where the runtime reports it). Returns (compiled, seconds, temp)."""
  start = time.perf_counter()
  compiled = step.lower(*args).compile()
  seconds = time.perf_counter() - start
  temp = None
  try:
    analysis = compiled.memory_analysis()
    if analysis is not None:
      temp = int(analysis.temp_size_in_bytes)
      needed = temp + int(analysis.output_size_in_bytes)
  except Exception:  # memory analysis is optional; the run itself decides
    analysis = None
  if analysis is not None:
    for device in devices:
      stats = device.memory_stats()
      if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if needed > free:
          raise MemoryError(f"needs {needed / GIB:.2f} GiB (temp + outputs) per device, "
                            f"{free / GIB:.2f} GiB free on {device}")
  return compiled, seconds, temp


def time_calls(compiled, args, warm_up: int, steps: int, calls: int) -> list[float]:
  """Seconds per call of each timed step: `warm_up` untimed calls, then `steps` steps of
  `calls` back-to-back calls waited for once."""
  for _ in range(warm_up):
    _block(compiled(*args))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    results = [compiled(*args) for _ in range(calls)]
    _block(results[-1])
    times.append((time.perf_counter() - start) / calls)
    del results
  return times


def peak_bytes(devices) -> int | None:
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) if peaks else None


def _free() -> None:
  jax.clear_caches()
  gc.collect()


# ---------------------------------------------------------------------------------------------
# The two measurements


def measure(name, step, args, devices, seq, args_cfg, warm_up, steps, calls):
  """One fwd+bwd measurement as a JSON record."""
  record = dict(kind=name, seq=seq, devices=len(devices),
                flop=flops(args_cfg.batch, seq, args_cfg.heads, args_cfg.head_dim))
  try:
    compiled, compile_s, temp = compile_step(step, args, devices)
    record.update(compile_s=compile_s, temp_bytes=temp)
    times = time_calls(compiled, args, warm_up, steps, calls)
  except Exception as e:  # a failure is a result to report
    record.update(status="fails", reason=failure_reason(e))
    return record
  median = statistics.median(times)
  record.update(status="ok", times_ms=[t * 1e3 for t in times], median_ms=median * 1e3,
                tflops=record["flop"] / median / 1e12, peak_bytes=peak_bytes(devices))
  return record


def scaling(cfg, mesh, devices, report):
  num = len(devices)
  impl = cfg.implementation
  single_sharding = jax.sharding.SingleDeviceSharding(devices[0])
  ring_sharding = NamedSharding(mesh, SPEC)
  rows = []
  for seq in cfg.seqs:
    shape = (cfg.batch, seq, cfg.heads, cfg.head_dim)
    args = [jax.device_put(a, single_sharding) for a in host_inputs(shape, cfg.dtype, seq)]
    one = measure("single", single_step(impl), args, devices[:1], seq, cfg, cfg.warm_up,
                  cfg.steps, cfg.calls)
    del args
    _free()
    _log(_line(one))
    total = num * seq
    row = dict(seq_per_device=seq, total_seq=total, single=one)
    rows.append(row)
    try:
      order = jax_flash.zigzag_indices(total, num)
      shape = (cfg.batch, total, cfg.heads, cfg.head_dim)
      args = [jax.device_put(a, ring_sharding)
              for a in host_inputs(shape, cfg.dtype, total + 1, order)]
      ring = measure("ring", ring_step(mesh, impl), args, devices, total, cfg, cfg.warm_up,
                     cfg.steps, cfg.calls)
      del args
    except Exception as e:  # e.g. a sequence that zig-zag cannot split
      ring = dict(kind="ring", seq=total, devices=num, status="fails", reason=failure_reason(e))
    _free()
    _log(_line(ring))
    row["ring"] = ring
    if one.get("status") == "ok" and ring.get("status") == "ok":
      row["efficiency"] = ring["tflops"] / (num * one["tflops"])
    report()
  return rows


def longest(cfg, name, mesh, devices, report, tries):
  """Doubles the sequence until fwd+bwd fails; appends each try to `tries`."""
  impl = cfg.implementation
  if name == "single":
    sharding, step = jax.sharding.SingleDeviceSharding(devices[0]), single_step(impl)
  else:
    sharding, step = NamedSharding(mesh, SPEC), ring_step(mesh, impl)
  seq = cfg.start_seq
  while True:
    if cfg.max_seq is not None and seq > cfg.max_seq:
      tries.append(dict(kind=name, seq=seq, devices=len(devices), status="not tried",
                        reason=f"over --max-seq {cfg.max_seq}"))
      break
    last_ok = next((t for t in reversed(tries) if t["status"] == "ok"), None)
    if cfg.long_limit_s and last_ok is not None:
      guess = 4 * last_ok["median_ms"] / 1e3
      if guess > cfg.long_limit_s:
        tries.append(dict(kind=name, seq=seq, devices=len(devices), status="not tried",
                          reason=f"would take about {guess:.3g} s per call, over "
                                 f"--long-limit-s {cfg.long_limit_s:g}"))
        break
    shape = (cfg.batch, seq, cfg.heads, cfg.head_dim)
    try:
      args = device_inputs(shape, cfg.dtype, sharding, seq)
      record = measure(name, step, args, devices, seq, cfg, cfg.long_warm_up, cfg.long_reps, 1)
    except Exception as e:  # the inputs alone may not fit
      record = dict(kind=name, seq=seq, devices=len(devices), status="fails", reason=failure_reason(e))
    args = None
    _free()
    _log(_line(record))
    tries.append(record)
    report()
    if record["status"] != "ok":
      break
    seq *= 2
  return tries


# ---------------------------------------------------------------------------------------------
# Reporting


def _line(record) -> str:
  where = f"{record['kind']} seq {record['seq']} on {record['devices']} device(s):"
  if record["status"] == "ok":
    return (f"{where} {record['median_ms']:.3f} ms {record['tflops']:.4g} TFLOP/s "
            f"(compile {record['compile_s']:.2f} s)")
  return f"{where} {record['status']}: {record['reason']}"


def _ms(record) -> str:
  return f"{record['median_ms']:.3f}" if record and record.get("status") == "ok" else (
      record.get("status", "-") if record else "-")


def _rate(record) -> str:
  return f"{record['tflops']:.4g}" if record and record.get("status") == "ok" else "-"


def format_tables(results) -> str:
  num = results["settings"]["devices"]
  s = results["settings"]
  lines = [f"Causal fwd+bwd, {s['dtype']}, batch {s['batch']}, {s['heads']} heads, "
           f"head dim {s['head_dim']}, ring = zig-zag over {num} x {results['environment']['device_kind']}", ""]
  if results["scaling"]:
    lines += ["### Scaling: ring over P devices at P*L vs one device at L", "",
              f"| L per device | total seq | 1 dev ms | 1 dev TFLOP/s | ring P={num} ms "
              f"| ring TFLOP/s | efficiency |",
              "|---|---|---|---|---|---|---|"]
    for row in results["scaling"]:
      eff = row.get("efficiency")
      lines.append(f"| {row['seq_per_device']} | {row['total_seq']} | {_ms(row['single'])} | "
                   f"{_rate(row['single'])} | {_ms(row.get('ring'))} | {_rate(row.get('ring'))} "
                   f"| {'-' if eff is None else f'{eff:.3f}'} |")
    lines.append("")
  if results["longest"]:
    lines += ["### Longest causal sequence (fwd+bwd)", "",
              "| setup | devices | longest seq | ms | TFLOP/s | next tried | stopped because |",
              "|---|---|---|---|---|---|---|"]
    for name, tries in results["longest"].items():
      if not tries:
        continue
      ok = [t for t in tries if t["status"] == "ok"]
      best = ok[-1] if ok else None
      stop = tries[-1] if tries[-1]["status"] != "ok" else None
      label = "1 device, dot_product_attention" if name == "single" else "ring (zig-zag)"
      lines.append(f"| {label} | {tries[0]['devices']} | {best['seq'] if best else 'none'} | "
                   f"{_ms(best)} | {_rate(best)} | {stop['seq'] if stop else '-'} | "
                   f"{stop['status'] + ': ' + stop['reason'] if stop else '-'} |")
    lines.append("")
  notes = dict.fromkeys(f"- {r['kind']} seq {r['seq']}: {r['reason']}"
                        for row in results["scaling"] for r in (row["single"], row.get("ring"))
                        if r and r.get("status") != "ok")
  return "\n".join(lines + list(notes)).rstrip() + "\n"


def _write_whole(path: pathlib.Path, text: str) -> None:
  partial = path.with_name(path.name + ".partial")
  partial.write_text(text)
  partial.replace(path)


def environment(devices) -> dict:
  try:
    from jax_flash.benchmark import _accelerator_packages
    packages = _accelerator_packages()
  except Exception:  # only a record of versions
    packages = {}
  stats = devices[0].memory_stats() or {}
  return dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      python=sys.version.split()[0], jax=jax.__version__,
      jaxlib=importlib.metadata.version("jaxlib"), jax_flash=jax_flash.__version__,
      jax_backend=jax.default_backend(), device_kind=devices[0].device_kind,
      devices_used=len(devices), devices_visible=len(jax.devices()),
      device_bytes_limit=stats.get("bytes_limit"), accelerator_packages=packages,
      xla_flags=os.environ.get("XLA_FLAGS"),
      xla_mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
      xla_preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
      cpu_count=os.cpu_count())


def main(cfg) -> int:
  visible = jax.devices()
  num = cfg.devices or len(visible)
  if num > len(visible):
    print(f"--devices {num}: only {len(visible)} visible ({visible[0].platform})", file=sys.stderr)
    return 2
  devices = visible[:num]
  mesh = Mesh(np.array(devices), ("seq",))
  settings = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(cfg).items()}
  settings.update(devices=num, causal=True, layout="zigzag",
                  flop_convention="fwd 4*B*S^2*N*H / 2 (causal); fwd+bwd 3.5x")
  results = dict(environment=environment(devices), settings=settings, scaling=[], longest={})

  def report():
    if cfg.out is not None:
      cfg.out.mkdir(parents=True, exist_ok=True)
      _write_whole(cfg.out / "results.json", json.dumps(results, indent=2) + "\n")
      _write_whole(cfg.out / "table.md", format_tables(results))

  _log(f"{num} x {devices[0].device_kind}, {cfg.dtype}, heads {cfg.heads}, "
       f"head dim {cfg.head_dim}, batch {cfg.batch}")
  if not cfg.skip_scaling:
    results["scaling"] = scaling(cfg, mesh, devices, report)
  for name, used in (("single", devices[:1]), ("ring", devices)):
    if cfg.longest in ("both", name):
      results["longest"][name] = []
      longest(cfg, name, mesh if name == "ring" else None, used, report,
              results["longest"][name])
  report()
  print(format_tables(results))
  return 0


if __name__ == "__main__":
  sys.exit(main(ARGS))
