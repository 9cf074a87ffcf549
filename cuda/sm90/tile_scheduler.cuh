// Which query tiles (query block, head, batch element) a CTA of a one-dimensional grid computes.
//
// A grid of one CTA per tile: CTA t computes tile t; within a (head, batch) pair the tiles run
// from the last query block to the first (causal blocks longest first) and the hardware hands
// the next tile to whichever SM frees first.
//
// A persistent grid (a CTA per SM, so that a CTA's loads of its next tile overlap the epilogue
// of its last): a CTA takes tiles two at a time, pairs 2u and 2u + 1 for u = blockIdx.x,
// blockIdx.x + gridDim.x, ..., and within a (head, batch) pair the positions alternate the
// longest and the shortest causal blocks left (last block, first, second last, second, ...).
// Every pair then costs about as much (one causal block's long tile with its short twin), so the
// static deal is balanced; and CTAs running at the same time hold neighbouring pairs, mostly of
// one head, whose K and V they share in L2.
#pragma once

#include "common/attention_params.h"

namespace jax_flash::cuda {

template <int kBlockM>
struct QueryTileScheduler {
  int m_blocks, heads, total;
  bool persistent;

  __host__ __device__ QueryTileScheduler(const AttentionShape& shape, bool persistent_grid)
      : m_blocks(static_cast<int>((shape.seq_q + kBlockM - 1) / kBlockM)),
        heads(static_cast<int>(shape.heads_q)),
        total(static_cast<int>(m_blocks * shape.heads_q * shape.batch)),
        persistent(persistent_grid) {}

  __device__ int first() const { return persistent ? 2 * static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x); }
  __device__ int next(int t) const {
    if (!persistent) return total;
    return t % 2 == 0 ? t + 1 : t - 1 + 2 * static_cast<int>(gridDim.x);
  }

  struct Tile {
    int m_block, head, batch;
  };
  __device__ Tile tile(int t) const {
    const int pair = t / m_blocks, position = t - pair * m_blocks;
    // Rank 0 is the last query block.
    const int rank = !persistent || position % 2 == 0 ? position / (persistent ? 2 : 1)
                                                       : m_blocks - 1 - position / 2;
    return {m_blocks - 1 - rank, pair % heads, pair / heads};
  }
};

}  // namespace jax_flash::cuda
