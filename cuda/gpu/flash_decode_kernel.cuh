// The CUDA split-KV decode (flash-decoding with pack-GQA), contiguous or paged K/V, and the
// combine pass that merges its key chunks. Contract and layouts: common/decode_params.h (the
// CPU kernel, cpu/flash_decode.h, computes the same thing).
//
// Split kernel: one CTA (4 warps) per (batch b, kv head hk, key chunk, tile of 16 packed rows),
// launched longest sequence first (decode_batch_at).
// Packed row p of kv head hk is query position t = p / G of query head hk * G + p % G (G query
// heads per kv head, position-major as on the CPU), so one K/V block in shared memory serves
// every query head of the group: K/V are read once per group, not once per query head.
// The CTA's key chunk is cut from the union of its rows' key ranges (masks, lengths) as the CPU
// kernel cuts it. Keys stream through shared memory in blocks of 64 rows, kStages deep (cp.async,
// 16-byte copies, one barrier per block); the 4 warps split each block (16 keys a warp), each
// with its own online softmax and O accumulator for all 16 rows (mma.sync m16n8k16: S = Q K^T
// of 16 x 16, then O += P V of 16 x D). The kernel is bound by memory bandwidth, so the tensor
// cores' waste on rows that a 16-row tile pads (T * G = 4 at T = 1, GQA 4) costs nothing that
// shows; what matters is bytes in flight (kStages x 32 KiB a CTA at head dim 128, 2 CTAs an SM).
// At the end the warps merge through shared memory (their maxima, sums and O rescaled to a
// common maximum) and the CTA writes its rows: with one chunk the output rows and lse directly,
// else float32 partial rows and partial lse (-inf where the chunk holds none of the row's keys).
//
// Paged K/V: key j of sequence b is row j % page_size of page page_table[b, j / page_size].
// Threads 0..63 turn a block's 64 keys into pool rows once per block (one table load and one
// division a key, done a block ahead with the table entry loaded two blocks ahead, so the
// copies never wait on the table); contiguous K/V take the same path with row b * S + j. The
// table is device memory the handler cannot read, so the kernel checks it: each chunk's CTAs
// check a stride of the entries the sequence's length reaches, and a reached entry outside
// [0, num_pages) turns every row of the sequence into NaN (output and lse), as the "xla" paged
// path does; every entry read is also clamped into range so no read leaves the pools.
//
// Combine kernel: one warp per (batch, query head, position) row:
//   lse = log sum_s exp(lse_s), o = sum_s exp(lse_s - lse) o_s,
// a NaN lse_s makes the row NaN, a row whose chunks all hold -inf is empty (0, kEmptyRowLse).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/attention_params.h"
#include "common/decode_params.h"
#include "common/mask.h"
#include "gpu/block_geometry.cuh"
#include "gpu/flash_decode.h"
#include "gpu/fragments.cuh"
#include "gpu/ptx.cuh"
#include "gpu/smem_tile.cuh"
#include "gpu/softmax.cuh"
#include "sm80/warp_gemm.cuh"

namespace jax_flash::cuda {

// Kernel shape of the split kernel for one compiled head dim. Stages: 3 up to head dim 128
// (3 x 32 KiB of K/V a CTA at 128, so two CTAs an SM keep 4 blocks in flight), 2 beyond
// (2 x 64 KiB at 256: one CTA an SM).
template <int kHeadDim_>
struct DecodeTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = static_cast<int>(kDecodeRowsPerCta);
  static constexpr int kBlockN = static_cast<int>(kDecodeBlockN);
  static constexpr int kNWarps = 4;
  static constexpr int kThreads = 32 * kNWarps;
  static constexpr int kKeysPerWarp = kBlockN / kNWarps;
  static_assert(kBlockM == 16 && kKeysPerWarp == 16, "a warp computes one m16 x n16 score tile a block");
  static constexpr int kStages = kHeadDim <= 128 ? 3 : 2;
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KVTile = SmemTile<kBlockN, kHeadDim>;
  // The warps' merge reuses the K/V stages: kNWarps float32 copies of 16 x D (rows padded by 8
  // floats against bank conflicts).
  static constexpr int kMergeStride = kHeadDim + 8;
  static constexpr int kKvBytes = kStages * 2 * KVTile::kElements * 2;
  static constexpr int kQBytes = QTile::kElements * 2;
  static constexpr int kRowIndexBytes = kStages * kBlockN * 8;
  static constexpr int kStatsBytes = 2 * kNWarps * kBlockM * 4;
  static constexpr int kSmemBytes = kKvBytes + kQBytes + kRowIndexBytes + kStatsBytes;
  static_assert(kNWarps * kBlockM * kMergeStride * 4 <= kKvBytes, "the merge fits the K/V stages");
  static_assert(kBlockN <= kThreads, "a thread per key of a block maps its pool row");
};

