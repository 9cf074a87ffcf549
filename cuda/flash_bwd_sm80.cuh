// FlashAttention-2 backward for sm_80 and newer, by recomputation. Three kernels:
//   flash_bwd_prepare_kernel: delta = rowsum(dO * O) per query row; zero the fp32 dQ accumulator;
//   flash_bwd_kernel: one CTA per (key block, batch, kv head); K and V stay in shared memory
//     while the query blocks of every query head of the group that see the keys stream past
//     (Q and dO double-buffered). Per query block: S = Q K^T and dP = dO V^T in registers,
//     P = exp2(S log2e scale - lse log2e), dS = scale P (dP - delta); P and dS go through shared
//     memory to feed dV += P^T dO, dK += dS^T Q (accumulated in registers over the whole loop:
//     the GQA reduction happens here) and dQ += dS K (added to the fp32 accumulator atomically);
//   flash_bwd_convert_dq_kernel: dQ = accumulator in the input dtype.
#pragma once

#include "flash_fwd_sm80.cuh"

namespace jax_flash::cuda {

// First and last+1 query rows whose key range meets [j0, j1) (ranges move right with the row).
__device__ __forceinline__ void rows_seeing(const MaskParams& m, int64_t j0, int64_t j1,
                                            int64_t q_len, int64_t kv_len, int64_t& first,
                                            int64_t& end) {
  int64_t lo = 0, hi = q_len;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (key_range(m, mid, q_len, kv_len).end > j0) hi = mid; else lo = mid + 1;
  }
  first = lo;
  hi = q_len;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (key_range(m, mid, q_len, kv_len).begin >= j1) hi = mid; else lo = mid + 1;
  }
  end = lo;
}

// One warp per (batch, query row, head): delta = dO . O, and the row's dQ accumulator zeroed.
template <typename T>
__global__ void flash_bwd_prepare_kernel(const __grid_constant__ BwdParams p) {
  const AttentionShape& sh = p.shape;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= sh.batch * sh.seq_q * sh.heads_q) return;
  const int64_t h = row % sh.heads_q, t = row / sh.heads_q % sh.seq_q, b = row / (sh.heads_q * sh.seq_q);
  const T* o = static_cast<const T*>(p.o) + row * sh.head_dim;
  const T* d_o = static_cast<const T*>(p.d_o) + row * sh.head_dim;
  float* dq = p.dq_accum + row * sh.head_dim;
  float sum = 0.f;
  for (int c = lane * 8; c < sh.head_dim; c += 32 * 8) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += static_cast<float>(oe[e]) * static_cast<float>(de[e]);
    *reinterpret_cast<float4*>(dq + c) = make_float4(0.f, 0.f, 0.f, 0.f);
    *reinterpret_cast<float4*>(dq + c + 4) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) p.delta[(b * sh.heads_q + h) * sh.seq_q + t] = sum;
}

template <typename T>
__global__ void flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
  const AttentionShape& sh = p.shape;
  const int64_t n = sh.batch * sh.seq_q * sh.heads_q * sh.head_dim;
  T* dq = static_cast<T*>(p.dq);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dq[i] = static_cast<T>(p.dq_accum[i]);
}

// Stores a warp's 16 x kBN accumulator (rows row0.., all columns) into a P-shaped shared tile.
template <typename PTile, int kTiles, typename T>
__device__ __forceinline__ void store_fragment(T* tile, const float (&x)[kTiles][4], int row0, int lane) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const int row = row0 + lane / 4, within = (lane % 4) * 2;
    *reinterpret_cast<uint32_t*>(tile + PTile::offset(row, t) + within) = MmaOp<T>::pack(x[t][0], x[t][1]);
    *reinterpret_cast<uint32_t*>(tile + PTile::offset(row + 8, t) + within) = MmaOp<T>::pack(x[t][2], x[t][3]);
  }
}

// The A operand X^T (16 keys from key0, all kBlockM queries) of a stored [query][key] tile.
template <typename PTile, int kSteps, typename T>
__device__ __forceinline__ void load_transposed_a(uint32_t (&a)[kSteps][4], const T* tile, int key0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
    ldmatrix_x4_trans(a[kk], tile + PTile::offset(kk * 16 + lane / 16 * 8 + lane % 8, key0 / 8 + lane / 8 % 2));
}

