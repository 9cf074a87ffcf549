"""Forward, lse and gradients of both implementations against the references, on a covering grid.

The grid is not a cartesian product (CI has 2 cores): every sequence pair, head dim, GQA ratio,
dtype and mask kind appears in several cases, each time with different partners, and the large
cases (1023, head dim 256) are kept to a few combinations. Every case runs for
implementation="cpu" (the C++ kernel), "xla" (the plain reference path) and "blockwise" (key
blocks in a scan, in XLA), which must all satisfy the tolerance rule of attention_testing.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _blockwise
from attention_testing import (EMPTY_ROW_LSE, Case, check_against_references, random_array,
                               run_jax_flash)

C = Case
GRID = [
    # T = S = 1: a single key, so P = 1 and dq = dk = 0 exactly in exact arithmetic.
    C(batch=2, seq_q=1, seq_k=1, heads_k=8, head_dim=32),
    C(batch=1, seq_q=1, seq_k=1, heads_k=1, head_dim=111, dtype="bfloat16", is_causal=True,
      return_residual=True),
    C(batch=3, seq_q=1, seq_k=1, heads_k=4, head_dim=256, dtype="float16", kv_lens=(1, 0, 1)),
    # 17
    C(batch=3, seq_q=17, seq_k=17, heads_k=4, head_dim=40, dtype="float16", is_causal=True,
      q_lens=(17, 5, 0), kv_lens=(17, 0, 9)),
    C(batch=2, seq_q=17, seq_k=17, heads_k=8, head_dim=256, local_window_size=3,
      return_residual=True),
    C(batch=1, seq_q=17, seq_k=17, heads_k=1, head_dim=64, dtype="bfloat16",
      local_window_size=(2, 0), rank3=True),
    # 113
    C(batch=3, seq_q=113, seq_k=113, heads_k=8, head_dim=64, dtype="bfloat16",
      kv_lens=(113, 0, 50)),
    C(batch=2, seq_q=113, seq_k=113, heads_k=1, head_dim=96, is_causal=True,
      local_window_size=(16, 0), return_residual=True),
    C(batch=2, seq_q=113, seq_k=113, heads_k=4, head_dim=128, dtype="float16",
      local_window_size=(5, 9), q_lens=(113, 60)),
    # 128 (exactly two kernel blocks)
    C(batch=2, seq_q=128, seq_k=128, heads_k=4, head_dim=80, is_causal=True, q_lens=(128, 77),
      kv_lens=(128, 64)),
    C(batch=1, seq_q=128, seq_k=128, heads_k=8, head_dim=32, dtype="float16", rank3=True,
      scale=0.5, kv_lens=(100,)),
    C(batch=2, seq_q=128, seq_k=128, heads_k=1, head_dim=111, dtype="bfloat16",
      local_window_size=64, return_residual=True),
    # 203
    C(batch=2, seq_q=203, seq_k=203, heads_k=1, head_dim=32, dtype="bfloat16", is_causal=True),
    C(batch=3, seq_q=203, seq_k=203, heads_k=8, head_dim=111, dtype="float16",
      local_window_size=20, q_lens=(203, 100, 0)),
    C(batch=1, seq_q=203, seq_k=203, heads_k=4, head_dim=40, is_causal=True, scale=2.0,
      local_window_size=(0, 0)),
    # T < S (causal is top-left aligned: query i sees keys j <= i)
    C(batch=2, seq_q=17, seq_k=113, heads_k=4, head_dim=64, is_causal=True),
    C(batch=3, seq_q=17, seq_k=113, heads_k=1, head_dim=256, dtype="bfloat16",
      local_window_size=(0, 7), kv_lens=(113, 0, 10)),
    C(batch=2, seq_q=17, seq_k=113, heads_k=8, head_dim=80, dtype="float16", scale=1.7,
      return_residual=True),
    C(batch=2, seq_q=17, seq_k=203, heads_k=8, head_dim=128, dtype="bfloat16", is_causal=True,
      kv_lens=(203, 0)),
    # T > S (rows past the window's reach have no keys)
    C(batch=2, seq_q=113, seq_k=17, heads_k=8, head_dim=80, dtype="bfloat16", is_causal=True,
      return_residual=True),
    C(batch=2, seq_q=113, seq_k=17, heads_k=1, head_dim=111, local_window_size=(0, 0)),
    C(batch=2, seq_q=113, seq_k=17, heads_k=4, head_dim=96, dtype="float16",
      local_window_size=(3, 0), kv_lens=(17, 5)),
    C(batch=2, seq_q=203, seq_k=113, heads_k=4, head_dim=256, dtype="bfloat16", is_causal=True,
      local_window_size=(32, 0)),
    # one query row / one key
    C(batch=3, seq_q=1, seq_k=128, heads_k=4, head_dim=80, kv_lens=(128, 0, 33)),
    C(batch=1, seq_q=1, seq_k=128, heads_k=1, head_dim=64, dtype="float16", is_causal=True),
    C(batch=2, seq_q=128, seq_k=1, heads_k=8, head_dim=96, dtype="bfloat16", is_causal=True),
    C(batch=1, seq_q=128, seq_k=1, heads_k=4, head_dim=64, rank3=True, local_window_size=0,
      return_residual=True),
    # long: 203 x 1023 and 1023 x 1023, few combinations
    C(batch=2, seq_q=203, seq_k=1023, heads_k=4, head_dim=96, dtype="float16", is_causal=True,
      q_lens=(203, 150), kv_lens=(1023, 0)),
    C(batch=1, seq_q=203, seq_k=1023, heads_k=8, head_dim=128, local_window_size=(64, 64)),
    C(batch=1, seq_q=1023, seq_k=203, heads_k=1, head_dim=40, dtype="bfloat16", is_causal=True,
      local_window_size=(100, 0), return_residual=True),
    C(batch=1, seq_q=1023, seq_k=1023, heads_k=8, head_dim=64, dtype="bfloat16", is_causal=True),
    C(batch=1, seq_q=1023, seq_k=1023, heads_k=1, head_dim=256, local_window_size=(128, 0),
      return_residual=True),
    C(batch=2, seq_q=1023, seq_k=1023, heads_k=4, head_dim=111, dtype="float16",
      q_lens=(1023, 700), kv_lens=(1023, 300)),
    # a negative scale (the logits change sign: the row maxima come from the smallest scores)
    C(batch=2, seq_q=113, seq_k=203, heads_k=4, head_dim=64, dtype="bfloat16", scale=-0.6,
      kv_lens=(203, 77), return_residual=True),
    # scale 0: every logit 0, uniform attention over the visible keys, dq = dk = 0
    C(batch=2, seq_q=113, seq_k=113, heads_k=1, head_dim=32, dtype="float16", scale=0.0,
      is_causal=True, kv_lens=(113, 40)),
    # rank 3 with T != S and an explicit scale
    C(batch=1, seq_q=113, seq_k=203, heads_k=4, head_dim=32, is_causal=True, rank3=True,
      scale=0.3, return_residual=True),
]


def test_grid_covers_every_value():
  """Each value of every dimension appears with several partners (guards edits of GRID)."""
  seqs = collections.Counter((c.seq_q, c.seq_k) for c in GRID)
  for pair in [(1, 1), (17, 17), (113, 113), (128, 128), (203, 203), (17, 113), (113, 17),
               (203, 1023), (1, 128), (1023, 1023)]:
    assert seqs[pair] >= 1, pair
  for name, values, least in [
      ("head_dim", (32, 40, 64, 80, 96, 111, 128, 256), 3),
      ("heads_k", (8, 4, 1), 8),
      ("dtype", ("float32", "bfloat16", "float16"), 8),
      ("is_causal", (True, False), 8),
      ("return_residual", (True, False), 8),
      ("rank3", (True, False), 3),
  ]:
    counts = collections.Counter(getattr(c, name) for c in GRID)
    for value in values:
      assert counts[value] >= least, (name, value, counts[value])
  kinds = collections.Counter()
  for c in GRID:
    w = c.local_window_size
    kinds["int window"] += isinstance(w, int)
    kinds["(k, 0) window"] += isinstance(w, tuple) and w[1] == 0
    kinds["(l, r) window"] += isinstance(w, tuple) and w[1] > 0
    kinds["zero kv length"] += c.kv_lens is not None and 0 in c.kv_lens
    kinds["q padding"] += c.q_lens is not None
    kinds["scale"] += c.scale is not None
  assert min(kinds.values()) >= 3, kinds
  for dtype in ("float32", "bfloat16", "float16"):
    assert {c.head_dim for c in GRID if c.dtype == dtype} >= {32, 40, 64, 96, 111, 128}, dtype


IMPLEMENTATIONS = ("cpu", "xla", "blockwise")


@pytest.mark.parametrize(
    "case,implementation",
    [(c, impl) for c in GRID for impl in IMPLEMENTATIONS],  # impl innermost: references are cached
    ids=[f"{c.id}-{impl}" for c in GRID for impl in IMPLEMENTATIONS],
)
def test_matches_reference(case, implementation, monkeypatch):
  # Blocks of 48 keys: every case with S > 48 crosses block edges, most with a padded last block.
  monkeypatch.setattr(_blockwise, "KEY_BLOCK", 48)
  got = run_jax_flash(case, implementation)
  check_against_references(case, got)


def test_deterministic():
  """Two runs of the same jitted forward and backward give bit-identical results."""
  case = C(batch=2, seq_q=203, seq_k=203, heads_k=4, head_dim=64, is_causal=True,
           kv_lens=(203, 150))
  first, second = run_jax_flash(case, "cpu"), run_jax_flash(case, "cpu")
  for name in first:
    np.testing.assert_array_equal(first[name], second[name], err_msg=name)


@pytest.mark.parametrize("cores", [1, 64])
@pytest.mark.parametrize("case", [
    C(batch=1, seq_q=300, seq_k=1023, heads_q=2, heads_k=1, head_dim=64, is_causal=True,
      kv_lens=(900,)),
    C(batch=2, seq_q=130, seq_k=260, heads_q=4, heads_k=2, head_dim=40, dtype="bfloat16",
      local_window_size=(70, 10), q_lens=(130, 100)),
], ids=lambda c: c.id)
def test_dq_splits(monkeypatch, case, cores):
  """The CPU backward splits dQ accumulation over key blocks by the host's core count
  (jax_flash._ops.dq_splits): 1 split and many splits give correct gradients alike."""
  monkeypatch.setattr(os, "cpu_count", lambda: cores)
  check_against_references(case, run_jax_flash(case, "cpu"))


_ISA_SCRIPT = textwrap.dedent("""
    import sys
    import jax_flash
    from attention_testing import Case, check_against_references, run_jax_flash
    if jax_flash.cpu_kernel_isa() != {isa!r}:
      sys.exit("unsupported: " + jax_flash.cpu_kernel_isa())
    for case in [
        Case(batch=2, seq_q=113, seq_k=203, heads_k=4, head_dim=40, is_causal=True,
             kv_lens=(203, 0), local_window_size=(50, 3)),
        Case(batch=2, seq_q=70, seq_k=70, heads_k=1, head_dim=111, dtype="bfloat16",
             q_lens=(70, 31)),
        Case(batch=1, seq_q=97, seq_k=150, heads_q=4, heads_k=2, head_dim=64, dtype="bfloat16",
             is_causal=True, kv_lens=(121,)),
        Case(batch=1, seq_q=65, seq_k=129, heads_k=8, head_dim=80, dtype="float16"),
    ]:
      check_against_references(case, run_jax_flash(case, "cpu"))
    print("ok")
