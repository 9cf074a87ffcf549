// The forward's epilogue: normalised output rows and their log-sum-exp, from registers.
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "common/mask.h"
#include "gpu/ptx.cuh"
#include "gpu/softmax.cuh"

namespace jax_flash::cuda {

// Writes a warp's normalised O rows (from row0 of the block, whose first row is query m0; rows
// past `rows` skipped, columns past head_dim skipped) and their log-sum-exp. A row is empty, and
// gets 0 and kEmptyRowLse, when the masks leave it no key; never because of its values: a NaN
// sum (a NaN or inf in the inputs) gives a NaN row and lse, as jax.nn does.
template <int kMTiles, int kDTiles, typename T>
__device__ __forceinline__ void store_output(T* out, int64_t row_stride, float* lse, const float (&o)[kMTiles][kDTiles][4],
                                             const OnlineSoftmax<kMTiles>& softmax, float scale, int row0,
                                             int rows, int64_t head_dim, const MaskParams& mask, int64_t m0,
                                             int64_t q_len, int64_t kv_len, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mt * 16 + half * 8 + lane / 4;
      const float sum = quad_sum(softmax.sum[mt][half]);
      if (row >= rows) continue;
      const bool empty = key_range(mask, m0 + row, q_len, kv_len).empty();
      const float inv = empty ? 0.f : 1.f / sum;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + (lane % 4) * 2;
        if (col < head_dim)
          *reinterpret_cast<uint32_t*>(out + row * row_stride + col) =
              empty ? 0u : MmaOp<T>::pack(o[mt][dt][2 * half] * inv, o[mt][dt][2 * half + 1] * inv);
      }
      if (lane % 4 == 0) lse[row] = empty ? kEmptyRowLse : softmax.max[mt][half] * scale + logf(sum);
    }
}

}  // namespace jax_flash::cuda
