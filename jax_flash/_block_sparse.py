"""Block-sparse attention masks: one bool per (query block, key block) of 128 x 128.

``block_mask`` of ``jax_flash.dot_product_attention`` is broadcastable to
``(B, N, ceil(T / BLOCK_MASK_BLOCK[0]), ceil(S / BLOCK_MASK_BLOCK[1]))``; blocks are aligned at
query row 0 and key 0 (the last ones partial where T or S is not a multiple). False hides every
key of the key block from every query of the query block, on top of every other mask. The
"cpu" kernel never visits a hidden tile (forward or backward: its 64 x 64 tiles lie inside one
block each, the bit of the block containing a tile decides it); "xla" expands the block mask to
an element mask (expand_block_mask) and applies it as any mask; "blockwise" expands, per scan
step, only the columns of its key block (memory linear in S). Under context parallelism each
device holds the block rows of its queries (jax_flash._context_parallel: shards of whole blocks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash import _registry

# (query rows, keys) of one block of the mask, (128, 128): its own size, read from the native
# module (kBlockMaskRows / kBlockMaskKeys of cuda/common/attention_params.h; never copied here).
# Not any kernel's tiles but a multiple of all of them: the CPU kernel's tiles are 64 x 64, the
# CUDA kernels' 64 or 128 rows/keys, and each must lie inside one mask block to be skipped whole
# (with 64 x 64 blocks a random mask at 25% density leaves 68% of 128 x 128 tiles with some bit
# set). FlexAttention's default block is 128 x 128 too.
BLOCK_MASK_BLOCK: tuple[int, int] = (int(_registry.KERNEL_CONSTANTS["block_mask_block_q"]),
                                     int(_registry.KERNEL_CONSTANTS["block_mask_block_k"]))


def block_mask_shape(seq_q: int, seq_k: int) -> tuple[int, int]:
  """(query blocks, key blocks) of a block mask for T = seq_q queries and S = seq_k keys."""
  block_q, block_k = BLOCK_MASK_BLOCK
  return -(-seq_q // block_q), -(-seq_k // block_k)


def expand_block_mask(block_mask: jax.Array, seq_q: int, seq_k: int) -> jax.Array:
  """The element mask (..., T, S) of a block mask (..., Tb, Sb): each block's bit repeated over
  its rows and keys, the partial last blocks cut to T and S."""
  block_q, block_k = BLOCK_MASK_BLOCK
  rows = jnp.repeat(block_mask, block_q, axis=-2)[..., :seq_q, :]
  return jnp.repeat(rows, block_k, axis=-1)[..., :seq_k]


def with_block_mask(mask: jax.Array | None, block_mask: jax.Array | None, seq_q: int,
                    seq_k: int) -> jax.Array | None:
  """A rank-4 element mask (or None) and a rank-4 block mask (or None) as one element mask:
  what "blockwise" and "xla" apply (a (B|1, N|1, T, S) bool array where a block mask is
  given)."""
  if block_mask is None:
    return mask
  elements = expand_block_mask(block_mask, seq_q, seq_k)
  return elements if mask is None else mask & elements
