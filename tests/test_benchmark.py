"""The benchmark's bookkeeping: FLOP counts and the derived backward rows."""

from __future__ import annotations

import sys
import types

import pytest

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
