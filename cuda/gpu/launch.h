// Host-side entry points of the CUDA kernels. launch_flash_fwd / launch_flash_bwd (gpu/launch.cu)
// are the one place that picks a kernel: the family from gpu/kernel_choice.h, the compiled head dim
// and tiles from gpu/tile_shapes.cuh; they call the family launchers declared below (defined and
// instantiated in sm80/ and sm90/). Launch shapes come from shapes and attributes alone, so the
// handlers are safe to capture in CUDA graphs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "common/attention_params.h"
#include "gpu/kernel_choice.h"  // (QueryTileGrid)

namespace jax_flash::cuda {

// The CUDA kernels read rows in 16-byte chunks: the caller pads the head dim to a multiple of this.
inline constexpr int64_t kHeadDimMultiple = 8;

// Whether the backward adds dQ in tiles of 64 rows x 128 columns in the fragments' order
// (Sm90BwdVariant::kTiledDq): on Hopper at head dim 128 by default, at the head dims that run the
// kernels of 128 (97..128; 65..128 under JAX_FLASH_CUDA_HD96=padded) with
// JAX_FLASH_CUDA_BACKWARD=sm90ws_tileddq (elsewhere the padding to 128 columns would cost memory).
bool tiled_dq_accum(const AttentionShape& shape);
inline constexpr int64_t kTiledDqRows = 64, kTiledDqColumns = 128;
// Whether a call of this shape may add dQ^T in tiles of 80 rows (experimental:
// JAX_FLASH_CUDA_BACKWARD=sm90ws_m80 at head dim 128; the plain calls among them do, m80_call).
bool transposed_dq_accum(const AttentionShape& shape);
inline constexpr int64_t kTransposedDqRows = 80;
// Whether this call runs sm90ws_m80's 80-row backward: under that family, plain calls at head
// dim 128 that are not deterministic.
bool m80_call(const BwdParams& params);
// Whether this call runs sm90ws_deferdq's backward (each visit's dQ during the next; the tiled
// hand-off): under that family, plain calls at head dim 128 that are not deterministic.
bool defer_dq_call(const BwdParams& params);

// Elements of the accumulator in whole tiles of `rows` query rows x `columns` per (batch, head).
inline int64_t dq_tiles_elements(const AttentionShape& shape, int64_t rows, int64_t columns = kTiledDqColumns) {
  return shape.batch * shape.heads_q * ((shape.seq_q + rows - 1) / rows) * rows * columns;
}
// Whether the call's backward adds dQ in tiles of 64 rows x staged_dq_columns through the stage
// (experimental: JAX_FLASH_CUDA_BACKWARD=sm90ws_stagedq where the split kernel of 256 runs, head
// dims 193..256 on Hopper, 129..256 under JAX_FLASH_CUDA_HD192_BWD=padded; sm90/traits.cuh
// kStageDq); deterministic calls do not.
bool staged_dq_accum(const AttentionShape& shape, bool deterministic);
// Columns of a staged dQ tile: the head dim in whole 64-column parts.
inline int64_t staged_dq_columns(const AttentionShape& shape) { return (shape.head_dim + 63) / 64 * 64; }

// The CTAs over which the Hopper backward splits each key block's group of query heads (1: no
// split): where a CTA per (key block, kv head, batch) leaves the SMs short of work (MQA, few
// kv heads), the smallest divisor of the group that makes 1.5 waves, each CTA adding its dK and
// dV into float32 accumulators (BwdParams::dkv_accum) that a last kernel converts. Not in
// deterministic mode (the additions' order would vary) nor on the mma.sync backward, nor with a
// value head dim of its own (Hv != H); only plain calls split (gpu/launch.cu), though the others'
// workspace has the room.
int kv_head_splits(const AttentionShape& shape, bool deterministic);

// BwdParams::key_major_groups for a main backward grid (gpu/kernel_launch.cuh key_block_grid): on
// a causal call, chunks of about two waves of CTAs (at least one group: a (slot, batch) pair's key
// blocks, or a slot's of every batch element under BwdParams::batch_innermost, which the caller
// sets first), longest key blocks first (gpu/block_geometry.cuh key_block_of_cta); 0 (the grid's
// order) otherwise, where the key blocks' work is equal, or under JAX_FLASH_CUDA_ORDER=grid.
int key_major_groups(const BwdParams& p, dim3 grid);

// Elements of the dQ part of the backward's float32 workspace: one per element of dQ (or a whole
// tile per (batch, head, 64-row block) with tiled_dq_accum or staged_dq_accum, the larger of those
// and the 80-row tiles' with transposed_dq_accum).
inline int64_t dq_part_elements(const AttentionShape& shape) {
  int64_t elements = shape.batch * shape.heads_q * shape.seq_q * shape.head_dim;
  if (tiled_dq_accum(shape)) elements = std::max(elements, dq_tiles_elements(shape, kTiledDqRows));
  if (transposed_dq_accum(shape)) elements = std::max(elements, dq_tiles_elements(shape, kTransposedDqRows));
  if (staged_dq_accum(shape, false))
    elements = std::max(elements, dq_tiles_elements(shape, kTiledDqRows, staged_dq_columns(shape)));
  return elements;
}

// Elements of the backward's float32 accumulator workspace: the dQ part, then, where the heads
// split (kv_head_splits), dK's and dV's accumulators; none in deterministic mode (dQ then comes
// from its own kernel, without atomics).
inline int64_t dq_accum_elements(const AttentionShape& shape, bool deterministic) {
  if (deterministic) return 0;
  const int64_t dkv = kv_head_splits(shape, false) > 1 ? 2 * shape.batch * shape.seq_k * shape.heads_k * shape.head_dim : 0;
  return dq_part_elements(shape) + dkv;
}

// Whether the forward of a call whose value head dim Hv differs from H runs a kernel of its own
// for the pair (JAX_FLASH_CUDA_VALUE_HEAD_DIM=native, on Hopper, a wgmma forward family, and the
// compiled head dims of H and Hv a pair of JF_SM90_FWD_VALUE_HEAD_DIMS): of the shape alone, so
// that the Python side's answer holds for every shard of a call. The handler takes Hv != H only
// then (the Python side pads v to H otherwise); false where Hv == H.
bool forward_takes_value_head_dim(const AttentionShape& shape);

// Whether the Hopper kernels run a pass of this shape, the ones with jax.nn's bias and mask arrays
// (gpu/logit_arrays.cuh; experimental): on Hopper, the compiled head dim's Hopper kernel, a wgmma
// family (not a JAX_FLASH_CUDA_* override to mma.sync), and for the backward not deterministic (its
// dQ kernel is mma.sync). The handlers refuse the arrays elsewhere.
bool hopper_takes_logit_arrays(const AttentionShape& shape, bool backward, bool deterministic);

// Whether the backward of a call whose value head dim Hv differs from H runs a kernel of its own
// for the pair (as forward_takes_value_head_dim, with the Hopper backward family at H's compiled
// head dim, JF_SM90_BWD_VALUE_HEAD_DIMS, and not deterministic); the Python side pads v and dO
// to H otherwise. False where Hv == H.
bool backward_takes_value_head_dim(const AttentionShape& shape, bool deterministic);

// Forward: o and lse.
cudaError_t launch_flash_fwd(const FwdParams& params, cudaStream_t stream);
// Backward: dq, dk, dv, using params.delta and params.dq_accum (dq_accum_elements) as workspaces
// the caller owns.
cudaError_t launch_flash_bwd(const BwdParams& params, cudaStream_t stream);

// The family launchers, for a 16-bit dtype T and a compiled head dim.
template <typename T, int kHeadDim>
cudaError_t launch_fwd_sm80(const FwdParams& params, cudaStream_t stream);
// The warp-specialised TMA forward (sm90/flash_fwd_ws_kernel.cuh): on a persistent grid or a CTA
// per tile; block-sparse calls that need nothing else of the general kernels run the plain one
// walking the block mask. Plain calls take FlashAttention-3's wider tiles (gpu/tile_shapes.cuh)
// where they measured faster (kMeasured), never (kNarrow), or wherever they exist (kWide).
enum class Sm90FwdTiles { kMeasured, kNarrow, kWide };
// int32 elements of the CUDA forward's scheduler workspace (FwdParams::tile_counter), an output
// of its custom call.
inline constexpr int64_t kFwdSchedulerElements = 1;
struct Sm90FwdOptions {
  // How the grid's CTAs take tiles (sm90/tile_scheduler.cuh): from a counter, dealt statically in
  // pairs or a CTA each where JAX_FLASH_CUDA_FWD_GRID forces one; unset, the launch measured
  // best for the mask and the tiles it runs (sm90/flash_fwd_ws.cu measured_grid).
  std::optional<QueryTileGrid> grid;
  Sm90FwdTiles tiles = Sm90FwdTiles::kMeasured;
  // Plain differentiated calls on the 128 x 128 tiles at head dims 64 and 128 take the 16-bit P's
  // row sums from the tensor cores (flash_fwd_ws_kernel.cuh kTensorSums; off: sm90ws_alusums).
  bool tensor_sums = true;
  // Plain calls with a 16-bit o store it by TMA (flash_fwd_ws_kernel.cuh kTmaStore; off under
  // JAX_FLASH_CUDA_FORWARD=sm90ws_directstore).
  bool tma_store = false;
};
// kValueHeadDim: V's and O's head dim where a pair of gpu/tile_shapes.cuh JF_SM90_FWD_VALUE_HEAD_DIMS
// runs (forward_takes_value_head_dim).
template <typename T, int kHeadDim, int kValueHeadDim = kHeadDim>
cudaError_t launch_fwd_sm90_ws(const FwdParams& params, const Sm90FwdOptions& options, cudaStream_t stream);
template <typename T, int kHeadDim>
cudaError_t launch_bwd_main_sm80(const BwdParams& params, cudaStream_t stream);
// The warp-specialised main backward's variants (sm90/flash_bwd_ws_kernel.cuh): 64-row query
// blocks with dQ added by atomics from the math warps or by bulk reductions from shared memory,
// or (head dim 64) 128-row query blocks with dQ by atomics, split by rows, and dK from registers
// (general calls included: with the soft cap or ALiBi 1.04-1.10x faster than 64-row visits,
// session 15, though their registers spill 40 bytes).
// kTiledDq (experimental, head dim 128): bulk reductions of whole warpgroup parts into a dQ
// accumulator in the fragments' order (tiled_dq_accum), converted by its own kernel.
// kM80 (experimental, head dim 128, plain non-deterministic calls): 80-row query blocks with dQ
// computed transposed into the tiled hand-off (sm90/traits.cuh kDqTransposed).
// kDeferDq (experimental, head dim 128, plain non-deterministic calls): kTiledDq without the
// consumers' barrier, each visit's dQ during the next (sm90/traits.cuh kDeferDq).
// kValueHeadDim != kHeadDim: a pair of JF_SM90_BWD_VALUE_HEAD_DIMS (backward_takes_value_head_dim),
// whose one kernel runs whatever the variant.
enum class Sm90BwdVariant { kAtomicDq, kBulkDq, kBlockM128, kTiledDq, kM80, kDeferDq, kStageDq };
template <typename T, int kHeadDim, int kValueHeadDim = kHeadDim>
cudaError_t launch_bwd_main_sm90_ws(const BwdParams& params, Sm90BwdVariant variant, cudaStream_t stream);
// The deterministic mode's dQ kernel (mma.sync on every GPU).
template <typename T, int kHeadDim>
cudaError_t launch_bwd_dq_sm80(const BwdParams& params, cudaStream_t stream);

}  // namespace jax_flash::cuda
