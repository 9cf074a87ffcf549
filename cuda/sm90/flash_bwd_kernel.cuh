// FlashAttention backward main kernel for Hopper (sm_90a) on wgmma, head dims 64 and 128.
//
// CTA = 2 warpgroups x 64 keys of one (batch, kv head): K and V stay in shared memory while the
// query blocks (64 rows, of every query head of the group) that see the keys stream past, Q and
// dO (and their lse, delta) double-buffered. Per query block, computed transposed so that each
// warpgroup's rows are its keys (FlashAttention-3's layout):
//   S^T = K Q^T and dP^T = V dO^T (SS wgmma), P^T = exp2(S^T scale log2e - lse log2e) and
//   dS^T = scale P^T (dP^T - delta) in registers (masks on the tiles that need them);
//   dV += P^T dO and dK += dS^T Q (RS wgmma, P^T and dS^T straight from registers, dO and Q read
//   N-major), accumulated in registers over the whole loop (the GQA reduction);
//   dS^T to shared memory, then dQ = dS K (SS wgmma, both operands transposed; each warpgroup
//   64 columns of the head dim) added to the float32 accumulator with atomics (or left to the
//   deterministic dQ kernel).
// The prepare and convert kernels of gpu/bwd_preprocess.cuh and gpu/bwd_postprocess.cuh run
// around it. No warp specialisation or
// TMA: both warpgroups run the same steps between barriers.
#pragma once

#include "common/attention_params.h"
#include "gpu/block_geometry.cuh"
#include "gpu/fragments.cuh"
#include "gpu/mask.cuh"
#include "gpu/ptx.cuh"
#include "gpu/smem_tile.cuh"
#include "gpu/softmax.cuh"
#include "gpu/tile_io.cuh"
#include "sm90/bwd_steps.cuh"
#include "sm90/traits.cuh"
#include "sm90/wgmma.cuh"

