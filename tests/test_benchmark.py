"""The benchmark's bookkeeping: FLOP counts and the derived backward rows."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import benchmark

CASE = benchmark.Case(batch=2, seq=1024, heads=4, head_dim=64, dtype="bfloat16", causal=True)


def measurement(peer, pass_name, times, status="ok"):
  return benchmark.Measurement(peer, CASE, pass_name, status, times_s=times)


def test_flops_follow_the_flash_attention_convention():
  forward = 4 * 2 * 1024**2 * 4 * 64 / 2
  assert CASE.flops("fwd") == forward
  assert CASE.flops("bwd") == 2.5 * forward
  assert CASE.flops("fwd+bwd") == 3.5 * forward


def test_backward_is_fwd_bwd_less_fwd():
  rows = benchmark.with_backward([measurement("a", "fwd", (1.0, 3.0, 2.0)),
                                  measurement("a", "fwd+bwd", (7.0, 5.0, 6.0))])
  (derived,) = [m for m in rows if m.pass_name == "bwd"]
  assert derived.ok and derived.median_s == pytest.approx(4.0) and "derived" in derived.reason
  assert derived.flop_rate("GFLOP/s") == pytest.approx(CASE.flops("bwd") / 4.0 / 1e9)


def test_backward_not_derived_from_failures_or_noise():
  rows = benchmark.with_backward([
      measurement("jax_flash", "fwd", (1.0,)), measurement("jax_flash", "fwd+bwd", (), "fails"),
      measurement("xla", "fwd", (2.0,)), measurement("xla", "fwd+bwd", (1.0,)),
      measurement("torch", "fwd", (1.0,)), measurement("torch", "fwd+bwd", (3.0,))])
  derived = {m.peer: m for m in rows if m.pass_name == "bwd"}
  assert derived["jax_flash"].status == "fails" and derived["xla"].status == "fails"
  assert derived["torch"].ok and derived["torch"].median_s == pytest.approx(2.0)
  table = benchmark.format_table(benchmark.CPU, rows)
  assert "| bwd |" in table and "no backward time" in table


def test_cli_writes_results_with_backward_rows(tmp_path):
  """The CLI on the CPU, tiny: every peer measured or marked, bwd rows derived, the
  deterministic flag recorded, the files written."""
  import json

  assert benchmark.main(["--platform", "cpu", "--seqs", "64", "--causal", "yes", "--reps", "1",
                         "--deterministic", "--out", str(tmp_path)]) == 0
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["settings"]["deterministic"] is True
  rows = {(m["peer"], m["pass"]) for m in results["measurements"]}
  assert {("jax_flash", "fwd"), ("jax_flash", "bwd"), ("jax_flash", "fwd+bwd")} <= rows
  assert "| bwd |" in (tmp_path / "table.md").read_text()


def test_cli_skips_named_peers(tmp_path):
  """--skip leaves a peer out (recorded, not run); jax_flash and unknown names are refused."""
  import json

  assert benchmark.main(["--platform", "cpu", "--seqs", "64", "--causal", "no", "--reps", "1",
                         "--skip", "torch", "--out", str(tmp_path)]) == 0
  measurements = json.loads((tmp_path / "results.json").read_text())["measurements"]
  torch_rows = [m for m in measurements if m["peer"] == "torch"]
  assert torch_rows and all(m["status"] == "unavailable" for m in torch_rows)
  assert all("--skip" in m["reason"] for m in torch_rows)
  assert any(m["peer"] == "xla" and m["status"] == "ok" for m in measurements)
  for bad in ("jax_flash", "cudnn"):
    with pytest.raises(SystemExit):
      benchmark.main(["--platform", "cpu", "--skip", bad])


# A GPU-platform case small enough to make its inputs anywhere (no peer runs it below).
GPU_CASE = benchmark.Case(batch=1, seq=16, heads=2, head_dim=8, dtype="bfloat16", causal=True)
OTHER_GPU_PEERS = ("jax_flash", "cudnn", "xla", "pallas")


def run_gpu_table(skip):
  """The GPU platform's table for GPU_CASE with the peers in `skip` left out."""
  measurements = [m for results in benchmark.run(benchmark.GPU, [GPU_CASE], reps=1, skip=skip)
                  for m in results]
  return measurements, benchmark.format_table(benchmark.GPU, benchmark.with_backward(measurements))


def test_tokamax_unavailable_is_reported_with_its_reason(monkeypatch):
  """Without tokamax (it needs Python >= 3.12) its cells read 'unavailable', the note says why,
  and its columns sit beside cuDNN's."""
  monkeypatch.setitem(sys.modules, "tokamax", None)  # `import tokamax` fails, installed or not
  reason = benchmark.TOKAMAX_GPU.unavailable()
  assert reason is not None and "tokamax" in reason

  measurements, table = run_gpu_table(skip=OTHER_GPU_PEERS)
  tokamax = [m for m in measurements if m.peer == "tokamax"]
  assert [m.pass_name for m in tokamax] == list(benchmark.PASSES)
  assert all(m.status == "unavailable" and m.reason == reason for m in tokamax)
  header = table.splitlines()[0]
  for column in ("cudnn TFLOP/s | tokamax TFLOP/s", "flash/cudnn | flash/tokamax",
                 "temp MiB cudnn | temp MiB tokamax"):
    assert column in header
  assert f"- tokamax unavailable: {reason}" in table


def test_tokamax_that_imports_without_the_function_is_unavailable(monkeypatch):
  monkeypatch.setitem(sys.modules, "tokamax", types.ModuleType("tokamax"))
  assert "dot_product_attention" in benchmark.TOKAMAX_GPU.unavailable()


def test_skip_tokamax():
  """--skip tokamax is a GPU option (its cells recorded as skipped); the CPU platform has no
  tokamax peer and refuses it."""
  args = benchmark.parse_args(["--platform", "gpu", "--skip", "tokamax", "pallas"])
  assert args.skip == ["tokamax", "pallas"]
  with pytest.raises(SystemExit):
    benchmark.parse_args(["--platform", "cpu", "--skip", "tokamax"])

  measurements, table = run_gpu_table(skip=(*OTHER_GPU_PEERS, "tokamax"))
  assert all(m.reason == "skipped (--skip)" for m in measurements if m.peer == "tokamax")
  assert "- tokamax unavailable: skipped (--skip)" in table


# 4 x 4 blocks of jax_flash.BLOCK_MASK_BLOCK (128 x 128).
SPARSE_CASE = benchmark.Case(batch=1, seq=512, heads=2, head_dim=32, dtype="float32",
                             causal=True, block_density=0.5)


def test_block_sparse_flops_count_only_the_computed_blocks():
  """A block-sparse case's mask: fixed by its seed, every diagonal block set; its FLOPs are the
  dense convention's times the share of blocks it computes (diagonal blocks half when causal),
  so an all-True mask counts exactly the dense FLOPs."""
  mask = SPARSE_CASE.block_mask()
  assert mask.shape == (4, 4) and mask.dtype == bool and np.all(np.diagonal(mask))
  assert mask.shape == jax_flash.block_mask_shape(SPARSE_CASE.seq, SPARSE_CASE.seq)
  np.testing.assert_array_equal(mask, SPARSE_CASE.block_mask())
  below = np.tril(mask, -1).sum()
  fraction = (below + 0.5 * 4) / (6 + 0.5 * 4)  # of 6 blocks below the diagonal and 4 on it
  assert SPARSE_CASE.computed_fraction() == pytest.approx(fraction)
  dense = SPARSE_CASE.dense()
  assert dense.block_density is None and dense.block_mask() is None
  for pass_name in ("fwd", "bwd", "fwd+bwd"):
    assert SPARSE_CASE.flops(pass_name) == pytest.approx(fraction * dense.flops(pass_name))
  full = dataclasses.replace(SPARSE_CASE, block_density=1.0)
  assert full.flops("fwd") == dense.flops("fwd")
  non_causal = dataclasses.replace(SPARSE_CASE, causal=False)
  assert non_causal.computed_fraction() == pytest.approx(mask.sum() / 16)


