# Forward-only timing of the bf16 CPU forward: batch 1, 4 heads (the benchmark's CPU shape).
import sys, time, jax, jax.numpy as jnp, numpy as np
import jax_flash
res = []
for seq in (2048, 4096):
  for hd in (64, 128):
    for causal in (False, True):
      ks = jax.random.split(jax.random.PRNGKey(0), 3)
      q, k, v = (jax.random.normal(x, (1, seq, 4, hd), jnp.bfloat16) for x in ks)
      f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal))
      f(q, k, v).block_until_ready()
      ts = []
      for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 7):
        t = time.perf_counter(); f(q, k, v).block_until_ready(); ts.append(time.perf_counter() - t)
      flops = 4 * seq * seq * hd * 4 / (2 if causal else 1)
      res.append(f"{seq} {hd} {'Y' if causal else 'N'} {flops / min(ts) / 1e9:7.1f}")
print("\n".join(res))
