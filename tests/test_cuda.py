"""The CUDA kernels against the references: marked `gpu`, skipped without an NVIDIA GPU.

Run on the GPU machine with .ci/gpu/check.sh. The same covering grid as the CPU kernel (its
16-bit cases: the CUDA kernels take bfloat16/float16), plus large cases, a CUDA-graph (command
buffer) run, a jit-compiled training step, and float32 inputs (the blockwise XLA path) against
JAX's own default-precision attention.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

from attention_testing import (Case, check_against_references, check_output_against_references,
                               gpu_tests_in_a_process, run_jax_flash)
from test_forward_backward import GRID

pytestmark = pytest.mark.gpu

C = Case
LARGE = [
    C(batch=1, seq_q=4096, seq_k=4096, heads_q=8, heads_k=8, head_dim=128, dtype="bfloat16",
      is_causal=True),
    C(batch=2, seq_q=4096, seq_k=4096, heads_q=8, heads_k=2, head_dim=64, dtype="float16",
      kv_lens=(4096, 3000)),
    C(batch=1, seq_q=4096, seq_k=4096, heads_q=4, heads_k=4, head_dim=256, dtype="bfloat16",
      local_window_size=(512, 0)),
    # batch x heads >= 132 CTAs in every kernel, T != S
    C(batch=4, seq_q=1000, seq_k=1500, heads_q=40, heads_k=8, head_dim=192, dtype="bfloat16",
      is_causal=True, q_lens=(1000, 999, 500, 1), kv_lens=(1500, 1, 800, 1500)),
    C(batch=1, seq_q=16384, seq_k=16384, heads_q=2, heads_k=1, head_dim=128, dtype="bfloat16",
      is_causal=True),
    # batch x kv heads a wave of CTAs on their own, T != S, GQA, lengths; a window at head dim 128
    C(batch=8, seq_q=600, seq_k=700, heads_q=32, heads_k=16, head_dim=64, dtype="bfloat16",
      is_causal=True, q_lens=(600, 599, 300, 1, 600, 128, 64, 65),
      kv_lens=(700, 1, 350, 700, 129, 700, 64, 700)),
    C(batch=16, seq_q=512, seq_k=512, heads_q=8, heads_k=8, head_dim=128, dtype="float16",
      local_window_size=(100, 20)),
    # Plain non-causal calls at head dim 128 whose query blocks of 64 and of 80 rows (the
    # backward's, sm90ws_m80's) both end partly filled: GQA, T != S, a partial key block; lengths.
    C(batch=2, seq_q=1000, seq_k=1100, heads_q=8, heads_k=2, head_dim=128, dtype="bfloat16"),
    C(batch=2, seq_q=333, seq_k=333, heads_q=4, heads_k=4, head_dim=128, dtype="float16",
      q_lens=(333, 170), kv_lens=(333, 81)),
    # Head dim 256's Hopper backward, whose warpgroups share 64-key blocks (split head dim): GQA,
    # T != S, lengths, partial blocks; causal; and head dim 200 zero-padded onto it.
    C(batch=2, seq_q=300, seq_k=333, heads_q=4, heads_k=2, head_dim=256, dtype="bfloat16",
      q_lens=(300, 150), kv_lens=(333, 77)),
    C(batch=1, seq_q=520, seq_k=520, heads_q=2, heads_k=2, head_dim=256, dtype="float16",
      is_causal=True),
    C(batch=1, seq_q=190, seq_k=260, heads_q=4, heads_k=1, head_dim=200, dtype="bfloat16"),
    # Head dims 129..192 (on Hopper the backward on the split wgmma kernels of 192, whose second
    # warpgroup takes 64 columns of dK and dV and two blocks of dQ; elsewhere mma.sync): MQA's
    # head splits, lengths; 160 causal, GQA, T != S; 136 (the second warpgroup's columns mostly
    # zeros) with a window.
    C(batch=2, seq_q=300, seq_k=260, heads_q=8, heads_k=1, head_dim=192, dtype="bfloat16",
      kv_lens=(260, 131)),
    C(batch=1, seq_q=333, seq_k=300, heads_q=4, heads_k=2, head_dim=160, dtype="float16", is_causal=True),
    C(batch=2, seq_q=200, seq_k=250, heads_q=6, heads_k=2, head_dim=136, dtype="bfloat16",
      local_window_size=(60, 10)),
    # MQA: the Hopper backward splits each key block's 16 (8) query heads over CTAs, dK and dV
    # added in float32 and converted last (gpu/launch.h kv_head_splits): head dims 64 and 256.
    C(batch=1, seq_q=700, seq_k=900, heads_q=16, heads_k=1, head_dim=64, dtype="bfloat16",
      is_causal=True),
    C(batch=2, seq_q=300, seq_k=260, heads_q=8, heads_k=1, head_dim=256, dtype="float16",
      kv_lens=(260, 131)),
    # Causal backward CTAs started longest key blocks first in chunks of groups (gpu/launch.h
    # key_major_groups): 80 (batch, kv head) groups of 4 key blocks, a chunk of 66 and a last
    # one of 14 on an H200's 132 SMs; the last key block partial; lengths.
    C(batch=8, seq_q=500, seq_k=500, heads_q=20, heads_k=10, head_dim=64, dtype="bfloat16",
      is_causal=True, kv_lens=(500, 499, 250, 1, 500, 128, 129, 500)),
    # Head dims 65..96 on the kernels of 96 (128-column tiles whose products stop at 96; the
    # mma.sync family at 128): GQA, T != S, lengths, causal; a window in float16; MQA causal
    # (its head splits).
    C(batch=2, seq_q=1000, seq_k=1200, heads_q=12, heads_k=4, head_dim=96, dtype="bfloat16",
      is_causal=True, q_lens=(1000, 333), kv_lens=(1200, 700)),
    C(batch=2, seq_q=700, seq_k=700, heads_q=4, heads_k=4, head_dim=80, dtype="float16",
      local_window_size=(200, 50)),
    C(batch=1, seq_q=900, seq_k=900, heads_q=16, heads_k=1, head_dim=96, dtype="bfloat16",
      is_causal=True),
    # decode steps: the split-KV program (pack-GQA, key chunks, the combine) around the forward
    C(batch=4, seq_q=1, seq_k=8192, heads_q=32, heads_k=8, head_dim=128, dtype="bfloat16",
      kv_lens=(8192, 5000, 1, 0)),
    C(batch=2, seq_q=4, seq_k=3000, heads_q=16, heads_k=1, head_dim=64, dtype="float16",
      q_lens=(4, 2), kv_lens=(3000, 2999)),
]
CASES = [c for c in GRID if c.dtype != "float32"] + LARGE


@pytest.fixture(autouse=True)
def _exact_float32_references():
  """The float32 references must not run on TF32 tensor cores."""
  with jax.default_matmul_precision("highest"):
    yield


def _poison_device_memory(nbytes: int = 1 << 30) -> None:
  """Fill and free a large block with NaN so that buffers XLA hands out next start as NaN:
  an element a kernel forgot to write then fails the finiteness check."""
  jax.block_until_ready(jnp.full((nbytes // 4,), jnp.nan, jnp.float32)).delete()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cuda_matches_reference(case):
  _poison_device_memory()
  got = run_jax_flash(case, "cuda")
  check_against_references(case, got)


# Shapes at the forward's tile edges for its inference path (no residual, 16-bit o): T != S,
# lengths, GQA, causal, windows, head dims whose columns a 64- or 128-wide tile only partly
# holds (40, 96), more tiles than SMs.
FORWARD_ONLY = [
    C(batch=2, seq_q=300, seq_k=517, heads_q=4, heads_k=2, head_dim=128, dtype="bfloat16",
      q_lens=(300, 129), kv_lens=(517, 64)),
    C(batch=1, seq_q=257, seq_k=257, heads_q=2, heads_k=2, head_dim=64, dtype="float16",
      is_causal=True),
    C(batch=3, seq_q=1000, seq_k=700, heads_q=8, heads_k=1, head_dim=96, dtype="bfloat16",
      local_window_size=(100, 30)),
    C(batch=2, seq_q=64, seq_k=1000, heads_q=2, heads_k=2, head_dim=40, dtype="bfloat16",
      kv_lens=(1000, 3)),
    C(batch=4, seq_q=2048, seq_k=2048, heads_q=40, heads_k=8, head_dim=128, dtype="bfloat16",
      is_causal=True),
]


@pytest.mark.parametrize("case", FORWARD_ONLY, ids=[c.id for c in FORWARD_ONLY])
def test_forward_only_matches_reference(case):
  """The inference forward (no gradient, so no residual: a 16-bit o straight from the kernel,
  which the gradient tests never read) within the rule, every element written: rows without
  keys exactly 0."""
  _poison_device_memory()
  q, k, v, _ = case.inputs()
  out = np.asarray(jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, implementation="cuda", **case.options()))(q, k, v), np.float32)
  check_output_against_references(case, out)


def test_cuda_is_default_on_gpu():
  q, k, v, _ = C(dtype="bfloat16", seq_q=300, seq_k=300).inputs()
  auto = jax_flash_call(q, k, v, None)
  cuda = jax_flash_call(q, k, v, "cuda")
  np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(cuda, np.float32))


def test_float32_on_gpu_is_as_accurate_as_jax_default_matmul():
  """float32 inputs with implementation=None run (the blockwise XLA path) and are as accurate as
  JAX's own attention at its default float32 matmul precision: for the output and every
  gradient, max|x - x_exact| <= 2 max|x_jax_default - x_exact| + 1e-5 max|x_exact| + 1e-6, where
  x_exact is computed at "highest" precision."""
  import jax_flash
  case = C(batch=2, seq_q=1024, seq_k=1024, heads_q=8, heads_k=2, head_dim=64, is_causal=True)
  q, k, v, g = case.inputs()

  def results(attention):
    def loss(q, k, v):
      return jnp.sum(attention(q, k, v) * g)
    out = attention(q, k, v)
    return [out, *jax.grad(loss, argnums=(0, 1, 2))(q, k, v)]

  def flash(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, is_causal=True)

  def jax_nn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

  exact = results(jax.jit(jax_nn))  # the module's fixture: "highest"
  with jax.default_matmul_precision("default"):
    got, default = results(jax.jit(flash)), results(jax.jit(jax_nn))
  for name, x, d, e in zip(("out", "dq", "dk", "dv"), got, default, exact):
    assert x.dtype == jnp.float32, name
    x, d, e = (np.asarray(a, np.float64) for a in (x, d, e))
    bound = 2 * np.max(np.abs(d - e)) + 1e-5 * np.max(np.abs(e)) + 1e-6
    assert np.max(np.abs(x - e)) <= bound, (name, np.max(np.abs(x - e)), bound)


def jax_flash_call(q, k, v, implementation):
  import jax_flash
  return jax_flash.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


DETERMINISTIC_CASES = [c for c in CASES if c.head_dim in (40, 64, 96, 111, 128, 192, 256)][::3]


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=[c.id for c in DETERMINISTIC_CASES])
def test_deterministic_matches_reference(case):
  _poison_device_memory()
  got = run_jax_flash(case, "cuda", deterministic=True)
  check_against_references(case, got)


def test_backward_forms_delta_from_o_and_its_rounding_error():
  """A differentiated 16-bit call keeps the 16-bit o plus its int8 rounding error for the
  backward (jax_flash._rounding; issue 13 item 2): the forward's custom call writes both, XLA
  forms delta from them, and the backward's call takes delta, not them. The step-by-step result
  equals the backward given o in float32 (join_rounding, to float32 rounding)."""
  import jax_flash
  from jax_flash import _ops, _rounding
  rng = np.random.default_rng(5)
  q, k, v, d_o = (jnp.asarray(2 * rng.standard_normal((2, 96, 4, 64)), jnp.bfloat16) for _ in range(4))
  loss = lambda q: (jax_flash.dot_product_attention(q, k, v, implementation="cuda")
                    .astype(jnp.float32) * d_o.astype(jnp.float32)).sum()
  hlo = jax.jit(jax.grad(loss)).lower(q).as_text()
  forward = [line for line in hlo.splitlines() if "jax_flash_cuda_fwd" in line]
  backward = [line for line in hlo.splitlines() if "jax_flash_cuda_bwd" in line]
  assert forward and all("tensor<2x96x4x64xi8>" in line for line in forward), forward
  assert backward and not any("xi8>" in line for line in backward), backward
  config = _ops.KernelConfig("cuda", 0.125, False, -1, -1)
  lens = jnp.full((2,), 96, jnp.int32)
  o32, lse = _ops.flash_fwd(q, k, v, lens, lens, _ops.for_backward(config))
  o, o_error = _rounding.split_rounding(o32, jnp.bfloat16)
  got = _ops.flash_bwd(q, k, v, o, lse, d_o, lens, lens, config, None, o_error)
  want = _ops.flash_bwd(q, k, v, _rounding.join_rounding(o, o_error), lse, d_o, lens, lens, config)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2,
                               atol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False), (96, True), (256, False)])
def test_forward_splits_o_as_xla_would(dtype, head_dim, causal):
  """A differentiated call's forward writes the 16-bit o and its int8 rounding error itself
  (KernelConfig.o_split): bit for bit the split_rounding of the float32 o the same kernel
  writes with o_float32 (both normalised by the rounded P's sum), and the same lse; empty rows
  (past the query lengths) 0 both ways. Hopper and sm80 forwards by head dim (256: 64-key
  tiles)."""
  from jax_flash import _ops, _rounding
  rng = np.random.default_rng(head_dim)
  q, k, v = (jnp.asarray(2 * rng.standard_normal((2, 200, 4, head_dim)), dtype) for _ in range(3))
  q_lens = jnp.asarray([200, 150], jnp.int32)
  kv_lens = jnp.asarray([200, 180], jnp.int32)
  config = _ops.KernelConfig("cuda", head_dim**-0.5, causal, -1, -1)
  o, lse, o_error = _ops.flash_fwd(q, k, v, q_lens, kv_lens, _ops.for_backward(config, split=True))
  o32, lse32 = _ops.flash_fwd(q, k, v, q_lens, kv_lens, _ops.for_backward(config))
  hi, want_error = _rounding.split_rounding(o32, dtype)
  np.testing.assert_array_equal(np.asarray(o).view(np.uint16), np.asarray(hi).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(o_error), np.asarray(want_error))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse32))
  assert np.abs(np.asarray(o_error, np.int32)).max() > 64  # the errors are there to compare


_NARROW_SPLIT = os.environ.get("JAX_FLASH_CUDA_NARROW") != "off"


@pytest.mark.skipif(not _NARROW_SPLIT, reason="JAX_FLASH_CUDA_NARROW=off")
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seq_k, window", [(1, None), (300, (0, 0))], ids=["one_key", "diagonal_window"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_single_key_rows_have_exactly_zero_score_gradients(seq_k, window, head_dim, deterministic):
  """Rows whose masks leave exactly one key have P = 1, so dS = 0 and every dq and dk
  contribution from them is exactly 0, as jax.nn gives (issue 13's [12]: dP - delta left float32
  round-off, 1.21x past the accuracy rule's floor). By default (the narrow split) such calls
  (narrow: at most 16 keys a row) run the mma.sync kernels, which zero dS there by a factor (NaN
  would stay NaN)."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, 300, 4, head_dim)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((2, seq_k, 2, head_dim)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((2, seq_k, 2, head_dim)), jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal((2, 300, 4, head_dim)), jnp.bfloat16)

  def grads(implementation, **kw):
    f = lambda q, k, v: jnp.sum(jax_flash.dot_product_attention(
        q, k, v, local_window_size=window, implementation=implementation, **kw).astype(jnp.float32) * g)
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

  dq, dk, dv = grads("cuda", deterministic=deterministic)
  assert not np.any(np.asarray(dq, np.float32)), "dq must be exactly 0"
  assert not np.any(np.asarray(dk, np.float32)), "dk must be exactly 0"
  want_dv = grads("xla")[2]
  np.testing.assert_allclose(np.asarray(dv, np.float32), np.asarray(want_dv, np.float32), rtol=2e-2, atol=2e-2)


def test_deterministic_is_bit_identical():
  """deterministic=True: every output bit-identical run after run, in a GQA call whose default
  backward would split the kv heads' query heads over CTAs (dK and dV by atomics)."""
  case = C(batch=2, seq_q=1024, seq_k=1024, heads_q=8, heads_k=2, head_dim=128,
           dtype="bfloat16", is_causal=True)
  first = run_jax_flash(case, "cuda", deterministic=True)
  for _ in range(3):
    again = run_jax_flash(case, "cuda", deterministic=True)
    for name in ("out", "lse", "dq", "dk", "dv"):
      np.testing.assert_array_equal(first[name], again[name], err_msg=name)


def test_dk_dv_deterministic():
  """Where a key block's query heads are not split over CTAs (here: a kv head per query head),
  dK and dV are reduced in registers: bit-identical run after run. (dQ is accumulated with
  float32 atomics, as dK and dV are where the Hopper backward splits a group's heads, gpu/launch.h
  kv_head_splits: their order, and so their last bits, can vary; deterministic=True fixes both.)"""
  case = C(batch=2, seq_q=1024, seq_k=1024, heads_q=8, heads_k=8, head_dim=128,
           dtype="bfloat16", is_causal=True)
  first = run_jax_flash(case, "cuda")
  for _ in range(3):
    again = run_jax_flash(case, "cuda")
    for name in ("out", "lse", "dk", "dv"):
      np.testing.assert_array_equal(first[name], again[name], err_msg=name)


def test_command_buffer_capture():
  """The handlers are marked command-buffer compatible: XLA may capture them in CUDA graphs.
  Run a jitted fwd+bwd many times (XLA captures after warm-up) and compare with the first."""
  case = C(batch=2, seq_q=512, seq_k=512, heads_q=4, heads_k=4, head_dim=64, dtype="bfloat16")
  q, k, v, g = case.inputs()
  import jax_flash

  @jax.jit
  def step(q, k, v):
    def loss(q, k, v):
      out = jax_flash.dot_product_attention(q, k, v, implementation="cuda")
      return jnp.sum(out.astype(jnp.float32) * g)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  reference = jax.tree.map(np.asarray, step(q, k, v))
  for _ in range(10):
    value, grads = step(q, k, v)
  np.testing.assert_allclose(np.asarray(value), reference[0], rtol=1e-5)
  for got, want in zip(grads[1:], reference[1][1:]):  # dk, dv: deterministic
    np.testing.assert_array_equal(np.asarray(got), want)


def test_jit_training_step_reduces_loss():
  """A tiny attention-only regression model trained with a jit-compiled SGD step."""
  import jax_flash
  rng = np.random.default_rng(0)
  batch, seq, heads, dim = 4, 256, 4, 64
  x = jnp.asarray(rng.standard_normal((batch, seq, heads * dim)), jnp.bfloat16)
  target = jnp.asarray(rng.standard_normal((batch, seq, heads * dim)), jnp.float32)
  params = {name: jnp.asarray(rng.standard_normal((heads * dim, heads * dim)) / 16, jnp.float32)
            for name in ("wq", "wk", "wv")}

  def loss_fn(params):
    def project(w):
      return (x @ w.astype(jnp.bfloat16)).reshape(batch, seq, heads, dim)
    out = jax_flash.dot_product_attention(project(params["wq"]), project(params["wk"]),
                                          project(params["wv"]), is_causal=True)
    return jnp.mean((out.astype(jnp.float32).reshape(batch, seq, -1) - target) ** 2)

  @jax.jit
  def train_step(params):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

  losses = []
  for _ in range(20):
    params, loss = train_step(params)
    losses.append(float(loss))
  assert all(np.isfinite(losses))
  assert losses[-1] < losses[0]


def _run_in_subprocess(env_overrides: dict, *pytest_args: str,
                       files: tuple[str, ...] = ("test_cuda.py",)) -> subprocess.CompletedProcess:
  """pytest on `files` (of this folder; this file by default) in a subprocess with the
  environment overrides (the kernel choices are read once per process)."""
  here = os.path.dirname(os.path.abspath(__file__))
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "gpu",
       *(os.path.join(here, f) for f in files), *pytest_args],
      env=dict(os.environ, **env_overrides), capture_output=True, text=True, timeout=900)