def test_block_sparse_peers():
  """jax_flash's CPU and CUDA kernels and XLA (the mask expanded) run block-sparse cases;
  cuDNN, Pallas, tokamax and PyTorch's flash kernel are unavailable for them, with the reason;
  every peer runs the dense twin."""
  for peer in (benchmark.CPU.peers[0], benchmark.GPU.peers[0],
               *[p for p in benchmark.CPU.peers if p.name == "xla"],
               *[p for p in benchmark.GPU.peers if p.name == "xla"]):
    assert peer.case_unavailable(SPARSE_CASE) is None, peer.name
  for peer in (*benchmark.GPU.peers, *benchmark.CPU.peers):
    assert peer.case_unavailable(SPARSE_CASE.dense()) is None
  for peer in (p for p in (*benchmark.GPU.peers[1:], *benchmark.CPU.peers[1:]) if p.name != "xla"):
    assert "mask" in peer.case_unavailable(SPARSE_CASE), peer.name


def test_cli_block_density(tmp_path):
  """--block-density: each case block-sparse, then dense, in one run; jax_flash and XLA run the
  block-sparse one (the same result), the table has a blocks column and the speed-up lines."""
  import json

  assert benchmark.main(["--platform", "cpu", "--seqs", "512", "--head-dims", "32", "--causal",
                         "yes", "--reps", "1", "--block-density", "0.5", "--skip", "torch",
                         "--out", str(tmp_path)]) == 0
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["settings"]["block_density"] == 0.5
  ran = {(m["peer"], m["block_density"], m["pass"]) for m in results["measurements"]
         if m["status"] == "ok"}
  for peer in ("jax_flash", "xla"):
    for density in (0.5, None):
      assert {(peer, density, "fwd"), (peer, density, "fwd+bwd")} <= ran
  sparse = [m for m in results["measurements"] if m["block_density"] == 0.5]
  assert all(m["flop"] < 0.9 * benchmark.Case(1, 512, 4, 32, "float32", True).flops(m["pass"])
             for m in sparse)
  table = (tmp_path / "table.md").read_text()
  assert "| causal | blocks | pass |" in table and "| dense | fwd |" in table
  assert "- jax_flash block-sparse (" in table and "density 0.5) against dense, seq 512" in table
  for bad in ("0", "1.5", "x"):
    with pytest.raises(SystemExit):
      benchmark.parse_args(["--block-density", bad])
  with pytest.raises(SystemExit):
    benchmark.parse_args(["--block-density", "0.5", "--preset", "decode"])


def test_block_sparse_outputs_agree():
  """The peers of a block-sparse case compute the same attention: jax_flash with the block mask
  and XLA with it expanded to an element mask."""
  inputs = benchmark.make_inputs(SPARSE_CASE)
  outputs = {}
  for peer in (benchmark.CPU.peers[0], *[p for p in benchmark.CPU.peers if p.name == "xla"]):
    attention = peer.build.args[0]
    outputs[peer.name] = np.asarray(attention(*inputs.arrays()[:3], is_causal=True,
                                              block_mask=inputs.block_mask))
  dense = np.asarray(jax.nn.dot_product_attention(*inputs.arrays()[:3], is_causal=True))
  np.testing.assert_allclose(outputs["jax_flash"], outputs["xla"], atol=2e-5)
  assert not np.allclose(outputs["jax_flash"], dense, atol=1e-3)


def test_interleave_times_a_block_sparse_case_with_its_dense_twin():
  """--interleave times a block-sparse case and its dense twin in the same rounds (one group:
  their ratio is the figure that matters); other cases alone."""
  small = dataclasses.replace(SPARSE_CASE, seq=256)  # 2 x 2 blocks
  cases = benchmark.block_sparse_cases([small, dataclasses.replace(small, causal=False)], 0.5)
  groups = list(benchmark.run(benchmark.CPU, cases, reps=1, skip=("xla", "torch"),
                              interleave=True))
  assert [[m.case for m in group if m.peer == "jax_flash" and m.pass_name == "fwd"]
          for group in groups] == [cases[:2], cases[2:]]
  assert all(m.ok for group in groups for m in group if m.peer == "jax_flash")


@pytest.mark.parametrize("interleave", [True, False])
def test_interleaved_rounds_let_the_cpu_settle_before_each_run(monkeypatch, interleave):
  """Under --interleave each timed run on the CPU follows a pause of Platform.settle_s (a peer's
  OpenMP workers spin on after its call and would slow the next peer's run); back-to-back
  timing runs one peer's repetitions together and pauses never."""
  from jax_flash.benchmark import runner

  pauses = []
  monkeypatch.setattr(runner.time, "sleep", pauses.append)
  case = benchmark.CPU.make_cases((64,), (32,), (True,))[0]
  [measurements] = list(benchmark.run(benchmark.CPU, [case], reps=3, skip=("xla", "torch"),
                                      interleave=interleave))
  timed = [m for m in measurements if m.ok]
  assert timed and benchmark.CPU.settle_s > 0
  if interleave:
    assert pauses == [benchmark.CPU.settle_s] * sum(len(m.times_s) for m in timed)
  else:
    assert pauses == []


def test_interleaved_runs_repeat_short_steps_for_min_run_s(monkeypatch):
  """Under --interleave a timed run repeats a step shorter than Platform.min_run_s back to back
  (ceil(min_run_s / its warm-up time) times) and records the time a call; a step longer than
  min_run_s runs once a timed run."""
  from jax_flash.benchmark import runner
  from jax_flash.benchmark.measure import Compiled
  from jax_flash.benchmark.peers import Peer

  monkeypatch.setattr(runner.time, "sleep", lambda s: None)
  clock = [0.0]
  monkeypatch.setattr(runner.time, "perf_counter", lambda: clock[0])  # the one time module
  calls = {"fwd": 0, "fwd+bwd": 0}
  lasting = {"fwd": 0.01, "fwd+bwd": 0.3}  # seconds a call of each pass takes

  def prepare(pass_name):
    def step():
      calls[pass_name] += 1
      clock[0] += lasting[pass_name]
    return lambda: Compiled(step, None)

  peer = Peer(name="fake", label="fake", unavailable=lambda: None,
              build=lambda case, inputs: {p: prepare(p) for p in lasting})
  platform = dataclasses.replace(benchmark.CPU, min_run_s=0.1, warm_up_runs=1)
  case = benchmark.CPU.make_cases((64,), (32,), (True,))[0]
  fwd, both = runner.measure_interleaved(platform, [(peer, None, case, None)], reps=3)
  assert calls == {"fwd": 1 + 3 * 10, "fwd+bwd": 1 + 3}  # a warm-up, then 3 rounds
  assert fwd.times_s == pytest.approx((0.01,) * 3) and both.times_s == pytest.approx((0.3,) * 3)


# Score variants (--logits-soft-cap, --alibi, --sinks, --dropout-rate): jax_flash plain and with
# the variant in the same run.
TINY_CPU_RUN = ["--platform", "cpu", "--seqs", "64", "--causal", "yes", "--reps", "1"]
DEFAULT_CPU_HEADER = ("| seq | hdim | causal | pass | jax_flash ms | GFLOP/s | xla GFLOP/s | "
                      "torch GFLOP/s | flash/xla | flash/torch | temp MiB flash | temp MiB xla |")


