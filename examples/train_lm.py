"""Train a small GPT-style byte-level language model whose attention is jax_flash.

    python examples/train_lm.py                          # a few minutes on a 2-core CPU
    python examples/train_lm.py --attention xla          # the same model on jax.nn's XLA attention
    python examples/train_lm.py --compare jax_flash,xla  # both, same seed and data; plot, table
    python examples/train_lm.py --kv-heads 1 --positions learned --data README.md
    python examples/train_lm.py --checkpoint-dir /tmp/ckpt --stop-after 300   # then add --resume
    python examples/generate.py --checkpoint-dir /tmp/ckpt   # text from a checkpoint, KV cache
    python examples/train_lm.py --preset gpt2-small --compare jax_flash,xla,cudnn   # on a GPU
    python examples/train_lm.py --pack --seq-len 1024 --batch-size 2 --steps 20   # packed docs

The model is a decoder-only transformer in Flax NNX: byte embeddings (tied to the output layer),
pre-norm blocks (RMSNorm -> causal self-attention -> residual, RMSNorm -> GELU MLP -> residual),
rotary or learned positions, and optional grouped-query attention (``--kv-heads``). Attention is
``jax_flash.dot_product_attention(q, k, v, is_causal=True)``, a drop-in for
``jax.nn.dot_product_attention``; ``--attention xla`` / ``cudnn`` run jax.nn's implementations
instead. It trains with optax AdamW in one jit-compiled step that donates the model and optimizer
state, on bytes of real text: by default the Python standard library's own source files (no
download), or the file or folder given with ``--data``. The batch of step ``s`` is a function of
``(seed, s)`` alone, so runs with the same seed see the same data and a resumed run continues
exactly where it stopped.

Each run writes to ``--out`` (default ``runs/<time>-<attention>``): ``config.json``,
``metrics.json`` (per-step loss, validation loss, tokens/s, compile time, XLA's compiled memory of
the step and the peak device memory where the device reports it), ``loss.png`` and ``sample.txt``.
``--compare`` trains once per implementation, each in its own process (so peak memory is its own),
and writes ``compare.png``, ``compare.md`` and ``compare.json`` beside the runs' folders.
Checkpoints (orbax; model, optimizer, step, config and history) go to ``--checkpoint-dir``.

The code is the library ``examples/lm/`` (config, flags, attention, data, model, training,
sampling, checkpoints, reporting, runs: see ``lm/__init__.py``); this script parses the command
line and starts the run. Needs the ``examples`` extra: ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

# The lm library lives beside this script: importable from any working directory, uninstalled.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lm import flags, packing, runs  # noqa: E402
from lm.attention import check_attention_backend  # noqa: E402


def main(argv: Sequence[str] | None = None) -> None:
  """Parses the command line, then trains one run or compares implementations."""
  invocation = flags.parse_args(argv, description=__doc__.split("\n\n")[0])
  if invocation.options.resume and not invocation.options.checkpoint_dir:
    raise SystemExit("error: --resume needs --checkpoint-dir")
  if invocation.options.pack:
    if invocation.options.compare or invocation.options.resume:
      raise SystemExit("error: --pack is a run of its own (padded, then packed): not with "
                       "--compare or --resume")
    check_attention_backend(invocation.config)
    packing.compare(invocation.config, invocation.options)
    return
  if not invocation.options.resume:  # (a resumed run checks the checkpoint's config)
    check_attention_backend(invocation.config)
  if invocation.options.compare:
    runs.compare(invocation, runs.parse_implementations(invocation.options.compare),
                 script=__file__)
  else:
    runs.train(invocation.config, invocation.options, invocation.overrides, invocation.preset)


if __name__ == "__main__":
  main(sys.argv[1:])
