// FlashAttention forward for Hopper (sm_90a), warp-specialised (FlashAttention-3's design):
//
//   warpgroup 0, the producer: gives most of its registers back (setmaxnreg) and one thread
//     issues TMA loads: a tile's Q, then its K and V blocks (last block first) into a ring of
//     kStages stages, each buffer guarded by a "full" mbarrier (completed by the copy's bytes)
//     and an "empty" one (completed when every consumer warp has released it);
//   warpgroups 1.., the consumers: 64 query rows each, take the registers; per key block
//     S = Q K^T (wgmma SS), masks and the online softmax in registers (gpu/softmax.cuh), then
//     O += P V with P from registers (wgmma RS); V and O have the value head dim (Hv, which
//     differs from Q's and K's H in the kernels of gpu/tile_shapes.cuh ValueHeadDimShapes). Within a warpgroup the next block's S is issued
//     with this block's P V, and the softmax of the next block runs while P V is on the tensor
//     cores; with kPingPong the two consumer warpgroups also take turns to issue their products
//     (named barriers), so that one's softmax runs under the other's GEMMs.
//
// The epilogue (normalisation, lse, empty rows) is gpu/epilogue.cuh's, from registers. The CTA
// computes the tiles sm90/tile_scheduler.cuh gives it: the producer warp decides each next tile
// and hands it to the consumers through shared memory (a slot and a full/empty mbarrier pair);
// with a persistent grid it loads the next tile while the consumers finish the last.
#pragma once

#include <cuda.h>

#include "common/attention_params.h"
#include "gpu/block_geometry.cuh"
#include "gpu/dropout_fragments.h"
#include "gpu/epilogue.cuh"
#include "gpu/fragments.cuh"
#include "gpu/logit_arrays.cuh"
#include "gpu/mask.cuh"
#include "gpu/score_mods.cuh"
#include "gpu/segment_ids.cuh"
#include "gpu/softmax.cuh"
#include "gpu/tile_io.cuh"
#include "sm90/barrier.cuh"
#include "sm90/fwd_gemms.cuh"
#include "sm90/fwd_timeline.cuh"
#include "sm90/tile_scheduler.cuh"
#include "sm90/tma.cuh"
#include "sm90/traits.cuh"
#include "sm90/wgmma.cuh"