def table_lines(capsys):
  """The lines of the table main() printed, from its header on."""
  lines = capsys.readouterr().out.splitlines()
  return lines[next(i for i, line in enumerate(lines) if line.startswith("| seq |")):]


def test_default_table_has_no_variant_columns(capsys):
  """Without a variant flag the table's header is the one it always was, no variant anywhere
  (nor a heads column: that needs --heads or --kv-heads)."""
  assert benchmark.main([*TINY_CPU_RUN, "--skip", "xla", "torch"]) == 0
  out = capsys.readouterr().out
  header = next(line for line in out.splitlines() if line.startswith("| seq |"))
  assert header in (DEFAULT_CPU_HEADER, DEFAULT_CPU_HEADER + " flash % FMA peak |")
  assert "variant" not in out and "heads" not in header


def test_cli_score_variant_columns(tmp_path, capsys):
  """--alibi --logits-soft-cap: jax_flash plain and with the variant on the same case, the
  variant's rate and its time over the plain one's; XLA (through jax.nn: ALiBi only, as a bias)
  and PyTorch's flash kernel unavailable for it, with the reason; recorded in results.json and
  said above the table with the CUDA score modifications' switch."""
  import json

  assert benchmark.main([*TINY_CPU_RUN, "--alibi", "--logits-soft-cap", "30",
                         "--out", str(tmp_path)]) == 0
  lines = table_lines(capsys)
  header = [cell.strip() for cell in lines[0].strip("|").split("|")]
  for column in ("jax_flash GFLOP/s", "jax_flash+variant GFLOP/s", "variant/plain time",
                 "xla+variant GFLOP/s", "flash+v/xla+v", "temp MiB flash+v"):
    assert column in header
  fwd = dict(zip(header, (cell.strip() for cell in lines[2].strip("|").split("|"))))
  assert fwd["pass"] == "fwd" and fwd["variant/plain time"].endswith("x")
  assert fwd["xla+variant GFLOP/s"] == "unavailable"
  table = (tmp_path / "table.md").read_text()
  assert "- xla+variant unavailable: jax.nn.dot_product_attention takes no logits_soft_cap" in table
  assert "logits_soft_cap=30, alibi_slopes" in table
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["settings"]["variant"] == dict(logits_soft_cap=30.0, alibi=True, sinks=False,
                                                dropout_rate=None, bias=False, mask=False,
                                                bias_grad=False)
  ran = {(m["peer"], m["pass"]) for m in results["measurements"] if m["status"] == "ok"}
  assert {("jax_flash", "fwd+bwd"), ("jax_flash+variant", "fwd+bwd")} <= ran


def test_cli_bias_and_mask_variant(tmp_path, capsys):
  """--bias --mask: jax_flash with the (1, N, T, S) bias and the (T, S) band mask beside XLA
  through jax.nn with the same arrays (it takes both): their outputs agree, the table says what
  the arrays are and results.json records them."""
  import json

  from jax_flash.benchmark.variants import Variant, band_mask, position_bias

  assert benchmark.main([*TINY_CPU_RUN, "--bias", "--mask", "--skip", "torch",
                         "--out", str(tmp_path)]) == 0
  lines = table_lines(capsys)
  header = [cell.strip() for cell in lines[0].strip("|").split("|")]
  fwd = dict(zip(header, (cell.strip() for cell in lines[2].strip("|").split("|"))))
  assert fwd["xla+variant GFLOP/s"] != "unavailable" and fwd["jax_flash+variant GFLOP/s"] != "unavailable"
  table = (tmp_path / "table.md").read_text()
  assert "bias: a (1, N, T, S) array sin(0.01 (i + 2j) + h)" in table and "mask: a (T, S) band" in table
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["settings"]["variant"]["bias"] and results["settings"]["variant"]["mask"]
  # The arrays themselves, and the same attention from both peers.
  q = jax.random.normal(jax.random.key(0), (1, 20, 2, 16))  # T <= S: every row keeps a key
  k = jax.random.normal(jax.random.key(1), (1, 24, 2, 16))
  bias = position_bias(q, k)
  assert bias.shape == (1, 2, 20, 24) and float(bias[0, 1, 3, 5]) == pytest.approx(np.sin(0.13 + 1))
  mask = np.asarray(band_mask(20, 24))
  assert mask[10, 5] and mask[10, 16] and not mask[10, 4] and not mask[10, 17]
  variant = Variant(bias=True, mask=True)
  from jax_flash.benchmark import variants
  flash = variants._flash_attention("cpu", False, variant)(q, k, k, is_causal=False)
  xla = variants._jax_nn_attention("xla", variant)(q, k, k, is_causal=False)
  np.testing.assert_allclose(np.asarray(flash), np.asarray(xla), atol=2e-5)


# --bias-grad: the same position bias, differentiated (the fwd+bwd pass returns dbias).
BIAS_GRAD_CASE = benchmark.Case(batch=2, seq=16, heads=2, head_dim=8, dtype="float32",
                                causal=False)


def test_bias_grad_option_parses():
  """--bias-grad implies --bias and differentiates it; --bias alone does not; Variant refuses
  bias_grad without bias."""
  from jax_flash.benchmark.variants import Variant

  args = benchmark.parse_args(["--platform", "cpu", "--bias-grad"])
  assert args.variant == Variant(bias=True, bias_grad=True)
  assert args.variant.features() == ("bias",) and args.variant.differentiated() is not None
  plain = benchmark.parse_args(["--platform", "cpu", "--bias"]).variant
  assert plain == Variant(bias=True) and not plain.bias_grad and plain.differentiated() is None
  assert benchmark.parse_args(["--platform", "cpu", "--bias", "--bias-grad"]).variant.bias_grad
  with pytest.raises(SystemExit):
    benchmark.parse_args(["--platform", "cpu", "--bias-grad", "--block-density", "0.5"])
  with pytest.raises(ValueError, match="needs bias"):
    Variant(bias_grad=True)
  assert "differentiated" in Variant(bias=True, bias_grad=True).describe()
  assert "differentiated" not in Variant(bias=True).describe()


def _built_passes(monkeypatch, peer, case):
  """The (function, arguments) of each pass `peer` builds for `case`, instead of compiling
  them: {pass: (fn, args)}."""
  from jax_flash.benchmark import peers

  monkeypatch.setattr(peers, "compile_step", lambda fn, args, calls: (fn, tuple(args)))
  prepares = peer.build(case, benchmark.make_inputs(case))
  return {name: prepare() for name, prepare in prepares.items()}


def _variant_peers(variant):
  """The CPU platform's peers with `variant`, by name."""
  from jax_flash.benchmark.variants import with_variant

  return {p.name: p for p in with_variant(benchmark.CPU, variant).peers}


