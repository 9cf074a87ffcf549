"""One process of tests/test_multiprocess.py's attention check (run as a script, not collected):

    python tests/multiprocess_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID LOCAL_DEVICES OUT

Joins a jax.distributed run on the CPU (Gloo collectives), builds a mesh over every process's
devices with the sequence axis over all of them, and runs jax_flash.dot_product_attention under
jax.jit on sequence-sharded q, k, v (causal GQA, with each context-parallel strategy): the output
and the gradients, gathered to every process. Process 0 writes them to OUT (.npz), keyed
"<strategy>/<name>", with the inputs under "inputs/<name>".
"""

from __future__ import annotations

import os
import sys


def main(coordinator: str, num_processes: int, process_id: int, local_devices: int,
         out_path: str) -> None:
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)
  import jax_flash

  rng = np.random.default_rng(0)  # the same inputs on every process
  batch, seq, heads_q, heads_k, head_dim = 2, 32, 4, 2, 16
  q = rng.standard_normal((batch, seq, heads_q, head_dim), np.float32)
  k = rng.standard_normal((batch, seq, heads_k, head_dim), np.float32)
  v = rng.standard_normal((batch, seq, heads_k, head_dim), np.float32)
  g = rng.standard_normal((batch, seq, heads_q, head_dim), np.float32)

  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("seq",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))
  rows = NamedSharding(mesh, P(None, "seq", None, None))
  whole = NamedSharding(mesh, P())
  place = lambda x: jax.make_array_from_callback(x.shape, rows, lambda index: x[index])
  args = [place(x) for x in (q, k, v, g)]

  results = {f"inputs/{n}": x for n, x in zip("qkvg", (q, k, v, g))}
  for strategy in (None, "ring", "all_to_all", "all_gather"):
    def forward_and_grads(q, k, v, g, strategy=strategy):
      attention = lambda q, k, v: jax_flash.dot_product_attention(
          q, k, v, is_causal=True, implementation="cpu", context_parallel=strategy)
      out, vjp = jax.vjp(attention, q, k, v)
      return (out, *vjp(g))

    fn = jax.jit(forward_and_grads, out_shardings=whole)
    for name, x in zip(("out", "dq", "dk", "dv"), fn(*args)):
      results[f"{strategy or 'auto'}/{name}"] = np.asarray(x)
  if jax.process_index() == 0:
    np.savez(out_path, **results)


if __name__ == "__main__":
  coordinator, processes, process_id, local, out = sys.argv[1:]
  main(coordinator, int(processes), int(process_id), int(local), out)
