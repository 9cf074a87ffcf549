// Every CUDA kernel's tile shape per head dim, in one table, and the head dims each family is
// compiled for (inputs padded to a multiple of kHeadDimMultiple run on the smallest compiled head
// dim that holds them: gpu/launch.cu).
#pragma once

#include <type_traits>

#include "gpu/launch.h"
#include "sm80/traits.cuh"
#include "sm90/traits.cuh"

namespace jax_flash::cuda {

// The compiled head dims of each family, smallest first, as X-macros: the launch switch and the
// launchers' instantiations are both generated from them. JF_HEAD_DIMS is the launch switch's:
// every family's; a family without a compiled head dim runs the smallest of its own that holds it
// (sm80_head_dim: head dim 96 is the wgmma kernels' alone, the mma.sync ones run it at 128).
#define JF_HEAD_DIMS(X) X(32) X(64) X(96) X(128) X(192) X(256)
#define JF_SM80_HEAD_DIMS(X) X(32) X(64) X(128) X(192) X(256)
#define JF_SM90_FWD_HEAD_DIMS(X) X(64) X(96) X(128) X(192) X(256)
#define JF_SM90_BWD_HEAD_DIMS(X) X(64) X(96) X(128) X(192) X(256)
// The (H, Hv) pairs whose Hopper forward has kernels of their own where the value head dim Hv
// differs from H (MLA's 192 / 128; ValueHeadDimShapes), compiled head dims both: a call runs the
// pair of its compiled H and Hv where that pair is listed (gpu/launch.cu), else v zero-padded to H.
#define JF_SM90_FWD_VALUE_HEAD_DIMS(X) X(192, 128)
// ... and whose Hopper backward has (its split kernel; non-deterministic calls: the deterministic
// dQ kernel is the mma.sync family's, of one head dim).
#define JF_SM90_BWD_VALUE_HEAD_DIMS(X) X(192, 128)

// The smallest mma.sync head dim at or above head_dim.
constexpr int sm80_head_dim(int head_dim) {
#define JF_SM80_AT_LEAST(D) \
  if (head_dim <= D) return D;
  JF_SM80_HEAD_DIMS(JF_SM80_AT_LEAST)
#undef JF_SM80_AT_LEAST
  return 0;
}

template <int kHeadDim>
struct TileShapes {
  static_assert(kHeadDim % kHeadDimMultiple == 0, "compiled head dims are whole chunks");

