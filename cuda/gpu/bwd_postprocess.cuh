// The backward's last kernel (not in deterministic mode): dQ from its float32 accumulator.
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "gpu/dq_accum_layout.cuh"
#include "gpu/launch.h"
#include "gpu/ptx.cuh"

namespace jax_flash::cuda {

// Group i of 8 float32 values at `from` (two 16-byte loads) times `scale` in the 16-bit type T at
// `to` (one 16-byte store).
template <typename T>
__device__ __forceinline__ void convert_eight(const float* from, void* to, int64_t i, float scale = 1.f) {
  const float4 lo = reinterpret_cast<const float4*>(from)[2 * i];
  const float4 hi = reinterpret_cast<const float4*>(from)[2 * i + 1];
  reinterpret_cast<uint4*>(to)[i] =
      make_uint4(MmaOp<T>::pack(scale * lo.x, scale * lo.y), MmaOp<T>::pack(scale * lo.z, scale * lo.w),
                 MmaOp<T>::pack(scale * hi.x, scale * hi.y), MmaOp<T>::pack(scale * hi.z, scale * hi.w));
}

// dQ = dq_scale times the float32 accumulator, in the input dtype, 8 elements a thread per step
// (the head dim is a multiple of 8, so the element count is too). dq_scale: the softmax scale
// where the main kernel left it out of dS (the Hopper kernels: sm90/bwd_steps.cuh
// transposed_score_gradients), else 1.
template <typename T>
__global__ void flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams p, float dq_scale) {
  const AttentionShape& sh = p.shape;
  const int64_t groups = sh.batch * sh.seq_q * sh.heads_q * sh.head_dim / 8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < groups;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    convert_eight<T>(p.dq_accum, p.dq, i, dq_scale);
}

// The same from the accumulator in the quad order (gpu/dq_accum_layout.cuh; the kernels that add
// dQ by atomics, head dims that are multiples of 16): a 16-column group a thread per step
// (four 16-byte loads, two 16-byte stores).
template <typename T>
__global__ void flash_bwd_convert_quad_dq_kernel(const __grid_constant__ BwdParams p, float dq_scale) {
  const AttentionShape& sh = p.shape;
  const int64_t groups = sh.batch * sh.seq_q * sh.heads_q * sh.head_dim / 16;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < groups;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float x[16];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 v = reinterpret_cast<const float4*>(p.dq_accum)[4 * i + q];
      x[4 * q] = v.x, x[4 * q + 1] = v.y, x[4 * q + 2] = v.z, x[4 * q + 3] = v.w;
    }
    uint32_t packed[8];  // logical columns 2 pair and + 1
#pragma unroll
    for (int pair = 0; pair < 8; ++pair) {
      const int physical = quad_physical_column(2 * pair);
      packed[pair] = MmaOp<T>::pack(dq_scale * x[physical], dq_scale * x[physical + 1]);
    }
    uint4* to = reinterpret_cast<uint4*>(p.dq) + 2 * i;
    to[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    to[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  }
}

// dK and dV from their float32 accumulators (BwdParams::dkv_accum, the Hopper backward's head
// splits), 8 elements a thread per step.
template <typename T>
__global__ void flash_bwd_convert_dkv_kernel(const __grid_constant__ BwdParams p) {
  const AttentionShape& sh = p.shape;
  const int64_t groups = sh.batch * sh.seq_k * sh.heads_k * sh.head_dim / 8;  // of dK, then of dV
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < 2 * groups;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < groups)
      convert_eight<T>(p.dkv_accum, p.dk, i);
    else
      convert_eight<T>(p.dkv_accum + groups * 8, p.dv, i - groups);
  }
}

