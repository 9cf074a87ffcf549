// Launcher of the Hopper main backward kernel (kernel_choice.h picks it).
#include "flash_bwd_sm90.cuh"
#include "flash_dispatch.cuh"
#include "flash_launch.h"

namespace jax_flash::cuda {
namespace {

template <typename T, int kHeadDim>
struct LaunchSm90Bwd {
  static cudaError_t run(const BwdParams& p, cudaStream_t stream) {
    if constexpr (kHeadDim == 64 || kHeadDim == 128) {
      using Traits = Sm90BwdTraits<kHeadDim>;
      const dim3 grid((p.shape.seq_k + Traits::kBlockN - 1) / Traits::kBlockN, p.shape.heads_k, p.shape.batch);
      return launch_with_smem(flash_bwd_sm90_kernel<Traits, T>, grid, Traits::kThreads, Traits::kSmemBytes, stream,
                              p);
    } else {
      return cudaErrorNotSupported;
    }
  }
};

}  // namespace

cudaError_t launch_flash_bwd_main_sm90(const BwdParams& params, cudaStream_t stream) {
  return dispatch_dtype_head_dim<LaunchSm90Bwd>(params, stream);
}

}  // namespace jax_flash::cuda
