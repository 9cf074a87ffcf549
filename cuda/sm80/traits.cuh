// Kernel shapes of the mma.sync (sm_80+) kernels: one traits template per kernel, from the tile
// sizes of gpu/tile_shapes.cuh.
#pragma once

#include <cstdint>

#include "gpu/smem_tile.cuh"

namespace jax_flash::cuda {

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

// Head dims up to this carry dS as two 16-bit tiles, hi = r16(dS) and lo = r16(dS - hi), into dK
// and dQ (the main backward and the deterministic dQ kernel): about float32 dS, where 16-bit dS
// alone put dq/dk past the accuracy rule on heads of a few dimensions (issue 13;
// examples/results/h200/session9/differential_cuda_analysis.md, step 4). The extra products are
// cheap beside the memory traffic at such head dims. Calls whose rows see few keys take the
// split at every head dim (gpu/score_mods.cuh narrow_plain_call).
inline constexpr int kSplitDsMaxHeadDim = 32;

// Backward main kernel: each CTA owns kBlockN keys of one (batch, kv head) and loops over the
// query blocks (of every query head of the group) that see them. Three warp grids: S and dP
// (kBlockM x kBlockN), dK and dV (kBlockN x head dim), dQ (kBlockM x head dim, done in column
// chunks of at most kDqChunk to bound registers).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kSdpWarpsM, int kKvWarpsN,
          int kDqWarpsM, bool kSplitDs_ = (kHeadDim_ <= kSplitDsMaxHeadDim)>
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
  static constexpr bool kSplitDs = kSplitDs_;
  static constexpr int kSmemBytes =
      2 * (2 * KVTile::kElements + 4 * QTile::kElements + (kSplitDs ? 3 : 2) * PTile::kElements);
};

}  // namespace jax_flash::cuda
