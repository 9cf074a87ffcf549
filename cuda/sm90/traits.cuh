// Kernel shapes of the wgmma (sm_90a) kernels: one traits template per kernel, from the tile
// sizes of gpu/tile_shapes.cuh.
#pragma once

#include <type_traits>

#include "gpu/smem_tile.cuh"
#include "sm90/gmma_tile.cuh"

namespace jax_flash::cuda {

// The columns of a kernel's shared Q, K, V (and dO) tiles: the head dim in whole 64-column blocks
// (the 128-byte swizzle's). At head dim 96 the tiles are 128 wide, their last 32 columns zeros
// that TMA fills (the tensor maps end at the head dim) and no product reads: the products over
// the head dim take 6 k-steps, those that make head-dim columns N = 96 (session 23; before, head
// dims 65..96 ran the kernels of 128 whole).
constexpr int tile_head_dim(int head_dim) { return (head_dim + 63) / 64 * 64; }

// The warp-specialised forward (sm90/flash_fwd_ws_kernel.cuh): a producer warpgroup (TMA) and
// kConsumers consumer warpgroups (2, or 3: FlashAttention-3's 192-row tile at head dim 64) of 64
// query rows each, kStages stages of K and of V. kValueHeadDim: V's and O's head dim Hv where it
// differs from Q's and K's (MLA's 192 / 128: P V then makes Hv columns, not H of which H - Hv are
// zeros; gpu/tile_shapes.cuh ValueHeadDimShapes).
template <int kHeadDim_, int kBlockN_, int kStages_, int kConsumers_ = 2, int kValueHeadDim_ = kHeadDim_>
struct Sm90FwdWsTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kTileHeadDim = tile_head_dim(kHeadDim);
  static constexpr int kValueHeadDim = kValueHeadDim_;
  static constexpr int kTileValueHeadDim = tile_head_dim(kValueHeadDim);
  static constexpr int kConsumers = kConsumers_;
  static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  // The consumer warpgroups take turns at their products (one's softmax under another's GEMMs).
  static constexpr bool kPingPong = true;
  // Whether a consumer warpgroup may skip the key blocks none of its rows sees (the plain kernels,
  // unless JAX_FLASH_CUDA_FWD_UNSEEN=compute): on the 192-row tiles only, whose upper warpgroups
  // miss a causal tile's last block or two. On 128-row tiles it could skip only an end-aligned
  // first tile's padding warpgroup, and its code (idle turns and pass-overs around the block loop,
  // +1000 SASS instructions) cost head dim 256's forward 7-20% at seq 1024-2048 (b74ec67 against
  // a076682 on an H100; without it the kernel is back at a076682's ratio to cuDNN: PERF_NOTES v49).
  static constexpr bool kSkipsUnseenBlocks = kConsumers == 3;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerWarps = 4 * kConsumers;
  // setmaxnreg split of the 64K registers (multiples of 8): the producer needs few. Three
  // consumers take the whole file at 32 / 160 (ptxas, head dim 64: 20 B spilled; 24 / 160 spilled
  // more, 40 / 152 too, in the consumers).
  static constexpr int kProducerRegisters = kConsumers == 2 ? 56 : 32;
  static constexpr int kConsumerRegisters = kConsumers == 2 ? 224 : 160;
  // setmaxnreg moves registers within the CTA's launch allocation (__launch_bounds__(kThreads, 1):
  // the register file over kThreads, in multiples of 8 a thread); asking for more hangs.
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * 128 * kConsumers <= 65536 / kThreads / 8 * 8 * kThreads,
                "registers past the launch allocation");
  using QTile = GmmaTile<kBlockM, kTileHeadDim>;
  using KTile = GmmaTile<kBlockN, kTileHeadDim>;
  using VTile = GmmaTile<kBlockN, kTileValueHeadDim>;
  using OTile = GmmaTile<kBlockM, kTileValueHeadDim>;
  // Q, kStages stages of K and of V, the ones tile (1 KiB: sm90/fwd_gemms.cuh issue_output's row
  // sums), and 1 KiB to align the base.
  static constexpr int kOnesElements = 512;
  static constexpr int kSmemBytes =
      2 * (QTile::kElements + kStages * (KTile::kElements + VTile::kElements) + kOnesElements) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  // With the O tile that the TMA-store epilogue writes from (flash_fwd_ws_kernel.cuh kTmaStore):
  // where it fits.
  static constexpr int kSmemBytesTmaStore = kSmemBytes + 2 * OTile::kElements;
  static constexpr bool kTmaStoreFits = kSmemBytesTmaStore <= 227 * 1024;
  // The kernel's static shared memory (its barriers), padded to the dynamic part's 1 KiB
  // alignment (ptxas: 1024 bytes smem); a CTA's static and dynamic parts share the 227 KiB.
  static constexpr int kStaticSmemBytes = 1024;
  // With kStages tiles of a 16-bit bias (a key block of each query row of the tile, swizzled:
  // flash_fwd_ws_kernel.cuh FwdTmaParams::bias_staged) in the O tile's place: key blocks of 64 or
  // 128, where it fits (head dim 128: all of the 227 KiB; session 34's first run on an H100 found
  // 32 bytes too many when the tiles' barriers were dynamic: "invalid argument" at launch).
  using BiasTile = SmemTile<kBlockM, (kBlockN == 64 || kBlockN == 128) ? kBlockN : 64>;
  // The same tile in the TMA's swizzle (JAX_FLASH_CUDA_BIAS_LOADS=tma: FwdTmaParams::bias_tma).
  using BiasTmaTile = GmmaTile<kBlockM, BiasTile::kCols>;
  static constexpr int kSmemBytesBiasStages = kSmemBytes + kStages * 2 * BiasTile::kElements;
  static constexpr bool kBiasStagesFit =
      (kBlockN == 64 || kBlockN == 128) && kSmemBytesBiasStages + kStaticSmemBytes <= 227 * 1024;
  static_assert(kValueHeadDim % 64 == 0 || kValueHeadDim == 96, "P V is done in products of N = 128 and 64, or 96");
  static_assert(kBlockN == 64 || kBlockN == 80 || kBlockN == 112 || kBlockN == 128 || kBlockN == 176,
                "wgmma shapes are instantiated for N = 64, 80, 112, 128, 176");
};