@pytest.mark.parametrize("causal", [False, True])
def test_bias_grad_pass_returns_dbias_of_jax_nn(monkeypatch, causal):
  """With --bias-grad, the fwd+bwd pass of jax_flash+variant (and of xla+variant) returns
  dbias in the bias's (1, N, T, S) shape, summed over the batch of 2: that of jax.grad of
  jax.nn.dot_product_attention (implementation="xla") with the same bias, and the same dq, dk,
  dv; the forward pass is --bias's."""
  from jax_flash.benchmark.variants import Variant, position_bias

  case = dataclasses.replace(BIAS_GRAD_CASE, causal=causal)
  q, k, v, d_out = (jnp.asarray(x) for x in benchmark.make_inputs(case).arrays())
  bias = position_bias(q, k)
  assert bias.shape == (1, case.heads, case.seq, case.seq)

  def loss(q, k, v, bias):
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=causal,
                                       implementation="xla")
    return jnp.sum(out * d_out)

  expected = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
  peers = _variant_peers(Variant(bias=True, bias_grad=True))
  for name in ("jax_flash+variant", "xla+variant"):
    passes = _built_passes(monkeypatch, peers[name], case)
    fn, args = passes["fwd+bwd"]
    out, grads = jax.jit(fn)(*args)
    assert len(grads) == 4 and set(grads[3]) == {"bias"}
    dbias = grads[3]["bias"]
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    np.testing.assert_allclose(np.asarray(dbias), np.asarray(expected[3]), rtol=1e-4, atol=1e-5)
    for got, want in zip(grads[:3], expected[:3]):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    # The forward pass takes q, k, v as the --bias one does, and gives the same output.
    forward, forward_args = passes["fwd"]
    assert len(forward_args) == 3
    np.testing.assert_allclose(np.asarray(jax.jit(forward)(*forward_args)), np.asarray(out),
                               rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(expected[3])).max() > 1e-3  # a dbias that is not zero to match


def test_bias_without_grad_pass_is_unchanged(monkeypatch):
  """Without --bias-grad the fwd+bwd pass returns dq, dk and dv only (no dbias), as before."""
  from jax_flash.benchmark.variants import Variant

  for name, peer in _variant_peers(Variant(bias=True)).items():
    if name in ("jax_flash", "jax_flash+variant", "xla+variant"):
      fn, args = _built_passes(monkeypatch, peer, BIAS_GRAD_CASE)["fwd+bwd"]
      _, grads = jax.jit(fn)(*args)
      assert len(grads) == 3 and [g.shape for g in grads] == [a.shape for a in args[:3]]


def test_bias_grad_refusal_makes_the_peer_unavailable():
  """A kernel whose backward refuses the bias's gradient (NotImplementedError at trace time)
  is refused for --bias-grad only: with the bias constant its backward runs."""
  from jax_flash.benchmark.peers import trace_refusal
  from jax_flash.benchmark.variants import Variant

  @jax.custom_vjp
  def no_dbias(bias):
    return bias

  def refuse(residuals, g):
    raise NotImplementedError("no dbias (test)")

  no_dbias.defvjp(lambda bias: (bias, None), refuse)

  def attention(q, k, v, *, is_causal, bias=None):
    bias = Variant(bias=True).arrays(q, k)["bias"] if bias is None else no_dbias(bias)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=is_causal)

  differentiated = Variant(bias=True, bias_grad=True).differentiated()
  assert trace_refusal(attention, BIAS_GRAD_CASE) is None
  assert (trace_refusal(attention, BIAS_GRAD_CASE, differentiated=differentiated)
          == "NotImplementedError: no dbias (test)")


def test_cli_bias_grad(tmp_path, capsys):
  """--bias-grad on the CPU, tiny: jax_flash and XLA run the variant forward and backward, the
  caption says the bias is differentiated and results.json records it."""
  import json

  assert benchmark.main([*TINY_CPU_RUN, "--bias-grad", "--skip", "torch",
                         "--out", str(tmp_path)]) == 0
  lines = table_lines(capsys)
  header = [cell.strip() for cell in lines[0].strip("|").split("|")]
  rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
          for line in lines[2:] if line.startswith("| 64 |")]
  assert [row["pass"] for row in rows] == ["fwd", "bwd", "fwd+bwd"]
  for row in rows:
    assert "unavailable" not in (row["jax_flash+variant GFLOP/s"], row["xla+variant GFLOP/s"])
  table = (tmp_path / "table.md").read_text()
  assert "formed in the step and differentiated (fwd+bwd returns dbias" in table
  variant = json.loads((tmp_path / "results.json").read_text())["settings"]["variant"]
  assert variant["bias"] and variant["bias_grad"]


def test_cli_refused_variant_is_unavailable(monkeypatch, capsys):
  """A variant the jax_flash kernel refuses at trace time (NotImplementedError, as the CUDA
  kernels refuse dropout) reads 'unavailable' with the reason; the plain kernel still runs."""
  import jax_flash

  original = jax_flash.dot_product_attention

  def refusing(*args, dropout_rate=0.0, **kwargs):
    if dropout_rate:
      raise NotImplementedError("'cuda' does not take dropout_rate (test)")
    return original(*args, **kwargs)

  monkeypatch.setattr(jax_flash, "dot_product_attention", refusing)
  assert benchmark.main([*TINY_CPU_RUN, "--dropout-rate", "0.1", "--skip", "xla", "torch"]) == 0
  lines = table_lines(capsys)
  header = [cell.strip() for cell in lines[0].strip("|").split("|")]
  rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
          for line in lines[2:] if line.startswith("| 64 |")]
  assert [row["pass"] for row in rows] == ["fwd", "bwd", "fwd+bwd"]
  assert all(row["jax_flash+variant GFLOP/s"] == "unavailable" for row in rows)
  assert all(row["jax_flash GFLOP/s"] != "unavailable" for row in rows)
  assert ("- jax_flash+variant unavailable: NotImplementedError: 'cuda' does not take "
          "dropout_rate (test)") in lines
  assert "- xla+variant unavailable: skipped (--skip)" in lines


def test_gpu_variant_peers_say_what_they_take():
  """On the GPU platform: cuDNN and XLA through jax.nn take ALiBi (as a bias) and nothing else,
  Pallas nothing; each cell of a peer that cannot take the variant says why."""
  from jax_flash.benchmark.variants import Variant, with_variant

  platform = with_variant(benchmark.GPU, Variant(logits_soft_cap=30.0, dropout_rate=0.1))
  assert [p.name for p in platform.peers] == [
      "jax_flash", "jax_flash+variant", "cudnn+variant", "tokamax+variant", "xla+variant",
      "pallas+variant"]
  measurements = [m for results in benchmark.run(platform, [GPU_CASE], reps=1,
                                                 skip=("tokamax+variant",)) for m in results]
  assert all(not m.ok for m in measurements)
  table = benchmark.format_table(platform, benchmark.with_backward(measurements))
  for peer in ("cudnn", "xla"):
    assert (f"- {peer}+variant unavailable: jax.nn.dot_product_attention takes no "
            "logits_soft_cap, dropout_rate") in table
  assert "- pallas+variant unavailable: Pallas' mha takes no logits_soft_cap" in table
  alibi = with_variant(benchmark.GPU, Variant(alibi=True))
  assert {p.name: p.unavailable() for p in alibi.peers[2:]}["cudnn+variant"] is None


def test_variant_arguments_are_checked():
  for bad in (["--logits-soft-cap", "0"], ["--logits-soft-cap", "inf"], ["--dropout-rate", "1"],
              ["--alibi", "--block-density", "0.5"], ["--sinks", "--preset", "decode"]):
    with pytest.raises(SystemExit):
      benchmark.parse_args(["--platform", "cpu", *bad])
  args = benchmark.parse_args(["--platform", "cpu", "--sinks", "--dropout-rate", "0.2"])
  assert args.variant.features() == ("sinks", "dropout_rate")
  assert benchmark.parse_args(["--platform", "cpu"]).variant is None


# Packed documents (--packed-documents D): jax_flash with segment ids beside itself on the same
# tokens as separate rows, and the peers that can express the packed mask.
PACKED_CASE = benchmark.Case(batch=1, seq=256, heads=4, head_dim=32, dtype="float32",
                             causal=True, documents=4)
