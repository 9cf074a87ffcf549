// Moves of whole tiles between global and shared memory (cp.async in, 16-byte stores out), and of
// a warp's float32 accumulator fragments out to shared or global memory in 16 bits.
#pragma once

#include <cstdint>

#include "gpu/fragments.cuh"
#include "gpu/ptx.cuh"
#include "gpu/smem_tile.cuh"

namespace jax_flash::cuda {

// Copies rows [0, rows) x chunks [0, chunks) of a global tile (row stride in elements) into a
// swizzled shared tile; everything outside is zero-filled. Each thread copies the same chunk
// column of rows tid / kChunks + i * kThreads / kChunks where the thread count allows (a fixed,
// unrolled trip with one address per thread), else walks the tile in thread-strided order.
template <typename Tile, int kThreads, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t row_stride, int rows,
                                          int chunks, int tid) {
  constexpr int kCopies = Tile::kRows * Tile::kChunks;
  static_assert(kCopies % kThreads == 0, "every thread copies as many chunks");
  if constexpr (kThreads % Tile::kChunks == 0) {
    constexpr int kRowsPerPass = kThreads / Tile::kChunks;
    const int c = tid % Tile::kChunks, r0 = tid / Tile::kChunks;
    const T* src = gmem + r0 * row_stride + c * 8;
#pragma unroll
    for (int i = 0; i < kCopies / kThreads; ++i) {
      const int r = r0 + i * kRowsPerPass;
      const bool valid = r < rows && c < chunks;
      cp_async_16(smem + Tile::offset(r, c), valid ? src + i * kRowsPerPass * row_stride : gmem, valid);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kCopies / kThreads; ++i) {
      const int index = tid + i * kThreads;
      const int r = index / Tile::kChunks, c = index % Tile::kChunks;
      const bool valid = r < rows && c < chunks;
      cp_async_16(smem + Tile::offset(r, c), valid ? gmem + r * row_stride + c * 8 : gmem, valid);
    }
  }
}

// load_tile for one warp with few registers (a warp-specialised kernel's producer): the same
// copies, zero fill included, in a loop kept rolled. The caller waits for them (cp_async_wait).
template <typename Tile, typename T>
__device__ __forceinline__ void warp_load_tile(T* smem, const T* gmem, int64_t row_stride, int rows, int chunks,
                                               int lane) {
#pragma unroll 1
  for (int index = lane; index < Tile::kRows * Tile::kChunks; index += 32) {
    const int r = index / Tile::kChunks, c = index % Tile::kChunks;
    const bool valid = r < rows && c < chunks;
    cp_async_16(smem + Tile::offset(r, c), valid ? gmem + r * row_stride + c * 8 : gmem, valid);
  }
}

// The reverse of load_tile: rows [0, rows) x chunks [0, chunks) of a swizzled shared tile to a
// global tile, 16 bytes a thread at a time (a warp writes whole rows).
template <typename Tile, int kThreads, typename T>
__device__ __forceinline__ void store_tile(T* gmem, int64_t row_stride, const T* smem, int rows, int chunks,
                                           int tid) {
  constexpr int kCopies = Tile::kRows * Tile::kChunks;
  static_assert(kCopies % kThreads == 0, "every thread copies as many chunks");
  // A pass covers whole rows where the threads divide into them (each thread then keeps its
  // chunk); else (rows of 24 chunks: head dim 192) thread t copies chunks t, t + kThreads, ...
  constexpr bool kWholeRows = kThreads % Tile::kChunks == 0;
  constexpr int kRowsPerPass = kWholeRows ? kThreads / Tile::kChunks : 0;
#pragma unroll
  for (int i = 0; i < kCopies / kThreads; ++i) {
    const int index = kWholeRows ? tid : tid + i * kThreads;
    const int c = index % Tile::kChunks, r = index / Tile::kChunks + i * kRowsPerPass;
    if (r < rows && c < chunks)
      *reinterpret_cast<uint4*>(gmem + r * row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(smem + Tile::offset(r, c));
  }
}

// Stores a warp's accumulator packed as A fragments (gpu/fragments.cuh's accumulator_to_a:
// a[nt / 2][mt][(nt % 2) * 2 + half] holds x[mt][nt][2 half .. 2 half + 1] in 16 bits; rows
// from row0, columns from col0, a multiple of 16 * kKTiles) into a 16-bit shared tile, addressed
// like the warp GEMMs' operands: one lane address, moves of 8 rows and 1 chunk.
template <typename Tile, int kKTiles, int kMTiles, typename T>
__device__ __forceinline__ void store_a_fragments(T* tile, const uint32_t (&a)[kKTiles][kMTiles][4], int row0,
                                                  int col0, int lane) {
  constexpr int kNTiles = 2 * kKTiles;
  const SmemOperand<Tile, kPowerOfTwo<kNTiles>> op(tile, row0 + lane / 4, col0 / 8);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        st_shared_b32(op.at(mt * 16 + half * 8, nt) + (lane % 4) * 4, a[nt / 2][mt][(nt % 2) * 2 + half]);
}

// The same from the float32 accumulator.
template <typename Tile, int kMTiles, int kNTiles, typename T>
__device__ __forceinline__ void store_accumulator(T* tile, const float (&x)[kMTiles][kNTiles][4], int row0, int col0,
                                                  int lane) {
  static_assert(kNTiles % 2 == 0, "whole 16-column A fragments");
  uint32_t a[kNTiles / 2][kMTiles][4];
  accumulator_to_a<T>(a, x);
  store_a_fragments<Tile>(tile, a, row0, col0, lane);
}

// Writes a warp's dK or dV accumulator (key rows from row0, columns from col0) to global memory.
template <int kMTiles, int kNTiles, typename T>
__device__ __forceinline__ void store_rows(T* out, int64_t row_stride, const float (&x)[kMTiles][kNTiles][4],
                                           int row0, int col0, int rows, int64_t cols, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + mt * 16 + half * 8 + lane / 4, col = col0 + nt * 8 + (lane % 4) * 2;
        if (row < rows && col < cols)
          *reinterpret_cast<uint32_t*>(out + row * row_stride + col) =
              MmaOp<T>::pack(x[mt][nt][2 * half], x[mt][nt][2 * half + 1]);
      }
}

}  // namespace jax_flash::cuda
