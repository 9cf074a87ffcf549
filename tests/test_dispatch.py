"""The dispatch layer (jax_flash._dispatch) and the op layer around the kernels (jax_flash._ops):
one resolution and one set of capability checks for every entry point, the head dim padded and
the scale made positive for every entry point, the kernels' constants read from the native
module. No GPU here: a GPU host is simulated where the rule depends on one."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _dispatch, _native, _ops, _registry
from jax_flash._reference import EMPTY_ROW_LSE
from attention_testing import SIMULATED_CUDA_CONSTANTS, ffi_calls, random_array, reference_f32

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


@pytest.fixture
def gpu_host(monkeypatch):
  """A host whose default backend is an NVIDIA GPU with jax_flash's CUDA kernels built (nothing
  runs on it: the tests only ask what would run, or run the XLA paths on the CPU)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(_registry, "has_platform", lambda platform: platform in ("cpu", "cuda"))
  monkeypatch.setattr(_registry, "cuda_gpu_present", lambda: True)
  monkeypatch.setattr(_registry, "CUDA_KERNEL_CONSTANTS", dict(SIMULATED_CUDA_CONSTANTS))


def call(shape=(2, 8, 4, 16), dtype=F32, **kwargs) -> _dispatch.Call:
  return _dispatch.Call(tuple(shape), jnp.dtype(dtype), **kwargs)


# ---------------------------------------------------------------------------------------------
# What each implementation states


def test_each_implementation_states_what_it_supports():
  cpu, xla, blockwise = (_dispatch.capabilities(n) for n in ("cpu", "xla", "blockwise"))
  assert cpu.kernel and not xla.kernel and not blockwise.kernel
  assert cpu.max_head_dim == _native.kernel_constants()["max_head_dim"]
  assert xla.max_head_dim is None and blockwise.max_head_dim is None
  assert cpu.logit_arrays and xla.logit_arrays and blockwise.logit_arrays
  assert not _dispatch.capabilities("cuda").logit_arrays  # not yet (issue 16 item 3)
  assert cpu.ring and not xla.ring and not blockwise.ring
  assert {F32, BF16} <= cpu.dtypes
  for name in ("cpu", "xla", "blockwise"):
    assert _dispatch.capabilities(name).mask_forms == _dispatch.MASK_FORMS
  with pytest.raises(ValueError, match="no implementation named 'cudnn'"):
    _dispatch.capabilities("cudnn")


def test_cuda_states_its_limits_from_its_native_module(gpu_host):
  cuda = _dispatch.capabilities("cuda")
  assert F32 not in cuda.dtypes and BF16 in cuda.dtypes
  assert cuda.max_head_dim == SIMULATED_CUDA_CONSTANTS["max_head_dim"]
  assert cuda.head_dim_multiple == SIMULATED_CUDA_CONSTANTS["head_dim_multiple"]


@pytest.mark.parametrize("dtype,want", [(F32, "blockwise"), (BF16, "cuda"),
                                        (jnp.dtype(jnp.float16), "cuda")])
def test_none_resolves_by_backend_and_dtype(gpu_host, dtype, want):
  assert _dispatch.select(None, call(dtype=dtype)) == want


def test_none_on_the_host_is_the_cpu_kernel():
  if jax.default_backend() != "cpu":
    pytest.skip("a CPU host")
  assert _dispatch.select(None, call()) == "cpu"
  assert _dispatch.select(None, call(dtype=BF16)) == "cpu"


