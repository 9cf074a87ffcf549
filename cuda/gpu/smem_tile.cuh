// The swizzled shared-memory tile both CUDA families stage 16-bit operands in (the mma.sync
// kernels compute on it; the wgmma kernels store dS^T and dK/dV through it), and a lane's
// addressing of one operand inside it.
#pragma once

#include <cstdint>

#include "gpu/ptx.cuh"

namespace jax_flash::cuda {

// A [kRows][kCols] tile of 16-bit elements in shared memory. Rows are split in 16-byte chunks
// whose order is XOR-swizzled with the row, so the 8 rows one ldmatrix reads (same logical
// chunk) land in 8 different bank groups, and cp.async writes stay 16-byte aligned.
//
// The swizzle commutes with moves the warp GEMMs make: for dr a multiple of 8,
//   physical_chunk(row + dr, chunk ^ dc) == physical_chunk(row, chunk) ^ dc,
// so a lane computes its address once per operand and reaches every fragment by one XOR and an
// immediate offset (sm80/warp_gemm.cuh).
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

template <int kN>
inline constexpr bool kPowerOfTwo = kN > 0 && (kN & (kN - 1)) == 0;

// A lane's ldmatrix row in one operand of a tile: the shared address of its row (with the tile's
// base), its chunk (physical when moves are XORs, else logical) and its row (for the swizzle).
template <typename Tile, bool kXorMoves>
struct SmemOperand {
  uint32_t row_address;
  int chunk;
  int row;

  template <typename T>
  __device__ __forceinline__ SmemOperand(const T* tile, int row_, int logical_chunk)
      : row_address(smem_address(tile + row_ * Tile::kCols)),
        chunk(kXorMoves ? Tile::physical_chunk(row_, logical_chunk) : logical_chunk),
        row(row_) {
    asm volatile("" : "+r"(row_address), "+r"(chunk));
  }

  // The address dr rows (a multiple of 8) and dc chunks on.
  __device__ __forceinline__ uint32_t at(int dr, int dc) const {
    if constexpr (kXorMoves)
      return row_address + (chunk ^ dc) * 16 + dr * Tile::kCols * 2;
    else
      return row_address + Tile::physical_chunk(row, chunk + dc) * 16 + dr * Tile::kCols * 2;
  }
};

}  // namespace jax_flash::cuda
