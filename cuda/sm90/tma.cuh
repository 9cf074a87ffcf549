// TMA (cp.async.bulk.tensor) loads of the boxes sm90/tensor_map.h describes, completing on an
// mbarrier by their byte count. Only meaningful in code compiled for sm_90a.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "gpu/ptx.cuh"
#include "sm90/barrier.cuh"

namespace jax_flash::cuda {

// Fetches a descriptor (a kernel parameter) ahead of its first use.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}

// The box of `map` at (column, head, row, batch) into shared memory at smem_dst; its bytes count
// towards `bar`'s current phase.
__device__ __forceinline__ void tma_load_box(void* smem_dst, const CUtensorMap& map, int column, int head, int row,
                                             int batch, const Mbarrier& bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_address(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(column), "r"(head), "r"(row), "r"(batch), "r"(bar.address)
      : "memory");
}

// Rows [row, row + Tile::kRows) and columns [column0, column0 + Tile::kCols) of one head of `map`
// into a GmmaTile (one box a 64-column block).
template <typename Tile, typename T>
__device__ __forceinline__ void tma_load_tile(T* tile, const CUtensorMap& map, int head, int64_t row, int batch,
                                              const Mbarrier& bar, int64_t column0 = 0) {
#pragma unroll
  for (int block = 0; block < Tile::kCols / 64; ++block)
    tma_load_box(tile + block * Tile::kRows * 64, map, static_cast<int>(column0) + block * 64, head,
                 static_cast<int>(row), batch, bar);
}

// The box at (column, head, row, batch) of `map` written from shared memory at smem_src,
// asynchronously, in this thread's bulk group (bulk_commit; bulk_wait_read before the source is
// written again, bulk_wait_all before the thread exits). Parts of the box past the array's
// bounds are not written.
__device__ __forceinline__ void tma_store_box(const CUtensorMap& map, const void* smem_src, int column, int head,
                                              int row, int batch) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(&map)),
               "r"(smem_address(smem_src)), "r"(column), "r"(head), "r"(row), "r"(batch)
               : "memory");
}

// Rows part_row0 .. part_row0 + kPartRows - 1 of the GmmaTile at `tile` written to rows [row, row +
// kPartRows) of one head of `map` (boxes of kPartRows rows x 64 columns, one a 64-column block;
// part_row0 a multiple of 8, so that each box's source keeps the swizzle's 1 KiB alignment).
template <typename Tile, int kPartRows, typename T>
__device__ __forceinline__ void tma_store_rows(const CUtensorMap& map, const T* tile, int part_row0, int head,
                                               int64_t row, int batch) {
#pragma unroll
  for (int block = 0; block < Tile::kCols / 64; ++block)
    tma_store_box(map, tile + block * Tile::kRows * 64 + part_row0 * 64, block * 64, head, static_cast<int>(row),
                  batch);
}

// Adds `bytes` (a multiple of 16) of float32 from shared memory to global memory (16-byte
// aligned), asynchronously, in this thread's bulk group.
__device__ __forceinline__ void bulk_reduce_add(float* global_dst, const float* smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(global_dst),
               "r"(smem_address(smem_src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk groups have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until this thread's bulk groups are complete (their writes done), e.g. before it exits.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

}  // namespace jax_flash::cuda
