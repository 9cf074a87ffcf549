"""The experiment's settings: `Config` (everything that decides a run's numbers, saved with every
run and checkpoint), its presets, and `RunOptions` (how and where one invocation runs)."""

from __future__ import annotations  # flags.py reads the field types as strings

import dataclasses
from typing import Any, Literal


@dataclasses.dataclass(frozen=True)
class Config:
  """The experiment: everything that decides the numbers a run produces. Saved with every run and
  checkpoint; every field is also a command-line flag (``kv_heads`` -> ``--kv-heads``)."""

  # data
  data: str | None = None  # a text file or a folder; default: the standard library's *.py files
  data_glob: str = "*.py"  # which files of a folder to read (recursively)
  max_data_bytes: int = 4_000_000
  val_fraction: float = 0.1
  # model
  layers: int = 4
  width: int = 128
  heads: int = 4
  kv_heads: int | None = None  # None: as many as query heads; fewer: GQA; 1: MQA
  mlp_ratio: int = 4
  positions: Literal["rope", "learned"] = "rope"
  rope_base: float = 10_000.0
  dtype: Literal["float32", "bfloat16"] = "float32"  # activations; parameters stay float32
  attention: Literal["jax_flash", "xla", "cudnn"] = "jax_flash"
  # training
  seq_len: int = 128
  batch_size: int = 16
  steps: int = 600
  learning_rate: float = 3e-3
  warmup_steps: int = 50
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  seed: int = 0
  # reporting
  log_every: int = 20  # progress-bar refresh (and the tokens/s interval)
  eval_every: int = 100
  eval_batches: int = 8
  # sampling
  prompt: str = "def "
  sample_bytes: int = 300
  temperature: float = 0.7  # 0: greedy

  @property
  def num_kv_heads(self) -> int:
    return self.heads if self.kv_heads is None else self.kv_heads

  @property
  def head_dim(self) -> int:
    return self.width // self.heads

  def validate(self) -> None:
    """Raises ValueError for settings that cannot build a model."""
    if self.width % self.heads:
      raise ValueError(f"--width {self.width} must be a multiple of --heads {self.heads}")
    if self.heads % self.num_kv_heads:
      raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
    if self.positions == "rope" and self.head_dim % 2:
      raise ValueError(f"rotary positions need an even head dim; got {self.head_dim}")
    for name in ("steps", "seq_len", "batch_size", "log_every", "eval_every", "eval_batches"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be at least 1")

  @classmethod
  def from_dict(cls, values: dict[str, Any]) -> Config:
    """Builds a Config from a saved dict, ignoring keys this version does not know."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


# Fields that fix the shapes of the saved state or the data stream: a resumed run keeps them.
RESUME_FIXED = ("data", "data_glob", "max_data_bytes", "val_fraction", "layers", "width", "heads",
                "kv_heads", "mlp_ratio", "positions", "rope_base", "seq_len", "batch_size", "seed")

PRESETS: dict[str, dict[str, Any]] = {
    # Finishes in a few minutes on a 2-core CPU (the Config defaults).
    "demo": {},
    # GPT-2 small's shape (124M parameters with GPT-2's vocabulary; 85M here with 256 bytes) on
    # one GPU: bf16 activations, 16 x 1024 tokens a step. For --seq-len 4096 pass --batch-size 4
    # to keep the tokens per step (XLA attention materialises B*heads*T*T scores per layer).
    "gpt2-small": dict(
        layers=12, width=768, heads=12, seq_len=1024, batch_size=16, dtype="bfloat16",
        steps=500, learning_rate=6e-4, warmup_steps=50, max_data_bytes=64_000_000,  # all of it
        log_every=10, eval_every=100, eval_batches=16, sample_bytes=400),
}


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """How and where this invocation runs; not part of the experiment (not saved in checkpoints)."""

  out: str | None = None  # output folder; default runs/<time>-<attention> (or -compare)
  compare: str | None = None  # comma-separated implementations, e.g. jax_flash,xla,cudnn
  checkpoint_dir: str | None = None  # orbax checkpoints; none saved without it
  checkpoint_every: int = 200
  keep_checkpoints: int = 3
  resume: bool = False  # continue from the latest checkpoint in --checkpoint-dir
  stop_after: int | None = None  # end this invocation after that step (the schedule keeps --steps)
  progress: bool = True  # a progress bar (tqdm if installed); off: a log line per --log-every
  pack: bool = False  # train packed documents (segment ids) and padded ones; compare tokens/s
