"""A/B of where a differentiated CUDA call splits its output for the backward, in one process.

"kernel": the forward kernel writes the 16-bit o and its int8 rounding error itself
(KernelConfig.o_split, the default); "xla": the forward writes o in float32 and XLA splits it
(jax_flash._rounding.split_rounding; before session 16). Each case times jax.grad of a sum of
the output against a fixed cotangent, both ways in rounds, with cuDNN through jax.nn in the same rounds
(each of the three first in turn); bf16, 16k tokens / hidden 2048 shapes (the benchmark's grid).

  usage: python3 .ci/gpu/o_split_ab.py [--seqs 4096 8192] [--head-dims 64 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash import _ops

_WITH_SPLIT = _ops.for_backward


def _xla_split(config, split=False):
  return _WITH_SPLIT(config, split=False)


def step(implementation: str, shape, causal: bool):
  q, k, v, d_o = (jax.random.normal(key, shape, jnp.bfloat16)
                  for key in jax.random.split(jax.random.key(0), 4))

  def loss(q, k, v):
    if implementation == "cudnn":
      out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    else:
      out = jax_flash.dot_product_attention(q, k, v, is_causal=causal, implementation="cuda")
    return jnp.sum(out.astype(jnp.float32) * d_o.astype(jnp.float32))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return lambda: jax.block_until_ready(grad(q, k, v))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  print("| seq | hd | causal | kernel split ms | xla split ms | xla/kernel | cuDNN ms | cuDNN/kernel |")
  print("|---|---|---|---|---|---|---|---|")
  for seq in args.seqs:
    for head_dim in args.head_dims:
      for causal in (False, True):
        shape = (max(1, 16384 // seq), seq, max(1, 2048 // head_dim), head_dim)
        steps = {"kernel": step("cuda", shape, causal)}
        _ops.for_backward = _xla_split  # traced now: the xla way compiled with the old config
        try:
          steps["xla"] = step("cuda", shape, causal)
          steps["xla"]()
        finally:
          _ops.for_backward = _WITH_SPLIT
        steps["cudnn"] = step("cudnn", shape, causal)
        times = {name: [] for name in steps}
        for _ in range(2):  # warm-up
          for run in steps.values():
            run()
        names = list(steps)
        for r in range(args.rounds):  # each way first in turn (the first of a round ran slower)
          for name in names[r % len(names):] + names[:r % len(names)]:
            run = steps[name]
            reps, start = 10, time.perf_counter()
            for _ in range(reps):
              run()
            times[name].append((time.perf_counter() - start) / reps * 1e3)
        ms = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        print(f"| {seq} | {head_dim} | {'Y' if causal else 'N'} | {ms['kernel']:.3f} | "
              f"{ms['xla']:.3f} | {ms['xla'] / ms['kernel']:.3f} | {ms['cudnn']:.3f} | "
              f"{ms['cudnn'] / ms['kernel']:.3f} |", flush=True)


if __name__ == "__main__":
  main()
