// Runtime values -> template constants, in one place: the dtype and the compiled head dim.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "attention_params.h"

namespace jax_flash::cuda {

template <template <typename, int> class Launch, typename T, typename Params>
cudaError_t dispatch_head_dim(const Params& params, cudaStream_t stream) {
  const int64_t d = params.shape.head_dim;
  if (d <= 32) return Launch<T, 32>::run(params, stream);
  if (d <= 64) return Launch<T, 64>::run(params, stream);
  if (d <= 128) return Launch<T, 128>::run(params, stream);
  if (d <= 192) return Launch<T, 192>::run(params, stream);
  if (d <= 256) return Launch<T, 256>::run(params, stream);
  return cudaErrorInvalidValue;
}

// Runs Launch<T, kHeadDim>::run(params, stream) for the 16-bit dtype T and the smallest compiled
// head dim >= params.shape.head_dim; cudaErrorInvalidValue for anything else.
template <template <typename, int> class Launch, typename Params>
cudaError_t dispatch_dtype_head_dim(const Params& params, cudaStream_t stream) {
  switch (params.dtype) {
    case Dtype::kBFloat16: return dispatch_head_dim<Launch, __nv_bfloat16>(params, stream);
    case Dtype::kFloat16: return dispatch_head_dim<Launch, __half>(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

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