def test_select_errors_name_the_caller_the_option_and_the_shapes(gpu_host):
  with pytest.raises(NotImplementedError, match=re.escape(
      "jax_flash.ring_attention: jax_flash's 'cuda' kernels take bfloat16 or float16; for "
      "float32 inputs (query(2, 8, 4, 16))")):
    _dispatch.select("cuda", call(ring=True), caller="jax_flash.ring_attention")
  with pytest.raises(NotImplementedError, match="implementation=None picks 'blockwise'.*cast"):
    _dispatch.select(None, call(ring=True), caller="jax_flash.ring_attention")
  with pytest.raises(NotImplementedError,
                     match=r"'cuda' kernels \(implementation=None picks 'cuda' here\).*mask\(8, 8\)"):
    _dispatch.select(None, call(dtype=BF16, mask=(8, 8)))
  with pytest.raises(ValueError, match=re.escape("H=300 (query(8, 4, 300))")):
    _dispatch.select("cuda", call((8, 4, 300), BF16))
  with pytest.raises(NotImplementedError, match="my advice"):
    _dispatch.select("cuda", call(dtype=BF16, bias=(4, 8, 8)), mask_advice="my advice")
  assert _dispatch.select("cpu", call(bias=(4, 8, 8), mask=(8, 8))) == "cpu"
  assert _dispatch.select(None, call(bias=(4, 8, 8), mask=(8, 8))) == "blockwise"


# ---------------------------------------------------------------------------------------------
# Every entry point asks the same rule


def test_flax_and_the_core_api_agree_on_a_gpu(gpu_host, rng):
  """float32 on a GPU runs the blockwise path, which takes masks: the Flax function used to
  refuse a mask there before the implementation was resolved, while the core API took it. Now
  both take it, and both refuse it on the CUDA kernels (16-bit inputs)."""
  jflax = pytest.importorskip("jax_flash.flax")
  q = random_array(rng, (2, 9, 4, 16), F32)
  k, v = random_array(rng, (2, 11, 2, 16), F32), random_array(rng, (2, 11, 2, 16), F32)
  mask = jnp.asarray(rng.random((9, 11)) < 0.6).at[:, 0].set(True)
  core = jax_flash.dot_product_attention(q, k, v, mask=mask)
  flax_out = jflax.dot_product_attention(q, k, v, mask=mask)
  np.testing.assert_array_equal(np.asarray(flax_out), np.asarray(core))
  np.testing.assert_allclose(np.asarray(core), np.asarray(reference_f32(q, k, v, mask=mask)),
                             rtol=1e-5, atol=1e-5)
  for fn in (jax_flash.dot_product_attention, jflax.dot_product_attention):
    with pytest.raises(NotImplementedError, match=r"'cuda' kernels.*mask\(9, 11\)"):
      fn(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask=mask)


# ---------------------------------------------------------------------------------------------
# The op layer: padding, scale


@pytest.mark.parametrize("head_dim,pad", [(8, 0), (40, 0), (111, 1), (65, 7), (1, 7), (256, 0)])
def test_cuda_head_dim_padding(gpu_host, head_dim, pad):
  assert _ops.head_dim_padding("cuda", head_dim) == pad
  assert _ops.head_dim_padding("cpu", head_dim) == 0  # the CPU kernel aligns its own tiles


def test_call_kernels_pads_and_makes_the_scale_positive(gpu_host, rng):
  """What every entry point gets around its kernels, checked with a stand-in for them (the plain
  reference): the kernels see a padded head dim and a positive scale; the caller sees neither,
  in the output or in the gradients."""
  q, k, v = (random_array(rng, (1, 6, 2, 111), F32) for _ in range(3))
  lens = jnp.full((1,), 6, jnp.int32)
  seen = []

  def stand_in(q, k, v, q_lens, kv_lens, config):
    seen.append((q.shape[-1], config.scale))
    return jax_flash._reference.attention_reference(
        q, k, v, q_lens, kv_lens, scale=config.scale, is_causal=config.is_causal)

  def loss(q, k, v, run):
    out, _ = run(q, k, v)
    return jnp.sum(out * jnp.arange(out.size).reshape(out.shape) / out.size), out

  def via_ops(q, k, v):
    return _ops.call_kernels(stand_in, q, k, v, lens, lens, implementation="cuda", scale=-0.3,
                             is_causal=True)

  def direct(q, k, v):
    return jax_flash._reference.attention_reference(q, k, v, lens, lens, scale=-0.3,
                                                    is_causal=True)

  (got, got_out), got_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      q, k, v, via_ops)
  (want, want_out), want_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      q, k, v, direct)
  assert seen and all(s == (112, 0.3) for s in seen), seen
  assert got_out.shape == q.shape
  np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-6, atol=1e-6)
  for a, b in zip(got_grads, want_grads):
    assert a.shape == q.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Constants from the native modules