inline constexpr float kLn2Decode = 0.6931471805599453f;  // lse from log2 units

__device__ __forceinline__ int64_t decode_clamp_len(const int32_t* lens, int64_t b, int64_t max_len) {
  const int64_t x = lens[b];
  return x < 0 ? 0 : (x > max_len ? max_len : x);
}

// Batches up to this size are visited longest sequence first (decode_batch_at).
inline constexpr int64_t kDecodeMaxRankedBatch = 256;

// The batch element of the pos-th group of CTAs in launch order: the longest kv length first
// (ties in batch order, so equal lengths keep the batch order), so that a ragged batch's long
// sequences start in the first waves and the short ones fill the last; in batch order the last
// waves held long CTAs alone on a few SMs. The rank is counted over the lengths in shared memory
// (B^2 / threads compares a CTA), so past kDecodeMaxRankedBatch elements batch order is kept.
__device__ __forceinline__ int64_t decode_batch_at(const DecodeParams& p, int64_t pos) {
  const int64_t batch = p.shape.batch;
  if (batch > kDecodeMaxRankedBatch) return pos;
  __shared__ int32_t s_len[kDecodeMaxRankedBatch];
  __shared__ int32_t s_batch;
  for (int64_t b = threadIdx.x; b < batch; b += blockDim.x)
    s_len[b] = static_cast<int32_t>(decode_clamp_len(p.kv_lens, b, p.shape.seq_k));
  __syncthreads();
  for (int b = threadIdx.x; b < batch; b += blockDim.x) {
    const int32_t len = s_len[b];
    int64_t rank = 0;
    for (int o = 0; o < batch; ++o) rank += s_len[o] > len || (s_len[o] == len && o < b);
    if (rank == pos) s_batch = b;
  }
  __syncthreads();
  return s_batch;
}

// What one CTA of the split kernel computes: its place in the grid, its rows and key chunk.
struct DecodeTask {
  int64_t b, hk, split;
  int64_t p0;          // first packed row of the tile
  int64_t group;       // query heads per kv head
  int64_t q_len, kv_len;
  int64_t offset;      // query position of row t: t + offset (bottom-right with queries_at_end)
  int rows;            // packed rows of the tile that exist (<= 16)
  int live;            // of them, rows whose position is < q_len
  int64_t c0, c1;      // the key chunk [c0, c1)
  int64_t max_begin;   // over live rows: the largest first key and the smallest end, so that a
  int64_t min_end;     // block inside [max_begin, min(min_end, c1)) needs no mask