def _on_hopper() -> bool:
  """Whether the first GPU is a Hopper (compute capability 9.x)."""
  return int(jax.devices("gpu")[0].compute_capability.split(".")[0]) == 9


def _run_cuda_tests_on_hopper_with(env_overrides: dict, selection: str,
                                   files: tuple[str, ...] = ("test_cuda.py",)) -> None:
  """Runs the CUDA tests of `files` matching `selection` under the overrides, on Hopper."""
  if not _on_hopper():
    pytest.skip("the kernel choice only differs on compute capability 9.x")
  result = _run_in_subprocess(env_overrides, "-k", selection, files=files)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_backward_workspace_holds_dk_dv_where_heads_split():
  """Where a CTA per (key block, kv head, batch) leaves the SMs short of work (MQA at batch 1),
  the Hopper backward splits each group's query heads over CTAs and adds dK and dV into float32
  accumulators placed after dQ's in its workspace; with a kv head per query head, or
  deterministic, it does not."""
  if not _on_hopper():
    pytest.skip("the head splits are the Hopper backward's")
  from jax_flash import _registry
  b, t, s, h = 1, 1024, 1024, 128
  plain = _registry.cuda_dq_accum_elements(b, t, s, 16, 16, h, False)
  assert plain == b * t * 16 * h
  assert _registry.cuda_dq_accum_elements(b, t, s, 16, 1, h, False) == plain + 2 * b * s * 1 * h
  assert _registry.cuda_dq_accum_elements(b, t, s, 16, 1, h, True) == 0


