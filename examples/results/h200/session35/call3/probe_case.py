"""One CUDA_BIAS_CASES case (tests/test_cuda_logit_arrays.py) on the CUDA kernels, its forward and
then its gradients, printing each step as it completes: run under a timeout, it tells which pass
of which case does not finish.

  JAX_FLASH_CUDA_LOGIT_ARRAYS=on python3 probe_case.py CASE
"""
from __future__ import annotations

import functools
import sys

sys.path.insert(0, "tests")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from test_bias_mask_kernel import _flash, _inputs, _vjp  # noqa: E402
from test_cuda_logit_arrays import CUDA_BIAS_CASES  # noqa: E402
import test_bias_mask_kernel as tb  # noqa: E402


def main() -> None:
  name = sys.argv[1]
  options = dict(CUDA_BIAS_CASES[name])
  dtype = jnp.dtype(options.pop("dtype", jnp.bfloat16))
  bias_shape, bias_dtype = options.pop("bias_shape", None), options.pop("bias_dtype", None)
  mask_shape = options.pop("mask_shape", None)
  t, s = options.pop("t", tb.T), options.pop("s", tb.S)
  heads, head_dim = options.pop("heads", (tb.N, tb.K)), options.pop("head_dim", tb.H)
  bias_dtype = dtype if bias_dtype is None else bias_dtype
  q, k, v, g, bias, mask = _inputs(4, dtype, bias_shape, bias_dtype, mask_shape, t, s, heads, head_dim)
  attention = _flash(mask, options, "cuda")
  out = jax.jit(attention)(q, k, v, bias)
  jax.block_until_ready(out)
  print(f"{name}: forward done", flush=True)
  got = jax.jit(functools.partial(_vjp, attention))(q, k, v, bias, g)
  jax.block_until_ready(got)
  print(f"{name}: gradients done", flush=True)


if __name__ == "__main__":
  main()
