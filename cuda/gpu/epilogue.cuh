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

// A quad's 4 x 4 block of packed pairs turned over: v[j] comes in as this lane's pair of
// columns of 8-column tile j (columns 2 (lane % 4), +1 of it) and leaves as lane j's pair of
// tile lane % 4, so that v[0..3] hold tile lane % 4's eight columns in order. Two butterfly
// steps of two shuffles each; every lane of the warp takes part.
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4], int lane) {
#pragma unroll
  for (int m = 1; m <= 2; m *= 2) {
    const bool upper = lane & m;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j & m) continue;
      // Of positions j and j + m a lane keeps the one whose bit m is its own and swaps the other.
      const uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? v[j] : v[j + m], m);
      v[j] = upper ? got : v[j];
      v[j + m] = upper ? v[j + m] : got;
    }
  }
}

// Two adjacent elements of a differentiated call's o: rounded to T (`hi`, packed) and their
// rounding errors as int8 (`errors`, x's in the low byte: common/rounding_residual.h).
template <typename T>
__device__ __forceinline__ void split_pair(float x, float y, uint32_t& hi, uint16_t& errors) {
  hi = MmaOp<T>::pack(x, y);
  const T* rounded = reinterpret_cast<const T*>(&hi);
  constexpr bool kFloat16 = std::is_same_v<T, __half>;
  const int8_t ex = rounding_error(x, static_cast<float>(rounded[0]), kFloat16);
  const int8_t ey = rounding_error(y, static_cast<float>(rounded[1]), kFloat16);
  errors = static_cast<uint16_t>(static_cast<uint8_t>(ex) | static_cast<uint16_t>(static_cast<uint8_t>(ey)) << 8);
}

// The same pair stored: the rounded values at `hi`, their rounding errors at `error`.
template <typename T>
__device__ __forceinline__ void store_split_pair(T* hi, int8_t* error, float x, float y) {
  uint32_t packed;
  uint16_t errors;
  split_pair<T>(x, y, packed, errors);
  *reinterpret_cast<uint32_t*>(hi) = packed;
  *reinterpret_cast<uint16_t*>(error) = errors;
}

// Whether store_output may take store_output_vectors for a call: 16-bit o (and o_error) whose
// rows start at 16-byte (8-byte) boundaries, and head_dim a multiple of 8 so that a lane's 8
// columns lie wholly inside or outside it.
__device__ __forceinline__ bool vector_stores_fit(const void* o_base, const int8_t* o_error, int64_t offset,
                                                  int64_t row_stride, int64_t head_dim) {
  return head_dim % 8 == 0 && row_stride % 8 == 0 && offset % 8 == 0 &&
         reinterpret_cast<uintptr_t>(o_base) % 16 == 0 && reinterpret_cast<uintptr_t>(o_error) % 8 == 0;
}

// One of a thread's two rows of 16-row tile mt (lane / 4 + 8 half): where it goes, whether it is
// stored (inside the block's rows and at or after query 0: rows before 0 are an end-aligned
// tile's padding), whether the masks left it empty, and what normalises it (the sum of the
// 16-bit P when by_rounded_sum). Every lane forms it, stored or not: the sums and
// SeenRows::any are quad shuffles.
struct OutputRow {
  int row;  // of the block
  bool stored;
  bool empty;
  float inv;  // 0 when empty
  float lse;  // kEmptyRowLse when empty

  // The row's log-sum-exp, by one lane of the quad.
  __device__ __forceinline__ void store_lse(float* lse_rows, int lane) const {
    if (lane % 4 == 0 && stored) lse_rows[row] = lse;
  }
};

template <int kMTiles>
__device__ __forceinline__ OutputRow output_row(const OnlineSoftmax<kMTiles>& softmax, int mt, int half,
                                                bool by_rounded_sum, float scale, int row0, int rows,
                                                const MaskParams& mask, int64_t m0, int64_t q_len, int64_t kv_len,
                                                int lane, const SeenRows<kMTiles>* seen) {
  OutputRow r;
  r.row = row0 + mt * 16 + half * 8 + lane / 4;
  const float sum = quad_sum(softmax.sum[mt][half]);
  const float sum_rounded = quad_sum(softmax.sum_rounded[mt][half]);
  const bool unseen = seen != nullptr && !seen->any(mt, half);
  r.stored = r.row < rows && m0 + r.row >= 0;
  r.empty = unseen || key_range(mask, m0 + r.row, q_len, kv_len).empty();
  r.inv = r.empty ? 0.f : 1.f / (by_rounded_sum ? sum_rounded : sum);
  r.lse = r.empty ? kEmptyRowLse : softmax.lse_of(mt, half, sum, scale);
  return r;
}

// store_output's 16-bit rows (kErrors: with their rounding errors at o_error) with each lane
// storing 8 adjacent columns at once (quad_transpose): a quarter of the store instructions, each
// a row's whole 32-byte sectors, and no branch per element (the default since session 52; head
// dim 256's pair stores took ~14,000 cycles a tile on an H200, PERF_NOTES v50; with these its
// forward ran 12-35% faster, v51). Only where vector_stores_fit; the same values, rows and lse as
// the pair stores below, which JAX_FLASH_CUDA_FWD_STORES=pairs keeps.
template <bool kErrors, typename T, int kMTiles, int kDTiles>
__device__ __forceinline__ void store_output_vectors(void* o_base, int8_t* o_error, int64_t offset,
                                                     int64_t row_stride, float* lse,
                                                     const float (&o)[kMTiles][kDTiles][4],
                                                     const OnlineSoftmax<kMTiles>& softmax, float scale, int row0,
                                                     int rows, int64_t head_dim, const MaskParams& mask, int64_t m0,
                                                     int64_t q_len, int64_t kv_len, int lane,
                                                     const SeenRows<kMTiles>* seen) {
  static_assert(kDTiles % 4 == 0, "a quad turns over four 8-column tiles at a time");
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    OutputRow r[2];
    int64_t at[2];  // element of o (and o_error) of the row's column 0
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      r[half] = output_row(softmax, mt, half, kErrors, scale, row0, rows, mask, m0, q_len, kv_len, lane, seen);
      at[half] = offset + r[half].row * row_stride;
      r[half].store_lse(lse, lane);
    }