def test_mma_sync_kernels_on_hopper():
  """On Hopper the wgmma kernels run head dims 33..128 (and 129..256's backward); the mma.sync
  ones (what A100s run) must pass the same cases there too, dQ by atomics and deterministic, and split o as the Hopper
  forward does."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_FORWARD": "sm80", "JAX_FLASH_CUDA_BACKWARD": "sm80"},
      "((test_cuda_matches_reference or test_deterministic_matches_reference) and (h64 or h128 or h256)) "
      "or test_forward_splits_o_as_xla_would")


# JAX_FLASH_CUDA_FWD_GRID forces one deal of the forward's tiles (sm90/tile_scheduler.cuh) where
# the default deals causal calls' in static pairs and the others' from the counter: each runs
# the deal the default does not use somewhere.
@pytest.mark.parametrize("grid", ["per_tile", "static", "dynamic"])
def test_forward_grid_override_on_hopper(grid):
  """The default forward's kernels on a CTA per tile, or on their persistent grid dealt tiles in
  static pairs or from the counter whatever the mask (JAX_FLASH_CUDA_FWD_GRID), pass the
  reference cases of head dims 33..128 (causal ones among them), the forward-only cases, the
  CUDA-graph capture and the training step; and so do head dim 64's three-warpgroup tiles
  (sm90ws_wide), which the default deals from the counter with or without a causal mask."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_FWD_GRID": grid},
      "(test_cuda_matches_reference and (h40 or h64 or h80 or h96 or h111 or h128)) "
      "or test_forward_only_matches_reference or test_command_buffer_capture or "
      "test_jit_training_step_reduces_loss")
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_FWD_GRID": grid, "JAX_FLASH_CUDA_FORWARD": "sm90ws_wide"},
      "(test_cuda_matches_reference and h64) or test_command_buffer_capture")


