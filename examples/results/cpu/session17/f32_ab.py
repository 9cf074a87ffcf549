# Forward-only (or fwd+bwd: "bwd") timing of the CPU kernel: batch 1, 4 heads (the benchmark's
# CPU shape), float32 (DTYPE=bfloat16 for bf16). Usage: f32_ab.py REPS [fwd|bwd] [seq ...].
# Prints GFLOP/s of the best call.
import os, sys, time, jax, jax.numpy as jnp
import jax_flash
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
mode = sys.argv[2] if len(sys.argv) > 2 else "fwd"
seqs = [int(s) for s in sys.argv[3:]] or [2048, 4096]
res = []
for seq in seqs:
  for hd in (64, 128):
    for causal in (False, True):
      ks = jax.random.split(jax.random.PRNGKey(0), 4)
      dtype = jnp.dtype(os.environ.get("DTYPE", "float32"))
      q, k, v, do = (jax.random.normal(x, (1, seq, 4, hd), dtype) for x in ks)
      att = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal)
      if mode == "fwd":
        f = jax.jit(att); args = (q, k, v); mult = 4
      else:  # fwd+bwd
        f = jax.jit(lambda q, k, v, do: jax.vjp(att, q, k, v)[1](do)); args = (q, k, v, do); mult = 14
      jax.block_until_ready(f(*args))
      ts = []
      for _ in range(reps):
        t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
      flops = mult * seq * seq * hd * 4 / (2 if causal else 1)
      res.append(f"{seq} {hd} {'Y' if causal else 'N'} {flops / min(ts) / 1e9:7.1f}")
print("\n".join(res))
