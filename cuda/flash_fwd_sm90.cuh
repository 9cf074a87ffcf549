// FlashAttention forward for Hopper (sm_90a) on warpgroup MMA (wgmma), head dims 64 and 128.
//
// CTA = 2 warpgroups x 64 query rows of one (batch, query head). Key/value tiles of kBlockN rows
// stream through shared memory in two stages (cp.async, as the sm80 kernel), laid out for wgmma
// (GmmaTile, 128-byte swizzle). Per key block: S = Q K^T (wgmma, both operands in shared
// memory), masks and the online softmax with lazy rescaling in registers (as flash_fwd_sm80.cuh),
// then O += P V with P straight from registers (wgmma RS; V read N-major). No warp
// specialisation or TMA yet: the two warpgroups run the same steps between barriers.
#pragma once

#include <cuda_runtime.h>

#include "attention_params.h"
#include "flash_fwd_sm80.cuh"
#include "wgmma.cuh"

namespace jax_flash::cuda {

// A [kRows][kCols] tile of 16-bit elements as wgmma reads it with the 128-byte swizzle: column
// blocks of 64 elements, each [kRows][64] with 128-byte rows whose 16-byte chunks are XOR-ed
// with the row (mod 8). Tiles start on 1 KiB boundaries.
template <int kRows_, int kCols_>
struct GmmaTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kChunks = kCols / 8;
  static constexpr int kElements = kRows * kCols;
  static constexpr int kBlockBytes = kRows * 128;  // one 64-column block
  static_assert(kCols % 64 == 0 && kRows % 8 == 0, "whole 64-column blocks of 8-row groups");

  // Offset (in elements) of chunk `chunk` (8 elements) of row `row`.
  __device__ __forceinline__ static int offset(int row, int chunk) {
    return (chunk / 8) * kRows * 64 + row * 64 + ((chunk % 8) ^ (row % 8)) * 8;
  }

  // wgmma descriptor of the K-major operand whose M/N rows are rows row0.. of the tile (a multiple
  // of 8) and whose k runs along the columns, at k-step kk (columns 16 kk .. 16 kk + 15).
  __device__ __forceinline__ static uint64_t k_major(uint32_t tile_address, int row0, int kk) {
    return smem_descriptor(tile_address + kk / 4 * kBlockBytes + row0 * 128 + kk % 4 * 32, 16, 1024);
  }
  // wgmma descriptor of the N-major operand whose k runs along the rows (k-step kk: rows 16 kk ..
  // 16 kk + 15) and whose N is every column.
  __device__ __forceinline__ static uint64_t n_major(uint32_t tile_address, int kk) {
    return smem_descriptor(tile_address + kk * 16 * 128, kBlockBytes, 1024);
  }
};