// dQ from the tiled accumulator (Sm90BwdVariant::kTiledDq and kStageDq, gpu/launch.h
// tiled_dq_accum, staged_dq_accum): per (batch, head, 64-row block) a tile of 64 x kColumns
// floats (128; or the head dim in whole 64-column parts: 192, 256), each 64-column part in a warpgroup's
// fragments' order: float4 j * 128 + t holds thread t's n-tile j, rows 16 (t / 32) + (t % 32) / 4
// (+ 8 for the float4's last two), columns 8 j + 2 (t % 4) and + 1 of the part. One float4 a
// thread per step; rows past seq_q and columns past head_dim are padding. The Hopper kernel left
// the softmax scale out of dS: dQ takes it here.
template <typename T, int kColumns>
__global__ void flash_bwd_convert_tiled_dq_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kRows = kTiledDqRows, kPartQuads = kRows * 64 / 4, kTileQuads = kRows * kColumns / 4;
  const AttentionShape& sh = p.shape;
  const int64_t m_blocks = (sh.seq_q + kRows - 1) / kRows;
  const int64_t quads = sh.batch * sh.heads_q * m_blocks * kTileQuads;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < quads;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t tile = i / kTileQuads;
    const int in_tile = static_cast<int>(i % kTileQuads);
    const int part = in_tile / kPartQuads, in_part = in_tile % kPartQuads;
    const int j = in_part / 128, t = in_part % 128;
    const int row = 16 * (t / 32) + (t % 32) / 4;
    const int col = part * 64 + 8 * j + 2 * (t % 4);
    const int64_t m_block = tile % m_blocks, bh = tile / m_blocks;
    const int64_t h = bh % sh.heads_q, b = bh / sh.heads_q;
    if (col >= sh.head_dim) continue;
    const float4 x = reinterpret_cast<const float4*>(p.dq_accum)[i];
    const float s = p.scale;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t q = m_block * kRows + row + 8 * half;
      if (q >= sh.seq_q) continue;
      const uint32_t pair = half == 0 ? MmaOp<T>::pack(s * x.x, s * x.y) : MmaOp<T>::pack(s * x.z, s * x.w);
      *reinterpret_cast<uint32_t*>(static_cast<T*>(p.dq) + ((b * sh.seq_q + q) * sh.heads_q + h) * sh.head_dim + col) =
          pair;
    }
  }
}

// dQ from the transposed tiles (sm90ws_m80's 80-row visits, sm90/traits.cuh kDqTransposed): per
// (batch, head, 80-row block) a tile of 80 x 128 floats, each warpgroup's part (its 64 head-dim
// rows of dQ^T) in its fragments' order: float4 j * 128 + t holds thread t's n-tile j, head-dim
// rows 16 (t / 32) + (t % 32) / 4 (+ 8 for the float4's last two) of the part, queries 8 j +
// 2 (t % 4) and + 1. A CTA of 256 threads a tile: coalesced float4 reads transposed through
// shared memory, then 16-byte stores of whole dQ rows (times the softmax scale, which the Hopper
// kernel left out of dS). Rows past seq_q are padding.
template <typename T>
__global__ void __launch_bounds__(256) flash_bwd_convert_transposed_dq_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kRows = kTransposedDqRows, kColumns = kTiledDqColumns, kQuads = kRows * kColumns / 4;
  constexpr int kStride = kColumns + 4;  // floats a row of the shared tile (16-byte rows, banks apart)
  __shared__ __align__(16) float tile[kRows * kStride];
  const AttentionShape& sh = p.shape;
  const int64_t m_blocks = (sh.seq_q + kRows - 1) / kRows;
  const int64_t tiles = sh.batch * sh.heads_q * m_blocks;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum) + t * kQuads;
    for (int i = threadIdx.x; i < kQuads; i += blockDim.x) {
      const float4 x = src[i];
      const int group = i / (kQuads / 2), in_part = i % (kQuads / 2);
      const int j = in_part / 128, thread = in_part % 128;
      const int column = 64 * group + 16 * (thread / 32) + (thread % 32) / 4;
      const int row = 8 * j + 2 * (thread % 4);
      tile[row * kStride + column] = x.x;
      tile[(row + 1) * kStride + column] = x.y;
      tile[row * kStride + column + 8] = x.z;
      tile[(row + 1) * kStride + column + 8] = x.w;
    }
    __syncthreads();
    const int64_t m_block = t % m_blocks, bh = t / m_blocks;
    const int64_t h = bh % sh.heads_q, b = bh / sh.heads_q;
    for (int i = threadIdx.x; i < kRows * kColumns / 8; i += blockDim.x) {
      const int row = i / (kColumns / 8), column = (i % (kColumns / 8)) * 8;
      const int64_t q = m_block * kRows + row;
      if (q < sh.seq_q && column < sh.head_dim) {
        const float s = p.scale;
        const float4 lo = *reinterpret_cast<const float4*>(&tile[row * kStride + column]);
        const float4 hi = *reinterpret_cast<const float4*>(&tile[row * kStride + column + 4]);
        *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + ((b * sh.seq_q + q) * sh.heads_q + h) * sh.head_dim + column) =
            make_uint4(MmaOp<T>::pack(s * lo.x, s * lo.y), MmaOp<T>::pack(s * lo.z, s * lo.w),
                       MmaOp<T>::pack(s * hi.x, s * hi.y), MmaOp<T>::pack(s * hi.z, s * hi.w));
      }
    }
    __syncthreads();  // the tile is read before the next one is written
  }
}

}  // namespace jax_flash::cuda
