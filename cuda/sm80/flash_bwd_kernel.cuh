// FlashAttention-2 backward for sm_80 and newer, by recomputation: the main kernel and the
// deterministic dQ kernel, after the float32 dQ accumulator is zeroed and before
// gpu/bwd_postprocess.cuh converts it (delta = rowsum(dO * O) comes formed by XLA).
//   flash_bwd_kernel: one CTA per (key block, batch, kv head); K and V stay in shared memory
//     while the query blocks of every query head of the group that see the keys stream past
//     (Q and dO double-buffered). Per query block: S = Q K^T and dP = dO V^T in registers,
//     P = exp2(S log2e scale - lse log2e), dS = scale P (dP - delta); P and dS go through shared
//     memory to feed dV += P^T dO, dK += dS^T Q (accumulated in registers over the whole loop:
//     the GQA reduction happens here) and dQ += dS K (added to the fp32 accumulator atomically).
// Deterministic mode replaces the atomics and the convert pass by flash_bwd_dq_kernel: one CTA
// per query block, recomputing S, dP and dS for every key block its rows see and accumulating
// dQ in registers (three more products, no atomics, the same result run after run).
#pragma once

#include "common/attention_params.h"
#include "gpu/block_geometry.cuh"
#include "gpu/dq_accum_layout.cuh"
#include "gpu/dropout_fragments.h"
#include "gpu/fragments.cuh"
#include "gpu/mask.cuh"
#include "gpu/ptx.cuh"
#include "gpu/score_mods.cuh"
#include "gpu/segment_ids.cuh"
#include "gpu/softmax.cuh"
#include "gpu/tile_io.cuh"
#include "sm80/traits.cuh"
#include "sm80/warp_gemm.cuh"

namespace jax_flash::cuda {

// The statistics of this thread's rows, the warp's rows starting at m0: the log2-scaled lse, delta,
// and dS's factor. Rows that attend to nothing (past q_len, or lse = kEmptyRowLse) get lse +inf:
// every P of theirs is exp2(-inf) = 0, masked or not. dS's factor is the softmax scale, or, with
// p.zero_single_key_ds, 0 on rows whose masks leave exactly one key: their P is 1 and dS exactly
// 0 (as jax.nn gives), where dP - delta would leave float32 round-off (dP and delta summed in
// different orders; issue 13's [12], a single-key call 1.21x past the accuracy rule's floor). A
// product, not a choice: NaN and inf there still give NaN.
template <int kMTiles>
__device__ __forceinline__ void load_row_statistics(float (&lse2)[kMTiles][2], float (&row_delta)[kMTiles][2],
                                                    float (&ds_scale)[kMTiles][2], const float* lse,
                                                    const float* delta, const BwdParams& p, int64_t m0,
                                                    int64_t q_len, int64_t kv_len, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = m0 + mt * 16 + half * 8 + lane / 4;
      const float row_lse = row < q_len ? lse[row] : kEmptyRowLse;
      lse2[mt][half] = row_lse == kEmptyRowLse ? INFINITY : row_lse * kLog2e;
      row_delta[mt][half] = row < q_len ? delta[row] : 0.f;
      const KeyRange keys = key_range(p.mask, row, q_len, kv_len);
      ds_scale[mt][half] = p.zero_single_key_ds && keys.end - keys.begin == 1 ? 0.f : p.scale;
    }
}

// The P and dS of one tile of scores (fragments s, dp for this thread's rows; masked scores are
// -inf): P = exp2(S scale log2e - lse log2e), dS = ds_scale P (dP - delta).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void probabilities_and_ds(float (&s)[kMTiles][kNTiles][4], float (&dp)[kMTiles][kNTiles][4],
                                                     const float (&lse2)[kMTiles][2], const float (&delta)[kMTiles][2],
                                                     const float (&ds_scale)[kMTiles][2], float scale_log2) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // <= 0 in exact arithmetic; clamped there (NaN kept) against rounding at huge logits.
        const float prob = fast_exp2(min_keeping_nan(s[mt][nt][e] * scale_log2 - lse2[mt][e / 2], 0.f));
        s[mt][nt][e] = prob;
        dp[mt][nt][e] = ds_scale[mt][e / 2] * prob * (dp[mt][nt][e] - delta[mt][e / 2]);
      }
}

