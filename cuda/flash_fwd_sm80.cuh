// FlashAttention-2 forward for sm_80 and newer (mma.sync m16n8k16, bf16/fp16 in, fp32 out).
//
// CTA = kBlockM query rows of one (batch, query head); warp w owns rows 16w..16w+15. Key/value
// tiles stream through shared memory in two stages (cp.async), last tile first so the tiles
// that need masks (causal diagonal, kv length edge) come before the unmasked ones. Scores stay
// in registers: S = Q K^T, online softmax in base 2, then P (converted in registers to the A
// operand layout) times V accumulates O.
#pragma once

#include <cuda_runtime.h>

#include "attention_params.h"
#include "cuda_ptx.cuh"
#include "flash_traits.cuh"

namespace jax_flash::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;

// Copies rows [0, rows) x chunks [0, chunks) of a global tile (row stride in elements) into a
// swizzled shared tile; everything outside is zero-filled.
template <typename Tile, int kThreads, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t row_stride, int rows,
                                          int chunks, int tid) {
#pragma unroll
  for (int i = tid; i < Tile::kRows * Tile::kChunks; i += kThreads) {
    const int r = i / Tile::kChunks, c = i % Tile::kChunks;
    const bool valid = r < rows && c < chunks;
    cp_async_16(smem + Tile::offset(r, c), valid ? gmem + r * row_stride + c * 8 : gmem, valid);
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ int64_t clamp_len(const int32_t* lens, int64_t b, int64_t full) {
  const int64_t n = lens[b];
  return n < 0 ? 0 : (n > full ? full : n);
}

// acc[16 rows x 8*kTiles cols] += A[16 rows of `a_tile` from a_row0, k in [0, 16*kSteps)] *
// B^T where B = rows [b_row0, b_row0 + 8*kTiles) of `b_tile`: the score product of one warp.
template <typename ATile, typename BTile, int kSteps, int kTiles, typename T>
__device__ __forceinline__ void warp_mma_abt(float (&acc)[kTiles][4], const T* a_tile, int a_row0,
                                             const T* b_tile, int b_row0, int lane) {
  static_assert(kTiles % 2 == 0, "B tiles come in pairs");
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    uint32_t a[4];
    ldmatrix_x4(a, a_tile + ATile::offset(a_row0 + (lane / 8 % 2) * 8 + lane % 8, kk * 2 + lane / 16));
#pragma unroll
    for (int n2 = 0; n2 < kTiles / 2; ++n2) {
      uint32_t b[4];
      ldmatrix_x4(b, b_tile + BTile::offset(b_row0 + n2 * 16 + lane / 16 * 8 + lane % 8, kk * 2 + lane / 8 % 2));
      MmaOp<T>::run(acc[2 * n2], a, b[0], b[1]);
      MmaOp<T>::run(acc[2 * n2 + 1], a, b[2], b[3]);
    }
  }
}

// acc[16 x 8*kTiles] += A (16 x 16*kSteps, given as register fragments) * B where B = rows
// [0, 16*kSteps) x columns [col0, col0 + 8*kTiles) of `b_tile` (loaded transposed).
template <typename BTile, int kSteps, int kTiles, typename T>
__device__ __forceinline__ void warp_mma_ab_regs(float (&acc)[kTiles][4],
                                                 const uint32_t (&a)[kSteps][4], const T* b_tile,
                                                 int col0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
    for (int n2 = 0; n2 < kTiles / 2; ++n2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, b_tile + BTile::offset(kk * 16 + lane / 8 % 2 * 8 + lane % 8,
                                                  col0 / 8 + n2 * 2 + lane / 16));
      MmaOp<T>::run(acc[2 * n2], a[kk], b[0], b[1]);
      MmaOp<T>::run(acc[2 * n2 + 1], a[kk], b[2], b[3]);
    }
  }
}

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kThreads)
    flash_fwd_kernel(const __grid_constant__ FwdParams p) {
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);
  T* s_k = s_q + QTile::kElements;       // two stages
  T* s_v = s_k + 2 * KVTile::kElements;  // two stages

  const AttentionShape& sh = p.shape;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // longest (causal) blocks first
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (sh.heads_q / sh.heads_k);
  const int64_t q_len = clamp_len(p.q_lens, b, sh.seq_q);
  const int64_t kv_len = clamp_len(p.kv_lens, b, sh.seq_k);
  const int64_t q_stride = sh.heads_q * sh.head_dim, kv_stride = sh.heads_k * sh.head_dim;
  const int chunks = static_cast<int>(sh.head_dim / 8);
  const int64_t m0 = static_cast<int64_t>(m_block) * kBM;
  const int rows = static_cast<int>(min64(kBM, sh.seq_q - m0));
  const int live_rows = static_cast<int>(max64(0, min64(rows, q_len - m0)));

  const T* q = static_cast<const T*>(p.q) + (b * sh.seq_q + m0) * q_stride + h * sh.head_dim;
  const T* k = static_cast<const T*>(p.k) + b * sh.seq_k * kv_stride + hk * sh.head_dim;
  const T* v = static_cast<const T*>(p.v) + b * sh.seq_k * kv_stride + hk * sh.head_dim;

  // Key blocks some row of this CTA sees.
  int n_first = 0, n_last = -1;
  KeyRange first{0, 0}, last{0, 0};
  if (live_rows > 0) {
    first = key_range(p.mask, m0, q_len, kv_len);
    last = key_range(p.mask, m0 + live_rows - 1, q_len, kv_len);
    if (last.end > first.begin) {
      n_first = static_cast<int>(first.begin / kBN);
      n_last = static_cast<int>((last.end - 1) / kBN);
    }
  }
  const bool has_padding_rows = m0 + kBM > q_len;

  // This thread's two rows (g and g + 8 of the warp's 16) and their key ranges.
  const int row_a = warp * 16 + lane / 4, row_b = row_a + 8;
  const KeyRange keys_a = key_range(p.mask, m0 + row_a, q_len, kv_len);
  const KeyRange keys_b = key_range(p.mask, m0 + row_b, q_len, kv_len);

  float o[kD / 8][4] = {};
  float max_a = -INFINITY, max_b = -INFINITY, sum_a = 0.f, sum_b = 0.f;
  const float scale_log2 = p.scale * kLog2e;

  if (n_last >= n_first) {
    load_tile<QTile, kThreads>(s_q, q, q_stride, live_rows, chunks, tid);
    auto load_kv = [&](int n_block, int stage) {
      const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
      const int n_rows = static_cast<int>(min64(kBN, kv_len - n0));
      load_tile<KVTile, kThreads>(s_k + stage * KVTile::kElements, k + n0 * kv_stride, kv_stride,
                                  n_rows, chunks, tid);
      load_tile<KVTile, kThreads>(s_v + stage * KVTile::kElements, v + n0 * kv_stride, kv_stride,
                                  n_rows, chunks, tid);
    };
    load_kv(n_last, 0);
    cp_async_commit();

    for (int n_block = n_last, stage = 0; n_block >= n_first; --n_block, stage ^= 1) {
      if (n_block > n_first) {
        load_kv(n_block - 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const T* tile_k = s_k + stage * KVTile::kElements;
      const T* tile_v = s_v + stage * KVTile::kElements;

      float s[kBN / 8][4] = {};
      warp_mma_abt<QTile, KVTile, kD / 16>(s, s_q, warp * 16, tile_k, 0, lane);

      const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
      const bool masked = has_padding_rows || n0 < last.begin || n0 + kBN > first.end;
      if (masked) {
#pragma unroll
        for (int t = 0; t < kBN / 8; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t j = n0 + t * 8 + (lane % 4) * 2 + e;
            if (j < keys_a.begin || j >= keys_a.end) s[t][e] = -INFINITY;
            if (j < keys_b.begin || j >= keys_b.end) s[t][2 + e] = -INFINITY;
          }
      }
      float tile_max_a = -INFINITY, tile_max_b = -INFINITY;
#pragma unroll
      for (int t = 0; t < kBN / 8; ++t) {
        tile_max_a = fmaxf(tile_max_a, fmaxf(s[t][0], s[t][1]));
        tile_max_b = fmaxf(tile_max_b, fmaxf(s[t][2], s[t][3]));
      }
      const float new_max_a = fmaxf(max_a, quad_max(tile_max_a));
      const float new_max_b = fmaxf(max_b, quad_max(tile_max_b));
      // A row with nothing visible yet keeps max -inf: subtract 0 so exp2(-inf) gives 0.
      const float base_a = new_max_a == -INFINITY ? 0.f : new_max_a * scale_log2;
      const float base_b = new_max_b == -INFINITY ? 0.f : new_max_b * scale_log2;
      const float corr_a = fast_exp2(max_a * scale_log2 - base_a);
      const float corr_b = fast_exp2(max_b * scale_log2 - base_b);
      max_a = new_max_a;
      max_b = new_max_b;
      sum_a *= corr_a;
      sum_b *= corr_b;
#pragma unroll
      for (int t = 0; t < kD / 8; ++t) {
        o[t][0] *= corr_a;
        o[t][1] *= corr_a;
        o[t][2] *= corr_b;
        o[t][3] *= corr_b;
      }
      uint32_t pa[kBN / 16][4];  // P as the A operand of P V
#pragma unroll
      for (int t = 0; t < kBN / 8; ++t) {
        const float p0 = fast_exp2(s[t][0] * scale_log2 - base_a);
        const float p1 = fast_exp2(s[t][1] * scale_log2 - base_a);
        const float p2 = fast_exp2(s[t][2] * scale_log2 - base_b);
        const float p3 = fast_exp2(s[t][3] * scale_log2 - base_b);
        sum_a += p0 + p1;
        sum_b += p2 + p3;
        pa[t / 2][(t % 2) * 2 + 0] = MmaOp<T>::pack(p0, p1);
        pa[t / 2][(t % 2) * 2 + 1] = MmaOp<T>::pack(p2, p3);
      }
      warp_mma_ab_regs<KVTile, kBN / 16>(o, pa, tile_v, 0, lane);
      __syncthreads();  // the stage is overwritten by the next iteration's prefetch
    }
  }

  // Epilogue: normalise, write O (zeros for rows with nothing to attend) and the log-sum-exp.
  sum_a = quad_sum(sum_a);
  sum_b = quad_sum(sum_b);
  const float inv_a = sum_a > 0.f ? 1.f / sum_a : 0.f;
  const float inv_b = sum_b > 0.f ? 1.f / sum_b : 0.f;
  T* out = static_cast<T*>(p.o) + (b * sh.seq_q + m0) * q_stride + h * sh.head_dim;
#pragma unroll
  for (int t = 0; t < kD / 8; ++t) {
    const int col = t * 8 + (lane % 4) * 2;
    if (col >= sh.head_dim) continue;
    if (row_a < rows)
      *reinterpret_cast<uint32_t*>(out + row_a * q_stride + col) =
          MmaOp<T>::pack(o[t][0] * inv_a, o[t][1] * inv_a);
    if (row_b < rows)
      *reinterpret_cast<uint32_t*>(out + row_b * q_stride + col) =
          MmaOp<T>::pack(o[t][2] * inv_b, o[t][3] * inv_b);
  }
  if (lane % 4 == 0) {
    float* lse = p.lse + (static_cast<int64_t>(b) * sh.heads_q + h) * sh.seq_q + m0;
    if (row_a < rows) lse[row_a] = sum_a > 0.f ? max_a * p.scale + logf(sum_a) : kEmptyRowLse;
    if (row_b < rows) lse[row_b] = sum_b > 0.f ? max_b * p.scale + logf(sum_b) : kEmptyRowLse;
  }
}

}  // namespace jax_flash::cuda
