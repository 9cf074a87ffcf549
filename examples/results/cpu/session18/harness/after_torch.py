# jax_flash's forward timed alone and right after a torch SDPA call (as --interleave does)
import sys, time, jax, jax.numpy as jnp, numpy as np, torch
import jax_flash
seq, hd, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "Y"
ks = jax.random.split(jax.random.PRNGKey(0), 3)
q, k, v = (jax.random.normal(x, (1, seq, 4, hd), jnp.float32) for x in ks)
f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=causal))
tq, tk, tv = (torch.from_numpy(np.asarray(x)).transpose(1, 2).contiguous() for x in (q, k, v))
tf = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
jax.block_until_ready(f(q, k, v)); tf()
flops = 4 * seq * seq * hd * 4 / (2 if causal else 1)
def t_jax():
  t = time.perf_counter(); jax.block_until_ready(f(q, k, v)); return time.perf_counter() - t
def t_torch():
  t = time.perf_counter(); tf(); return time.perf_counter() - t
for name, seq_of in (("jax alone", lambda: [t_jax() for _ in range(9)]),
                     ("torch alone", lambda: [t_torch() for _ in range(9)]),
                     ("jax after torch", lambda: [(t_torch(), t_jax())[1] for _ in range(9)]),
                     ("torch after jax", lambda: [(t_jax(), t_torch())[1] for _ in range(9)])):
  ts = sorted(seq_of()); print(f"{name:16s} median {flops / ts[4] / 1e9:6.1f} best {flops / ts[0] / 1e9:6.1f} GFLOP/s")
for pause in (0.001, 0.005, 0.02, 0.1):
  def one():
    t_torch(); time.sleep(pause); return t_jax()
  ts = sorted(one() for _ in range(9)); print(f"jax {pause*1e3:5.0f} ms after torch: median {flops / ts[4] / 1e9:6.1f}")
