// Kernel shapes of the sm_80+ FlashAttention kernels: one traits template per kernel family, and
// the swizzled shared-memory tile they all stage operands in.
#pragma once

#include <cstdint>

namespace jax_flash::cuda {

// A [kRows][kCols] tile of 16-bit elements in shared memory. Rows are split in 16-byte chunks
// whose order is XOR-swizzled with the row, so the 8 rows one ldmatrix reads (same logical
// chunk) land in 8 different bank groups, and cp.async writes stay 16-byte aligned.
//
// The swizzle commutes with moves the warp GEMMs make: for dr a multiple of 8,
//   physical_chunk(row + dr, chunk ^ dc) == physical_chunk(row, chunk) ^ dc,
// so a lane computes its address once per operand and reaches every fragment by one XOR and an
// immediate offset (warp_gemm.cuh).
template <int kRows_, int kCols_>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kChunks = kCols / 8;
  static_assert(kCols % 32 == 0, "tile rows must hold a multiple of 4 chunks");
  static_assert(kChunks < 8 || kChunks % 8 == 0, "swizzle works on groups of 8 chunks");
  static constexpr int kElements = kRows * kCols;

  __device__ __forceinline__ static int physical_chunk(int row, int chunk) {
    if constexpr (kChunks >= 8) {
      return (chunk & ~7) | ((chunk ^ row) & 7);
    } else {  // 4 chunks a row: two rows share a 128-byte line
      return chunk ^ ((row >> 1) & 3);
    }
  }

  // Offset (in elements) of chunk `chunk` (8 elements) of row `row`.
  __device__ __forceinline__ static int offset(int row, int chunk) {
    return row * kCols + physical_chunk(row, chunk) * 8;
  }
};

// Forward: each CTA owns kBlockM query rows of one (batch, head), kBlockM / kNWarps per warp (a
// multiple of 16: more rows a warp means fewer shared-memory reads of K and V per product), and
// streams key/value tiles of kBlockN rows through a two-stage cp.async pipeline.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct FwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kThreads = 32 * kNWarps;
  static constexpr int kMTiles = kBlockM / (16 * kNWarps);  // 16-row tiles per warp
  static_assert(kMTiles * 16 * kNWarps == kBlockM, "warps own whole 16-row tiles");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "tiles are multiples of 16");
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KVTile = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kSmemBytes = 2 * (QTile::kElements + 4 * KVTile::kElements);
};

// A grid of warps over an M x N tile of a product: kWarpsM x kWarpsN, each warp owning
// kMTiles 16-row tiles and kNTiles 8-column tiles.
template <int kM, int kN, int kWarpsM_, int kWarpsN_>
struct WarpGrid {
  static constexpr int kWarpsM = kWarpsM_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kRows = kM / kWarpsM;  // per warp
  static constexpr int kCols = kN / kWarpsN;
  static constexpr int kMTiles = kRows / 16;
  static constexpr int kNTiles = kCols / 8;
  static_assert(kMTiles * 16 * kWarpsM == kM && kNTiles * 8 * kWarpsN == kN, "whole tiles");
  static_assert(kNTiles % 2 == 0, "n-tiles come in pairs");
  __device__ __forceinline__ static int row0(int warp) { return warp % kWarpsM * kRows; }
  __device__ __forceinline__ static int col0(int warp) { return warp / kWarpsM * kCols; }
};

// Backward main kernel: each CTA owns kBlockN keys of one (batch, kv head) and loops over the
// query blocks (of every query head of the group) that see them. Three warp grids: S and dP
// (kBlockM x kBlockN), dK and dV (kBlockN x head dim), dQ (kBlockM x head dim, done in column
// chunks of at most kDqChunk to bound registers).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kSdpWarpsM, int kKvWarpsN,
          int kDqWarpsM>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kThreads = 32 * kNWarps;
  using SdpGrid = WarpGrid<kBlockM, kBlockN, kSdpWarpsM, kNWarps / kSdpWarpsM>;
  using KvGrid = WarpGrid<kBlockN, kHeadDim, kKvWarpsN, kNWarps / kKvWarpsN>;
  using DqGrid = WarpGrid<kBlockM, kHeadDim, kDqWarpsM, kNWarps / kDqWarpsM>;
  static constexpr int kDqChunk =
      DqGrid::kCols % 64 == 0 ? 64 : (DqGrid::kCols % 32 == 0 ? 32 : 16);
  static_assert(DqGrid::kCols % kDqChunk == 0 && kDqChunk % 16 == 0, "dQ column chunks");
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KVTile = SmemTile<kBlockN, kHeadDim>;
  using PTile = SmemTile<kBlockM, kBlockN>;
  static constexpr int kSmemBytes =
      2 * (2 * KVTile::kElements + 4 * QTile::kElements + 2 * PTile::kElements);
};

}  // namespace jax_flash::cuda
