// The one way the family launchers start a kernel: its dynamic shared-memory limit raised first,
// every CUDA error returned; and the two grids the kernels are launched on.
#pragma once

#include <cuda_runtime.h>

#include "common/attention_params.h"

namespace jax_flash::cuda {

// Launches kernel<<<grid, threads, smem_bytes, stream>>>(params), first raising the kernel's
// dynamic shared memory limit to smem_bytes; the first CUDA error, or success.
template <typename Params>
cudaError_t launch_with_smem(void (*kernel)(Params), dim3 grid, int threads, int smem_bytes,
                             cudaStream_t stream, const Params& params) {
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes))
    return e;
  kernel<<<grid, threads, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

// One CTA per (query block, query head, batch): the grid QueryBlockTask reads (the forward
// kernels and the deterministic dQ kernel).
template <typename Traits>
dim3 query_block_grid(const AttentionShape& shape) {
  return dim3((shape.seq_q + Traits::kBlockM - 1) / Traits::kBlockM, shape.heads_q, shape.batch);
}

// One CTA per (key block, kv head, batch), or per (key block, kv head x head split, batch) with
// `kv_head_splits`: the grid KeyBlockTask reads (the main backward kernels).
template <typename Traits>
dim3 key_block_grid(const AttentionShape& shape, int kv_head_splits = 1) {
  return dim3((shape.seq_k + Traits::kBlockN - 1) / Traits::kBlockN, shape.heads_k * kv_head_splits, shape.batch);
}

}  // namespace jax_flash::cuda
