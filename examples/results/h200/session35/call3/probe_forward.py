"""Forward (then gradients) of one configuration of the bias/mask kernels, printing each step as it
completes (run under a timeout): which of causal, a single key block, the ids' kernel, the direct
loads makes the forward stall.

  JAX_FLASH_CUDA_LOGIT_ARRAYS=on python3 probe_forward.py NAME
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jax_flash

B, N, H = 2, 4, 128


def config(name):
  global B, N
  t, s, kw = 70, 150, {}
  if name.endswith("-manytiles"):  # 256 tiles: more than the SMs, so the persistent CTAs take several
    B, N, name = 8, 32, name[:-len("-manytiles")]
  f32_bias = lambda t, s: jax.random.normal(jax.random.key(3), (1, N, t, s), jnp.float32)
  if name == "mask-causal-1block":
    kw = dict(mask=jnp.ones((B, 1, t, s), bool), is_causal=True)
  elif name == "ids-causal-1block":
    kw = dict(q_segment_ids=jnp.zeros((B, t), jnp.int32), kv_segment_ids=jnp.zeros((B, s), jnp.int32), is_causal=True)
  elif name == "f32bias-causal-1block":
    kw = dict(bias=f32_bias(t, s), is_causal=True)
  elif name == "f32bias-causal-2blocks":
    t = 200
    kw = dict(bias=f32_bias(t, s), is_causal=True)
  elif name == "f32bias-window-1block":
    kw = dict(bias=f32_bias(t, s), local_window_size=(70, 0))
  elif name == "f32bias-noncausal-1block":
    s = 100
    kw = dict(bias=f32_bias(t, s))
  elif name == "f32bias-noncausal-2blocks":
    kw = dict(bias=f32_bias(t, s))
  elif name == "bf16bias-mask-causal-staged":
    s = 144
    kw = dict(bias=f32_bias(t, s).astype(jnp.bfloat16), mask=jnp.ones((B, 1, t, s), bool), is_causal=True)
  else:
    raise SystemExit(f"unknown {name}")
  return t, s, kw


def main() -> None:
  name = sys.argv[1]
  t, s, kw = config(name)
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (B, t, N, H), jnp.bfloat16)
  k, v = (jax.random.normal(key, (B, s, N, H), jnp.bfloat16) for key in ks[1:])
  f = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, implementation="cuda", **kw)
  jax.block_until_ready(jax.jit(f)(q, k, v))
  print(f"{name}: forward done", flush=True)
  jax.block_until_ready(jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2)))(q, k, v))
  print(f"{name}: gradients done", flush=True)


if __name__ == "__main__":
  main()
