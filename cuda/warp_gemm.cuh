// Warp-level tile products on mma.sync m16n8k16, with operands in swizzled shared tiles
// (SmemTile) or, for A, already in registers. A warp computes
//   acc[kMTiles][kNTiles] (16x8 fp32 fragments) += A (16*kMTiles x 16*kSteps) * B (16*kSteps x 8*kNTiles)
// Operands are described by where they start in their tile and how they are stored:
//   A stored [m][k] (kATransposed = false) or [k][m] (true);
//   B stored [n][k] (kBTransposed = false, e.g. K for Q K^T) or [k][n] (true, e.g. V for P V).
// ldmatrix (.trans where the storage is the other way round) turns either into the fragments.
#pragma once

#include "cuda_ptx.cuh"

namespace jax_flash::cuda {

template <typename Tile, bool kTransposed, int kMTiles, typename T>
__device__ __forceinline__ void load_a_fragments(uint32_t (&a)[kMTiles][4], const T* tile, int m0,
                                                 int k0, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    if constexpr (!kTransposed)
      ldmatrix_x4(a[mt], tile + Tile::offset(m0 + mt * 16 + lane / 8 % 2 * 8 + lane % 8, k0 / 8 + lane / 16));
    else
      ldmatrix_x4_trans(a[mt], tile + Tile::offset(k0 + lane / 16 * 8 + lane % 8, (m0 + mt * 16) / 8 + lane / 8 % 2));
  }
}

// B fragments of n-tiles 2p and 2p+1 (16 columns from n0) at k-step k0: b[0], b[1] for the
// first, b[2], b[3] for the second.
template <typename Tile, bool kTransposed, typename T>
__device__ __forceinline__ void load_b_pair(uint32_t (&b)[4], const T* tile, int n0, int k0, int lane) {
  if constexpr (!kTransposed)
    ldmatrix_x4(b, tile + Tile::offset(n0 + lane / 16 * 8 + lane % 8, k0 / 8 + lane / 8 % 2));
  else
    ldmatrix_x4_trans(b, tile + Tile::offset(k0 + lane / 8 % 2 * 8 + lane % 8, n0 / 8 + lane / 16));
}

template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void mma_pair(float (&acc)[kMTiles][kNTiles][4], const uint32_t (&a)[kMTiles][4],
                                         const uint32_t (&b)[4], int np) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    MmaOp<T>::run(acc[mt][2 * np], a[mt], b[0], b[1]);
    MmaOp<T>::run(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
  }
}

// Both operands from shared memory: A at (m0, k0), B at (n0, k0) in their tiles.
template <typename ATile, bool kATransposed, typename BTile, bool kBTransposed, int kSteps,
          int kMTiles, int kNTiles, typename T>
__device__ __forceinline__ void warp_gemm(float (&acc)[kMTiles][kNTiles][4], const T* a_tile, int a_m0,
                                          int a_k0, const T* b_tile, int b_n0, int b_k0, int lane) {
  static_assert(kNTiles % 2 == 0, "B fragments come in pairs of n-tiles");
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    uint32_t a[kMTiles][4];
    load_a_fragments<ATile, kATransposed>(a, a_tile, a_m0, a_k0 + kk * 16, lane);
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      load_b_pair<BTile, kBTransposed>(b, b_tile, b_n0 + np * 16, b_k0 + kk * 16, lane);
      mma_pair<T>(acc, a, b, np);
    }
  }
}

// A from registers (a[kk][mt]: k-step kk of m-tile mt), B from shared memory at (n0, k0).
template <typename BTile, bool kBTransposed, int kSteps, int kMTiles, int kNTiles, typename T>
__device__ __forceinline__ void warp_gemm_a_regs(float (&acc)[kMTiles][kNTiles][4],
                                                 const uint32_t (&a)[kSteps][kMTiles][4], const T* b_tile,
                                                 int b_n0, int b_k0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      load_b_pair<BTile, kBTransposed>(b, b_tile, b_n0 + np * 16, b_k0 + kk * 16, lane);
      mma_pair<T>(acc, a[kk], b, np);
    }
}

// The A operand (16-bit pairs) of an accumulator: columns 16kk..16kk+15 of each m-tile.
template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void accumulator_to_a(uint32_t (&a)[kNTiles / 2][kMTiles][4],
                                                 const float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      a[nt / 2][mt][(nt % 2) * 2 + 0] = MmaOp<T>::pack(acc[mt][nt][0], acc[mt][nt][1]);
      a[nt / 2][mt][(nt % 2) * 2 + 1] = MmaOp<T>::pack(acc[mt][nt][2], acc[mt][nt][3]);
    }
}

}  // namespace jax_flash::cuda