// The warp-specialised backward (sm90/flash_bwd_ws_kernel.cuh): a producer warpgroup (TMA) and
// 2 consumer warpgroups of 64 keys each; Q, dO (and their rows' lse, delta)
// in kStages stages, dS^T double-buffered. kBulkDq: the consumers leave each visit's dQ in a
// float32 shared tile that the producer's second warp adds to the accumulator with bulk
// reductions (else the consumers add it with atomics). kBlockM: query rows a visit, 64, or 128 at
// head dim 64 (FlashAttention-3's tile there: half the visits, and dQ split by query rows
// between the warpgroups, 64 rows each, instead of computed by warpgroup 0 alone).
// kDkFromRegisters (128-row visits): dK += dS^T Q takes dS^T from registers as dV takes P^T, and
// both products are issued before the consumers' barrier, so they run while a warpgroup waits
// for the other's dS^T (+8-10% bwd at head dim 64, cuda/PERF_NOTES.md v11; with 64-row visits at
// head dim 128 it measured even, so those keep dK reading dS^T from shared memory after the
// barrier).
// kTiledDq (with kBulkDq at head dim 128; the default there): FlashAttention-3's dQ hand-off. Each
// warpgroup leaves its dQ part (64 rows x its 64 columns) in the shared tile in its fragments'
// order (thread t's n-tile j at float4 j * 128 + t: conflict-free 16-byte stores), and the dQ
// accumulator holds every (batch, head, 64-row block)'s tile in that same order, so the writer
// adds a warpgroup's part with ONE 16 KiB bulk reduction (instead of a 512-byte one a row, 64
// a visit), each warpgroup with its own full/empty barriers; the convert kernel reorders
// (gpu/bwd_postprocess.cuh flash_bwd_convert_tiled_dq_kernel).
// kDqTransposed (80-row visits, experimental: JAX_FLASH_CUDA_BACKWARD=sm90ws_m80, FlashAttention-3's
// non-causal tile at head dim 128): 25% fewer visits per product than 64 rows. wgmma's M is 64,
// so dQ is computed transposed, dQ^T = K^T dS^T (each warpgroup 64 head-dim rows x 80 queries),
// which reads dS^T as a K-major B: the dS^T buffers are query-major, [query][key] (stmatrix
// .trans from the fragments), and dK += dS^T Q reads them M-major. The tiled hand-off then holds
// dQ^T fragments (gpu/bwd_postprocess.cuh flash_bwd_convert_transposed_dq_kernel).
// kSplitHeadDim (head dims 192 and 256, where a warpgroup's dK and dV over the whole head dim do
// not fit in its registers; FlashAttention-3 splits them too): key blocks of 64 that both
// warpgroups share; each computes S^T and dP^T for its half of the block's queries (N = 32),
// leaves P^T and dS^T in shared tiles, and after the consumers' barrier accumulates dV and dK for
// its head-dim columns (warpgroup 0 the first 128, warpgroup 1 the rest: 128 or 64) and dQ for its
// 64-column blocks of it (two each at 256; at 192 one for warpgroup 0 and two for warpgroup 1, so
// that each takes about half the products: split_dk_columns, split_dq_blocks); dQ by atomics.
// (Halves of 96 would start mid-way through a 64-column block, which an N-major operand cannot.)
// kDeferDq (experimental, with kTiledDq on 64-row visits): the consumers' barrier goes; each
// warpgroup computes a visit's dQ during its next visit, once the other warpgroup has signalled
// that visit's dS^T (an mbarrier a warpgroup and buffer), so the two warpgroups may drift apart
// and one's softmax run under the other's products. dS^T then takes four buffers (a buffer is
// written again only once the other warpgroup has signalled a later visit, which it does after
// its dQ of this one).
// kStageDq (experimental, with kSplitHeadDim: JAX_FLASH_CUDA_BACKWARD=sm90ws_stagedq): no atomics
// for dQ. Once its dK and dV are in, a warpgroup's half of the stage's Q and dO tiles (the columns
// its products read, 16 KiB each) is free: it leaves its two 64-column blocks of dQ there in its
// fragments' order, and the producer's second warp adds them to the tiled accumulator (as at head
// dim 128, 64-column parts) with one 16 KiB bulk reduction each, then releases the stage itself
// (FlashAttention-3 hands dQ off through a shared tile of its own, which 256 columns leave no
// room for beside two stages).
// kValueHeadDim (with kSplitHeadDim: gpu/tile_shapes.cuh ValueHeadDimShapes): V's, dO's and dV's
// head dim Hv where it differs from H (MLA's 192 / 128): V and dO tiles Hv wide, dP^T over Hv,
// and the warpgroups' columns of dK and dV dealt apart (split_dk_columns, split_dv_columns).
template <int kHeadDim_, bool kBulkDq_ = false, int kBlockM_ = 64, bool kTiledDq_ = false, bool kSplitHeadDim_ = false,
          bool kDeferDq_ = false, bool kStageDq_ = false, int kValueHeadDim_ = kHeadDim_>