# The plain forward's query tiles lie against the sequence's end wherever their height does not
# divide it (to within 64 rows; the default since session 48): the first tile's rows before row 0
# are its padding, loaded as zeros by TMA and never stored. JAX_FLASH_CUDA_FWD_ROWS=start lays them
# from row 0 as before.
@pytest.mark.parametrize("forward, rows", [(None, "start"), ("sm90ws_wide", "end"), ("sm90ws_directstore", "end"),
                                           ("sm90ws_wide", "start")])
def test_forward_query_tile_rows_on_hopper(forward, rows):
  """With the tiles from row 0 (the default kernels, odd lengths) or against the sequence's end
  (head dim 64's 192-row tiles on every mask, sm90ws_wide, and the direct stores of O), the
  forward passes the reference cases (partial blocks, lengths, GQA, T != S, causal), the
  forward-only cases and the CUDA-graph capture."""
  env = {"JAX_FLASH_CUDA_FWD_ROWS": rows, **({"JAX_FLASH_CUDA_FORWARD": forward} if forward else {})}
  heads = "h40 or h64" if forward == "sm90ws_wide" else "h40 or h64 or h80 or h96 or h111 or h128 or h256"
  _run_cuda_tests_on_hopper_with(
      env, f"(test_cuda_matches_reference and ({heads})) or test_forward_only_matches_reference or "
      "test_command_buffer_capture")


