// The steps of the Hopper backward's visit of one query block by a key block
// (sm90/flash_bwd_ws_kernel.cuh), computed transposed so that each warpgroup's rows are its 64
// keys (FlashAttention-3's layout).
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "gpu/block_geometry.cuh"
#include "gpu/dq_accum_layout.cuh"
#include "gpu/fragments.cuh"
#include "gpu/ptx.cuh"
#include "gpu/smem_tile.cuh"
#include "gpu/tile_io.cuh"
#include "sm90/wgmma.cuh"

namespace jax_flash::cuda {

// S^T = K Q^T and dP^T = V dO^T for a warpgroup's 64 keys (from key_row0 of the K and V tiles)
// and Traits::kScoreQueries queries (from query_row0 of the Q and dO stages) (SS wgmma; dP^T over
// the value head dim): issued and committed as two groups, S^T's first (so wgmma_wait<1> waits
// for S^T only), not waited for.
template <typename Traits, typename T>
__device__ __forceinline__ void issue_transposed_scores(float (&st)[1][Traits::kScoreQueries / 8][4],
                                                  float (&dpt)[1][Traits::kScoreQueries / 8][4], uint32_t k_address,
                                                  uint32_t v_address, uint32_t q_address, uint32_t do_address,
                                                  int key_row0, int query_row0) {
  using KTile = typename Traits::KTile;
  using QTile = typename Traits::QTile;
  using VTile = typename Traits::VTile;
  using DoTile = typename Traits::DoTile;
  const uint64_t k_desc = made_here(KTile::k_major(k_address, key_row0, 0));  // (K and V: every visit)
  const uint64_t q_desc = QTile::k_major(q_address, query_row0, 0);
  const uint64_t v_desc = made_here(VTile::k_major(v_address, key_row0, 0));
  const uint64_t do_desc = DoTile::k_major(do_address, query_row0, 0);
  fence_registers(st[0]);
  fence_registers(dpt[0]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk)
    Wgmma<T, Traits::kScoreQueries>::ss(st[0], KTile::k_major_from(k_desc, 0, kk), QTile::k_major_from(q_desc, 0, kk),
                                        kk > 0);
  wgmma_commit();
#pragma unroll
  for (int kk = 0; kk < Traits::kValueHeadDim / 16; ++kk)
    Wgmma<T, Traits::kScoreQueries>::ss(dpt[0], VTile::k_major_from(v_desc, 0, kk),
                                        DoTile::k_major_from(do_desc, 0, kk), kk > 0);
  wgmma_commit();
}

// st <- P^T = exp2(S^T scale log2e - lse log2e), with the block's rows' lse (log2 units; column c
// of a thread's fragments is query 8 nt + 2 (lane % 4) + c % 2). The argument is <= 0 in exact
// arithmetic; it is clamped there (NaN kept) because at logits near 1e19 rounding puts it far
// above 0 (gpu/softmax.cuh).
template <int kBlockM>
__device__ __forceinline__ void transposed_probabilities(float (&st)[1][kBlockM / 8][4], const float* lse2,
                                                         float scale_log2, int lane) {
#pragma unroll
  for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int query = nt * 8 + (lane % 4) * 2 + e % 2;
      st[0][nt][e] = fast_exp2(min_keeping_nan(st[0][nt][e] * scale_log2 - lse2[query], 0.f));
    }
}

// dpt <- dS^T / scale = P^T (dP^T - delta), with pt = P^T (transposed_probabilities) and the
// block's rows' delta. The softmax scale, a factor of every dS, is left out (one multiply a score
// fewer, ~5% of a visit's instructions): dK takes it once before its store, dQ in its convert
// kernel (gpu/bwd_postprocess.cuh).
template <int kBlockM>
__device__ __forceinline__ void transposed_score_gradients(float (&dpt)[1][kBlockM / 8][4],
                                                           const float (&pt)[1][kBlockM / 8][4], const float* delta,
                                                           int lane) {
#pragma unroll
  for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int query = nt * 8 + (lane % 4) * 2 + e % 2;
      dpt[0][nt][e] = pt[0][nt][e] * (dpt[0][nt][e] - delta[query]);
    }
}