namespace jax_flash::cuda {

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ BwdParams p) {
#if JF_SM90A
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  using KVTile = typename Traits::KVTile;
  using QTile = typename Traits::QTile;
  using DsTile = typename Traits::DsTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  T* s_k = first_tile_boundary<T>(smem_raw);
  T* s_v = s_k + KVTile::kElements;
  T* s_q = s_v + KVTile::kElements;      // two stages
  T* s_do = s_q + 2 * QTile::kElements;  // two stages
  T* s_ds = s_do + 2 * QTile::kElements;
  float* s_lse2 = reinterpret_cast<float*>(s_ds + DsTile::kElements);  // two stages of kBM
  float* s_delta = s_lse2 + 2 * kBM;                                     // two stages of kBM

  const AttentionShape& sh = p.shape;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = warp / 4;                         // warpgroup: keys 64 group ..
  const int warp_key0 = group * 64 + warp % 4 * 16;   // this warp's 16 keys in the block
  const KeyBlockTask<kBM, kBN> task(p);
  using Visit = typename KeyBlockTask<kBM, kBN>::Visit;
  const int b = task.b;
  const int64_t q_len = task.q_len, kv_len = task.kv_len, q_stride = task.q_stride, kv_stride = task.kv_stride;
  const int64_t n0 = task.n0;
  const int live_keys = task.live_keys;
  const int iterations = task.iterations;

  const T* q_base = static_cast<const T*>(p.q) + task.q_batch_offset;
  const T* do_base = static_cast<const T*>(p.d_o) + task.q_batch_offset;
  // Q, dO of a visit into a stage (cp.async); its rows' lse and delta into registers of the
  // first kBM threads (loaded early, stored to shared memory once they have arrived).
  struct RowStatistics {
    float lse, delta;
  };
  auto load_visit = [&](Visit v, int stage) {
    const int64_t m0 = static_cast<int64_t>(v.mb) * kBM;
    const int rows = task.rows(v);
    load_tile<QTile, kThreads>(s_q + stage * QTile::kElements, q_base + m0 * q_stride + v.h * sh.head_dim,
                               q_stride, rows, task.chunks, tid);
    load_tile<QTile, kThreads>(s_do + stage * QTile::kElements, do_base + m0 * q_stride + v.h * sh.head_dim,
                               q_stride, rows, task.chunks, tid);
    RowStatistics stats{kEmptyRowLse, 0.f};
    if (tid < rows) {
      const int64_t stat = (static_cast<int64_t>(b) * sh.heads_q + v.h) * sh.seq_q + m0 + tid;
      stats = {p.lse[stat], p.delta[stat]};
    }
    return stats;
  };
  // The lse in log2 units (+inf for rows that attend to nothing, so that their P is 0) and the
  // delta of a stage, published by the next barrier.
  auto store_statistics = [&](RowStatistics stats, int stage) {
    if (tid < kBM) {
      s_lse2[stage * kBM + tid] = stats.lse == kEmptyRowLse ? INFINITY : stats.lse * kLog2e;
      s_delta[stage * kBM + tid] = stats.delta;
    }
  };

  float dk[1][kD / 8][4] = {};
  float dv[1][kD / 8][4] = {};
  const float scale_log2 = p.scale * kLog2e;
  const uint32_t k_address = smem_address(s_k), v_address = smem_address(s_v);
  const uint32_t ds_address = smem_address(s_ds);

  // The query blocks this warpgroup's keys take part in (the others skip their products).
  const int64_t group_key0 = n0 + group * 64;
  const KeyGroupBlocks group_blocks =
      KeyGroupBlocks::of<kBM>(p.mask, group_key0, min64(group_key0 + 64, n0 + live_keys), q_len, kv_len);

  if (iterations > 0) {
    load_tile<KVTile, kThreads>(s_k, static_cast<const T*>(p.k) + task.kv_offset, kv_stride, live_keys, task.chunks,
                                tid);
    load_tile<KVTile, kThreads>(s_v, static_cast<const T*>(p.v) + task.kv_offset, kv_stride, live_keys, task.chunks,
                                tid);
    store_statistics(load_visit(task.first_visit(), 0), 0);
    cp_async_commit();
  }
  prefetch_next_wave_keys<kBN, kD, kThreads, T>(p, tid);

  Visit visit = task.first_visit();
  for (int it = 0, stage = 0; it < iterations; ++it, stage ^= 1, visit = task.next_visit(visit)) {
    // This visit's tiles and statistics have landed and every warp is done with the previous
    // visit (its stage, dS^T tile and statistics): prefetch the next visit into the other stage.
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    const bool has_next = it + 1 < iterations;
    const int64_t m0 = static_cast<int64_t>(visit.mb) * kBM;
    const uint32_t q_address = smem_address(s_q + stage * QTile::kElements);
    const uint32_t do_address = smem_address(s_do + stage * QTile::kElements);

    // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys, then P^T and dS^T (masked
    // where some query of the block does not see some key). A warpgroup none of whose keys the
    // block's queries see has P^T = dS^T = 0: it skips the products and stores a zero dS^T.
    float st[1][kBM / 8][4], dpt[1][kBM / 8][4];
    const bool group_live = group_blocks.live(visit.mb);
    RowStatistics next_stats{};
    if (group_live) {
      issue_transposed_scores<Traits, T>(st, dpt, k_address, v_address, q_address, do_address, group);
      // The next visit's loads are issued under the products.
      if (has_next) {
        next_stats = load_visit(task.next_visit(visit), stage ^ 1);
        cp_async_commit();
      }
      wgmma_wait<0>();
      fence_registers(st[0]);
      fence_registers(dpt[0]);

      if (!group_blocks.whole(visit.mb))
        mask_transposed_scores(st, p.mask, n0 + warp_key0, m0, q_len, kv_len, lane);
      probabilities_and_ds<kBM>(st, dpt, s_lse2 + stage * kBM, s_delta + stage * kBM, scale_log2, p.scale, lane);
    } else {
      if (has_next) {
        next_stats = load_visit(task.next_visit(visit), stage ^ 1);
        cp_async_commit();
      }
#pragma unroll
      for (int nt = 0; nt < kBM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[0][nt][e] = 0.f;
    }
    // The next visit's statistics have had the products' time to arrive.
    if (has_next) store_statistics(next_stats, stage ^ 1);

    // dS^T to shared memory, for dK and dQ (each thread its fragments: rows keys, columns
    // queries). SmemTile<kBN, 64> stores exactly as DsTile lays out (one 64-column block,
    // chunk ^ row).
    store_accumulator<SmemTile<kBN, kBM>>(s_ds, dpt, warp_key0, 0, lane);
    fence_proxy_async();
    __syncthreads();  // every warp's dS^T is in shared memory

    // dV, dK and this warpgroup's part of dQ, issued back to back and waited for once; dQ added
    // to the float32 accumulator.
    const bool dq_here = !p.deterministic && group * 64 < kD;
    float dq[1][8][4];
    accumulate_gradients<Traits, T>(dk, dv, dq, st, q_address, do_address, ds_address, k_address, group, group_live,
                                    dq_here);
    if (dq_here) add_dq(p, task, dq, m0, visit.h, group, warp, lane);
  }

  store_dk_dv<Traits, kThreads>(p, task, dk, dv, s_k, s_v, warp_key0, lane, tid, [] { __syncthreads(); });
#endif  // JF_SM90A
}

}  // namespace jax_flash::cuda
