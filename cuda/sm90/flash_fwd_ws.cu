// Launcher of the warp-specialised wgmma forward (TMA descriptors made here, per call), for the
// head dims of gpu/tile_shapes.cuh.
#include "gpu/kernel_launch.cuh"
#include "gpu/launch.h"
#include "gpu/tile_shapes.cuh"
#include "sm90/flash_fwd_ws_kernel.cuh"
#include "sm90/tensor_map.h"

namespace jax_flash::cuda {

template <typename T, int kHeadDim, bool kPingPong>
cudaError_t launch_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream) {
  using Traits = typename TileShapes<kHeadDim>::template Sm90FwdWs<kPingPong>;
  const AttentionShape& s = p.shape;
  FwdTmaParams params;
  params.p = p;
  if (cudaError_t e = make_head_tensor_map(&params.q, p.q, p.dtype, s.batch, s.seq_q, s.heads_q, s.head_dim,
                                           Traits::kBlockM))
    return e;
  if (cudaError_t e = make_head_tensor_map(&params.k, p.k, p.dtype, s.batch, s.seq_k, s.heads_k, s.head_dim,
                                           Traits::kBlockN))
    return e;
  if (cudaError_t e = make_head_tensor_map(&params.v, p.v, p.dtype, s.batch, s.seq_k, s.heads_k, s.head_dim,
                                           Traits::kBlockN))
    return e;
  return launch_with_smem(flash_fwd_sm90_ws_kernel<Traits, T>, query_block_grid<Traits>(s), Traits::kThreads,
                          Traits::kSmemBytes, stream, params);
}

#define JF_INSTANTIATE(D)                                                                  \
  template cudaError_t launch_fwd_sm90_ws<__nv_bfloat16, D, true>(const FwdParams&, cudaStream_t);  \
  template cudaError_t launch_fwd_sm90_ws<__half, D, true>(const FwdParams&, cudaStream_t);         \
  template cudaError_t launch_fwd_sm90_ws<__nv_bfloat16, D, false>(const FwdParams&, cudaStream_t); \
  template cudaError_t launch_fwd_sm90_ws<__half, D, false>(const FwdParams&, cudaStream_t);
JF_SM90_HEAD_DIMS(JF_INSTANTIATE)
#undef JF_INSTANTIATE

}  // namespace jax_flash::cuda