// A warp's A fragments (16 rows from row0 a row tile, 16 columns from col0 a k tile, as
// accumulator_to_a packs them) into the 16-bit SmemTile `tile`: one stmatrix a 16 x 16 fragment
// where st.shared.b32 takes eight. Lane l addresses row l % 8 of matrix l / 8, which is the
// fragment's rows + 8 (l / 8 % 2) and chunk + (l / 16).
template <typename Tile, int kKTiles, int kMTiles, typename T>
__device__ __forceinline__ void stmatrix_a_fragments(T* tile, const uint32_t (&a)[kKTiles][kMTiles][4], int row0,
                                                     int col0, int lane) {
  static_assert(kPowerOfTwo<2 * kKTiles>, "k tiles' chunks XOR-ed onto the lane's");
  const SmemOperand<Tile, true> op(tile, row0 + lane % 8 + (lane / 8 % 2) * 8, col0 / 8 + lane / 16);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int kt = 0; kt < kKTiles; ++kt) stmatrix_x4(op.at(mt * 16, 2 * kt), a[kt][mt]);
}

// A warp's dS^T rows (keys warp_key0 ..; the warpgroup's Traits::kScoreQueries query columns
// from query0) to the DsTile at `ds`: each 64-column block as SmemTile<kBlockN, 64> lays it out,
// which is GmmaTile's block layout. (With kSplitHeadDim also P^T, to its own tile.)
template <typename Traits, typename T>
__device__ __forceinline__ void store_transposed_ds(T* ds, const float (&dst)[1][Traits::kScoreQueries / 8][4],
                                                    int warp_key0, int lane, int query0 = 0) {
  using Block = SmemTile<Traits::kBlockN, 64>;
  constexpr int kColumns = Traits::kScoreQueries < 64 ? Traits::kScoreQueries : 64;  // a store's
#pragma unroll
  for (int b = 0; b < Traits::kScoreQueries / kColumns; ++b) {
    uint32_t a[kColumns / 16][1][4];
    accumulator_to_a<T>(a, *reinterpret_cast<const float(*)[1][kColumns / 8][4]>(&dst[0][kColumns / 8 * b]));
    stmatrix_a_fragments<Block>(ds + b * Block::kElements, a, warp_key0, query0, lane);
  }
}

// A warp's rows of a zero dS^T (a warpgroup whose keys the block's queries do not see), stored
// from constants (store_transposed_ds's layout).
template <typename Traits, typename T>
__device__ __forceinline__ void store_zero_ds(T* ds, int warp_key0, int lane) {
  const float zeros[1][Traits::kScoreQueries / 8][4] = {};
  store_transposed_ds<Traits>(ds, zeros, warp_key0, lane);
}

// store_transposed_ds from dS^T packed as A fragments (Traits::kDkFromRegisters).
template <typename Traits, typename T>
__device__ __forceinline__ void store_transposed_ds_fragments(T* ds, const uint32_t (&dst)[Traits::kBlockM / 16][1][4],
                                                              int warp_key0, int lane) {
  using Block = SmemTile<Traits::kBlockN, 64>;
  using BlockFragments = const uint32_t[4][1][4];
#pragma unroll
  for (int b = 0; b < Traits::kBlockM / 64; ++b)
    stmatrix_a_fragments<Block>(ds + b * Block::kElements, *reinterpret_cast<BlockFragments*>(&dst[4 * b]), warp_key0,
                                0, lane);
}