""")


@pytest.mark.parametrize("isa", ["avx512_amx", "avx512", "avx512_bf16", "avx2", "baseline"])
def test_other_cpu_kernel_variants(isa):
  """Every kernel variant this CPU can run (JAX_FLASH_CPU_ISA picks one; the rest of the suite
  runs the best one), those it cannot skipped."""
  if jax.default_backend() != "cpu":
    pytest.skip("CPU kernel variants are tested on CPU hosts")
  here = os.path.dirname(__file__)
  env = dict(os.environ, JAX_FLASH_CPU_ISA=isa,
             PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
  result = subprocess.run([sys.executable, "-c", _ISA_SCRIPT.format(isa=isa)], env=env,
                          capture_output=True, text=True, timeout=300)
  if result.stderr.startswith("unsupported: "):
    pytest.skip(f"this CPU cannot run the {isa} kernel variant")
  assert result.returncode == 0, result.stderr[-4000:]
  assert result.stdout.strip().endswith("ok")


def _cpu_flags() -> tuple[str, set[str]]:
  """(vendor id, flags) of the first CPU in /proc/cpuinfo; ("", set()) where there is none."""
  try:
    with open("/proc/cpuinfo") as f:
      text = f.read()
  except OSError:
    return "", set()
  fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
  fields = {k.strip(): v.strip() for k, v in fields.items()}
  return fields.get("vendor_id", ""), set(fields.get("flags", "").split())


def test_default_cpu_kernel_variant_follows_the_cpu():
  """Without JAX_FLASH_CPU_ISA the best variant runs: avx512_amx where the tiles are usable, on
  AMD's AVX-512 CPUs with avx512_bf16 the vdpbf16ps variant (its bf16 products ran 1.5-2x
  avx512's on a Zen 4: PERF_NOTES CPU v3.4), on other AVX-512 CPUs without AMX avx512."""
  if "JAX_FLASH_CPU_ISA" in os.environ:
    pytest.skip("JAX_FLASH_CPU_ISA forces a variant")
  vendor, flags = _cpu_flags()
  isa = jax_flash.cpu_kernel_isa()
  if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags or "amx_tile" in flags:
    pytest.skip("an AVX-512 CPU without AMX")
  if vendor == "AuthenticAMD" and "avx512_bf16" in flags:
    if isa != "avx512_bf16":  # a build without the variant (a compiler without -mavx512bf16)?
      forced = subprocess.run(
          [sys.executable, "-c", "import jax_flash; print(jax_flash.cpu_kernel_isa())"],
          env=dict(os.environ, JAX_FLASH_CPU_ISA="avx512_bf16"), capture_output=True, text=True,
          timeout=120)
      if forced.stdout.strip() != "avx512_bf16":
        pytest.skip("this build has no avx512_bf16 variant")
    assert isa == "avx512_bf16"
  else:
    assert isa == "avx512"


