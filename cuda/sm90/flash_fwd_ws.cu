// Launcher of the warp-specialised wgmma forward (TMA descriptors made here, per call), for the
// head dims of gpu/tile_shapes.cuh: a persistent grid (a CTA per SM, taking tiles from a counter or
// dealt them statically) or a CTA per tile (sm90/tile_scheduler.cuh).
#include <algorithm>
#include <cstdint>

#include "gpu/kernel_choice.h"
#include "gpu/kernel_launch.cuh"
#include "gpu/logit_arrays.cuh"
#include "gpu/launch.h"
#include "gpu/tile_shapes.cuh"
#include "sm90/flash_fwd_ws_kernel.cuh"
#include "sm90/tensor_map.h"
#include "sm90/tile_scheduler.cuh"

namespace jax_flash::cuda {

namespace {

// The deal measured best for a call on Traits' tiles: the static pairs for causal calls on
// 128-row tiles (5-12% faster there than the counter at head dims 128 and 256, H200, session 25),
// the counter elsewhere (+4-17% at head dim 64 without a causal mask, even at 128 and 256,
// session 25; head dim 64's causal 192-row tiles, session 44).
template <typename Traits>
QueryTileGrid measured_grid(const FwdParams& p) {
  return p.mask.causal && Traits::kBlockM == 128 ? QueryTileGrid::kStaticPairs : QueryTileGrid::kDynamic;
}

template <typename Traits, typename T>
cudaError_t launch(const FwdParams& p, const Sm90FwdOptions& options, cudaStream_t stream) {
  const AttentionShape& s = p.shape;
  const int64_t tiles = (s.seq_q + Traits::kBlockM - 1) / Traits::kBlockM * s.heads_q * s.batch;
  // The scheduler counts in int (kDynamic: up to tiles + a CTA per SM).
  if (tiles > INT32_MAX / 2) return cudaErrorInvalidConfiguration;
  FwdTmaParams params;
  params.p = p;
  const QueryTileGrid grid = options.grid.value_or(measured_grid<Traits>(p));
  params.grid = grid;
  // Tiles that end at the sequence's end (the plain kernels; unless JAX_FLASH_CUDA_FWD_ROWS=start):
  // under a causal mask the padding rows then lie in the first tile, which sees the fewest keys
  // (head dim 64's causal forward +2-6% at seq 2048-8192 on an H100, session 44). The shift is
  // whole warpgroups' rows (64), so that no O box is stored from a row before 0: TMA loads boxes
  // that start there (zeros before row 0) but a store that starts there is an illegal
  // instruction (session 44, examples/results/h200/session44/call2/tma_negative_rows.cu).
  if (end_aligned_rows_enabled())
    params.query_row_shift = static_cast<int>((Traits::kBlockM - s.seq_q % Traits::kBlockM) % Traits::kBlockM / 64 * 64);
  params.skip_unseen_blocks = skip_unseen_blocks_enabled();
  if (cudaError_t e = make_qkv_tensor_maps(p, Traits::kBlockM, Traits::kBlockN, &params.q, &params.k, &params.v))
    return e;
  const int64_t ctas = QueryTileScheduler<Traits::kBlockM>::ctas(tiles, device_sm_count(), grid);
  if (grid == QueryTileGrid::kDynamic) {
    // The tiles past the first CTA's each come from this counter (a memset node when XLA
    // captures the call in a graph).
    if (p.tile_counter == nullptr) return cudaErrorInvalidValue;
    if (cudaError_t e = cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream)) return e;
  }
  auto kernel = flash_fwd_sm90_ws_kernel<Traits, T, false>;
  // (The 128 x 128 tiles at head dims 64, 96 and 128 only: compile time, and the wide tiles'
  // registers: at key blocks of 176 ptxas serialises the products, C7512.)
  constexpr bool kSumTiles = Traits::kTileValueHeadDim <= 128 && Traits::kBlockN == 128 && Traits::kConsumers == 2;
  const bool tensor_sums = options.tensor_sums && p.for_backward();
  if constexpr (kSumTiles)
    if (tensor_sums) kernel = flash_fwd_sm90_ws_kernel<Traits, T, false, false, true>;
  // Tiles that straddle the block mask's blocks (sm90ws_wide's): the plain calls only.
  if constexpr (kBlockMaskKeys % Traits::kBlockN == 0 && kBlockMaskRows % Traits::kBlockM == 0) {
    if (general_kernel(p)) {
      kernel = general_ids(p) ? flash_fwd_sm90_ws_kernel<Traits, T, true>
                              : flash_fwd_sm90_ws_kernel<Traits, T, true, false, false, false>;
      // A soft cap or ALiBi alone takes the tensor-core sums too (the softmax's own sums are
      // about a quarter of the consumers' instructions, and the capped forward is bound by them).
      if constexpr (kSumTiles)
        if (tensor_sums && !general_ids(p)) kernel = flash_fwd_sm90_ws_kernel<Traits, T, true, false, true, false>;
    }
    // Block-sparse calls with nothing else of the general kernels: the plain kernel with the
    // block walk (head dims 64 and 128 only: compile time; 1.19-1.20x the general kernel's
    // block-sparse forward at seq 8192 hd128, cuda/PERF_NOTES.md v17).
    if constexpr (Traits::kHeadDim == 64 || Traits::kHeadDim == 128)
      if (plain_block_walk_suffices(p)) kernel = flash_fwd_sm90_ws_kernel<Traits, T, false, true>;
    // Fused dropout: a general kernel of its own (the handler refuses it beside ids or a block
    // mask; no tensor sums: P V's operand has the dropped probabilities, the sums every one).
    if (p.dropout_seeds != nullptr) kernel = flash_fwd_sm90_ws_kernel<Traits, T, true, false, false, false, false, true>;
    // jax.nn's bias and mask arrays: a general kernel of its own, with the ids' code (the
    // handler refuses them beside dropout); a 16-bit bias's tiles through shared memory (no TMA
    // store below), and a staged bias alone in the general kernel without the ids' code.
    if (logit_arrays(p)) kernel = flash_fwd_sm90_ws_kernel<Traits, T, true, false, false, true, false, false, true>;
    if constexpr (Traits::kBiasStagesFit) {
      params.bias_staged = staged_bias_enabled() && logit_arrays(p) && bias_stages(p);
      params.bias_tma = params.bias_staged && tma_bias_enabled() &&
                        make_bias_tensor_map(&params.bias, p, Traits::kBlockM) == cudaSuccess;
      if (params.bias_staged && staged_bias_alone(p))
        kernel = flash_fwd_sm90_ws_kernel<Traits, T, true, false, false, false, false, false, true>;
    }
  }
  // Plain calls with a 16-bit o store it by TMA from shared memory (not under sm90ws_directstore),
  // and so do those with a soft cap or ALiBi alone (not with dropout).
  int smem_bytes = params.bias_staged ? Traits::kSmemBytesBiasStages : Traits::kSmemBytes;
  if constexpr (Traits::kTmaStoreFits && Traits::kTileValueHeadDim <= 128)
    if (options.tma_store && !p.for_backward() && !general_ids(p) && p.dropout_seeds == nullptr) {
      if (cudaError_t e = make_head_tensor_map(&params.o, p.o, p.dtype, s.batch, s.seq_q, s.heads_q, s.head_dim_v, 64))
        return e;
      kernel = general_kernel(p) ? flash_fwd_sm90_ws_kernel<Traits, T, true, false, false, false, true>
                                 : flash_fwd_sm90_ws_kernel<Traits, T, false, false, false, false, true>;
      smem_bytes = Traits::kSmemBytesTmaStore;
    }
  return launch_with_smem(kernel, dim3(static_cast<unsigned>(ctas)), Traits::kThreads, smem_bytes, stream, params);
}

}  // namespace