// dV += P^T dO and dK += dS^T Q with both A operands from registers (Traits::kDkFromRegisters):
// issued and committed, not waited for (the caller's next wait covers them).
template <typename Traits, typename T>
__device__ __forceinline__ void issue_key_gradients(float (&dk)[1][Traits::kHeadDim / 8][4],
                                                    float (&dv)[1][Traits::kHeadDim / 8][4],
                                                    uint32_t (&pt)[Traits::kBlockM / 16][1][4],
                                                    uint32_t (&dst)[Traits::kBlockM / 16][1][4], uint32_t q_address,
                                                    uint32_t do_address) {
  constexpr int kBM = Traits::kBlockM, kD = Traits::kHeadDim;
  using QTile = typename Traits::QTile;
  const uint64_t do_desc = QTile::n_major(do_address, 0);
  const uint64_t q_desc = QTile::n_major(q_address, 0);
  fence_registers(dv[0]);
  fence_registers(dk[0]);
#pragma unroll
  for (int kk = 0; kk < kBM / 16; ++kk) {
    fence_registers(pt[kk]);
    fence_registers(dst[kk]);
  }
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBM / 16; ++kk)
    Wgmma<T, kD>::rs_b_transposed(dv[0], pt[kk][0], QTile::n_major_from(do_desc, kk), true);
#pragma unroll
  for (int kk = 0; kk < kBM / 16; ++kk)
    Wgmma<T, kD>::rs_b_transposed(dk[0], dst[kk][0], QTile::n_major_from(q_desc, kk), true);
  wgmma_commit();
}

// dQ = dS K for warpgroup `group`'s part: its 64 query rows with every head-dim column
// (Traits::kDqByRows), else the head-dim columns 64 g .. 64 g + 63 of every row (all of them for
// head dim 64 in warpgroup 0; with kSplitHeadDim g is the 64-column block, two a warpgroup: a
// warpgroup's whole half of dQ beside dK and dV held more registers than there are, and ptxas
// serialised the products, C7512); issued and committed, not waited for.
template <typename Traits, typename T>
__device__ __forceinline__ void issue_query_gradient(float (&dq)[1][8][4], uint32_t ds_address, uint32_t k_address,
                                                     int group) {
  using KTile = typename Traits::KTile;
  using DsTile = typename Traits::DsTile;
  const uint32_t ds_part = (Traits::kDqByRows ? group : 0) * DsTile::kBlockBytes;
  const uint32_t k_part = (Traits::kDqByRows ? 0 : group) * KTile::kBlockBytes;
  const uint64_t ds_desc = DsTile::n_major(ds_address + ds_part, 0);
  const uint64_t k_desc = made_here(KTile::n_major(k_address + k_part, 0));
  fence_registers(dq[0]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk)
    Wgmma<T, 64>::ss_transposed(dq[0], DsTile::n_major_from(ds_desc, kk), KTile::n_major_from(k_desc, kk), kk > 0);
  wgmma_commit();
}

// 64-row visits, after the consumers' barrier: dV += P^T dO (P^T from registers) and
// dK += dS^T Q (dS^T from shared memory, which keeps registers free for dQ) for the warpgroup's
// keys if the block sees them (group_live), and its part of dQ where dq_here
// (issue_query_gradient); issued and waited for.
template <typename Traits, typename T>
__device__ __forceinline__ void accumulate_gradients(float (&dk)[1][Traits::kHeadDim / 8][4],
                                                     float (&dv)[1][Traits::kHeadDim / 8][4], float (&dq)[1][8][4],
                                                     const float (&pt_float)[1][Traits::kBlockM / 8][4],
                                                     uint32_t q_address, uint32_t do_address, uint32_t ds_address,
                                                     uint32_t k_address, int group, bool group_live, bool dq_here) {
  static_assert(!Traits::kDkFromRegisters, "128-row visits take dK from registers");
  constexpr int kBM = Traits::kBlockM, kD = Traits::kHeadDim;
  using QTile = typename Traits::QTile;
  using DsTile = typename Traits::DsTile;
  fence_registers(dv[0]);
  fence_registers(dk[0]);
  fence_registers(dq[0]);
  if (group_live) {
    uint32_t pt[kBM / 16][1][4];
    accumulator_to_a<T>(pt, pt_float);
    const uint64_t do_desc = QTile::n_major(do_address, 0);
    const uint64_t q_desc = QTile::n_major(q_address, 0);
    const uint64_t ds_desc = DsTile::k_major(ds_address, group * 64, 0);
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk) fence_registers(pt[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk)
      Wgmma<T, kD>::rs_b_transposed(dv[0], pt[kk][0], QTile::n_major_from(do_desc, kk), true);
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk)
      Wgmma<T, kD>::ss_b_transposed(dk[0], DsTile::k_major_from(ds_desc, 0, kk), QTile::n_major_from(q_desc, kk),
                                    true);
    wgmma_commit();
    // At head dim 128 the registers do not hold dK, dV and dQ in flight at once (ptxas
    // serialises the products, C7512).
    if constexpr (kD > 64) wgmma_wait<0>();
  }
  if (dq_here) issue_query_gradient<Traits, T>(dq, ds_address, k_address, group);
  wgmma_wait<0>();
  fence_registers(dv[0]);
  fence_registers(dk[0]);
  fence_registers(dq[0]);
}

