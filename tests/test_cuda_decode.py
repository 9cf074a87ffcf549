"""The CUDA split-KV decode kernel (issue 15 items 1-2 on the GPU; cuda/gpu/flash_decode_kernel.cuh),
contiguous and paged, against the float32 reference with the rule of attention_testing (2x the
input dtype's own error) and against the full-sequence forward at the same positions; and the
paged calls past the kernel's rows (chunked prefill), which gather the pages for the tiled
forward.

The kernel is the default on the GPU; JAX_FLASH_CUDA_DECODE=tiled or split (read once, when
jax_flash is imported) override it for comparisons. The GPU tests run in this process under
whichever mode it has (most call the kernel's custom calls directly, so they test it in any
mode); test_under_the_tiled_override runs the mode-dependent ones again in a subprocess under
"tiled". The tests without the `gpu` marker check the Python side (the mode, the split rule,
the routing, the program traced) on any machine.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from attention_testing import (Case, assert_within_rule, check_against_references,
                               gpu_tests_in_a_process, random_array, reference_f32,
                               reference_in_dtype, row_has_keys, run_jax_flash)
from jax_flash import _decode, _ops, _paged
from jax_flash._reference import EMPTY_ROW_LSE
from test_paged import CASES as PAGED_CASES
from test_paged import PagedCase, check, contiguous

F32 = jnp.float32
CONSTANTS = {"decode_rows_per_cta": 16, "decode_block_n": 64, "decode_max_head_dim": 256}


# ---------------------------------------------------------------------------------------------
# The Python side, on any machine


def test_kernel_is_the_default():
  if os.environ.get(_decode.CUDA_DECODE_VARIABLE, "") in ("", "kernel"):
    assert _decode.cuda_kernel_enabled() and _decode.cuda_decode_mode() == "kernel"


def test_mode_is_read_at_import():
  """Unset, empty or "kernel": the kernel; "tiled" and "split" override it; another value warns
  (naming the values) and means the default."""
  code = ("import warnings; warnings.simplefilter('always')\n"
          "from jax_flash import _decode; print(_decode.cuda_decode_mode(), "
          "_decode.cuda_kernel_enabled())")
  for value, expected in ((None, "kernel True"), ("", "kernel True"), ("kernel", "kernel True"),
                          ("tiled", "tiled False"), ("split", "split False"),
                          ("Kernel", "kernel True")):
    env = {k: v for k, v in os.environ.items() if k != _decode.CUDA_DECODE_VARIABLE}
    if value is not None:
      env[_decode.CUDA_DECODE_VARIABLE] = value
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith(expected), (value, result.stdout)
    warned = "JAX_FLASH_CUDA_DECODE='Kernel' is not one of" in result.stderr
    assert warned == (value == "Kernel"), (value, result.stderr[-2000:])


@pytest.mark.parametrize("units, seq_k, sms, expected", [
    (512, 8192, 132, 1),     # B64 x 8 kv heads: 3.9 waves already
    (256, 16384, 132, 1),    # B16 x 16 kv heads: 1.94 waves
    (8, 8192, 132, 14),      # B1 x 8: 14 chunks give 112 of 132 SMs (>= 0.85 of the best)
    (1, 100, 132, 1),        # fewer than MIN_CHUNK_KEYS keys: one chunk
    (1, 10**6, 132, 55),     # at most MAX_SPLITS (64): 55 is within 0.85 of its 64/132
    (0, 8192, 132, 1),
])
def test_split_rule(units, seq_k, sms, expected):
  assert _decode.cuda_splits_rule(units, seq_k, sms, 64) == expected


def test_splits_override(monkeypatch):
  """JAX_FLASH_CUDA_DECODE_SPLITS (for measurements) replaces the rule, clamped to whole key
  blocks and MAX_SPLITS; a bad value names the variable."""
  block_n = 64  # the kernel's constants, as the native module gives them (stand-ins without CUDA)
  constants = {"decode_block_n": block_n, "decode_rows_per_cta": 16}
  monkeypatch.setattr(_decode, "_cuda_constant", constants.__getitem__)
  rule = _decode.cuda_num_splits(64, 1, 32, 8, 8192, sm_count=132)
  monkeypatch.setenv(_decode.CUDA_SPLITS_VARIABLE, "4")
  assert _decode.cuda_num_splits(64, 1, 32, 8, 8192, sm_count=132) == 4 != rule
  assert _decode.cuda_num_splits(64, 1, 32, 8, 2 * block_n, sm_count=132) == 2
  monkeypatch.setenv(_decode.CUDA_SPLITS_VARIABLE, "1000")
  assert _decode.cuda_num_splits(64, 1, 32, 8, 1 << 20, sm_count=132) == _decode.MAX_SPLITS
  for bad in ("0", "two"):
    monkeypatch.setenv(_decode.CUDA_SPLITS_VARIABLE, bad)
    with pytest.raises(ValueError, match="JAX_FLASH_CUDA_DECODE_SPLITS"):
      _decode.cuda_num_splits(64, 1, 32, 8, 8192, sm_count=132)


def test_split_rule_fills_the_waves():
  for units in range(1, 300, 7):
    for seq_k in (256, 1000, 8192, 65536):
      s = _decode.cuda_splits_rule(units, seq_k, 132, 64)
      assert 1 <= s <= min(_decode.MAX_SPLITS, max(1, -(-seq_k // _decode.MIN_CHUNK_KEYS)))


@pytest.fixture
def cuda_constants(monkeypatch):
  """The CUDA decode kernel's constants and an H200's SM count, on a machine without them."""
  monkeypatch.setattr(_decode, "_cuda_constant", CONSTANTS.__getitem__)
  monkeypatch.setattr(_decode, "_cuda_sm_count", lambda: 132)


def test_routing(cuda_constants, monkeypatch):
  """By default "cuda" takes the kernel for T * G <= CUDA_MAX_PACKED_ROWS (chunks from the
  rule), the tiled forward beyond; the paged route follows (gather beyond); "tiled" and "split"
  never take it; "cpu" is unchanged."""
  monkeypatch.setattr(_decode, "_CUDA_DECODE_MODE", "kernel")
  assert _decode.kv_splits("cuda", 64, 1, 32, 8, 8192) == 1
  assert _decode.kv_splits("cuda", 1, 1, 32, 8, 8192) == 14
  assert _decode.kv_splits("cuda", 4, 4, 16, 1, 8192) >= 1  # 64 packed rows: the kernel
  assert _decode.kv_splits("cuda", 4, 5, 16, 1, 8192) == 0  # 80: the tiled forward
  assert _decode.kv_splits("cuda", 4, 512, 32, 8, 8192) == 0  # chunked prefill
  assert _decode.kv_splits("cpu", 1, 1, 8, 2, 1000) >= 1
  for shape, route in (((1, 32, 8), "kernel"), ((4, 32, 8), "kernel"), ((16, 32, 8), "kernel"),
                       ((17, 32, 8), "gather"), ((512, 32, 8), "gather"), ((64, 1, 1), "kernel"),
                       ((65, 1, 1), "gather"), ((1, 128, 1), "gather")):
    assert _decode.cuda_paged_route(*shape) == route, shape
    assert (route == "kernel") == (_decode.kv_splits("cuda", 2, *shape, 4096) > 0), shape
  for mode in ("tiled", "split"):
    monkeypatch.setattr(_decode, "_CUDA_DECODE_MODE", mode)
    assert _decode.kv_splits("cuda", 64, 1, 32, 8, 8192) == 0
    assert _decode.cuda_paged_route(1, 32, 8) == "gather"


def test_dot_product_attention_traces_the_kernel(cuda_constants, monkeypatch):
  """The program a decode-shaped CUDA call traces to: the decode custom call by default, the
  tiled forward for chunked prefill and under "tiled" (traced, not run: no GPU needed)."""
  q, k, v = (jnp.zeros((2, t, n, 128), jnp.bfloat16) for t, n in ((1, 32), (4096, 8), (4096, 8)))
  q_big = jnp.zeros((2, 512, 32, 128), jnp.bfloat16)
  kv_lens = jnp.asarray([4096, 100], jnp.int32)

  def program(q):
    return str(jax.make_jaxpr(lambda q, k, v: _ops.call_kernels(
        _ops.flash_fwd, q, k, v, jnp.full((2,), q.shape[1], jnp.int32), kv_lens,
        implementation="cuda", scale=0.1, is_causal=False))(q, k, v))

  monkeypatch.setattr(_decode, "_CUDA_DECODE_MODE", "kernel")
  assert "jax_flash_cuda_decode" in program(q)
  assert "jax_flash_cuda_decode" not in program(q_big) and "jax_flash_cuda_fwd" in program(q_big)
  monkeypatch.setattr(_decode, "_CUDA_DECODE_MODE", "tiled")
  assert "jax_flash_cuda_decode" not in program(q) and "jax_flash_cuda_fwd" in program(q)


def test_paged_cuda_refuses_float32():
  case = PagedCase(dtype="float32")
  with pytest.raises(NotImplementedError, match="bfloat16 or float16.*implementation='xla'"):
    jax_flash.paged_attention(*case.inputs(), implementation="cuda")


# ---------------------------------------------------------------------------------------------
# On the GPU


@pytest.mark.gpu
def test_under_the_tiled_override():
  """The tests whose path depends on the mode, in a process with JAX_FLASH_CUDA_DECODE=tiled:
  contiguous decode calls take the tiled forward, paged ones gather their pages for it."""
  gpu_tests_in_a_process(__file__, "test_dot_product_attention_routes or "
                         "test_paged_matches_the_reference or test_reached_bad_entry or "
                         "test_decode_step_equals", dict(JAX_FLASH_CUDA_DECODE="tiled"))


@pytest.mark.gpu
@pytest.mark.parametrize("loads", ["evict_first", "prefetch256"])
def test_under_the_l2_hints(loads):
  """The kernel's contiguous and paged reference cases under each experimental L2 hint of its
  K/V copies (JAX_FLASH_CUDA_DECODE_LOADS, read once per process: a subprocess each)."""
  gpu_tests_in_a_process(__file__, "test_contiguous_matches_the_reference or "
                         "test_paged_matches_the_reference", dict(JAX_FLASH_CUDA_DECODE_LOADS=loads),
                         expect_skips=True)


C = Case
CONTIGUOUS = [
    # T = 1: GQA 4, MQA, MHA; ragged lengths with an empty and a full sequence.
    C(batch=3, seq_q=1, seq_k=700, heads_q=8, heads_k=2, head_dim=64, dtype="bfloat16",
      kv_lens=(700, 0, 129)),
    C(batch=2, seq_q=1, seq_k=1000, heads_q=8, heads_k=1, head_dim=128, dtype="float16",
      kv_lens=(1, 1000)),
    C(batch=2, seq_q=1, seq_k=300, heads_q=4, heads_k=4, head_dim=40, dtype="bfloat16"),
    # T = 2 and 4: causal (top-left, as dot_product_attention), windows, query lengths.
    C(batch=2, seq_q=2, seq_k=520, heads_q=8, heads_k=2, head_dim=80, dtype="float16",
      is_causal=True),
    C(batch=2, seq_q=4, seq_k=777, heads_q=16, heads_k=2, head_dim=96, dtype="bfloat16",
      local_window_size=(300, 2), kv_lens=(600, 777)),
    C(batch=3, seq_q=4, seq_k=333, heads_q=4, heads_k=1, head_dim=256, dtype="bfloat16",
      q_lens=(4, 1, 0), kv_lens=(333, 200, 50)),
    C(batch=1, seq_q=2, seq_k=1100, heads_q=6, heads_k=3, head_dim=111, dtype="float16",
      local_window_size=5),
    # 64 packed rows (4 row tiles), MQA with 32 query heads at T = 2.
    C(batch=1, seq_q=4, seq_k=500, heads_q=32, heads_k=2, head_dim=32, dtype="bfloat16",
      kv_lens=(431,)),
    C(batch=2, seq_q=2, seq_k=4096, heads_q=32, heads_k=1, head_dim=192, dtype="bfloat16",
      kv_lens=(4096, 3001)),
]


def _decode_call(case: Case, splits: int):
  """(o, lse (B, N, T)) of the CUDA decode custom call, head dim padded to a multiple of 8."""
  q, k, v, _ = case.inputs()
  batch = q.shape[0]
  pad = -case.head_dim % 8
  if pad:
    q, k, v = (jnp.pad(x, [(0, 0)] * 3 + [(0, pad)]) for x in (q, k, v))
  q_lens = jnp.asarray(case.q_lens or (case.seq_q,) * batch, jnp.int32)
  kv_lens = jnp.asarray(case.kv_lens or (case.seq_k,) * batch, jnp.int32)
  w = case.local_window_size
  left, right = (-1, -1) if w is None else ((w, w) if isinstance(w, int) else w)
  scale = 1 / np.sqrt(case.head_dim) if case.scale is None else case.scale
  o, lse = jax.jit(lambda *a: _decode.decode_fwd(
      *a, scale=scale, is_causal=case.is_causal, window_left=left, window_right=right,
      splits=splits, implementation="cuda"))(q, k, v, q_lens, kv_lens)
  return o[..., :case.head_dim], lse


def _check_contiguous(case: Case, o, lse) -> None:
  q, k, v, _ = case.inputs()
  options = case.options()
  out32, lse32 = reference_f32(q, k, v, return_residual=True, **options)
  outd, lsed = reference_in_dtype(q, k, v, return_residual=True, **options)
  live = row_has_keys(case)  # (B, T)
  o, lse = np.asarray(o, np.float64), np.swapaxes(np.asarray(lse, np.float64), -1, -2)
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
  assert_within_rule("out", o, np.asarray(out32, np.float64), np.asarray(outd, np.float64),
                     live[..., None, None])
  assert_within_rule("lse", lse, np.asarray(lse32), np.asarray(lsed), live[..., None])
  assert np.all(o[~live] == 0), "rows with no key must be exactly 0"
  assert np.all(lse[~live] == EMPTY_ROW_LSE)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 17])
@pytest.mark.parametrize("case", CONTIGUOUS, ids=lambda c: c.id)
def test_contiguous_matches_the_reference(case, splits):
  o, lse = _decode_call(case, splits)
  assert o.dtype == case.jdtype
  _check_contiguous(case, o, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CONTIGUOUS[:4], ids=lambda c: c.id)
def test_dot_product_attention_routes_to_the_kernel(case):
  """dot_product_attention(implementation="cuda") on a decode shape calls the kernel by default
  (the tiled forward under JAX_FLASH_CUDA_DECODE=tiled) and matches the reference."""
  q, k, v, _ = case.inputs()
  call = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, implementation="cuda", return_residual=True, **case.options()))
  text = call.lower(q, k, v).as_text()
  if _decode.cuda_kernel_enabled():
    assert "jax_flash_cuda_decode" in text
  else:
    assert "jax_flash_cuda_decode" not in text
  if _decode.cuda_decode_mode() == "tiled":
    assert "jax_flash_cuda_fwd" in text
  o, lse = call(q, k, v)
  _check_contiguous(case, o, np.swapaxes(np.asarray(lse), -1, -2))


@pytest.mark.gpu
def test_default_picks_the_kernel_on_the_gpu():
  """implementation=None on a GPU: bf16/f16 decode calls and paged calls take the decode kernel;
  float32 takes the blockwise path as before (no custom call), paged float32 raises."""
  if not _decode.cuda_kernel_enabled():
    pytest.skip(f"JAX_FLASH_CUDA_DECODE={_decode.cuda_decode_mode()} in this process")
  case = CONTIGUOUS[0]
  q, k, v, _ = case.inputs()
  text = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v)).lower(q, k, v).as_text()
  assert "jax_flash_cuda_decode" in text
  q32, k32, v32 = (x.astype(F32) for x in (q, k, v))
  text = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v)).lower(
      q32, k32, v32).as_text()
  assert "jax_flash_cuda" not in text
  paged = PagedCase(dtype="bfloat16")
  text = jax.jit(lambda *a: jax_flash.paged_attention(*a)).lower(*paged.inputs()).as_text()
  assert "jax_flash_cuda_paged" in text
  chunk = PagedCase(seq_q=40, kv_lens=(128, 50), dtype="bfloat16")  # 160 packed rows
  text = jax.jit(lambda *a: jax_flash.paged_attention(*a)).lower(*chunk.inputs()).as_text()
  assert "jax_flash_cuda_paged" not in text and "jax_flash_cuda_fwd" in text
  with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
    jax_flash.paged_attention(*PagedCase(dtype="float32").inputs())


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    C(batch=3, seq_q=1, seq_k=700, heads_q=8, heads_k=2, head_dim=128, dtype="bfloat16",
      kv_lens=(700, 0, 129)),
    C(batch=2, seq_q=4, seq_k=1000, heads_q=8, heads_k=2, head_dim=64, dtype="float16",
      local_window_size=(300, 2), kv_lens=(900, 1000)),
], ids=lambda c: c.id)
def test_decode_call_gradients(case):
  """A decode-shaped call differentiated (the tiled forward and backward: _ops.for_backward
  leaves the decode kernel to inference), within the rule of the references (out, lse, dq, dk,
  dv)."""
  check_against_references(case, run_jax_flash(case, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_step_equals_the_full_forward(heads, dtype):
  """Rows p (T = 1), p-3..p (T = 4) and p-79..p (T = 80, gathered) of the CUDA tiled causal
  forward == a bottom-right causal paged step at kv length p + 1 (same keys, paged and
  contiguous)."""
  heads_q, heads_k = heads
  case = PagedCase(batch=2, heads_q=heads_q, heads_k=heads_k, head_dim=128, page_size=16,
                   pages_per_seq=32, kv_lens=(512, 512), dtype=dtype)
  _, kp, vp, table, _ = case.inputs()
  k, v = (jnp.asarray(contiguous(x, table, case.page_size)).astype(dtype) for x in (kp, vp))
  q_full = random_array(np.random.default_rng(5), (2, 512, heads_q, 128), jnp.dtype(dtype))
  full = np.asarray(jax_flash.dot_product_attention(q_full, k, v, is_causal=True,
                                                    implementation="cuda"), np.float32)
  step = jax.jit(lambda q, lens: jax_flash.paged_attention(q, kp, vp, table, lens,
                                                           is_causal=True, implementation="cuda"))
  atol = 2e-2 if dtype == "bfloat16" else 4e-3
  for p in (3, 15, 16, 100, 511):
    lens = jnp.full((2,), p + 1, jnp.int32)
    np.testing.assert_allclose(np.asarray(step(q_full[:, p:p + 1], lens), np.float32)[:, 0],
                               full[:, p], atol=atol)
    np.testing.assert_allclose(np.asarray(step(q_full[:, p - 3:p + 1], lens), np.float32),
                               full[:, p - 3:p + 1], atol=atol)
    if p >= 79:  # a chunk of 80 rows (80 x G packed rows): the pages gathered, tiled forward
      np.testing.assert_allclose(np.asarray(step(q_full[:, p - 79:p + 1], lens), np.float32),
                                 full[:, p - 79:p + 1], atol=atol)


def _half(case: PagedCase) -> PagedCase:
  return case if case.dtype != "float32" else dataclasses.replace(case, dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [_half(c) for c in PAGED_CASES], ids=lambda c: f"{c}"[10:80])
def test_paged_matches_the_reference(case):
  """Every paged case of tests/test_paged.py in 16 bits: the kernel up to 64 packed rows, the
  pages gathered for the tiled forward beyond (GATHER_CASES; every shape under "tiled")."""
  call = jax.jit(lambda *a: jax_flash.paged_attention(
      *a, implementation="cuda", return_residual=True, **case.options()))
  text = call.lower(*case.inputs()).as_text()
  kernel = _decode.cuda_paged_route(case.seq_q, case.heads_q, case.heads_k) == "kernel"
  assert ("jax_flash_cuda_paged" in text) == kernel
  assert ("jax_flash_cuda_fwd" in text) == (not kernel)
  out, lse = call(*case.inputs())
  assert out.dtype == jnp.dtype(case.dtype) and out.shape == (case.batch, case.seq_q,
                                                               case.heads_q, case.head_dim)
  check(case, out, lse)


@pytest.mark.gpu
def test_paged_equals_contiguous():
  """The same keys paged or contiguous (page sizes 16, 1 and 100): the same kernel, the same
  chunks, the same results."""
  for page_size, pages in ((16, 40), (1, 640), (100, 7)):
    case = PagedCase(batch=3, heads_q=8, heads_k=2, page_size=page_size, pages_per_seq=pages,
                     kv_lens=(page_size * pages, 17, 300), dtype="bfloat16")
    q, kp, vp, table, lens = case.inputs()
    k, v = (jnp.asarray(contiguous(x, table, page_size)).astype(jnp.bfloat16) for x in (kp, vp))
    splits = _decode.cuda_num_splits(3, 1, 8, 2, page_size * pages)
    paged, _ = _paged._paged_kernel(q, kp, vp, table, lens, 0.125, False, -1, -1, splits, "cuda")
    # queries_at_end only moves causal masks and windows: without them the two calls agree.
    dense, _ = _decode.decode_fwd(q, k, v, jnp.ones((3,), jnp.int32), lens, scale=0.125,
                                  is_causal=False, window_left=-1, window_right=-1,
                                  splits=splits, implementation="cuda")
    np.testing.assert_array_equal(np.asarray(paged, np.float32), np.asarray(dense, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("seq_q", [1, 40], ids=["kernel", "gathered"])
@pytest.mark.parametrize("entry", [-1, 21, 2**31 - 1])
def test_reached_bad_entry_gives_nan_for_that_sequence(entry, seq_q):
  """The table is device memory: neither the kernel nor the gathered path (T = 40: 160 packed
  rows) can refuse the call, so (as "xla") the sequence that reaches a bad entry is NaN, the
  others are untouched; nothing outside the pools is read (compute-sanitizer:
  .ci/gpu/sanitize_decode.py)."""
  case = PagedCase(seq_q=seq_q, kv_lens=(128, 50), extra_pages=5, dtype="bfloat16",
                   is_causal=True)  # 21 pages
  q, kp, vp, table, lens = case.inputs()
  base_out, base_lse = jax_flash.paged_attention(q, kp, vp, table, lens, implementation="cuda",
                                                 return_residual=True)
  out, lse = jax_flash.paged_attention(q, kp, vp, table.at[1, 3].set(entry), lens,
                                       implementation="cuda", return_residual=True)
  assert np.all(np.isnan(np.asarray(out[1], np.float32))) and np.all(np.isnan(lse[1]))
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(base_out[0], np.float32))
  np.testing.assert_array_equal(lse[0], base_lse[0])


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_nan_propagates(splits):
  """A NaN a row sees makes the row NaN through its chunk and the combine; another sequence and
  an empty row stay as they were."""
  case = C(batch=3, seq_q=1, seq_k=600, heads_q=4, heads_k=2, head_dim=64, dtype="bfloat16",
           kv_lens=(600, 600, 0))
  q, k, v, _ = case.inputs()
  k = k.at[0, 450, 1, 7].set(jnp.nan).at[2, 10, 0, 3].set(jnp.nan)
  q_lens, kv_lens = jnp.ones((3,), jnp.int32), jnp.asarray(case.kv_lens, jnp.int32)
  o, lse = _decode.decode_fwd(q, k, v, q_lens, kv_lens, scale=0.125, is_causal=False,
                              window_left=-1, window_right=-1, splits=splits,
                              implementation="cuda")
  o = np.asarray(o, np.float32)
  assert np.all(np.isnan(o[0, 0, 2:])) and np.all(np.isnan(lse[0, 2:]))  # heads of kv head 1
  assert np.all(np.isfinite(o[0, 0, :2])) and np.all(np.isfinite(o[1]))
  assert np.all(o[2] == 0) and np.all(np.asarray(lse[2]) == EMPTY_ROW_LSE)


@pytest.mark.gpu
def test_workspaces_and_graph_capture():
  """The split workspaces are outputs of the call (no hidden allocation), and a jitted loop of
  decode calls (which XLA may capture into a CUDA graph) gives the single call's result."""
  case = CONTIGUOUS[0]
  q, k, v, _ = case.inputs()
  lens = jnp.asarray(case.kv_lens, jnp.int32)
  text = jax.jit(lambda q: _decode.decode_fwd(
      q, k, v, jnp.ones((3,), jnp.int32), lens, scale=0.125, is_causal=False, window_left=-1,
      window_right=-1, splits=5, implementation="cuda")).lower(q).as_text()
  assert "jax_flash_cuda_decode" in text

  @jax.jit
  def loop(q):
    def body(_, acc):
      o, _ = _decode.decode_fwd(q, k, v, jnp.ones((3,), jnp.int32), lens, scale=0.125,
                                is_causal=False, window_left=-1, window_right=-1, splits=5,
                                implementation="cuda")
      return acc + o.astype(F32)
    return jax.lax.fori_loop(0, 4, body, jnp.zeros(q.shape, F32))

  np.testing.assert_allclose(np.asarray(loop(q)) / 4, np.asarray(_decode.decode_fwd(
      q, k, v, jnp.ones((3,), jnp.int32), lens, scale=0.125, is_causal=False, window_left=-1,
      window_right=-1, splits=5, implementation="cuda")[0], np.float32), atol=1e-6)
