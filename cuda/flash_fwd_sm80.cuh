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

#include "attention_params.h"
#include "cuda_ptx.cuh"
#include "flash_traits.cuh"
#include "warp_gemm.cuh"

namespace jax_flash::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;
// Lazy rescaling threshold of the forward's online softmax: probabilities stay <= 2^8.
inline constexpr float kRescaleLog2 = 8.f;

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ int64_t clamp_len(const int32_t* lens, int64_t b, int64_t full) {
  const int64_t n = lens[b];
  return n < 0 ? 0 : (n > full ? full : n);
}

// Copies rows [0, rows) x chunks [0, chunks) of a global tile (row stride in elements) into a
// swizzled shared tile; everything outside is zero-filled. Each thread copies the same chunk
// column of rows tid / kChunks + i * kThreads / kChunks where the thread count allows (a fixed,
// unrolled trip with one address per thread), else walks the tile in thread-strided order.
template <typename Tile, int kThreads, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t row_stride, int rows,
                                          int chunks, int tid) {
  constexpr int kCopies = Tile::kRows * Tile::kChunks;
  static_assert(kCopies % kThreads == 0, "every thread copies as many chunks");
  if constexpr (kThreads % Tile::kChunks == 0) {
    constexpr int kRowsPerPass = kThreads / Tile::kChunks;
    const int c = tid % Tile::kChunks, r0 = tid / Tile::kChunks;
    const T* src = gmem + r0 * row_stride + c * 8;
#pragma unroll
    for (int i = 0; i < kCopies / kThreads; ++i) {
      const int r = r0 + i * kRowsPerPass;
      const bool valid = r < rows && c < chunks;
      cp_async_16(smem + Tile::offset(r, c), valid ? src + i * kRowsPerPass * row_stride : gmem, valid);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kCopies / kThreads; ++i) {
      const int index = tid + i * kThreads;
      const int r = index / Tile::kChunks, c = index % Tile::kChunks;
      const bool valid = r < rows && c < chunks;
      cp_async_16(smem + Tile::offset(r, c), valid ? gmem + r * row_stride + c * 8 : gmem, valid);
    }
  }
}