# Each consumer warpgroup of the plain forward on the 192-row tiles (head dims up to 64) skips the
# products and softmax of the key blocks none of its own rows sees, still taking its turns and
# releasing the blocks' buffers (the default since session 48; sm90/flash_fwd_ws_kernel.cuh mine,
# mine_end; Sm90FwdWsTraits::kSkipsUnseenBlocks). JAX_FLASH_CUDA_FWD_UNSEEN=compute computes them
# as before.
@pytest.mark.parametrize("rows", ["start", "end"])
def test_forward_computes_unseen_blocks_on_hopper(rows):
  """With every warpgroup computing every block of its tile, the tiles laid from row 0 or against
  the sequence's end pass the reference cases of head dims 40-128 (causal, windows, lengths,
  T != S), the forward-only cases, the CUDA-graph capture and the forwards of more tiles than
  SMs."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_FWD_UNSEEN": "compute", "JAX_FLASH_CUDA_FWD_ROWS": rows},
      "(test_cuda_matches_reference and (h40 or h64 or h96 or h128)) or test_forward_only_matches_reference or "
      "test_command_buffer_capture or test_forward_of_more_tiles_than_sms")


def test_forward_alu_sums_on_hopper():
  """With JAX_FLASH_CUDA_FORWARD=sm90ws_alusums the differentiated forward on the 128 x 128 tiles
  (head dims 64 and 128) sums its 16-bit P in the softmax (unpacking and adding each) instead of
  on the tensor cores as the default does; the reference cases, deterministic ones, the
  forward's own split of o and the training step pass."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_FORWARD": "sm90ws_alusums"},
      "((test_cuda_matches_reference or test_deterministic_matches_reference) and (h40 or h64 or h128)) or "
      "test_forward_splits_o_as_xla_would or test_jit_training_step_reduces_loss")


