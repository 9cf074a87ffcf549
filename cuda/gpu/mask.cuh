// Masks applied to a tile of scores in registers (-inf outside each row's key range, or each
// key's query range), on the tiles that need them; the ranges come from common/mask.h.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/mask.h"
#include "gpu/block_geometry.cuh"

namespace jax_flash::cuda {

// A row's key range (or a key's query range) as offsets from a thread's first column `first`,
// clamped to [-1, width]: 32-bit bounds for the tile's compares.
struct TileSpan {
  int begin, end;
};
template <typename Range>
__device__ __forceinline__ TileSpan span_in_tile(const Range& r, int64_t first, int width) {
  return {static_cast<int>(max64(-1, min64(r.begin - first, width))),
          static_cast<int>(max64(-1, min64(r.end - first, width)))};
}

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
      const auto [begin, end] = span_in_tile(r, n0 + (lane % 4) * 2, kNTiles * 8);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = nt * 8 + e;
          if (j < begin || j >= end) s[mt][nt][2 * half + e] = -INFINITY;
        }
    }
}

// Sets to -inf the transposed scores s (rows: keys from key0, this thread's rows lane/4 and
// +8 of its warp's 16; columns: queries from query0, 8 j + 2 (lane % 4) + e % 2) of the queries
// that do not see the key: one query range per key row, two compares per score.
template <int kNTiles>
__device__ __forceinline__ void mask_transposed_scores(float (&s)[1][kNTiles][4], const MaskParams& mask,
                                                       int64_t key0, int64_t query0, int64_t q_len,
                                                       int64_t kv_len, int lane) {
  const int64_t column0 = query0 + (lane % 4) * 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const QueryRange r = query_range(mask, key0 + lane / 4 + half * 8, q_len, kv_len);
    const auto [begin, end] = span_in_tile(r, column0, kNTiles * 8);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (nt * 8 + c < begin || nt * 8 + c >= end) s[0][nt][2 * half + c] = -INFINITY;
  }
}

}  // namespace jax_flash::cuda