  __device__ __forceinline__ explicit DecodeTask(const DecodeParams& p) {
    const AttentionShape& sh = p.shape;
    group = sh.heads_q / sh.heads_k;
    const int64_t packed = sh.seq_q * group;
    const int64_t row_tiles = (packed + kDecodeRowsPerCta - 1) / kDecodeRowsPerCta;
    int64_t x = blockIdx.x;  // ((rank(b) * K + hk) * splits + split) * row_tiles + tile
    const int64_t tile = x % row_tiles;
    x /= row_tiles;
    split = x % p.num_splits;
    x /= p.num_splits;
    hk = x % sh.heads_k;
    b = decode_batch_at(p, x / sh.heads_k);
    q_len = p.q_lens ? decode_clamp_len(p.q_lens, b, sh.seq_q) : sh.seq_q;
    kv_len = decode_clamp_len(p.kv_lens, b, sh.seq_k);
    offset = p.queries_at_end ? kv_len - sh.seq_q : 0;
    p0 = tile * kDecodeRowsPerCta;
    rows = static_cast<int>(min64(kDecodeRowsPerCta, packed - p0));
    live = static_cast<int>(max64(0, min64(rows, q_len * group - p0)));
    int64_t lo = INT64_MAX, hi = 0;
    max_begin = 0;
    min_end = INT64_MAX;
    for (int r = 0; r < live; ++r) {
      const KeyRange k = row_keys(p, r);
      max_begin = max64(max_begin, k.begin);
      min_end = min64(min_end, k.end);
      if (k.empty()) continue;
      lo = min64(lo, k.begin);
      hi = max64(hi, k.end);
    }
    c0 = c1 = 0;
    if (lo < hi) {
      const int64_t span = (hi - lo + p.num_splits - 1) / p.num_splits;
      const int64_t chunk = (span + kDecodeBlockN - 1) / kDecodeBlockN * kDecodeBlockN;
      c0 = min64(hi, lo + split * chunk);
      c1 = min64(hi, c0 + chunk);
    }
  }

  // The keys packed row r of the tile sees (empty for rows past `live`).
  __device__ __forceinline__ KeyRange row_keys(const DecodeParams& p, int r) const {
    if (r >= live) return {0, 0};
    return key_range(p.mask, (p0 + r) / group + offset, q_len + offset, kv_len);
  }
  // Whether row r sees a key of this CTA's chunk.
  __device__ __forceinline__ bool sees_chunk(const DecodeParams& p, int r) const {
    const KeyRange k = row_keys(p, r);
    return !k.empty() && k.begin < c1 && k.end > c0;
  }
  __device__ __forceinline__ int64_t position(int r) const { return (p0 + r) / group; }
  __device__ __forceinline__ int64_t head(int r) const { return hk * group + (p0 + r) % group; }
};

