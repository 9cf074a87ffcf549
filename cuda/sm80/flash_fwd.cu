// Launcher of the mma.sync forward kernel, for the head dims of gpu/tile_shapes.cuh.
#include "gpu/kernel_launch.cuh"
#include "gpu/launch.h"
#include "gpu/tile_shapes.cuh"
#include "sm80/flash_fwd_kernel.cuh"

namespace jax_flash::cuda {

template <typename T, int kHeadDim>
cudaError_t launch_fwd_sm80(const FwdParams& p, cudaStream_t stream) {
  using Traits = typename TileShapes<kHeadDim>::Sm80Fwd;
  auto kernel = p.dropout_seeds != nullptr ? flash_fwd_kernel<Traits, T, true, false, true>
                : general_kernel(p)        ? flash_fwd_kernel<Traits, T, true>
                : narrow_plain_call(p) ? flash_fwd_kernel<Traits, T, false, true>
                                       : flash_fwd_kernel<Traits, T, false>;
  return launch_with_smem(kernel, query_block_grid<Traits>(p.shape), Traits::kThreads, Traits::kSmemBytes, stream,
                          p);
}

#define JF_INSTANTIATE(D) JF_INSTANTIATE_LAUNCHER(launch_fwd_sm80, FwdParams, D)
JF_SM80_HEAD_DIMS(JF_INSTANTIATE)
#undef JF_INSTANTIATE

}  // namespace jax_flash::cuda
