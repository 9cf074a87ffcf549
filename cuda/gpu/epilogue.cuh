// The forward's epilogue: normalised output rows and their log-sum-exp, from registers.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/attention_params.h"
#include "common/mask.h"
#include "common/rounding_residual.h"
#include "gpu/ptx.cuh"
#include "gpu/segment_ids.cuh"
#include "gpu/softmax.cuh"

namespace jax_flash::cuda {

// Two adjacent elements of a differentiated call's o: rounded to T at `hi`, their rounding
// errors as int8 at `error` (common/rounding_residual.h).
template <typename T>
__device__ __forceinline__ void store_split_pair(T* hi, int8_t* error, float x, float y) {
  const uint32_t packed = MmaOp<T>::pack(x, y);
  *reinterpret_cast<uint32_t*>(hi) = packed;
  const T* rounded = reinterpret_cast<const T*>(&packed);
  constexpr bool kFloat16 = std::is_same_v<T, __half>;
  const int8_t ex = rounding_error(x, static_cast<float>(rounded[0]), kFloat16);
  const int8_t ey = rounding_error(y, static_cast<float>(rounded[1]), kFloat16);
  *reinterpret_cast<uint16_t*>(error) = static_cast<uint16_t>(static_cast<uint8_t>(ex) |
                                                              static_cast<uint16_t>(static_cast<uint8_t>(ey)) << 8);
}

// Writes a warp's normalised O rows and their log-sum-exp: O (for the backward, o_float32 or
// o_error: normalised by the sum of the 16-bit P it was built from; lse from the unrounded sum:
// OnlineSoftmax) at element `offset` of o (16-bit T, or float32 when o_float32: the output kept
// for the backward, AttentionParams::o_float32; with o_error, non-null, each element's int8
// rounding error at the same offset there: FwdParams::o_error), rows
// from row0 of the block, whose first row is query m0 (rows past `rows` or before query 0 and
// columns past head_dim skipped). A row is empty, and gets 0 and kEmptyRowLse, when the masks leave it no key;
// never because of its values: a NaN sum (a NaN or inf in the inputs) gives a NaN row and lse,
// as jax.nn does. The general kernels pass `seen` (gpu/segment_ids.cuh: with segment ids, which
// rows the masks left some key; all of them without); the rows it lacks are empty too.
// OTile (not void): the 16-bit O rows go to the block's GmmaTile at o_tile (its row r the
// block's row r) for a TMA store (sm90/tma.cuh tma_store_rows) instead of to o; plain calls only
// (neither o_float32 nor o_error).
template <typename T, int kMTiles, int kDTiles, typename OTile = void>
__device__ __forceinline__ void store_output(void* o_base, bool o_float32, int8_t* o_error, int64_t offset,
                                             int64_t row_stride,
                                             float* lse, const float (&o)[kMTiles][kDTiles][4],
                                             const OnlineSoftmax<kMTiles>& softmax, float scale, int row0,
                                             int rows, int64_t head_dim, const MaskParams& mask, int64_t m0,
                                             int64_t q_len, int64_t kv_len, int lane,
                                             const SeenRows<kMTiles>* seen = nullptr, T* o_tile = nullptr) {
  // (`seen` is a pointer only to be optional at compile time: callers pass a local's address
  // or nothing, never a run-time choice, so that it stays in registers.)
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + mt * 16 + half * 8 + lane / 4;
      const float sum = quad_sum(softmax.sum[mt][half]);
      const float sum_rounded = quad_sum(softmax.sum_rounded[mt][half]);
      bool unseen = false;
      if (seen) unseen = !seen->any(mt, half);
      if (row >= rows || m0 + row < 0) continue;  // (rows before 0: an end-aligned tile's padding)
      const bool empty = unseen || key_range(mask, m0 + row, q_len, kv_len).empty();
      const float inv = empty ? 0.f : 1.f / (o_float32 || o_error ? sum_rounded : sum);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + (lane % 4) * 2;
        if (col >= head_dim) continue;
        const float x = o[mt][dt][2 * half] * inv, y = o[mt][dt][2 * half + 1] * inv;
        if constexpr (!std::is_void_v<OTile>) {
          *reinterpret_cast<uint32_t*>(o_tile + OTile::offset(row, dt) + (lane % 4) * 2) =
              empty ? 0u : MmaOp<T>::pack(x, y);
          continue;
        }
        const int64_t at = offset + row * row_stride + col;
        if (o_float32)
          *reinterpret_cast<float2*>(static_cast<float*>(o_base) + at) = empty ? make_float2(0.f, 0.f)
                                                                               : make_float2(x, y);
        else if (o_error == nullptr)
          *reinterpret_cast<uint32_t*>(static_cast<T*>(o_base) + at) = empty ? 0u : MmaOp<T>::pack(x, y);
        else
          store_split_pair<T>(static_cast<T*>(o_base) + at, o_error + at, empty ? 0.f : x, empty ? 0.f : y);
      }
      if (lane % 4 == 0) lse[row] = empty ? kEmptyRowLse : softmax.lse_of(mt, half, sum, scale);
    }
}

}  // namespace jax_flash::cuda
