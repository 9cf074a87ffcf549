"""The forward pass of each CUDA forward kernel choice beside cuDNN and tokamax, one run.

Each variant (a JAX_FLASH_CUDA_FORWARD value, or "default") runs in its own process (the choice
is read once per process) and times jax_flash's forward and, in the same process, the peers'
forwards, on the benchmark's GPU grid (16k tokens, hidden 2048, bfloat16). Prints one markdown
table: TFLOP/s per variant and peer, and each variant's ratio to the faster peer.

  usage: python3 .ci/gpu/forward_variants.py --variants default sm90ws sm90ws_serial \
           --head-dims 64 128 --seqs 1024 4096 16384 [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PEERS = ("cudnn", "tokamax")


def child(args: argparse.Namespace) -> None:
  """Times the forward of jax_flash (and the peers, with --peers) on every case; JSON on stdout."""
  from jax_flash.benchmark import GPU
  from jax_flash.benchmark.cases import make_inputs
  from jax_flash.benchmark.measure import time_step

  names = {"jax_flash", *args.peers}
  peers = [p for p in GPU.peers if p.name in names]
  results = []
  for case in GPU.make_cases(args.seqs, args.head_dims, (False, True)):
    inputs = make_inputs(case)
    for peer in peers:
      reason = peer.unavailable()
      if reason is not None:
        results.append({"case": case.__dict__, "peer": peer.name, "tflops": None, "why": reason})
        continue
      try:
        compiled = peer.build(case, inputs)["fwd"]()
        times = [t / compiled.calls_per_step for t in time_step(compiled.step, 2, args.reps)]
        median = sorted(times)[len(times) // 2]
        results.append({"case": case.__dict__, "peer": peer.name,
                        "tflops": case.flops("fwd") / median / 1e12})
      except Exception as e:  # a failing peer is a result
        results.append({"case": case.__dict__, "peer": peer.name, "tflops": None, "why": repr(e)[:200]})
      print(f"{peer.name} {case} {results[-1]['tflops']}", file=sys.stderr, flush=True)
  print(json.dumps(results))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variants", nargs="+", default=["default"])
  parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
  parser.add_argument("--seqs", nargs="+", type=int, default=[1024, 4096, 16384])
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--out", default=None)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--peers", nargs="*", default=[], help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    child(args)
    return

  rows: dict[tuple, dict[str, float | None]] = {}
  for index, variant in enumerate(args.variants):
    env = dict(os.environ)
    if variant != "default":
      env["JAX_FLASH_CUDA_FORWARD"] = variant
    # The peers run in the first variant's process and again in the last one's (their drift
    # across the run shows).
    peers = list(PEERS) if index in (0, len(args.variants) - 1) else []
    command = [sys.executable, __file__, "--child", "--reps", str(args.reps), "--seqs",
               *map(str, args.seqs), "--head-dims", *map(str, args.head_dims), "--peers", *peers]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
      print(f"variant {variant} failed:\n{result.stderr[-3000:]}", file=sys.stderr)
      continue
    for r in json.loads(result.stdout.strip().splitlines()[-1]):
      c = r["case"]
      key = (c["head_dim"], c["seq"], c["causal"])
      name = variant if r["peer"] == "jax_flash" else f"{r['peer']}@{index}"
      rows.setdefault(key, {})[name] = r["tflops"]

  columns = list(dict.fromkeys(name for cells in rows.values() for name in cells))
  variants = [c for c in columns if "@" not in c]
  peers = [c for c in columns if "@" in c]
  header = ["hd", "seq", "causal", *columns, *(f"{v}/best peer" for v in variants)]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for (hd, seq, causal), cells in sorted(rows.items()):
    best = max((cells[p] for p in peers if cells.get(p)), default=None)
    fmt = lambda x: "-" if x is None else f"{x:.0f}"
    ratios = [f"{cells[v] / best:.2f}" if cells.get(v) and best else "-" for v in variants]
    lines.append("| " + " | ".join([str(hd), str(seq), "Y" if causal else "N",
                                    *(fmt(cells.get(c)) for c in columns), *ratios]) + " |")
  table = "\n".join(lines)
  print(table)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "forward_variants.md"), "w") as f:
      f.write(f"`{' '.join(sys.argv)}`\n\n{table}\n")


if __name__ == "__main__":
  main()
