// Which query tiles (query block, head, batch element) a CTA of the forward's one-dimensional grid
// computes, in one of three ways (QueryTileGrid):
//
// kPerTile, a CTA per tile: CTA t computes tile t; within a (head, batch) pair the tiles run from
// the last query block to the first (causal blocks longest first) and the hardware hands the next
// tile to whichever SM frees first.
//
// kDynamic (the default without a causal mask), a persistent grid of a CTA per SM taking tiles as
// it frees: CTA c starts on tile c and its producer warp fetches each next tile from a counter in
// global memory (FwdParams::tile_counter, zeroed by the launch), one atomic a tile issued a tile
// ahead (+4-17% at head dim 64, even at 128 and 256 against kStaticPairs, session 25). The
// order is kPerTile's: the CTAs at work hold neighbouring tiles, mostly of one head, whose K and
// V they share in L2, and a causal head's longest blocks go first. Taking tiles as SMs free
// balances what a static deal cannot: on the H200 the same tiles of a non-causal call take the
// SMs up to 30% longer on some than on others (head dim 64, seq 4096: SM active cycles min 1.92M,
// max 2.52M under the static deal; cuda/PERF_NOTES.md v25).
//
// kStaticPairs (the default with a causal mask: 5-12% faster there than kDynamic at head dims 128
// and 256, session 25; everywhere under JAX_FLASH_CUDA_FWD_GRID=static, as before session
// 25), a persistent grid dealing tiles two at a time: pairs 2u and 2u + 1 for u = blockIdx.x,
// blockIdx.x + gridDim.x, ..., and within a (head, batch) pair the positions alternate the
// longest and the shortest causal blocks left (last block, first, second last, second, ...), so
// that every pair costs about as much.
//
// In every way the producer warp decides each next tile and hands it to the consumers through
// shared memory (flash_fwd_ws_kernel.cuh), so the roles never disagree on the sequence.
#pragma once

#include "common/attention_params.h"
#include "gpu/launch.h"

namespace jax_flash::cuda {

template <int kBlockM>
struct QueryTileScheduler {
  int m_blocks, heads, total;
  QueryTileGrid grid;
  int* counter;  // kDynamic: tiles taken past the first gridDim.x

  __host__ __device__ QueryTileScheduler(const AttentionShape& shape, QueryTileGrid grid_, int* counter_)
      : m_blocks(static_cast<int>((shape.seq_q + kBlockM - 1) / kBlockM)),
        heads(static_cast<int>(shape.heads_q)),
        total(static_cast<int>(m_blocks * shape.heads_q * shape.batch)),
        grid(grid_),
        counter(counter_) {}

  // The grid's CTAs for `tiles` tiles on `sms` SMs.
  static int64_t ctas(int64_t tiles, int sms, QueryTileGrid grid) {
    if (grid == QueryTileGrid::kPerTile) return tiles;
    const int64_t units = grid == QueryTileGrid::kStaticPairs ? (tiles + 1) / 2 : tiles;
    return units < sms ? units : (sms > 1 ? sms : 1);
  }

  __device__ int first() const {
    return grid == QueryTileGrid::kStaticPairs ? 2 * static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
  }
  // The tile after t (kDynamic: after any; one atomic, whose latency the caller hides by asking a
  // tile ahead). Past the last: total or more.
  __device__ int next(int t) const {
    switch (grid) {
      case QueryTileGrid::kPerTile:
        return total;
      case QueryTileGrid::kStaticPairs:
        return t % 2 == 0 ? t + 1 : t - 1 + 2 * static_cast<int>(gridDim.x);
      default:
        return atomicAdd(counter, 1) + static_cast<int>(gridDim.x);
    }
  }

  struct Tile {
    int m_block, head, batch;
  };
  __device__ Tile tile(int t) const {
    const int pair = t / m_blocks, position = t - pair * m_blocks;
    // Rank 0 is the last query block.
    const bool paired = grid == QueryTileGrid::kStaticPairs;
    const int rank = !paired ? position : position % 2 == 0 ? position / 2 : m_blocks - 1 - position / 2;
    return {m_blocks - 1 - rank, pair % heads, pair / heads};
  }
};

}  // namespace jax_flash::cuda
