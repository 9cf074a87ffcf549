"""Split-KV decoding on the CPU kernel (issue 15, item 1): dot_product_attention with a few
query rows per kv head runs the decode kernel (pack-GQA, key chunks, combine), with the tiled
forward's semantics and the usual backward.

Every case is checked with the rule of attention_testing (out, lse, dq, dk, dv against the
float32 reference, 2x the input dtype's own error), the choice of kernel is asserted (the rule
and the custom call in the lowered program), the combine is checked for chunk counts 1..many
against the tiled forward, and a decode step against the full causal forward at its position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_flash
from attention_testing import (Case, assert_within_rule, check_against_references,
                               random_array, references, row_has_keys, run_jax_flash)
from jax_flash import _decode, _ops
from jax_flash._reference import EMPTY_ROW_LSE

C = Case
CASES = [
    # T = 1: one decode step; GQA (group 4), MQA, MHA; ragged lengths with an empty sequence.
    C(batch=3, seq_q=1, seq_k=700, heads_q=8, heads_k=2, head_dim=64, kv_lens=(700, 0, 129)),
    C(batch=2, seq_q=1, seq_k=1000, heads_q=8, heads_k=1, head_dim=128, dtype="bfloat16",
      kv_lens=(1, 999)),
    C(batch=2, seq_q=1, seq_k=300, heads_q=4, heads_k=4, head_dim=40, dtype="float16"),
    # T = 2 and 4 (speculative decoding): causal is top-left (query i sees keys j <= i), windows,
    # query lengths.
    C(batch=2, seq_q=2, seq_k=520, heads_q=8, heads_k=2, head_dim=80, is_causal=True,
      return_residual=True),
    C(batch=2, seq_q=4, seq_k=777, heads_q=16, heads_k=2, head_dim=96, dtype="bfloat16",
      local_window_size=(300, 2), kv_lens=(600, 777)),
    C(batch=3, seq_q=4, seq_k=333, heads_q=4, heads_k=1, head_dim=256, q_lens=(4, 1, 0),
      kv_lens=(333, 200, 50)),
    C(batch=1, seq_q=2, seq_k=1100, heads_q=6, heads_k=3, head_dim=111, dtype="float16",
      rank3=True, local_window_size=5, return_residual=True),
    # 64 packed rows exactly (T * group == cpu_block_q).
    C(batch=1, seq_q=4, seq_k=500, heads_q=32, heads_k=2, head_dim=32, kv_lens=(431,)),
]


def _uses_decode(case: Case, **extra) -> bool:
  q, k, v, _ = case.inputs()
  call = functools.partial(jax_flash.dot_product_attention, implementation="cpu",
                           **case.options(), **extra)
  return "jax_flash_cpu_decode" in jax.jit(call).lower(q, k, v).as_text()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_decode_matches_the_reference(case):
  assert _decode.kv_splits("cpu", case.batch, case.seq_q, case.heads_q, case.heads_k,
                           case.seq_k) >= 1
  assert _uses_decode(case)
  check_against_references(case, run_jax_flash(case, "cpu"))


def test_the_rule():
  block_q = jax_flash._registry.KERNEL_CONSTANTS["cpu_block_q"]
  assert block_q == _decode.block_q() == 64
  # T * group <= 64: the decode kernel; above, the tiled forward (CUDA's rule and its chunks:
  # tests/test_cuda_decode.py).
  assert _decode.kv_splits("cpu", 64, 1, 32, 8, 8192) >= 1
  assert _decode.kv_splits("cpu", 4, 16, 32, 8, 8192) >= 1  # 16 x 4 = 64 rows
  assert _decode.kv_splits("cpu", 4, 17, 32, 8, 8192) == 0
  assert _decode.kv_splits("cpu", 4, 512, 32, 8, 8192) == 0  # chunked prefill: tiled
  assert _decode.kv_splits("cuda", 4, 512, 32, 8, 8192) == 0
  assert _decode.kv_splits("blockwise", 64, 1, 32, 8, 8192) == 0
  # Chunks: cover the cores twice, at least MIN_CHUNK_KEYS keys each, at most MAX_SPLITS.
  assert _decode.kv_splits("cpu", 1, 1, 8, 1, 8192, cores=16) == 32
  assert _decode.kv_splits("cpu", 1, 1, 8, 1, 1000, cores=16) == 4  # ceil(1000 / 256)
  assert _decode.kv_splits("cpu", 1, 1, 8, 1, 10**6, cores=1000) == _decode.MAX_SPLITS
  assert _decode.kv_splits("cpu", 64, 1, 32, 8, 8192, cores=16) == 1  # 512 tasks already
  assert _decode.kv_splits("cpu", 1, 1, 8, 1, 17, cores=16) == 1


def test_tiled_forward_above_the_threshold():
  case = C(batch=1, seq_q=17, seq_k=300, heads_q=8, heads_k=2, head_dim=32)  # 68 rows
  assert not _uses_decode(case)
  case = C(batch=1, seq_q=16, seq_k=300, heads_q=8, heads_k=2, head_dim=32)  # 64 rows
  assert _uses_decode(case)


def _kernel_config(scale, splits, **mask):
  return _ops.KernelConfig("cpu", scale, mask.get("is_causal", False),
                           mask.get("window_left", -1), mask.get("window_right", -1),
                           kv_splits=splits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mask", [{}, dict(is_causal=True), dict(window_left=200, window_right=1)],
                         ids=["full", "causal", "window"])
def test_combine_is_exact_for_any_chunk_count(dtype, mask):
  """The decode kernel forced to 1..many chunks (more chunks than key blocks too) against the
  tiled forward (kv_splits=0) on the same inputs: the same results up to float32 rounding of the
  combine, empty rows exactly 0 and EMPTY_ROW_LSE."""
  rng = np.random.default_rng(0)
  b, t, n, k_heads, h, s = 3, 3, 8, 2, 48, 650
  q = random_array(rng, (b, t, n, h), jnp.dtype(dtype))
  k = random_array(rng, (b, s, k_heads, h), jnp.dtype(dtype))
  v = random_array(rng, (b, s, k_heads, h), jnp.dtype(dtype))
  q_lens = jnp.array([3, 2, 3], jnp.int32)
  kv_lens = jnp.array([650, 100, 0], jnp.int32)
  scale = 1 / np.sqrt(h)
  o0, lse0 = jax.jit(_ops.flash_fwd, static_argnums=5)(q, k, v, q_lens, kv_lens,
                                                        _kernel_config(scale, 0, **mask))
  o0, lse0 = np.asarray(o0, np.float32), np.asarray(lse0)
  for splits in (1, 2, 3, 5, 11, 64, 200):
    o, lse = jax.jit(_ops.flash_fwd, static_argnums=5)(q, k, v, q_lens, kv_lens,
                                                        _kernel_config(scale, splits, **mask))
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    tol = 2e-6 if dtype == "float32" else 1e-2  # bf16: o rounded once, from slightly other f32
    np.testing.assert_allclose(o, o0, atol=tol, rtol=tol, err_msg=f"splits={splits}")
    np.testing.assert_allclose(lse, lse0, atol=2e-6, rtol=2e-6, err_msg=f"splits={splits}")
    assert np.all(o[2] == 0) and np.all(lse[2] == EMPTY_ROW_LSE)  # kv length 0
    assert np.all(o[1, 2] == 0) and np.all(lse[1, :, 2] == EMPTY_ROW_LSE)  # past q length


@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
def test_decode_step_equals_the_full_causal_forward(heads):
  """Row p of the full causal forward == a decode step of query p over keys 0..p (kv length
  p + 1), for every p: the KV-cache identity."""
  n, k_heads = heads
  rng = np.random.default_rng(1)
  b, s, h = 2, 300, 64
  q = random_array(rng, (b, s, n, h), jnp.float32)
  k = random_array(rng, (b, s, k_heads, h), jnp.float32)
  v = random_array(rng, (b, s, k_heads, h), jnp.float32)
  full, full_lse = jax_flash.dot_product_attention(q, k, v, is_causal=True, return_residual=True)

  @jax.jit
  def step(p):
    q_p = jax.lax.dynamic_slice_in_dim(q, p, 1, axis=1)
    return jax_flash.dot_product_attention(
        q_p, k, v, key_value_seq_lengths=jnp.full((b,), p + 1, jnp.int32), return_residual=True)

  assert "jax_flash_cpu_decode" in step.lower(0).as_text()
  for p in (0, 1, 63, 64, 65, 200, 299):
    out, lse = step(p)
    np.testing.assert_allclose(out[:, 0], full[:, p], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(lse[:, 0], full_lse[:, p], atol=2e-6, rtol=1e-6)


def test_decode_under_vmap_and_grad():
  case = C(batch=2, seq_q=1, seq_k=400, heads_q=8, heads_k=2, head_dim=32, kv_lens=(400, 77))
  q, k, v, g = case.inputs()
  lens = jnp.asarray(case.kv_lens, jnp.int32)

  def one(q, k, v, lens):
    return jax_flash.dot_product_attention(q, k, v, key_value_seq_lengths=lens[None])[0]

  mapped = jax.vmap(one)(q[:, None], k[:, None], v[:, None], lens)
  direct = jax_flash.dot_product_attention(q, k, v, key_value_seq_lengths=lens)
  np.testing.assert_allclose(mapped, direct, atol=1e-6)
  ref32, _ = references(case)
  grads = jax.grad(lambda q, k, v: jnp.sum(jax.vmap(one)(q[:, None], k[:, None], v[:, None],
                                                          lens) * g), argnums=(0, 1, 2))(q, k, v)
  for name, got in zip(("dq", "dk", "dv"), grads):
    np.testing.assert_allclose(got, ref32[name], atol=2e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_nan_and_inf_propagate(splits, where):
  """A NaN or inf a row sees gives what the tiled forward gives (NaN or inf, never 0 or
  another number), through the chunk that holds it and the combine: the same non-finite
  elements, the same finite values elsewhere; rows of another batch element stay finite; an
  empty row stays 0 whatever it would have seen."""
  rng = np.random.default_rng(2)
  b, t, n, k_heads, h, s = 3, 1, 4, 2, 32, 600
  arrays = {name: np.asarray(random_array(rng, shape, jnp.float32)) for name, shape in
            (("q", (b, t, n, h)), ("k", (b, s, k_heads, h)), ("v", (b, s, k_heads, h)))}
  for value in (np.nan, np.inf, -np.inf):
    x = {name: a.copy() for name, a in arrays.items()}
    if where == "q":
      x["q"][0, 0, 1, 5] = value
    else:
      x[where][0, 450, 1, 7] = value
      x[where][2, 10, 0, 3] = value  # batch element 2 has length 0: never seen
    q_lens = jnp.full((b,), t, jnp.int32)
    kv_lens = jnp.array([600, 600, 0], jnp.int32)
    args = (*(jnp.asarray(x[name]) for name in "qkv"), q_lens, kv_lens)
    o, lse = (np.asarray(r) for r in _ops.flash_fwd(*args, _kernel_config(1 / np.sqrt(h), splits)))
    o0, lse0 = (np.asarray(r) for r in _ops.flash_fwd(*args, _kernel_config(1 / np.sqrt(h), 0)))
    heads = [1] if where == "q" else [2, 3]  # the query heads that see the poisoned element
    seen = o[0, 0, heads, 7] if where == "v" else o[0, 0, heads]  # a value column, or rows
    if value != value or where == "q":
      assert np.all(np.isnan(seen)), (where, value)
    if value != value or where != "k":  # (an infinite key gives -inf scores to some heads)
      assert not np.any(np.isfinite(seen)), (where, value)
    np.testing.assert_array_equal(np.isfinite(o), np.isfinite(o0))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse0))
    finite = np.isfinite(o0)
    np.testing.assert_allclose(o[finite], o0[finite], atol=2e-6, rtol=1e-5)
    assert np.all(np.isfinite(o[1])) and np.all(np.isfinite(lse[1]))
    assert np.all(o[2] == 0) and np.all(lse[2] == EMPTY_ROW_LSE)


def test_workspaces_are_outputs_of_the_call():
  """The partial outputs and lse are float32 results of the custom call (XLA sees their
  memory), sized by the native module; none with one chunk."""
  assert _decode.workspace_shapes(1, 2, 1, 8, 64)[0].shape == (0,)
  o_ws, lse_ws = _decode.workspace_shapes(5, 2, 3, 8, 64)
  assert o_ws.shape == (5 * 2 * 8 * 3 * 64,) and lse_ws.shape == (5 * 2 * 8 * 3,)
  q = jnp.ones((2, 3, 8, 64), jnp.float32)
  k = jnp.ones((2, 1000, 2, 64), jnp.float32)
  lens = jnp.full((2,), 3, jnp.int32)
  text = jax.jit(_ops.flash_fwd, static_argnums=5).lower(
      q, k, k, lens, lens, _kernel_config(0.1, 5)).as_text()
  assert f"tensor<{5 * 2 * 8 * 3 * 64}xf32>" in text and f"tensor<{5 * 2 * 8 * 3}xf32>" in text


def test_ffi_refuses_bad_splits():
  q = jnp.ones((1, 1, 2, 16), jnp.float32)
  k = jnp.ones((1, 100, 2, 16), jnp.float32)
  lens = jnp.ones((1,), jnp.int32)
  with pytest.raises(Exception, match="num_splits must be in"):
    jax.block_until_ready(_decode.decode_fwd(q, k, k, lens, lens, scale=0.1, is_causal=False,
                                             window_left=-1, window_right=-1, splits=0))
  call = jax.ffi.ffi_call("jax_flash_cpu_decode", (
      jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 1), jnp.float32),
      jax.ShapeDtypeStruct((7,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32)))
  with pytest.raises(Exception, match="o_partial"):
    jax.block_until_ready(call(q, k, k, lens, lens, **_decode.attributes(0.1, False, -1, -1, 4)))


@st.composite
def decode_cases(draw) -> Case:
  batch = draw(st.integers(1, 3))
  heads_k = draw(st.integers(1, 3))
  group = draw(st.sampled_from([1, 2, 4, 8]))
  seq_q = draw(st.sampled_from([1, 2, 4]))
  seq_k = draw(st.integers(1, 900))
  side = st.integers(0, 400)
  lengths = st.none() | st.tuples(*[st.integers(-1, seq_k + 2)] * batch)
  head_dim = draw(st.sampled_from([16, 40, 64, 128, 200]))
  return Case(batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_k * group, heads_k=heads_k,
              head_dim=head_dim, dtype=draw(st.sampled_from(["float32", "bfloat16"])),
              is_causal=draw(st.booleans()),
              local_window_size=draw(st.none() | side | st.tuples(side, side)),
              kv_lens=draw(lengths), return_residual=draw(st.booleans()),
              seed=draw(st.integers(0, 2**31 - 1)))


# Derandomized: the same 12 draws every run, so CI's verdict does not depend on the draw.
@settings(max_examples=12, deadline=None, derandomize=True)
@given(decode_cases())
def test_random_decode_shapes(case):
  assert _uses_decode(case)
  check_against_references(case, run_jax_flash(case, "cpu"))


# Found by test_random_decode_shapes (session 9): bf16 dk 1.34x and 1.23x the 2x-jax.nn bound on
# the CPU kernel (T = 2 causal: rows that see one and two keys), pinned as a strict xfail. The
# cause was the test's: the float32 reference got a float32 cotangent while the kernels (and
# jax.nn in bf16) get it rounded to bf16; with the same cotangent (Case.inputs, session 10) the
# errors are 0.47x and 0.32x of the bound. Kept as regression cases.
@pytest.mark.parametrize("seq_k, heads, head_dim, seed", [(144, 1, 40, 0), (396, 2, 64, 34565)])
def test_bf16_dk_of_a_short_causal_decode(seq_k, heads, head_dim, seed):
  case = Case(batch=2, seq_q=2, seq_k=seq_k, heads_q=heads, heads_k=heads, head_dim=head_dim,
              dtype="bfloat16", is_causal=True, seed=seed)
  check_against_references(case, run_jax_flash(case, "cpu"))


def test_benchmark_decode_preset(tmp_path, capsys):
  """python -m jax_flash.benchmark --preset decode: every case of the issue, contiguous and
  paged, and the ragged batch beside its all-full twin, jax_flash and XLA measured with the kv
  lengths (tiny here: --decode-reduce 64)."""
  import json

  from jax_flash import benchmark
  from jax_flash.benchmark.cases import DECODE_RAGGED_SHAPES, DECODE_SHAPES

  assert benchmark.main(["--platform", "cpu", "--preset", "decode", "--decode-reduce", "64",
                         "--reps", "1", "--out", str(tmp_path)]) == 0
  records = json.loads((tmp_path / "results.json").read_text())["measurements"]
  assert len(records) == 2 * 2 * (len(DECODE_SHAPES) + len(DECODE_RAGGED_SHAPES))
  assert all(r["status"] == "ok" for r in records), [r for r in records if r["status"] != "ok"]
  ragged = [r for r in records if "(half" in r["case"]]
  assert ragged and all(r["kv_lengths"] == [256, 32] for r in ragged), ragged
  table = capsys.readouterr().out
  assert "B2 T1 32/8 S256 hd128 paged" in table and "B1 T512 32/8 S256 hd128 contiguous" in table
  assert "| B2 T1 32/8 S256 (half 32) hd128 paged |" in table
  assert "- B2 T1 32/8 S256 (half 32) hd128 contiguous against all at S256: jax_flash " in table
  assert benchmark.main(["--platform", "cpu", "--preset", "decode", "--decode-reduce", "64",
                         "--reps", "1", "--cases", "T4 .* paged"]) == 0
  table = capsys.readouterr().out
  assert table.count("| B1 T") == 1 and "| B1 T4 32/8 S256 hd128 paged |" in table
