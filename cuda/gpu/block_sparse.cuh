// Block-sparse attention in the CUDA kernels: tiles whose block of the block mask is hidden are
// never visited, forward or backward.
//
// The mask's blocks (kBlockMaskRows x kBlockMaskKeys, 128 x 128) are at least as large as every
// kernel tile (64 or 128 rows, 64 or 128 keys, aligned at 0), so each tile lies in one block and
// is live exactly when that block's bit is set: no element mask is needed. XLA turns the bool
// mask into lists beside the call (jax_flash._ops.block_sparse_lists), as FlexAttention's
// BlockMask does:
//   - per (b, query head, query block): the live key blocks in ascending order and their count,
//     which the query-block walks (forward, deterministic dQ) read through TileWalk;
//   - per (b, kv head, key block): the live (query head of the group, query block) pairs, one
//     int32 each (head_in_group * query_blocks + query_block), ascending (head by head, blocks
//     ascending), and their count, which the key-block walk of the backward reads (KeyBlockTask).
// Both walks are intersected with the tile range the other masks leave (causal, window, lengths,
// segment ids). Entries out of range are clamped into it, so a malformed list (the custom call can
// be reached by name) gives wrong values but no access outside the arrays.
#pragma once

#include <cstdint>

#include "common/attention_params.h"

namespace jax_flash::cuda {

// The tiles of kTile rows (keys) a walk visits in [first, last]: all of them, or, with a list of
// live mask blocks, those in a live block. Ascending index j gives the j-th; the kernels walk
// down from the last (descending).
template <int kTile>
struct TileWalk {
  // Tiles per mask block (1 for tiles wider than a block, which only the dense walk takes: the
  // list constructor asserts).
  static constexpr int kPer = kTile <= kBlockMaskRows ? static_cast<int>(kBlockMaskRows / kTile) : 1;
  const int32_t* list = nullptr;  // live blocks from the first one that meets [first, last]; null: dense
  int first = 0, last = -1;
  int skip = 0;   // tiles of the list's first block before `first`
  int count = 0;  // tiles visited

  __device__ TileWalk(int first_tile, int last_tile) : first(first_tile), last(last_tile) {
    count = last >= first ? last - first + 1 : 0;
  }
  // `blocks` ascending live mask blocks (`n` of them, clamped to [0, max_blocks]).
  __device__ TileWalk(int first_tile, int last_tile, const int32_t* blocks, int n, int max_blocks)
      : first(first_tile), last(last_tile) {
    static_assert(kBlockMaskRows == kBlockMaskKeys && kBlockMaskRows % kTile == 0,
                  "every kernel tile lies in one block of the block mask");
    n = n < 0 ? 0 : (n > max_blocks ? max_blocks : n);
    if (last < first || n == 0) return;
    const int lo = lower_bound(blocks, n, first / kPer);
    const int hi = lower_bound(blocks, n, last / kPer + 1);
    if (hi <= lo) return;
    list = blocks + lo;
    const int begin = __ldg(list) * kPer, end = __ldg(blocks + hi - 1) * kPer + kPer - 1;
    skip = first > begin ? first - begin : 0;
    const int tail = end > last ? end - last : 0;
    count = (hi - lo) * kPer - skip - tail;
    if (count < 0) count = 0;  // unsorted lists only
  }

  // The j-th visited tile, ascending (0 <= j < count).
  __device__ __forceinline__ int ascending(int j) const {
    if (list == nullptr) return first + j;
    const int x = j + skip;
    const int tile = __ldg(list + x / kPer) * kPer + x % kPer;
    return tile < first ? first : (tile > last ? last : tile);
  }
  // The i-th visited tile from the last one down.
  __device__ __forceinline__ int descending(int i) const { return ascending(count - 1 - i); }

 private:
  // The first index of blocks[0, n) holding a value >= x (n if none); blocks ascending.
  __device__ static int lower_bound(const int32_t* blocks, int n, int x) {
    int lo = 0, hi = n;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (__ldg(blocks + mid) < x) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }
};

// The key-block list of query block `query_tile_row0 / kBlockMaskRows` of (b, h) with its count,
// as a walk over the key tiles [first, last] of kTile keys.
template <int kTile>
__device__ __forceinline__ TileWalk<kTile> key_tile_walk(const AttentionParams& p, int64_t b, int64_t h,
                                                         int64_t query_row0, int first, int last) {
  if (p.kv_block_lists == nullptr) return TileWalk<kTile>(first, last);
  const int64_t q_blocks = p.block_mask_q_blocks, k_blocks = p.block_mask_k_blocks;
  const int64_t row = (b * p.shape.heads_q + h) * q_blocks + query_row0 / kBlockMaskRows;
  return TileWalk<kTile>(first, last, p.kv_block_lists + row * k_blocks, __ldg(p.kv_block_counts + row),
                         static_cast<int>(k_blocks));
}

}  // namespace jax_flash::cuda