// The reverse of load_tile: rows [0, rows) x chunks [0, chunks) of a swizzled shared tile to a
// global tile, 16 bytes a thread at a time (a warp writes whole rows).
template <typename Tile, int kThreads, typename T>
__device__ __forceinline__ void store_tile(T* gmem, int64_t row_stride, const T* smem, int rows, int chunks,
                                           int tid) {
  constexpr int kCopies = Tile::kRows * Tile::kChunks;
  static_assert(kCopies % kThreads == 0 && kThreads % Tile::kChunks == 0, "every thread copies as many chunks");
  constexpr int kRowsPerPass = kThreads / Tile::kChunks;
  const int c = tid % Tile::kChunks, r0 = tid / Tile::kChunks;
#pragma unroll
  for (int i = 0; i < kCopies / kThreads; ++i) {
    const int r = r0 + i * kRowsPerPass;
    if (r < rows && c < chunks)
      *reinterpret_cast<uint4*>(gmem + r * row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(smem + Tile::offset(r, c));
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

// The query rows [m0, m0 + rows) of a CTA (live: before q_len) and the key blocks [n_first,
// n_last] that any of them sees.
template <int kBlockM, int kBlockN>
struct QueryBlock {
  int64_t m0;
  int rows, live_rows;
  KeyRange first{0, 0}, last{0, 0};  // key ranges of the first and last live rows
  int n_first = 0, n_last = -1;
  bool has_padding_rows;

  __device__ QueryBlock(const MaskParams& mask, int m_block, int64_t seq_q, int64_t q_len,
                        int64_t kv_len)
      : m0(static_cast<int64_t>(m_block) * kBlockM),
        rows(static_cast<int>(min64(kBlockM, seq_q - m0))),
        live_rows(static_cast<int>(max64(0, min64(rows, q_len - m0)))),
        has_padding_rows(m0 + kBlockM > q_len) {
    if (live_rows > 0) {
      first = key_range(mask, m0, q_len, kv_len);
      last = key_range(mask, m0 + live_rows - 1, q_len, kv_len);
      if (last.end > first.begin) {
        n_first = static_cast<int>(first.begin / kBlockN);
        n_last = static_cast<int>((last.end - 1) / kBlockN);
      }
    }
  }

  // Whether some row sees only part of key block n0 (or is padding): then masks apply.
  __device__ bool needs_mask(int64_t n0) const {
    return has_padding_rows || n0 < last.begin || n0 + kBlockN > first.end;
  }
};

// A query-block CTA's problem (the forward kernels and the deterministic dQ kernel): batch b, query
// head h and its kv head hk, valid lengths, row strides, its query rows with the key blocks they
// see (longest causal blocks first: block gridDim.x - 1 - blockIdx.x), and element offsets of its
// first query row in q / o / dq / dO, of its kv head in k / v, and of its (b, h) row 0 in lse /
// delta.
template <int kBlockM, int kBlockN>
struct QueryBlockTask {
  int b, h, hk;
  int64_t q_len, kv_len, q_stride, kv_stride;
  int chunks;  // 16-byte chunks of a row's head dim
  QueryBlock<kBlockM, kBlockN> blk;
  int64_t q_offset, kv_offset, stat_offset;

  template <typename Params>
  __device__ explicit QueryBlockTask(const Params& p)
      : b(blockIdx.z),
        h(blockIdx.y),
        hk(static_cast<int>(blockIdx.y / (p.shape.heads_q / p.shape.heads_k))),
        q_len(clamp_len(p.q_lens, blockIdx.z, p.shape.seq_q)),
        kv_len(clamp_len(p.kv_lens, blockIdx.z, p.shape.seq_k)),
        q_stride(p.shape.heads_q * p.shape.head_dim),
        kv_stride(p.shape.heads_k * p.shape.head_dim),
        chunks(static_cast<int>(p.shape.head_dim / 8)),
        blk(p.mask, gridDim.x - 1 - blockIdx.x, p.shape.seq_q, q_len, kv_len),
        q_offset((b * p.shape.seq_q + blk.m0) * q_stride + h * p.shape.head_dim),
        kv_offset(b * p.shape.seq_k * kv_stride + hk * p.shape.head_dim),
        stat_offset((static_cast<int64_t>(b) * p.shape.heads_q + h) * p.shape.seq_q) {}

  // Rows [0, rows) of key block n_block's K or V (from `base`, k or v) into a shared tile.
  template <typename Tile, int kThreads, typename T>
  __device__ __forceinline__ void load_keys(T* tile, const T* base, int n_block, int tid) const {
    const int64_t n0 = static_cast<int64_t>(n_block) * kBlockN;
    load_tile<Tile, kThreads>(tile, base + kv_offset + n0 * kv_stride, kv_stride,
                              static_cast<int>(min64(kBlockN, kv_len - n0)), chunks, tid);
  }
  // This block's query rows of q or dO into a shared tile (rows past q_len zero).
  template <typename Tile, int kThreads, typename T>
  __device__ __forceinline__ void load_queries(T* tile, const T* base, int tid) const {
    load_tile<Tile, kThreads>(tile, base + q_offset, q_stride, blk.live_rows, chunks, tid);
  }
};

// Sets to -inf the scores of keys outside each row's range, for the kMTiles 16-row tiles of a
// warp whose first query row is m0 (key ranges computed here, on the few masked tiles, rather
// than kept in registers across the loop). Fragment element (mt, nt, e) of a thread is row
// 16 mt + lane/4 (+8 for e >= 2), column 8 nt + 2 (lane % 4) + e % 2.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void mask_scores(float (&s)[kMTiles][kNTiles][4], const MaskParams& mask,
                                            int64_t m0, int64_t n0, int64_t q_len, int64_t kv_len,
                                            int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const KeyRange r = key_range(mask, m0 + mt * 16 + half * 8 + lane / 4, q_len, kv_len);
      // Bounds relative to this thread's first column of the tile, in 32 bits.
      const int64_t j0 = n0 + (lane % 4) * 2;
      const int begin = static_cast<int>(max64(-1, min64(r.begin - j0, kNTiles * 8)));
      const int end = static_cast<int>(max64(-1, min64(r.end - j0, kNTiles * 8)));
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = nt * 8 + e;
          if (j < begin || j >= end) s[mt][nt][2 * half + e] = -INFINITY;
        }
    }
}