PACKED_CPU_RUN = ["--platform", "cpu", "--seqs", "256", "--head-dims", "32", "--causal", "yes",
                  "--reps", "1", "--packed-documents", "4"]


def table_rows(lines):
  """The table's header cells and its rows as dicts by header (lines from table_lines)."""
  def cells(line):
    return [cell.strip() for cell in line.strip("|").split("|")]

  header = cells(lines[0])
  return header, [dict(zip(header, cells(line))) for line in lines[2:] if line.startswith("| ")]


def test_packed_flops_count_only_the_document_pairs():
  """A packed case's FLOPs: D documents of (S/D)^2 pairs, halved when causal (a hand count),
  the same as the separate rows' (B*D rows of S/D tokens); ids sorted, end to end."""
  forward = 4 * 4 * 64**2 * 4 * 32 / 2  # 4 * documents * (256/4)^2 * heads * head dim, causal
  assert PACKED_CASE.flops("fwd") == forward
  assert PACKED_CASE.flops("fwd+bwd") == 3.5 * forward
  separate = benchmark.Case(batch=4, seq=64, heads=4, head_dim=32, dtype="float32", causal=True)
  assert PACKED_CASE.flops("fwd") == separate.flops("fwd")
  non_causal = dataclasses.replace(PACKED_CASE, causal=False)
  assert non_causal.flops("fwd") == 2 * forward
  np.testing.assert_array_equal(PACKED_CASE.document_ids(), np.repeat(np.arange(4), 64))
  assert benchmark.packed_cases([PACKED_CASE.dense()], 4)[0].documents == 4
  with pytest.raises(ValueError, match="seq 256 is not divisible by 3"):
    benchmark.packed_cases([PACKED_CASE], 3)


def _has_torch() -> bool:
  try:
    import torch  # noqa: F401  (only whether it imports)
  except ImportError:
    return False
  return True


def _packed_inputs_and_reference(causal: bool):
  """A small packed case (4 documents of 32 tokens), its inputs, and each document's attention
  computed on its own by jax.nn."""
  case = dataclasses.replace(PACKED_CASE, seq=128, heads=2, causal=causal)
  q, k, v, _ = benchmark.make_inputs(case).arrays()
  documents = [slice(i * 32, (i + 1) * 32) for i in range(4)]
  reference = np.concatenate([jax.nn.dot_product_attention(q[:, d], k[:, d], v[:, d],
                                                           is_causal=causal)
                              for d in documents], axis=1)
  return case, (q, k, v), reference


@pytest.mark.parametrize("causal", [True, False])
def test_packed_outputs_agree(causal):
  """The JAX peers of a packed case compute the same attention: each document on its own."""
  from jax_flash.benchmark import peers

  _, (q, k, v), reference = _packed_inputs_and_reference(causal)
  for peer in (peers.FLASH_CPU, peers.XLA_CPU, peers.separate_flash_peer("cpu", "cpu")):
    out = peer.build.args[0](q, k, v, is_causal=causal, documents=4)
    np.testing.assert_allclose(out, reference, atol=2e-5, err_msg=peer.name)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_torch_mask_agrees(causal):
  """PyTorch's attn_mask for a packed case gives each document's attention (where torch is
  installed: it is an optional peer)."""
  torch = pytest.importorskip("torch")
  from jax_flash.benchmark import peers

  case, (q, k, v), reference = _packed_inputs_and_reference(causal)
  q_t, k_t, v_t = (torch.from_numpy(np.ascontiguousarray(x.swapaxes(1, 2))) for x in (q, k, v))
  out = torch.nn.functional.scaled_dot_product_attention(q_t, k_t, v_t,
                                                         attn_mask=peers.torch_attn_mask(case))
  np.testing.assert_allclose(out.numpy().swapaxes(1, 2), reference, atol=2e-5)


def test_cli_packed_documents(tmp_path, capsys):
  """--packed-documents 4 on the CPU: jax_flash packed and its separate-rows baseline, their
  rates and time ratio; XLA with the mask; PyTorch's flash kernel with an attn_mask (or
  unavailable saying so); the FLOPs of a packed row, the caption, the settings. The CUDA
  kernels' segment ids have no switch any more: neither the caption nor the environment
  record names one."""
  import json

  assert benchmark.main([*PACKED_CPU_RUN, "--out", str(tmp_path)]) == 0
  lines = table_lines(capsys)
  header, rows = table_rows(lines)
  assert header[:10] == ["seq", "hdim", "causal", "docs", "pass", "jax_flash_separate ms",
                         "jax_flash ms", "jax_flash_separate GFLOP/s", "jax_flash GFLOP/s",
                         "packed/separate time"]
  for column in ("xla GFLOP/s", "torch GFLOP/s", "flash/xla", "temp MiB flash sep"):
    assert column in header
  assert [row["pass"] for row in rows] == ["fwd", "bwd", "fwd+bwd"]
  assert all(row["docs"] == "4x64" for row in rows)
  for row in (rows[0], rows[2]):  # fwd, fwd+bwd (bwd is derived, and may not be at --reps 1)
    ratio = float(row["packed/separate time"].rstrip("x"))
    assert ratio == pytest.approx(float(row["jax_flash ms"]) / float(row["jax_flash_separate ms"]),
                                  rel=0.05, abs=0.01)  # the ms cells are rounded
  table = (tmp_path / "table.md").read_text()
  assert "FLOPs count only the pairs within documents" in table
  assert "SEGMENT_IDS" not in table
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["settings"]["packed_documents"] == 4
  assert results["settings"]["block_density"] is None and results["settings"]["variant"] is None
  assert not any("segment_ids" in name for name in results["environment"])
  by_peer = {(m["peer"], m["pass"]): m for m in results["measurements"]}
  for peer in ("jax_flash", "jax_flash_separate", "xla"):
    for pass_name in ("fwd", "fwd+bwd"):
      m = by_peer[(peer, pass_name)]
      assert m["status"] == "ok" and m["documents"] == 4, m
      assert m["flop"] == PACKED_CASE.flops(pass_name)
  assert by_peer[("jax_flash", "fwd")]["flop"] == 4 * 4 * 64**2 * 4 * 32 / 2
  torch_fwd = by_peer[("torch", "fwd")]
  if not _has_torch():  # an optional peer: unavailable without it
    assert torch_fwd["status"] == "unavailable", torch_fwd
  else:
    assert torch_fwd["status"] == "ok" or "attn_mask" in torch_fwd["reason"]


def test_cli_refused_segment_ids_are_unavailable(monkeypatch, capsys):
  """A kernel that refuses segment ids at trace time (none does now: the "cpu" and "cuda"
  kernels both take them; here a stand-in refuses) leaves jax_flash's packed cells
  'unavailable' with the NotImplementedError's reason; the separate rows still run."""
  import jax_flash

  original = jax_flash.dot_product_attention

  def refusing(*args, q_segment_ids=None, kv_segment_ids=None, **kwargs):
    if q_segment_ids is not None:
      raise NotImplementedError("'cuda' takes no segment ids yet (test)")
    return original(*args, **kwargs)

  monkeypatch.setattr(jax_flash, "dot_product_attention", refusing)
  assert benchmark.main([*PACKED_CPU_RUN, "--seqs", "128", "--reps", "5", "--skip", "xla", "torch"]) == 0
  out = capsys.readouterr().out
  lines = out.splitlines()
  _, rows = table_rows(lines[next(i for i, line in enumerate(lines)
                                  if line.startswith("| seq |")):])
  # The whole output in each message: its notes say why a cell is not a rate (CI once saw the
  # separate rows fail, and only this would have said why).
  assert all(row["jax_flash GFLOP/s"] == "unavailable" for row in rows), out
  # The separate rows ran: fwd and fwd+bwd are rates. The bwd row is fwd+bwd minus fwd, and at
  # this size a loaded CI machine has timed fwd+bwd under fwd even as medians of 5 (0.20 ms
  # against 0.24 ms), so it may be "fails", but only for that reason.
  measured = {row["pass"]: row["jax_flash_separate GFLOP/s"] for row in rows}
  assert all(measured[p] not in ("unavailable", "fails", "-") for p in ("fwd", "fwd+bwd")), out
  assert measured["bwd"] != "unavailable", out
  if measured["bwd"] == "fails":
    assert ("- jax_flash_separate fails: fwd+bwd no slower than fwd: no backward time to "
            "derive") in lines, out
  assert all(row["packed/separate time"] == "-" for row in rows), out
  assert ("- jax_flash unavailable: NotImplementedError: 'cuda' takes no segment ids yet "
          "(test)") in lines, out


