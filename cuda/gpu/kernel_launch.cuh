// The one way the family launchers start a kernel: its dynamic shared-memory limit raised first,
// every CUDA error returned.
#pragma once

#include <cuda_runtime.h>

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

}  // namespace jax_flash::cuda