template <typename T, int kHeadDim, int kValueHeadDim>
cudaError_t launch_fwd_sm90_ws(const FwdParams& p, const Sm90FwdOptions& options, cudaStream_t stream) {
  if constexpr (kValueHeadDim != kHeadDim) {
    using Shapes = ValueHeadDimShapes<kHeadDim, kValueHeadDim>;
    if (options.tiles == Sm90FwdTiles::kWide && !general_kernel(p))
      return launch<typename Shapes::Sm90FwdWsWide, T>(p, options, stream);
    return launch<typename Shapes::Sm90FwdWs, T>(p, options, stream);
  } else {
    using Shapes = TileShapes<kHeadDim>;
    if constexpr (Shapes::kHasSm90FwdWide) {
      const bool wide = options.tiles == Sm90FwdTiles::kWide ||
                        (options.tiles == Sm90FwdTiles::kMeasured && Shapes::kWideTilesByDefault);
      if (wide && !general_kernel(p) && (kHeadDim != 128 || !p.mask.causal))
        return launch<typename Shapes::Sm90FwdWsWide, T>(p, options, stream);
    }
    return launch<typename Shapes::Sm90FwdWs, T>(p, options, stream);
  }
}

#define JF_INSTANTIATE(D)                                                                                  \
  template cudaError_t launch_fwd_sm90_ws<__nv_bfloat16, D>(const FwdParams&, const Sm90FwdOptions&, cudaStream_t); \
  template cudaError_t launch_fwd_sm90_ws<__half, D>(const FwdParams&, const Sm90FwdOptions&, cudaStream_t);
JF_SM90_FWD_HEAD_DIMS(JF_INSTANTIATE)
#undef JF_INSTANTIATE
#define JF_INSTANTIATE_PAIR(D, DV)                                                                                   \
  template cudaError_t launch_fwd_sm90_ws<__nv_bfloat16, D, DV>(const FwdParams&, const Sm90FwdOptions&, cudaStream_t); \
  template cudaError_t launch_fwd_sm90_ws<__half, D, DV>(const FwdParams&, const Sm90FwdOptions&, cudaStream_t);
JF_SM90_FWD_VALUE_HEAD_DIMS(JF_INSTANTIATE_PAIR)
#undef JF_INSTANTIATE_PAIR

#ifdef JF_FWD_TIMELINE
cudaError_t reset_fwd_timeline() {
  void* words = nullptr;
  if (cudaError_t e = cudaGetSymbolAddress(&words, g_fwd_timeline)) return e;
  return cudaMemset(words, 0, sizeof(g_fwd_timeline));
}
cudaError_t read_fwd_timeline(uint64_t* words) {
  return cudaMemcpyFromSymbol(words, g_fwd_timeline, sizeof(g_fwd_timeline));
}
#endif

}  // namespace jax_flash::cuda