def test_gpu_packed_peers():
  """On the GPU platform: jax_flash, its separate rows, then every peer with the packed mask
  (cuDNN, tokamax and XLA a bool mask, Pallas segment ids), their columns as the platform has
  them; the caption says how each takes the documents (and names no switch: the CUDA kernels
  take segment ids by default)."""
  from jax_flash.benchmark.packed import packed_caption

  platform = benchmark.with_packed_documents(benchmark.GPU)
  assert [p.name for p in platform.peers] == [
      "jax_flash", "jax_flash_separate", "cudnn", "tokamax", "xla", "pallas"]
  headers = [column.header for column in platform.columns]
  assert headers[:8] == ["seq", "hdim", "causal", "docs", "pass", "jax_flash_separate TFLOP/s",
                         "jax_flash TFLOP/s", "packed/separate time"]
  for header in ("cudnn TFLOP/s", "tokamax TFLOP/s", "flash/cudnn", "flash/pallas",
                 "temp MiB flash sep", "temp MiB xla"):
    assert header in headers
  packed = dataclasses.replace(GPU_CASE, documents=2)
  assert platform.peers[1].case_unavailable(GPU_CASE) is not None
  assert platform.peers[4].case_unavailable(packed) is None  # xla: no probe needed
  caption = packed_caption(platform, 16)
  assert "cudnn: a (B, 1, T, S) bool mask formed in the step" in caption
  assert "pallas: its (B, T) segment ids" in caption and "torch" not in caption
  assert "jax_flash: q_segment_ids = kv_segment_ids" in caption and "SEGMENT_IDS" not in caption


def test_packed_documents_arguments_are_checked(capsys):
  """A seq that D does not divide is refused naming the flag and the seq; D is a positive
  integer; the mode does not combine with the other modes."""
  with pytest.raises(SystemExit):
    benchmark.parse_args(["--platform", "cpu", "--seqs", "256,200", "--packed-documents", "16"])
  assert "--packed-documents 16: seq 200 is not divisible by 16" in capsys.readouterr().err
  for bad in (["--packed-documents", "0"], ["--packed-documents", "1.5"],
              ["--packed-documents", "4", "--block-density", "0.5"],
              ["--packed-documents", "4", "--alibi"],
              ["--packed-documents", "4", "--preset", "decode"]):
    with pytest.raises(SystemExit):
      benchmark.parse_args(["--platform", "cpu", "--seqs", "256", *bad])
  args = benchmark.parse_args(["--platform", "cpu", "--seqs", "256", "--packed-documents", "4"])
  assert args.packed_documents == 4
  assert benchmark.parse_args(["--platform", "cpu"]).packed_documents is None


# A value head dim of its own (--value-head-dim HV): v, the output and its cotangent have HV, q
# and k the case's head dim (MLA-style; issue 17's H=192, Hv=128 figure).
HV_CASE = dataclasses.replace(CASE, head_dim=64, value_head_dim=32)
HV_CPU_RUN = ["--platform", "cpu", "--seqs", "64", "--head-dims", "32", "--causal", "yes",
              "--reps", "1", "--value-head-dim", "16"]


def _flops_before_value_head_dim(case, pass_name):
  """Case.flops as it was before the value head dim: 4 B S^2 N H (halved when causal), times
  1, 2.5 or 3.5, times the computed fraction."""
  forward = 4.0 * case.batch * case.seq**2 * case.heads * case.head_dim
  if case.causal:
    forward /= 2
  factor = {"fwd": 1.0, "bwd": benchmark.FWD_BWD_FLOP_FACTOR - 1.0,
            "fwd+bwd": benchmark.FWD_BWD_FLOP_FACTOR}
  return forward * factor[pass_name] * case.computed_fraction()


def test_value_head_dim_flops_count_each_product_over_its_head_dim():
  """Forward S = QK^T over H and PV over Hv: 2 B N T S (H + Hv); backward S again, dQ and dK
  over H, dP and dV over Hv: 2 B N T S (3H + 2Hv); halved when causal (a hand count)."""
  pairs = 2 * 2 * 4 * 1024 * 1024 / 2  # 2 B N T S, causal
  assert HV_CASE.hv == 32 and HV_CASE.head_dim_label == "64/32"
  assert HV_CASE.flops("fwd") == pairs * (64 + 32)
  assert HV_CASE.flops("bwd") == pairs * (3 * 64 + 2 * 32)
  assert HV_CASE.flops("fwd+bwd") == pairs * (4 * 64 + 3 * 32)
  non_causal = dataclasses.replace(HV_CASE, causal=False)
  assert non_causal.flops("fwd") == 2 * HV_CASE.flops("fwd")
  packed = dataclasses.replace(HV_CASE, documents=4)
  assert packed.flops("bwd") == HV_CASE.flops("bwd") / 4


def test_value_head_dim_equal_to_head_dim_counts_as_before():
  """With Hv = H (the option left out, or given the case's head dim) every count is exactly
  today's: dense, causal or not, block-sparse, packed, every pass."""
  for case in (CASE, dataclasses.replace(CASE, causal=False), SPARSE_CASE,
               dataclasses.replace(SPARSE_CASE, causal=False), PACKED_CASE, GPU_CASE,
               benchmark.Case(batch=1, seq=16384, heads=16, head_dim=128, dtype="bfloat16",
                              causal=True)):
    for same in (case, dataclasses.replace(case, value_head_dim=case.head_dim)):
      for pass_name in ("fwd", "bwd", "fwd+bwd"):
        assert same.flops(pass_name) == _flops_before_value_head_dim(case, pass_name), (
            case, pass_name)
  assert CASE.value_head_dim is None and CASE.head_dim_label == "64"


def test_value_head_dim_inputs():
  """make_inputs: query and key of head dim H, value and output cotangent of Hv; with Hv = H
  the same arrays as without the option."""
  case = dataclasses.replace(PACKED_CASE, documents=None, value_head_dim=16)
  q, k, v, d_out = benchmark.make_inputs(case).arrays()
  assert q.shape == k.shape == (1, 256, 4, 32) and v.shape == d_out.shape == (1, 256, 4, 16)
  plain = benchmark.make_inputs(dataclasses.replace(case, value_head_dim=None)).arrays()
  same = benchmark.make_inputs(dataclasses.replace(case, value_head_dim=32)).arrays()
  for a, b in zip(plain, same, strict=True):
    np.testing.assert_array_equal(a, b)


def record_input_shapes(monkeypatch) -> list:
  """The list that each case's input shapes (query, key, value, cotangent) are appended to as
  the runner makes them."""
  from jax_flash.benchmark import runner

  shapes = []
  original = runner.make_inputs

  def recording(case, *args, **kwargs):
    inputs = original(case, *args, **kwargs)
    shapes.append(tuple(x.shape for x in inputs.arrays()))
    return inputs

  monkeypatch.setattr(runner, "make_inputs", recording)
  return shapes


