"""The README's main job, run as a user runs it: `python examples/train_lm.py` from the repository
root, a few steps of a tiny model, in a subprocess, then `examples/generate.py` on its checkpoint.
It catches a broken import or flag in the examples' library (examples/lm/) that no other test
would see; and the example model's KV-cache decoding against its training forward."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytest.importorskip("flax")
pytest.importorskip("optax")


def test_train_lm_runs_and_learns(tmp_path):
  out = tmp_path / "run"
  command = [
      sys.executable, "examples/train_lm.py", "--layers", "1", "--width", "32", "--heads", "2",
      "--seq-len", "64", "--batch-size", "4", "--steps", "12", "--eval-every", "12",
      "--eval-batches", "1", "--log-every", "4", "--sample-bytes", "8",
      "--max-data-bytes", "200000", "--learning-rate", "3e-3", "--no-progress", "--out", str(out)]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  metrics = json.loads((out / "metrics.json").read_text())
  assert metrics["config"]["attention"] == "jax_flash"
  summary = metrics["summary"]
  first, final = summary["first_train_loss"], summary["final_train_loss"]
  assert first == first and final == final, summary  # not NaN
  assert final < first, summary  # 12 steps at this rate move the byte loss down


def test_generate_from_a_checkpoint_agrees_across_attentions(tmp_path):
  """train_lm.py --checkpoint-dir, then examples/generate.py on that checkpoint: greedy bytes
  from jax_flash and from jax.nn's xla attention are the same (cudnn skipped without a GPU)."""
  checkpoints, out = tmp_path / "checkpoints", tmp_path / "generate.json"
  train = [
      sys.executable, "examples/train_lm.py", "--layers", "2", "--width", "32", "--heads", "4",
      "--kv-heads", "2", "--seq-len", "64", "--batch-size", "4", "--steps", "12",
      "--eval-every", "12", "--eval-batches", "1", "--sample-bytes", "4",
      "--max-data-bytes", "200000", "--no-progress", "--out", str(tmp_path / "run"),
      "--checkpoint-dir", str(checkpoints)]
  result = subprocess.run(train, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  generate = [
      sys.executable, "examples/generate.py", "--checkpoint-dir", str(checkpoints),
      "--compare", "jax_flash,xla,cudnn", "--temperature", "0", "--new-tokens", "12",
      "--repeats", "1", "--prompt", "def ", "--prompt", "import os", "--out", str(out)]
  result = subprocess.run(generate, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  report = json.loads(out.read_text())
  assert report["step"] == 12 and report["config"]["kv_heads"] == 2
  flash, xla = report["results"]["jax_flash"], report["results"]["xla"]
  assert len(flash["tokens"]) == 2 and all(len(row) == 12 for row in flash["tokens"])
  assert flash["tokens"] == xla["tokens"]
  assert flash["prefill_tokens_per_s"] > 0 and flash["decode_tokens_per_s"] > 0
  assert "tokens/s" in result.stdout and "xla vs jax_flash: the same 24 bytes" in result.stdout
  if jax.default_backend() == "cpu":
    assert "needs an NVIDIA GPU" in report["results"]["cudnn"]["skipped"]
    assert "attention cudnn: skipped" in result.stdout


def test_generate_table_script(tmp_path):
  """.ci/gpu/generate_table.sh (hopper_round.sh's GENERATE=1 step) with tiny sizes on the CPU:
  the same train_lm.py and generate.py commands (bf16, --batch, --prompt-bytes), and the tokens/s
  table of every batch size and attention."""
  env = dict(os.environ, OUT=str(tmp_path), COMPARE="jax_flash,xla", GEN_BATCHES="1,3",
             TRAIN_SIZE="--layers 1 --width 32 --heads 4 --kv-heads 2 --seq-len 64 "
                        "--batch-size 4 --steps 4 --max-data-bytes 200000",
             GEN_SIZE="--prompt-bytes 16 --new-tokens 17")
  result = subprocess.run(["bash", ".ci/gpu/generate_table.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  report = json.loads((tmp_path / "generate" / "generate.json").read_text())
  assert report["config"]["dtype"] == "bfloat16" and report["step"] == 4
  assert [run["batch"] for run in report["runs"]] == [1, 3]
  for run in report["runs"]:
    assert len(run["prompts"]) == run["batch"] and run["prompt_bytes"] == 16
    for name in ("jax_flash", "xla"):
      r = run["results"][name]
      assert len(r["tokens"]) == run["batch"] and all(len(row) == 17 for row in r["tokens"])
      assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
  assert report["results"] == report["runs"][0]["results"]
  assert "| batch | attention | prompt bytes |" in result.stdout, result.stdout
  assert "| 1 | jax_flash | 16 | 17 |" in result.stdout and "| 3 | xla | 16 | 17 |" in result.stdout


@pytest.mark.parametrize("positions, kv_heads", [("rope", 2), ("learned", None)])
def test_kv_cache_decode_gives_the_full_forward_logits(positions, kv_heads):
  """The example model's prefill + decode (prompts of different lengths in one batch, each
  sequence at its own position) give the logits of the training forward over the whole text."""
  sys.path.insert(0, str(ROOT / "examples"))
  from flax import nnx

  from lm.config import Config
  from lm.generation import pad_prompts
  from lm.model import ByteLM

  config = Config(layers=2, width=32, heads=4, kv_heads=kv_heads, seq_len=32,
                  positions=positions)
  model = ByteLM(config, rngs=nnx.Rngs(0))
  texts = [b"def f(x):\n    return x", b"import os", b"class A:\n  pass"]
  steps = 8  # feed the last `steps` bytes of each text one at a time after its prompt
  prompts, lengths = pad_prompts([t[:-steps] for t in texts])
  max_len = prompts.shape[1] + steps
  logits, caches = jax.jit(model.prefill, static_argnums=1)(prompts, max_len)
  got = [np.asarray(logits)[np.arange(len(texts)), lengths - 1]]
  decode = jax.jit(model.decode)
  for i in range(steps):
    positions = lengths + i
    tokens = np.array([t[p] for t, p in zip(texts, positions)], np.int32)
    step_logits, caches = decode(tokens, positions, caches)
    got.append(np.asarray(step_logits))
  for b, text in enumerate(texts):
    want = np.asarray(model(np.array([list(text)], np.int32)))[0]
    start = lengths[b] - 1
    np.testing.assert_allclose(np.stack([g[b] for g in got]), want[start:start + steps + 1],
                               rtol=1e-4, atol=1e-4, err_msg=f"text {b}")


def test_train_lm_pack_reports_useful_tokens_per_second(tmp_path):
  """train_lm.py --pack: padded, then packed documents (segment ids), a few steps each; both
  useful tokens/s and the gain printed and in packing.json."""
  out = tmp_path / "pack"
  command = [
      sys.executable, "examples/train_lm.py", "--pack", "--layers", "1", "--width", "32",
      "--heads", "2", "--seq-len", "512", "--batch-size", "2", "--steps", "3",
      "--max-data-bytes", "60000", "--out", str(out)]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  assert "padded:" in result.stdout and "packed:" in result.stdout, result.stdout
  assert "packing gain:" in result.stdout, result.stdout
  report = json.loads((out / "packing.json").read_text())
  padded, packed = report["padded"], report["packed"]
  assert padded["useful_tokens_per_s"] > 0 and packed["useful_tokens_per_s"] > 0
  assert packed["fill"] > padded["fill"]  # the same documents, fewer padding positions
  assert report["gain"] == pytest.approx(
      packed["useful_tokens_per_s"] / padded["useful_tokens_per_s"])
  for r in (padded, packed):
    assert np.isfinite(r["first_loss"]) and np.isfinite(r["final_loss"]), r


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_packed_row_gives_each_documents_own_logits(positions):
  """The example model on a packed row (segment ids, positions restarting per document) gives
  each document the logits it has alone."""
  sys.path.insert(0, str(ROOT / "examples"))
  from flax import nnx

  from lm.config import Config
  from lm.model import ByteLM
  from lm.packing import packed_rows

  config = Config(layers=2, width=32, heads=4, kv_heads=2, seq_len=48, positions=positions)
  model = ByteLM(config, rngs=nnx.Rngs(0))
  docs = [np.frombuffer(t, np.uint8) for t in (b"def f(x):\n    return x", b"import os\n",
                                                b"class A:\n  pass")]
  rows = packed_rows(docs, config.seq_len)
  assert len(rows.inputs) == 1
  logits = np.asarray(jax.jit(model)(rows.inputs, rows.segment_ids, rows.positions))[0]
  at = 0
  for doc in docs:
    alone = np.asarray(model(np.asarray(doc[None, :-1], np.int32)))[0]
    np.testing.assert_allclose(logits[at:at + len(alone)], alone, rtol=1e-4, atol=1e-4)
    at += len(alone)