// ---- Split head dim (Traits::kSplitHeadDim): the P^T and dS^T tiles are [key][query], every
// key of the block and every query of the visit; a warpgroup owns head-dim columns of dK and dV
// (Traits::split_dk_columns, split_dv_columns) and 64-column blocks of dQ (split_dq_blocks).

// The first kTiles n-tiles of an accumulator, as an accumulator of their own: a warpgroup's
// columns of the split kernels' dK and dV, whose arrays hold the widest warpgroup's.
template <int kTiles, int kAllTiles>
__device__ __forceinline__ auto leading_tiles(float (&x)[1][kAllTiles][4]) -> float (&)[1][kTiles][4] {
  static_assert(kTiles <= kAllTiles, "a part of the accumulator");
  return *reinterpret_cast<float(*)[1][kTiles][4]>(&x);
}
template <int kTiles, int kAllTiles>
__device__ __forceinline__ auto leading_tiles(const float (&x)[1][kAllTiles][4]) -> const float (&)[1][kTiles][4] {
  static_assert(kTiles <= kAllTiles, "a part of the accumulator");
  return *reinterpret_cast<const float(*)[1][kTiles][4]>(&x);
}

// dV += P^T dO for kNv head-dim columns from 64-column block dv_block0 and dK += dS^T Q for kNk
// from dk_block0 (the first kNv / 8 and kNk / 8 n-tiles of dv and dk; none of dV where kNv is 0),
// every operand from shared memory: issued and committed, not waited for.
template <typename Traits, int kNk, int kNv, typename T, int kDkTiles, int kDvTiles>
__device__ __forceinline__ void issue_split_key_gradients(float (&dk_all)[1][kDkTiles][4], float (&dv_all)[1][kDvTiles][4],
                                                          uint32_t pt_address, uint32_t ds_address, uint32_t q_address,
                                                          uint32_t do_address, int dk_block0, int dv_block0) {
  static_assert(Traits::kSplitHeadDim, "the split head dim's products");
  static_assert(kNk % 64 == 0 && kNv % 64 == 0 && kNk > 0, "whole 64-column blocks");
  using QTile = typename Traits::QTile;
  using DoTile = typename Traits::DoTile;
  using DsTile = typename Traits::DsTile;
  auto& dk = leading_tiles<kNk / 8>(dk_all);
  const uint64_t pt_desc = DsTile::k_major(pt_address, 0, 0);
  const uint64_t ds_desc = DsTile::k_major(ds_address, 0, 0);
  const uint64_t do_desc = DoTile::n_major(do_address + dv_block0 * DoTile::kBlockBytes, 0);
  const uint64_t q_desc = QTile::n_major(q_address + dk_block0 * QTile::kBlockBytes, 0);
  if constexpr (kNv > 0) fence_registers(leading_tiles<kNv / 8>(dv_all)[0]);
  fence_registers(dk[0]);
  wgmma_fence();
  if constexpr (kNv > 0) {
    auto& dv = leading_tiles<kNv / 8>(dv_all);
#pragma unroll
    for (int kk = 0; kk < Traits::kBlockM / 16; ++kk)
      Wgmma<T, kNv>::ss_b_transposed(dv[0], DsTile::k_major_from(pt_desc, 0, kk), DoTile::n_major_from(do_desc, kk),
                                     true);
  }
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk)
    Wgmma<T, kNk>::ss_b_transposed(dk[0], DsTile::k_major_from(ds_desc, 0, kk), QTile::n_major_from(q_desc, kk), true);
  wgmma_commit();
}