def test_forward_direct_store_on_hopper():
  """With JAX_FLASH_CUDA_FORWARD=sm90ws_directstore the inference forward at head dims 64 and 128
  stores O by every thread's stores to global memory, where the default stores it by TMA from
  shared memory (flash_fwd_ws_kernel.cuh kTmaStore); the forward-only cases, the reference
  cases and the CUDA-graph capture pass."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_FORWARD": "sm90ws_directstore"},
      "test_forward_only_matches_reference or (test_cuda_matches_reference and (h64 or h128)) or "
      "test_command_buffer_capture or test_cuda_is_default_on_gpu")


@pytest.mark.parametrize("forward", ["sm90ws", "sm80"])
def test_forward_pair_stores_on_cuda(forward):
  """By default (since session 52) the forwards store 16-bit O rows from registers, and a
  differentiated call's rounding errors, 8 columns a lane at once after a quad's shuffles where
  the rows allow (gpu/epilogue.cuh store_output_vectors; head dims that are not a multiple of 8,
  111 among the cases, take the pair stores anyway). With JAX_FLASH_CUDA_FWD_STORES=pairs every
  row takes the pair stores, as before: the reference cases, the deterministic and forward-only
  ones, the forward's own split of o bit for bit against the float32 o, the NaN rules and
  unwritten elements, the CUDA-graph capture and the training step pass, on the Hopper kernels
  and on the mma.sync ones."""
  if forward == "sm90ws" and not _on_hopper():
    pytest.skip("the Hopper kernels run on compute capability 9.x only")
  env = {"JAX_FLASH_CUDA_FWD_STORES": "pairs", "JAX_FLASH_CUDA_FORWARD": forward}
  result = _run_in_subprocess(
      env, "-k",
      "test_cuda_matches_reference or test_deterministic_matches_reference or test_forward_only_matches_reference "
      "or test_forward_splits_o_as_xla_would or test_command_buffer_capture or test_jit_training_step_reduces_loss "
      "or test_poisoned_inputs_on_cuda or test_cuda_kernels_write_every_output_element",
      files=("test_cuda.py", "test_nan_propagation.py"))
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


# By default the plain calls' forward takes FlashAttention-3's wide tiles where they measured
# faster (head dims 64, 192 and 256; gpu/tile_shapes.cuh); each override runs the tiles the
# default does not use somewhere.
@pytest.mark.parametrize("tiles", ["sm90ws_narrow", "sm90ws_wide"])
def test_forward_tile_choices_on_hopper(tiles):
  """The forward with the wide tiles never (sm90ws_narrow: 128 x 128, or 128 x 64 past head dim
  128) or wherever they exist (sm90ws_wide: key blocks of 176 at head dim 128 without a causal
  mask, 192 query rows on three consumer warpgroups at head dim 64, key blocks of 112 and 80 at
  192 and 256) passes the reference cases of those head dims (partial blocks, lengths, GQA,
  T != S among them), the forward's own split of o, the CUDA-graph capture and the training
  step."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_FORWARD": tiles},
      "(test_cuda_matches_reference and (h40 or h64 or h80 or h96 or h111 or h128 or h192 or h256)) or "
      "test_forward_splits_o_as_xla_would or test_command_buffer_capture or "
      "test_jit_training_step_reduces_loss")


# The default backward visits 128-row query blocks at head dims 33..64, adds dQ by bulk row
# reductions at 65..127 and by one bulk reduction a warpgroup into a dQ accumulator in the
# fragments' order at 128 (gpu/tile_shapes.cuh); each override runs 64-row blocks a way the
# default does not use at those head dims (the tiled dQ at 97..127, which run the kernel of 128;
# at 65..96 under JAX_FLASH_CUDA_HD96=padded: test_head_dims_to_96_padded_to_128_on_cuda).
@pytest.mark.parametrize("family, head_dims", [("sm90ws_atomicdq", "h40 or h64 or h80 or h96 or h111 or h128"),
                                               ("sm90ws_tileddq", "h111 or h128"),
                                               ("sm90ws_bulkdq", "h40 or h64 or h128")])
def test_backward_dq_by_the_other_way_on_hopper(family, head_dims):
  """The warp-specialised backward with 64-row query blocks and dQ added a way its default does
  not use at these head dims (atomics from the math warps, or bulk reductions from a shared tile
  by the producer) passes their reference and deterministic cases, the CUDA-graph capture and
  the training step."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_BACKWARD": family},
      f"((test_cuda_matches_reference or test_deterministic_matches_reference) and ({head_dims})) "
      "or test_command_buffer_capture or test_jit_training_step_reduces_loss")


def test_backward_on_80_row_blocks_on_hopper():
  """Experimental: with JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 the plain non-deterministic calls at
  head dim 128 visit 80-row query blocks (dQ computed transposed, dS^T stored query-major, its
  own convert kernel): their reference cases (partial blocks, lengths, windows, causal, GQA,
  T != S), the deterministic ones beside them (64-row kernel, same accumulator), the CUDA-graph
  capture and the training step pass."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_BACKWARD": "sm90ws_m80"},
      "((test_cuda_matches_reference or test_deterministic_matches_reference) and h128) "
      "or test_command_buffer_capture or test_jit_training_step_reduces_loss")