// kGeneral (both kernels): the call has a soft cap or ALiBi slopes (gpu/score_mods.cuh): S is
// modified before its masks and dP takes the cap's chain rule; or segment ids
// (gpu/segment_ids.cuh): the walk narrowed to the blocks whose ids can meet, the id mask where a
// tile's rows and keys do not all share one id.
// kDropout (general kernels; the launchers' choice for calls with dropout seeds, both kernels):
// fused dropout (gpu/dropout_fragments.h): dP times Z = keep / (1 - rate) before the cap's chain
// rule and dS = P (Z dP - delta), then P times Z for dV.
template <typename Traits, typename T, bool kGeneral, bool kDropout = false>
__global__ void __launch_bounds__(Traits::kThreads)
    flash_bwd_kernel(const __grid_constant__ BwdParams p) {
  static_assert(!kDropout || kGeneral, "dropout: a general kernel");
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads, kDqChunk = Traits::kDqChunk;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  using PTile = typename Traits::PTile;
  using Sdp = typename Traits::SdpGrid;
  using Kv = typename Traits::KvGrid;
  using Dq = typename Traits::DqGrid;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_k = reinterpret_cast<T*>(smem_raw);
  T* s_v = s_k + KVTile::kElements;
  T* s_q = s_v + KVTile::kElements;     // two stages
  T* s_do = s_q + 2 * QTile::kElements;  // two stages
  T* s_p = s_do + 2 * QTile::kElements;
  T* s_ds = s_p + PTile::kElements;
  T* s_ds_lo = s_ds + PTile::kElements;  // Traits::kSplitDs only

  const AttentionShape& sh = p.shape;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  KeyBlockTask<kBM, kBN> task(p);
  if constexpr (kGeneral) narrow_key_block(task, SegmentIds(p, task.b), lane);
  task.template walk_visits<kGeneral>(p);  // a block mask's live query blocks only
  using Visit = typename KeyBlockTask<kBM, kBN>::Visit;
  const int b = task.b;
  const int64_t q_len = task.q_len, kv_len = task.kv_len, q_stride = task.q_stride, kv_stride = task.kv_stride;
  const int64_t n0 = task.n0;

  const T* q_base = static_cast<const T*>(p.q) + task.q_batch_offset;
  const T* do_base = static_cast<const T*>(p.d_o) + task.q_batch_offset;
  auto load_q_do = [&](Visit v, int stage) {
    const int h = v.h;
    const int64_t m0 = static_cast<int64_t>(v.mb) * kBM;
    const int rows = task.rows(v);
    load_tile<QTile, kThreads>(s_q + stage * QTile::kElements, q_base + m0 * q_stride + h * sh.head_dim,
                               q_stride, rows, task.chunks, tid);
    load_tile<QTile, kThreads>(s_do + stage * QTile::kElements, do_base + m0 * q_stride + h * sh.head_dim,
                               q_stride, rows, task.chunks, tid);
  };

  float dk[Kv::kMTiles][Kv::kNTiles][4] = {};
  float dv[Kv::kMTiles][Kv::kNTiles][4] = {};
  const int sdp_m0 = Sdp::row0(warp), sdp_n0 = Sdp::col0(warp);
  const float scale_log2 = (kGeneral ? ScoreMods::softmax_scale(p) : p.scale) * kLog2e;

  const int iterations = task.iterations;
  if (iterations > 0) {
    load_tile<KVTile, kThreads>(s_k, static_cast<const T*>(p.k) + task.kv_offset, kv_stride, task.live_keys,
                                task.chunks, tid);
    load_tile<KVTile, kThreads>(s_v, static_cast<const T*>(p.v) + task.kv_offset, kv_stride, task.live_keys,
                                task.chunks, tid);
    load_q_do(task.first_visit(), 0);
    cp_async_commit();
  }
  Visit visit = task.first_visit();
  for (int it = 0, stage = 0; it < iterations; ++it, stage ^= 1, visit = task.next_visit(visit)) {
    // This iteration's Q and dO (the one group in flight) have landed, and every warp is done
    // with the previous iteration's P, dS and stage: prefetch the next Q and dO into that stage.
    cp_async_wait<0>();
    __syncthreads();
    if (it + 1 < iterations) {
      load_q_do(task.next_visit(visit), stage ^ 1);
      cp_async_commit();
    }
    const int h = visit.h;
    const int64_t m0 = static_cast<int64_t>(visit.mb) * kBM;
    const T* tile_q = s_q + stage * QTile::kElements;
    const T* tile_do = s_do + stage * QTile::kElements;

    // S = Q K^T and dP = dO V^T on this warp's part of the kBM x kBN tile.
    float s[Sdp::kMTiles][Sdp::kNTiles][4] = {};
    float dp[Sdp::kMTiles][Sdp::kNTiles][4] = {};
    warp_gemm<QTile, false, KVTile, false, kD / 16>(s, tile_q, sdp_m0, s_k, sdp_n0, lane);
    warp_gemm<QTile, false, KVTile, false, kD / 16>(dp, tile_do, sdp_m0, s_v, sdp_n0, lane);

    // P = exp2(S scale log2e - lse log2e) (0 where masked), dS = scale P (dP - delta).
    const float* lse = p.lse + (static_cast<int64_t>(b) * sh.heads_q + h) * sh.seq_q;
    const float* delta = p.delta + (static_cast<int64_t>(b) * sh.heads_q + h) * sh.seq_q;
    float lse2[Sdp::kMTiles][2], row_delta[Sdp::kMTiles][2], ds_scale[Sdp::kMTiles][2];
    load_row_statistics(lse2, row_delta, ds_scale, lse, delta, p, m0 + sdp_m0, q_len, kv_len, lane);
    const KeyRange first = key_range(p.mask, m0, q_len, kv_len);
    const KeyRange last = key_range(p.mask, min64(m0 + kBM, q_len) - 1, q_len, kv_len);
    bool id_mask = false;
    if constexpr (kGeneral) {
      ScoreMods(p, b, h).apply(s, m0 + sdp_m0, n0 + sdp_n0, lane);
      if (p.q_segment_ids)
        id_mask = needs_id_mask(SegmentIds(p, b), m0, min64(m0 + kBM, sh.seq_q), n0, min64(n0 + kBN, sh.seq_k));
    }
    if (id_mask)
      mask_with_ids(s, SegmentIds(p, b), p.mask, m0 + sdp_m0, n0 + sdp_n0, q_len, kv_len, lane,
                    static_cast<SeenRows<Sdp::kMTiles>*>(nullptr));
    else if (m0 + kBM > q_len || n0 < last.begin || n0 + kBN > first.end)
      mask_scores(s, p.mask, m0 + sdp_m0, n0 + sdp_n0, q_len, kv_len, lane);
    uint64_t keep[Sdp::kMTiles] = {};
    if constexpr (kDropout) {
      const DropoutStream stream = dropout_stream(p, b, h);
#pragma unroll
      for (int mt = 0; mt < Sdp::kMTiles; ++mt) {
        keep[mt] = forward_keep_mask<Sdp::kNTiles>(stream, m0 + sdp_m0 + 16 * mt + lane / 4,
                                                   n0 + sdp_n0 + 2 * (lane % 4));
        apply_keep_mask(dp[mt], keep[mt], p.dropout_scale);
      }
    }
    if constexpr (kGeneral) ScoreMods(p, b, h).fold_chain_rule(dp, s, row_delta, m0 + sdp_m0, n0 + sdp_n0, lane);
    probabilities_and_ds(s, dp, lse2, row_delta, ds_scale, scale_log2);
    if constexpr (kDropout)
#pragma unroll
      for (int mt = 0; mt < Sdp::kMTiles; ++mt) apply_keep_mask(s[mt], keep[mt], p.dropout_scale);
    store_accumulator<PTile>(s_p, s, sdp_m0, sdp_n0, lane);
    store_accumulator<PTile>(s_ds, dp, sdp_m0, sdp_n0, lane);
    if constexpr (Traits::kSplitDs) {
      subtract_rounded<T>(dp);
      store_accumulator<PTile>(s_ds_lo, dp, sdp_m0, sdp_n0, lane);
    }
    __syncthreads();

    // dV += P^T dO and dK += dS^T Q: A = the [query][key] tiles read transposed.
    warp_gemm<PTile, true, QTile, true, kBM / 16>(dv, s_p, Kv::row0(warp), tile_do, Kv::col0(warp), lane);
    warp_gemm<PTile, true, QTile, true, kBM / 16>(dk, s_ds, Kv::row0(warp), tile_q, Kv::col0(warp), lane);
    if constexpr (Traits::kSplitDs)
      warp_gemm<PTile, true, QTile, true, kBM / 16>(dk, s_ds_lo, Kv::row0(warp), tile_q, Kv::col0(warp), lane);

    // dQ += dS K, added to the float32 accumulator (kDqChunk columns at a time); the
    // deterministic mode computes dQ in flash_bwd_dq_kernel instead.
    if (!p.deterministic) {
      // This thread's first dQ element of the block; rows past q_len and padded columns
      // (head dims the kernel rounds up) are skipped.
      const int lane_row = Dq::row0(warp) + lane / 4, lane_col = Dq::col0(warp) + (lane % 4) * 2;
      float* dq_block = p.dq_accum + (b * sh.seq_q + m0 + lane_row) * q_stride + h * sh.head_dim + lane_col;
      const int live_rows = static_cast<int>(min64(kBM, q_len - m0)) - lane_row;
      const int live_cols = static_cast<int>(sh.head_dim) - lane_col;
      // The accumulator's quad order where the launch asks for it (sm_90a build only,
      // gpu/dq_accum_layout.cuh; every warp's columns start on a 16-column group): a thread's
      // pairs of n-tiles 2j and 2j + 1 are four consecutive floats from 16 j + 4 (lane % 4), one
      // 16-byte atomic instead of two of 8 bytes.
      const bool quads = kQuadOrderBuild && p.dq_quads;
      static_assert(Dq::kCols % 16 == 0, "a warp's dQ columns are whole 16-column groups");
#pragma unroll
      for (int c0 = 0; c0 < Dq::kCols; c0 += kDqChunk) {
        float dq[Dq::kMTiles][kDqChunk / 8][4] = {};
        warp_gemm<PTile, false, KVTile, true, kBN / 16>(dq, s_ds, Dq::row0(warp), s_k, Dq::col0(warp) + c0, lane);
        if constexpr (Traits::kSplitDs)
          warp_gemm<PTile, false, KVTile, true, kBN / 16>(dq, s_ds_lo, Dq::row0(warp), s_k, Dq::col0(warp) + c0,
                                                          lane);
#pragma unroll
        for (int mt = 0; mt < Dq::kMTiles; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = mt * 16 + half * 8;
            if (r >= live_rows) continue;
            float* row = dq_block + r * q_stride;
            if (quads)  // 16 j + 4 (lane % 4)
              add_fragment_half<true>(row + (lane % 4) * 2, dq[mt], half, c0, live_cols);
            else
              add_fragment_half<false>(row, dq[mt], half, c0, live_cols);
          }
      }
    }
  }

  // dK and dV rows of this block (zeros where no query sees the key).
  store_rows(static_cast<T*>(p.dk) + task.kv_offset, kv_stride, dk, Kv::row0(warp), Kv::col0(warp), task.keys,
             sh.head_dim, lane);
  store_rows(static_cast<T*>(p.dv) + task.kv_offset, kv_stride, dv, Kv::row0(warp), Kv::col0(warp), task.keys,
             sh.head_dim, lane);
}

