// The backward's last kernel (not in deterministic mode): dQ from its float32 accumulator.
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "gpu/ptx.cuh"

namespace jax_flash::cuda {

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

}  // namespace jax_flash::cuda