// ---- 80-row visits (Traits::kDqTransposed): the dS^T buffers are query-major, [query][key].

// A warp's dS^T (its 16 keys from warp_key0 x the block's queries; A fragments, as
// accumulator_to_a packs them) into the query-major DsTile at shared address `ds_address`:
// stmatrix .trans turns each 8 keys x 8 queries matrix into 8 query rows of one 16-byte chunk
// (k-step kk's four: keys +0 / +8 of queries 16 kk.. and 16 kk + 8..). The 8 rows a matrix
// writes share a chunk, which the swizzle spreads over 8 bank groups.
template <typename Traits>
__device__ __forceinline__ void store_query_major_ds(uint32_t ds_address,
                                                     const uint32_t (&dst)[Traits::kBlockM / 16][1][4],
                                                     int warp_key0, int lane) {
  using DsTile = typename Traits::DsTile;
  static_assert(Traits::kDqTransposed, "query-major dS^T");
  const int matrix = lane / 8, row = lane % 8;
  const int chunk = warp_key0 / 8 + matrix % 2;
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk) {
    const int query = 16 * kk + 8 * (matrix / 2) + row;
    stmatrix_x4_trans(ds_address + 2 * DsTile::offset(query, chunk), dst[kk][0]);
  }
}

// A warp's part of a zero dS^T (store_query_major_ds's layout; a warpgroup whose keys the block's
// queries do not see).
template <typename Traits>
__device__ __forceinline__ void store_zero_query_major_ds(uint32_t ds_address, int warp_key0, int lane) {
  const uint32_t zeros[Traits::kBlockM / 16][1][4] = {};
  store_query_major_ds<Traits>(ds_address, zeros, warp_key0, lane);
}

// dV += P^T dO, P^T from registers: issued and committed, not waited for.
template <typename Traits, typename T>
__device__ __forceinline__ void issue_value_gradient(float (&dv)[1][Traits::kHeadDim / 8][4],
                                                     uint32_t (&pt)[Traits::kBlockM / 16][1][4], uint32_t do_address) {
  using QTile = typename Traits::QTile;
  const uint64_t do_desc = QTile::n_major(do_address, 0);
  fence_registers(dv[0]);
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk) fence_registers(pt[kk]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk)
    Wgmma<T, Traits::kHeadDim>::rs_b_transposed(dv[0], pt[kk][0], QTile::n_major_from(do_desc, kk), true);
  wgmma_commit();
}

// dK += dS^T Q for warpgroup `group`'s keys, dS^T read M-major from the query-major tile (its
// keys are the tile's 64-column block `group`): issued and committed, not waited for.
template <typename Traits, typename T>
__device__ __forceinline__ void issue_key_gradient_from_query_major(float (&dk)[1][Traits::kHeadDim / 8][4],
                                                                    uint32_t ds_address, uint32_t q_address,
                                                                    int group) {
  using QTile = typename Traits::QTile;
  using DsTile = typename Traits::DsTile;
  const uint64_t ds_desc = DsTile::n_major(ds_address + group * DsTile::kBlockBytes, 0);
  const uint64_t q_desc = QTile::n_major(q_address, 0);
  fence_registers(dk[0]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockM / 16; ++kk)
    Wgmma<T, Traits::kHeadDim>::ss_transposed(dk[0], DsTile::n_major_from(ds_desc, kk), QTile::n_major_from(q_desc, kk),
                                              true);
  wgmma_commit();
}

