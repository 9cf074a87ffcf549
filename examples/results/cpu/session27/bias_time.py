# fwd+bwd (grads of q, k, v and the bias) of jax_flash "cpu" with a full (1, N, T, S) bias: median ms of 15.
import sys, time, jax, jax.numpy as jnp, numpy as np, jax_flash
dt = jnp.dtype(sys.argv[1]); bias_dt = jnp.dtype(sys.argv[2]) if len(sys.argv) > 2 else dt
B, N, T, H = 1, 8, 1024, 64
ks = jax.random.split(jax.random.PRNGKey(0), 5)
q, k, v = (jax.random.normal(x, (B, T, N, H), dt) for x in ks[:3])
bias = jax.random.normal(ks[3], (1, N, T, T), bias_dt)
g = jax.random.normal(ks[4], (B, T, N, H), dt)
def loss(q, k, v, b):
  return jnp.sum(jax_flash.dot_product_attention(q, k, v, b, implementation="cpu").astype(jnp.float32) * g)
f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
jax.block_until_ready(f(q, k, v, bias))
ts = []
for _ in range(15):
  t = time.perf_counter(); jax.block_until_ready(f(q, k, v, bias)); ts.append(time.perf_counter() - t)
nob = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_flash.dot_product_attention(q, k, v, implementation="cpu").astype(jnp.float32) * g), argnums=(0, 1, 2)))
jax.block_until_ready(nob(q, k, v)); t2 = []
for _ in range(15):
  t = time.perf_counter(); jax.block_until_ready(nob(q, k, v)); t2.append(time.perf_counter() - t)
print(f"{sys.argv[1]} bias {bias_dt}: with bias {np.median(ts)*1e3:.1f} ms, without {np.median(t2)*1e3:.1f} ms")
