// FlashAttention-2 backward for sm_80 and newer, by recomputation. Three kernels:
//   flash_bwd_prepare_kernel: delta = rowsum(dO * O) per query row; zero the fp32 dQ accumulator;
//   flash_bwd_kernel: one CTA per (key block, batch, kv head); K and V stay in shared memory
//     while the query blocks of every query head of the group that see the keys stream past
//     (Q and dO double-buffered). Per query block: S = Q K^T and dP = dO V^T in registers,
//     P = exp2(S log2e scale - lse log2e), dS = scale P (dP - delta); P and dS go through shared
//     memory to feed dV += P^T dO, dK += dS^T Q (accumulated in registers over the whole loop:
//     the GQA reduction happens here) and dQ += dS K (added to the fp32 accumulator atomically);
//   flash_bwd_convert_dq_kernel: dQ = accumulator in the input dtype.
// Deterministic mode replaces the atomics and the convert pass by flash_bwd_dq_kernel: one CTA
// per query block, recomputing S, dP and dS for every key block its rows see and accumulating
// dQ in registers (three more products, no atomics, the same result run after run).
#pragma once

#include "flash_fwd_sm80.cuh"

namespace jax_flash::cuda {

// Threads per query row in the prepare kernel: one per 8 elements of the head dim, rounded up to
// a power of two (so a row's threads are an aligned group of a warp), at most a warp.
__host__ __device__ constexpr int prepare_threads_per_row(int64_t head_dim) {
  int threads = 1;
  while (threads < 32 && threads * 8 < head_dim) threads *= 2;
  return threads;
}

// delta = dO . O per (batch, query row, head), and the row's dQ accumulator zeroed (when there
// is one). kThreadsPerRow threads a row (prepare_threads_per_row), each 16 bytes of O and dO at
// a time: at head dim 64 a warp takes 4 rows, so every lane loads.
template <typename T, int kThreadsPerRow>
__global__ void flash_bwd_prepare_kernel(const __grid_constant__ BwdParams p) {
  const AttentionShape& sh = p.shape;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kThreadsPerRow;
  const int lane_in_row = threadIdx.x % kThreadsPerRow;
  const bool live = row < sh.batch * sh.seq_q * sh.heads_q;  // no early return: the shuffles need every lane
  const T* o = static_cast<const T*>(p.o) + row * sh.head_dim;
  const T* d_o = static_cast<const T*>(p.d_o) + row * sh.head_dim;
  float* dq = p.deterministic ? nullptr : p.dq_accum + row * sh.head_dim;
  float sum = 0.f;
  for (int c = lane_in_row * 8; live && c < sh.head_dim; c += kThreadsPerRow * 8) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += static_cast<float>(oe[e]) * static_cast<float>(de[e]);
    if (dq != nullptr) {
      *reinterpret_cast<float4*>(dq + c) = make_float4(0.f, 0.f, 0.f, 0.f);
      *reinterpret_cast<float4*>(dq + c + 4) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#pragma unroll
  for (int offset = kThreadsPerRow / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (live && lane_in_row == 0) {
    const int64_t h = row % sh.heads_q, t = row / sh.heads_q % sh.seq_q, b = row / (sh.heads_q * sh.seq_q);
    p.delta[(b * sh.heads_q + h) * sh.seq_q + t] = sum;
  }
}

// dQ = the float32 accumulator in the input dtype, 8 elements (two 16-byte loads, one store) a
// thread per step; the head dim is a multiple of 8, so the element count is too.
template <typename T>
__global__ void flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
  const AttentionShape& sh = p.shape;
  const int64_t groups = sh.batch * sh.seq_q * sh.heads_q * sh.head_dim / 8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < groups;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 lo = reinterpret_cast<const float4*>(p.dq_accum)[2 * i];
    const float4 hi = reinterpret_cast<const float4*>(p.dq_accum)[2 * i + 1];
    const uint4 packed = make_uint4(MmaOp<T>::pack(lo.x, lo.y), MmaOp<T>::pack(lo.z, lo.w), MmaOp<T>::pack(hi.x, hi.y),
                                    MmaOp<T>::pack(hi.z, hi.w));
    reinterpret_cast<uint4*>(p.dq)[i] = packed;
  }
}

// Stores a warp's accumulator (rows from row0, columns from col0, a multiple of 8 * kNTiles)
// into a 16-bit shared tile, addressed like the warp GEMMs' operands: one lane address, moves of
// 8 rows and 1 chunk.
template <typename Tile, int kMTiles, int kNTiles, typename T>
__device__ __forceinline__ void store_accumulator(T* tile, const float (&x)[kMTiles][kNTiles][4],
                                                  int row0, int col0, int lane) {
  const SmemOperand<Tile, kPowerOfTwo<kNTiles>> op(tile, row0 + lane / 4, col0 / 8);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        st_shared_b32(op.at(mt * 16 + half * 8, nt) + (lane % 4) * 4,
                      MmaOp<T>::pack(x[mt][nt][2 * half], x[mt][nt][2 * half + 1]));
}

// Writes a warp's dK or dV accumulator (key rows from row0, columns from col0) to global memory.
template <int kMTiles, int kNTiles, typename T>
__device__ __forceinline__ void store_rows(T* out, int64_t row_stride, const float (&x)[kMTiles][kNTiles][4],
                                           int row0, int col0, int rows, int64_t cols, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + mt * 16 + half * 8 + lane / 4, col = col0 + nt * 8 + (lane % 4) * 2;
        if (row < rows && col < cols)
          *reinterpret_cast<uint32_t*>(out + row * row_stride + col) =
              MmaOp<T>::pack(x[mt][nt][2 * half], x[mt][nt][2 * half + 1]);
      }
}