// dQ^T = K^T dS^T for warpgroup `group`'s head-dim rows 64 g .. 64 g + 63 and every query of the
// block: A = K^T M-major (K's 64-column block g), B = dS^T K-major (the query-major tile's rows
// are B's N); issued and committed, not waited for. Fragment (j, e) of a thread is head-dim row
// 64 g + 16 (warp % 4) + lane / 4 (+ 8 for e >= 2), query 8 j + 2 (lane % 4) + e % 2.
template <typename Traits, typename T>
__device__ __forceinline__ void issue_transposed_query_gradient(float (&dqt)[1][Traits::kBlockM / 8][4],
                                                                uint32_t ds_address, uint32_t k_address, int group) {
  using KTile = typename Traits::KTile;
  using DsTile = typename Traits::DsTile;
  const uint64_t k_desc = made_here(KTile::n_major(k_address + group * KTile::kBlockBytes, 0));
  const uint64_t ds_desc = DsTile::k_major(ds_address, 0, 0);
  fence_registers(dqt[0]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk)
    Wgmma<T, Traits::kBlockM>::ss_a_transposed(dqt[0], KTile::n_major_from(k_desc, kk),
                                               DsTile::k_major_from(ds_desc, 0, kk), kk > 0);
  wgmma_commit();
}

// A consumer thread's accumulator fragments (kTiles n-tiles of 8 columns) stored in the fragments'
// order, `at` being the thread's float4 (its index t in the warpgroup past the part's start): n-tile
// j at float4 j * 128 + t, conflict-free 16-byte stores (the tiled dQ hand-offs' layout, read back
// by gpu/bwd_postprocess.cuh flash_bwd_convert_tiled_dq_kernel).
template <int kTiles>
__device__ __forceinline__ void store_in_fragment_order(float4* at, const float (&frag)[1][kTiles][4]) {
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) at[nt * 128] = make_float4(frag[0][nt][0], frag[0][nt][1], frag[0][nt][2], frag[0][nt][3]);
}

// Adds a warp's part of dQ (rows 16 (warp % 4) .. of warpgroup `group`'s 64 query rows with
// kDqByRows, else of the query block; kNTiles x 8 columns from col0) of the query block from m0
// of head h to the float32 accumulator, 16-byte atomics where it is in the quad order
// (gpu/dq_accum_layout.cuh), else 8-byte ones.
template <bool kDqByRows, int kBlockM, int kBlockN, bool kSplitsHeads, int kNTiles>
__device__ __forceinline__ void add_dq(const BwdParams& p, const KeyBlockTask<kBlockM, kBlockN, kSplitsHeads>& task,
                                       const float (&dq)[1][kNTiles][4], int64_t m0, int h, int group, int col0,
                                       int warp, int lane) {
  const AttentionShape& sh = p.shape;
  const int lane_row = (kDqByRows ? group * 64 : 0) + warp % 4 * 16 + lane / 4;
  const int lane_col = col0 + (lane % 4) * 2;
  float* dq_block = p.dq_accum + (task.b * sh.seq_q + m0 + lane_row) * task.q_stride + h * sh.head_dim + lane_col;
  const int live_rows = static_cast<int>(min64(kBlockM, task.q_len - m0)) - lane_row;
  const int live_cols = static_cast<int>(sh.head_dim) - lane_col;
  if (dq_accum_in_quads(p.dq_accum, sh.head_dim)) {
    float* quads = dq_block + (lane % 4) * 2;  // 16 j + 4 (lane % 4)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      if (half * 8 < live_rows) add_fragment_half<true>(quads + half * 8 * task.q_stride, dq[0], half, 0, live_cols);
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half)
    if (half * 8 < live_rows) add_fragment_half<false>(dq_block + half * 8 * task.q_stride, dq[0], half, 0, live_cols);
}

