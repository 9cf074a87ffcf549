"""What the benchmark measures: attention problems (cases), their passes and their inputs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

# The passes each peer runs on each case.
PASSES = ("fwd", "fwd+bwd")
# Forward plus backward costs 3.5 forwards (the backward 2.5).
FWD_BWD_FLOP_FACTOR = 3.5
# The FlashAttention benchmark's GPU shapes: tokens per batch and model width.
GPU_TOKENS = 16384
GPU_HIDDEN = 2048


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: self-attention of `seq` tokens, shapes (B, S, N, H)."""

  batch: int
  seq: int
  heads: int
  head_dim: int
  dtype: str
  causal: bool

  def flops(self, pass_name: str) -> float:
    """FLOPs of one pass by the FlashAttention convention."""
    forward = 4.0 * self.batch * self.seq**2 * self.heads * self.head_dim
    if self.causal:
      forward /= 2
    factor = {"fwd": 1.0, "bwd": FWD_BWD_FLOP_FACTOR - 1.0, "fwd+bwd": FWD_BWD_FLOP_FACTOR}
    return forward * factor[pass_name]


@dataclasses.dataclass(frozen=True)
class Inputs:
  """Query, key, value and output cotangent of one case, (B, S, N, H) host arrays."""

  query: np.ndarray
  key: np.ndarray
  value: np.ndarray
  d_out: np.ndarray

  def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The four arrays in argument order."""
    return self.query, self.key, self.value, self.d_out


def make_inputs(case: Case, seed: int = 0) -> Inputs:
  """Random normal inputs of the case's shape and dtype (never zeros)."""
  return _random_inputs((case.batch, case.seq, case.heads, case.head_dim), case.dtype, seed)


@functools.lru_cache(maxsize=1)  # a causal case and its non-causal twin share their inputs
def _random_inputs(shape: tuple[int, ...], dtype: str, seed: int) -> Inputs:
  rng = np.random.default_rng(seed)
  return Inputs(*(rng.standard_normal(shape, np.float32).astype(jnp.dtype(dtype))
                  for _ in range(4)))


def cpu_cases(seqs: Sequence[int], head_dims: Sequence[int],
              causal_modes: Sequence[bool]) -> list[Case]:
  """The CPU grid: B=1, 4 heads, float32."""
  return [Case(batch=1, seq=seq, heads=4, head_dim=head_dim, dtype="float32", causal=causal)
          for seq in seqs for head_dim in head_dims for causal in causal_modes]


def gpu_cases(seqs: Sequence[int], head_dims: Sequence[int],
              causal_modes: Sequence[bool]) -> list[Case]:
  """The FlashAttention benchmark's GPU grid: batch = 16384 // seq and heads = 2048 // head dim
  (each at least 1), bfloat16."""
  return [Case(batch=max(1, GPU_TOKENS // seq), seq=seq, heads=max(1, GPU_HIDDEN // head_dim),
               head_dim=head_dim, dtype="bfloat16", causal=causal)
          for seq in seqs for head_dim in head_dims for causal in causal_modes]
