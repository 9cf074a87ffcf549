"""The command line: `python -m jax_flash.benchmark [options]`."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

import jax

from jax_flash.benchmark.columns import HEAD_DIM_COLUMN
from jax_flash.benchmark.provenance import environment
from jax_flash.benchmark.measure import TIME_BUDGET_S, Measurement, failure_reason
from jax_flash.benchmark.platforms import (PLATFORMS, Platform, no_devices,
                                           with_deterministic_flash)
from jax_flash.benchmark.plot import write_plot
from jax_flash.benchmark.report import format_table, with_backward, write_results
from jax_flash.benchmark.runner import log, run


def positive_ints(text: str) -> list[int]:
  """An argument of positive integers separated by commas."""
  try:
    values = [int(part) for part in text.split(",") if part]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers (a,b,...), got {text!r}")
  return values


def _per_platform(attribute: str) -> str:
  """Each platform's value of a setting, for help texts: "cpu: 512,1024; gpu: 1024,4096"."""
  values = {p.name: getattr(p, attribute) for p in PLATFORMS.values()}
  return "; ".join(f"{name}: {','.join(map(str, v)) if isinstance(v, tuple) else v}"
                   for name, v in values.items())


def skippable(platform: Platform) -> list[str]:
  """The peers --skip may name: all but jax_flash (the first)."""
  return [peer.name for peer in platform.peers[1:]]


def _peer_names() -> str:
  """The skippable peers of each platform, for the help text."""
  return "; ".join(f"{name}: {','.join(skippable(platform))}"
                   for name, platform in PLATFORMS.items())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """The benchmark's arguments from `argv` (sys.argv[1:] when None); exits on a bad one."""
  parser = argparse.ArgumentParser(
      prog="python -m jax_flash.benchmark",
      description="Time jax_flash beside other attention implementations, in one run.")
  parser.add_argument(
      "--platform", choices=tuple(PLATFORMS),
      default="gpu" if jax.default_backend() == "gpu" else "cpu",
      help="what to measure on (default: gpu when JAX's default backend is a GPU, else cpu)")
  seqs = parser.add_mutually_exclusive_group()
  seqs.add_argument("--seqs", type=positive_ints, nargs="+", metavar="SEQ",
                    help=f"sequence lengths (default: {_per_platform('default_seqs')})")
  seqs.add_argument("--quick", action="store_true",
                    help="a short smoke test: the platform's quick sequence lengths "
                         f"({_per_platform('quick_seqs')}) and head dims "
                         f"({_per_platform('quick_head_dims')})")
  parser.add_argument("--head-dims", type=positive_ints, nargs="+", metavar="HDIM",
                      help=f"head dims (default: {_per_platform('default_head_dims')}); only "
                           "platforms whose table shows the head dim take this option")
  parser.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                      help="causal cases, non-causal cases or both (default: both)")
  parser.add_argument("--reps", type=int, default=20,
                      help=f"timed repetitions after the warm-up ({_per_platform('warm_up_runs')} "
                           "runs); fewer for slow peers, so each spends about "
                           f"{TIME_BUDGET_S:g} s per pass of a case (default: 20)")
  parser.add_argument("--deterministic", action="store_true",
                      help="time jax_flash's deterministic backward (deterministic=True)")
  parser.add_argument("--skip", nargs="+", default=[], metavar="PEER",
                      help="peers not to run, for a shorter run (their cells read "
                           f"'unavailable'); jax_flash cannot be skipped ({_peer_names()})")
  parser.add_argument("--out", type=pathlib.Path, metavar="DIR",
                      help="write results.json (measurements and environment), table.md and "
                           "plot.png here")
  args = parser.parse_args(argv)
  if args.reps < 1:
    parser.error("--reps must be at least 1")
  # Flatten "--seqs 512,1024 2048" into one list.
  args.seqs = [n for group in args.seqs for n in group] if args.seqs else None
  args.head_dims = [n for group in args.head_dims for n in group] if args.head_dims else None
  platform = PLATFORMS[args.platform]
  allowed = skippable(platform)
  for name in args.skip:
    if name not in allowed:
      parser.error(f"--skip: {name!r} is not a skippable {platform.name} peer "
                   f"(those are {', '.join(allowed)})")
  if args.head_dims and HEAD_DIM_COLUMN not in platform.columns:
    parser.error(f"--head-dims: the {platform.name} table has no head dim column (its cases "
                 f"have head dim {','.join(map(str, platform.default_head_dims))})")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the benchmark; returns the process exit status."""
  args = parse_args(argv)
  platform = PLATFORMS[args.platform]
  if args.deterministic:
    platform = with_deterministic_flash(platform)
  missing = no_devices(platform.device_kind)
  if missing is not None:
    log(missing)
    return 2
  seqs = args.seqs or (platform.quick_seqs if args.quick else platform.default_seqs)
  head_dims = args.head_dims or (
      platform.quick_head_dims if args.quick else platform.default_head_dims)
  causal_modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  cases = platform.make_cases(seqs, head_dims, causal_modes)
  env = environment(platform)
  settings = dict(seqs=list(seqs), head_dims=list(head_dims), causal=args.causal,
                  reps=args.reps, warm_up_runs=platform.warm_up_runs,
                  time_budget_s=TIME_BUDGET_S, quick=args.quick, cases=len(cases),
                  deterministic=args.deterministic, skip=list(args.skip))
  measurements: list[Measurement] = []
  for results in run(platform, cases, args.reps, args.skip):
    measurements.extend(results)
    if args.out is not None:
      reported = with_backward(measurements)
      write_results(args.out, env, settings, reported, format_table(platform, reported))
  print(format_table(platform, with_backward(measurements)))
  if args.out is not None:
    try:
      write_plot(args.out / "plot.png", platform, measurements,
                 f"{env['device_kind']}, {cases[0].dtype}: attention {platform.rate_unit}")
    except Exception as e:  # the plot only shows what results.json holds: warn, lose nothing
      log(f"jax_flash benchmark: warning: no plot written ({failure_reason(e)})")
  return 0
