// The forward's epilogue: normalised output rows and their log-sum-exp, from registers.
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "gpu/ptx.cuh"
#include "gpu/softmax.cuh"

namespace jax_flash::cuda {

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

}  // namespace jax_flash::cuda
