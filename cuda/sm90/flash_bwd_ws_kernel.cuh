// FlashAttention backward main kernel for Hopper (sm_90a), warp-specialised: one CTA per key
// block of 128 keys of one (batch, kv head), computed transposed (the steps of
// sm90/bwd_steps.cuh), dK and dV in registers over every query block of every query head of the
// group, dQ added to the float32 accumulator; its loads are a producer warpgroup's:
//
//   warpgroup 0, the producer: gives most of its registers back; its first warp loads K and V
//     once, then per visit (query block of a head) Q and dO by TMA into one of kStages stages
//     and the rows' lse (log2 units) and delta with plain loads, all 32 lanes arriving on the
//     stage's full barrier (lane 0 with the copies' bytes). Tiles with rows past the valid
//     lengths (only with lengths) are copied by the warp with zero fill instead: the array's
//     data there would meet probability 0 in the products, and 0 * NaN is NaN.
//   warpgroups 1-2, the consumers (64 keys each): per visit S^T = K Q^T and dP^T = V dO^T (SS),
//     P^T and dS^T in registers, dS^T to one of two shared buffers, the two warpgroups meet on
//     a named barrier, then dV += P^T dO (RS), dK += dS^T Q and dQ = dS K (SS); each consumer
//     thread releases the stage once its products are in.
//   With Traits::kBulkDq the consumers leave dQ in a float32 shared tile instead of adding it
//   with atomics, and the producer's second warp adds the tile's rows to the accumulator with
//   bulk reductions (cp.reduce.async.bulk), FlashAttention-3's way of keeping the atomics and
//   their addresses off the math warps.
//   With 80-row visits (Traits::kDqTransposed, experimental) dS^T is stored query-major and the
//   consumers compute dQ^T = K^T dS^T (wgmma's M is 64), handed off in tiles as at head dim 128.
//   With a value head dim of its own (Traits::kOwnValueHeadDim: MLA's 192 / 128, the split
//   kernel) V, dO and dV have Hv columns: dP^T runs over Hv, and each warpgroup's columns of dK
//   and dV are dealt apart (Traits::split_dk_columns, split_dv_columns).
//
// The prepare and convert kernels around it are shared with the sm80 family (gpu/launch.cu).
#pragma once

#include <cuda.h>

#include <type_traits>

#include "common/attention_params.h"
#include "gpu/block_geometry.cuh"
#include "gpu/dropout_fragments.h"
#include "gpu/fragments.cuh"
#include "gpu/logit_arrays.cuh"
#include "gpu/mask.cuh"
#include "gpu/ptx.cuh"
#include "gpu/score_mods.cuh"
#include "gpu/segment_ids.cuh"
#include "gpu/smem_tile.cuh"
#include "gpu/softmax.cuh"
#include "gpu/tile_io.cuh"
#include "sm90/barrier.cuh"
#include "sm90/bwd_steps.cuh"
#include "sm90/tma.cuh"
#include "sm90/traits.cuh"
#include "sm90/wgmma.cuh"