namespace jax_flash::cuda {

// The forward's parameters with the TMA descriptors of q, k and v (sm90/tensor_map.h), and of o
// in boxes of 64 rows where the kernel stores O by TMA (kTmaStore).
struct FwdTmaParams {
  FwdParams p;
  CUtensorMap q, k, v, o;
  QueryTileGrid grid;  // how the grid's CTAs take tiles (sm90/tile_scheduler.cuh)
  // kLogitArrays: the bias's tiles go through shared memory (gpu/logit_arrays.cuh bias_stages;
  // the launch then allocates Traits::kSmemBytesBiasStages), by TMA with bias_tma (its
  // descriptor `bias`, sm90/tensor_map.h make_bias_tensor_map; JAX_FLASH_CUDA_BIAS_LOADS=tma),
  // else by the producer warp's copies.
  bool bias_staged = false;
  bool bias_tma = false;
  CUtensorMap bias;
  // The plain kernels' tiles start this many rows before row 0 (a multiple of 64: flash_fwd_ws.cu),
  // so that the last ends at the sequence's end and the first holds the padding (QueryBlock's
  // row_shift; 0: from row 0).
  int query_row_shift = 0;
  // The plain kernels' consumer warpgroups skip the key blocks none of their own rows sees
  // (unless JAX_FLASH_CUDA_FWD_UNSEEN=compute).
  bool skip_unseen_blocks = false;
};

// Shared memory of a warp-specialised forward CTA, from a 1 KiB boundary: Q, kStages stages of
// K, kStages of V, the ones tile (kTensorSums), the O tile (kTmaStore: an OTile; the launch then
// allocates Traits::kSmemBytesTmaStore) or in its place kStages bias tiles
// (FwdTmaParams::bias_staged; their barriers are FwdWsBarriers').
template <typename Traits, typename T>
struct Sm90FwdWsSmem {
  T* q;
  T* k;
  T* v;
  T* ones;
  T* o;
  T* bias;
  __device__ explicit Sm90FwdWsSmem(unsigned char* raw) {
    q = first_tile_boundary<T>(raw);
    k = q + Traits::QTile::kElements;
    v = k + Traits::kStages * Traits::KTile::kElements;
    ones = v + Traits::kStages * Traits::VTile::kElements;
    o = ones + Traits::kOnesElements;  // (1 KiB of ones: o stays on a 1 KiB boundary)
    bias = o;
  }
  __device__ T* k_stage(int stage) const { return k + stage * Traits::KTile::kElements; }
  __device__ T* v_stage(int stage) const { return v + stage * Traits::VTile::kElements; }
  __device__ T* bias_stage(int stage) const { return bias + stage * Traits::BiasTile::kElements; }
};

// The barriers: the tile slot's (the producer's hand-off of each next tile), Q's buffer's, then the
// full and empty barriers of each K and V stage and of each bias tile (FwdTmaParams::bias_staged);
// and the slot itself. (Static shared memory: with the dynamic part's 1 KiB alignment it takes
// 1 KiB whatever its size, Traits::kStaticSmemBytes.)
template <int kStages>
struct FwdWsBarriers {
  uint64_t tile_full, tile_empty, q_full, q_empty, k_full[kStages], k_empty[kStages], v_full[kStages],
      v_empty[kStages], bias_full[kStages], bias_empty[kStages];
  int tile;  // the next tile, or scheduler.total and past for none
};

// kGeneral: the call has a soft cap or ALiBi slopes (gpu/score_mods.cuh), applied to every
// block's scores before its masks, or segment ids (gpu/segment_ids.cuh: they narrow each tile's
// key blocks, for the producer and the consumers alike) or a block mask.
// kIds (general kernels only): the ids' and the block walk's code is compiled in (general_ids:
// calls with segment ids or a block mask); without it a general kernel has only the score
// modifications beside the plain kernel's masks.
// kBlockWalk: the plain kernel walking a block mask's live key blocks (gpu/block_sparse.cuh), for
// block-sparse calls that need nothing else of the general kernels (plain_block_walk_suffices: no
// score modification, ids or window).
// kTensorSums (the default for differentiated calls on the 128 x 128 tiles at head dims 64 and
// 128, plain or with a soft cap or ALiBi alone; JAX_FLASH_CUDA_FORWARD=sm90ws_alusums turns it
// off): the sums of the 16-bit P that O is normalised by come from the tensor cores, P times a
// column of ones beside each P V (sm90/fwd_gemms.cuh issue_output), instead of the softmax's
// unpacking and adding of every P (OnlineSoftmax::add_rounded_sums: about a quarter of the
// consumers' instructions a block). The same float32 sums of the same 16-bit values, in another
// order.
// kTmaStore (inference calls at head dims 64, 96 and 128, plain or with a soft cap or ALiBi alone,
// unless JAX_FLASH_CUDA_FORWARD=sm90ws_directstore; +1-7% on the plain forward, session 21):
// each consumer warpgroup writes its normalised O rows to the O tile in shared memory and one of
// its threads stores them by TMA (FlashAttention-3's epilogue), instead of every thread storing
// 4-byte pairs to global memory; the warpgroup goes on to its next tile while the copy runs.
// kDropout (general kernels without ids, tensor sums or the TMA store): fused dropout
// (gpu/dropout_fragments.h), an instantiation of its own so that the other general kernels keep
// their registers.
// kLogitArrays (general kernels without dropout, tensor sums or the TMA store): jax.nn's bias and
// mask arrays (gpu/logit_arrays.cuh), likewise of its own; experimental. With kIds every array
// path (a mask array, the bias staged or read directly); without it a staged bias alone
// (gpu/logit_arrays.cuh staged_bias_alone: the launch stages it and passes no mask array, ids or
// block mask), the general kernel's registers without the ids' code and the direct loads (ptxas
// at head dim 128: no spill, where the whole one spills 568 B; 5% faster, session 35).
template <typename Traits, typename T, bool kGeneral, bool kBlockWalk = false, bool kTensorSums = false,
          bool kIds = kGeneral, bool kTmaStore = false, bool kDropout = false, bool kLogitArrays = false>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_sm90_ws_kernel(const __grid_constant__ FwdTmaParams params) {
  static_assert(!kDropout || (kGeneral && !kIds && !kTensorSums && !kTmaStore && !kBlockWalk),
                "dropout: a general kernel without ids, tensor sums or the TMA store");
  static_assert(!kLogitArrays || (kGeneral && !kDropout && !kTensorSums && !kTmaStore && !kBlockWalk),
                "bias and mask arrays: a general kernel without dropout, tensor sums or the TMA store");
#if JF_SM90A
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kDv = Traits::kValueHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr bool kOwnValueHeadDim = Traits::kValueHeadDim != Traits::kHeadDim;
  using QTile = typename Traits::QTile;
  using KTile = typename Traits::KTile;
  using VTile = typename Traits::VTile;
  const FwdParams& p = params.p;
  constexpr bool kStagedBiasAlone = kLogitArrays && !kIds;
  const bool bias_staged = kStagedBiasAlone || (kLogitArrays && params.bias_staged);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ FwdWsBarriers<kStages> bars;
  const Sm90FwdWsSmem<Traits, T> smem(smem_raw);

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    Mbarrier(&bars.tile_full).init(1);
    Mbarrier(&bars.tile_empty).init(128 * Traits::kConsumers);  // every consumer thread reads the slot
    Mbarrier(&bars.q_full).init(1);
    Mbarrier(&bars.q_empty).init(Traits::kConsumerWarps);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      Mbarrier(&bars.k_full[s]).init(1);
      Mbarrier(&bars.v_full[s]).init(1);
      Mbarrier(&bars.k_empty[s]).init(Traits::kConsumerWarps);
      Mbarrier(&bars.v_empty[s]).init(Traits::kConsumerWarps);
      if (bias_staged) {
        // The TMA's expected bytes (one arrival), or the producer warp's lanes once their copies are in.
        Mbarrier(&bars.bias_full[s]).init(params.bias_tma ? 1 : 32);
        Mbarrier(&bars.bias_empty[s]).init(Traits::kConsumerWarps);
      }
    }
    Mbarrier::fence_init();
  }
  if constexpr (kTensorSums) {
    for (int i = threadIdx.x; i < Traits::kOnesElements / 2; i += Traits::kThreads)
      reinterpret_cast<uint32_t*>(smem.ones)[i] = MmaOp<T>::pack(1.f, 1.f);
    fence_proxy_async();  // wgmma reads the tile through the async proxy
  }
  __syncthreads();

  const QueryTileScheduler<kBM> scheduler(p.shape, params.grid, p.tile_counter);
  const int row_shift = kGeneral || kBlockWalk ? 0 : params.query_row_shift;
  const bool skip_unseen = Traits::kSkipsUnseenBlocks && !kGeneral && !kBlockWalk && params.skip_unseen_blocks;
  // Both roles walk the tiles the producer hands over; key blocks run through the stage ring in one
  // sequence over all of them (block `ring` of the sequence uses stage ring % kStages, in its
  // (ring / kStages)-th round), and Q's buffer is filled once per tile with keys.
  auto task_of = [&](int t) {
    const auto tile = scheduler.tile(t);
    QueryBlockTask<kBM, kBN> task(p, tile.m_block, tile.head, tile.batch, row_shift);
    if constexpr (kIds) narrow_query_block(task.blk, SegmentIds(p, task.b), lane);  // warp-collective
    if constexpr (kIds || kBlockWalk) task.walk_keys(p);  // a block mask's live key blocks only
    return task;
  };

  if (warp < 4) {
    // ---- Producer warpgroup: warp 0 loads, the others leave.
    release_registers<Traits::kProducerRegisters>();
    if (warp != 0) return;
    if (lane == 0) {
      prefetch_tensor_map(params.q);
      prefetch_tensor_map(params.k);
      prefetch_tensor_map(params.v);
    }
    int ring = 0, q_round = 0;
    for (int t = scheduler.first(), round = 0;; ++round) {
      // Tile t (or the end) to the consumers, once every one of them has read the last.
      if (lane == 0) {
        Mbarrier(&bars.tile_empty).wait((round & 1) ^ 1);
        bars.tile = t;
        Mbarrier(&bars.tile_full).arrive();
      }
      if (t >= scheduler.total) break;
      // The tile after it, asked for now (kDynamic: an atomic, its latency under this tile's loads).
      const int next = lane == 0 ? scheduler.next(t) : 0;
      const QueryBlockTask<kBM, kBN> task = task_of(t);
      const QueryBlock<kBM, kBN>& blk = task.blk;
      const int count = task.keys.count;  // key blocks, visited last first
      auto advance = [&] { t = __shfl_sync(0xffffffffu, next, 0); };
      if (count <= 0) {
        advance();
        continue;
      }
      if (lane == 0) {
        Mbarrier(&bars.q_empty).wait((q_round & 1) ^ 1);
        const Mbarrier q_full(&bars.q_full);
        q_full.arrive_expect_bytes(QTile::kElements * sizeof(T));
        tma_load_tile<QTile>(smem.q, params.q, task.h, blk.m0, task.b, q_full);
      }
      ++q_round;
      for (int i = 0; i < count; ++i, ++ring) {
        const int stage = ring % kStages, phase = (ring / kStages) & 1;
        const int64_t n0 = static_cast<int64_t>(task.keys.descending(i)) * kBN;
        if (lane == 0) {
          Mbarrier(&bars.k_empty[stage]).wait(phase ^ 1);
          const Mbarrier k_full(&bars.k_full[stage]);
          k_full.arrive_expect_bytes(KTile::kElements * sizeof(T));
          tma_load_tile<KTile>(smem.k_stage(stage), params.k, task.hk, n0, task.b, k_full);
        }
        // The block's bias tile, by TMA or by the warp's copies (each lane arrives once its own
        // are in).
        if constexpr (kLogitArrays)
          if (bias_staged) {
            const Mbarrier bias_full(&bars.bias_full[stage]);
            Mbarrier(&bars.bias_empty[stage]).wait(phase ^ 1);
            if (params.bias_tma) {
              if (lane == 0) {
                using Tile = typename Traits::BiasTmaTile;
                const BiasSlice slice = bias_slice(p.bias, task.b, task.h);
                bias_full.arrive_expect_bytes(Tile::kElements * sizeof(T));
                tma_load_tile<Tile>(smem.bias_stage(stage), params.bias, slice.head, blk.m0, slice.batch, bias_full,
                                    n0);
              }
            } else {
              stage_bias_tile<typename Traits::BiasTile>(smem.bias_stage(stage), p, task.b, task.h, blk.m0, n0, lane);
              bias_full.arrive_after_copies();
            }
          }
        // V rows in [kv_len, seq_k) hold the array's data past this batch element's length,
        // which the masks give probability 0 but which P V would still multiply (0 * NaN is
        // NaN): a block holding such rows is copied by the warp with zero fill instead of TMA.
        const Mbarrier v_empty(&bars.v_empty[stage]), v_full(&bars.v_full[stage]);
        if (n0 + kBN <= task.kv_len || task.kv_len == p.shape.seq_k) {
          if (lane == 0) {
            v_empty.wait(phase ^ 1);
            v_full.arrive_expect_bytes(VTile::kElements * sizeof(T));
            tma_load_tile<VTile>(smem.v_stage(stage), params.v, task.hk, n0, task.b, v_full);
          }
        } else {
          v_empty.wait(phase ^ 1);
          const ValueRows values = value_rows<kOwnValueHeadDim>(p, task);
          warp_load_tile<VTile>(smem.v_stage(stage), static_cast<const T*>(p.v) + values.v_offset + n0 * values.v_stride,
                                values.v_stride, static_cast<int>(task.kv_len - n0), values.chunks, lane);
          cp_async_commit();
          cp_async_wait<0>();
          fence_proxy_async();
          __syncwarp();
          if (lane == 0) v_full.arrive();
        }
        // The warp's lanes stay in step: a lane running ahead would wait on an empty barrier
        // two phases early, which its parity cannot tell from the right one.
        __syncwarp();
      }
      advance();
    }
    return;
  }

  // ---- Consumer warpgroups.
  claim_registers<Traits::kConsumerRegisters>();
  // The warpgroup, warp-uniform (the Q descriptor in uniform registers) in the plain kernels; the
  // general kernels spilled up to 344 B with it.
  const int group = consumer_warpgroup<!kGeneral>(warp);
  const int warp_m0 = group * 64 + warp % 4 * 16;  // this warp's first row in the block
  const float softmax_scale = kGeneral ? ScoreMods::softmax_scale(p) : p.scale;
  const float scale_log2 = softmax_scale * kLog2e;
  const float bias_factor = 1.f / softmax_scale;  // (kLogitArrays) the staged bias's, in the scores' units
  const uint32_t q_address = smem_address(smem.q);
  const uint64_t ones_desc = ones_descriptor(smem_address(smem.ones));  // (kTensorSums)
  // One warpgroup syncs on a turn barrier and the one before it in the ring arrives.
  constexpr int kTurnThreads = 256;
  // Ping-pong (a ring of turns with three warpgroups): warpgroup g issues its products after
  // barrier 1 + g completes and then lets the next go (barrier 1 + (g + 1) % kConsumers, its
  // threads and the next one's counting on each barrier).
  auto wait_turn = [&] {
    if constexpr (Traits::kPingPong) named_barrier_sync(1 + group, kTurnThreads);
  };
  auto pass_turn = [&] {
    if constexpr (Traits::kPingPong) named_barrier_arrive(1 + (group + 1) % Traits::kConsumers, kTurnThreads);
  };
  // A consumer warp is done with a buffer: one arrival a warp.
  auto release = [&](uint64_t* bar) {
    if (lane == 0) Mbarrier(bar).arrive();
  };

  // The turns run on across the CTA's tiles (every warpgroup takes count - 1 of a tile's): the
  // last warpgroup's last pass_turn of a tile is warpgroup 0's first turn of the next, as
  // FlashAttention-3's. Restarted at each tile (the last warpgroup's first arrival at a tile's
  // start, warpgroup 0 taking its last pass at the end), a warpgroup done early could arrive for
  // the next tile while its last arrival of this tile was still pending on the same barrier,
  // which then completed on one warpgroup's two arrivals and the other's wait hung: the arrays'
  // kernels in session 35, every forward of more tiles than SMs at T = 70 in session 38
  // (tests/test_cuda.py test_forward_of_more_tiles_than_sms). Restarted at each tile on two sets
  // of barriers that the tiles take in turn, they do not hang but ran no faster (session 49,
  // 91fc4cb; cuda/PERF_NOTES.md v48).
  if constexpr (Traits::kPingPong)
    if (group == Traits::kConsumers - 1) named_barrier_arrive(1, kTurnThreads);
  FwdTimeline stamp(group);  // (a debug build's record of the phases: sm90/fwd_timeline.h)
  int ring = 0, q_round = 0;
  for (int round = 0;; ++round) {
    Mbarrier(&bars.tile_full).wait(round & 1);
    const int t = bars.tile;
    Mbarrier(&bars.tile_empty).arrive();
    stamp(kFwdEventTileReady);
    if (t >= scheduler.total) break;
    const QueryBlockTask<kBM, kBN> task = task_of(t);
    const QueryBlock<kBM, kBN>& blk = task.blk;
    const int count = task.keys.count;
    const int64_t m0 = blk.m0;
    stamp(kFwdEventTile, count);
    OnlineSoftmax<1> softmax(p.pv_headroom_log2);
    float o[1][kDv / 8][4] = {};
    float row_sums[1][1][4] = {};  // kTensorSums: the 16-bit P's row sums (every column the row's)
    SeenRows<1> seen(!(kIds && tracks_seen_rows(p)) && untracked_seen_rows(count));  // rows that met a key
    // With a mask array (kLogitArrays) the rows that met a key every mask lets through are
    // noted apart (the range and id masks' own notes cannot tell which of their keys it hides).
    const bool array_mask = kLogitArrays && kIds && p.logit_mask;
    SeenRows<1> array_seen(false);

    // Fused dropout (kDropout; the handler refuses it beside segment ids or a block mask): the
    // tile's stream; each block's dropped probabilities are zeroed in P V's operand once the row
    // sums have them, and O is scaled by 1 / (1 - rate).
    const bool dropout = kDropout && p.dropout_seeds != nullptr;
    if (count > 0) {
      auto stage_of = [&](int i) { return (ring + i) % kStages; };
      auto phase_of = [&](int i) { return ((ring + i) / kStages) & 1; };
      const ScoreMods mods(p, task.b, task.h);  // unused (and not read) without kGeneral
      const DropoutStream drop_stream = dropout ? dropout_stream(p, task.b, task.h) : DropoutStream();
      auto drop_block = [&](uint32_t (&pa)[kBN / 16][1][4], int i) {
        if constexpr (kDropout)
          if (dropout)
            drop_forward_probabilities<kBN / 8>(pa, drop_stream, m0 + warp_m0 + lane / 4,
                                                static_cast<int64_t>(task.keys.descending(i)) * kBN + 2 * (lane % 4));
      };
      auto mask_block = [&](float (&s)[1][kBN / 8][4], int i) {
        const int64_t n0 = static_cast<int64_t>(task.keys.descending(i)) * kBN;
        if constexpr (kGeneral) mods.apply<!kIds>(s, m0 + warp_m0, n0, lane);
        if constexpr (kIds) {
          mask_forward_block<kBN>(s, p, task.b, m0, m0 + blk.live_rows, blk.needs_mask(n0), m0 + warp_m0, n0,
                                  task.q_len, task.kv_len, lane, &seen);
        } else if (blk.live_rows_need_mask(n0)) {
          mask_scores(s, p.mask, m0 + warp_m0, n0, task.q_len, task.kv_len, lane);
        }
        if constexpr (kLogitArrays) {
          if constexpr (kIds)
            apply_logit_arrays<T>(s, p, task.b, task.h, m0 + warp_m0, n0, task.q_len, task.kv_len, lane, array_seen,
                                  bias_staged);
          if (bias_staged) {
            const int stage = stage_of(i);
            Mbarrier(&bars.bias_full[stage]).wait(phase_of(i));
            if (params.bias_tma)
              add_staged_bias<typename Traits::BiasTmaTile>(s, smem.bias_stage(stage), warp_m0, bias_factor, lane);
            else
              add_staged_bias<typename Traits::BiasTile>(s, smem.bias_stage(stage), warp_m0, bias_factor, lane);
            release(&bars.bias_empty[stage]);
          }
        }
      };
      // This warpgroup's key blocks, [mine, mine_end) of the walk: all of them, or with
      // skip_unseen those its own rows see (the plain walk runs n_last down to n_first). Under
      // a causal mask the upper warpgroups of a 192-row tile see none of its last block or two,
      // and an end-aligned first tile's padding warpgroups none at all. Its turns and its
      // releases of every block's buffers (once full: an early arrival would count towards the
      // stage's previous round) stay as they are; the products and softmax of the others go.
      int mine = 0, mine_end = count;
      if (skip_unseen) {
        const KeyBlockSpan own = key_blocks_seen<kBN>(p.mask, m0 + group * 64, 64, task.q_len, task.kv_len);
        mine = max(0, blk.n_last - own.last);
        mine_end = own.last < own.first ? mine : min(count, blk.n_last - own.first + 1);
      }
      auto pass_over = [&](int i) {
        Mbarrier(&bars.k_full[stage_of(i)]).wait(phase_of(i));
        release(&bars.k_empty[stage_of(i)]);
        Mbarrier(&bars.v_full[stage_of(i)]).wait(phase_of(i));
        release(&bars.v_empty[stage_of(i)]);
      };
      auto idle_turn = [&] {
        wait_turn();
        pass_turn();
      };
      Mbarrier(&bars.q_full).wait(q_round & 1);
      if (mine >= mine_end) {
        release(&bars.q_empty);
        for (int i = 0; i < count; ++i) {
          pass_over(i);
          if (i + 1 < count) idle_turn();
        }
      } else {
        for (int i = 0; i < mine; ++i) {
          pass_over(i);
          idle_turn();
        }
        Mbarrier(&bars.k_full[stage_of(mine)]).wait(phase_of(mine));
        float s[1][kBN / 8][4];
        issue_scores<Traits, T>(s, q_address, group * 64, smem_address(smem.k_stage(stage_of(mine))));
        wgmma_wait<0>();
        fence_registers(s[0]);
        stamp(kFwdEventFirstS);
        release(&bars.k_empty[stage_of(mine)]);
        if (mine + 1 == mine_end) release(&bars.q_empty);
        mask_block(s, mine);
        if (softmax.must_rescale(s, scale_log2)) softmax.rescale(o, scale_log2);  // (row_sums are 0)
        softmax.exponentiate(s, scale_log2);
        uint32_t pa[kBN / 16][1][4];
        accumulator_to_a<T>(pa, s);
        if (!kTensorSums && p.for_backward()) softmax.template add_rounded_sums<T>(pa);  // differentiated calls only
        drop_block(pa, mine);
        stamp(kFwdEventConverted, 0);

        for (int i = mine; i + 1 < mine_end; ++i) {
          const int stage = stage_of(i), next = stage_of(i + 1);
          Mbarrier(&bars.k_full[next]).wait(phase_of(i + 1));
          stamp(kFwdEventKeyFull, i + 1);
          wait_turn();
          stamp(kFwdEventTurn, i + 1);
          // S(i + 1) and then P(i) V(i); waiting for all but the newest group waits for S(i + 1)
          // only, so the softmax of block i + 1 runs while P(i) V(i) is on the tensor cores.
          issue_scores<Traits, T>(s, q_address, group * 64, smem_address(smem.k_stage(next)));
          Mbarrier(&bars.v_full[stage]).wait(phase_of(i));
          issue_output<Traits, T, kTensorSums>(o, pa, smem_address(smem.v_stage(stage)), &row_sums[0], ones_desc);
          pass_turn();
          stamp(kFwdEventIssued, i + 1);
          wgmma_wait<1>();
          fence_registers(s[0]);
          stamp(kFwdEventScores, i + 1);
          release(&bars.k_empty[next]);
          if (i + 2 == mine_end) release(&bars.q_empty);  // this warpgroup's last S is in
          mask_block(s, i + 1);
          stamp(kFwdEventMasked, i + 1);
          const bool moved = softmax.must_rescale(s, scale_log2);
          if (moved) softmax.move_reference(scale_log2);
          stamp(kFwdEventMaxed, i + 1);
          softmax.exponentiate(s, scale_log2);
          stamp(kFwdEventSoftmax, i + 1);
          wgmma_wait<0>();  // P(i) V(i) is in: O and P(i)'s registers and V stage are free
          fence_registers(o[0]);
          stamp(kFwdEventOutput, i + 1);
          release(&bars.v_empty[stage]);
          if (moved) {
            softmax.rescale_output(o);
            if constexpr (kTensorSums) softmax.rescale_output(row_sums);
          }
          accumulator_to_a<T>(pa, s);
          if (!kTensorSums && p.for_backward()) softmax.template add_rounded_sums<T>(pa);  // differentiated calls only
          drop_block(pa, i + 1);
          stamp(kFwdEventConverted, i + 1);
        }
        const int last = stage_of(mine_end - 1);
        Mbarrier(&bars.v_full[last]).wait(phase_of(mine_end - 1));
        issue_output<Traits, T, kTensorSums>(o, pa, smem_address(smem.v_stage(last)), &row_sums[0], ones_desc);
        wgmma_wait<0>();
        fence_registers(o[0]);
        if constexpr (kTensorSums) {
          fence_registers(row_sums[0]);
          // The row's whole sum in one lane of its quad (the epilogue sums the quad's parts).
#pragma unroll
          for (int half = 0; half < 2; ++half)
            softmax.sum_rounded[0][half] = lane % 4 == 0 ? row_sums[0][0][2 * half] : 0.f;
        }
        release(&bars.v_empty[last]);
        for (int i = mine_end; i < count; ++i) {
          idle_turn();
          pass_over(i);
        }
      }
      ring += count;
      ++q_round;
      if (dropout) {
#pragma unroll
        for (int dt = 0; dt < kDv / 8; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[0][dt][e] *= p.dropout_scale;
      }
    }

    stamp(kFwdEventStoreStart);
    if constexpr (kLogitArrays)
      if (array_mask) seen = array_seen;
    const ValueRows values = value_rows<kOwnValueHeadDim>(p, task);
    if constexpr (kTmaStore) {
      // The warpgroup's rows of the O tile: once its last TMA store has read them, written by
      // every thread, then stored by the warpgroup's first thread.
      const bool issuer = warp % 4 == 0 && lane == 0;
      const int o_tile_barrier = 1 + Traits::kConsumers + group;  // (1 .. kConsumers: the turns)
      if (issuer) bulk_wait_read();
      named_barrier_sync(o_tile_barrier, 128);
      stamp(kFwdEventStoreSynced);
      store_output<T, 1, kDv / 8, typename Traits::OTile>(p.o, false, nullptr, false, values.row_offset, values.row_stride,
                                                          p.lse + task.stat_offset + m0, o, softmax, softmax_scale,
                                                          warp_m0, blk.rows, values.head_dim, p.mask, m0, task.q_len,
                                                          task.kv_len, lane, nullptr, smem.o);
      stamp(kFwdEventStoreWritten);
      fence_proxy_async();  // the TMA store reads the tile through the async proxy
      named_barrier_sync(o_tile_barrier, 128);
      if (issuer) {
        if (m0 + group * 64 >= 0)  // (an end-aligned first tile's warpgroups of padding rows store none)
          tma_store_rows<typename Traits::OTile, 64>(params.o, smem.o, group * 64, task.h, m0 + group * 64, task.b);
        bulk_commit();
      }
    } else {
      store_output<T>(p.o, p.o_float32, p.o_error, p.o_vector_stores, values.row_offset, values.row_stride, p.lse + task.stat_offset + m0, o,
                      softmax, softmax_scale, warp_m0, blk.rows, values.head_dim, p.mask, m0, task.q_len,
                      task.kv_len, lane, kIds || kBlockWalk ? &seen : nullptr);
      stamp(kFwdEventStoreWritten);
    }
    stamp(kFwdEventStoreEnd);
  }
  if constexpr (kTmaStore)
    if (warp % 4 == 0 && lane == 0) bulk_wait_all();  // the last stores complete before the CTA exits
#endif  // JF_SM90A
}

}  // namespace jax_flash::cuda
