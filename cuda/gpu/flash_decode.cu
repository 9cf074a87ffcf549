// Launcher of the CUDA split-KV decode (gpu/flash_decode_kernel.cuh): dtype and compiled head dim
// become template constants; the split kernel, then (with several key chunks) the combine.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include "gpu/flash_decode.h"
#include "gpu/flash_decode_kernel.cuh"
#include "gpu/kernel_choice.h"
#include "gpu/kernel_launch.cuh"

namespace jax_flash::cuda {
namespace {

// The decode kernel's compiled head dims, smallest first (those of the mma.sync forward, so
// every head dim the CUDA forward takes; inputs run on the smallest that holds them).
#define JF_DECODE_HEAD_DIMS(X) X(32) X(64) X(128) X(192) X(256)

template <typename T, int kHeadDim>
cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream) {
  using Traits = DecodeTraits<kHeadDim>;
  const int64_t ctas = decode_split_ctas(p.shape, p.num_splits);
  // The K/V copies' L2 hint (JAX_FLASH_CUDA_DECODE_LOADS) as a template constant.
  auto kernel = flash_decode_kernel<Traits, T>;
  if (decode_loads() == DecodeLoads::kEvictFirst) kernel = flash_decode_kernel<Traits, T, L2Hint::kEvictFirst>;
  if (decode_loads() == DecodeLoads::kPrefetch256) kernel = flash_decode_kernel<Traits, T, L2Hint::kPrefetch256>;
  if (cudaError_t e = launch_with_smem(kernel, dim3(static_cast<unsigned>(ctas)), Traits::kThreads,
                                       Traits::kSmemBytes, stream, p))
    return e;
  if (p.num_splits == 1) return cudaSuccess;
  flash_decode_combine_kernel<T><<<static_cast<unsigned>(decode_combine_ctas(p.shape)),
                                   32 * kDecodeCombineRowsPerCta, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_decode_head_dim(const DecodeParams& p, cudaStream_t stream) {
#define JF_DECODE_CASE(D) \
  if (p.shape.head_dim <= D) return launch_decode<T, D>(p, stream);
  JF_DECODE_HEAD_DIMS(JF_DECODE_CASE)
#undef JF_DECODE_CASE
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_flash_decode(const DecodeParams& p, cudaStream_t stream) {
  const int64_t ctas = decode_split_ctas(p.shape, p.num_splits);
  if (ctas == 0) return cudaSuccess;  // no rows (B, T, N or K is 0): nothing to write
  if (ctas > INT_MAX || decode_combine_ctas(p.shape) > INT_MAX || p.shape.head_dim % 8 != 0 ||
      p.shape.head_dim > kDecodeMaxHeadDim || p.num_splits < 1 || (p.num_splits > 1 && !p.o_partial))
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case Dtype::kBFloat16: return launch_decode_head_dim<__nv_bfloat16>(p, stream);
    case Dtype::kFloat16: return launch_decode_head_dim<__half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash::cuda
