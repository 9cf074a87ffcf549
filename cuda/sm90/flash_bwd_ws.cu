// Launcher of the warp-specialised wgmma main backward kernel (TMA descriptors made here, per
// call), for the head dims of gpu/tile_shapes.cuh; its prepare and convert kernels are
// gpu/launch.cu's.
#include "gpu/kernel_choice.h"
#include "gpu/kernel_launch.cuh"
#include "gpu/logit_arrays.cuh"
#include "gpu/launch.h"
#include "gpu/tile_shapes.cuh"
#include "sm90/flash_bwd_ws_kernel.cuh"
#include "sm90/tensor_map.h"

namespace jax_flash::cuda {

namespace {

// The call's parameters with the TMA descriptors of q, k, v and dO for Traits' blocks.
template <typename Traits>
cudaError_t tma_params(const BwdParams& p, BwdTmaParams* params) {
  const AttentionShape& s = p.shape;
  params->p = p;
  params->p.batch_innermost = longest_first_enabled() && dbias_shared_by_batch(p);
  params->p.key_major_groups = key_major_groups(params->p, key_block_grid<Traits>(s, p.kv_head_splits));
  if (cudaError_t e = make_qkv_tensor_maps(p, Traits::kBlockM, Traits::kBlockN, &params->q, &params->k, &params->v))
    return e;
  return make_head_tensor_map(&params->d_o, p.d_o, p.dtype, s.batch, s.seq_q, s.heads_q, s.head_dim_v, Traits::kBlockM);
}

// Tiles that run plain non-deterministic calls only (sm90ws_m80's and sm90ws_deferdq's;
// gpu/launch.h m80_call, defer_dq_call).
template <typename Traits, typename T>
cudaError_t launch_plain(const BwdParams& p, cudaStream_t stream) {
  BwdTmaParams params;
  if (cudaError_t e = tma_params<Traits>(p, &params)) return e;
  return launch_with_smem(flash_bwd_sm90_ws_kernel<Traits, T, false, false>,
                          key_block_grid<Traits>(p.shape, p.kv_head_splits),
                          Traits::kThreads, Traits::kSmemBytes, stream, params);
}

template <typename Traits, typename T>
cudaError_t launch(const BwdParams& p, cudaStream_t stream) {
  BwdTmaParams params;
  if (cudaError_t e = tma_params<Traits>(p, &params)) return e;
  // The run-time switches as template constants. The staged dQ's kernels and those of a value
  // head dim of its own serve non-deterministic calls only (gpu/launch.cu staged_dq_accum,
  // backward_takes_value_head_dim): no deterministic instantiations of them.
  constexpr bool kDeterministicKernels = !Traits::kStageDq && !Traits::kOwnValueHeadDim;
  auto kernel = flash_bwd_sm90_ws_kernel<Traits, T, false, false>;
  if (general_kernel(p)) kernel = flash_bwd_sm90_ws_kernel<Traits, T, false, true>;
  // Soft cap or ALiBi alone: the general kernel without the ids' and block walk's code
  // (general_ids; deterministic calls keep the whole one: compile time).
  if (general_kernel(p) && !general_ids(p) && !p.deterministic)
    kernel = flash_bwd_sm90_ws_kernel<Traits, T, false, true, false, false>;
  // Fused dropout: a general kernel of its own (not deterministic, not beside ids or a block mask:
  // the handler refuses those).
  if (p.dropout_seeds != nullptr && !p.deterministic)
    kernel = flash_bwd_sm90_ws_kernel<Traits, T, false, true, false, false, true>;
  // jax.nn's bias and mask arrays: a general kernel of its own, with the ids' code (not
  // deterministic, not beside dropout: the handler refuses those).
  if (logit_arrays(p) && !p.deterministic)
    kernel = flash_bwd_sm90_ws_kernel<Traits, T, false, true, false, true, false, true>;
  // A 16-bit bias's tiles through shared memory; a staged bias alone in the general kernel
  // without the ids' code.
  if constexpr (Traits::kBiasStagesFit) {
    params.bias_staged = staged_bias_enabled() && logit_arrays(p) && !p.deterministic && bias_stages(p);
    params.bias_tma = params.bias_staged && tma_bias_enabled() &&
                      make_bias_tensor_map(&params.bias, p, Traits::BiasTile::kRows) == cudaSuccess;
    if (params.bias_staged && staged_bias_alone(p))
      kernel = flash_bwd_sm90_ws_kernel<Traits, T, false, true, false, false, false, true>;
  }
  params.dbias_quads = staged_bias_enabled() && p.dbias_accum != nullptr && dbias_quads(p);
  if constexpr (kDeterministicKernels)
    if (p.deterministic)
      kernel = general_kernel(p) ? flash_bwd_sm90_ws_kernel<Traits, T, true, true>
                                 : flash_bwd_sm90_ws_kernel<Traits, T, true, false>;
  // Block-sparse calls with nothing else of the general kernels: the plain kernel with the block
  // walk (head dims 64 and 128, the benchmark's: compile time; 1.06-1.07x the general kernel's
  // block-sparse backward at seq 8192 hd128, cuda/PERF_NOTES.md v17).
  if constexpr (Traits::kHeadDim == 64 || Traits::kHeadDim == 128)
    if (!p.deterministic && plain_block_walk_suffices(p))
      kernel = flash_bwd_sm90_ws_kernel<Traits, T, false, false, true>;
  return launch_with_smem(kernel, key_block_grid<Traits>(p.shape, p.kv_head_splits), Traits::kThreads,
                          params.bias_staged ? Traits::kSmemBytesBiasStages : Traits::kSmemBytes, stream, params);
}

}  // namespace

template <typename T, int kHeadDim, int kValueHeadDim>
cudaError_t launch_bwd_main_sm90_ws(const BwdParams& p, Sm90BwdVariant variant, cudaStream_t stream) {
  if constexpr (kValueHeadDim != kHeadDim) {
    // The pair's one kernel (dQ by atomics), whichever variant the head dim's calls take.
    return launch<typename ValueHeadDimShapes<kHeadDim, kValueHeadDim>::Sm90BwdWs, T>(p, stream);
  } else {
    return with_sm90_bwd_traits<kHeadDim>(variant, [&](auto traits) {
      using Traits = typename decltype(traits)::type;
      if constexpr (Traits::kDqTransposed || Traits::kDeferDq)
        return launch_plain<Traits, T>(p, stream);
      else
        return launch<Traits, T>(p, stream);
    });
  }
}

#define JF_INSTANTIATE(D)                                                                                \
  template cudaError_t launch_bwd_main_sm90_ws<__nv_bfloat16, D>(const BwdParams&, Sm90BwdVariant, \
                                                                 cudaStream_t);                           \
  template cudaError_t launch_bwd_main_sm90_ws<__half, D>(const BwdParams&, Sm90BwdVariant, cudaStream_t);
JF_SM90_BWD_HEAD_DIMS(JF_INSTANTIATE)
#undef JF_INSTANTIATE
#define JF_INSTANTIATE_PAIR(D, DV)                                                                                  \
  template cudaError_t launch_bwd_main_sm90_ws<__nv_bfloat16, D, DV>(const BwdParams&, Sm90BwdVariant, cudaStream_t); \
  template cudaError_t launch_bwd_main_sm90_ws<__half, D, DV>(const BwdParams&, Sm90BwdVariant, cudaStream_t);
JF_SM90_BWD_VALUE_HEAD_DIMS(JF_INSTANTIATE_PAIR)
#undef JF_INSTANTIATE_PAIR

}  // namespace jax_flash::cuda