// The online softmax of a warp's kMTiles 16-row tiles (this thread: rows lane/4 and lane/4 + 8
// of each), with lazy rescaling. A row's reference maximum (max) moves only when some row of the
// warp meets a score more than kRescaleLog2 (in log2 units) above its own, or sees its first
// key; then every row of the warp moves to its new maximum and O and the sums are rescaled.
// Otherwise P = exp2(S - reference) stays <= 2^kRescaleLog2 and nothing is rescaled: exact, since
// the final normalisation and lse use the same reference. After the first blocks a warp rarely
// rescales (saving 128 multiplies a thread per block at head dim 128). Needs scale_log2 >= 0
// (ops.py keeps the scale positive).
template <int kMTiles>
struct OnlineSoftmax {
  float max[kMTiles][2];
  float sum[kMTiles][2];  // this thread's part; quad_sum gives the row's
  float new_max[kMTiles][2];
  float correction[kMTiles][2];  // of the last move_reference

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        max[mt][half] = -INFINITY;
        sum[mt][half] = 0.f;
      }
  }

  // The rows' maxima including this block's scores s; whether the warp must rescale.
  template <int kNTiles>
  __device__ __forceinline__ bool must_rescale(const float (&s)[kMTiles][kNTiles][4], float scale_log2) {
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
          tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
        const float old_max = max[mt][half];
        new_max[mt][half] = fmaxf(old_max, quad_max(tile_max));
        grow |= old_max == -INFINITY ? new_max[mt][half] != -INFINITY
                                     : (new_max[mt][half] - old_max) * scale_log2 > kRescaleLog2;
      }
    return __any_sync(0xffffffffu, grow);
  }

  // Moves every row's reference to its new maximum and rescales the sums; O still needs
  // rescale_output (which may wait until O's pending product is in).
  __device__ __forceinline__ void move_reference(float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // A row with nothing visible yet keeps max -inf: its correction is exp2(-inf) = 0.
        const float base = new_max[mt][half] == -INFINITY ? 0.f : new_max[mt][half] * scale_log2;
        correction[mt][half] = fast_exp2(max[mt][half] * scale_log2 - base);
        max[mt][half] = new_max[mt][half];
        sum[mt][half] *= correction[mt][half];
      }
  }

  // O relative to the references move_reference set.
  template <int kDTiles>
  __device__ __forceinline__ void rescale_output(float (&o)[kMTiles][kDTiles][4]) const {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          o[mt][dt][2 * half] *= correction[mt][half];
          o[mt][dt][2 * half + 1] *= correction[mt][half];
        }
  }

  template <int kDTiles>
  __device__ __forceinline__ void rescale(float (&o)[kMTiles][kDTiles][4], float scale_log2) {
    move_reference(scale_log2);
    rescale_output(o);
  }

  // s <- P = exp2(S scale log2e - reference), added to the sums.
  template <int kNTiles>
  __device__ __forceinline__ void exponentiate(float (&s)[kMTiles][kNTiles][4], float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // -inf reference (nothing seen yet): subtract 0 so that exp2(-inf) gives 0.
        const float base = max[mt][half] == -INFINITY ? 0.f : max[mt][half] * scale_log2;
        float block_sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            s[mt][nt][e] = fast_exp2(s[mt][nt][e] * scale_log2 - base);
            block_sum += s[mt][nt][e];
          }
        sum[mt][half] += block_sum;
      }
  }
};