def test_cli_value_head_dim(tmp_path, capsys, monkeypatch):
  """--value-head-dim on the CPU: the inputs each peer gets have v and dO of HV, q and k of
  the case's head dim; jax_flash runs (its output of HV); XLA (jax.nn) and PyTorch's flash
  kernel read 'unavailable' with the reason; the hdim column reads H/HV, the caption and
  results.json say so, the FLOPs are the honest count."""
  import json

  shapes = record_input_shapes(monkeypatch)
  assert benchmark.main([*HV_CPU_RUN, "--out", str(tmp_path)]) == 0
  assert shapes == [((1, 64, 4, 32), (1, 64, 4, 32), (1, 64, 4, 16), (1, 64, 4, 16))]
  _, rows = table_rows(table_lines(capsys))
  assert [row["pass"] for row in rows] == ["fwd", "bwd", "fwd+bwd"]
  assert all(row["hdim"] == "32/16" and row["xla GFLOP/s"] == "unavailable" for row in rows)
  assert rows[0]["GFLOP/s"] not in ("unavailable", "fails")
  table = (tmp_path / "table.md").read_text()
  assert "value head dim Hv=16" in table
  assert f"- xla unavailable: {peers_module().JAX_NN_NO_VALUE_HEAD_DIM}" in table
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["settings"]["value_head_dim"] == 16
  case = benchmark.Case(1, 64, 4, 32, "float32", True, value_head_dim=16)
  by_peer = {(m["peer"], m["pass"]): m for m in results["measurements"]}
  for pass_name in ("fwd", "fwd+bwd"):
    m = by_peer[("jax_flash", pass_name)]
    assert m["status"] == "ok" and m["value_head_dim"] == 16 and m["flop"] == case.flops(pass_name)
  torch_fwd = by_peer[("torch", "fwd")]
  # (PyTorch's CPU flash kernel refuses Hv != H; where PyTorch is not installed, as in CI, the
  # peer reads unavailable for that.)
  torch_missing = importlib.util.find_spec("torch") is None
  assert torch_fwd["status"] == "unavailable"
  assert ("not installed" if torch_missing else "value head dim") in torch_fwd["reason"]
  out = peers_module().FLASH_CPU.build.args[0](*benchmark.make_inputs(case).arrays()[:3],
                                               is_causal=True)
  assert out.shape == (1, 64, 4, 16)


def peers_module():
  from jax_flash.benchmark import peers

  return peers


def test_jax_nn_peers_take_no_value_head_dim():
  """jax.nn's xla and cudnn refuse a value of another head dim (a ValueError at trace time):
  their cells read 'unavailable' with the reason, on both platforms, packed or not; the same
  peers run the case with Hv = H; jax_flash takes it."""
  peers = peers_module()
  hv_case = dataclasses.replace(GPU_CASE, value_head_dim=4)
  with pytest.raises(ValueError):
    jax.eval_shape(lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
                   *benchmark.make_inputs(hv_case).arrays()[:3])
  jax_nn = [p for p in (*benchmark.GPU.peers, *benchmark.CPU.peers) if p.name in ("xla", "cudnn")]
  assert sorted(p.name for p in jax_nn) == ["cudnn", "xla", "xla"]
  for peer in jax_nn:
    for case in (hv_case, dataclasses.replace(hv_case, documents=2)):
      assert peer.case_unavailable(case) == peers.JAX_NN_NO_VALUE_HEAD_DIM, peer.name
    assert peer.case_unavailable(dataclasses.replace(hv_case, value_head_dim=8)) is None
  for flash in (benchmark.CPU.peers[0], benchmark.GPU.peers[0]):
    assert flash.case_unavailable(hv_case) is None

  measurements = [m for results in benchmark.run(benchmark.GPU, [hv_case], reps=1,
                                                 skip=("jax_flash", "tokamax", "pallas"))
                  for m in results]
  table = benchmark.format_table(benchmark.GPU, benchmark.with_backward(measurements))
  for name in ("cudnn", "xla"):
    cells = [m for m in measurements if m.peer == name]
    assert cells and all(m.status == "unavailable" for m in cells)
    assert f"- {name} unavailable: {peers.JAX_NN_NO_VALUE_HEAD_DIM}" in table
  assert "| 16 | 8/4 | Y | fwd |" in table
  if peers._pallas_unavailable() is None:  # Pallas' mha checks one head dim for q, k and v too
    assert benchmark.GPU.peers[-1].case_unavailable(hv_case) == peers.PALLAS_NO_VALUE_HEAD_DIM


def test_tokamax_is_given_the_value_head_dim(monkeypatch):
  """tokamax's dot_product_attention takes a value of another head dim (its value "*B S K h",
  output "*B T N h"): the peer passes v as it is and runs the case; a tokamax that refused it
  at trace time (NotImplementedError) would read 'unavailable' with its reason. (A stand-in
  module: tokamax needs Python >= 3.12.)"""
  hv_case = dataclasses.replace(GPU_CASE, value_head_dim=4)
  seen = []

  def attention(query, key, value, *, is_causal, implementation, **options):
    seen.append((query.shape, value.shape, implementation))
    return jax_flash.dot_product_attention(query, key, value, is_causal=is_causal,
                                           implementation="xla")

  monkeypatch.setitem(sys.modules, "tokamax",
                      types.SimpleNamespace(dot_product_attention=attention))
  assert benchmark.TOKAMAX_GPU.case_unavailable(hv_case) is None
  assert seen[0] == ((1, 16, 2, 8), (1, 16, 2, 4), "mosaic")

  def refusing(*args, **kwargs):
    raise NotImplementedError("no Hv here (test)")

  monkeypatch.setitem(sys.modules, "tokamax", types.SimpleNamespace(dot_product_attention=refusing))
  assert (benchmark.TOKAMAX_GPU.case_unavailable(hv_case)
          == "NotImplementedError: no Hv here (test)")


def test_value_head_dim_arguments_are_checked():
  for bad in (["--value-head-dim", "0"], ["--value-head-dim", "1.5"], ["--value-head-dim", "x"],
              ["--value-head-dim", "128", "--preset", "decode"]):
    with pytest.raises(SystemExit):
      benchmark.parse_args(["--platform", "cpu", *bad])
  assert benchmark.parse_args(["--platform", "gpu", "--value-head-dim", "128"]).value_head_dim == 128
  assert benchmark.parse_args(["--platform", "cpu"]).value_head_dim is None


# Grouped-query cases (--heads N --kv-heads K): k and v of K heads, each shared by N/K query
# heads; q, the output and its cotangent keep N; FLOPs count the query heads.
GQA_CASE = dataclasses.replace(CASE, seq=64, dtype="float32", kv_heads=2)
GQA_CPU_RUN = ["--platform", "cpu", "--seqs", "64", "--causal", "yes", "--reps", "1",
               "--heads", "4", "--kv-heads", "2"]


