import sys, time, jax, jax.numpy as jnp, jax_flash
seq = int(sys.argv[1]); hd = int(sys.argv[2]); causal = sys.argv[3] == "Y"
dt = jnp.bfloat16 if sys.argv[4] == "bf16" else jnp.float32
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
ks = jax.random.split(jax.random.PRNGKey(0), 4)
q, k, v, do = (jax.random.normal(kk, (1, seq, 4, hd), dt) for kk in ks)
o, vjp = jax.vjp(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal), q, k, v)
bwd = jax.jit(lambda do: vjp(do))
jax.block_until_ready(bwd(do))
best = 1e9
for _ in range(reps):
  t = time.perf_counter(); jax.block_until_ready(bwd(do)); best = min(best, time.perf_counter() - t)
fl = 4 * seq * seq * 4 * hd * 2.5 / (2 if causal else 1)
print(f"seq {seq} hd {hd} causal {causal} {sys.argv[4]}: bwd {best*1e3:.1f} ms {fl/best/1e9:.1f} GFLOP/s")
