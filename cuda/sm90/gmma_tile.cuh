// The shared-memory tile the wgmma kernels stage operands in, as wgmma reads it with the
// 128-byte swizzle, and the descriptors of its K-major and N-major operands.
#pragma once

#include <cstdint>

#include "gpu/ptx.cuh"
#include "sm90/wgmma.cuh"

namespace jax_flash::cuda {

// The first 1 KiB boundary of the shared address space at or after `raw` (a kernel's dynamic
// shared memory, allocated 1 KiB larger for it), as a T*: where a kernel's GmmaTiles start
// (the swizzle pattern is anchored to 1 KiB boundaries).
template <typename T>
__device__ __forceinline__ T* first_tile_boundary(unsigned char* raw) {
  const uint32_t address = smem_address(raw);
  return reinterpret_cast<T*>(raw + (((address + 1023) & ~1023u) - address));
}

// A [kRows][kCols] tile of 16-bit elements as wgmma reads it with the 128-byte swizzle: column
// blocks of 64 elements, each [kRows][64] with 128-byte rows whose 16-byte chunks are XOR-ed
// with the row (mod 8). Tiles start on 1 KiB boundaries.
template <int kRows_, int kCols_>
struct GmmaTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kChunks = kCols / 8;
  static constexpr int kElements = kRows * kCols;
  static constexpr int kBlockBytes = kRows * 128;  // one 64-column block
  static_assert(kCols % 64 == 0 && kRows % 8 == 0, "whole 64-column blocks of 8-row groups");

  // Offset (in elements) of chunk `chunk` (8 elements) of row `row`.
  __device__ __forceinline__ static int offset(int row, int chunk) {
    return (chunk / 8) * kRows * 64 + row * 64 + ((chunk % 8) ^ (row % 8)) * 8;
  }

  // wgmma descriptor of the K-major operand whose M/N rows are rows row0.. of the tile (a multiple
  // of 8) and whose k runs along the columns, at k-step kk (columns 16 kk .. 16 kk + 15).
  __device__ __forceinline__ static uint64_t k_major(uint32_t tile_address, int row0, int kk) {
    return descriptor_at(smem_descriptor(tile_address, 16, 1024), k_major_offset(row0, kk));
  }
  // The same from the tile's K-major descriptor at row 0, k-step 0 (k_major(address, 0, 0)).
  __device__ __forceinline__ static uint64_t k_major_from(uint64_t tile_desc, int row0, int kk) {
    return descriptor_at(tile_desc, k_major_offset(row0, kk));
  }
  __device__ __forceinline__ static uint32_t k_major_offset(int row0, int kk) {
    return kk / 4 * kBlockBytes + row0 * 128 + kk % 4 * 32;
  }
  // wgmma descriptor of the N-major operand whose k runs along the rows (k-step kk: rows 16 kk ..
  // 16 kk + 15) and whose N is every column.
  __device__ __forceinline__ static uint64_t n_major(uint32_t tile_address, int kk) {
    return descriptor_at(smem_descriptor(tile_address, kBlockBytes, 1024), kk * 16 * 128);
  }
  // The same from the tile's N-major descriptor at k-step 0 (n_major(address, 0)).
  __device__ __forceinline__ static uint64_t n_major_from(uint64_t tile_desc, int kk) {
    return descriptor_at(tile_desc, kk * 16 * 128);
  }
};

}  // namespace jax_flash::cuda