template <int kHeadDim_, int kBlockN_>
struct Sm90FwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // 2 warpgroups x 64 rows
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpGroups = kBlockM / 64;
  static constexpr int kThreads = 128 * kWarpGroups;
  using QTile = GmmaTile<kBlockM, kHeadDim>;
  using KVTile = GmmaTile<kBlockN, kHeadDim>;
  // Q, two stages of K and of V, and 1 KiB to align the base.
  static constexpr int kSmemBytes = 2 * (QTile::kElements + 4 * KVTile::kElements) + 1024;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "wgmma shapes are instantiated for N = 64, 128");
  static_assert(kBlockN == 64 || kBlockN == 128, "wgmma shapes are instantiated for N = 64, 128");
};

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ FwdParams p) {
#if JF_SM90A
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // wgmma's swizzle pattern is anchored to 1 KiB boundaries of the shared address space.
  const uint32_t raw_address = smem_address(smem_raw);
  T* s_q = reinterpret_cast<T*>(smem_raw + (((raw_address + 1023) & ~1023u) - raw_address));
  T* s_k = s_q + QTile::kElements;       // two stages
  T* s_v = s_k + 2 * KVTile::kElements;  // two stages

  const AttentionShape& sh = p.shape;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = warp / 4;  // warpgroup: query rows 64 group ..
  const int m_block = gridDim.x - 1 - blockIdx.x;  // longest (causal) blocks first
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (sh.heads_q / sh.heads_k);
  const int64_t q_len = clamp_len(p.q_lens, b, sh.seq_q);
  const int64_t kv_len = clamp_len(p.kv_lens, b, sh.seq_k);
  const int64_t q_stride = sh.heads_q * sh.head_dim, kv_stride = sh.heads_k * sh.head_dim;
  const int chunks = static_cast<int>(sh.head_dim / 8);
  const QueryBlock<kBM, kBN> blk(p.mask, m_block, sh.seq_q, q_len, kv_len);
  const int64_t m0 = blk.m0;
  const int warp_m0 = group * 64 + warp % 4 * 16;  // this warp's 16 rows

  const T* q = static_cast<const T*>(p.q) + (b * sh.seq_q + m0) * q_stride + h * sh.head_dim;
  const T* k = static_cast<const T*>(p.k) + b * sh.seq_k * kv_stride + hk * sh.head_dim;
  const T* v = static_cast<const T*>(p.v) + b * sh.seq_k * kv_stride + hk * sh.head_dim;

  float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}};
  float o[1][kD / 8][4] = {};
  const float scale_log2 = p.scale * kLog2e;

  const uint32_t q_address = smem_address(s_q);
  auto k_address = [&](int stage) { return smem_address(s_k + stage * KVTile::kElements); };
  auto v_address = [&](int stage) { return smem_address(s_v + stage * KVTile::kElements); };

  const int n_first = blk.n_first, n_last = blk.n_last;
  if (n_last >= n_first) {
    auto load_k = [&](int n_block, int stage) {
      const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
      load_tile<KVTile, kThreads>(s_k + stage * KVTile::kElements, k + n0 * kv_stride, kv_stride,
                                  static_cast<int>(min64(kBN, kv_len - n0)), chunks, tid);
    };
    auto load_v = [&](int n_block, int stage) {
      const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
      load_tile<KVTile, kThreads>(s_v + stage * KVTile::kElements, v + n0 * kv_stride, kv_stride,
                                  static_cast<int>(min64(kBN, kv_len - n0)), chunks, tid);
    };
    // Groups in flight, oldest first: (Q, K[n_last]), V[n_last], then per iteration K, V of the
    // next block (as the sm80 kernel).
    load_tile<QTile, kThreads>(s_q, q, q_stride, blk.live_rows, chunks, tid);
    load_k(n_last, 0);
    cp_async_commit();
    load_v(n_last, 0);
    cp_async_commit();

    for (int n_block = n_last, stage = 0; n_block >= n_first; --n_block, stage ^= 1) {
      const bool prefetch = n_block > n_first;
      if (prefetch) {
        load_k(n_block - 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<2>();  // this stage's K has landed
      } else {
        cp_async_wait<1>();
      }
      fence_proxy_async();
      __syncthreads();

      // S = Q K^T for this warpgroup's 64 rows.
      float s[1][kBN / 8][4];
      fence_registers(s[0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk)
        Wgmma<T, kBN>::ss(s[0], QTile::k_major(q_address, group * 64, kk), KVTile::k_major(k_address(stage), 0, kk),
                          kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s[0]);

      const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
      if (blk.needs_mask(n0)) mask_scores(s, p.mask, m0 + warp_m0, n0, q_len, kv_len, lane);

      // Online softmax with lazy rescaling (see flash_fwd_sm80.cuh).
      float new_max[2];
      bool grow = false;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt)
          tile_max = fmaxf(tile_max, fmaxf(s[0][nt][2 * half], s[0][nt][2 * half + 1]));
        const float old_max = row_max[0][half];
        new_max[half] = fmaxf(old_max, quad_max(tile_max));
        grow |= old_max == -INFINITY ? new_max[half] != -INFINITY
                                     : (new_max[half] - old_max) * scale_log2 > kRescaleLog2;
      }
      if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float base = new_max[half] == -INFINITY ? 0.f : new_max[half] * scale_log2;
          const float correction = fast_exp2(row_max[0][half] * scale_log2 - base);
          row_max[0][half] = new_max[half];
          row_sum[0][half] *= correction;
#pragma unroll
          for (int dt = 0; dt < kD / 8; ++dt) {
            o[0][dt][2 * half] *= correction;
            o[0][dt][2 * half + 1] *= correction;
          }
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float base = row_max[0][half] == -INFINITY ? 0.f : row_max[0][half] * scale_log2;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            s[0][nt][e] = fast_exp2(s[0][nt][e] * scale_log2 - base);
            sum += s[0][nt][e];
          }
        row_sum[0][half] += sum;
      }
      uint32_t pa[kBN / 16][1][4];
      accumulator_to_a<T>(pa, s);

      if (prefetch) {
        load_v(n_block - 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<2>();  // this stage's V has landed
      } else {
        cp_async_wait<0>();
      }
      fence_proxy_async();
      __syncthreads();

      // O += P V: P from registers, V N-major from shared memory.
      fence_registers(o[0]);
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) fence_registers(pa[kk]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk)
        Wgmma<T, kD>::rs_b_transposed(o[0], pa[kk][0], KVTile::n_major(v_address(stage), kk), true);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(o[0]);
      // No barrier here (as the sm80 kernel): the next prefetches are ordered by the next
      // iteration's barriers, and this warpgroup's reads of the stage are complete (waited).
    }
  }

  // Epilogue: normalise, write O (zeros for rows with nothing to attend) and the log-sum-exp.
  T* out = static_cast<T*>(p.o) + (b * sh.seq_q + m0) * q_stride + h * sh.head_dim;
  float* lse = p.lse + (static_cast<int64_t>(b) * sh.heads_q + h) * sh.seq_q + m0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = warp_m0 + half * 8 + lane / 4;
    const float sum = quad_sum(row_sum[0][half]);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    if (row >= blk.rows) continue;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
      const int col = dt * 8 + (lane % 4) * 2;
      if (col < sh.head_dim)
        *reinterpret_cast<uint32_t*>(out + row * q_stride + col) =
            MmaOp<T>::pack(o[0][dt][2 * half] * inv, o[0][dt][2 * half + 1] * inv);
    }
    if (lane % 4 == 0) lse[row] = sum > 0.f ? row_max[0][half] * p.scale + logf(sum) : kEmptyRowLse;
  }
#endif  // JF_SM90A
}

}  // namespace jax_flash::cuda