// The A operand X (16 queries from row0, all keys) of a stored [query][key] tile.
template <typename PTile, int kSteps, typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[kSteps][4], const T* tile, int row0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
    ldmatrix_x4(a[kk], tile + PTile::offset(row0 + lane / 8 % 2 * 8 + lane % 8, kk * 2 + lane / 16));
}

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kThreads)
    flash_bwd_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads, kSliceD = Traits::kSliceD, kDqChunk = Traits::kDqChunk;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  using PTile = typename Traits::PTile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_k = reinterpret_cast<T*>(smem_raw);
  T* s_v = s_k + KVTile::kElements;
  T* s_q = s_v + KVTile::kElements;     // two stages
  T* s_do = s_q + 2 * QTile::kElements;  // two stages
  T* s_p = s_do + 2 * QTile::kElements;
  T* s_ds = s_p + PTile::kElements;

  const AttentionShape& sh = p.shape;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_n = warp % Traits::kWarpsN, warp_d = warp / Traits::kWarpsN;
  const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int group = static_cast<int>(sh.heads_q / sh.heads_k);
  const int64_t q_len = clamp_len(p.q_lens, b, sh.seq_q);
  const int64_t kv_len = clamp_len(p.kv_lens, b, sh.seq_k);
  const int64_t q_stride = sh.heads_q * sh.head_dim, kv_stride = sh.heads_k * sh.head_dim;
  const int chunks = static_cast<int>(sh.head_dim / 8);
  const int64_t n0 = static_cast<int64_t>(n_block) * kBN;
  const int keys = static_cast<int>(min64(kBN, sh.seq_k - n0));
  const int live_keys = static_cast<int>(max64(0, min64(keys, kv_len - n0)));

  int64_t m_begin = 0, m_end = 0;
  if (live_keys > 0) rows_seeing(p.mask, n0, n0 + live_keys, q_len, kv_len, m_begin, m_end);
  const int mb_first = static_cast<int>(m_begin / kBM);
  const int mb_count = m_end > m_begin ? static_cast<int>((m_end - 1) / kBM) - mb_first + 1 : 0;
  const int iterations = mb_count * group;

  const T* q_base = static_cast<const T*>(p.q) + b * sh.seq_q * q_stride;
  const T* do_base = static_cast<const T*>(p.d_o) + b * sh.seq_q * q_stride;
  auto load_q_do = [&](int it, int stage) {
    const int h = hk * group + it / mb_count;
    const int64_t m0 = static_cast<int64_t>(mb_first + it % mb_count) * kBM;
    const int rows = static_cast<int>(max64(0, min64(kBM, q_len - m0)));
    load_tile<QTile, kThreads>(s_q + stage * QTile::kElements, q_base + m0 * q_stride + h * sh.head_dim,
                               q_stride, rows, chunks, tid);
    load_tile<QTile, kThreads>(s_do + stage * QTile::kElements, do_base + m0 * q_stride + h * sh.head_dim,
                               q_stride, rows, chunks, tid);
  };

  float dk[kSliceD / 8][4] = {};
  float dv[kSliceD / 8][4] = {};
  const int key0 = warp_n * 16, col0 = warp_d * kSliceD;
  const float scale_log2 = p.scale * kLog2e;

  if (iterations > 0) {
    const T* k = static_cast<const T*>(p.k) + (b * sh.seq_k + n0) * kv_stride + hk * sh.head_dim;
    const T* v = static_cast<const T*>(p.v) + (b * sh.seq_k + n0) * kv_stride + hk * sh.head_dim;
    load_tile<KVTile, kThreads>(s_k, k, kv_stride, live_keys, chunks, tid);
    load_tile<KVTile, kThreads>(s_v, v, kv_stride, live_keys, chunks, tid);
    load_q_do(0, 0);
    cp_async_commit();
  }
  for (int it = 0, stage = 0; it < iterations; ++it, stage ^= 1) {
    if (it + 1 < iterations) {
      load_q_do(it + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int h = hk * group + it / mb_count;
    const int64_t m0 = static_cast<int64_t>(mb_first + it % mb_count) * kBM;
    const T* tile_q = s_q + stage * QTile::kElements;
    const T* tile_do = s_do + stage * QTile::kElements;

    // S and dP for this warp's 16 query rows.
    float s[kBN / 8][4] = {};
    float dp[kBN / 8][4] = {};
    warp_mma_abt<QTile, KVTile, kD / 16>(s, tile_q, warp * 16, s_k, 0, lane);
    warp_mma_abt<QTile, KVTile, kD / 16>(dp, tile_do, warp * 16, s_v, 0, lane);

    const int64_t row_a = m0 + warp * 16 + lane / 4, row_b = row_a + 8;
    const float* lse = p.lse + (static_cast<int64_t>(b) * sh.heads_q + h) * sh.seq_q;
    const float* delta = p.delta + (static_cast<int64_t>(b) * sh.heads_q + h) * sh.seq_q;
    const float lse_a = row_a < q_len ? lse[row_a] * kLog2e : 0.f;
    const float lse_b = row_b < q_len ? lse[row_b] * kLog2e : 0.f;
    const float delta_a = row_a < q_len ? delta[row_a] : 0.f;
    const float delta_b = row_b < q_len ? delta[row_b] : 0.f;
    const KeyRange keys_a = key_range(p.mask, row_a, q_len, kv_len);
    const KeyRange keys_b = key_range(p.mask, row_b, q_len, kv_len);
    const KeyRange first = key_range(p.mask, m0, q_len, kv_len);
    const KeyRange last = key_range(p.mask, min64(m0 + kBM, q_len) - 1, q_len, kv_len);
    const bool masked = m0 + kBM > q_len || n0 < last.begin || n0 + kBN > first.end;
#pragma unroll
    for (int t = 0; t < kBN / 8; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t j = n0 + t * 8 + (lane % 4) * 2 + e;
        float pa = fast_exp2(s[t][e] * scale_log2 - lse_a);
        float pb = fast_exp2(s[t][2 + e] * scale_log2 - lse_b);
        if (masked) {
          if (j < keys_a.begin || j >= keys_a.end) pa = 0.f;
          if (j < keys_b.begin || j >= keys_b.end) pb = 0.f;
        }
        s[t][e] = pa;
        s[t][2 + e] = pb;
        dp[t][e] = p.scale * pa * (dp[t][e] - delta_a);
        dp[t][2 + e] = p.scale * pb * (dp[t][2 + e] - delta_b);
      }
    store_fragment<PTile>(s_p, s, warp * 16, lane);
    store_fragment<PTile>(s_ds, dp, warp * 16, lane);
    __syncthreads();

    // dV += P^T dO and dK += dS^T Q for this warp's 16 keys and head-dim slice.
    {
      uint32_t a[kBM / 16][4];
      load_transposed_a<PTile>(a, s_p, key0, lane);
      warp_mma_ab_regs<QTile, kBM / 16>(dv, a, tile_do, col0, lane);
      load_transposed_a<PTile>(a, s_ds, key0, lane);
      warp_mma_ab_regs<QTile, kBM / 16>(dk, a, tile_q, col0, lane);
    }
    // dQ += dS K for this warp's 16 query rows, kDqChunk columns at a time.
    {
      uint32_t a[kBN / 16][4];
      load_a<PTile>(a, s_ds, warp * 16, lane);
      float* dq_a = p.dq_accum + ((b * sh.seq_q + row_a) * sh.heads_q + h) * sh.head_dim;
      float* dq_b = dq_a + 8 * q_stride;
#pragma unroll
      for (int c0 = 0; c0 < kD; c0 += kDqChunk) {
        float dq[kDqChunk / 8][4] = {};
        warp_mma_ab_regs<KVTile, kBN / 16>(dq, a, s_k, c0, lane);
#pragma unroll
        for (int t = 0; t < kDqChunk / 8; ++t) {
          const int col = c0 + t * 8 + (lane % 4) * 2;
          if (col >= sh.head_dim) continue;
          if (row_a < q_len) {
            atomicAdd(dq_a + col, dq[t][0]);
            atomicAdd(dq_a + col + 1, dq[t][1]);
          }
          if (row_b < q_len) {
            atomicAdd(dq_b + col, dq[t][2]);
            atomicAdd(dq_b + col + 1, dq[t][3]);
          }
        }
      }
    }
    __syncthreads();  // P, dS and this stage are overwritten next
  }

  // dK and dV rows of this block (zeros where no query sees the key).
  T* dk_out = static_cast<T*>(p.dk) + (b * sh.seq_k + n0) * kv_stride + hk * sh.head_dim;
  T* dv_out = static_cast<T*>(p.dv) + (b * sh.seq_k + n0) * kv_stride + hk * sh.head_dim;
  const int r_a = key0 + lane / 4, r_b = r_a + 8;
#pragma unroll
  for (int t = 0; t < kSliceD / 8; ++t) {
    const int col = col0 + t * 8 + (lane % 4) * 2;
    if (col >= sh.head_dim) continue;
    if (r_a < keys) {
      *reinterpret_cast<uint32_t*>(dk_out + r_a * kv_stride + col) = MmaOp<T>::pack(dk[t][0], dk[t][1]);
      *reinterpret_cast<uint32_t*>(dv_out + r_a * kv_stride + col) = MmaOp<T>::pack(dv[t][0], dv[t][1]);
    }
    if (r_b < keys) {
      *reinterpret_cast<uint32_t*>(dk_out + r_b * kv_stride + col) = MmaOp<T>::pack(dk[t][2], dk[t][3]);
      *reinterpret_cast<uint32_t*>(dv_out + r_b * kv_stride + col) = MmaOp<T>::pack(dv[t][2], dv[t][3]);
    }
  }
}

}  // namespace jax_flash::cuda
