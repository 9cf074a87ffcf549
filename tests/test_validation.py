"""Every argument error: raised at trace time, with a message that names the argument and the
shapes or values involved."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from attention_testing import reference_f32, random_array, simulate_cuda_host


def pattern(*fragments: str) -> str:
  """A regex matching the literal fragments, in order, anywhere in the message."""
  return ".*".join(re.escape(f) for f in fragments)


def arrays(rng, q_shape, k_shape, v_shape=None, dtypes=("float32",) * 3):
  v_shape = k_shape if v_shape is None else v_shape
  return tuple(random_array(rng, s, jnp.dtype(d)) for s, d in zip((q_shape, k_shape, v_shape),
                                                                  dtypes))


IMPLEMENTATIONS = ["cpu", "xla", "blockwise", None]

SHAPE_ERRORS = [
    # (id, q shape, k shape, v shape, fragments of the message)
    ("rank2", (8, 16), (8, 16), None,
     ("rank 4", "rank 3", "query(8, 16), key(8, 16), value(8, 16)")),
    ("rank5", (1, 2, 8, 4, 16), (1, 2, 8, 4, 16), None,
     ("rank 4", "query(1, 2, 8, 4, 16)")),
    ("rank_mismatch", (2, 8, 4, 16), (8, 4, 16), None,
     ("rank 4", "query(2, 8, 4, 16), key(8, 4, 16), value(8, 4, 16)")),
    ("value_rank_mismatch", (2, 8, 4, 16), (2, 8, 4, 16), (8, 4, 16),
     ("rank", "value(8, 4, 16)")),
    ("batch_mismatch", (2, 8, 4, 16), (3, 8, 4, 16), None,
     ("same batch size", "query(2, 8, 4, 16), key(3, 8, 4, 16)")),
    ("head_dim_mismatch", (2, 8, 4, 16), (2, 8, 4, 32), None,
     ("same head dim H", "query(2, 8, 4, 16), key(2, 8, 4, 32)")),
    ("heads_not_multiple", (2, 8, 6, 16), (2, 8, 4, 16), None,
     ("N=6", "multiple", "K=4", "query(2, 8, 6, 16), key(2, 8, 4, 16)")),
    ("kv_shape_mismatch", (2, 8, 4, 16), (2, 8, 4, 16), (2, 9, 4, 16),
     ("key and value must have the same shape", "key(2, 8, 4, 16), value(2, 9, 4, 16)")),
    ("kv_heads_mismatch", (2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 4, 16),
     ("key and value must have the same shape", "key(2, 8, 2, 16), value(2, 8, 4, 16)")),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("q_shape,k_shape,v_shape,fragments",
                         [e[1:] for e in SHAPE_ERRORS], ids=[e[0] for e in SHAPE_ERRORS])
def test_shape_errors(rng, q_shape, k_shape, v_shape, fragments, implementation):
  q, k, v = arrays(rng, q_shape, k_shape, v_shape)
  with pytest.raises(ValueError, match=pattern(*fragments)):
    jax_flash.dot_product_attention(q, k, v, implementation=implementation)


def test_errors_are_raised_at_trace_time_under_jit(rng):
  q, k, v = arrays(rng, (2, 8, 6, 16), (2, 8, 4, 16))
  f = jax.jit(jax_flash.dot_product_attention)
  with pytest.raises(ValueError, match=pattern("N=6", "K=4")):
    f.lower(q, k, v)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtypes,fragments", [
    (("float32", "bfloat16", "float32"), ("share one dtype", "query float32", "key bfloat16",
                                          "value float32")),
    (("float16", "float16", "bfloat16"), ("share one dtype", "value bfloat16")),
    (("int32",) * 3, ("query, key and value must be float32, bfloat16 or float16",
                      "got int32")),
    (("float8_e4m3fn",) * 3, ("query, key and value must be float32, bfloat16 or float16",
                              "got float8_e4m3fn")),
], ids=["mixed_qk", "mixed_v", "int32", "float8"])
def test_dtype_errors(rng, dtypes, fragments, implementation):
  q, k, v = arrays(rng, (2, 8, 4, 16), (2, 8, 4, 16), dtypes=dtypes)
  with pytest.raises(ValueError, match=pattern(*fragments)):
    jax_flash.dot_product_attention(q, k, v, implementation=implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_float64_is_rejected(implementation):
  with jax.enable_x64(True):
    q = jnp.ones((2, 8, 4, 16), jnp.float64)
    assert q.dtype == jnp.float64
    with pytest.raises(ValueError, match=pattern("query, key and value must be float32",
                                                 "got float64")):
      jax_flash.dot_product_attention(q, q, q, implementation=implementation)


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
@pytest.mark.parametrize("lengths,fragments", [
    (np.array([8, 8, 8], np.int32), ("must have shape (2,)", "got (3,)")),
    (np.array([[8, 8]], np.int32), ("must have shape (2,)", "got (1, 2)")),
    (np.int32(8), ("must have shape (2,)", "got ()")),
    (np.array([8.0, 4.0], np.float32), ("must be an integer array", "got float32")),
    (np.array([True, False]), ("must be an integer array", "got bool")),
], ids=["too_long", "rank2", "scalar", "float", "bool"])
def test_seq_length_errors(rng, name, lengths, fragments):
  q, k, v = arrays(rng, (2, 8, 4, 16), (2, 8, 4, 16))
  with pytest.raises(ValueError, match=pattern(name, *fragments)):
    jax_flash.dot_product_attention(q, k, v, **{name: lengths})


def test_seq_lengths_of_rank3_inputs_have_one_entry(rng):
  q, k, v = arrays(rng, (8, 4, 16), (8, 4, 16))
  with pytest.raises(ValueError, match=pattern("key_value_seq_lengths", "(1,)", "got (2,)")):
    jax_flash.dot_product_attention(q, k, v, key_value_seq_lengths=np.array([8, 8], np.int32))
  jax_flash.dot_product_attention(q, k, v, key_value_seq_lengths=np.array([5], np.int32))


@pytest.mark.parametrize("window,fragments", [
    (-1, (">= 0 on both sides", "(-1, -1)")),
    ((3, -2), (">= 0 on both sides", "(3, -2)")),
    ((-5, 0), (">= 0 on both sides", "(-5, 0)")),
    ((1, 2, 3), ("int or a (left, right) pair of ints", "(1, 2, 3)")),
    ((4,), ("int or a (left, right) pair of ints", "(4,)")),
    (2.5, ("int or a (left, right) pair of ints", "2.5")),
    ((1.0, 2), ("int or a (left, right) pair of ints", "(1.0, 2)")),
    ("3", ("int or a (left, right) pair of ints", "'3'")),
], ids=["negative_int", "negative_right", "negative_left", "3_tuple", "1_tuple", "float",
        "float_in_pair", "string"])
def test_window_errors(rng, window, fragments):
  q, k, v = arrays(rng, (2, 8, 4, 16), (2, 8, 4, 16))
  with pytest.raises(ValueError, match=pattern("local_window_size", *fragments)):
    jax_flash.dot_product_attention(q, k, v, local_window_size=window)


@pytest.mark.parametrize("implementation", ["cudnn", "CPU", "pallas", ""])
def test_unknown_implementation(rng, implementation):
  q, k, v = arrays(rng, (2, 8, 4, 16), (2, 8, 4, 16))
  with pytest.raises(ValueError, match=pattern("implementation must be one of",
                                               f"got {implementation!r}")):
    jax_flash.dot_product_attention(q, k, v, implementation=implementation)


def test_cuda_without_a_cuda_gpu(rng):
  """implementation="cuda" where it cannot run (no CUDA kernels built, or JAX sees no CUDA GPU)
  is a ValueError at trace time, never a fallback."""
  try:
    has_gpu = bool(jax.devices("cuda"))
  except RuntimeError:
    has_gpu = False
  if has_gpu and jax_flash.has_platform("cuda"):
    pytest.skip("this host can run the CUDA kernels")
  q, k, v = arrays(rng, (2, 8, 4, 16), (2, 8, 4, 16), dtypes=("bfloat16",) * 3)
  with pytest.raises(ValueError, match=pattern("implementation='cuda'", "use implementation=")):
    jax_flash.dot_product_attention(q, k, v, implementation="cuda")
  with pytest.raises(ValueError, match=pattern("implementation='cuda'")):
    jax.jit(lambda q: jax_flash.dot_product_attention(q, k, v, implementation="cuda")).lower(q)


def test_head_dim_above_kernel_limit(rng):
  q, k, v = arrays(rng, (1, 5, 2, 257), (1, 7, 1, 257))
  for implementation in ("cpu", None):
    with pytest.raises(ValueError, match=pattern("H=257", "'cpu'", "H <= 256",
                                                 "implementation='blockwise'")):
      jax_flash.dot_product_attention(q, k, v, implementation=implementation)
  # The XLA paths take any head dim.
  want = reference_f32(q, k, v, is_causal=True)
  for implementation in ("xla", "blockwise"):
    out = jax_flash.dot_product_attention(q, k, v, implementation=implementation, is_causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
  # 256 itself is fine for the kernel.
  q, k, v = arrays(rng, (1, 5, 2, 256), (1, 7, 1, 256))
  jax_flash.dot_product_attention(q, k, v, implementation="cpu")


def test_errors_name_the_shapes_of_unbatched_inputs(rng):
  """Rank-3 inputs gain a batch dim inside jax_flash; the messages keep the shapes as passed."""
  q, k, v = arrays(rng, (5, 2, 257), (7, 1, 257))
  with pytest.raises(ValueError, match=pattern("H=257 (query(5, 2, 257))")):
    jax_flash.dot_product_attention(q, k, v, implementation="cpu")
  q, k, v = arrays(rng, (8, 4, 16), (8, 4, 16))
  with pytest.raises(ValueError, match=pattern("broadcastable", "got bias(3, 8, 8)")):
    jax_flash.dot_product_attention(q, k, v, np.zeros((3, 8, 8), np.float32),
                                    implementation="xla")


@pytest.mark.parametrize("implementation", ["cuda", None])
def test_bias_and_mask_need_cpu_or_an_xla_path_on_cuda(rng, monkeypatch, implementation):
  """The CUDA kernels take no bias or mask arrays by default (experimental under
  JAX_FLASH_CUDA_LOGIT_ARRAYS=on, unset here): asking for them there (or with None, which picks
  them for bfloat16 on a GPU host) says what to use, never falls back silently.
  (The "cpu" kernel takes them: tests/test_bias_mask_kernel.py.)"""
  simulate_cuda_host(monkeypatch)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q, k, v = arrays(rng, (2, 8, 4, 16), (2, 8, 4, 16), dtypes=("bfloat16",) * 3)
  with pytest.raises(NotImplementedError, match=pattern("'cuda' kernels", "bias(2, 4, 8, 8)",
                                                        "implementation='blockwise'")):
    jax_flash.dot_product_attention(q, k, v, jnp.zeros((2, 4, 8, 8)),
                                    implementation=implementation)
  with pytest.raises(NotImplementedError, match=pattern("got mask(8, 8)", "is_causal")):
    jax_flash.dot_product_attention(q[0], k[0], v[0], mask=jnp.ones((8, 8), bool),
                                    implementation=implementation)


@pytest.mark.parametrize("name, value, fragments", [
    ("bias", np.zeros((2, 4, 8, 8, 1), np.float32), ("bias", "at most 4 dims", "(2, 4, 8, 8)")),
    ("bias", np.zeros((2, 3, 8, 8), np.float32), ("bias", "broadcastable", "bias(2, 3, 8, 8)")),
    ("bias", np.zeros((8, 7), np.float32), ("bias", "broadcastable", "bias(8, 7)")),
    ("bias", np.zeros((8, 8), np.int32), ("bias must be a float array", "int32")),
    ("mask", np.ones((2, 4, 8, 8), np.float32), ("mask must be a bool array", "float32")),
    ("mask", np.ones((3, 1, 1, 8), bool), ("mask", "broadcastable", "mask(3, 1, 1, 8)")),
])
def test_bias_and_mask_shapes(rng, name, value, fragments):
  q, k, v = arrays(rng, (2, 8, 4, 16), (2, 8, 2, 16))
  with pytest.raises(ValueError, match=pattern(*fragments)):
    jax_flash.dot_product_attention(q, k, v, **{name: value}, implementation="blockwise")


def test_traced_scale_under_jit(rng):
  q, k, v = arrays(rng, (2, 8, 4, 16), (2, 8, 4, 16))
  f = jax.jit(lambda q, k, v, s: jax_flash.dot_product_attention(q, k, v, scale=s))
  with pytest.raises(ValueError, match=pattern("scale", "concrete Python number")):
    f(q, k, v, 0.5)
  # A concrete (static) scale under jit is fine.
  jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, scale=0.5))(q, k, v)


@pytest.mark.parametrize("scale,fragments", [
    (float("nan"), ("scale must be finite", "nan")),
    (float("inf"), ("scale must be finite", "inf")),
    ("0.5x", ("scale must be a real number", "'0.5x'")),
    (None.__class__, ("scale must be a real number",)),
], ids=["nan", "inf", "string", "type"])
def test_bad_scale(rng, scale, fragments):
  # "string" fails on jax_flash 0.1.0: float("0.5x") raises ValueError("could not convert string
  # to float: '0.5x'"), which check_scale does not catch (it catches TypeError only), so the
  # message does not name `scale`.
  q, k, v = arrays(rng, (2, 8, 4, 16), (2, 8, 4, 16))
  with pytest.raises(ValueError, match=pattern(*fragments)):
    jax_flash.dot_product_attention(q, k, v, scale=scale)


@pytest.mark.parametrize("implementation", ["cpu", "xla", "blockwise"])
def test_zero_head_dim(rng, implementation):
  """H = 0: an empty result or a ValueError naming the head dim would both do.

  Fails on jax_flash 0.1.0: the default scale 1 / sqrt(H) raises a bare ZeroDivisionError
  ("float division by zero") in _validation.check_scale."""
  q, k, v = arrays(rng, (2, 8, 4, 0), (2, 8, 4, 0))
  try:
    out = jax_flash.dot_product_attention(q, k, v, implementation=implementation)
  except ValueError as e:
    assert "H=0" in str(e) or "head dim" in str(e), str(e)
  else:
    assert out.shape == q.shape