#pragma unroll
    for (int g = 0; g < kDTiles / 4; ++g) {
      const int col = (4 * g + lane % 4) * 8;  // this lane's 8 columns after the turn: tile 4 g + lane % 4
      const bool in_width = col < head_dim;
      uint32_t errors[4];  // (kErrors) tile 4 g + j's int8 pairs: row lane / 4 low, + 8 high
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t hi[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float* pair = &o[mt][4 * g + j][2 * half];
          const float x = r[half].empty ? 0.f : pair[0] * r[half].inv;
          const float y = r[half].empty ? 0.f : pair[1] * r[half].inv;
          if constexpr (kErrors) {
            uint16_t pair_errors;
            split_pair<T>(x, y, hi[j], pair_errors);
            errors[j] = half == 0 ? pair_errors : errors[j] | static_cast<uint32_t>(pair_errors) << 16;
          } else {
            hi[j] = MmaOp<T>::pack(x, y);
          }
        }
        quad_transpose(hi, lane);
        if (r[half].stored && in_width)
          *reinterpret_cast<uint4*>(static_cast<T*>(o_base) + at[half] + col) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      }
      if constexpr (kErrors) {
        quad_transpose(errors, lane);  // errors[i]: columns 2 i, +1 of this lane's 8
        const uint2 upper_row = make_uint2((errors[0] & 0xFFFFu) | errors[1] << 16, (errors[2] & 0xFFFFu) | errors[3] << 16);
        const uint2 lower_row = make_uint2(errors[0] >> 16 | (errors[1] & 0xFFFF0000u),
                                           errors[2] >> 16 | (errors[3] & 0xFFFF0000u));
        if (r[0].stored && in_width) *reinterpret_cast<uint2*>(o_error + at[0] + col) = upper_row;
        if (r[1].stored && in_width) *reinterpret_cast<uint2*>(o_error + at[1] + col) = lower_row;
      }
    }
  }
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
// vector_stores (FwdParams::o_vector_stores): 16-bit rows by store_output_vectors where they fit.
// OTile (not void): the 16-bit O rows go to the block's GmmaTile at o_tile (its row r the
// block's row r) for a TMA store (sm90/tma.cuh tma_store_rows) instead of to o; plain calls only
// (neither o_float32 nor o_error).
template <typename T, int kMTiles, int kDTiles, typename OTile = void>
__device__ __forceinline__ void store_output(void* o_base, bool o_float32, int8_t* o_error, bool vector_stores,
                                             int64_t offset, int64_t row_stride,
                                             float* lse, const float (&o)[kMTiles][kDTiles][4],
                                             const OnlineSoftmax<kMTiles>& softmax, float scale, int row0,
                                             int rows, int64_t head_dim, const MaskParams& mask, int64_t m0,
                                             int64_t q_len, int64_t kv_len, int lane,
                                             const SeenRows<kMTiles>* seen = nullptr, T* o_tile = nullptr) {
  // (`seen` is a pointer only to be optional at compile time: callers pass a local's address
  // or nothing, never a run-time choice, so that it stays in registers.)
  if constexpr (std::is_void_v<OTile> && kDTiles % 4 == 0) {
    if (vector_stores && !o_float32 && vector_stores_fit(o_base, o_error, offset, row_stride, head_dim)) {
      if (o_error != nullptr)
        store_output_vectors<true, T>(o_base, o_error, offset, row_stride, lse, o, softmax, scale, row0, rows, head_dim,
                                      mask, m0, q_len, kv_len, lane, seen);
      else
        store_output_vectors<false, T>(o_base, o_error, offset, row_stride, lse, o, softmax, scale, row0, rows,
                                       head_dim, mask, m0, q_len, kv_len, lane, seen);
      return;
    }
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const OutputRow r =
          output_row(softmax, mt, half, o_float32 || o_error, scale, row0, rows, mask, m0, q_len, kv_len, lane, seen);
      if (!r.stored) continue;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + (lane % 4) * 2;
        if (col >= head_dim) continue;
        const float x = o[mt][dt][2 * half] * r.inv, y = o[mt][dt][2 * half + 1] * r.inv;
        if constexpr (!std::is_void_v<OTile>) {
          *reinterpret_cast<uint32_t*>(o_tile + OTile::offset(r.row, dt) + (lane % 4) * 2) =
              r.empty ? 0u : MmaOp<T>::pack(x, y);
          continue;
        }
        const int64_t at = offset + r.row * row_stride + col;
        if (o_float32)
          *reinterpret_cast<float2*>(static_cast<float*>(o_base) + at) =
              r.empty ? make_float2(0.f, 0.f) : make_float2(x, y);
        else if (o_error == nullptr)
          *reinterpret_cast<uint32_t*>(static_cast<T*>(o_base) + at) = r.empty ? 0u : MmaOp<T>::pack(x, y);
        else
          store_split_pair<T>(static_cast<T*>(o_base) + at, o_error + at, r.empty ? 0.f : x, r.empty ? 0.f : y);
      }
      r.store_lse(lse, lane);
    }
}

}  // namespace jax_flash::cuda