struct Sm90BwdWsTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kTileHeadDim = tile_head_dim(kHeadDim);
  static constexpr int kValueHeadDim = kValueHeadDim_;
  static constexpr int kTileValueHeadDim = tile_head_dim(kValueHeadDim);
  static constexpr bool kOwnValueHeadDim = kValueHeadDim != kHeadDim;
  static constexpr bool kSplitHeadDim = kSplitHeadDim_;
  static_assert(!kOwnValueHeadDim || (kSplitHeadDim_ && kHeadDim == 192 && kValueHeadDim == 128 && !kStageDq_),
                "a value head dim of its own: the split kernel of 192 / 128");
  static constexpr bool kStageDq = kStageDq_;
  static_assert(!kStageDq || (kSplitHeadDim_ && kHeadDim == 256), "dQ through the stage: the split head dim 256's");
  static constexpr bool kDeferDq = kDeferDq_;
  static_assert(!kDeferDq || (kTiledDq_ && kBlockM_ == 64), "deferred dQ: the tiled hand-off, 64-row visits");
  static constexpr int kDsBuffers = kDeferDq ? 4 : 2;
  static_assert(!kSplitHeadDim || (kBlockM_ == 64 && !kBulkDq_ && (kHeadDim == 192 || kHeadDim == 256)),
                "split head dim: 64-row visits, dQ by atomics, head dim 192 or 256");
  static constexpr bool kBulkDq = kBulkDq_;
  static constexpr bool kTiledDq = kTiledDq_;
  static constexpr bool kDqTransposed = kBlockM_ == 80;
  static_assert(!kTiledDq || (kBulkDq && kHeadDim_ == 128 && (kBlockM_ == 64 || kBlockM_ == 80)),
                "tiled dQ: bulk reductions, head dim 128, 64- or 80-row visits");
  static constexpr int kBlockM = kBlockM_;  // query rows per visit
  static constexpr bool kDkFromRegisters = kBlockM == 128;
  static_assert(kBlockM == 64 || (kBlockM == 128 && kHeadDim == 64 && !kBulkDq) || (kDqTransposed && kTiledDq),
                "128-row visits at head dim 64 only, with dQ by atomics; 80-row ones with the tiled dQ");
  // Each warpgroup computes dQ for its 64 query rows (128-row visits), else for 64 of the head
  // dim's columns (warpgroup 0 alone at head dim 64).
  static constexpr bool kDqByRows = kBlockM == 128;
  static constexpr int kBlockN = kSplitHeadDim ? 64 : 128;  // keys: 2 consumer warpgroups x 64, or 64 shared
  static constexpr int kConsumers = 2;
  // A warpgroup's S^T and dP^T: 64 keys x kScoreQueries of the block's queries (all, or its half
  // with kSplitHeadDim, from kScoreQueries * group); its dK and dV: 64 keys x the head dim's
  // columns (all, or with kSplitHeadDim those below).
  static constexpr int kScoreQueries = kSplitHeadDim ? kBlockM_ / 2 : kBlockM_;
  // kSplitHeadDim: warpgroup g's columns of dK and of dV (split_dk_columns from split_dk_col0,
  // likewise dV), and its 64-column blocks of dQ (from split_dq_block0(g)). At 192 warpgroup 0
  // takes 128 columns of dK and dV and a block of dQ, warpgroup 1 64 and two (128 + 64 columns
  // of products against 64 + 128). At 192 / 128 (kOwnValueHeadDim) warpgroup 0 takes dV's 128
  // columns, dK's first 64 and a block of dQ, warpgroup 1 dK's other 128 and two blocks of dQ:
  // 256 columns of products each.
  static constexpr int split_dk_columns(int g) {
    return kOwnValueHeadDim ? (g == 0 ? 64 : kHeadDim - 64) : (g == 0 ? 128 : kHeadDim - 128);
  }
  static constexpr int split_dk_col0(int g) { return g == 0 ? 0 : split_dk_columns(0); }
  static constexpr int split_dv_columns(int g) {
    return kOwnValueHeadDim ? (g == 0 ? kValueHeadDim : 0) : split_dk_columns(g);
  }
  static constexpr int split_dv_col0(int g) { return g == 0 ? 0 : split_dv_columns(0); }
  static constexpr int split_dq_blocks(int g) { return g == 0 ? kHeadDim / 128 : kHeadDim / 64 - kHeadDim / 128; }
  static constexpr int split_dq_block0(int g) { return g == 0 ? 0 : split_dq_blocks(0); }
  // Whether the two warpgroups' column counts differ (head dim 192): each then runs its own
  // instantiation of the products that depend on them.
  static constexpr bool kSplitUneven = kSplitHeadDim && (split_dk_columns(0) != split_dk_columns(1) ||
                                                         split_dv_columns(0) != split_dv_columns(1));
  // The n-tiles of a consumer thread's dK and dV accumulators: the head dim's, or with
  // kSplitHeadDim the widest warpgroup's columns.
  static constexpr int max2(int a, int b) { return a > b ? a : b; }
  static constexpr int kDkTiles = (kSplitHeadDim ? max2(split_dk_columns(0), split_dk_columns(1)) : kHeadDim) / 8;
  static constexpr int kDvTiles = (kSplitHeadDim ? max2(split_dv_columns(0), split_dv_columns(1)) : kHeadDim) / 8;
  static constexpr int kStages = 2;
  // The producer issues a stage's TMA before it loads the rows' lse and delta, so that those
  // loads run under the copies: bwd +1-2% at head dims 128 and 256 on the H200, but 2-3% slower
  // at 192's split kernel, which keeps the loads first (session 29, cuda/PERF_NOTES.md v29).
  static constexpr bool kStatsUnderTma = !(kSplitHeadDim && kHeadDim == 192);
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerWarps = 4 * kConsumers;
  // Consumer warps that compute dQ: each warpgroup 64 of the (tile's) head dim's columns.
  static constexpr int kDqWarps = 4 * (kTileHeadDim / 64);
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  // setmaxnreg moves registers within the CTA's launch allocation (__launch_bounds__(kThreads, 1):
  // the register file over kThreads, in multiples of 8 a thread); asking for more hangs.
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * 128 * kConsumers <= 65536 / kThreads / 8 * 8 * kThreads,
                "registers past the launch allocation");
  using KTile = GmmaTile<kBlockN, kTileHeadDim>;
  using QTile = GmmaTile<kBlockM, kTileHeadDim>;
  using VTile = GmmaTile<kBlockN, kTileValueHeadDim>;
  using DoTile = GmmaTile<kBlockM, kTileValueHeadDim>;
  // dS^T: [key][query], or [query][key] (kDqTransposed)
  using DsTile = std::conditional_t<kDqTransposed, GmmaTile<kBlockM, kBlockN>, GmmaTile<kBlockN, kBlockM>>;
  // Row stride (floats) of the dQ tile: 16-byte rows for the bulk copies, 8 banks apart, so
  // that a half-warp's float2 stores (4 rows x 4 column pairs) meet 32 distinct banks (4 apart
  // made rows r and r + 1 share 4 banks: the hd128 profile counted 34M conflicts on 87M
  // store wavefronts).
  static constexpr int kDqRowStride = kTiledDq ? kHeadDim : kTileHeadDim + 8;
  // Floats of one warpgroup's part of the tiled dQ tile (kTiledDq): 64 rows x its 64 columns, or
  // (kDqTransposed) its 64 head-dim rows of dQ^T x the block's queries.
  static constexpr int kDqPartFloats = kBlockM * kHeadDim / 2;
  // K, V; kStages of Q and of dO; kDsBuffers dS^T (and two P^T with kSplitHeadDim); kStages of the
  // block's lse (log2 units) and delta; the dQ tile (kBulkDq); the barriers; 1 KiB to align the base.
  static constexpr int kBarrierBytes = kDeferDq ? 256 : 128;  // (with ds_full: 200 bytes)
  static constexpr int kScoreTiles = kSplitHeadDim ? 4 : kDsBuffers;
  // Where the barriers start (or, with a staged bias, its tiles), from the 1 KiB-aligned base.
  static constexpr int kBarrierOffsetBytes =
      2 * (KTile::kElements + VTile::kElements + kStages * (QTile::kElements + DoTile::kElements) +
           kScoreTiles * DsTile::kElements) +
      2 * kStages * kBlockM * 4 + (kBulkDq ? kBlockM * kDqRowStride * 4 : 0);
  static constexpr int kSmemBytes = kBarrierOffsetBytes + kBarrierBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  // With kStages tiles of a 16-bit bias (the visit's queries x the block's keys: BiasTile as the
  // producer warp copies it, swizzled; BiasTmaTile as TMA writes it), in the barriers' place on a
  // 1 KiB boundary (the TMA swizzle's), the barriers after them (flash_bwd_ws_kernel.cuh
  // Sm90BwdWsSmem, BwdTmaParams::bias_staged), where they fit.
  using BiasTile = SmemTile<kBlockM == 80 ? 64 : kBlockM, kBlockN>;
  using BiasTmaTile = GmmaTile<BiasTile::kRows, kBlockN>;
  static constexpr int kSmemBytesBiasStages = kSmemBytes + kStages * 2 * BiasTile::kElements;
  static constexpr bool kBiasStagesFit =
      kBlockM != 80 && kBarrierOffsetBytes % 1024 == 0 && kSmemBytesBiasStages <= 227 * 1024;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kSplitHeadDim,
                "wgmma shapes are instantiated for N = 64, 96, 128");
};

}  // namespace jax_flash::cuda
