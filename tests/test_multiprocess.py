"""jax_flash across processes (jax.distributed on the CPU, Gloo collectives): two processes of
several simulated devices each, launched as subprocesses with a local coordinator.

* examples/train_lm_sharded.py gives the losses of one process with the same devices and mesh;
* a sequence-sharded jax_flash.dot_product_attention (causal GQA, each context-parallel
  strategy, the ring by default) gives the output and gradients of the unsharded call.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import jax_flash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_lm_sharded.py")
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
TIMEOUT_S = 240
# A small model, a few steps: data 2, tensor 2, seq 2 (the ring, zig-zag layout) over 8 devices.
EXAMPLE_ARGS = ["--devices", "8", "--mesh", "2,2,2", "--layers", "1", "--width", "32",
                "--heads", "4", "--seq-len", "32", "--batch-size", "4", "--steps", "4",
                "--log-every", "1", "--eval-batches", "1", "--max-data-bytes", "60000"]

pytestmark = pytest.mark.skipif(
    not hasattr(jax.config, "jax_cpu_collectives_implementation"),
    reason="this jaxlib has no CPU collectives across processes "
           "(jax_cpu_collectives_implementation)")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env() -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # each process sets its own device count
  return env


def _run_processes(commands: list[list[str]]) -> list[str]:
  """Runs the commands at once and waits for all; fails with every output if one fails."""
  procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=ROOT) for c in commands]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  if any(p.returncode for p in procs):
    report = "\n".join(f"--- process {i} (exit {p.returncode}):\n{o[-4000:]}"
                       for i, (p, o) in enumerate(zip(procs, outputs)))
    pytest.fail(f"a process failed:\n{report}")
  return outputs


def test_train_lm_sharded_two_processes_match_one(tmp_path):
  single, multi = tmp_path / "single.json", tmp_path / "multi.json"
  _run_processes([[sys.executable, EXAMPLE, *EXAMPLE_ARGS, "--metrics-out", str(single)]])
  coordinator = f"127.0.0.1:{_free_port()}"
  _run_processes([
      [sys.executable, EXAMPLE, *EXAMPLE_ARGS, "--coordinator-address", coordinator,
       "--num-processes", "2", "--process-id", str(i)]
      + (["--metrics-out", str(multi)] if i == 0 else []) for i in range(2)])
  want, got = json.loads(single.read_text()), json.loads(multi.read_text())
  assert (want["processes"], got["processes"]) == (1, 2)
  assert len(got["losses"]) == 4
  np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
  np.testing.assert_allclose(got["final_val_loss"], want["final_val_loss"], rtol=1e-5)


def test_sequence_sharded_attention_across_two_processes(tmp_path):
  out = tmp_path / "attention.npz"
  coordinator = f"127.0.0.1:{_free_port()}"
  _run_processes([[sys.executable, WORKER, coordinator, "2", str(i), "2", str(out)]
                  for i in range(2)])
  got = dict(np.load(out))
  q, k, v, g = (got[f"inputs/{n}"] for n in "qkvg")
  out_ref, vjp = jax.vjp(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, is_causal=True, implementation="cpu"), q, k, v)
  want = dict(zip(("out", "dq", "dk", "dv"), (out_ref, *vjp(g))))
  for strategy in ("auto", "ring", "all_to_all", "all_gather"):
    for name, w in want.items():
      np.testing.assert_allclose(got[f"{strategy}/{name}"], np.asarray(w), rtol=1e-5, atol=1e-5,
                                 err_msg=f"{strategy} {name}")
