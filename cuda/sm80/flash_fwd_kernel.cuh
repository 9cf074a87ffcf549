// FlashAttention-2 forward for sm_80 and newer (mma.sync m16n8k16, bf16/fp16 in, fp32 out).
//
// CTA = kBlockM query rows of one (batch, query head); each warp owns kMTiles 16-row tiles.
// Key/value tiles stream through shared memory in two stages (cp.async; K and V in separate
// groups so the score product starts while V is still arriving), last tile first so the tiles
// that need masks (causal diagonal, kv length edge) come before the unmasked ones. Scores stay
// in registers: S = Q K^T, online softmax in base 2, P converted in registers into the A operand
// of P V, which accumulates O.
#pragma once

#include <cuda_runtime.h>

#include "common/attention_params.h"
#include "gpu/block_geometry.cuh"
#include "gpu/dropout_fragments.h"
#include "gpu/epilogue.cuh"
#include "gpu/fragments.cuh"
#include "gpu/mask.cuh"
#include "gpu/ptx.cuh"
#include "gpu/score_mods.cuh"
#include "gpu/segment_ids.cuh"
#include "gpu/softmax.cuh"
#include "sm80/traits.cuh"
#include "sm80/warp_gemm.cuh"

namespace jax_flash::cuda {

// kGeneral: the call has a soft cap or ALiBi slopes (gpu/score_mods.cuh), applied to every
// tile's scores before its masks, or segment ids (gpu/segment_ids.cuh).
// kSplitP: P enters P V as hi + lo (two products), so that O's weights are P to about float32
// (the narrow calls': gpu/score_mods.cuh narrow_plain_call).
// kDropout (general kernels; the launcher's choice for calls with dropout seeds): fused dropout
// (gpu/dropout_fragments.h), an instantiation of its own so that the others keep their registers.
template <typename Traits, typename T, bool kGeneral, bool kSplitP = false, bool kDropout = false>
__global__ void __launch_bounds__(Traits::kThreads)
    flash_fwd_kernel(const __grid_constant__ FwdParams p) {
  static_assert(!kDropout || (kGeneral && !kSplitP), "dropout: a general kernel of one P");
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads, kMT = Traits::kMTiles;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);
  T* s_k = s_q + QTile::kElements;       // two stages
  T* s_v = s_k + 2 * KVTile::kElements;  // two stages

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  QueryBlockTask<kBM, kBN> task(p);
  if constexpr (kGeneral) {
    narrow_query_block(task.blk, SegmentIds(p, task.b), lane);
    task.walk_keys(p);  // a block mask's live key blocks only
  }
  const QueryBlock<kBM, kBN>& blk = task.blk;
  SeenRows<kMT> seen(!(kGeneral && tracks_seen_rows(p)) && untracked_seen_rows(task.keys.count));  // rows that met a key
  const int64_t m0 = blk.m0;
  const int warp_m0 = warp * kMT * 16;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  OnlineSoftmax<kMT> softmax(p.pv_headroom_log2);
  float o[kMT][kD / 8][4] = {};
  const float softmax_scale = kGeneral ? ScoreMods::softmax_scale(p) : p.scale;
  const float scale_log2 = softmax_scale * kLog2e;
  // Dropout: each block's dropped probabilities are zeroed in P V's operand once the row sums
  // have them, and O is scaled by 1 / (1 - rate).
  const DropoutStream drop_stream = kDropout ? dropout_stream(p, task.b, task.h) : DropoutStream();

  const int count = task.keys.count;  // key blocks, visited last first
  if (count > 0) {
    auto load_k = [&](int n_block, int stage) {
      task.template load_keys<KVTile, kThreads>(s_k + stage * KVTile::kElements, k, n_block, tid);
    };
    auto load_v = [&](int n_block, int stage) {
      task.template load_keys<KVTile, kThreads>(s_v + stage * KVTile::kElements, v, n_block, tid);
    };
    // Groups in flight, oldest first: (Q, K of the first block visited), its V, then per
    // iteration K, V of the next block.
    task.template load_queries<QTile, kThreads>(s_q, static_cast<const T*>(p.q), tid);
    load_k(task.keys.descending(0), 0);
    cp_async_commit();
    load_v(task.keys.descending(0), 0);
    cp_async_commit();

    for (int i = 0, stage = 0; i < count; ++i, stage ^= 1) {
      const int n_block = task.keys.descending(i);
      const bool prefetch = i + 1 < count;
      const int next_block = prefetch ? task.keys.descending(i + 1) : n_block;
      if (prefetch) {
        load_k(next_block, stage ^ 1);
        cp_async_commit();
        cp_async_wait<2>();  // this stage's K has landed
      } else {
        cp_async_wait<1>();
      }
      __syncthreads();

      float s[kMT][kBN / 8][4] = {};
      warp_gemm<QTile, false, KVTile, false, kD / 16>(s, s_q, warp_m0, s_k + stage * KVTile::kElements, 0,
                                                      lane);
      const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
      if constexpr (kGeneral) {
        ScoreMods(p, task.b, task.h).apply(s, m0 + warp_m0, n0, lane);
        mask_forward_block<kBN>(s, p, task.b, m0, m0 + blk.live_rows, blk.needs_mask(n0), m0 + warp_m0, n0,
                                task.q_len, task.kv_len, lane, &seen);
      } else if (blk.live_rows_need_mask(n0)) {
        mask_scores(s, p.mask, m0 + warp_m0, n0, task.q_len, task.kv_len, lane);
      }

      if (softmax.must_rescale(s, scale_log2)) softmax.rescale(o, scale_log2);
      softmax.exponentiate(s, scale_log2);
      uint32_t pa[kBN / 16][kMT][4];
      accumulator_to_a<T>(pa, s);
      if (p.for_backward()) softmax.template add_rounded_sums<T>(pa);  // differentiated calls only
      if constexpr (kDropout)
        drop_forward_probabilities<kBN / 8>(pa, drop_stream, m0 + warp_m0 + lane / 4, n0 + 2 * (lane % 4));
      uint32_t pa_lo[kSplitP ? kBN / 16 : 1][kMT][4];
      if constexpr (kSplitP) {
        subtract_rounded<T>(s);
        accumulator_to_a<T>(pa_lo, s);
        if (p.for_backward()) softmax.template add_rounded_sums<T>(pa_lo);
      }

      if (prefetch) {
        load_v(next_block, stage ^ 1);
        cp_async_commit();
        cp_async_wait<2>();  // this stage's V has landed
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      // No barrier here: the next iteration's first prefetch (K into the other stage) was last
      // read before this iteration's second barrier, and its V prefetch waits for its first.
      warp_gemm_a_regs<KVTile, true>(o, pa, s_v + stage * KVTile::kElements, 0, lane);
      if constexpr (kSplitP) warp_gemm_a_regs<KVTile, true>(o, pa_lo, s_v + stage * KVTile::kElements, 0, lane);
    }
  }

  if constexpr (kDropout)
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][dt][e] *= p.dropout_scale;

  // Epilogue: normalise, write O (zeros for rows with nothing to attend) and the log-sum-exp.
  store_output<T>(p.o, p.o_float32, p.o_error, p.o_vector_stores, task.q_offset, task.q_stride, p.lse + task.stat_offset + m0, o, softmax,
               softmax_scale, warp_m0, blk.rows, p.shape.head_dim, p.mask, m0, task.q_len, task.kv_len,
               lane, kGeneral ? &seen : nullptr);
}

}  // namespace jax_flash::cuda