# ---------------------------------------------------------------------------------------------
# Edge cases of the masks and sizes


def _attention(q, k, v, implementation, **options):
  return jax_flash.dot_product_attention(q, k, v, implementation=implementation, **options)


@pytest.mark.parametrize("implementation", ["cpu", "xla", "blockwise"])
@pytest.mark.parametrize("seq_q,seq_k", [(5, 0), (0, 5)], ids=["no_keys", "no_queries"])
def test_empty_sequences(rng, implementation, seq_q, seq_k):
  """A zero-length key (or query) sequence: every row has nothing to attend to, so the output
  is 0, lse EMPTY_ROW_LSE and every gradient 0 (jax.nn gives 0 output there as well)."""
  q = random_array(rng, (2, seq_q, 4, 16), jnp.float32)
  k = random_array(rng, (2, seq_k, 2, 16), jnp.float32)
  g = random_array(rng, q.shape, jnp.float32)
  out, lse = _attention(q, k, k, implementation, return_residual=True)
  assert out.shape == q.shape and lse.shape == q.shape[:-1]
  assert not np.any(np.asarray(out)) and np.all(np.asarray(lse) == EMPTY_ROW_LSE)
  grads = jax.grad(lambda q, k, v: jnp.sum(_attention(q, k, v, implementation) * g),
                   argnums=(0, 1, 2))(q, k, k)
  for d, x in zip(grads, (q, k, k)):
    assert d.shape == x.shape and not np.any(np.asarray(d))


