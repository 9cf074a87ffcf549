"""The command line of train_lm.py: one flag per field of `Config` and `RunOptions`, resolved as
preset <- ``--config`` file <- flags given explicitly."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from lm.config import PRESETS, Config, RunOptions


FLAG_HELP = {
    "data": "a text file or a folder; None: the Python standard library's *.py files",
    "data_glob": "files of a --data folder to read, recursively",
    "max_data_bytes": "read at most this much text",
    "val_fraction": "the last fraction of the text is the validation set",
    "kv_heads": "key/value heads: fewer than --heads is grouped-query attention, 1 multi-query",
    "dtype": "activation dtype (parameters and optimizer state stay float32)",
    "attention": "jax_flash, or jax.nn.dot_product_attention with implementation xla or cudnn",
    "steps": "training steps (the learning-rate schedule spans them)",
    "learning_rate": "peak AdamW learning rate (linear warmup, cosine decay to a tenth)",
    "seed": "initialisation, data order and sampling",
    "log_every": "refresh the progress bar (and measure tokens/s) every N steps",
    "eval_every": "validation loss every N steps (and at the end)",
    "eval_batches": "validation batches (fixed windows) per evaluation",
    "prompt": "the sample's prompt",
    "sample_bytes": "bytes to generate at the end",
    "temperature": "sampling temperature; 0 is greedy",
    "out": "output folder; None: runs/<time>-<attention> (runs/<time>-compare)",
    "compare": "train once per implementation, e.g. jax_flash,xla,cudnn, with the same seed and "
               "data; one plot and one table",
    "checkpoint_dir": "save orbax checkpoints (model, optimizer, step, config) there",
    "checkpoint_every": "save every N steps (and at the end) when --checkpoint-dir is given",
    "keep_checkpoints": "keep the latest N checkpoints",
    "resume": "continue from the latest checkpoint in --checkpoint-dir with its config (flags "
              "given now may change e.g. --steps, --attention, --dtype, not shapes or data)",
    "stop_after": "end this invocation after step N, checkpointed; the schedule still spans "
                  "--steps (resume later with --resume)",
    "pack": "train on packed documents (one per Python file, segment ids, positions restarting "
            "per document) and on the same documents padded to the row, the same steps; print "
            "useful tokens/s of both and the gain (default data: this repository's source)",
    "progress": "show a progress bar (tqdm if installed); without it, a log line per --log-every",
}


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, help_for) -> None:
  """One flag per dataclass field; defaults are SUPPRESSed so that only given flags are parsed."""
  for field in dataclasses.fields(cls):
    flag = "--" + field.name.replace("_", "-")
    kind = field.type
    kwargs: dict[str, Any] = dict(default=argparse.SUPPRESS, help=help_for(field))
    if kind.startswith("Literal["):
      kwargs["choices"] = [c.strip().strip("\"'") for c in kind[len("Literal["):-1].split(",")]
    elif kind in ("int", "int | None"):
      kwargs["type"] = int
    elif kind == "float":
      kwargs["type"] = float
    elif kind == "bool":
      kwargs["action"] = argparse.BooleanOptionalAction
    parser.add_argument(flag, **kwargs)


def _config_help(field: dataclasses.Field) -> str:
  presets = [f"{name}: {values[field.name]}" for name, values in PRESETS.items()
             if field.name in values]
  default = f"default {field.default}" + (f"; {', '.join(presets)}" if presets else "")
  return f"{FLAG_HELP[field.name]} ({default})" if field.name in FLAG_HELP else default


def _run_help(field: dataclasses.Field) -> str:
  default = f"default {field.default}"
  return f"{FLAG_HELP[field.name]} ({default})" if field.name in FLAG_HELP else default


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
  """The parser: --preset, --config, then one flag per Config field and per RunOptions field."""
  parser = argparse.ArgumentParser(
      description=description, allow_abbrev=False,
      epilog="Flags given explicitly override --config, which overrides --preset.")
  parser.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                      help="base settings: demo (2-core CPU, minutes) or gpt2-small (one GPU)")
  parser.add_argument("--config", metavar="FILE", default=None,
                      help="start from the config.json of an earlier run")
  _add_dataclass_flags(parser.add_argument_group("experiment"), Config, _config_help)
  _add_dataclass_flags(parser.add_argument_group("run"), RunOptions, _run_help)
  return parser


@dataclasses.dataclass(frozen=True)
class Invocation:
  """The parsed command line: the resolved config and the flags that were given explicitly."""

  config: Config
  options: RunOptions
  preset: str
  config_file: str | None
  overrides: dict[str, Any]  # Config fields given on the command line


def parse_args(argv: Sequence[str] | None = None, description: str | None = None) -> Invocation:
  """Resolves the Config as preset <- --config file <- explicit flags, and the RunOptions;
  `description` heads --help."""
  parser = build_parser(description)
  args = vars(parser.parse_args(argv))
  preset, config_file = args.pop("preset"), args.pop("config")
  config_names = {f.name for f in dataclasses.fields(Config)}
  overrides = {k: v for k, v in args.items() if k in config_names}
  options = RunOptions(**{k: v for k, v in args.items() if k not in config_names})
  values = dict(PRESETS[preset])
  if config_file:
    with open(config_file) as f:
      values.update(json.load(f))
  values.update(overrides)
  config = Config.from_dict(values)
  try:
    config.validate()
  except ValueError as e:
    parser.error(str(e))
  return Invocation(config, options, preset, config_file, overrides)