// kSplitDs: dS enters dQ as hi + lo, as the main kernel's (its Traits::kSplitDs) does.
template <typename Traits, typename T, bool kGeneral, bool kSplitDs, bool kDropout = false>
__global__ void __launch_bounds__(Traits::kThreads)
    flash_bwd_dq_kernel(const __grid_constant__ BwdParams p) {
  static_assert(!kDropout || kGeneral, "dropout: a general kernel");
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads, kMT = Traits::kMTiles;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);
  T* s_do = s_q + QTile::kElements;
  T* s_k = s_do + QTile::kElements;      // two stages
  T* s_v = s_k + 2 * KVTile::kElements;  // two stages

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  QueryBlockTask<kBM, kBN> task(p);
  if constexpr (kGeneral) {
    narrow_query_block(task.blk, SegmentIds(p, task.b), lane);
    task.walk_keys(p);  // a block mask's live key blocks only
  }
  const QueryBlock<kBM, kBN>& blk = task.blk;
  const int64_t m0 = blk.m0, q_len = task.q_len, kv_len = task.kv_len;
  const int warp_m0 = warp * kMT * 16;

  float lse2[kMT][2], row_delta[kMT][2], ds_scale[kMT][2];
  load_row_statistics(lse2, row_delta, ds_scale, p.lse + task.stat_offset, p.delta + task.stat_offset, p,
                      m0 + warp_m0, q_len, kv_len, lane);
  float dq[kMT][kD / 8][4] = {};
  const float scale_log2 = (kGeneral ? ScoreMods::softmax_scale(p) : p.scale) * kLog2e;
  const DropoutStream drop_stream = kDropout ? dropout_stream(p, task.b, task.h) : DropoutStream();

  const int count = task.keys.count;
  if (count > 0) {
    auto load_kv = [&](int n_block, int stage) {
      task.template load_keys<KVTile, kThreads>(s_k + stage * KVTile::kElements, static_cast<const T*>(p.k),
                                                n_block, tid);
      task.template load_keys<KVTile, kThreads>(s_v + stage * KVTile::kElements, static_cast<const T*>(p.v),
                                                n_block, tid);
    };
    task.template load_queries<QTile, kThreads>(s_q, static_cast<const T*>(p.q), tid);
    task.template load_queries<QTile, kThreads>(s_do, static_cast<const T*>(p.d_o), tid);
    load_kv(task.keys.ascending(0), 0);
    cp_async_commit();

    for (int i = 0, stage = 0; i < count; ++i, stage ^= 1) {
      const int n_block = task.keys.ascending(i);
      // This block's K and V have landed and every warp is done with the other stage.
      cp_async_wait<0>();
      __syncthreads();
      if (i + 1 < count) {
        load_kv(task.keys.ascending(i + 1), stage ^ 1);
        cp_async_commit();
      }
      const T* tile_k = s_k + stage * KVTile::kElements;
      const T* tile_v = s_v + stage * KVTile::kElements;
      float s[kMT][kBN / 8][4] = {};
      float dp[kMT][kBN / 8][4] = {};
      warp_gemm<QTile, false, KVTile, false, kD / 16>(s, s_q, warp_m0, tile_k, 0, lane);
      warp_gemm<QTile, false, KVTile, false, kD / 16>(dp, s_do, warp_m0, tile_v, 0, lane);
      const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
      if constexpr (kGeneral) {
        ScoreMods(p, task.b, task.h).apply(s, m0 + warp_m0, n0, lane);
        mask_forward_block<kBN>(s, p, task.b, m0, m0 + blk.live_rows, blk.needs_mask(n0), m0 + warp_m0, n0, q_len,
                                kv_len, lane, static_cast<SeenRows<kMT>*>(nullptr));
        if constexpr (kDropout)  // Z dP, as the main kernel's
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt)
            apply_keep_mask(dp[mt],
                            forward_keep_mask<kBN / 8>(drop_stream, m0 + warp_m0 + 16 * mt + lane / 4, n0 + 2 * (lane % 4)),
                            p.dropout_scale);
        ScoreMods(p, task.b, task.h).fold_chain_rule(dp, s, row_delta, m0 + warp_m0, n0, lane);
      } else if (blk.needs_mask(n0)) {
        mask_scores(s, p.mask, m0 + warp_m0, n0, q_len, kv_len, lane);
      }
      probabilities_and_ds(s, dp, lse2, row_delta, ds_scale, scale_log2);
      uint32_t ds[kBN / 16][kMT][4];
      accumulator_to_a<T>(ds, dp);
      warp_gemm_a_regs<KVTile, true>(dq, ds, tile_k, 0, lane);
      if constexpr (kSplitDs) {  // dS's low part too, as the main kernel's dK and dQ take it
        subtract_rounded<T>(dp);
        accumulator_to_a<T>(ds, dp);
        warp_gemm_a_regs<KVTile, true>(dq, ds, tile_k, 0, lane);
      }
    }
  }

  store_rows(static_cast<T*>(p.dq) + task.q_offset, task.q_stride, dq, warp_m0, 0, blk.rows, p.shape.head_dim, lane);
}

}  // namespace jax_flash::cuda
