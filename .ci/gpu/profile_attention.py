"""Runs jax_flash's CUDA forward and backward once each, for Nsight Compute to profile.

    ncu --clock-control none -k regex:'flash_(fwd|bwd)_kernel' -c 2 --set full \\
        python3 .ci/gpu/profile_attention.py [--seq 4096] [--head-dim 128] [--causal]

One jitted forward+backward at the benchmark's shape (16k tokens, hidden 2048, bf16): the first
two launches matched by the regex are the forward kernel and the main backward kernel.
`--peer cudnn` runs jax.nn's cuDNN attention instead (the same shape and step), so that the
peer's kernels can be profiled with the same metrics in the same call. `--forward-only` runs the
inference forward alone (the benchmark's fwd rows: no gradient, so no saved statistics).
`--bias` passes a (1, N, T, S) bias in the inputs' dtype (an input of the step, as the benchmark's
--bias variant forms it; ours needs JAX_FLASH_CUDA_LOGIT_ARRAYS=on).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.benchmark.variants import position_bias


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--deterministic", action="store_true")
  parser.add_argument("--forward-only", action="store_true")
  parser.add_argument("--bias", action="store_true")
  parser.add_argument("--peer", choices=("jax_flash", "cudnn"), default="jax_flash")
  args = parser.parse_args()
  batch, heads = max(1, 16384 // args.seq), max(1, 2048 // args.head_dim)
  shape = (batch, args.seq, heads, args.head_dim)
  q, k, v, d_out = (jax.random.normal(key, shape, jnp.bfloat16)
                    for key in jax.random.split(jax.random.key(0), 4))

  bias = position_bias(q, k) if args.bias else None

  def attention(q, k, v, bias):
    if args.peer == "cudnn":
      return jax.nn.dot_product_attention(q, k, v, bias, is_causal=args.causal, implementation="cudnn")
    return jax_flash.dot_product_attention(q, k, v, bias, is_causal=args.causal, implementation="cuda",
                                           deterministic=args.deterministic)

  def loss(q, k, v, bias):
    return jnp.sum(attention(q, k, v, bias).astype(jnp.float32) * d_out.astype(jnp.float32))

  step = jax.jit(attention) if args.forward_only else jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  jax.block_until_ready(step(q, k, v, bias))
  print("profiled", args.peer, shape, "causal" if args.causal else "non-causal", "bias" if args.bias else "")


if __name__ == "__main__":
  main()