namespace jax_flash::cuda {

// The backward's parameters with the TMA descriptors of q, k, v and dO (sm90/tensor_map.h).
struct BwdTmaParams {
  BwdParams p;
  CUtensorMap q, k, v, d_o;
  // kLogitArrays: the bias's tiles go through shared memory (gpu/logit_arrays.cuh bias_stages;
  // the launch then allocates Traits::kSmemBytesBiasStages), by TMA with bias_tma (its
  // descriptor `bias`, sm90/tensor_map.h make_bias_tensor_map), else by the producer warp's
  // copies.
  bool bias_staged = false;
  bool bias_tma = false;
  CUtensorMap bias;
  // dbias by 16-byte atomics of four keys (gpu/logit_arrays.cuh dbias_quads).
  bool dbias_quads = false;
};

template <int kStages>
struct BwdWsBarriers {
  uint64_t kv_full, full[kStages], empty[kStages];
  uint64_t dq_full[2], dq_empty[2];  // the dQ tile (Traits::kBulkDq; one pair a warpgroup with kTiledDq)
  uint32_t staged_dq_live[kStages][2];  // Traits::kStageDq: whether a stage holds warpgroup g's dQ
  uint64_t bias_full[kStages];  // the stage's bias tile (BwdTmaParams::bias_staged): its TMA, or the producer's lanes' copies
};

// With Traits::kDeferDq: a warpgroup's dS^T of a visit in its buffer, one mbarrier a warpgroup and
// buffer (after the others, so that the other variants' barriers keep their 128 bytes).
template <int kStages>
struct BwdWsDeferBarriers : BwdWsBarriers<kStages> {
  uint64_t ds_full[2][4];
};

// Shared memory of a warp-specialised backward CTA, from a 1 KiB boundary. The barriers are in
// it too, last: a static __shared__ beside the 1 KiB-aligned dynamic part took 1 KiB, which the
// 80-row visits' 226.3 KiB do not leave (227 KiB in all). With a staged bias its tiles come
// before them (on the 1 KiB boundary there, which TMA's swizzle needs; Traits::kBiasStagesFit).
template <typename Traits, typename T>
struct Sm90BwdWsSmem {
  T* k;
  T* v;
  T* q;      // kStages
  T* d_o;    // kStages
  T* ds;     // Traits::kDsBuffers dS^T buffers
  T* pt;     // two P^T buffers (Traits::kSplitHeadDim)
  float* lse2;   // kStages x kBlockM
  float* delta;  // kStages x kBlockM
  float* dq;     // kBlockM x kDqRowStride (kBulkDq)
  T* bias;       // kStages bias tiles (bias_staged)
  using Barriers = std::conditional_t<Traits::kDeferDq, BwdWsDeferBarriers<Traits::kStages>, BwdWsBarriers<Traits::kStages>>;
  Barriers* bars;
  static_assert(sizeof(Barriers) <= Traits::kBarrierBytes, "the barriers' bytes");
  __device__ Sm90BwdWsSmem(unsigned char* raw, bool bias_staged) {
    k = first_tile_boundary<T>(raw);
    v = k + Traits::KTile::kElements;
    q = v + Traits::VTile::kElements;
    d_o = q + Traits::kStages * Traits::QTile::kElements;
    ds = d_o + Traits::kStages * Traits::DoTile::kElements;
    pt = ds + 2 * Traits::DsTile::kElements;  // (kSplitHeadDim: two dS^T buffers)
    lse2 = reinterpret_cast<float*>(ds + Traits::kScoreTiles * Traits::DsTile::kElements);
    delta = lse2 + Traits::kStages * Traits::kBlockM;
    dq = delta + Traits::kStages * Traits::kBlockM;
    bias = reinterpret_cast<T*>(dq + (Traits::kBulkDq ? Traits::kBlockM * Traits::kDqRowStride : 0));
    bars = reinterpret_cast<Barriers*>(bias + (bias_staged ? Traits::kStages * Traits::BiasTile::kElements : 0));
  }
  __device__ T* bias_stage(int stage) const { return bias + stage * Traits::BiasTile::kElements; }
  __device__ T* q_stage(int stage) const { return q + stage * Traits::QTile::kElements; }
  __device__ T* d_o_stage(int stage) const { return d_o + stage * Traits::DoTile::kElements; }
  __device__ T* ds_buffer(int i) const { return ds + i * Traits::DsTile::kElements; }
  __device__ T* pt_buffer(int i) const { return pt + i * Traits::DsTile::kElements; }
};

// kDeterministic: p.deterministic as a constant (dQ is then left to its own kernel). Whether a
// warpgroup computes dQ must be known to the compiler: behind a run-time branch ptxas serialises
// the dQ product at head dim 128 (C7512, "insufficient register resources").
// kGeneral: the call has a soft cap or ALiBi slopes (gpu/score_mods.cuh): each visit's S^T is
// modified before its masks and dP^T takes the cap's chain rule; or segment ids
// (gpu/segment_ids.cuh): the visits narrowed to the query blocks whose ids can meet the keys',
// the id mask where a warpgroup's keys and the block's rows do not all share one id.
// kBlockWalk: the plain kernel walking a block mask's live visits, for block-sparse calls that
// need nothing else of the general kernels (plain_block_walk_suffices).
// kIds (general kernels only): the ids' and the block walk's code is compiled in (general_ids);
// without it a general kernel has only the score modifications beside the plain kernel's masks.
// kDropout (non-deterministic general kernels without ids): fused dropout (gpu/dropout_fragments.h),
// an instantiation of its own so that the other general kernels keep their registers (with it,
// the capped kernels spilled up to 250 bytes).
// kLogitArrays (non-deterministic general kernels without dropout): jax.nn's bias and mask arrays
// (gpu/logit_arrays.cuh) on S^T, and dS^T added into the bias's float32 gradient; an
// instantiation of its own, experimental. With kIds every array path; without it a staged bias
// alone (gpu/logit_arrays.cuh staged_bias_alone), as the forward's.
template <typename Traits, typename T, bool kDeterministic, bool kGeneral, bool kBlockWalk = false,
          bool kIds = kGeneral, bool kDropout = false, bool kLogitArrays = false>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_bwd_sm90_ws_kernel(const __grid_constant__ BwdTmaParams params) {
  static_assert(!kDropout || (kGeneral && !kIds && !kDeterministic && !kBlockWalk),
                "dropout: a non-deterministic general kernel without ids");
  static_assert(!kLogitArrays || (kGeneral && !kDeterministic && !kBlockWalk && !kDropout),
                "bias and mask arrays: a non-deterministic general kernel without dropout");
#if JF_SM90A
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kConsumerThreads = 128 * Traits::kConsumers;
  using KTile = typename Traits::KTile;
  using QTile = typename Traits::QTile;
  using VTile = typename Traits::VTile;
  using DoTile = typename Traits::DoTile;
  using DsTile = typename Traits::DsTile;
  const BwdParams& p = params.p;
  constexpr bool kStagedBiasAlone = kLogitArrays && !kIds;
  const bool bias_staged = kStagedBiasAlone || (kLogitArrays && params.bias_staged);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Sm90BwdWsSmem<Traits, T> smem(smem_raw, bias_staged);
  auto& bars = *smem.bars;

  // A stage is released by every consumer thread, each for its own reads of the rows' lse and
  // delta (plain loads): a warp barrier before one lane's arrive orders them as well by the PTX
  // memory model, but compute-sanitizer's racecheck does not follow it (session 23: 4 hazards).
  // With Traits::kStageDq the dQ writer releases it too, once its bulk reductions have read the
  // dQ left in the stage.
  constexpr bool kStagedDq = Traits::kStageDq && !kDeterministic;
  constexpr int kReleaseCount = kConsumerThreads + (kStagedDq ? 1 : 0);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    Mbarrier(&bars.kv_full).init(32);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      Mbarrier(&bars.full[s]).init(32);
      Mbarrier(&bars.empty[s]).init(kReleaseCount);
      if (bias_staged) Mbarrier(&bars.bias_full[s]).init(params.bias_tma ? 1 : 32);  // the TMA's bytes, or each lane
    }
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      Mbarrier(&bars.dq_full[g]).init(Traits::kTiledDq || Traits::kStageDq ? 4 : Traits::kDqWarps);
      Mbarrier(&bars.dq_empty[g]).init(32);
      if constexpr (Traits::kDeferDq) {
#pragma unroll
        for (int b = 0; b < 4; ++b) Mbarrier(&bars.ds_full[g][b]).init(1);
      }
    }
    Mbarrier::fence_init();
  }
  __syncthreads();

  const AttentionShape& sh = p.shape;
  // A part of the group's heads where the call splits them (not the 80-row visits: launch.cu).
  using Task = KeyBlockTask<kBM, kBN, !Traits::kDqTransposed>;
  Task task(p);
  if constexpr (kIds) narrow_key_block(task, SegmentIds(p, task.b), lane);  // warp-collective: every role
  task.template walk_visits<kIds || kBlockWalk>(p);  // a block mask's live query blocks only
  using Visit = typename Task::Visit;
  const int iterations = task.iterations;

  if (warp < 4) {
    // ---- Producer warpgroup: warp 0 loads, the others leave.
    release_registers<Traits::kProducerRegisters>();
    if (kStagedDq && warp == 1) {
      // The dQ writer (through the stage): each visit's live 64-column parts (a warpgroup's two:
      // the first in its half of the stage's Q tile, the second in its half of dO's), one bulk
      // reduction each into the accumulator's tile of (batch, head, query block), columns past
      // the head dim skipped; then the stage released.
      const int64_t m_blocks = (sh.seq_q + kBM - 1) / kBM;
      const int parts = static_cast<int>((sh.head_dim + 63) / 64);
      constexpr int kPartFloats = kBM * 64;
      static_assert(2 * QTile::kBlockBytes == kPartFloats * 4, "a 64-column part of dQ in two blocks of Q or dO");
      Visit visit = task.first_visit();
      for (int it = 0; it < iterations; ++it, visit = task.next_visit(visit)) {
        const int stage = it % kStages;
        Mbarrier(&bars.dq_full[0]).wait(it & 1);
        Mbarrier(&bars.dq_full[1]).wait(it & 1);
        if (lane == 0) {
          float* tile = p.dq_accum + ((task.b * sh.heads_q + visit.h) * m_blocks + visit.mb) * (kBM * parts * 64);
#pragma unroll
          for (int g = 0; g < 2; ++g) {
            if (!bars.staged_dq_live[stage][g]) continue;
            const float* q_half = reinterpret_cast<const float*>(smem.q_stage(stage)) + g * kPartFloats;
            const float* do_half = reinterpret_cast<const float*>(smem.d_o_stage(stage)) + g * kPartFloats;
            if (2 * g < parts) bulk_reduce_add(tile + 2 * g * kPartFloats, q_half, kPartFloats * 4);
            if (2 * g + 1 < parts) bulk_reduce_add(tile + (2 * g + 1) * kPartFloats, do_half, kPartFloats * 4);
          }
          bulk_commit();
          bulk_wait_read();
          Mbarrier(&bars.empty[stage]).arrive();
        }
        __syncwarp();
      }
      if (lane == 0) bulk_wait_all();  // the last reductions complete before the warp exits
      return;
    }
    if (Traits::kBulkDq && Traits::kTiledDq && !kDeterministic && warp == 1) {
      // The dQ writer (tiled): each visit's two warpgroup parts, one bulk reduction each, into
      // the accumulator's tile of (batch, head, query block) in the same order.
      const int64_t m_blocks = (sh.seq_q + kBM - 1) / kBM;
      Visit visit = task.first_visit();
      for (int it = 0; it < iterations; ++it, visit = task.next_visit(visit)) {
        float* tile = p.dq_accum + ((task.b * sh.heads_q + visit.h) * m_blocks + visit.mb) * (kBM * kD);
#pragma unroll
        for (int g = 0; g < 2; ++g) {
          Mbarrier(&bars.dq_full[g]).wait(it & 1);
          if (lane == 0) {
            bulk_reduce_add(tile + g * Traits::kDqPartFloats, smem.dq + g * Traits::kDqPartFloats,
                            static_cast<uint32_t>(Traits::kDqPartFloats * 4));
            bulk_commit();
            bulk_wait_read();
          }
          __syncwarp();
          Mbarrier(&bars.dq_empty[g]).arrive();
        }
      }
      if (lane == 0) bulk_wait_all();  // the last reductions complete before the warp exits
      return;
    }
    if (Traits::kBulkDq && !kDeterministic && warp == 1) {
      // The dQ writer: each visit's tile, row by row, added to the accumulator.
      Visit visit = task.first_visit();
      for (int it = 0; it < iterations; ++it, visit = task.next_visit(visit)) {
        Mbarrier(&bars.dq_full[0]).wait(it & 1);
        const int64_t m0 = static_cast<int64_t>(visit.mb) * kBM;
        const int rows = task.rows(visit);
#pragma unroll
        for (int r = lane; r < kBM; r += 32)
          if (r < rows)
            bulk_reduce_add(p.dq_accum + (task.b * sh.seq_q + m0 + r) * task.q_stride + visit.h * sh.head_dim,
                            smem.dq + r * Traits::kDqRowStride, static_cast<uint32_t>(sh.head_dim * 4));
        bulk_commit();
        bulk_wait_read();
        Mbarrier(&bars.dq_empty[0]).arrive();
        __syncwarp();
      }
      bulk_wait_all();  // the last reductions complete before the warp exits
      return;
    }
    if (warp != 0) return;
    prefetch_next_wave_keys<kBN, kD, 32, T, Traits::kValueHeadDim>(p, lane);
    if (iterations == 0) return;
    // V's and dO's rows (their own head dim with Traits::kOwnValueHeadDim).
    const ValueRows values = key_block_value_rows<Traits::kOwnValueHeadDim>(p, task);
    const Mbarrier kv_full(&bars.kv_full);
    if (task.live_keys == kBN || task.kv_len == sh.seq_k) {
      if (lane == 0) {
        prefetch_tensor_map(params.q);
        prefetch_tensor_map(params.d_o);
        kv_full.arrive_expect_bytes((KTile::kElements + VTile::kElements) * sizeof(T));
        tma_load_tile<KTile>(smem.k, params.k, task.hk, task.n0, task.b, kv_full);
        tma_load_tile<VTile>(smem.v, params.v, task.hk, task.n0, task.b, kv_full);
      } else {
        kv_full.arrive();
      }
    } else {  // keys past kv_len in the block: zero-filled
      warp_load_tile<KTile>(smem.k, static_cast<const T*>(p.k) + task.kv_offset, task.kv_stride, task.live_keys,
                            task.chunks, lane);
      warp_load_tile<VTile>(smem.v, static_cast<const T*>(p.v) + values.v_offset, values.v_stride, task.live_keys,
                            values.chunks, lane);
      cp_async_commit();
      cp_async_wait<0>();
      fence_proxy_async();
      kv_full.arrive();
    }
    Visit visit = task.first_visit();
    for (int it = 0; it < iterations; ++it, visit = task.next_visit(visit)) {
      const int stage = it % kStages, phase = (it / kStages) & 1;
      const Mbarrier full(&bars.full[stage]);
      Mbarrier(&bars.empty[stage]).wait(phase ^ 1);
      const int64_t m0 = static_cast<int64_t>(visit.mb) * kBM;
      const int rows = task.rows(visit);
      // The visit's bias tile, by TMA or by the warp's copies (each lane arrives once its own are
      // in); the stage's empty barrier covers the tile: the consumers read it before they release.
      if constexpr (kLogitArrays)
        if (bias_staged) {
          const Mbarrier bias_full(&bars.bias_full[stage]);
          if (params.bias_tma) {
            if (lane == 0) {
              using Tile = typename Traits::BiasTmaTile;
              const BiasSlice slice = bias_slice(p.bias, task.b, visit.h);
              bias_full.arrive_expect_bytes(Tile::kElements * sizeof(T));
              tma_load_tile<Tile>(smem.bias_stage(stage), params.bias, slice.head, m0, slice.batch, bias_full,
                                  task.n0);
            }
          } else {
            stage_bias_tile<typename Traits::BiasTile>(smem.bias_stage(stage), p, task.b, visit.h, m0, task.n0, lane);
            bias_full.arrive_after_copies();
          }
        }
      // Whole tiles by TMA: with Traits::kStatsUnderTma issued before the rows' lse and delta
      // load (lane 0 expects the bytes; the phase completes once every lane has arrived after its
      // stores, and the bytes are in), else after them (lane 0's arrival expecting the bytes).
      const bool whole_tiles = rows == kBM || task.q_len == sh.seq_q;
      auto issue_whole_tiles = [&] {
        tma_load_tile<QTile>(smem.q_stage(stage), params.q, visit.h, m0, task.b, full);
        tma_load_tile<DoTile>(smem.d_o_stage(stage), params.d_o, visit.h, m0, task.b, full);
      };
      constexpr uint32_t kStageBytes = (QTile::kElements + DoTile::kElements) * sizeof(T);
      if (Traits::kStatsUnderTma && whole_tiles && lane == 0) {
        full.expect_bytes(kStageBytes);
        issue_whole_tiles();
      }
      // The rows' lse in log2 units (+inf for rows that attend to nothing or are past q_len,
      // so that their P is 0) and delta.
#pragma unroll
      for (int r = lane; r < kBM; r += 32) {
        float lse = kEmptyRowLse, delta = 0.f;
        if (r < rows) {
          const int64_t stat = (static_cast<int64_t>(task.b) * sh.heads_q + visit.h) * sh.seq_q + m0 + r;
          lse = p.lse[stat];
          delta = p.delta[stat];
        }
        smem.lse2[stage * kBM + r] = lse == kEmptyRowLse ? INFINITY : lse * kLog2e;
        smem.delta[stage * kBM + r] = delta;
      }
      if (whole_tiles) {
        if (!Traits::kStatsUnderTma && lane == 0) {
          full.arrive_expect_bytes(kStageBytes);
          issue_whole_tiles();
        } else {
          full.arrive();
        }
      } else {  // rows past q_len in the block: zero-filled
        const int64_t offset = task.q_batch_offset + m0 * task.q_stride + visit.h * sh.head_dim;
        const int64_t do_offset = Traits::kOwnValueHeadDim
                                      ? values.row_offset + m0 * values.row_stride + visit.h * values.head_dim
                                      : offset;
        warp_load_tile<QTile>(smem.q_stage(stage), static_cast<const T*>(p.q) + offset, task.q_stride, rows,
                              task.chunks, lane);
        warp_load_tile<DoTile>(smem.d_o_stage(stage), static_cast<const T*>(p.d_o) + do_offset, values.row_stride, rows,
                               values.chunks, lane);
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async();
        full.arrive();
      }
      // The lanes stay in step (parity waits are only safe one phase behind).
      __syncwarp();
    }
    return;
  }

  // ---- Consumer warpgroups.
  claim_registers<Traits::kConsumerRegisters>();
  const int ctid = threadIdx.x - 128;                // 0 .. kConsumerThreads - 1
  // The warpgroup, warp-uniform (K's, V's and dS^T's descriptors in uniform registers: bwd +1-3%
  // on the H200, session 24) in the plain kernels of 64-row visits; the general kernels and the
  // 128-row visits (head dim 64) keep the plain index: with it ptxas spilled more in most of
  // them, and head dim 64's backward ran 2-3% slower.
  const int group = consumer_warpgroup<!kGeneral && Traits::kBlockM != 128>(warp);
  // Its keys (64 group .., or with kSplitHeadDim the block's 64) and this warp's 16 of them; its
  // queries of each visit's block (kSQ from query0) and head-dim columns of dK and dV (all, or
  // with kSplitHeadDim its own from dk_col0 and dv_col0).
  constexpr bool kSplit = Traits::kSplitHeadDim;
  constexpr int kSQ = Traits::kScoreQueries;
  const int group_keys = kSplit ? 0 : group * 64;
  const int warp_key0 = group_keys + warp % 4 * 16;
  const int query0 = kSplit ? group * kSQ : 0;
  // (Warpgroup 0's columns start at 0.)
  const int dk_col0 = kSplit ? group * Traits::split_dk_col0(1) : 0;
  const int dv_col0 = kSplit ? group * Traits::split_dv_col0(1) : 0;
  const int64_t q_len = task.q_len, kv_len = task.kv_len;
  const int64_t n0 = task.n0;
  float dk[1][Traits::kDkTiles][4] = {};
  float dv[1][Traits::kDvTiles][4] = {};
  const float scale_log2 = (kGeneral ? ScoreMods::softmax_scale(p) : p.scale) * kLog2e;
  // (kLogitArrays) the staged bias's factor, in the scores' units
  const float bias_factor = kLogitArrays ? 1.f / ScoreMods::softmax_scale(p) : 0.f;
  const uint32_t k_address = smem_address(smem.k), v_address = smem_address(smem.v);
  // The two consumer warpgroups meet on named barrier 1 (id 0 is __syncthreads').
  auto consumers_sync = [] { named_barrier_sync(1, kConsumerThreads); };
  // f(std::integral_constant<int, g>) with this warpgroup's g where the split warpgroups' column
  // counts differ (Traits::kSplitUneven), else f(integral_constant<int, 0>): one instantiation.
  auto with_group_constant = [&](auto&& f) {
    if (!Traits::kSplitUneven || group == 0)
      f(std::integral_constant<int, 0>{});
    else
      f(std::integral_constant<int, 1>{});
  };

  // The query blocks this warpgroup's keys take part in (the others skip their products).
  const int64_t group_key0 = n0 + group_keys;
  const KeyGroupBlocks group_blocks =
      KeyGroupBlocks::of<kBM>(p.mask, group_key0, min64(group_key0 + 64, n0 + task.live_keys), q_len, kv_len);

  // This warpgroup's part of visit v's dQ into the tiled hand-off (Traits::kTiledDq), in its
  // fragments' order, once the writer has taken the part of visit v - 1.
  // dQ's fragments a warpgroup: 64 rows or columns x 64, or (kDqTransposed) dQ^T's 64 head-dim
  // rows x the block's queries.
  constexpr int kDqTiles = Traits::kDqTransposed ? kBM / 8 : 8;
  auto hand_off_dq_part = [&](const float (&dq)[1][kDqTiles][4], int v) {
    Mbarrier(&bars.dq_empty[group]).wait((v & 1) ^ 1);
    store_in_fragment_order(reinterpret_cast<float4*>(smem.dq + group * Traits::kDqPartFloats) + (ctid % 128), dq);
    fence_proxy_async();  // the bulk reductions read through the async proxy
    __syncwarp();
    if (lane == 0) Mbarrier(&bars.dq_full[group]).arrive();
  };
  // Traits::kDeferDq: visit v's dQ, once the other warpgroup's dS^T of it is in (this one's own
  // is: the warpgroup's barrier after its stores), handed off.
  auto deferred_dq = [&](int v) {
    if constexpr (Traits::kDeferDq) {
      Mbarrier(&bars.ds_full[1 - group][v % 4]).wait((v / 4) & 1);
      float dq[1][8][4];
      issue_query_gradient<Traits, T>(dq, smem_address(smem.ds_buffer(v % 4)), k_address, group);
      wgmma_wait<0>();
      fence_registers(dq[0]);
      hand_off_dq_part(dq, v);
    }
  };

  if (iterations > 0) Mbarrier(&bars.kv_full).wait(0);
  Visit visit = task.first_visit();
  for (int it = 0; it < iterations; ++it, visit = task.next_visit(visit)) {
    const int stage = it % kStages;
    Mbarrier(&bars.full[stage]).wait((it / kStages) & 1);
    const int64_t m0 = static_cast<int64_t>(visit.mb) * kBM;
    const uint32_t q_address = smem_address(smem.q_stage(stage));
    const uint32_t do_address = smem_address(smem.d_o_stage(stage));
    T* ds = smem.ds_buffer(it % Traits::kDsBuffers);
    const uint32_t ds_address = smem_address(ds);

    // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys, then P^T and dS^T (masked
    // where some query of the block does not see some key). A warpgroup none of whose keys the
    // block's queries see has P^T = dS^T = 0: it skips the products and stores a zero dS^T.
    float st[1][kSQ / 8][4], dpt[1][kSQ / 8][4];
    bool group_live = group_blocks.live(visit.mb);
    // With segment ids: none of this warpgroup's keys may share an id with the block's rows
    // (then it is not live either), or all of them one id (no id mask).
    bool id_mask = false;
    if constexpr (kIds)
      if (group_live && p.q_segment_ids) {
        const SegmentIds ids(p, task.b);
        const IdSpan keys = ids.keys_span(group_key0, min64(group_key0 + 64, sh.seq_k));
        const IdSpan rows = ids.rows_span(m0, min64(m0 + kBM, sh.seq_q));
        group_live = rows.meets(keys);
        id_mask = !rows.same_single_id(keys);
      }
    if (group_live) {
      issue_transposed_scores<Traits, T>(st, dpt, k_address, v_address, q_address, do_address, group_keys, query0);
      // S^T is in once all but the newest group (dP^T) are: its masks and, in plain calls, P^T
      // run while dP^T is on the tensor cores.
      wgmma_wait<1>();
      fence_registers(st[0]);
      const float* lse2 = smem.lse2 + stage * kBM + query0;
      const float* delta = smem.delta + stage * kBM + query0;
      const int64_t m0_group = m0 + query0;  // the warpgroup's first query
      if constexpr (kGeneral)
        ScoreMods(p, task.b, visit.h).apply_transposed<!kIds>(st, n0 + warp_key0, m0_group, lane);
      if (id_mask)
        mask_transposed_with_ids(st, SegmentIds(p, task.b), p.mask, n0 + warp_key0, m0_group, q_len, kv_len, lane);
      else if (!group_blocks.whole(visit.mb))
        mask_transposed_scores(st, p.mask, n0 + warp_key0, m0_group, q_len, kv_len, lane);
      if constexpr (kLogitArrays) {
        if constexpr (kIds)
          apply_logit_arrays_transposed<T>(st, p, task.b, visit.h, n0 + warp_key0, m0_group, lane, bias_staged);
        if (bias_staged) {
          Mbarrier(&bars.bias_full[stage]).wait((it / kStages) & 1);
          if (params.bias_tma)
            add_staged_bias_transposed<typename Traits::BiasTmaTile>(st, smem.bias_stage(stage), warp_key0, query0,
                                                                     bias_factor, lane);
          else
            add_staged_bias_transposed<typename Traits::BiasTile>(st, smem.bias_stage(stage), warp_key0, query0,
                                                                  bias_factor, lane);
        }
      }
      if constexpr (!kGeneral) transposed_probabilities<kSQ>(st, lse2, scale_log2, lane);
      wgmma_wait<0>();
      fence_registers(dpt[0]);
      // Fused dropout (kDropout): Z = keep / (1 - rate) of this warpgroup's elements. dS^T =
      // P^T (Z dP^T - delta) wants dP^T times Z first (the cap's chain rule then folds into
      // Z dP^T), and dV the dropped P^T, formed once dS^T has read P^T.
      uint64_t keep = 0;
      const bool dropout = kDropout && p.dropout_seeds != nullptr;
      if constexpr (kGeneral) {  // the cap's chain rule reads the capped scores, before P^T
        if constexpr (kDropout)
          if (dropout) {
            keep = transposed_keep_mask<kSQ / 8>(dropout_stream(p, task.b, visit.h), n0 + warp_key0 + lane / 4,
                                                 m0_group + 2 * (lane % 4));
            apply_keep_mask(dpt[0], keep, p.dropout_scale);
          }
        ScoreMods(p, task.b, visit.h).fold_chain_rule_transposed(dpt, st, delta, n0 + warp_key0, m0_group, lane);
        transposed_probabilities<kSQ>(st, lse2, scale_log2, lane);
      }
      transposed_score_gradients<kSQ>(dpt, st, delta, lane);
      if (dropout) apply_keep_mask(st[0], keep, p.dropout_scale);
      // dbias = dS (the handler refuses a soft cap beside a bias: dS here holds the cap's factor)
      if constexpr (kLogitArrays)
        if (p.dbias_accum) add_dbias_transposed(dpt, p, task.b, visit.h, n0 + warp_key0, m0_group, lane,
                             kStagedBiasAlone || params.dbias_quads);
    }
    // (Not live: st and dpt are left unset and never read; the zero dS^T is stored from
    // constants. Zeroing them here cost 30 CS2R every visit, hoisted above the branch.)

    // dS^T to this visit's buffer (the other buffer may still be read by the other warpgroup's
    // dQ of the last visit; this one's last reader, two visits ago, finished before that
    // warpgroup reached the barrier below last time). Then dV, dK and this warpgroup's part of
    // dQ (64 query rows or 64 columns a warpgroup: Traits::kDqByRows), waited for; then the
    // stage is released (Q, dO, lse and delta no longer read by this warp) and dQ added to the
    // float32 accumulator.
    const bool dq_here = !kDeterministic && (Traits::kDqByRows || Traits::kTileHeadDim == 128 || kSplit || group == 0);
    float dq[1][kDqTiles][4];
    if constexpr (kSplit) {
      // P^T and dS^T of the warpgroup's queries to this visit's tiles (every key), then, once
      // both warpgroups' are in, its head-dim columns of dV and dK and its first 64-column block
      // of dQ from them; the stage released once dV and dK are in; dQ's second block (if it has
      // one) issued while the first's atomics run. A block none of whose queries see the keys
      // (both warpgroups alike) adds nothing: no stores, no products.
      if (group_live) {
        store_transposed_ds<Traits>(smem.pt_buffer(it % 2), st, warp_key0, lane, query0);
        store_transposed_ds<Traits>(ds, dpt, warp_key0, lane, query0);
      }
      fence_proxy_async();
      consumers_sync();  // both warpgroups' P^T and dS^T are in
      const bool dq_live = dq_here && group_live;
      // Warpgroup `kG`'s products and dQ, its column counts as constants (they differ between the
      // warpgroups at head dim 192).
      auto split_gradients = [&](auto group_constant) {
        constexpr int kG = decltype(group_constant)::value;
        constexpr int kNk = Traits::split_dk_columns(kG), kNv = Traits::split_dv_columns(kG);
        constexpr int kDqBlocks = Traits::split_dq_blocks(kG);
        const int dq_block0 = Traits::split_dq_block0(group);  // (group is kG where the warpgroups differ)
        if (group_live)
          issue_split_key_gradients<Traits, kNk, kNv, T>(dk, dv, smem_address(smem.pt_buffer(it % 2)), ds_address,
                                                         q_address, do_address, dk_col0 / 64, dv_col0 / 64);
        if (dq_live) {
          issue_query_gradient<Traits, T>(dq, ds_address, k_address, dq_block0);
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        if constexpr (kNv > 0) fence_registers(leading_tiles<kNv / 8>(dv)[0]);
        fence_registers(leading_tiles<kNk / 8>(dk)[0]);
        Mbarrier(&bars.empty[stage]).arrive();  // every lane (kConsumerThreads of kReleaseCount)
        if constexpr (kStagedDq) {
          // dV and dK are in: this warpgroup's halves of Q and dO are no longer read (the other
          // warpgroup reads its own halves; S^T and dP^T were in before the barrier). dQ's first
          // 64-column block goes where its Q columns were, the second where its dO columns were,
          // each in the fragments' order (conflict-free 16-byte stores); then the writer is told.
          static_assert(kDqBlocks == 2, "two 64-column blocks of dQ a warpgroup");
          if (dq_live) {
            float dq_next[1][8][4];
            wgmma_wait<0>();
            fence_registers(dq[0]);
            issue_query_gradient<Traits, T>(dq_next, ds_address, k_address, dq_block0 + 1);
            store_in_fragment_order(reinterpret_cast<float4*>(smem.q_stage(stage)) + group * (kBM * 64 / 4) + ctid % 128,
                                    dq);
            wgmma_wait<0>();
            fence_registers(dq_next[0]);
            store_in_fragment_order(reinterpret_cast<float4*>(smem.d_o_stage(stage)) + group * (kBM * 64 / 4) + ctid % 128,
                                    dq_next);
            fence_proxy_async();  // the bulk reductions read through the async proxy
          }
          if (ctid % 128 == 0) bars.staged_dq_live[stage][group] = dq_live;
          __syncwarp();
          if (lane == 0) Mbarrier(&bars.dq_full[group]).arrive();
        } else if (dq_live) {
          wgmma_wait<0>();
          fence_registers(dq[0]);
          if constexpr (kDqBlocks == 2) {
            float dq_next[1][8][4];
            issue_query_gradient<Traits, T>(dq_next, ds_address, k_address, dq_block0 + 1);
            add_dq<Traits::kDqByRows>(p, task, dq, m0, visit.h, group, dq_block0 * 64, warp, lane);
            wgmma_wait<0>();
            fence_registers(dq_next[0]);
            add_dq<Traits::kDqByRows>(p, task, dq_next, m0, visit.h, group, dq_block0 * 64 + 64, warp, lane);
          } else {
            static_assert(kDqBlocks == 1, "one or two 64-column blocks of dQ a warpgroup");
            add_dq<Traits::kDqByRows>(p, task, dq, m0, visit.h, group, dq_block0 * 64, warp, lane);
          }
        }
        // Every path has waited for its products by now; said here, where the paths join, ptxas
        // need not inject the wait itself (C7517, a no-op DEPBAR a visit either way).
        wgmma_wait<0>();
      };
      with_group_constant(split_gradients);
      continue;
    } else if constexpr (Traits::kDeferDq) {
      // This visit's dS^T, signalled to the other warpgroup; dV and dK (this warpgroup's rows of
      // dS^T), waited for; the stage released; then the last visit's dQ.
      if (group_live)
        store_transposed_ds<Traits>(ds, dpt, warp_key0, lane);
      else
        store_zero_ds<Traits>(ds, warp_key0, lane);
      fence_proxy_async();
      named_barrier_sync(2 + group, 128);  // the warpgroup's dS^T rows are in (its dK reads them)
      if (ctid % 128 == 0) Mbarrier(&bars.ds_full[group][it % 4]).arrive();
      accumulate_gradients<Traits, T>(dk, dv, dq, st, q_address, do_address, ds_address, k_address, group,
                                      group_live, false);
      Mbarrier(&bars.empty[stage]).arrive();  // every lane (kReleaseCount)
      if (dq_here && it > 0) deferred_dq(it - 1);
      continue;
    } else if constexpr (Traits::kDqTransposed) {
      // 80-row visits: dS^T stored query-major (stmatrix), then after the barrier dK (dS^T from
      // the tile) and dV (P^T from registers) in flight together, then dQ^T. (dV issued first,
      // beside dK or across the barrier, and all three in flight made ptxas serialise the
      // products, C7512; dK first does not.)
      if (group_live) {
        uint32_t dst[kBM / 16][1][4];
        accumulator_to_a<T>(dst, dpt);
        store_query_major_ds<Traits>(ds_address, dst, warp_key0, lane);
      } else {
        store_zero_query_major_ds<Traits>(ds_address, warp_key0, lane);
      }
      fence_proxy_async();
      consumers_sync();  // both warpgroups' dS^T are in
      if (group_live) {
        issue_key_gradient_from_query_major<Traits, T>(dk, ds_address, q_address, group);
        uint32_t pt[kBM / 16][1][4];
        accumulator_to_a<T>(pt, st);
        issue_value_gradient<Traits, T>(dv, pt, do_address);
        wgmma_wait<0>();
        fence_registers(dv[0]);
        fence_registers(dk[0]);
      }
      if (dq_here) issue_transposed_query_gradient<Traits, T>(dq, ds_address, k_address, group);
      wgmma_wait<0>();
      fence_registers(dq[0]);
      fence_registers(dv[0]);
      fence_registers(dk[0]);
    } else if constexpr (Traits::kDkFromRegisters) {
      // dV and dK from registers (128-row visits) are issued before the barrier: they run while
      // this warpgroup waits for the other's dS^T.
      uint32_t pt[kBM / 16][1][4], dst[kBM / 16][1][4];
      if (group_live) {
        accumulator_to_a<T>(dst, dpt);
        accumulator_to_a<T>(pt, st);
        store_transposed_ds_fragments<Traits>(ds, dst, warp_key0, lane);
      } else {
        store_zero_ds<Traits>(ds, warp_key0, lane);
      }
      fence_proxy_async();
      if (group_live) issue_key_gradients<Traits, T>(dk, dv, pt, dst, q_address, do_address);
      consumers_sync();  // both warpgroups' dS^T are in
      // The registers do not hold dV and dK in flight beside dQ (ptxas would serialise the
      // products, C7512): they have had the barrier's wait to run.
      wgmma_wait<0>();
      if (dq_here) {
        issue_query_gradient<Traits, T>(dq, ds_address, k_address, group);
        wgmma_wait<0>();
        fence_registers(dq[0]);
      }
      fence_registers(dv[0]);
      fence_registers(dk[0]);
    } else {
      if (group_live)
        store_transposed_ds<Traits>(ds, dpt, warp_key0, lane);
      else
        store_zero_ds<Traits>(ds, warp_key0, lane);
      fence_proxy_async();
      consumers_sync();  // both warpgroups' dS^T are in
      accumulate_gradients<Traits, T>(dk, dv, dq, st, q_address, do_address, ds_address, k_address, group,
                                      group_live, dq_here);
    }
    // Every lane releases its own reads of the stage (lse, delta; kReleaseCount).
    Mbarrier(&bars.empty[stage]).arrive();
    if constexpr (Traits::kTiledDq) {
      if (dq_here) hand_off_dq_part(dq, it);  // this warpgroup's part (Traits::kTiledDq)
    } else if constexpr (Traits::kBulkDq) {
      static_assert(kDqTiles == 8, "64 columns of dQ a warpgroup");
      if (dq_here) {  // the tile, once the writer has read the last visit's
        Mbarrier(&bars.dq_empty[0]).wait((it & 1) ^ 1);
        const int row = warp % 4 * 16 + lane / 4, col = group * 64 + (lane % 4) * 2;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int half = 0; half < 2; ++half)
            *reinterpret_cast<float2*>(smem.dq + (row + 8 * half) * Traits::kDqRowStride + col + nt * 8) =
                make_float2(dq[0][nt][2 * half], dq[0][nt][2 * half + 1]);
        fence_proxy_async();  // the bulk reductions read through the async proxy
        __syncwarp();
        if (lane == 0) Mbarrier(&bars.dq_full[0]).arrive();
      }
    } else if (dq_here) {
      add_dq<Traits::kDqByRows>(p, task, dq, m0, visit.h, group, Traits::kDqByRows ? 0 : group * 64, warp, lane);
    }
  }

  if (!kDeterministic && iterations > 0) deferred_dq(iterations - 1);
  // dS^T left the softmax scale out (transposed_score_gradients): dK takes it here.