// kHint: the K/V copies' L2 hint (experimental: gpu/kernel_choice.h DecodeLoads).
template <typename Traits, typename T, L2Hint kHint = L2Hint::kNone>
__global__ void __launch_bounds__(Traits::kThreads)
    flash_decode_kernel(const __grid_constant__ DecodeParams p) {
  constexpr int kD = Traits::kHeadDim, kBN = Traits::kBlockN, kS = Traits::kStages;
  constexpr int kThreads = Traits::kThreads, kNWarps = Traits::kNWarps;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  constexpr int kChunks = KVTile::kChunks;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_kv = reinterpret_cast<T*>(smem_raw);  // stage s: K at 2 s, V at 2 s + 1 (KVTile each)
  T* s_q = reinterpret_cast<T*>(smem_raw + Traits::kKvBytes);
  int64_t* s_row = reinterpret_cast<int64_t*>(smem_raw + Traits::kKvBytes + Traits::kQBytes);  // [kS][kBN]
  float* s_max = reinterpret_cast<float*>(smem_raw + Traits::kKvBytes + Traits::kQBytes + Traits::kRowIndexBytes);
  float* s_sum = s_max + kNWarps * Traits::kBlockM;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const AttentionShape& sh = p.shape;
  const DecodeTask task(p);
  const int64_t d = sh.head_dim;
  const int chunks = static_cast<int>(d / 8);
  const T* k_base = static_cast<const T*>(p.k);
  const T* v_base = static_cast<const T*>(p.v);
  const int64_t row_stride = sh.heads_k * d;  // elements between key rows of one kv head
  const int64_t head_offset = task.hk * d;

  // Sequence check (paged): this chunk's stride of the entries the length reaches.
  bool bad = false;
  if (p.paged) {
    const int64_t reached = (task.kv_len + p.page_size - 1) / p.page_size;
    const int32_t* entries = p.page_table + task.b * p.pages_per_seq;
    for (int64_t i = task.split + static_cast<int64_t>(tid) * p.num_splits; i < reached;
         i += static_cast<int64_t>(kThreads) * p.num_splits) {
      const int32_t e = entries[i];
      bad |= e < 0 || e >= p.num_pages;
    }
  }

  // Key j's pool row (its K/V row index before the head), or -1 past the chunk (zero-filled).
  // `entry` is its page-table entry (paged only), loaded ahead by table_entry.
  auto table_entry = [&](int64_t j) -> int32_t {
    if (!p.paged || j >= task.c1) return 0;
    return p.page_table[task.b * p.pages_per_seq +
                        static_cast<uint32_t>(j) / static_cast<uint32_t>(p.page_size)];
  };
  auto pool_row = [&](int64_t j, int32_t entry) -> int64_t {
    if (j >= task.c1) return -1;
    if (!p.paged) return task.b * sh.seq_k + j;
    if (p.num_pages == 0) return -1;
    const int64_t page = entry < 0 ? 0 : (entry >= p.num_pages ? p.num_pages - 1 : entry);
    return page * p.page_size + static_cast<uint32_t>(j) % static_cast<uint32_t>(p.page_size);
  };

  const int n_blocks = task.c0 < task.c1 ? static_cast<int>((task.c1 - task.c0 + kBN - 1) / kBN) : 0;
  auto block_key = [&](int n) { return task.c0 + static_cast<int64_t>(n) * kBN; };

  // The K and V copies of block n into stage n % kS (pool rows from s_row).
  const uint64_t policy = kHint == L2Hint::kEvictFirst ? l2_evict_first_policy() : 0;
  auto load_block = [&](int n) {
    const int stage = n % kS;
    T* sk = s_kv + (2 * stage) * KVTile::kElements;
    T* sv = sk + KVTile::kElements;
    const int64_t* rows = s_row + stage * kBN;
#pragma unroll
    for (int i = 0; i < kBN * kChunks / kThreads; ++i) {
      const int index = tid + i * kThreads;
      const int r = index / kChunks, c = index % kChunks;
      const int64_t row = rows[r];
      const bool valid = row >= 0 && c < chunks;
      const int64_t at = row * row_stride + head_offset + c * 8;
      cp_async_16_hinted<kHint>(sk + KVTile::offset(r, c), valid ? k_base + at : k_base, valid, policy);
      cp_async_16_hinted<kHint>(sv + KVTile::offset(r, c), valid ? v_base + at : v_base, valid, policy);
    }
  };

  // Prologue: pool rows of blocks 0..kS-1, the table entry of block kS in flight; Q and
  // blocks 0..kS-2 issued (kS - 1 groups, the first with Q).
  int32_t pending_entry = 0;
  if (tid < kBN) {
#pragma unroll
    for (int n = 0; n < kS; ++n)
      if (n < n_blocks) s_row[n * kBN + tid] = pool_row(block_key(n) + tid, table_entry(block_key(n) + tid));
    if (kS < n_blocks) pending_entry = table_entry(block_key(kS) + tid);
  }
  {
    const T* q = static_cast<const T*>(p.q);
    for (int index = tid; index < Traits::kBlockM * QTile::kChunks; index += kThreads) {
      const int r = index / QTile::kChunks, c = index % QTile::kChunks;
      const bool valid = r < task.live && c < chunks;
      const int64_t at = ((task.b * sh.seq_q + task.position(r)) * sh.heads_q + task.head(r)) * d + c * 8;
      cp_async_16(s_q + QTile::offset(r, c), valid ? q + at : q, valid);
    }
  }
  bad = __syncthreads_or(bad);  // also: s_row visible to every thread
#pragma unroll
  for (int n = 0; n < kS - 1; ++n) {
    if (n < n_blocks) load_block(n);
    cp_async_commit();
  }

  // This thread's two rows (lane / 4 and + 8): their key ranges, cut to the chunk.
  int64_t row_begin[2], row_end[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const KeyRange k = task.row_keys(p, lane / 4 + 8 * half);
    row_begin[half] = k.begin;
    row_end[half] = min64(k.end, task.c1);
  }
  const int64_t unmasked_end = min64(task.min_end, task.c1);

  OnlineSoftmax<1> softmax(p.pv_headroom_log2);
  float o[1][kD / 8][4] = {};
  const float scale_log2 = p.scale * kLog2e;

  for (int n = 0; n < n_blocks; ++n) {
    cp_async_wait<kS - 2>();  // this thread's copies of block n (and Q) have landed
    __syncthreads();          // everyone's; and block n - 1's stage is free again
    if (n + kS - 1 < n_blocks) load_block(n + kS - 1);
    cp_async_commit();

    const int stage = n % kS;
    const T* sk = s_kv + (2 * stage) * KVTile::kElements;
    const T* sv = sk + KVTile::kElements;
    float s[1][2][4] = {};
    warp_gemm<QTile, false, KVTile, false, kD / 16>(s, s_q, 0, sk, warp * 16, lane);

    const int64_t j0 = block_key(n);
    if (j0 < task.max_begin || j0 + kBN > unmasked_end) {
      const int64_t first = j0 + warp * 16 + (lane % 4) * 2;
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t j = first + nt * 8 + e;
            if (j < row_begin[half] || j >= row_end[half]) s[0][nt][2 * half + e] = -INFINITY;
          }
    }
    if (softmax.must_rescale(s, scale_log2)) softmax.rescale(o, scale_log2);
    softmax.exponentiate(s, scale_log2);
    uint32_t pa[1][1][4];
    accumulator_to_a<T>(pa, s);
    warp_gemm_a_regs<KVTile, true, 1>(o, pa, sv + warp * 16 * kD, 0, lane);

    // Pool rows of block n + kS (into this block's row slot, whose copies were issued long
    // ago), from the entry loaded a block ago; then the entry of block n + kS + 1.
    if (tid < kBN && n + kS < n_blocks) {
      s_row[stage * kBN + tid] = pool_row(block_key(n + kS) + tid, pending_entry);
      if (n + kS + 1 < n_blocks) pending_entry = table_entry(block_key(n + kS + 1) + tid);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the K/V stages become the merge buffer

  // Merge the warps: each row's maximum (log2 units), sum and O rescaled to the CTA's maximum.
  constexpr int kMS = Traits::kMergeStride;
  float* s_merge = reinterpret_cast<float*>(smem_raw);  // [kNWarps][16][kMS]
  float my_max[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float m = softmax.max[0][half];
    // The sums are relative to the reference plus the headroom (OnlineSoftmax).
    my_max[half] = m == -INFINITY ? -INFINITY : __fmul_rn(m, scale_log2) + softmax.headroom;
    const float sum = quad_sum(softmax.sum[0][half]);
    if (lane % 4 == 0) {
      s_max[warp * 16 + lane / 4 + 8 * half] = my_max[half];
      s_sum[warp * 16 + lane / 4 + 8 * half] = sum;
    }
  }
  __syncthreads();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = lane / 4 + 8 * half;
    float cta_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNWarps; ++w) cta_max = fmaxf(cta_max, s_max[w * 16 + r]);
    const float factor = my_max[half] == -INFINITY ? 0.f : fast_exp2(my_max[half] - cta_max);
    float* dst = s_merge + (warp * 16 + r) * kMS + (lane % 4) * 2;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt)
      *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(o[0][dt][2 * half] * factor, o[0][dt][2 * half + 1] * factor);
  }
  __syncthreads();

  // Write the rows: float4 groups of columns, threads across a row for coalesced stores.
  constexpr int kGroups = kD / 4;
  const bool one_chunk = p.num_splits == 1;
  for (int g = tid; g < Traits::kBlockM * kGroups; g += kThreads) {
    const int r = g / kGroups, col = (g % kGroups) * 4;
    if (r >= task.rows || col >= d) continue;
    float cta_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNWarps; ++w) cta_max = fmaxf(cta_max, s_max[w * 16 + r]);
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kNWarps; ++w) {
      const float m = s_max[w * 16 + r];
      total += (m == -INFINITY ? 0.f : fast_exp2(m - cta_max)) * s_sum[w * 16 + r];
    }
    const bool seen = task.sees_chunk(p, r);
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (bad) {
      x = make_float4(NAN, NAN, NAN, NAN);
    } else if (seen) {
      const float inv = 1.f / total;
#pragma unroll
      for (int w = 0; w < kNWarps; ++w) {
        const float4 y = *reinterpret_cast<const float4*>(s_merge + (w * 16 + r) * kMS + col);
        x.x += y.x, x.y += y.y, x.z += y.z, x.w += y.w;
      }
      x.x *= inv, x.y *= inv, x.z *= inv, x.w *= inv;
    }
    const int64_t t = task.position(r), h = task.head(r);
    float lse = bad ? NAN : (seen ? (cta_max + __log2f(total)) * kLn2Decode : -INFINITY);
    if (one_chunk) {
      const int64_t at = ((task.b * sh.seq_q + t) * sh.heads_q + h) * d + col;
      if (p.o_float32) {
        *reinterpret_cast<float4*>(static_cast<float*>(p.o) + at) = x;
      } else {
        uint2 packed;
        packed.x = MmaOp<T>::pack(x.x, x.y);
        packed.y = MmaOp<T>::pack(x.z, x.w);
        *reinterpret_cast<uint2*>(static_cast<T*>(p.o) + at) = packed;
      }
      if (col == 0) p.lse[(task.b * sh.heads_q + h) * sh.seq_q + t] = lse == -INFINITY ? kEmptyRowLse : lse;
    } else {
      const int64_t row = ((task.split * sh.batch + task.b) * sh.heads_q + h) * sh.seq_q + t;
      *reinterpret_cast<float4*>(p.o_partial + row * d + col) = x;
      if (col == 0) p.lse_partial[row] = lse;
    }
  }
}