// A head split's dK and dV (p.kv_head_splits > 1; keys warp_key0 .., head-dim columns col0 ..)
// added to the float32 accumulators p.dkv_accum ((2, batch, seq_k, heads_k, head_dim)).
template <typename Traits, typename Task>
__device__ __forceinline__ void add_dk_dv(const BwdParams& p, const Task& task,
                                          const float (&dk)[1][Traits::kDkTiles][4],
                                          const float (&dv)[1][Traits::kDvTiles][4], int warp_key0, int col0,
                                          int lane) {
  static_assert(!Traits::kOwnValueHeadDim && Traits::kDkTiles == Traits::kDvTiles, "dK's columns are dV's");
  const AttentionShape& sh = p.shape;
  const int64_t dv_offset = sh.batch * sh.seq_k * sh.heads_k * sh.head_dim;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = warp_key0 + lane / 4 + 8 * half;
    if (key >= task.keys) continue;
    float* row = p.dkv_accum + ((task.b * sh.seq_k + task.n0 + key) * sh.heads_k + task.hk) * sh.head_dim;
#pragma unroll
    for (int nt = 0; nt < Traits::kDkTiles; ++nt) {
      const int col = col0 + nt * 8 + (lane % 4) * 2;
      if (col >= sh.head_dim) continue;
      atomic_add_pair(row + col, dk[0][nt][2 * half], dk[0][nt][2 * half + 1]);
      atomic_add_pair(row + dv_offset + col, dv[0][nt][2 * half], dv[0][nt][2 * half + 1]);
    }
  }
}

// dK and dV rows of the key block (zeros where no query sees the key), through shared memory
// where K and V were, so that the stores are whole rows: kThreads threads (this one `tid`),
// `sync` a barrier of all of them (K and V are no longer read once every warp is there). A
// thread's fragments are keys warp_key0 .., head-dim columns dk_col0 .. of dK (the first kNk / 8
// n-tiles of dk) and dv_col0 .. of dV (kNv / 8 of dv; none where kNv is 0); V's and dV's rows are
// `values`' (key_block_value_rows).
template <typename Traits, int kThreads, int kNk, int kNv, typename T, typename Task, typename Sync, int kDkTiles,
          int kDvTiles>
__device__ __forceinline__ void store_dk_dv(const BwdParams& p, const Task& task, const float (&dk)[1][kDkTiles][4],
                                            const float (&dv)[1][kDvTiles][4], T* s_k, T* s_v,
                                            const ValueRows& values, int warp_key0, int dk_col0, int dv_col0,
                                            int lane, int tid, Sync sync) {
  using KOutTile = SmemTile<Traits::kBlockN, Traits::kTileHeadDim>;
  using VOutTile = SmemTile<Traits::kBlockN, Traits::kTileValueHeadDim>;
  static_assert(KOutTile::kElements == Traits::KTile::kElements && VOutTile::kElements == Traits::VTile::kElements,
                "dK and dV staged where K and V were");
  // The stores address a thread's columns by XOR moves from the first (gpu/smem_tile.cuh
  // SmemOperand), which holds where they start at a multiple of their width: so do dV's and,
  // but for the pair's warpgroup 1 (64 + 128 columns), dK's; that one's go in 64-column pieces.
  constexpr int kDkPiece = Traits::kOwnValueHeadDim ? 64 : kNk;
  sync();
#pragma unroll
  for (int piece = 0; piece < kNk / kDkPiece; ++piece)
    store_accumulator<KOutTile>(s_k, *reinterpret_cast<const float(*)[1][kDkPiece / 8][4]>(&dk[0][piece * kDkPiece / 8]),
                                warp_key0, dk_col0 + piece * kDkPiece, lane);
  if constexpr (kNv > 0) store_accumulator<VOutTile>(s_v, leading_tiles<kNv / 8>(dv), warp_key0, dv_col0, lane);
  sync();
  store_tile<KOutTile, kThreads>(static_cast<T*>(p.dk) + task.kv_offset, task.kv_stride, s_k, task.keys, task.chunks,
                                 tid);
  store_tile<VOutTile, kThreads>(static_cast<T*>(p.dv) + values.v_offset, values.v_stride, s_v, task.keys,
                                 values.chunks, tid);
}

}  // namespace jax_flash::cuda