def test_backward_with_deferred_dq_on_hopper():
  """Experimental: with JAX_FLASH_CUDA_BACKWARD=sm90ws_deferdq the plain non-deterministic calls at
  head dim 128 run the tiled backward without the consumers' barrier, each visit's dQ computed
  during the next once the other warpgroup has signalled its dS^T: their reference cases
  (partial blocks, lengths, windows, causal, GQA, T != S), the deterministic ones beside them,
  the CUDA-graph capture and the training step pass."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_BACKWARD": "sm90ws_deferdq"},
      "((test_cuda_matches_reference or test_deterministic_matches_reference) and h128) "
      "or test_command_buffer_capture or test_jit_training_step_reduces_loss")


def test_general_backward_beside_80_row_blocks_on_hopper():
  """Under JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 the calls with a soft cap, ALiBi slopes or segment
  ids at head dim 128 keep the 64-row kernel, on a dQ accumulator sized for both tilings; their
  reference cases pass."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_BACKWARD": "sm90ws_m80"}, "cuda and h128",
      files=("test_softcap.py", "test_alibi.py", "test_segment_ids.py"))


def test_general_backward_on_64_row_blocks_on_hopper():
  """Calls with a soft cap, ALiBi slopes or segment ids at head dims 33..64 take the 128-row
  backward by default (the suite runs them there); on the 64-row one (sm90ws_atomicdq) they pass
  their reference cases too."""
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_BACKWARD": "sm90ws_atomicdq"}, "cuda and (h40 or h64)",
      files=("test_softcap.py", "test_alibi.py", "test_segment_ids.py"))


def test_mma_sync_backward_adds_quad_dq_on_hopper():
  """On Hopper the mma.sync backward adds dQ in the accumulator's quad order (16-byte atomics;
  gpu/dq_accum_layout.cuh), converted back by the quad convert (narrow calls; +12-13% on head dim
  192's mma.sync backward, H200, session 28). Under JAX_FLASH_CUDA_BACKWARD=sm80 every
  head dim takes it (those that are not multiples of 16 keep the row-major order: h40, h111) and
  passes its reference and deterministic cases, the CUDA-graph capture and the training step; so
  do the score variants' cases on its general kernel."""
  selection = "((test_cuda_matches_reference or test_deterministic_matches_reference) and ({})) or {}"
  _run_cuda_tests_on_hopper_with(
      {"JAX_FLASH_CUDA_BACKWARD": "sm80"},
      selection.format("h32 or h40 or h64 or h80 or h96 or h111 or h128 or h256",
                       "test_command_buffer_capture or test_jit_training_step_reduces_loss"))
  _run_cuda_tests_on_hopper_with({"JAX_FLASH_CUDA_BACKWARD": "sm80"}, "cuda",
                                 files=("test_softcap.py", "test_alibi.py", "test_segment_ids.py"))


@pytest.mark.parametrize("kernels", ["sm80", "padded"])
def test_head_dims_to_192_backward_off_their_own_kernels_on_hopper(kernels):
  """On Hopper the backward of head dims 129..192 runs the split wgmma kernels of 192, which the
  suite runs; with JAX_FLASH_CUDA_HD192_BWD=sm80 it runs the mma.sync kernels of 192 (dQ in the
  quad order), as before session 28, and with =padded the split kernels of 256 (columns 192..255
  zero-filled by TMA), as in session 28: the reference and deterministic cases of head dims 136,
  160 and 192 (GQA, MQA, lengths, windows, causal), the CUDA-graph capture, the training step
  and the score variants' cases pass there too."""
  selection = ("((test_cuda_matches_reference or test_deterministic_matches_reference) and (h136 or h160 or h192)) "
               "or test_command_buffer_capture or test_jit_training_step_reduces_loss")
  _run_cuda_tests_on_hopper_with({"JAX_FLASH_CUDA_HD192_BWD": kernels}, selection)
  _run_cuda_tests_on_hopper_with({"JAX_FLASH_CUDA_HD192_BWD": kernels}, "cuda",
                                 files=("test_softcap.py", "test_alibi.py", "test_segment_ids.py"))


def test_split_backward_with_staged_dq_on_hopper():
  """Experimental: with JAX_FLASH_CUDA_BACKWARD=sm90ws_stagedq the split kernels of head dim 256
  (head dims 193..256 on Hopper; 129..192 keep theirs, dQ by atomics) hand dQ off through the stage's Q and dO tiles to bulk reductions into a
  tiled accumulator (sm90/traits.cuh kStageDq): the reference and deterministic cases of head
  dims 160, 192, 200 and 256 (GQA, MQA's head splits, lengths, windows, causal), the CUDA-graph
  capture and the training step pass, and so do the score variants' cases."""
  selection = ("((test_cuda_matches_reference or test_deterministic_matches_reference) and "
               "(h160 or h192 or h200 or h256)) or test_command_buffer_capture or test_jit_training_step_reduces_loss")
  _run_cuda_tests_on_hopper_with({"JAX_FLASH_CUDA_BACKWARD": "sm90ws_stagedq"}, selection)
  _run_cuda_tests_on_hopper_with({"JAX_FLASH_CUDA_BACKWARD": "sm90ws_stagedq"}, "cuda",
                                 files=("test_softcap.py", "test_alibi.py", "test_segment_ids.py"))