// The combine pass (num_splits > 1): one warp per row (b, h, t), rows in lse order.
template <typename T>
__global__ void __launch_bounds__(32 * kDecodeCombineRowsPerCta)
    flash_decode_combine_kernel(const __grid_constant__ DecodeParams p) {
  const AttentionShape& sh = p.shape;
  const int lane = threadIdx.x % 32;
  const int64_t rows = sh.batch * sh.heads_q * sh.seq_q;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kDecodeCombineRowsPerCta + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t t = row % sh.seq_q, h = row / sh.seq_q % sh.heads_q, b = row / (sh.seq_q * sh.heads_q);
  const int64_t d = sh.head_dim, splits = p.num_splits;

  float max_lse = -INFINITY;
  bool nan = false;
  for (int64_t s = lane; s < splits; s += 32) {
    const float x = p.lse_partial[s * rows + row];
    nan |= x != x;
    max_lse = fmaxf(max_lse, x);
  }
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, delta));
  nan = __any_sync(0xffffffffu, nan);
  const bool empty = !nan && max_lse == -INFINITY;

  float sum = 0.f;
  if (!nan && !empty)
    for (int64_t s = 0; s < splits; ++s) {
      const float x = p.lse_partial[s * rows + row];
      if (x != -INFINITY) sum += __expf(x - max_lse);
    }
  const float inv = 1.f / sum;
  const int64_t out = ((b * sh.seq_q + t) * sh.heads_q + h) * d;
  for (int64_t col = lane * 4; col < d; col += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (nan) {
      acc = make_float4(NAN, NAN, NAN, NAN);
    } else if (!empty) {
      for (int64_t s = 0; s < splits; ++s) {
        const float x = p.lse_partial[s * rows + row];
        if (x == -INFINITY) continue;  // the chunk holds none of the row's keys
        const float w = __expf(x - max_lse);
        const float4 y = *reinterpret_cast<const float4*>(p.o_partial + (s * rows + row) * d + col);
        acc.x += w * y.x, acc.y += w * y.y, acc.z += w * y.z, acc.w += w * y.w;
      }
      acc.x *= inv, acc.y *= inv, acc.z *= inv, acc.w *= inv;
    }
    if (p.o_float32) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.o) + out + col) = acc;
    } else {
      uint2 packed;
      packed.x = MmaOp<T>::pack(acc.x, acc.y);
      packed.y = MmaOp<T>::pack(acc.z, acc.w);
      *reinterpret_cast<uint2*>(static_cast<T*>(p.o) + out + col) = packed;
    }
  }
  if (lane == 0) p.lse[row] = nan ? NAN : (empty ? kEmptyRowLse : max_lse + __logf(sum));
}

}  // namespace jax_flash::cuda
