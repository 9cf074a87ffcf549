"""The vjp of jax_flash.dot_product_attention alone, best of REPS calls after one warm-up:
  python bwd_time.py SEQ|SEQ_Q,SEQ_K HEAD_DIM Y|N bf16|f32 [REPS]
(B 1, 4 heads; GFLOP/s by the FlashAttention convention, the backward 2.5x the forward.)"""
import sys, time, jax, jax.numpy as jnp, jax_flash
sq, sk = (map(int, sys.argv[1].split(",")) if "," in sys.argv[1] else [int(sys.argv[1])] * 2)
hd = int(sys.argv[2]); causal = sys.argv[3] == "Y"
dt = jnp.bfloat16 if sys.argv[4] == "bf16" else jnp.float32
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
ks = jax.random.split(jax.random.PRNGKey(0), 4)
q = jax.random.normal(ks[0], (1, sq, 4, hd), dt)
k = jax.random.normal(ks[1], (1, sk, 4, hd), dt)
v = jax.random.normal(ks[2], (1, sk, 4, hd), dt)
do = jax.random.normal(ks[3], (1, sq, 4, hd), dt)
o, vjp = jax.vjp(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal), q, k, v)
bwd = jax.jit(lambda do: vjp(do))
jax.block_until_ready(bwd(do))
best = 1e9
for _ in range(reps):
  t = time.perf_counter(); jax.block_until_ready(bwd(do)); best = min(best, time.perf_counter() - t)
fl = 4 * sq * sk * 4 * hd * 2.5 / (2 if causal else 1)
print(f"seq {sq},{sk} hd {hd} causal {causal} {sys.argv[4]}: bwd {best*1e3:.1f} ms {fl/best/1e9:.1f} GFLOP/s")
