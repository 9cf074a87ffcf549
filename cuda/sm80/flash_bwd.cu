// Launchers of the mma.sync backward kernels (main, and the deterministic mode's dQ), for the head
// dims of gpu/tile_shapes.cuh.
#include "gpu/kernel_choice.h"
#include "gpu/kernel_launch.cuh"
#include "gpu/launch.h"
#include "gpu/tile_shapes.cuh"
#include "sm80/flash_bwd_kernel.cuh"

namespace jax_flash::cuda {

template <typename T, int kHeadDim>
cudaError_t launch_bwd_main_sm80(const BwdParams& params, cudaStream_t stream) {
  using Traits = typename TileShapes<kHeadDim>::Sm80Bwd;
  using SplitTraits = typename TileShapes<kHeadDim>::Sm80BwdSplitDs;
  // One grid for either kernel (the split's key blocks are the plain one's), so that the CTA order
  // computed for it (key_major_groups) is the launched grid's.
  static_assert(SplitTraits::kBlockN == Traits::kBlockN, "the split kernel's key blocks");
  BwdParams p = params;
  const dim3 grid = key_block_grid<Traits>(p.shape);
  p.key_major_groups = key_major_groups(p, grid);
  // (The split's third tile needs more shared memory than an A100 has at head dim 128: there
  // narrow calls keep the 16-bit dS.)
  if (narrow_plain_call(p) && SplitTraits::kSmemBytes <= device_max_smem_per_block()) {
    p.zero_single_key_ds = true;
    return launch_with_smem(flash_bwd_kernel<SplitTraits, T, false>, grid, SplitTraits::kThreads,
                            SplitTraits::kSmemBytes, stream, p);
  }
  auto kernel = p.dropout_seeds != nullptr ? flash_bwd_kernel<Traits, T, true, true>
                : general_kernel(p)        ? flash_bwd_kernel<Traits, T, true>
                                           : flash_bwd_kernel<Traits, T, false>;
  return launch_with_smem(kernel, grid, Traits::kThreads, Traits::kSmemBytes, stream, p);
}

template <typename T, int kHeadDim>
cudaError_t launch_bwd_dq_sm80(const BwdParams& p, cudaStream_t stream) {
  using Traits = typename TileShapes<kHeadDim>::Sm80BwdDq;
  // Q and dO, and two stages of K and of V.
  constexpr int kSmemBytes = 2 * (2 * Traits::QTile::kElements + 4 * Traits::KVTile::kElements);
  constexpr bool kSplitDs = kHeadDim <= kSplitDsMaxHeadDim;
  if (narrow_plain_call(p)) {
    BwdParams narrow = p;
    narrow.zero_single_key_ds = true;
    return launch_with_smem(flash_bwd_dq_kernel<Traits, T, false, true>, query_block_grid<Traits>(p.shape),
                            Traits::kThreads, kSmemBytes, stream, narrow);
  }
  auto kernel = p.dropout_seeds != nullptr ? flash_bwd_dq_kernel<Traits, T, true, kSplitDs, true>
                : general_kernel(p)        ? flash_bwd_dq_kernel<Traits, T, true, kSplitDs>
                                           : flash_bwd_dq_kernel<Traits, T, false, kSplitDs>;
  return launch_with_smem(kernel, query_block_grid<Traits>(p.shape), Traits::kThreads, kSmemBytes, stream, p);
}

#define JF_INSTANTIATE(D)                                       \
  JF_INSTANTIATE_LAUNCHER(launch_bwd_main_sm80, BwdParams, D) \
  JF_INSTANTIATE_LAUNCHER(launch_bwd_dq_sm80, BwdParams, D)
JF_SM80_HEAD_DIMS(JF_INSTANTIATE)
#undef JF_INSTANTIATE

}  // namespace jax_flash::cuda