// Writes a warp's normalised O rows (from row0 of the block; rows past `rows` skipped, columns
// past head_dim skipped) and their log-sum-exp; rows with nothing to attend get 0 and kEmptyRowLse.
template <int kMTiles, int kDTiles, typename T>
__device__ __forceinline__ void store_output(T* out, int64_t row_stride, float* lse, const float (&o)[kMTiles][kDTiles][4],
                                             const OnlineSoftmax<kMTiles>& softmax, float scale, int row0,
                                             int rows, int64_t head_dim, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mt * 16 + half * 8 + lane / 4;
      const float sum = quad_sum(softmax.sum[mt][half]);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      if (row >= rows) continue;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + (lane % 4) * 2;
        if (col < head_dim)
          *reinterpret_cast<uint32_t*>(out + row * row_stride + col) =
              MmaOp<T>::pack(o[mt][dt][2 * half] * inv, o[mt][dt][2 * half + 1] * inv);
      }
      if (lane % 4 == 0) lse[row] = sum > 0.f ? softmax.max[mt][half] * scale + logf(sum) : kEmptyRowLse;
    }
}

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kThreads)
    flash_fwd_kernel(const __grid_constant__ FwdParams p) {
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads, kMT = Traits::kMTiles;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);
  T* s_k = s_q + QTile::kElements;       // two stages
  T* s_v = s_k + 2 * KVTile::kElements;  // two stages

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const QueryBlockTask<kBM, kBN> task(p);
  const QueryBlock<kBM, kBN>& blk = task.blk;
  const int64_t m0 = blk.m0;
  const int warp_m0 = warp * kMT * 16;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  OnlineSoftmax<kMT> softmax;
  float o[kMT][kD / 8][4] = {};
  const float scale_log2 = p.scale * kLog2e;

  const int n_first = blk.n_first, n_last = blk.n_last;
  if (n_last >= n_first) {
    auto load_k = [&](int n_block, int stage) {
      task.template load_keys<KVTile, kThreads>(s_k + stage * KVTile::kElements, k, n_block, tid);
    };
    auto load_v = [&](int n_block, int stage) {
      task.template load_keys<KVTile, kThreads>(s_v + stage * KVTile::kElements, v, n_block, tid);
    };
    // Groups in flight, oldest first: (Q, K[n_last]), V[n_last], then per iteration K, V of
    // the next block.
    task.template load_queries<QTile, kThreads>(s_q, static_cast<const T*>(p.q), tid);
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
      __syncthreads();

      float s[kMT][kBN / 8][4] = {};
      warp_gemm<QTile, false, KVTile, false, kD / 16>(s, s_q, warp_m0, s_k + stage * KVTile::kElements, 0,
                                                      lane);
      const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
      if (blk.needs_mask(n0)) mask_scores(s, p.mask, m0 + warp_m0, n0, task.q_len, task.kv_len, lane);

      if (softmax.must_rescale(s, scale_log2)) softmax.rescale(o, scale_log2);
      softmax.exponentiate(s, scale_log2);
      uint32_t pa[kBN / 16][kMT][4];
      accumulator_to_a<T>(pa, s);

      if (prefetch) {
        load_v(n_block - 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<2>();  // this stage's V has landed
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      // No barrier here: the next iteration's first prefetch (K into the other stage) was last
      // read before this iteration's second barrier, and its V prefetch waits for its first.
      warp_gemm_a_regs<KVTile, true>(o, pa, s_v + stage * KVTile::kElements, 0, lane);
    }
  }

  // Epilogue: normalise, write O (zeros for rows with nothing to attend) and the log-sum-exp.
  store_output(static_cast<T*>(p.o) + task.q_offset, task.q_stride, p.lse + task.stat_offset + m0, o, softmax,
               p.scale, warp_m0, blk.rows, p.shape.head_dim, lane);
}

}  // namespace jax_flash::cuda