def test_grouped_heads_case_inputs_and_flops():
  """make_inputs: query and cotangent of N heads, key and value of K; with K = N the same
  arrays as without kv_heads; the FLOPs those of K = N (they count the query heads); K must
  divide N."""
  assert GQA_CASE.num_kv_heads == 2 and GQA_CASE.heads_label == "4/2"
  assert CASE.num_kv_heads == 4 and CASE.heads_label == "4"
  q, k, v, d_out = benchmark.make_inputs(GQA_CASE).arrays()
  assert q.shape == d_out.shape == (2, 64, 4, 64) and k.shape == v.shape == (2, 64, 2, 64)
  mla = dataclasses.replace(GQA_CASE, value_head_dim=32)
  assert [x.shape[2:] for x in benchmark.make_inputs(mla).arrays()] == [
      (4, 64), (2, 64), (2, 32), (4, 32)]
  plain = dataclasses.replace(GQA_CASE, kv_heads=None)
  same = benchmark.make_inputs(dataclasses.replace(GQA_CASE, kv_heads=4)).arrays()
  for a, b in zip(benchmark.make_inputs(plain).arrays(), same, strict=True):
    np.testing.assert_array_equal(a, b)
  for pass_name in ("fwd", "bwd", "fwd+bwd"):
    assert GQA_CASE.flops(pass_name) == plain.flops(pass_name)
  assert GQA_CASE.flops("fwd") == 4 * 2 * 64**2 * 4 * 64 / 2
  for bad in (3, 8, 0):
    with pytest.raises(ValueError, match="kv_heads"):
      dataclasses.replace(CASE, kv_heads=bad)


def test_grouped_heads_arguments_are_checked(capsys):
  """--kv-heads K must divide every case's query heads N (so K <= N): an argument error naming
  both; neither --heads nor --kv-heads combines with --preset decode."""
  for argv, said in (
      (["--heads", "4", "--kv-heads", "3"], "--kv-heads 3 does not divide --heads 4"),
      (["--heads", "2", "--kv-heads", "4"], "--kv-heads 4 is more than --heads 2"),
      (["--kv-heads", "8"], "--kv-heads 8 is more than the cpu grid's 4 query heads"),
      (["--platform", "gpu", "--kv-heads", "16"],
       "--kv-heads 16 is more than the gpu grid's 8 query heads at head dim 256")):
    with pytest.raises(SystemExit):
      benchmark.parse_args(["--platform", "cpu", *argv])
    assert said in capsys.readouterr().err
  for bad in (["--kv-heads", "2", "--preset", "decode"], ["--heads", "8", "--preset", "decode"],
              ["--kv-heads", "0"], ["--heads", "1.5"]):
    with pytest.raises(SystemExit):
      benchmark.parse_args(["--platform", "cpu", *bad])
  assert "do not apply to --preset decode" in capsys.readouterr().err
  args = benchmark.parse_args(["--platform", "cpu", "--heads", "8", "--kv-heads", "2"])
  assert (args.heads, args.kv_heads) == (8, 2)
  assert benchmark.parse_args(["--platform", "gpu", "--kv-heads", "8"]).kv_heads == 8
  args = benchmark.parse_args(["--platform", "cpu"])
  assert args.heads is None and args.kv_heads is None


def test_heads_option_keeps_the_gpu_batch():
  """--heads N replaces the grid's heads; the GPU batch stays 16384 // seq."""
  default = benchmark.gpu_cases([1024], [64, 128], [True])
  assert [(c.batch, c.heads) for c in default] == [(16, 32), (16, 16)]
  given = benchmark.gpu_cases([1024], [64, 128], [True], heads=8)
  assert [(c.batch, c.heads) for c in given] == [(16, 8), (16, 8)]
  assert [c.heads for c in benchmark.cpu_cases([64], [64], [True], heads=6)] == [6]


def test_grouped_heads_peers():
  """jax_flash and XLA (jax.nn) compute the same grouped-query attention from k and v of K
  heads; on the GPU platform Pallas' mha reads 'unavailable' (it indexes k and v by the query
  head) while XLA and jax_flash take such cases."""
  peers = peers_module()
  q, k, v, _ = benchmark.make_inputs(GQA_CASE).arrays()
  outputs = {peer.name: np.asarray(peer.build.args[0](q, k, v, is_causal=True))
             for peer in (peers.FLASH_CPU, peers.XLA_CPU)}
  np.testing.assert_allclose(outputs["jax_flash"], outputs["xla"], atol=2e-5)
  assert outputs["xla"].shape == (2, 64, 4, 64)
  gpu_case = dataclasses.replace(GPU_CASE, heads=4, kv_heads=2)
  by_name = {peer.name: peer for peer in benchmark.GPU.peers}
  assert peers.PALLAS_NO_GROUPED_HEADS in by_name["pallas"].case_unavailable(gpu_case)
  assert by_name["pallas"].case_unavailable(dataclasses.replace(gpu_case, kv_heads=None)) is None
  for name in ("jax_flash", "xla"):
    assert by_name[name].case_unavailable(gpu_case) is None, name


def test_torch_takes_grouped_heads_as_they_are():
  """PyTorch's CPU flash kernel with enable_gqa=True on k and v of K heads gives jax.nn's
  grouped-query attention (where torch is installed and its flash kernel takes them)."""
  torch = pytest.importorskip("torch")
  peers = peers_module()
  if peers._torch_flash_gqa_refusal() is not None:
    assert "grouped" in peers.TORCH_CPU.case_unavailable(GQA_CASE)
    return
  from torch.nn.attention import SDPBackend, sdpa_kernel

  q, k, v, _ = benchmark.make_inputs(GQA_CASE).arrays()
  with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    out = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(np.ascontiguousarray(x.swapaxes(1, 2))) for x in (q, k, v)),
        is_causal=True, enable_gqa=True)
  reference = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(out.numpy().swapaxes(1, 2), reference, atol=2e-5)


def test_cli_grouped_heads(tmp_path, capsys, monkeypatch):
  """--heads 4 --kv-heads 2 on the CPU: every peer gets k and v of 2 heads (q and dO of 4);
  jax_flash's cells are numbers, the heads column reads 4/2, the caption says so; the FLOPs
  count the 4 query heads; results.json records heads and kv_heads."""
  import json

  shapes = record_input_shapes(monkeypatch)
  assert benchmark.main([*GQA_CPU_RUN, "--out", str(tmp_path)]) == 0
  assert shapes == [((1, 64, 4, 64), (1, 64, 2, 64), (1, 64, 2, 64), (1, 64, 4, 64))]
  header, rows = table_rows(table_lines(capsys))
  assert header[:5] == ["seq", "heads", "hdim", "causal", "pass"]
  assert [row["pass"] for row in rows] == ["fwd", "bwd", "fwd+bwd"]
  assert all(row["heads"] == "4/2" for row in rows)
  for row in (rows[0], rows[2]):  # fwd, fwd+bwd (bwd is derived, and may not be at --reps 1)
    assert float(row["GFLOP/s"]) > 0 and float(row["jax_flash ms"]) > 0
    assert row["xla GFLOP/s"] not in ("unavailable", "fails")
  table = (tmp_path / "table.md").read_text()
  assert "grouped-query attention: 2 key/value heads" in table
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["settings"]["heads"] == 4 and results["settings"]["kv_heads"] == 2
  case = benchmark.Case(1, 64, 4, 64, "float32", True, kv_heads=2)
  by_peer = {(m["peer"], m["pass"]): m for m in results["measurements"]}
  for pass_name in ("fwd", "fwd+bwd"):
    m = by_peer[("jax_flash", pass_name)]
    assert m["status"] == "ok" and (m["heads"], m["kv_heads"]) == (4, 2)
    assert m["flop"] == case.flops(pass_name) == dataclasses.replace(
        case, kv_heads=None).flops(pass_name)
  torch_fwd = by_peer[("torch", "fwd")]
  if importlib.util.find_spec("torch") is None:
    assert torch_fwd["status"] == "unavailable" and "not installed" in torch_fwd["reason"]
  else:
    assert torch_fwd["status"] == "ok" or "grouped" in torch_fwd["reason"], torch_fwd
