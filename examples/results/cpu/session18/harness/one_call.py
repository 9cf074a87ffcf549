# One jitted jax_flash call timed REPS times: best and median GFLOP/s. Usage: one_call.py SEQ HD Y|N fwd|bwd REPS
# (batch 1, 4 heads; DTYPE=bfloat16 for bf16; "bwd" times fwd+bwd).
import os, sys, time, jax, jax.numpy as jnp
import jax_flash
seq, hd, causal, mode, reps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "Y", sys.argv[4], int(sys.argv[5])
ks = jax.random.split(jax.random.PRNGKey(0), 4)
q, k, v, do = (jax.random.normal(x, (1, seq, 4, hd), jnp.dtype(os.environ.get("DTYPE","float32"))) for x in ks)
att = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal)
if mode == "fwd": f = jax.jit(att); args = (q, k, v); mult = 4
else: f = jax.jit(lambda q, k, v, do: jax.vjp(att, q, k, v)[1](do)); args = (q, k, v, do); mult = 14
jax.block_until_ready(f(*args))
ts = []
for _ in range(reps):
  t = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t)
flops = mult * seq * seq * hd * 4 / (2 if causal else 1)
print(f"{seq} {hd} {causal} {mode} best {flops/min(ts)/1e9:.1f} median {flops/sorted(ts)[len(ts)//2]/1e9:.1f}")
if len(sys.argv) > 6: print(f.lower(*args).compile().as_text()[:3000])
