// Kernel shapes of the wgmma (sm_90a) kernels: one traits template per kernel, from the tile
// sizes of gpu/tile_shapes.cuh.
#pragma once

#include "sm90/gmma_tile.cuh"

namespace jax_flash::cuda {

template <int kHeadDim_, int kBlockN_>
struct Sm90FwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // 2 warpgroups x 64 rows
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpGroups = kBlockM / 64;
  static constexpr int kThreads = 128 * kWarpGroups;
  using QTile = GmmaTile<kBlockM, kHeadDim>;
  using KVTile = GmmaTile<kBlockN, kHeadDim>;
  // Q, two stages of K and of V, and 1 KiB to align the base.
  static constexpr int kSmemBytes = 2 * (QTile::kElements + 4 * KVTile::kElements) + 1024;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "wgmma shapes are instantiated for N = 64, 128");
  static_assert(kBlockN == 64 || kBlockN == 128, "wgmma shapes are instantiated for N = 64, 128");
};

template <int kHeadDim_>
struct Sm90BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;   // query rows per iteration
  static constexpr int kBlockN = 128;  // keys: 2 warpgroups x 64
  static constexpr int kThreads = 256;
  using KVTile = GmmaTile<kBlockN, kHeadDim>;
  using QTile = GmmaTile<kBlockM, kHeadDim>;
  using DsTile = GmmaTile<kBlockN, kBlockM>;  // dS^T: [key][query]
  // K, V; two stages of Q and dO; dS^T; two stages of the block's lse (log2 units) and delta;
  // 1 KiB to align the base.
  static constexpr int kSmemBytes =
      2 * (2 * KVTile::kElements + 4 * QTile::kElements + DsTile::kElements) + 2 * 2 * kBlockM * 4 + 1024;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "wgmma shapes are instantiated for N = 64, 128");
  static_assert(kBlockM == 64, "dS^T is stored through SmemTile, whose layout is DsTile's for 64 columns");
};

}  // namespace jax_flash::cuda