  // mma.sync forward (kBlockM, kBlockN, warps). Up to 128: 32 query rows a warp (as
  // FlashAttention-2); beyond, 16 rows a warp so the output accumulator fits in registers, and 8
  // warps so that a CTA still owns 128 rows (each K/V tile read from shared memory serves twice
  // the rows of a 64-row CTA, and an SM keeps 8 warps, not 4, with one CTA of 192 KiB).
  using Sm80Fwd = FwdTraits<kHeadDim, 128, 64, (kHeadDim <= 128 ? 4 : 8)>;
  // mma.sync backward (kBlockM, kBlockN, warps, then the warp grids' row counts for S/dP, dK/dV
  // and dQ): 8 warps; key blocks of 128 up to head dim 128, of 64 beyond (shared memory).
  using Sm80Bwd = BwdTraits<kHeadDim, 64, (kHeadDim <= 128 ? 128 : 64), 8, 2, 4, 4>;
  // The same with dS as hi + lo at every head dim: the narrow calls' (narrow_plain_call).
  using Sm80BwdSplitDs = BwdTraits<kHeadDim, 64, (kHeadDim <= 128 ? 128 : 64), 8, 2, 4, 4, true>;
  // The deterministic dQ kernel: query blocks of 64 (16 rows a warp), key blocks as the forward.
  using Sm80BwdDq = FwdTraits<kHeadDim, 64, (kHeadDim <= 128 ? 64 : 32), 4>;

#define JF_IS_HEAD_DIM(D) || kHeadDim == D
  static constexpr bool kHasSm90Fwd = false JF_SM90_FWD_HEAD_DIMS(JF_IS_HEAD_DIM);
  static constexpr bool kHasSm90Bwd = false JF_SM90_BWD_HEAD_DIMS(JF_IS_HEAD_DIM);
#undef JF_IS_HEAD_DIM
  // Warp-specialised wgmma forward: a TMA producer warpgroup and 2 consumer warpgroups x 64 query
  // rows, key blocks of 128 in 2 stages (of 64 past head dim 128: shared memory).
  using Sm90FwdWs = Sm90FwdWsTraits<kHeadDim, (kHeadDim <= 128 ? 128 : 64), 2>;
  // FlashAttention-3's forward tiles for the plain calls: at head dim 128 key blocks of 176
  // without a causal mask (fewer softmax steps and hand-offs per key; causal calls keep 128: more
  // masked work on the diagonal); at head dim 64 query blocks of 192 rows, three consumer
  // warpgroups taking turns (each K and V tile serves 1.5x the rows); at 192 and 256 key blocks of
  // 112 and 80 (the most shared memory holds, against 64). Not for the general calls (tiles that
  // straddle the block mask's 128 x 128 blocks).
  static constexpr bool kHasSm90FwdWide = kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256;
  // (Head dim 96: the 128 x 128 tiles; the wide ones not measured there.)
  static constexpr int kWideKeys = kHeadDim == 128 ? 176 : kHeadDim == 192 ? 112 : kHeadDim == 256 ? 80 : 128;
  using Sm90FwdWsWide = Sm90FwdWsTraits<kHeadDim, kWideKeys, 2, (kHeadDim == 64 ? 3 : 2)>;
  // Where the wide tiles run by default: where they measured faster (H200, seq 8192, session 17,
  // cuda/PERF_NOTES.md v17: head dim 192 +15% / +7% non-causal / causal, 256 +6% / even, 64
  // non-causal +7%; 128 non-causal even keeps the 128 x 128 tiles; 64 causal since session 44,
  // v42: once a tile's rows past the sequence stopped masking its every block, on the tile counter
  // +2% / +1% / +13% at seq 2048 / 4096 / 8192 on an H100).
  static constexpr bool kWideTilesByDefault = kHeadDim == 192 || kHeadDim == 256 || kHeadDim == 64;
  // Warp-specialised wgmma backward: a TMA producer warpgroup and 2 consumer warpgroups x 64 keys,
  // query blocks of 64; dQ added by atomics, or by bulk reductions from a shared tile. At head dims
  // 192 and 256 the warpgroups share key blocks of 64 and split the head dim's products
  // (sm90/traits.cuh kSplitHeadDim; dQ by atomics only): at 256 1.4-1.5x the mma.sync backward
  // (H200, session 22, cuda/PERF_NOTES.md v22). Head dim 192 ran 256's kernels zero-padded in
  // session 28 (JAX_FLASH_CUDA_HD192_BWD=padded; gpu/launch.cu pads_192_backward).
  static constexpr bool kSplitBwd = kHeadDim == 192 || kHeadDim == 256;
  using Sm90BwdWs = Sm90BwdWsTraits<kHeadDim, false, 64, false, kSplitBwd>;
  using Sm90BwdWsBulkDq = Sm90BwdWsTraits<kHeadDim, !kSplitBwd, 64, false, kSplitBwd>;
  // Experimental (JAX_FLASH_CUDA_BACKWARD=sm90ws_stagedq): the split kernel of head dim 256 with
  // dQ handed off through the stage's Q and dO tiles into a tiled accumulator (sm90/traits.cuh
  // kStageDq).
  static constexpr bool kHasSm90BwdStageDq = kHeadDim == 256;
  using Sm90BwdWsStageDq = Sm90BwdWsTraits<kHeadDim, false, 64, false, kSplitBwd, false, kHasSm90BwdStageDq>;
  // FlashAttention-3's dQ hand-off, one bulk reduction a warpgroup a visit into an accumulator in
  // the fragments' order (the kernel of head dim 128): the default at head dim 128 (+8-10% on the
  // backward over row reductions, H200, session 18, cuda/PERF_NOTES.md v18), at 65..127 with
  // JAX_FLASH_CUDA_BACKWARD=sm90ws_tileddq (gpu/launch.h tiled_dq_accum).
  static constexpr bool kHasSm90BwdTiledDq = kHeadDim == 128;
  using Sm90BwdWsTiledDq = Sm90BwdWsTraits<kHeadDim, true, 64, kHasSm90BwdTiledDq>;
  // Experimental (JAX_FLASH_CUDA_BACKWARD=sm90ws_m80): FlashAttention-3's non-causal backward tile
  // at head dim 128, 80-row query blocks with dQ computed transposed into the tiled hand-off
  // (sm90/traits.cuh kDqTransposed), for plain calls (gpu/launch.h m80_call).
  static constexpr bool kHasSm90BwdM80 = kHeadDim == 128;
  using Sm90BwdWsM80 = Sm90BwdWsTraits<kHeadDim, true, (kHasSm90BwdM80 ? 80 : 64), kHasSm90BwdM80>;
  // Experimental (JAX_FLASH_CUDA_BACKWARD=sm90ws_deferdq): the tiled kernel without the consumers'
  // barrier, each visit's dQ computed during the next (sm90/traits.cuh kDeferDq), for plain calls
  // (gpu/launch.h defer_dq_call).
  using Sm90BwdWsDeferDq = Sm90BwdWsTraits<kHeadDim, true, 64, kHasSm90BwdTiledDq, false, kHasSm90BwdTiledDq>;
  // 128-row query blocks, dQ split by rows between the consumers (registers allow head dim 64
  // only), dK from registers; the default there: +8-10% over 64-row blocks with atomics
  // (cuda/PERF_NOTES.md v10), +8-10% more from dK's registers (v11).
  static constexpr bool kHasSm90BwdBlockM128 = kHeadDim == 64;
  using Sm90BwdWsBlockM128 = Sm90BwdWsTraits<kHeadDim, false, (kHasSm90BwdBlockM128 ? 128 : 64)>;
  // With 64-row query blocks, the backward's dQ by default as measured on the H200 (v6): bulk
  // reductions at head dim 128 (+5-11% over atomics), atomics elsewhere (bulk reductions 25%
  // slower at 64). Head dim 96 (and 65..95, its kernel) adds dQ by atomics since session 28: with
  // the quad order's 16-byte atomics (v26) they beat the bulk row reductions by 9-19% on the
  // backward (cuda/PERF_NOTES.md v28).
  static constexpr bool kSm90BwdBulkDqByDefault = kHeadDim == 128;
};

// The Hopper forward's tiles for a value head dim Hv != H (JF_SM90_FWD_VALUE_HEAD_DIMS): V and O
// Hv columns wide, Q and K H. At 192 / 128 the consumers hold O as at head dim 128 (64 floats a
// thread), so key blocks of 128 fit their registers, as at 128; the wide tiles are head dim 192's
// (112 keys), the only ones with room for the TMA store's O tile.
// The backward's: the split kernel of H (sm90/traits.cuh kSplitHeadDim) with V and dO tiles Hv
// wide and each warpgroup's columns of dK and dV its own (split_dk_columns, split_dv_columns).
template <int kHeadDim, int kValueHeadDim>
struct ValueHeadDimShapes {
  using Sm90FwdWs = Sm90FwdWsTraits<kHeadDim, 128, 2, 2, kValueHeadDim>;
  using Sm90FwdWsWide = Sm90FwdWsTraits<kHeadDim, TileShapes<kHeadDim>::kWideKeys, 2, 2, kValueHeadDim>;
  static_assert(TileShapes<kHeadDim>::kSplitBwd, "the split backward's head dims");
  using Sm90BwdWs = Sm90BwdWsTraits<kHeadDim, false, 64, false, true, false, false, kValueHeadDim>;
};

// A type as a value (C++17 has no std::type_identity).
template <typename T>
struct TypeTag {
  using type = T;
};

// The traits of the kernel that runs the Hopper backward's `variant` at head dim kD: the one
// mapping from a variant to its kernel, read by its launch (sm90/flash_bwd_ws.cu) and by the
// steps around it (gpu/launch.cu: whether the kernel adds dQ by atomics, which decides dQ's
// convert). Returns f(TypeTag<Traits>{}). A variant the head dim has no kernel of takes the
// 64-row atomics kernel (gpu/launch.cu never asks for one).
template <int kD, typename F>
decltype(auto) with_sm90_bwd_traits(Sm90BwdVariant variant, F&& f) {
  using Shapes = TileShapes<kD>;
  if (variant == Sm90BwdVariant::kBulkDq) return f(TypeTag<typename Shapes::Sm90BwdWsBulkDq>{});
  if constexpr (Shapes::kHasSm90BwdTiledDq) {
    using Tiled = typename Shapes::Sm90BwdWsTiledDq;
    // The accumulator's tiles (gpu/launch.h, sized there and read by the tiled convert) are the
    // kernel's visits: a query block of every head-dim column.
    static_assert(Tiled::kBlockM == kTiledDqRows && Tiled::kHeadDim == kTiledDqColumns, "tiled dQ geometry");
    if (variant == Sm90BwdVariant::kTiledDq) return f(TypeTag<Tiled>{});
    if (variant == Sm90BwdVariant::kDeferDq) return f(TypeTag<typename Shapes::Sm90BwdWsDeferDq>{});
  }
  if constexpr (Shapes::kHasSm90BwdM80) {
    using M80 = typename Shapes::Sm90BwdWsM80;
    static_assert(M80::kBlockM == kTransposedDqRows && M80::kHeadDim == kTiledDqColumns, "transposed dQ geometry");
    if (variant == Sm90BwdVariant::kM80) return f(TypeTag<M80>{});
  }
  if constexpr (Shapes::kHasSm90BwdStageDq)
    if (variant == Sm90BwdVariant::kStageDq) return f(TypeTag<typename Shapes::Sm90BwdWsStageDq>{});
  if constexpr (Shapes::kHasSm90BwdBlockM128)
    if (variant == Sm90BwdVariant::kBlockM128) return f(TypeTag<typename Shapes::Sm90BwdWsBlockM128>{});
  return f(TypeTag<typename Shapes::Sm90BwdWs>{});
}

// Explicit instantiations of a launcher template<T, kHeadDim> for both 16-bit dtypes.
#define JF_INSTANTIATE_LAUNCHER(launcher, Params, D)                                  \
  template cudaError_t launcher<__nv_bfloat16, D>(const Params&, cudaStream_t); \
  template cudaError_t launcher<__half, D>(const Params&, cudaStream_t);

}  // namespace jax_flash::cuda
