"""jax.nn's `bias` and `mask` arrays on the CUDA kernels (issue 16 item 3; experimental, the
Hopper kernels' kLogitArrays instantiations, cuda/gpu/logit_arrays.cuh, taken only under
JAX_FLASH_CUDA_LOGIT_ARRAYS=on).

On any machine: the switch's values, the default refusal, the traced custom calls under the
switch (the arrays as operands, dbias as a float32 result, the block mask derived from the mask
array) and the trace-time refusals of what the kernels do not cover yet. On a GPU
(test_cuda_kernels_under_the_switch runs the rest in a process with the switch): the
test_bias_mask_kernel.py checks against jax.nn by the FlashAttention rule, on the CUDA kernels."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _dispatch, _logit_arrays, _ops
from attention_testing import F32, ffi_calls, gpu_tests_in_a_process, simulate_cuda_host
from test_bias_mask_kernel import BIAS_SHAPES, B, N, S, T, _check, _inputs


def test_switch_reads_its_values():
  """JAX_FLASH_CUDA_LOGIT_ARRAYS (read at import): "on" turns the arrays on; unset, empty or
  "off" leave them off; another value warns, naming the values, and is off."""
  assert _logit_arrays._read_cuda_logit_arrays("on") is True
  for value in (None, "", "off"):
    assert _logit_arrays._read_cuda_logit_arrays(value) is False
  with pytest.warns(UserWarning, match=r"JAX_FLASH_CUDA_LOGIT_ARRAYS='1' is not one of \('off', 'on'\)"):
    assert _logit_arrays._read_cuda_logit_arrays("1") is False


@pytest.mark.parametrize("shape, rows, keys", [
    ((2, 3, 300, 200), 128, 128),  # partial last blocks both ways
    ((1, 1, 256, 128), 128, 128),  # whole blocks
    ((2, 1, 1, 300), 128, 128),    # no row dim
    ((1, 3, 70, 1), 128, 128),     # no key dim
    ((1, 1, 9, 10), 4, 3),         # small blocks
])
def test_block_mask_of_a_mask(shape, rows, keys):
  """A block is live exactly where some element of the mask in it is True (numpy loops as the
  reference); a dim of size 1 stays 1."""
  rng = np.random.default_rng(sum(shape))
  mask = rng.random(shape) < 0.02  # sparse: many blocks empty
  mask[..., :1, :1] |= True
  got = np.asarray(_logit_arrays.block_mask_of(jnp.asarray(mask), rows, keys))
  *lead, t, s = shape
  tb = -(-t // rows) if t > 1 else 1
  sb = -(-s // keys) if s > 1 else 1
  want = np.zeros((*lead, tb, sb), bool)
  for i in range(tb):
    for j in range(sb):
      rs = slice(i * rows, (i + 1) * rows) if t > 1 else slice(None)
      ks = slice(j * keys, (j + 1) * keys) if s > 1 else slice(None)
      want[..., i, j] = mask[..., rs, ks].any(axis=(-2, -1))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape, seq_q, seq_k", [
    ((2, 3, 70, 150), 70, 150),   # partial 128-key groups
    ((1, 1, 1, 300), 9, 300),     # rows broadcast: stay one row
    ((2, 1, 40, 1), 40, 77),      # keys broadcast: spread over the 77 columns
])
@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "backward"])
def test_cuda_mask_bits_order(shape, seq_q, seq_k, transposed):
  """Bit 2 nt + c of word 4 g + q of row r is column 128 g + 8 nt + 2 q + c of that row (keys
  of a query row; with `transposed`, queries of a key row), as the CUDA kernels' fragments read
  it; the columns past the last are 0."""
  rng = np.random.default_rng(sum(shape))
  mask = rng.random(shape) < 0.5
  words = np.asarray(_logit_arrays.cuda_mask_bits(jnp.asarray(mask), seq_q, seq_k, transposed))
  rows_first = np.swapaxes(mask, -1, -2) if transposed else mask
  columns = seq_q if transposed else seq_k
  want = np.zeros((*rows_first.shape[:-1], -(-columns // 128) * 128), bool)
  want[..., :columns] = np.broadcast_to(rows_first, (*rows_first.shape[:-1], columns))
  assert words.dtype == np.uint32 and words.shape == (*want.shape[:-1], want.shape[-1] // 32)
  column = np.arange(want.shape[-1])
  group, nt, quad, c = column // 128, column % 128 // 8, column % 8 // 2, column % 2
  got = (words[..., 4 * group + quad] >> (2 * nt + c).astype(np.uint32)) & 1
  np.testing.assert_array_equal(got.astype(bool), want)


def test_cuda_refuses_the_arrays_without_the_switch(monkeypatch):
  """By default (the switch unset, as here) the CUDA kernels take no arrays: the dispatch raises
  at trace time naming them, their shapes and the switch; the op layer never builds such a call."""
  assert not _logit_arrays.cuda_kernels_take_logit_arrays()
  q = jnp.ones((2, 8, 2, 64), jnp.bfloat16)
  bias = jnp.zeros((2, 2, 8, 8), jnp.float32)
  monkeypatch.setattr(_dispatch, "default_implementation", lambda dtype: "cuda")
  with pytest.raises(NotImplementedError,
                     match=r"take no bias or mask arrays; got bias\(2, 2, 8, 8\).*"
                           r"JAX_FLASH_CUDA_LOGIT_ARRAYS=on"):
    jax_flash.dot_product_attention(q, q, q, bias)
  config = _ops.KernelConfig("cuda", 1.0, False, -1, -1)
  with pytest.raises(NotImplementedError, match="JAX_FLASH_CUDA_LOGIT_ARRAYS=on"):
    _ops._logit_operands(config, bias, None, 8, 8)


def test_cuda_calls_carry_the_arrays_under_the_switch(monkeypatch):
  """With the switch on (simulated: its value patched, this machine a CUDA host), a
  differentiated CUDA call traces to the forward and backward custom calls with the bias and the
  mask as operands (attributes bias=mask=True; the mask as its bits, cuda_mask_bits: T = 200
  query rows of ceil(300 / 128) x 4 words in the forward, S = 300 key rows of ceil(200 / 128)
  x 4 in the backward), the backward returning dbias in float32 and the bias's shape (cast to
  its dtype after the call), and the block mask the mask array implies (block_sparse); a
  float16 bias beside bfloat16 inputs goes as float32; without arrays the operands are (0,)
  placeholders."""
  simulate_cuda_host(monkeypatch)
  monkeypatch.setattr(_logit_arrays, "_CUDA_LOGIT_ARRAYS", True)
  assert _dispatch.capabilities("cuda").logit_arrays
  q = jnp.ones((2, 200, 4, 64), jnp.bfloat16)
  k = v = jnp.ones((2, 300, 4, 64), jnp.bfloat16)
  bias = jnp.zeros((1, 4, 200, 300), jnp.float16)
  mask = jnp.tril(jnp.ones((200, 300), bool))

  def loss(q, k, v, bias, mask):
    out = jax_flash.dot_product_attention(q, k, v, bias, mask, implementation="cuda")
    return out.astype(jnp.float32).sum()

  calls = ffi_calls(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, bias, mask)
  assert [name for name, *_ in calls] == ["jax_flash_cuda_fwd", "jax_flash_cuda_bwd"]
  for (name, attributes, operands, results), mask_bits in zip(calls, [(1, 1, 200, 12), (1, 1, 300, 8)]):
    assert bool(attributes["bias"]) and bool(attributes["mask"]), name
    assert bool(attributes["block_sparse"]), name  # the causal mask's upper blocks are skipped
    shapes = {(tuple(x.shape), jnp.dtype(x.dtype)) for x in operands}
    assert ((1, 4, 200, 300), jnp.dtype(F32)) in shapes, name  # the float16 bias, as float32
    assert (mask_bits, jnp.dtype(jnp.uint32)) in shapes, name
  _, _, _, bwd_results = calls[1]
  assert (tuple(bwd_results[-1].shape), jnp.dtype(bwd_results[-1].dtype)) == ((1, 4, 200, 300), F32)
  dbias = jax.eval_shape(jax.grad(loss, argnums=3), q, k, v, bias, mask)
  assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
  for name, attributes, operands, _ in ffi_calls(jax.grad(lambda q: loss(q, k, v, None, None)), q):
    assert not bool(attributes["bias"]) and not bool(attributes["mask"]), name


@pytest.mark.parametrize("what, options, match", [
    ("bias", dict(deterministic=True), "deterministic=True"),
    ("mask", dict(dropout_rate=0.1, dropout_key=jax.random.key(0)), "dropout_rate=0.1"),
    ("mask", dict(q_segment_ids=jnp.zeros((2, 40), jnp.int32),
                  kv_segment_ids=jnp.zeros((2, 40), jnp.int32)), "segment ids"),
    ("bias", dict(logits_soft_cap=30.0), "logits_soft_cap=30.0 with a bias"),
])
def test_cuda_refuses_what_the_kernels_do_not_cover(monkeypatch, what, options, match):
  """Under the switch, the arrays beside deterministic=True, dropout, segment ids, or a bias
  beside the soft cap are refused at trace time (as the handlers refuse them), naming both."""
  simulate_cuda_host(monkeypatch)
  monkeypatch.setattr(_logit_arrays, "_CUDA_LOGIT_ARRAYS", True)
  monkeypatch.setattr(_dispatch, "_check_cuda_runs", lambda: None)
  from jax_flash import _dropout
  monkeypatch.setattr(_dropout, "_CUDA_DROPOUT", True)
  q = jnp.ones((2, 40, 4, 64), jnp.bfloat16)
  arrays = {"bias": jnp.zeros((1, 4, 40, 40))} if what == "bias" else {"mask": jnp.ones((40, 40), bool)}
  with pytest.raises(NotImplementedError, match=f"not with {match}"):
    jax_flash.dot_product_attention(q, q, q, implementation="cuda", **arrays, **options)
  # The mask beside the soft cap is taken (dS there needs no bias gradient).
  ffi_calls(lambda q: jax_flash.dot_product_attention(
      q, q, q, mask=jnp.ones((40, 40), bool), logits_soft_cap=30.0, implementation="cuda"), q)


# The GPU checks (against jax.nn, test_bias_mask_kernel.py's _check on the CUDA kernels): bfloat16
# or float16 inputs, head dims of the Hopper kernels. They run in a process with the switch
# (test_cuda_kernels_under_the_switch).
CUDA_BIAS_CASES = {
    # Every broadcast of the bias at head dim 64, causal: one add an element (BNTS), B adds
    # (1NTS), B N adds (11TS), rows and keys broadcast (BN1S, BNT1: exactly 0).
    "BNTS-hd64": dict(bias_shape=BIAS_SHAPES["BNTS"], head_dim=64, is_causal=True),
    "1NTS-hd64": dict(bias_shape=BIAS_SHAPES["1NTS"], head_dim=64, is_causal=True),
    "11TS-hd128": dict(bias_shape=BIAS_SHAPES["11TS"], head_dim=128),
    "BN1S-hd128": dict(bias_shape=BIAS_SHAPES["BN1S"], head_dim=128),
    "BNT1-hd96": dict(bias_shape=BIAS_SHAPES["BNT1"], head_dim=96, is_causal=True),
    # Masks, and both with the range masks; the split backward (192, 256).
    "mask-TS-hd128": dict(mask_shape=BIAS_SHAPES["TS"], head_dim=128),
    "mask-BN1S-hd64": dict(mask_shape=BIAS_SHAPES["BN1S"], head_dim=64),
    "both-window-hd256": dict(bias_shape=BIAS_SHAPES["1NTS"], mask_shape=BIAS_SHAPES["TS"],
                              head_dim=256, local_window_size=(20, 7)),
    "both-lengths-hd192": dict(bias_shape=BIAS_SHAPES["TS"], mask_shape=BIAS_SHAPES["BNTS"],
                               head_dim=192,
                               query_seq_lengths=jnp.array([70, 31], jnp.int32),
                               key_value_seq_lengths=jnp.array([150, 90], jnp.int32)),
    # A float32 bias beside bfloat16 inputs; a float16 bias beside them (cast to float32); float16
    # inputs and bias (the kernels' __half reads).
    "f32-bias": dict(bias_shape=BIAS_SHAPES["1NTS"], bias_dtype=F32, head_dim=128, is_causal=True),
    "f16-bias": dict(bias_shape=BIAS_SHAPES["B1TS"], bias_dtype=jnp.float16, head_dim=64),
    "f16-inputs": dict(dtype=jnp.float16, bias_shape=BIAS_SHAPES["B1TS"], head_dim=64),
    # MQA and T > S.
    "mqa-t-above-s": dict(bias_shape=(B, N, S, T), mask_shape=(1, 1, S, T), t=S, s=T, heads=(4, 1),
                          head_dim=64, is_causal=True),
}


# Biases the Hopper kernels stage through shared memory (gpu/logit_arrays.cuh bias_stages: the
# inputs' dtype, keys contiguous, every row on 16 bytes) and whose dbias takes 16-byte atomics
# (dbias_quads): a key count that is a multiple of 8 but not of the key blocks (144), rows past
# the last query tile (T = 70). A bias alone runs in the kernels without the ids' code, one beside
# a mask (the "-mask" cases) in those with it. The cases above (S = 150) read every element from
# global memory and add dbias an element at a time; so do these under
# JAX_FLASH_CUDA_BIAS_LOADS=direct. By default their forward copies the tiles by TMA (but for the
# row-broadcast BN1S, which has no descriptor), under =staged by the producer warp's copies
# (test_cuda_kernels_under_the_switch).
S8 = 144
CUDA_BIAS_CASES.update({f"staged-{name}": dict(case, s=case.get("s", S8)) for name, case in {
    "1NTS-hd128-causal": dict(bias_shape=(1, N, T, S8), head_dim=128, is_causal=True),
    "BNTS-hd64": dict(bias_shape=(B, N, T, S8), head_dim=64),
    "B1TS-hd96-lengths": dict(bias_shape=(B, 1, T, S8), head_dim=96,
                              query_seq_lengths=jnp.array([70, 33], jnp.int32),
                              key_value_seq_lengths=jnp.array([144, 77], jnp.int32)),
    "BN1S-hd192": dict(bias_shape=(B, N, 1, S8), head_dim=192, is_causal=True),
    "11TS-mask-hd256": dict(bias_shape=(1, 1, T, S8), mask_shape=(T, S8), head_dim=256),
    "1NTS-mask-hd128": dict(bias_shape=(1, N, T, S8), mask_shape=(B, 1, T, S8), head_dim=128),
    "f16-1NTS-window-hd64": dict(dtype=jnp.float16, bias_shape=(1, N, T, S8), head_dim=64,
                                 local_window_size=(30, 10)),
    "mqa-T-above-S-hd128": dict(bias_shape=(B, N, 152, 96), t=152, s=96, heads=(4, 1), head_dim=128,
                                is_causal=True),
}.items()})

# More query tiles than an H100 or H200 has SMs (B x heads = 320 at T = 70), so that the forward's
# persistent CTAs take several each: session 35's forward hung there once the two consumer
# warpgroups' paces differed (the direct loads, which rows past T skip) and one arrived for the
# next tile on a turn barrier the other had not yet taken (cuda/PERF_NOTES.md v34).
CUDA_BIAS_CASES.update({
    "many-tiles-f32-causal-hd128": dict(bias_shape=(1, 160, T, S), bias_dtype=F32, heads=(160, 8),
                                        head_dim=128, is_causal=True),
    "many-tiles-mask-hd64": dict(mask_shape=(B, 1, T, S), heads=(160, 160), head_dim=64),
    "many-tiles-staged-mask-causal-hd96": dict(bias_shape=(1, 160, T, S8), mask_shape=(T, S8), s=S8,
                                               heads=(160, 32), head_dim=96, is_causal=True),
    # A bias the batch shares: the backward runs the batch's CTAs of a key block side by side
    # (gpu/block_geometry.cuh key_block_of_cta, batch_innermost); 80 kv heads make two causal
    # chunks of (kv head) groups, the last of fewer.
    "batch-shared-bias-chunks-causal-hd64": dict(bias_shape=(1, 160, T, S8), s=S8, heads=(160, 80),
                                                 head_dim=64, is_causal=True),
})


def _needs_the_cuda_switch():
  if not _logit_arrays.cuda_kernels_take_logit_arrays():
    pytest.skip("runs under JAX_FLASH_CUDA_LOGIT_ARRAYS=on (test_cuda_kernels_under_the_switch)")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_BIAS_CASES, ids=str)
def test_cuda_against_jax_nn(case):
  _needs_the_cuda_switch()
  options = dict(CUDA_BIAS_CASES[case])
  dtype = jnp.dtype(options.pop("dtype", jnp.bfloat16))
  _check(4, dtype, implementation="cuda", **options)


@pytest.mark.gpu
def test_cuda_row_the_mask_empties_gives_zero_and_nan_shows():
  """A row the mask empties: output 0 and no gradient; a NaN bias element a row attends to makes
  that row NaN, one the mask hides changes nothing."""
  _needs_the_cuda_switch()
  q, k, v, g, bias, _ = _inputs(10, jnp.bfloat16, (1, N, T, S), jnp.bfloat16, None, head_dim=64)
  mask = jnp.ones((B, N, T, S), bool).at[:, 2, 5].set(False).at[1, 2, 6, 40].set(False)
  bias = bias.at[0, 1, 3, 17].set(jnp.nan).at[0, 2, 6, 40].set(jnp.nan)

  def loss(q, bias):
    out = jax_flash.dot_product_attention(q, k, v, bias, mask, implementation="cuda")
    return jnp.sum(out.astype(F32) * g), out

  (_, out), (dq, _) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(q, bias)
  out = np.asarray(out, np.float32)
  assert np.all(out[:, 5, 2] == 0) and np.all(np.asarray(dq, np.float32)[:, 5, 2] == 0)
  # (B, T, N): the bias is every batch element's, so its NaN at [0, 1, 3, 17] reaches both; the
  # one at [0, 2, 6, 40] only batch 0, whose mask keeps it.
  nan_rows = np.isnan(out).any(-1)
  want = np.zeros_like(nan_rows)
  want[:, 3, 1] = want[0, 6, 2] = True
  np.testing.assert_array_equal(nan_rows, want)


@pytest.mark.gpu
def test_cuda_block_diagonal_mask_skips_blocks():
  """A block-diagonal mask (documents of 128 keys) hides whole blocks, which the derived block
  mask skips: the output and gradients still match jax.nn."""
  _needs_the_cuda_switch()
  t = 384
  ids = jnp.arange(t) // 128
  mask = ids[:, None] == ids[None, :]
  q, k, v, g, _, _ = _inputs(12, jnp.bfloat16, None, None, None, t=t, s=t, head_dim=128)
  out = jax_flash.dot_product_attention(q, k, v, mask=mask, implementation="cuda")
  want = jax.nn.dot_product_attention(*(x.astype(F32) for x in (q, k, v)), mask=mask[None, None])
  assert np.abs(np.asarray(out, np.float32) - np.asarray(want)).max() < 2e-2


@pytest.mark.gpu
def test_cuda_kernels_under_the_switch():
  """The GPU tests above in a process with JAX_FLASH_CUDA_LOGIT_ARRAYS=on, and the staged biases'
  cases again with the forward's tiles copied by the producer warp (JAX_FLASH_CUDA_BIAS_LOADS=
  staged) and with every element read and added from global memory (=direct). Each process has
  300 s (a minute or two when they pass): a kernel that never finishes fails this test by the
  timeout instead of holding the suite (session 35's hang, cuda/PERF_NOTES.md v34)."""
  gpu_tests_in_a_process(__file__, "test_cuda_against_jax_nn or test_cuda_row_the_mask or "
                         "test_cuda_block_diagonal", dict(JAX_FLASH_CUDA_LOGIT_ARRAYS="on"),
                         timeout_s=300)
  for loads in ("staged", "direct"):
    gpu_tests_in_a_process(__file__, "test_cuda_against_jax_nn and (staged or many-tiles)",
                           dict(JAX_FLASH_CUDA_LOGIT_ARRAYS="on", JAX_FLASH_CUDA_BIAS_LOADS=loads),
                           timeout_s=300)