def test_constants_come_from_the_native_module():
  constants = _native.kernel_constants()
  assert _registry.KERNEL_CONSTANTS == constants
  assert EMPTY_ROW_LSE == constants["empty_row_lse"] == float(np.finfo(np.float32).min)
  assert constants["max_head_dim"] == 256
  # The workspace the CPU handler checks: one float32 partial per split, head dim aligned.
  align = constants["cpu_head_dim_align"]
  assert _registry.cpu_dq_accum_elements(3, 2, 17, 4, 40) == 3 * 2 * 17 * 4 * (-(-40 // align) * align)


def ffi_result_shapes(fn, *args) -> list[tuple[tuple[int, ...], ...]]:
  """The result shapes of every ffi_call that tracing fn(*args) binds (nothing is lowered)."""
  return [tuple(tuple(x.shape) for x in results) for *_, results in ffi_calls(fn, *args)]


def test_cuda_workspace_size_comes_from_the_cuda_module(gpu_host, monkeypatch):
  """The CUDA backward's workspace is sized by _native_cuda.dq_accum_elements (a stand-in
  module here: no CUDA kernels are built on this machine) from the call's whole shape (the
  Hopper backward's head splits add dK's and dV's accumulators where the kv heads are few); its
  results are dq, dk, dv, that workspace (delta is an operand, formed by XLA) and dbias ((0,)
  float32 without a bias)."""
  asked = []

  def dq_accum_elements(batch, seq_q, seq_k, heads_q, heads_k, head_dim, head_dim_v, deterministic):
    asked.append((batch, seq_q, seq_k, heads_q, heads_k, head_dim, head_dim_v, deterministic))
    return 12345

  fake = types.SimpleNamespace(dq_accum_elements=dq_accum_elements, narrow_split_call=lambda *args: False)
  monkeypatch.setattr(_registry, "_native_cuda", fake)
  q = jnp.zeros((2, 8, 4, 16), jnp.bfloat16)
  k = jnp.zeros((2, 8, 2, 16), jnp.bfloat16)
  lse = jnp.zeros((2, 4, 8), jnp.float32)
  lens = jnp.full((2,), 8, jnp.int32)
  for deterministic in (False, True):
    config = _ops.KernelConfig("cuda", 0.25, True, -1, -1, deterministic)
    shapes = ffi_result_shapes(
        lambda q, k: _ops.flash_bwd(q, k, k, q, lse, q, lens, lens, config), q, k)
    assert shapes == [((2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16), (12345,), (0,))]
  assert asked == [(2, 8, 8, 4, 2, 16, 16, False), (2, 8, 8, 4, 2, 16, 16, True)]


def test_cpu_workspace_size_comes_from_the_native_module(monkeypatch):
  monkeypatch.setattr(_registry, "cpu_dq_accum_elements", lambda *args: 777)
  q = jnp.zeros((2, 8, 4, 16), jnp.float32)
  lse = jnp.zeros((2, 4, 8), jnp.float32)
  lens = jnp.full((2,), 8, jnp.int32)
  config = _ops.KernelConfig("cpu", 0.25, True, -1, -1)
  shapes = ffi_result_shapes(lambda q: _ops.flash_bwd(q, q, q, q, lse, q, lens, lens, config), q)
  assert shapes[0][4] == (777,)  # (then dbias and its workspace: (0,) without a bias)
  assert shapes[0][5:] == ((0,), (0,))
