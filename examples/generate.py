"""Generate text with a byte-level language model trained by train_lm.py, decoding with a KV cache.

    python examples/train_lm.py --checkpoint-dir /tmp/lm              # train; saves checkpoints
    python examples/generate.py --checkpoint-dir /tmp/lm              # a batch of prompts -> text
    python examples/generate.py --checkpoint-dir /tmp/lm --prompt "import " --prompt "def f(x):"
    python examples/generate.py --checkpoint-dir /tmp/lm --compare jax_flash,xla --temperature 0
    python examples/generate.py --checkpoint-dir /tmp/lm --compare jax_flash,xla,cudnn --dtype bfloat16
    python examples/generate.py --checkpoint-dir /tmp/lm --compare jax_flash,xla --batch 1,64 \
        --prompt-bytes 256 --new-tokens 256      # a tokens/s table: batch x attention

It restores the latest (or ``--step``) orbax checkpoint that ``train_lm.py --checkpoint-dir``
wrote, with the config saved beside it, and runs the prompts as one batch: a jit-compiled
prefill of the right-padded prompts writes every block's keys and values into a cache, then a
jit-compiled ``lax.scan`` feeds one byte per sequence per step, each sequence at its own
position, attending over its cache entries 0 .. position (``key_value_seq_lengths``, no mask
array; the model's ``decode`` in ``lm/model.py``, the loop in ``lm/generation.py``). Sampling is
greedy at ``--temperature 0``, else from the softmax at that temperature over the ``--top-k``
most likely bytes. It prints the prefill's and the decode loop's tokens/s (medians of
``--repeats`` runs after a first, compiling, one) and the text.

``--compare jax_flash,xla`` generates with each attention from the same checkpoint, prompts and
key, and says whether their bytes agree (with ``--temperature 0`` they should: the same greedy
choices unless two logits tie within rounding). ``cudnn`` needs an NVIDIA GPU and 16-bit
activations (``--dtype bfloat16``): elsewhere it is skipped with the reason.

``--batch 1,64`` runs each batch size in turn (the prompts repeated to fill the batch), and
``--prompt-bytes N`` takes N-byte windows of the text the checkpoint was trained on (its
validation split, evenly spaced, one per sequence) as the prompts, so the prefill has work to
time. The run ends with a table of tokens/s per batch size and attention. Needs the
``examples`` extra: ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

# The lm library lives beside this script: importable from any working directory, uninstalled.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from lm.attention import IMPLEMENTATIONS, check_attention_backend  # noqa: E402
from lm.checkpoints import CheckpointStore  # noqa: E402
from lm.config import Config  # noqa: E402
from lm.data import load_bytes, split_data  # noqa: E402
from lm.generation import Sampling, generate  # noqa: E402
from lm.model import ByteLM  # noqa: E402
from lm.training import init_state  # noqa: E402

DEFAULT_PROMPTS = ["def ", "import ", "class Parser:", "    return "]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
  parser.add_argument("--checkpoint-dir", required=True,
                      help="the --checkpoint-dir of a train_lm.py run")
  parser.add_argument("--step", type=int, default=None,
                      help="the checkpoint's step (default: the latest)")
  parser.add_argument("--prompt", action="append", default=None,
                      help=f"a prompt; repeat for a batch (default: {DEFAULT_PROMPTS})")
  parser.add_argument("--new-tokens", type=int, default=100,
                      help="bytes to generate after each prompt (default 100)")
  parser.add_argument("--temperature", type=float, default=0.7,
                      help="sampling temperature; 0 is greedy (default 0.7)")
  parser.add_argument("--top-k", type=int, default=0,
                      help="sample among the k most likely bytes; 0: all (default 0)")
  parser.add_argument("--seed", type=int, default=0, help="the sampling key (default 0)")
  parser.add_argument("--attention", choices=IMPLEMENTATIONS, default=None,
                      help="attention implementation (default: the checkpoint's)")
  parser.add_argument("--compare", default=None,
                      help="generate once per implementation, e.g. jax_flash,xla,cudnn")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                      help="activation dtype (default: the checkpoint's)")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed runs of each phase after the compiling one (default 3)")
  parser.add_argument("--batch", type=batch_sizes, default=None, metavar="N[,N...]",
                      help="sequences per batch, one run per size (e.g. 1,64): the prompts "
                           "repeated to fill it (default: one sequence per prompt)")
  parser.add_argument("--prompt-bytes", type=int, default=None, metavar="N",
                      help="prompts of N bytes each from the checkpoint's validation text, one "
                           "window per sequence (instead of --prompt)")
  parser.add_argument("--out", default=None, help="also write the results to this JSON file")
  args = parser.parse_args(argv)
  if args.compare and args.attention:
    parser.error("give --attention or --compare, not both")
  if args.repeats < 1:
    parser.error("--repeats must be at least 1")
  if args.prompt_bytes is not None and (args.prompt or args.prompt_bytes < 1):
    parser.error("--prompt-bytes takes a positive number of bytes, without --prompt")
  try:
    Sampling(args.temperature, args.top_k)
  except ValueError as e:
    parser.error(str(e))
  return args


def batch_sizes(text: str) -> list[int]:
  """--batch: positive integers separated by commas."""
  try:
    sizes = [int(part) for part in text.split(",") if part.strip()]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers (N or N,M,...); got {text!r}")
  return sizes


def text_prompts(config: Config, count: int, length: int) -> list[bytes]:
  """`count` prompts of `length` bytes: windows of the validation split of the checkpoint's
  text (config.data, as train_lm.py read it), evenly spaced."""
  _, val = split_data(load_bytes(config), config)
  if len(val) < length:
    raise SystemExit(f"error: --prompt-bytes {length}: the validation text has {len(val)} bytes")
  starts = np.linspace(0, len(val) - length, count).astype(np.int64)
  return [val[s:s + length].tobytes() for s in starts]


def fill(prompts: list[bytes], batch: int) -> list[bytes]:
  """`batch` prompts: the given ones repeated in order."""
  return [prompts[i % len(prompts)] for i in range(batch)]


def tokens_per_second_table(runs: list[dict[str, Any]], names: list[str]) -> str:
  """A markdown table of every run: batch size, attention, prefill and decode tokens/s, and
  whether its bytes equal those of the first attention that ran at that batch size."""
  lines = ["| batch | attention | prompt bytes | new bytes | prefill tokens/s | decode tokens/s | "
           "same bytes as the first |", "|---|---|---|---|---|---|---|"]
  for run in runs:
    ran = [n for n in names if "tokens" in run["results"][n]]
    for name in names:
      r = run["results"][name]
      if "tokens" not in r:
        lines.append(f"| {run['batch']} | {name} | - | - | skipped | skipped | - |")
        continue
      same = ("-" if name == ran[0] else
              "yes" if r["tokens"] == run["results"][ran[0]]["tokens"] else "no")
      lines.append(f"| {run['batch']} | {name} | {run['prompt_bytes']} | {run['new_tokens']} | "
                   f"{r['prefill_tokens_per_s']:,.0f} | {r['decode_tokens_per_s']:,.0f} | "
                   f"{same} |")
  return "\n".join(lines)


def load(directory: str, step: int | None) -> tuple[Config, nnx.State, int]:
  """The config and the model's parameters saved by train_lm.py at `step` (default: latest)."""
  if not os.path.isdir(directory):
    raise SystemExit(f"error: --checkpoint-dir {directory} does not exist")
  store = CheckpointStore(directory, keep=1_000_000)  # (reading only: nothing is deleted)
  try:
    step = store.latest_step() if step is None else step
    if step is None:
      raise SystemExit(f"error: no checkpoint in {store.directory}: train with "
                       f"examples/train_lm.py --checkpoint-dir {directory} first")
    config = Config.from_dict(store.read_meta(step)["config"])
    _, like = init_state(config)  # the (model, optimizer) state the checkpoint holds
    state, _ = store.restore(step, like)
  finally:
    store.close()
  return config, state[0], step


