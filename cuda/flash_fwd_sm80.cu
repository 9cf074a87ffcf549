// Instantiations and launcher of the sm_80+ forward kernel.
#include "flash_dispatch.cuh"
#include "flash_fwd_sm80.cuh"
#include "flash_launch.h"
#include "kernel_choice.h"

namespace jax_flash::cuda {
namespace {

// Tile shapes per head dim: (kBlockM, kBlockN, warps). Up to 128: 32 query rows a warp (as
// FlashAttention-2); beyond, 16 rows a warp so the output accumulator fits in registers, and 8
// warps so that a CTA still owns 128 rows (each K/V tile read from shared memory serves twice
// the rows of a 64-row CTA, and an SM keeps 8 warps, not 4, with one CTA of 192 KiB).
template <int kHeadDim>
using FwdTraitsFor = std::conditional_t<
    (kHeadDim <= 128), FwdTraits<kHeadDim, 128, 64, 4>, FwdTraits<kHeadDim, 128, 64, 8>>;

template <typename T, int kHeadDim>
struct Launch {
  static cudaError_t run(const FwdParams& p, cudaStream_t stream);
};

template <typename T, int kHeadDim>
cudaError_t Launch<T, kHeadDim>::run(const FwdParams& p, cudaStream_t stream) {
  using Traits = FwdTraitsFor<kHeadDim>;
  const dim3 grid((p.shape.seq_q + Traits::kBlockM - 1) / Traits::kBlockM, p.shape.heads_q, p.shape.batch);
  return launch_with_smem(flash_fwd_kernel<Traits, T>, grid, Traits::kThreads, Traits::kSmemBytes, stream, p);
}

}  // namespace

cudaError_t launch_flash_fwd(const FwdParams& params, cudaStream_t stream) {
  if (params.shape.seq_q == 0 || params.shape.batch == 0) return cudaSuccess;
  if (forward_kernel(params) == KernelFamily::kSm90) return launch_flash_fwd_sm90(params, stream);
  return dispatch_dtype_head_dim<Launch>(params, stream);
}

}  // namespace jax_flash::cuda
