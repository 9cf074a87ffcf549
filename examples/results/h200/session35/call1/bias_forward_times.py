"""Where the (1, N, T, S) bias's forward time goes: our forward (and fwd+bwd) at seq 4096, hd128
(B 4, 16 heads, bf16) with the arrays given as inputs (not formed in the step), beside the
kernels it is built on and cuDNN / tokamax with the same bias, in one process.

  python3 examples/results/h200/session35/call1/bias_forward_times.py [--label staged]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jax_flash

B, T, N, D = 4, 4096, 16, 128


def timed(fn, *args, reps=15):
  compiled = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--label", default="")
  parser.add_argument("--peers", action="store_true")
  args = parser.parse_args()
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(key, (B, T, N, D), jnp.bfloat16) for key in keys[:3])
  i = jnp.arange(T)[:, None]
  j = jnp.arange(T)[None, :]
  bias_1n = jnp.sin(0.01 * (i + 2 * j)[None, None] + jnp.arange(N)[None, :, None, None]).astype(jnp.bfloat16)
  bias_11 = bias_1n[:, :1]
  bias_bn = jnp.broadcast_to(bias_1n, (B, N, T, T)) + jnp.zeros((B, 1, 1, 1), jnp.bfloat16)
  bias_f32 = bias_1n.astype(jnp.float32)
  mask_11 = (i + j >= 0)[None, None]  # all true, (1, 1, T, S)
  ids = jnp.zeros((B, T), jnp.int32)
  flops_fwd = 4 * B * N * T * T * D

  def flash(**kw):
    return lambda q, k, v, *a: jax_flash.dot_product_attention(
        q, k, v, **{name: x for name, x in zip(kw["names"], a)}, is_causal=kw.get("causal", False),
        implementation="cuda")

  def grad_of(fn):
    def loss(q, k, v, *a):
      return jnp.sum(fn(q, k, v, *a).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))

  cases = [
      ("plain", [], []),
      ("segment ids (kIds kernel)", ["q_segment_ids", "kv_segment_ids"], [ids, ids]),
      ("mask (1,1,T,S) all true", ["mask"], [mask_11]),
      ("bias (1,1,T,S) bf16", ["bias"], [bias_11]),
      ("bias (1,N,T,S) bf16", ["bias"], [bias_1n]),
      ("bias (B,N,T,S) bf16", ["bias"], [bias_bn]),
      ("bias (1,N,T,S) f32 (direct loads)", ["bias"], [bias_f32]),
  ]
  for causal in (False, True):
    for name, names, arrays in cases:
      fn = flash(names=names, causal=causal)
      t = timed(fn, q, k, v, *arrays)
      line = f"{args.label:8s} causal={int(causal)} {name:36s} fwd {t * 1e3:7.3f} ms {flops_fwd / (2 if causal else 1) / t / 1e12:6.1f} TFLOP/s"
      if name in ("plain", "bias (1,N,T,S) bf16"):
        tb = timed(grad_of(fn), q, k, v, *arrays, reps=7)
        line += f" | fwd+bwd(grad q,k,v) {tb * 1e3:7.3f} ms"
      print(line, flush=True)
  if args.peers:
    import tokamax
    for causal in (False, True):
      for peer in ("cudnn", "tokamax"):
        def fn(q, k, v, bias, peer=peer, causal=causal):
          if peer == "cudnn":
            return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=causal, implementation="cudnn")
          return tokamax.dot_product_attention(q, k, v, bias=bias, is_causal=causal, implementation="mosaic")
        try:
          t = timed(fn, q, k, v, bias_1n)
          tb = timed(grad_of(fn), q, k, v, bias_1n, reps=7)
          print(f"{peer:8s} causal={int(causal)} {'bias (1,N,T,S) bf16':36s} fwd {t * 1e3:7.3f} ms "
                f"{flops_fwd / (2 if causal else 1) / t / 1e12:6.1f} TFLOP/s | fwd+bwd(grad q,k,v) {tb * 1e3:7.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
          print(peer, "failed:", str(e).splitlines()[0][:200])


if __name__ == "__main__":
  main()