#pragma unroll
  for (int nt = 0; nt < Traits::kDkTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[0][nt][e] *= p.scale;
  // A part of the group's heads (not with the experimental 80-row visits: their registers
  // spilled 476 B with it; nor with a value head dim of its own: gpu/launch.h kv_head_splits):
  // added, converted by a last kernel.
  const ValueRows values = key_block_value_rows<Traits::kOwnValueHeadDim>(p, task);
  if (!Traits::kDqTransposed && !Traits::kOwnValueHeadDim && p.kv_head_splits > 1) {
    if constexpr (!Traits::kOwnValueHeadDim)
      add_dk_dv<Traits>(p, task, dk, dv, warp_key0, dk_col0, lane);  // (columns past the head dim skipped)
  } else if constexpr (Traits::kSplitUneven) {
    with_group_constant([&](auto group_constant) {  // the warpgroup's columns only
      constexpr int kG = decltype(group_constant)::value;
      store_dk_dv<Traits, kConsumerThreads, Traits::split_dk_columns(kG), Traits::split_dv_columns(kG)>(
          p, task, dk, dv, smem.k, smem.v, values, warp_key0, dk_col0, dv_col0, lane, ctid, consumers_sync);
    });
  } else {
    store_dk_dv<Traits, kConsumerThreads, 8 * Traits::kDkTiles, 8 * Traits::kDvTiles>(
        p, task, dk, dv, smem.k, smem.v, values, warp_key0, dk_col0, dv_col0, lane, ctid, consumers_sync);
  }
#endif  // JF_SM90A
}

}  // namespace jax_flash::cuda