def model_graphdef(config: Config) -> nnx.GraphDef:
  """The model's structure for `config` (its attention included), without parameters."""
  return nnx.split(nnx.eval_shape(lambda: ByteLM(config, rngs=nnx.Rngs(0))))[0]


def first_difference(a, b) -> str:
  """Where two (B, N) token arrays first differ, in words."""
  for i, (x, y) in enumerate(zip(a, b)):
    for j, (p, q) in enumerate(zip(x, y)):
      if p != q:
        return f"prompt {i}, byte {j}"
  return "nowhere"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Loads the checkpoint, generates with each implementation asked for, prints and returns
  the results."""
  args = parse_args(argv)
  config, params, step = load(args.checkpoint_dir, args.step)
  if args.dtype:
    config = dataclasses.replace(config, dtype=args.dtype)
  names = ([s.strip() for s in args.compare.split(",") if s.strip()] if args.compare
           else [args.attention or config.attention])
  unknown = [n for n in names if n not in IMPLEMENTATIONS]
  if unknown or not names or len(set(names)) != len(names):
    raise SystemExit(f"error: --compare takes distinct names from {','.join(IMPLEMENTATIONS)}; "
                     f"got {args.compare!r}")
  sampling = Sampling(args.temperature, args.top_k)
  how = "greedy" if sampling.temperature == 0 else (
      f"temperature {sampling.temperature}" + (f", top-k {sampling.top_k}" if sampling.top_k
                                               else ""))
  print(f"checkpoint {os.path.abspath(args.checkpoint_dir)} step {step}: "
        f"{sum(x.size for x in jax.tree.leaves(params)):,} parameters, {config.layers} layers, width "
        f"{config.width}, {config.heads} heads / {config.num_kv_heads} kv heads, "
        f"{config.positions} positions, {config.dtype}; device {jax.devices()[0].device_kind}")

  given = [p.encode() for p in (args.prompt or DEFAULT_PROMPTS)]
  runs = []
  for batch in args.batch or [None]:
    if args.prompt_bytes is not None:
      prompts = text_prompts(config, batch or len(DEFAULT_PROMPTS), args.prompt_bytes)
    else:
      prompts = fill(given, batch) if batch else given
    print(f"\n{len(prompts)} prompts, {args.new_tokens} new bytes each, {how}")
    results = generate_batch(config, params, names, prompts, sampling, args)
    runs.append(dict(batch=len(prompts), prompt_bytes=max(len(p) for p in prompts),
                     new_tokens=args.new_tokens, prompts=[p.decode(errors="replace")
                                                          for p in prompts],
                     results=results))
  table = tokens_per_second_table(runs, names)
  print(f"\ntokens/s ({jax.devices()[0].device_kind}, {config.dtype}):\n{table}")
  report = dict(checkpoint=os.path.abspath(args.checkpoint_dir), step=step,
                config=dataclasses.asdict(config), prompts=runs[0]["prompts"],
                new_tokens=args.new_tokens, sampling=dataclasses.asdict(sampling),
                seed=args.seed, device=jax.devices()[0].device_kind,
                results=runs[0]["results"], runs=runs, table=table)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
  return report


# Texts printed per attention and batch; the rest are in --out.
SHOWN_TEXTS = 4


def generate_batch(config: Config, params: nnx.State, names: list[str], prompts: list[bytes],
                   sampling: Sampling, args: argparse.Namespace) -> dict[str, Any]:
  """Generates from `prompts` with each attention in `names`; prints each one's tokens/s and
  the first texts, and whether the bytes agree; returns the results by attention (a skipped
  one holds the reason)."""
  results: dict[str, Any] = {}
  for name in names:
    run_config = dataclasses.replace(config, attention=name)
    try:
      check_attention_backend(run_config)
    except SystemExit as e:
      if not args.compare:
        raise
      print(f"\nattention {name}: skipped: {e}")
      results[name] = dict(skipped=str(e))
      continue
    try:
      out = generate(model_graphdef(run_config), params, prompts, args.new_tokens, sampling,
                     jax.random.key(args.seed), max_positions=config.seq_len,
                     repeats=args.repeats)
    except ValueError as e:
      raise SystemExit(f"error: {e}") from None
    prefill_rate = out.prompt_tokens / out.prefill_seconds
    decode_rate = out.decode_tokens / out.decode_seconds if out.decode_seconds else 0.0
    texts = [bytes(row.tolist()).decode("utf-8", errors="replace") for row in out.tokens]
    print(f"\nattention {name}: prefill {len(prompts)} x {out.prompt_tokens // len(prompts)} "
          f"positions in {out.prefill_seconds * 1e3:.1f} ms ({prefill_rate:,.0f} tokens/s); "
          f"decode {len(prompts)} x {out.tokens.shape[1] - 1} bytes in "
          f"{out.decode_seconds * 1e3:.1f} ms ({decode_rate:,.0f} tokens/s); compile and first "
          f"call {out.compile_seconds:.1f}s")
    for prompt, text in list(zip(prompts, texts))[:SHOWN_TEXTS]:
      shown = prompt.decode(errors="replace")
      print(f"---- {shown[-60:]!r}\n{shown}{text}")
    if len(prompts) > SHOWN_TEXTS:
      print(f"---- ({len(prompts) - SHOWN_TEXTS} more sequences)")
    results[name] = dict(tokens=out.tokens.tolist(), texts=texts,
                         prefill_tokens_per_s=prefill_rate, decode_tokens_per_s=decode_rate,
                         prefill_seconds=out.prefill_seconds, decode_seconds=out.decode_seconds,
                         compile_seconds=out.compile_seconds)

  ran = [n for n in names if "tokens" in results[n]]
  for name in ran[1:]:
    a, b = results[ran[0]]["tokens"], results[name]["tokens"]
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a)
    print(f"\n{name} vs {ran[0]}: " + (f"the same {total} bytes" if same == total else
                                      f"{same} of {total} bytes equal; first difference at "
                                      f"{first_difference(a, b)}"))
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