// The log2-scaled lse and the delta of this thread's rows, the warp's rows starting at m0. Rows
// that attend to nothing (past q_len, or lse = kEmptyRowLse) get lse +inf: every P of theirs is
// exp2(-inf) = 0, masked or not.
template <int kMTiles>
__device__ __forceinline__ void load_row_statistics(float (&lse2)[kMTiles][2], float (&row_delta)[kMTiles][2],
                                                    const float* lse, const float* delta, int64_t m0,
                                                    int64_t q_len, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = m0 + mt * 16 + half * 8 + lane / 4;
      const float row_lse = row < q_len ? lse[row] : kEmptyRowLse;
      lse2[mt][half] = row_lse == kEmptyRowLse ? INFINITY : row_lse * kLog2e;
      row_delta[mt][half] = row < q_len ? delta[row] : 0.f;
    }
}

// The P and dS of one tile of scores (fragments s, dp for this thread's rows; masked scores are
// -inf): P = exp2(S scale log2e - lse log2e), dS = scale P (dP - delta).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void probabilities_and_ds(float (&s)[kMTiles][kNTiles][4], float (&dp)[kMTiles][kNTiles][4],
                                                     const float (&lse2)[kMTiles][2], const float (&delta)[kMTiles][2],
                                                     float scale, float scale_log2) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float prob = fast_exp2(s[mt][nt][e] * scale_log2 - lse2[mt][e / 2]);
        s[mt][nt][e] = prob;
        dp[mt][nt][e] = scale * prob * (dp[mt][nt][e] - delta[mt][e / 2]);
      }
}

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kThreads)
    flash_bwd_kernel(const __grid_constant__ BwdParams p) {
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

  const AttentionShape& sh = p.shape;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int group = static_cast<int>(sh.heads_q / sh.heads_k);
  const int64_t q_len = clamp_len(p.q_lens, b, sh.seq_q);
  const int64_t kv_len = clamp_len(p.kv_lens, b, sh.seq_k);
  const int64_t q_stride = sh.heads_q * sh.head_dim, kv_stride = sh.heads_k * sh.head_dim;
  const int chunks = static_cast<int>(sh.head_dim / 8);
  const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
  const int keys = static_cast<int>(min64(kBN, sh.seq_k - n0));
  const int live_keys = static_cast<int>(max64(0, min64(keys, kv_len - n0)));

  const QueryRange seeing = queries_seeing_keys(p.mask, n0, n0 + live_keys, q_len, kv_len);
  const int64_t m_begin = seeing.begin, m_end = seeing.end;
  const int mb_first = static_cast<int>(m_begin / kBM);
  const int mb_count = m_end > m_begin ? static_cast<int>((m_end - 1) / kBM) - mb_first + 1 : 0;
  const int iterations = mb_count * group;

  const T* q_base = static_cast<const T*>(p.q) + b * sh.seq_q * q_stride;
  const T* do_base = static_cast<const T*>(p.d_o) + b * sh.seq_q * q_stride;
  // Iteration it visits query block mb_first + it % mb_count of query head hk * group +
  // it / mb_count; kept as two counters (no division in the loop).
  struct Visit {
    int h, mb;
  };
  auto next_visit = [&](Visit v) {
    return v.mb + 1 < mb_first + mb_count ? Visit{v.h, v.mb + 1} : Visit{v.h + 1, mb_first};
  };
  auto load_q_do = [&](Visit v, int stage) {
    const int h = v.h;
    const int64_t m0 = static_cast<int64_t>(v.mb) * kBM;
    const int rows = static_cast<int>(max64(0, min64(kBM, q_len - m0)));
    load_tile<QTile, kThreads>(s_q + stage * QTile::kElements, q_base + m0 * q_stride + h * sh.head_dim,
                               q_stride, rows, chunks, tid);
    load_tile<QTile, kThreads>(s_do + stage * QTile::kElements, do_base + m0 * q_stride + h * sh.head_dim,
                               q_stride, rows, chunks, tid);
  };

  float dk[Kv::kMTiles][Kv::kNTiles][4] = {};
  float dv[Kv::kMTiles][Kv::kNTiles][4] = {};
  const int sdp_m0 = Sdp::row0(warp), sdp_n0 = Sdp::col0(warp);
  const float scale_log2 = p.scale * kLog2e;

  if (iterations > 0) {
    const T* k = static_cast<const T*>(p.k) + (b * sh.seq_k + n0) * kv_stride + hk * sh.head_dim;
    const T* v = static_cast<const T*>(p.v) + (b * sh.seq_k + n0) * kv_stride + hk * sh.head_dim;
    load_tile<KVTile, kThreads>(s_k, k, kv_stride, live_keys, chunks, tid);
    load_tile<KVTile, kThreads>(s_v, v, kv_stride, live_keys, chunks, tid);
    load_q_do(Visit{hk * group, mb_first}, 0);
    cp_async_commit();
  }
  Visit visit{hk * group, mb_first};
  for (int it = 0, stage = 0; it < iterations; ++it, stage ^= 1, visit = next_visit(visit)) {
    // This iteration's Q and dO (the one group in flight) have landed, and every warp is done
    // with the previous iteration's P, dS and stage: prefetch the next Q and dO into that stage.
    cp_async_wait<0>();
    __syncthreads();
    if (it + 1 < iterations) {
      load_q_do(next_visit(visit), stage ^ 1);
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
    float lse2[Sdp::kMTiles][2], row_delta[Sdp::kMTiles][2];
    load_row_statistics(lse2, row_delta, lse, delta, m0 + sdp_m0, q_len, lane);
    const KeyRange first = key_range(p.mask, m0, q_len, kv_len);
    const KeyRange last = key_range(p.mask, min64(m0 + kBM, q_len) - 1, q_len, kv_len);
    if (m0 + kBM > q_len || n0 < last.begin || n0 + kBN > first.end)
      mask_scores(s, p.mask, m0 + sdp_m0, n0 + sdp_n0, q_len, kv_len, lane);
    probabilities_and_ds(s, dp, lse2, row_delta, p.scale, scale_log2);
    store_accumulator<PTile>(s_p, s, sdp_m0, sdp_n0, lane);
    store_accumulator<PTile>(s_ds, dp, sdp_m0, sdp_n0, lane);
    __syncthreads();

    // dV += P^T dO and dK += dS^T Q: A = the [query][key] tiles read transposed.
    warp_gemm<PTile, true, QTile, true, kBM / 16>(dv, s_p, Kv::row0(warp), tile_do, Kv::col0(warp), lane);
    warp_gemm<PTile, true, QTile, true, kBM / 16>(dk, s_ds, Kv::row0(warp), tile_q, Kv::col0(warp), lane);

    // dQ += dS K, added to the float32 accumulator (kDqChunk columns at a time); the
    // deterministic mode computes dQ in flash_bwd_dq_kernel instead.
    if (!p.deterministic) {
      // This thread's first dQ element of the block; rows past q_len and padded columns
      // (head dims the kernel rounds up) are skipped.
      const int lane_row = Dq::row0(warp) + lane / 4, lane_col = Dq::col0(warp) + (lane % 4) * 2;
      float* dq_block = p.dq_accum + (b * sh.seq_q + m0 + lane_row) * q_stride + h * sh.head_dim + lane_col;
      const int live_rows = static_cast<int>(min64(kBM, q_len - m0)) - lane_row;
      const int live_cols = static_cast<int>(sh.head_dim) - lane_col;
#pragma unroll
      for (int c0 = 0; c0 < Dq::kCols; c0 += kDqChunk) {
        float dq[Dq::kMTiles][kDqChunk / 8][4] = {};
        warp_gemm<PTile, false, KVTile, true, kBN / 16>(dq, s_ds, Dq::row0(warp), s_k, Dq::col0(warp) + c0, lane);
#pragma unroll
        for (int mt = 0; mt < Dq::kMTiles; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = mt * 16 + half * 8;
            if (r >= live_rows) continue;
#pragma unroll
            for (int nt = 0; nt < kDqChunk / 8; ++nt) {
              const int c = c0 + nt * 8;
              if (c < live_cols)
                atomic_add_pair(dq_block + r * q_stride + c, dq[mt][nt][2 * half], dq[mt][nt][2 * half + 1]);
            }
          }
      }
    }
  }

  // dK and dV rows of this block (zeros where no query sees the key).
  T* dk_out = static_cast<T*>(p.dk) + (b * sh.seq_k + n0) * kv_stride + hk * sh.head_dim;
  T* dv_out = static_cast<T*>(p.dv) + (b * sh.seq_k + n0) * kv_stride + hk * sh.head_dim;
  store_rows(dk_out, kv_stride, dk, Kv::row0(warp), Kv::col0(warp), keys, sh.head_dim, lane);
  store_rows(dv_out, kv_stride, dv, Kv::row0(warp), Kv::col0(warp), keys, sh.head_dim, lane);
}

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kThreads)
    flash_bwd_dq_kernel(const __grid_constant__ BwdParams p) {
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
  const QueryBlockTask<kBM, kBN> task(p);
  const QueryBlock<kBM, kBN>& blk = task.blk;
  const int64_t m0 = blk.m0, q_len = task.q_len, kv_len = task.kv_len;
  const int warp_m0 = warp * kMT * 16;

  float lse2[kMT][2], row_delta[kMT][2];
  load_row_statistics(lse2, row_delta, p.lse + task.stat_offset, p.delta + task.stat_offset, m0 + warp_m0, q_len,
                      lane);
  float dq[kMT][kD / 8][4] = {};
  const float scale_log2 = p.scale * kLog2e;

  const int n_first = blk.n_first, n_last = blk.n_last;
  if (n_last >= n_first) {
    auto load_kv = [&](int n_block, int stage) {
      task.template load_keys<KVTile, kThreads>(s_k + stage * KVTile::kElements, static_cast<const T*>(p.k),
                                                n_block, tid);
      task.template load_keys<KVTile, kThreads>(s_v + stage * KVTile::kElements, static_cast<const T*>(p.v),
                                                n_block, tid);
    };
    task.template load_queries<QTile, kThreads>(s_q, static_cast<const T*>(p.q), tid);
    task.template load_queries<QTile, kThreads>(s_do, static_cast<const T*>(p.d_o), tid);
    load_kv(n_first, 0);
    cp_async_commit();

    for (int n_block = n_first, stage = 0; n_block <= n_last; ++n_block, stage ^= 1) {
      // This block's K and V have landed and every warp is done with the other stage.
      cp_async_wait<0>();
      __syncthreads();
      if (n_block < n_last) {
        load_kv(n_block + 1, stage ^ 1);
        cp_async_commit();
      }
      const T* tile_k = s_k + stage * KVTile::kElements;
      const T* tile_v = s_v + stage * KVTile::kElements;
      float s[kMT][kBN / 8][4] = {};
      float dp[kMT][kBN / 8][4] = {};
      warp_gemm<QTile, false, KVTile, false, kD / 16>(s, s_q, warp_m0, tile_k, 0, lane);
      warp_gemm<QTile, false, KVTile, false, kD / 16>(dp, s_do, warp_m0, tile_v, 0, lane);
      const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
      if (blk.needs_mask(n0)) mask_scores(s, p.mask, m0 + warp_m0, n0, q_len, kv_len, lane);
      probabilities_and_ds(s, dp, lse2, row_delta, p.scale, scale_log2);
      uint32_t ds[kBN / 16][kMT][4];
      accumulator_to_a<T>(ds, dp);
      warp_gemm_a_regs<KVTile, true>(dq, ds, tile_k, 0, lane);
    }
  }

  store_rows(static_cast<T*>(p.dq) + task.q_offset, task.q_stride, dq, warp_m0, 0, blk.rows, p.shape.head_dim, lane);
}

}  // namespace jax_flash::cuda
