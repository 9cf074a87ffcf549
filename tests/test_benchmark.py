"""The benchmark's bookkeeping: FLOP counts and the derived backward rows."""

from __future__ import annotations

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
