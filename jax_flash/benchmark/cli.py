"""The command line: `python -m jax_flash.benchmark [options]`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

import json


from jax_flash.benchmark.cases import (DECODE_SHORT_FRACTION, DecodeCase, block_sparse_cases,
                                       decode_cases, decode_inputs, packed_cases)
from jax_flash.benchmark.columns import HEAD_DIM_COLUMN, peak_fraction_column
from jax_flash.benchmark.provenance import environment
from jax_flash.benchmark.measure import (ACCELERATOR_CALLS_PER_STEP, TIME_BUDGET_S, Measurement,
                                         compile_step, failure_reason, time_step)
from jax_flash.benchmark.packed import packed_caption, with_packed_documents
from jax_flash.benchmark.platforms import (PLATFORMS, Platform, no_devices, with_block_sparse,
                                           with_deterministic_flash, with_heads_column)
from jax_flash.benchmark.plot import write_plot
from jax_flash.benchmark.report import (block_sparse_speedups, format_table, with_backward,
                                        write_results)
from jax_flash.benchmark.runner import log, run
from jax_flash.benchmark.variants import (DROPOUT_SEED, SINKS_SEED, VARIANT_SUFFIX, Variant,
                                          variant_caption, with_variant)


def positive_ints(text: str) -> list[int]:
  """An argument of positive integers separated by commas."""
  try:
    values = [int(part) for part in text.split(",") if part]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers (a,b,...), got {text!r}")
  return values


def _number(text: str, accept: Callable[[float], bool], expected: str) -> float:
  """An argument that is a number `accept` takes (never NaN); else an error naming `expected`."""
  try:
    value = float(text)
  except ValueError:
    value = float("nan")
  if value != value or not accept(value):
    raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
  return value


def density(text: str) -> float:
  """A block density: a number in (0, 1]."""
  return _number(text, lambda v: 0.0 < v <= 1.0, "a fraction of the blocks in (0, 1]")


def soft_cap(text: str) -> float:
  """A logit soft cap: a finite number > 0."""
  return _number(text, lambda v: 0.0 < v < float("inf"), "a finite soft cap > 0")


def dropout_rate(text: str) -> float:
  """A dropout rate: a number in (0, 1)."""
  return _number(text, lambda v: 0.0 < v < 1.0, "a dropout rate in (0, 1)")


def documents(text: str) -> int:
  """A number of documents per row: a positive integer."""
  return int(_number(text, lambda v: v >= 1 and v == int(v), "a positive integer"))


def value_head_dim(text: str) -> int:
  """A value head dim: a positive integer."""
  return int(_number(text, lambda v: v >= 1 and v == int(v), "a positive head dim"))


def head_count(text: str) -> int:
  """A number of heads: a positive integer."""
  return int(_number(text, lambda v: v >= 1 and v == int(v), "a positive number of heads"))


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
  parser.add_argument("--value-head-dim", type=value_head_dim, metavar="HV",
                      help="MLA-style cases: every case's value, and so its output and output "
                           "cotangent, has head dim HV (v (B, S, N, HV)) while query and key "
                           "keep the case's head dim H (e.g. --head-dims 192 --value-head-dim "
                           "128, DeepSeek-V2's); the hdim column reads H/HV, results.json "
                           "records it (settings' value_head_dim); FLOPs count each product "
                           "over its own head dim: forward 2*B*N*T*S*(H+HV), backward "
                           "2*B*N*T*S*(3H+2HV) (halved when causal; with HV = H the usual 4 B "
                           "N S^2 H and 2.5x it). Peers that take no such value read "
                           "'unavailable' with the reason (jax.nn's cudnn and xla, Pallas, "
                           "PyTorch's CPU flash kernel); jax_flash and tokamax run it (default: "
                           "HV = H)")
  parser.add_argument("--heads", type=head_count, metavar="N",
                      help="the query heads N of every case (default: the platform's grid: cpu "
                           "4; gpu 2048 // head dim, at least 1; on the GPU the batch stays "
                           "16384 // seq); the table gains a heads column (N, or N/K with "
                           "--kv-heads) and results.json records it (settings' heads); not "
                           "with --preset decode")
  parser.add_argument("--kv-heads", type=head_count, metavar="K",
                      help="grouped-query cases (GQA; MQA with K=1): key and value have K heads, "
                           "k (B, S, K, H) and v (B, S, K, HV), each shared by N/K query heads, "
                           "while the query, the output and its cotangent keep the N query "
                           "heads; every case's N must be divisible by K (so K <= N). The "
                           "table gains a heads column reading N/K, the caption says so, "
                           "results.json records it (settings' kv_heads, each measurement's "
                           "kv_heads); FLOPs count the query heads (the same as with K = N). "
                           "Every peer gets k and v of K heads as they are, none repeats them: "
                           "jax_flash, jax.nn's xla and cudnn and tokamax run them, PyTorch's "
                           "CPU flash kernel where it takes enable_gqa=True (probed); Pallas' mha "
                           "and a kernel that refuses them read 'unavailable' with the reason; "
                           "not with --preset decode (default: K = N)")
  parser.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                      help="causal cases, non-causal cases or both (default: both)")
  parser.add_argument("--reps", type=int, default=20,
                      help=f"timed repetitions after the warm-up ({_per_platform('warm_up_runs')} "
                           "runs); fewer for slow peers, so each spends about "
                           f"{TIME_BUDGET_S:g} s per pass of a case (default: 20)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                      help="the inputs' dtype (default: cpu float32, gpu bfloat16)")
  parser.add_argument("--interleave", action="store_true",
                      help="time each case's peers and passes in alternating rounds (one run "
                           "of each per round) instead of one after another: on a machine "
                           "shared with other work, load then falls on every peer alike "
                           f"(on the CPU each timed run waits {PLATFORMS['cpu'].settle_s * 1e3:g} "
                           "ms first, so that the last run's threads have left the cores, "
                           "and repeats its step back to back for about "
                           f"{PLATFORMS['cpu'].min_run_s * 1e3:g} ms, so that the cores' "
                           "wake-up after the pause is not a short call's time)")
  parser.add_argument("--deterministic", action="store_true",
                      help="time jax_flash's deterministic backward (deterministic=True)")
  parser.add_argument("--skip", nargs="+", default=[], metavar="PEER",
                      help="peers not to run, for a shorter run (their cells read "
                           f"'unavailable'); jax_flash cannot be skipped ({_peer_names()})")
  parser.add_argument("--packed-documents", type=documents, metavar="D",
                      help="packed cases: each row holds D documents of seq/D tokens end to end "
                           "(every seq must be divisible by D); jax_flash takes q_segment_ids = "
                           "kv_segment_ids (causal within each document in the causal cases) "
                           "and is timed beside itself on the same tokens as batch*D separate "
                           "rows of seq/D ('jax_flash_separate'), with the time ratio "
                           "('packed/separate time'); the other peers run where they can "
                           "express the packed mask (jax.nn's xla and cudnn and tokamax a "
                           "(B, 1, T, S) bool mask formed in the step, Pallas segment ids, "
                           "PyTorch a bool attn_mask), else read 'unavailable' with the reason "
                           "(jax_flash's cpu and cuda kernels both take segment ids); FLOP rates "
                           "count only the pairs within documents")
  parser.add_argument("--block-density", type=density, metavar="D",
                      help="block-sparse cases: each case with a random block mask (128 x 128 "
                           "blocks, jax_flash.BLOCK_MASK_BLOCK, a fraction D of them set, fixed seed, every query block "
                           "row's diagonal block set) followed by its dense twin (no mask) in "
                           "the same run; FLOP rates count only the computed blocks; peers "
                           "that take no mask read 'unavailable' for the sparse rows (XLA takes "
                           "it expanded to a (T, S) bool mask)")
  variant = parser.add_argument_group(
      "score variants",
      "with any of these, each case times jax_flash twice on the same inputs, plain and with "
      "the variant (all the options given together), and the table gives the variant's rate "
      "and its time over the plain one's ('variant/plain time'); every other peer runs with "
      "the variant where it takes it (jax.nn's cudnn and xla take ALiBi as a (1, N, T, S) bias "
      "array formed in the step, and the bias and mask arrays), else its cells read "
      "'unavailable' with the reason, as does a case the jax_flash kernel refuses (on a GPU: "
      "dropout, and the arrays unless JAX_FLASH_CUDA_LOGIT_ARRAYS=on). The sinks, slopes and "
      "bias are constants (not differentiated), but the bias with --bias-grad")
  variant.add_argument("--logits-soft-cap", type=soft_cap, metavar="C",
                       help="logits_soft_cap=C (Gemma 2's tanh cap of the scores)")
  variant.add_argument("--alibi", action="store_true",
                       help="alibi_slopes: ALiBi's geometric slopes 2^(-8h/N), one per head")
  variant.add_argument("--sinks", action="store_true",
                       help=f"sinks: a random normal logit per head (seed {SINKS_SEED}, mean 0)")
  variant.add_argument("--dropout-rate", type=dropout_rate, metavar="R",
                       help=f"dropout_rate=R with a fixed dropout_key (seed {DROPOUT_SEED})")
  variant.add_argument("--bias", action="store_true",
                       help="bias: a (1, N, T, S) array of the query's dtype, sin(0.01 (i + 2j) "
                            "+ h), formed in the step (not differentiated: no figure includes "
                            "dbias; --bias-grad differentiates it)")
  variant.add_argument("--bias-grad", action="store_true",
                       help="--bias with the bias differentiated: the fwd+bwd pass of every peer "
                            "that takes the bias returns dbias (1, N, T, S), summed over the "
                            "batch, beside dq, dk and dv (the bias formed in the step as with "
                            "--bias and given to jax.vjp as an input); a peer whose kernel "
                            "refuses the bias's gradient reads 'unavailable' with the reason; "
                            "the forward pass is --bias's")
  variant.add_argument("--mask", action="store_true",
                       help="mask: a (T, S) bool band, key j visible to row i when i - S/4 < j "
                            "<= i + S/4, formed in the step")
  parser.add_argument("--preset", choices=("decode",),
                      help="decode: the decoding shapes of issue 15 (B64 T1 32/8 S8192, also "
                           "ragged: every other sequence at S/8; B16 T1 16/16 S16384, B32 T4 "
                           "32/8 S8192, B4 T512 32/8 S8192 chunked prefill; head dim 128), "
                           "contiguous and paged, jax_flash beside XLA (and cuDNN on a GPU), "
                           "forward only; --seqs, --head-dims, --causal and --skip do not apply, "
                           "and --heads and --kv-heads are refused (the shapes have their own "
                           "query/kv heads)")
  parser.add_argument("--decode-reduce", type=int, metavar="N",
                      help="with --preset decode: divide batch and cache length by N (default: "
                           "8 on the cpu platform, 1 on gpu)")
  parser.add_argument("--cases", metavar="REGEX",
                      help="with --preset decode: only the cases whose label matches REGEX "
                           "(re.search), e.g. 'B64 T1' or 'contiguous'")
  parser.add_argument("--out", type=pathlib.Path, metavar="DIR",
                      help="write results.json (measurements and environment), table.md and "
                           "plot.png here")
  args = parser.parse_args(argv)
  if args.reps < 1:
    parser.error("--reps must be at least 1")
  if args.block_density is not None and args.preset is not None:
    parser.error("--block-density does not apply to --preset")
  args.variant = variant_of(args)
  if args.variant is not None and (args.preset is not None or args.block_density is not None):
    parser.error("the score variants (--logits-soft-cap, --alibi, --sinks, --dropout-rate, "
                 "--bias, --bias-grad, --mask) do not apply to --preset or --block-density")
  if args.packed_documents is not None and (
      args.preset is not None or args.block_density is not None or args.variant is not None):
    parser.error("--packed-documents does not apply to --preset, --block-density or the score "
                 "variants")
  if args.value_head_dim is not None and args.preset is not None:
    parser.error("--value-head-dim does not apply to --preset (its cases have head dim 128 "
                 "for q, k and v)")
  if (args.heads is not None or args.kv_heads is not None) and args.preset is not None:
    parser.error(f"--heads and --kv-heads do not apply to --preset {args.preset} (its shapes "
                 "have their own query and key/value heads: B64 T1 32/8, ...)")
  if args.decode_reduce is not None and (args.preset != "decode" or args.decode_reduce < 1):
    parser.error("--decode-reduce takes a positive integer, with --preset decode")
  if args.cases is not None:
    if args.preset != "decode":
      parser.error("--cases applies to --preset decode")
    try:
      re.compile(args.cases)
    except re.error as e:
      parser.error(f"--cases: {args.cases!r} is not a regular expression ({e})")
  # Flatten "--seqs 512,1024 2048" into one list.
  args.seqs = [n for group in args.seqs for n in group] if args.seqs else None
  args.head_dims = [n for group in args.head_dims for n in group] if args.head_dims else None
  platform = PLATFORMS[args.platform]
  for seq in case_seqs(args, platform) if args.packed_documents is not None else ():
    if seq % args.packed_documents:
      parser.error(f"--packed-documents {args.packed_documents}: seq {seq} is not divisible by "
                   f"{args.packed_documents} (each row holds {args.packed_documents} documents "
                   f"of seq/{args.packed_documents} tokens)")
  allowed = skippable(platform)
  for name in args.skip:
    if name not in allowed:
      parser.error(f"--skip: {name!r} is not a skippable {platform.name} peer "
                   f"(those are {', '.join(allowed)})")
  if args.head_dims and HEAD_DIM_COLUMN not in platform.columns:
    parser.error(f"--head-dims: the {platform.name} table has no head dim column (its cases "
                 f"have head dim {','.join(map(str, platform.default_head_dims))})")
  if args.kv_heads is not None and args.preset is None:
    error = kv_heads_error(args, platform)
    if error is not None:
      parser.error(error)
  return args


def case_head_dims(args: argparse.Namespace, platform: Platform) -> tuple[int, ...]:
  """The head dims the arguments ask for on `platform`."""
  if args.head_dims:
    return tuple(args.head_dims)
  return platform.quick_head_dims if args.quick else platform.default_head_dims


def kv_heads_error(args: argparse.Namespace, platform: Platform) -> str | None:
  """Why --kv-heads K does not fit the query heads N of the cases asked for (K > N, or N not
  divisible by K), naming both; None where it fits every case."""
  k = args.kv_heads
  cases = platform.make_cases(case_seqs(args, platform)[:1], case_head_dims(args, platform),
                              (False,), heads=args.heads)
  for n, head_dim in dict.fromkeys((case.heads, case.head_dim) for case in cases):
    if n % k == 0:
      continue
    heads = (f"--heads {n}" if args.heads is not None
             else f"the {platform.name} grid's {n} query heads at head dim {head_dim}")
    why = "is more than" if k > n else "does not divide"
    return (f"--kv-heads {k} {why} {heads}: grouped-query attention needs the query heads N "
            f"divisible by the key/value heads K (N % K == 0)")
  return None


def case_seqs(args: argparse.Namespace, platform: Platform) -> tuple[int, ...]:
  """The sequence lengths the arguments ask for on `platform`."""
  if args.seqs:
    return tuple(args.seqs)
  return platform.quick_seqs if args.quick else platform.default_seqs


def value_head_dim_caption(hv: int) -> str:
  """The caption line of a run with --value-head-dim."""
  return (f"value head dim Hv={hv}: v, the output and its cotangent (B, S, N, {hv}), q and k "
          f"the case's head dim H (hdim H/Hv); FLOPs count each product over its head dim: "
          f"forward 2*B*N*T*S*(H+Hv), backward 2*B*N*T*S*(3H+2Hv), halved when causal")


def kv_heads_caption(kv_heads: int) -> str:
  """The caption line of a run with --kv-heads."""
  return (f"grouped-query attention: {kv_heads} key/value heads, k (B, S, {kv_heads}, H) and v "
          f"(B, S, {kv_heads}, Hv), each shared by N/{kv_heads} query heads (heads column "
          f"N/{kv_heads}); q, the output and its cotangent keep the N query heads; FLOPs count "
          f"the query heads, the same as with K = N")


def variant_of(args: argparse.Namespace) -> Variant | None:
  """The score variant the arguments ask for, None without one."""
  # --bias-grad implies --bias: the same bias, differentiated.
  variant = Variant(logits_soft_cap=args.logits_soft_cap, alibi=args.alibi, sinks=args.sinks,
                    dropout_rate=args.dropout_rate, bias=args.bias or args.bias_grad,
                    mask=args.mask, bias_grad=args.bias_grad)
  return variant if variant.features() else None


def with_machine_fraction(platform: Platform, env: dict[str, object],
                          dtype: str) -> tuple[Platform, str | None]:
  """On the CPU: the platform with a column of jax_flash's share of the machine's measured
  float32 FMA peak (all cores), and a caption naming the CPU and that peak; else unchanged."""
  if platform.name != "cpu":
    return platform, None
  per_core = env.get("cpu_fma_peak_gflops_per_core")
  cores = env.get("cpu_count") or 1
  caption = (f"CPU: {env.get('cpu_model')} ({cores} cores, jax_flash kernel "
             f"{env.get('cpu_kernel_isa')}); {dtype} inputs")
  if not per_core:
    return platform, caption + "; FMA peak not measured (this build has no micro-benchmark)"
  total = float(per_core) * int(cores)
  caption += (f"; float32 FMA peak {per_core:.1f} GFLOP/s per core, {total:.1f} on "
              f"{cores} cores (measured by jax_flash's micro-benchmark)")
  flash = platform.peers[0]
  return (dataclasses.replace(platform, columns=(*platform.columns,
                                                 peak_fraction_column(flash, total * 1e9))),
          caption)


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
  if args.preset == "decode":
    return run_decode(platform, args)
  seqs = case_seqs(args, platform)
  head_dims = case_head_dims(args, platform)
  causal_modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  cases = platform.make_cases(seqs, head_dims, causal_modes, heads=args.heads)
  if args.dtype is not None:
    cases = [dataclasses.replace(case, dtype=args.dtype) for case in cases]
  if args.value_head_dim is not None:
    cases = [dataclasses.replace(case, value_head_dim=args.value_head_dim) for case in cases]
  if args.kv_heads is not None:
    cases = [dataclasses.replace(case, kv_heads=args.kv_heads) for case in cases]
  if args.heads is not None or args.kv_heads is not None:
    platform = with_heads_column(platform)
  if args.block_density is not None:
    cases = block_sparse_cases(cases, args.block_density)
    platform = with_block_sparse(platform)
  if args.packed_documents is not None:
    cases = packed_cases(cases, args.packed_documents)
    platform = with_packed_documents(platform, args.deterministic)
  env = environment(platform)
  skip = list(args.skip)
  if args.variant is not None:
    platform = with_variant(platform, args.variant, args.deterministic)
    skip = [name + VARIANT_SUFFIX for name in skip]
  platform, caption = with_machine_fraction(platform, env, cases[0].dtype if cases else "")
  if caption is not None:
    caption += (f"; load average {os.getloadavg()[0]:.2f} at the start"
                + ("; peers timed in alternating rounds (--interleave)" if args.interleave else ""))
  mode_caption = (variant_caption(args.variant) if args.variant is not None
                  else packed_caption(platform, args.packed_documents)
                  if args.packed_documents is not None else None)
  value_caption = (None if args.value_head_dim is None
                   else value_head_dim_caption(args.value_head_dim))
  heads_caption = None if args.kv_heads is None else kv_heads_caption(args.kv_heads)
  caption = "\n".join(filter(None, (caption, value_caption, heads_caption, mode_caption))) or None
  settings = dict(seqs=list(seqs), head_dims=list(head_dims), causal=args.causal,
                  reps=args.reps, warm_up_runs=platform.warm_up_runs,
                  time_budget_s=TIME_BUDGET_S, quick=args.quick, cases=len(cases),
                  deterministic=args.deterministic, skip=list(args.skip),
                  dtype=cases[0].dtype if cases else args.dtype, interleave=args.interleave,
                  load_average=list(os.getloadavg()), block_density=args.block_density,
                  variant=None if args.variant is None else dataclasses.asdict(args.variant),
                  packed_documents=args.packed_documents, value_head_dim=args.value_head_dim,
                  heads=args.heads, kv_heads=args.kv_heads)
  measurements: list[Measurement] = []
  for results in run(platform, cases, args.reps, skip, interleave=args.interleave):
    measurements.extend(results)
    if args.out is not None:
      reported = with_backward(measurements)
      write_results(args.out, env, settings, reported, _table(platform, reported, caption))
  print(_table(platform, with_backward(measurements), caption))
  if args.out is not None:
    title = f"{env['device_kind']}, {cases[0].dtype}: attention {platform.rate_unit}"
    if args.block_density is not None:  # one line per peer: the block-sparse rows
      measurements = [m for m in measurements if m.case.block_density is not None]
      title += f", block density {args.block_density:g}"
    if args.packed_documents is not None:
      title += f", {args.packed_documents} documents per row"
    if args.value_head_dim is not None:
      title += f", value head dim {args.value_head_dim}"
    if args.heads is not None:
      title += f", {args.heads} heads"
    if args.kv_heads is not None:
      title += f", {args.kv_heads} key/value heads"
    try:
      write_plot(args.out / "plot.png", platform, measurements, title)
    except Exception as e:  # the plot only shows what results.json holds: warn, lose nothing
      log(f"jax_flash benchmark: warning: no plot written ({failure_reason(e)})")
  return 0


def _table(platform: Platform, measurements: Sequence[Measurement], caption: str | None) -> str:
  """The markdown table, and after it the block-sparse cases' speed-ups over their dense twins
  where the run has some."""
  speedups = block_sparse_speedups(measurements)
  table = format_table(platform, measurements, caption)
  return table + ("\n\n" + speedups if speedups else "")


# ---------------------------------------------------------------------------------------------
# --preset decode


def _decode_fns(case: DecodeCase, kernel: str) -> dict:
  """The peers of a decode case, each a function of the case's input arrays (by name): jax_flash
  and XLA, and on a GPU cuDNN through jax.nn for the contiguous cases (jax.nn has no paged
  attention)."""
  import jax_flash  # the benchmark's other modules import it as well

  if case.paged:
    def paged(implementation):
      return lambda query, key_pages, value_pages, page_table, kv_lengths: (
          jax_flash.paged_attention(query, key_pages, value_pages, page_table, kv_lengths,
                                    is_causal=True, implementation=implementation))
    return {"jax_flash": paged(kernel), "xla": paged("xla")}
  def jax_nn(implementation):
    return lambda query, key, value, kv_lengths: jax.nn.dot_product_attention(
        query, key, value, key_value_seq_lengths=kv_lengths, implementation=implementation)

  fns = {
      "jax_flash": lambda query, key, value, kv_lengths: jax_flash.dot_product_attention(
          query, key, value, key_value_seq_lengths=kv_lengths, implementation=kernel),
      "xla": jax_nn("xla"),
  }
  if kernel == "cuda":
    fns["cudnn"] = jax_nn("cudnn")
  return fns


def _copy_bandwidth(device, calls: int, warm_up_runs: int, reps: int, mib: int) -> dict:
  """The device's copy bandwidth, the decode cases' roofline: y = x + 1 over `mib` MiB of
  float32 (each byte read once and written once), GB/s of bytes moved. (On a CPU a case whose
  cache fits the caches can read faster than this.)"""
  x = jax.device_put(jnp.zeros((mib << 18,), jnp.float32), device)
  compiled = compile_step(lambda x: x + 1, [x], calls)
  times = sorted(t / calls for t in time_step(compiled.step, warm_up_runs, reps))
  median = times[len(times) // 2]
  return dict(mib=mib, median_ms=median * 1e3, gb_per_s=2 * x.nbytes / median / 1e9)


def _decode_row(case: DecodeCase, results: dict, copy_gb_per_s: float) -> str:
  def ok(peer):
    return peer in results and results[peer]["status"] == "ok"

  def ms(peer):
    if peer not in results:
      return "-"
    return f"{results[peer]['median_ms']:.3f}" if ok(peer) else results[peer]["status"]

  def gbs(peer):
    return case.kv_bytes() / results[peer]["median_ms"] / 1e6 if ok(peer) else None

  def ratio(peer):  # > 1: jax_flash faster
    if not (ok(peer) and ok("jax_flash")):
      return "-"
    return f"{results[peer]['median_ms'] / results['jax_flash']['median_ms']:.2f}"

  flash = gbs("jax_flash")
  flash_gbs = f"{flash:.1f}" if flash is not None else "-"
  share = f"{100 * flash / copy_gb_per_s:.0f}%" if flash is not None else "-"
  return (f"| {case.label} | {ms('jax_flash')} | {ms('cudnn')} | {ms('xla')} | {ratio('cudnn')} | "
          f"{ratio('xla')} | {flash_gbs} | {share} |")


def _ragged_lines(cases: list[DecodeCase], results: dict) -> list[str]:
  """For each ragged case measured beside its all-full twin: how many times faster each peer ran
  it, against the ratio of the bytes the two read (the speed-up at equal bandwidth)."""
  lines = []
  for case in cases:
    full = case.full()
    if not case.ragged or full not in results:
      continue
    speedups = []
    for peer, result in results[case].items():
      twin = results[full].get(peer)
      if result["status"] == "ok" and twin is not None and twin["status"] == "ok":
        speedups.append(f"{peer} {twin['median_ms'] / result['median_ms']:.2f}x")
    ideal = full.kv_bytes() / case.kv_bytes()
    lines.append(f"- {case.label} against all at S{case.seq_k}: {', '.join(speedups) or '-'} "
                 f"faster; {ideal:.2f}x fewer K/V bytes (every other sequence at "
                 f"1/{DECODE_SHORT_FRACTION} of the length)")
  return lines


def run_decode(platform: Platform, args: argparse.Namespace) -> int:
  """The decode preset: each case's forward step for jax_flash, XLA and (GPU, contiguous)
  cuDNN, median ms; jax_flash's K/V bytes read per second and their share of the copy bandwidth
  measured in the same run (the roofline); for a ragged batch, its speed-up over the all-full
  one; a table on stdout, results.json and table.md in --out."""
  missing = no_devices(platform.device_kind)
  if missing is not None:
    log(missing)
    return 2
  cpu = platform.name == "cpu"
  reduce = args.decode_reduce or (8 if cpu else 1)
  kernel = "cpu" if cpu else "cuda"
  cases = decode_cases("float32" if cpu else "bfloat16", reduce)
  if args.cases is not None:
    cases = [case for case in cases if re.search(args.cases, case.label)]
    if not cases:
      log(f"--cases {args.cases!r} matches no case of the preset")
      return 2
  device = jax.devices(platform.device_kind)[0]
  calls = 1 if cpu else ACCELERATOR_CALLS_PER_STEP
  copy = _copy_bandwidth(device, calls, platform.warm_up_runs, args.reps, 64 if cpu else 2048)
  log(f"copy bandwidth: {copy['gb_per_s']:.1f} GB/s (y = x + 1 over {copy['mib']} MiB of float32)")
  header = (f"copy bandwidth {copy['gb_per_s']:.1f} GB/s (y = x + 1 over {copy['mib']} MiB, read + "
            "written), measured in this run\n\n"
            "| case | jax_flash ms | cudnn ms | xla ms | cudnn / jax_flash | xla / jax_flash | "
            "jax_flash K/V GB/s | of copy bandwidth |\n|---|---|---|---|---|---|---|---|")
  lines, records, by_case = [header], [], {}
  for index, case in enumerate(cases, 1):
    start = time.perf_counter()
    arrays = decode_inputs(case, device=device)
    results = {}
    for peer, fn in _decode_fns(case, kernel).items():
      names = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
      try:
        compiled = compile_step(fn, [arrays[name] for name in names], calls)
        times = [t / calls for t in time_step(compiled.step, platform.warm_up_runs, args.reps)]
        times.sort()
        results[peer] = dict(status="ok", median_ms=times[len(times) // 2] * 1e3,
                             times_ms=[t * 1e3 for t in times], temp_bytes=compiled.temp_bytes)
      except Exception as e:  # a peer that cannot run the case is a result, not a crash
        results[peer] = dict(status="fails", reason=failure_reason(e))
      records.append(dict(case=case.label, peer=peer, kv_bytes=case.kv_bytes(),
                          flop=case.flops(), kv_lengths=case.kv_lengths().tolist(),
                          **results[peer]))
    del arrays  # the next case's cache replaces this one's on the device
    by_case[case] = results
    lines.append(_decode_row(case, results, copy["gb_per_s"]))
    log(f"[{index}/{len(cases)}] {lines[-1]} ({time.perf_counter() - start:.1f} s)")
  ragged = _ragged_lines(cases, by_case)
  table = "\n".join(lines + ([""] + ragged if ragged else []))
  print(table)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    settings = dict(preset="decode", reduce=reduce, reps=args.reps, kernel=kernel,
                    cases=args.cases)
    (args.out / "results.json").write_text(json.dumps(
        dict(environment=environment(platform), settings=settings, copy_bandwidth=copy,
             measurements=records),
        indent=1, default=str))
    (args.out / "table.md").write_text(table + "\n")
  return 0
