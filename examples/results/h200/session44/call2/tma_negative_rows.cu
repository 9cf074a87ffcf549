// Does a TMA box that starts before row 0 load zeros there and store nothing there? (Session 44:
// the end-aligned forward tiles, JAX_FLASH_CUDA_FWD_ROWS=end, rely on it.) A 4-dim map of
// (64 columns, 1 head, 256 rows, 2 batch elements), boxes of 64 x 128 rows with the 128-byte
// swizzle, as the forward's Q and O maps. Prints what it finds; exit code 0 if both hold.
//   nvcc -I cuda -std=c++17 -gencode=arch=compute_90a,code=sm_90a THIS.cu cuda/sm90/tensor_map.cu -o t && ./t
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "sm90/barrier.cuh"
#include "sm90/tensor_map.h"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

using namespace jax_flash::cuda;

constexpr int kSeq = 256, kBatch = 2, kCols = 64, kBoxRows = 128;

// Element (r, c) of a 128-byte-swizzled box of 64 16-bit columns.
__device__ int swizzled(int r, int c) { return r * 64 + (((c / 8) ^ (r % 8)) * 8) + c % 8; }

__global__ void load_box(const __grid_constant__ CUtensorMap map, int row, int batch, uint16_t* out) {
  __shared__ __align__(1024) uint16_t tile[kBoxRows * kCols];
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    Mbarrier(&bar).init(1);
    Mbarrier::fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    Mbarrier(&bar).arrive_expect_bytes(sizeof(tile));
    tma_load_box(tile, map, 0, 0, row, batch, Mbarrier(&bar));
  }
  Mbarrier(&bar).wait(0);
  for (int i = threadIdx.x; i < kBoxRows * kCols; i += blockDim.x) out[i] = tile[swizzled(i / kCols, i % kCols)];
}

__global__ void store_box(const __grid_constant__ CUtensorMap map, int row, int batch) {
  __shared__ __align__(1024) uint16_t tile[kBoxRows * kCols];
  for (int i = threadIdx.x; i < kBoxRows * kCols; i += blockDim.x)
    tile[swizzled(i / kCols, i % kCols)] = static_cast<uint16_t>(5000 + i / kCols);
  fence_proxy_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    tma_store_box(map, tile, 0, 0, row, batch);
    bulk_commit();
    bulk_wait_all();
  }
}

int main() {
  const size_t n = size_t(kBatch) * kSeq * kCols;
  std::vector<uint16_t> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<uint16_t>(1 + i / kCols);  // 1 + global row
  uint16_t *data, *out;
  cudaMalloc(&data, n * 2);
  cudaMalloc(&out, kBoxRows * kCols * 2);
  cudaMemcpy(data, host.data(), n * 2, cudaMemcpyHostToDevice);
  CUtensorMap map;
  if (make_head_tensor_map(&map, data, jax_flash::Dtype::kBFloat16, kBatch, kSeq, 1, kCols, kBoxRows) != cudaSuccess) {
    std::printf("map: failed\n");
    return 2;
  }
  bool ok = true;
  // Load rows [-64, 64) of batch element 1: zeros, then its rows 0..63 (values 257..320).
  load_box<<<1, 128>>>(map, -64, 1, out);
  std::vector<uint16_t> got(kBoxRows * kCols);
  cudaError_t e = cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost);
  std::printf("load at row -64: %s\n", cudaGetErrorString(e));
  int bad = 0;
  for (int r = 0; r < kBoxRows; ++r)
    for (int c = 0; c < kCols; ++c) {
      const uint16_t want = r < 64 ? 0 : static_cast<uint16_t>(1 + kSeq + (r - 64));
      if (got[r * kCols + c] != want && bad++ < 4)
        std::printf("  row %d col %d: %u, want %u\n", r, c, got[r * kCols + c], want);
    }
  std::printf("load: %d wrong elements (row 0: %u, row 63: %u, row 64: %u)\n", bad, got[0], got[63 * kCols],
              got[64 * kCols]);
  ok &= bad == 0 && e == cudaSuccess;
  // Store box rows [0, 128) at rows [-64, 64) of batch element 1: its rows 0..63 get box rows
  // 64..127 (5064..5127); nothing else changes.
  store_box<<<1, 128>>>(map, -64, 1);
  e = cudaMemcpy(host.data(), data, n * 2, cudaMemcpyDeviceToHost);
  std::printf("store at row -64: %s\n", cudaGetErrorString(e));
  bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const int b = static_cast<int>(i / (kSeq * kCols)), r = static_cast<int>(i / kCols % kSeq);
    const uint16_t want = b == 1 && r < 64 ? static_cast<uint16_t>(5064 + r) : static_cast<uint16_t>(1 + i / kCols);
    if (host[i] != want && bad++ < 4) std::printf("  batch %d row %d: %u, want %u\n", b, r, host[i], want);
  }
  std::printf("store: %d wrong elements\n", bad);
  ok &= bad == 0 && e == cudaSuccess;
  std::printf(ok ? "negative rows: OK\n" : "negative rows: NOT OK\n");
  return ok ? 0 : 1;
}
