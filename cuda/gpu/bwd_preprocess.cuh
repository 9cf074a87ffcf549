// The backward's first kernel, before either family's main kernel: delta = rowsum(dO * O) per
// query row, and the float32 dQ accumulator zeroed.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include <type_traits>

#include "common/attention_params.h"
#include "common/rounding_residual.h"

namespace jax_flash::cuda {

// Threads per query row in the prepare kernel: one per 8 elements of the head dim, rounded up to
// a power of two (so a row's threads are an aligned group of a warp), at most a warp.
__host__ __device__ constexpr int prepare_threads_per_row(int64_t head_dim) {
  int threads = 1;
  while (threads < 32 && threads * 8 < head_dim) threads *= 2;
  return threads;
}

// delta = dO . O per (batch, query row, head), and the row's dQ accumulator zeroed (when there
// is one). O is float32 (AttentionParams::o_float32), or 16-bit with its int8 rounding error
// (BwdParams::o_error) or alone. kThreadsPerRow threads a row (prepare_threads_per_row), each 8 elements of O and dO at
// a time: at head dim 64 a warp takes 4 rows, so every lane loads.
template <typename T, int kThreadsPerRow>
__global__ void flash_bwd_prepare_kernel(const __grid_constant__ BwdParams p) {
  const AttentionShape& sh = p.shape;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kThreadsPerRow;
  const int lane_in_row = threadIdx.x % kThreadsPerRow;
  const bool live = row < sh.batch * sh.seq_q * sh.heads_q;  // no early return: the shuffles need every lane
  const T* d_o = static_cast<const T*>(p.d_o) + row * sh.head_dim;
  float* dq = p.deterministic ? nullptr : p.dq_accum + row * sh.head_dim;
  float sum = 0.f;
  for (int c = lane_in_row * 8; live && c < sh.head_dim; c += kThreadsPerRow * 8) {
    const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
    const T* de = reinterpret_cast<const T*>(&dv);
    alignas(16) float oe[8];  // O in float32 where the forward kept it so (AttentionParams::o_float32)
    if (p.o_float32) {
      const float* o = static_cast<const float*>(p.o) + row * sh.head_dim + c;
      *reinterpret_cast<float4*>(oe) = *reinterpret_cast<const float4*>(o);
      *reinterpret_cast<float4*>(oe + 4) = *reinterpret_cast<const float4*>(o + 4);
    } else {
      const uint4 ov = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + row * sh.head_dim + c);
#pragma unroll
      for (int e = 0; e < 8; ++e) oe[e] = static_cast<float>(reinterpret_cast<const T*>(&ov)[e]);
      if (p.o_error != nullptr) {
        const uint2 kv = *reinterpret_cast<const uint2*>(p.o_error + row * sh.head_dim + c);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          oe[e] = join_rounding(oe[e], reinterpret_cast<const int8_t*>(&kv)[e], std::is_same_v<T, __half>);
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += oe[e] * static_cast<float>(de[e]);
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

}  // namespace jax_flash::cuda
