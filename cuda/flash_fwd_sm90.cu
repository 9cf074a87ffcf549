// Launcher of the Hopper forward kernel (kernel_choice.h picks it).
#include "flash_dispatch.cuh"
#include "flash_fwd_sm90.cuh"
#include "flash_launch.h"

namespace jax_flash::cuda {
namespace {

template <typename T, int kHeadDim>
struct LaunchSm90 {
  static cudaError_t run(const FwdParams& p, cudaStream_t stream) {
    if constexpr (kHeadDim == 64 || kHeadDim == 128) {
      using Traits = Sm90FwdTraits<kHeadDim, 128>;
      const dim3 grid((p.shape.seq_q + Traits::kBlockM - 1) / Traits::kBlockM, p.shape.heads_q, p.shape.batch);
      return launch_with_smem(flash_fwd_sm90_kernel<Traits, T>, grid, Traits::kThreads, Traits::kSmemBytes, stream, p);
    } else {
      return cudaErrorNotSupported;
    }
  }
};

}  // namespace

cudaError_t launch_flash_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
  return dispatch_dtype_head_dim<LaunchSm90>(params, stream);
}

}  // namespace jax_flash::cuda
