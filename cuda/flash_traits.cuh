// Kernel shapes of the sm_80+ FlashAttention kernels: one traits template per kernel family, and
// the swizzled shared-memory tile they all stage operands in.
#pragma once

#include <cstdint>

namespace jax_flash::cuda {

// A [kRows][kCols] tile of 16-bit elements in shared memory. Rows are split in 16-byte chunks
// whose order is XOR-swizzled with the row, so the 8 rows one ldmatrix reads (same logical
// chunk) land in 8 different bank groups, and cp.async writes stay 16-byte aligned.
template <int kRows_, int kCols_>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kChunks = kCols / 8;
  static_assert(kCols % 32 == 0, "tile rows must hold a multiple of 4 chunks");
  static_assert(kChunks < 8 || kChunks % 8 == 0, "swizzle works on groups of 8 chunks");
  static constexpr int kElements = kRows * kCols;

  // Offset (in elements) of chunk `chunk` (8 elements) of row `row`.
  __device__ __forceinline__ static int offset(int row, int chunk) {
    int physical;
    if constexpr (kChunks >= 8) {
      physical = (chunk & ~7) | ((chunk ^ row) & 7);
    } else {  // 4 chunks a row: two rows share a 128-byte line
      physical = chunk ^ ((row >> 1) & 3);
    }
    return row * kCols + physical * 8;
  }
};

// Forward: each CTA owns kBlockM query rows of one (batch, head), 16 per warp, and streams
// key/value tiles of kBlockN rows through a two-stage cp.async pipeline.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct FwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kThreads = 32 * kNWarps;
  static_assert(kBlockM == 16 * kNWarps, "each warp owns 16 query rows");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "tiles are multiples of 16");
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KVTile = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kSmemBytes = 2 * (QTile::kElements + 4 * KVTile::kElements);
};

// Backward main kernel: each CTA owns kBlockN keys of one (batch, kv head) and loops over the
// query blocks (of every query head of the group) that see them. The warps tile the dK/dV
// products kWarpsN (16 keys each) x kWarpsD (head-dim slices); the S/dP/dQ products 16 query
// rows per warp.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarpsN_, int kWarpsD_>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kWarpsD = kWarpsD_;
  static constexpr int kNWarps = kWarpsN * kWarpsD;
  static constexpr int kThreads = 32 * kNWarps;
  static constexpr int kSliceD = kHeadDim / kWarpsD;  // head-dim columns of a warp's dK/dV
  static constexpr int kDqChunk = kHeadDim < 64 ? kHeadDim : 64;  // dQ columns per pass
  static_assert(kBlockM == 16 * kNWarps, "each warp owns 16 query rows of S and dP");
  static_assert(kBlockN == 16 * kWarpsN, "each warp row owns 16 keys of dK and dV");
  static_assert(kSliceD % 16 == 0 && kHeadDim % kDqChunk == 0, "head-dim slices of 16");
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KVTile = SmemTile<kBlockN, kHeadDim>;
  using PTile = SmemTile<kBlockM, kBlockN>;
  static constexpr int kSmemBytes =
      2 * (2 * KVTile::kElements + 4 * QTile::kElements + 2 * PTile::kElements) +
      4 * 2 * kBlockM;  // + lse and delta rows (float)
};

}  // namespace jax_flash::cuda
