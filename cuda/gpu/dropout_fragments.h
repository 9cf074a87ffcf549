// Fused dropout's keep decisions (common/dropout_bits.h) for the score elements one thread holds in
// an mma.sync or wgmma accumulator fragment, so that a CUDA kernel drops exactly the elements the
// CPU kernel and jax_flash/_dropout.py drop. Host and device code (no CUDA intrinsics): the lane
// is the caller's, and tests/cpp/dropout_fragments_check.cc runs these functions for every lane of
// a warpgroup on the host against the reference (tests/test_dropout_bits.py).
//
// A thread's accumulator of 16 rows x 8 columns (an n-tile) holds element e (0..3) at row
// row0 + 8 (e / 2) and column col0 + e % 2, with row0 = the warp's first row + lane / 4 (so
// row0 % 16 < 8) and col0 = the tile's first column + 2 (lane % 4) (even). Philox's quads are
// rows r, r + 8 and columns c, c + 1 with r % 16 < 8 and c even:
// - forward fragments (rows = query rows, columns = keys: S = Q K^T) hold one quad an n-tile,
//   element e being the call's word e: one call gives four decisions;
// - transposed fragments (rows = keys, columns = query rows: the backward's S^T = K Q^T) hold
//   keys k, k + 8 and query rows q, q + 1 an n-tile, four different quads; the quad of (q, k)
//   also holds (q + 8, k), which sits in the next n-tile of the same thread, so a pair of n-tiles
//   takes four calls (two decisions each).
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "common/dropout_bits.h"

namespace jax_flash::cuda {

// The keep decisions of one (batch element, query head): the Philox key, the counter's head and
// batch words (AttentionParams::dropout_seeds' four words) and the threshold.
struct DropoutStream {
  uint32_t key0 = 0, key1 = 0, head = 0, batch = 0;
  uint32_t threshold = 0;  // words below it drop their element

  JF_HOST_DEVICE DropoutStream() {}
  JF_HOST_DEVICE DropoutStream(const uint32_t* seed, uint32_t threshold_)
      : key0(seed[0]), key1(seed[1]), head(seed[2]), batch(seed[3]), threshold(threshold_) {}

  // The Philox call of the quad holding score element (row, column).
  JF_HOST_DEVICE PhiloxWords quad_words(int64_t row, int64_t column) const {
    const PhiloxWords counter = {{static_cast<uint32_t>(column / 2), static_cast<uint32_t>((row / 16) * 8 + row % 8),
                                  head, batch}};
    return philox4x32_10(counter, key0, key1);
  }
  JF_HOST_DEVICE bool keeps(uint32_t word) const { return word >= threshold; }
};

// The seeds' stream of (b, h) in params (which must have dropout_seeds).
JF_HOST_DEVICE inline DropoutStream dropout_stream(const AttentionParams& p, int64_t b, int64_t h) {
  return DropoutStream(p.dropout_seeds + (b * p.shape.heads_q + h) * 4, p.dropout_threshold);
}

// A forward n-tile's decisions: bit e keeps element e (row row0 + 8 (e / 2), key col0 + e % 2).
JF_HOST_DEVICE inline uint32_t forward_keep_bits(const DropoutStream& d, int64_t row0, int64_t col0) {
  const PhiloxWords w = d.quad_words(row0, col0);
  uint32_t bits = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) bits |= static_cast<uint32_t>(d.keeps(w.w[e])) << e;
  return bits;
}

// A pair of transposed n-tiles' decisions (the first's query rows from query0, query0 % 16 == 0
// plus 2 (lane % 4), the second's 8 further; keys key0 and key0 + 8): bit e keeps the first
// tile's element e (key key0 + 8 (e / 2), query row query0 + e % 2), bit 4 + e the second's.
JF_HOST_DEVICE inline uint32_t transposed_keep_bits(const DropoutStream& d, int64_t key0, int64_t query0) {
  uint32_t bits = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t key = key0 + 8 * (e / 2), query = query0 + e % 2;
    // The quad of rows query and query + 8 and keys key & ~1, key | 1: word key % 2 for the
    // first row, 2 + key % 2 for the second.
    const PhiloxWords w = d.quad_words(query, key);
    const int index = static_cast<int>(key % 2);
    bits |= static_cast<uint32_t>(d.keeps(index ? w.w[1] : w.w[0])) << e;
    bits |= static_cast<uint32_t>(d.keeps(index ? w.w[3] : w.w[2])) << (4 + e);
  }
  return bits;
}

#ifdef __CUDACC__
// Zeroes the dropped probabilities of a forward block's 16-bit A fragments, as accumulator_to_a
// packs them (n-tile nt's elements 2 half and 2 half + 1 in the low and high halves of
// a[nt / 2][0][2 (nt % 2) + half]); row0 and col0 as forward_keep_bits' for n-tile 0.
template <int kNTiles>
__device__ __forceinline__ void drop_forward_probabilities(uint32_t (&a)[kNTiles / 2][1][4], const DropoutStream& d,
                                                           int64_t row0, int64_t col0) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    const uint32_t bits = forward_keep_bits(d, row0, col0 + nt * 8);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t mask = ((bits >> (2 * half)) & 1u ? 0x0000FFFFu : 0u) | ((bits >> (2 * half + 1)) & 1u ? 0xFFFF0000u : 0u);
      a[nt / 2][0][(nt % 2) * 2 + half] &= mask;
    }
  }
}

// The keep decisions of a transposed fragment of kNTiles n-tiles (query rows from query0, query0
// % 16 == 0 plus 2 (lane % 4); keys key0 and key0 + 8): bit 4 nt + e keeps element e of n-tile nt.
template <int kNTiles>
__device__ __forceinline__ uint64_t transposed_keep_mask(const DropoutStream& d, int64_t key0, int64_t query0) {
  static_assert(kNTiles % 2 == 0 && kNTiles <= 16, "pairs of n-tiles, 64 decisions at most");
  uint64_t keep = 0;
#pragma unroll
  for (int pair = 0; pair < kNTiles / 2; ++pair)
    keep |= static_cast<uint64_t>(transposed_keep_bits(d, key0, query0 + 16 * pair)) << (8 * pair);
  return keep;
}

// x <- x * Z for a fragment of kNTiles n-tiles, Z = scale where bit 4 nt + e of keep is set, else
// 0: a multiply, as the CPU kernel and the references do, so that a NaN stays NaN.
template <int kNTiles>
__device__ __forceinline__ void apply_keep_mask(float (&x)[1][kNTiles][4], uint64_t keep, float scale) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[0][nt][e] *= (keep >> (4 * nt + e)) & 1u ? scale : 0.f;
}
#endif  // __CUDACC__

}  // namespace jax_flash::cuda