def test_backward_in_grid_order_on_cuda():
  """With JAX_FLASH_CUDA_ORDER=grid the causal backward's CTAs start in the grid's own order
  (each head's key blocks one after another) instead of longest key blocks first, as before
  session 23; its causal reference and deterministic cases pass (on Hopper the wgmma kernels,
  elsewhere the mma.sync ones)."""
  result = _run_in_subprocess({"JAX_FLASH_CUDA_ORDER": "grid"}, "-k",
                              "(test_cuda_matches_reference or test_deterministic_matches_reference) and causal")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_head_dims_to_96_padded_to_128_on_cuda():
  """With JAX_FLASH_CUDA_HD96=padded head dims 65..96 run the kernels of head dim 128 (their
  inputs zero-padded by TMA), as before session 23, where the default runs those of 96; their
  reference and deterministic cases, and the tiled dQ's (sm90ws_tileddq) then taking them on
  Hopper, pass."""
  selection = "(test_cuda_matches_reference or test_deterministic_matches_reference) and (h80 or h96)"
  result = _run_in_subprocess({"JAX_FLASH_CUDA_HD96": "padded"}, "-k", selection)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  _run_cuda_tests_on_hopper_with({"JAX_FLASH_CUDA_HD96": "padded", "JAX_FLASH_CUDA_BACKWARD": "sm90ws_tileddq"},
                                 selection)


def test_narrow_calls_unsplit_on_cuda():
  """With JAX_FLASH_CUDA_NARROW=off, narrow calls (rows of at most 16 keys, or at most 64 x 64
  scores a head) run as any other call (16-bit P and dS, o's int8 residual for delta) and still
  pass the reference cases (the accuracy rule's misses on rows of 1-3 keys are the differential
  run's to find: test_differential.py)."""
  result = _run_in_subprocess({"JAX_FLASH_CUDA_NARROW": "off"}, "-k", "test_cuda_matches_reference")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


# Set in the processes test_forward_of_more_tiles_than_sms starts for its own case.
MANY_TILES_PROCESS = "JAX_FLASH_TESTS_MANY_TILES_PROCESS"


@pytest.mark.parametrize("grid", [None, "static", "dynamic"], ids=["default", "static", "dynamic"])
def test_forward_of_more_tiles_than_sms(grid):
  """A forward of 640 query tiles (more than an H100's or H200's SMs: the persistent CTAs take
  several each) with the default kernels and under each persistent grid, causal and not, against
  the reference; the tile rows past T = 70 leave the second consumer warpgroup little to do, as
  where session 35's arrays' kernel hung, and every forward under each grid did while the
  consumers' turns restarted at each tile (session 38; sm90/flash_fwd_ws_kernel.cuh). Each in a
  process with a timeout, so that a hang fails this test instead of holding the suite."""
  if grid is not None and not _on_hopper():
    pytest.skip("the tile grids are Hopper's")
  env = {MANY_TILES_PROCESS: "1", **({"JAX_FLASH_CUDA_FWD_GRID": grid} if grid else {})}
  gpu_tests_in_a_process(__file__, "test_forward_of_more_tiles_than_sms_here", env, timeout_s=240)


def test_forward_of_more_tiles_than_sms_here():
  """(Run by test_forward_of_more_tiles_than_sms, in a process of its own.)"""
  if os.environ.get(MANY_TILES_PROCESS) != "1":
    pytest.skip("runs in test_forward_of_more_tiles_than_sms's processes")
  keys = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(keys[0], (4, 70, 160, 64), jnp.bfloat16)
  k, v = (jax.random.normal(key, (4, 150, 32, 64), jnp.bfloat16) for key in keys[1:])
  for causal in (False, True):
    got = jax_flash.dot_product_attention(q, k, v, is_causal=causal, implementation="cuda")
    want = jax_flash.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=causal,
                                           implementation="xla")
    assert np.abs(np.asarray(got, np.float32) - np.asarray(want)).max() < 2e-2, causal


def test_split_kv_decoding_on_cuda():
  """The experimental split-KV program around the CUDA forward (JAX_FLASH_CUDA_DECODE=split:
  pack-GQA and key chunks for calls without causal mask or window) passes the reference cases,
  the decode steps among them."""
  result = _run_in_subprocess({"JAX_FLASH_CUDA_DECODE": "split"}, "-k", "test_cuda_matches_reference")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("variable, value", [("JAX_FLASH_CUDA_FORWARD", "sm90-pipelind"),
                                             ("JAX_FLASH_CUDA_ORDER", "longst"),
                                             ("JAX_FLASH_CUDA_HD96", "nativ"),
                                             ("JAX_FLASH_CUDA_HD192_BWD", "pad"),
                                             ("JAX_FLASH_CUDA_VALUE_HEAD_DIM", "nativ"),
                                             ("JAX_FLASH_CUDA_DECODE_LOADS", "evict"),
                                             ("JAX_FLASH_CUDA_BIAS_LOADS", "stage"),
                                             ("JAX_FLASH_CUDA_FWD_GRID", "pertile"),
                                             ("JAX_FLASH_CUDA_FWD_ROWS", "ends"),
                                             ("JAX_FLASH_CUDA_FWD_UNSEEN", "skipped"),
                                             ("JAX_FLASH_CUDA_FWD_STORES", "vector"),
                                             ("JAX_FLASH_CUDA_FORWARD", "sm90ws_static")])
def test_unknown_kernel_choice_is_an_error(variable, value):
  """A misspelt override (or a removed one: sm90ws_static is JAX_FLASH_CUDA_FWD_GRID=static since
  session 43) is reported by name, not ignored."""
  result = _run_in_subprocess({variable: value}, "-k", "test_cuda_is_default_on_gpu")
  assert result.returncode != 0
  assert f"{variable}={value} is not one of" in result.stdout + result.stderr
