// Launcher of the wgmma main backward kernel, for the head dims of gpu/tile_shapes.cuh (its
// prepare, convert and deterministic dQ kernels are shared with the sm80 family: gpu/launch.cu).
#include "gpu/kernel_launch.cuh"
#include "gpu/launch.h"
#include "gpu/tile_shapes.cuh"
#include "sm90/flash_bwd_kernel.cuh"

namespace jax_flash::cuda {

template <typename T, int kHeadDim>
cudaError_t launch_bwd_main_sm90(const BwdParams& p, cudaStream_t stream) {
  using Traits = typename TileShapes<kHeadDim>::Sm90Bwd;
  return launch_with_smem(flash_bwd_sm90_kernel<Traits, T>, key_block_grid<Traits>(p.shape), Traits::kThreads,
                          Traits::kSmemBytes, stream, p);
}

#define JF_INSTANTIATE(D) JF_INSTANTIATE_LAUNCHER(launch_bwd_main_sm90, BwdParams, D)
JF_SM90_HEAD_DIMS(JF_INSTANTIATE)
#undef JF_INSTANTIATE

}  // namespace jax_flash::cuda