@pytest.mark.parametrize("right", [2**31, sys.maxsize], ids=["2^31", "maxsize"])
def test_window_larger_than_any_sequence(rng, right):
  """(0, right) with right far beyond the keys is the same mask as (0, S): keys j >= i.

  jax_flash 0.1.0 fails for right = sys.maxsize: the kernels' key_range computes
  i + window_right + 1 in int64, which overflows, so every row is empty and the output is
  silently all zeros."""
  q = random_array(rng, (1, 6, 2, 16), jnp.float32)
  k = random_array(rng, (1, 9, 1, 16), jnp.float32)
  want = _attention(q, k, k, "cpu", local_window_size=(0, 9))
  assert np.any(np.asarray(want))
  try:
    got = _attention(q, k, k, "cpu", local_window_size=(0, right))
  except ValueError as e:  # refusing clearly would be fine too
    assert "local_window_size" in str(e)
  else:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unsigned_lengths_beyond_int32(rng):
  """Lengths past the sequence mean "all of it" (as in jax.nn). jax_flash accepts any integer
  dtype and casts to int32: a uint32 length of 2**32 - 1 wraps to -1 and the batch element
  silently attends to nothing (fails on jax_flash 0.1.0). Either refuse or clamp."""
  q = random_array(rng, (2, 6, 2, 16), jnp.float32)
  k = random_array(rng, (2, 9, 1, 16), jnp.float32)
  want = _attention(q, k, k, "cpu", key_value_seq_lengths=np.array([3, 9], np.int32))
  try:
    got = _attention(q, k, k, "cpu",
                     key_value_seq_lengths=np.array([3, 2**32 - 1], np.uint32))
  except ValueError as e:
    assert "key_value_seq_lengths" in str(e)
  else:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
