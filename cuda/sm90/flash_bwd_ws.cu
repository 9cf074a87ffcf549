// Launcher of the warp-specialised wgmma main backward kernel (TMA descriptors made here, per
// call), for the head dims of gpu/tile_shapes.cuh; its prepare and convert kernels are
// gpu/launch.cu's.
#include "gpu/kernel_launch.cuh"
#include "gpu/launch.h"
#include "gpu/tile_shapes.cuh"
#include "sm90/flash_bwd_ws_kernel.cuh"
#include "sm90/tensor_map.h"

namespace jax_flash::cuda {

template <typename T, int kHeadDim>
cudaError_t launch_bwd_main_sm90_ws(const BwdParams& p, cudaStream_t stream) {
  using Traits = typename TileShapes<kHeadDim>::Sm90BwdWs;
  const AttentionShape& s = p.shape;
  BwdTmaParams params;
  params.p = p;
  if (cudaError_t e = make_qkv_tensor_maps(p, Traits::kBlockM, Traits::kBlockN, &params.q, &params.k, &params.v))
    return e;
  if (cudaError_t e = make_head_tensor_map(&params.d_o, p.d_o, p.dtype, s.batch, s.seq_q, s.heads_q, s.head_dim,
                                           Traits::kBlockM))
    return e;
  return launch_with_smem(flash_bwd_sm90_ws_kernel<Traits, T>, key_block_grid<Traits>(s), Traits::kThreads,
                          Traits::kSmemBytes, stream, params);
}

#define JF_INSTANTIATE(D) JF_INSTANTIATE_LAUNCHER(launch_bwd_main_sm90_ws, BwdParams, D)
JF_SM90_HEAD_DIMS(JF_INSTANTIATE)
#undef JF_INSTANTIATE

}  // namespace jax_flash::cuda
