// Fused dropout's keep decisions (common/dropout_bits.h) for the score elements one thread holds in
// an mma.sync or wgmma accumulator fragment, so that a CUDA kernel drops exactly the elements the
// CPU kernel and jax_flash/_dropout.py drop. Host and device code (the one shuffle is in the
// device-only wrapper): the lane is the caller's, and tests/cpp/dropout_fragments_check.cc runs
// these functions for every lane of a warp on the host against the reference
// (tests/test_dropout_bits.py).
//
// A thread's accumulator of 16 rows x 8 columns (an n-tile) holds element e (0..3) at row
// row0 + 8 (e / 2) and column col0 + e % 2, with row0 = the warp's first row + lane / 4 (so
// row0 % 16 < 8) and col0 = the tile's first column + 2 (lane % 4) (even). A Philox call's eight
// 16-bit halves are rows r, r + 8 and columns c, c + 1, c + 8, c + 9 (r % 16 < 8, c % 16 < 8):
// - forward fragments (rows = query rows, columns = keys: S = Q K^T) of a pair of n-tiles (the
//   first at a multiple of 16 columns) hold one call's eight elements: one call, eight decisions;
// - transposed fragments (rows = keys, columns = query rows: the backward's S^T = K Q^T) of a
//   pair of n-tiles hold keys k, k + 8 and query rows q, q + 1, q + 8, q + 9: half of each of
//   two calls (row words q and q + 1), whose other halves are keys k ^ 1 and k ^ 1 + 8, which
//   lane ^ 4 holds with the same query rows. The lane of even k makes the call of q, the other
//   that of q + 1, and they swap the halves the other needs: one call per eight decisions.
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "common/dropout_bits.h"

namespace jax_flash::cuda {

// The keep decisions of one (batch element, query head): the Philox key, the counter's head,
// batch, row and column words (AttentionParams::dropout_seeds' words: DropoutSeedWord) and the
// threshold.
struct DropoutStream {
  uint32_t key0 = 0, key1 = 0, head = 0, batch = 0, row_word0 = 0, column_word0 = 0;
  uint32_t threshold = 0;  // 16-bit halves below it drop their element

  JF_HOST_DEVICE DropoutStream() {}
  JF_HOST_DEVICE DropoutStream(const uint32_t* seed, uint32_t threshold_)
      : key0(seed[kSeedKey0]),
        key1(seed[kSeedKey1]),
        head(seed[kSeedHead]),
        batch(seed[kSeedBatch]),
        row_word0(seed[kSeedRowWord]),
        column_word0(seed[kSeedColumnWord]),
        threshold(threshold_) {}

  // The Philox call of the group holding score element (row, column).
  JF_HOST_DEVICE PhiloxWords group_words(int64_t row, int64_t column) const {
    return philox4x32_10(dropout_counter(batch, head, row, column, row_word0, column_word0), key0, key1);
  }
  JF_HOST_DEVICE bool keeps(uint32_t bits16) const { return bits16 >= threshold; }
};

// The seeds' stream of (b, h) in params (which must have dropout_seeds).
JF_HOST_DEVICE inline DropoutStream dropout_stream(const AttentionParams& p, int64_t b, int64_t h) {
  return DropoutStream(p.dropout_seeds + (b * p.shape.heads_q + h) * kDropoutSeedWords, p.dropout_threshold);
}

// A forward pair of n-tiles' decisions (row0 % 16 < 8; col0 even, col0 % 16 < 8: the first
// n-tile's): bit 4 t + e keeps n-tile t's element e (row row0 + 8 (e / 2), column col0 + 8 t + e % 2).
JF_HOST_DEVICE inline uint32_t forward_keep_bits(const DropoutStream& d, int64_t row0, int64_t col0) {
  const PhiloxWords w = d.group_words(row0, col0);
  uint32_t bits = 0;
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      bits |= static_cast<uint32_t>(d.keeps(dropout_half(w.w[2 * (e / 2) + t], e % 2))) << (4 * t + e);
  return bits;
}

// The 16-bit halves of one parity of a call's four words, two to a word (word i's in the low half
// of x (i = 0) or y (i = 2) or the high half (i = 1, 3)): what a transposed fragment's lane sends
// to lane ^ 4.
struct HalfWords {
  uint32_t x = 0, y = 0;
  JF_HOST_DEVICE uint32_t half(int i) const { return ((i < 2 ? x : y) >> (16 * (i % 2))) & 0xFFFFu; }
};
JF_HOST_DEVICE inline HalfWords halves_of_parity(const PhiloxWords& w, int parity) {
  HalfWords h;
  h.x = dropout_half(w.w[0], parity) | dropout_half(w.w[1], parity) << 16;
  h.y = dropout_half(w.w[2], parity) | dropout_half(w.w[3], parity) << 16;
  return h;
}

// A transposed pair of n-tiles (keys key0 and key0 + 8, key0 % 16 < 8; query rows from query0,
// query0 % 16 == 2 (lane % 4)): the lane's own call, that of query row query0 + key0 % 2.
JF_HOST_DEVICE inline PhiloxWords transposed_pair_call(const DropoutStream& d, int64_t key0, int64_t query0) {
  return d.group_words(query0 + key0 % 2, key0);
}

// The pair's decisions from the lane's own call and the halves lane ^ 4 sent of its call
// (halves_of_parity(its call, key0 % 2)): bit 4 t + e keeps n-tile t's element e (key key0 + 8
// (e / 2), query row query0 + 8 t + e % 2).
JF_HOST_DEVICE inline uint32_t transposed_keep_bits(const DropoutStream& d, const PhiloxWords& own,
                                                    const HalfWords& other, int64_t key0) {
  const int parity = static_cast<int>(key0 % 2);
  uint32_t bits = 0;
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int word = 2 * t + e / 2;  // row half t, column half e / 2
      const uint32_t value = e % 2 == parity ? dropout_half(own.w[word], parity) : other.half(word);
      bits |= static_cast<uint32_t>(d.keeps(value)) << (4 * t + e);
    }
  return bits;
}

#ifdef __CUDACC__
// Zeroes the dropped probabilities of a forward block's 16-bit A fragments, as accumulator_to_a
// packs them (m-tile mt's n-tile nt's elements 2 half and 2 half + 1 in the low and high halves
// of a[nt / 2][mt][2 (nt % 2) + half]); row0 and col0 as forward_keep_bits' for m-tile 0's first
// pair of n-tiles (the m-tiles 16 rows apart).
template <int kNTiles, int kMTiles>
__device__ __forceinline__ void drop_forward_probabilities(uint32_t (&a)[kNTiles / 2][kMTiles][4],
                                                           const DropoutStream& d, int64_t row0, int64_t col0) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int pair = 0; pair < kNTiles / 2; ++pair) {
      const uint32_t bits = forward_keep_bits(d, row0 + 16 * mt, col0 + 16 * pair);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // n-tile 2 pair + i / 2, elements 2 (i % 2) and 2 (i % 2) + 1
        const uint32_t two = bits >> (2 * i);
        a[pair][mt][i] &= (two & 1u ? 0x0000FFFFu : 0u) | (two & 2u ? 0xFFFF0000u : 0u);
      }
    }
}

// The forward layout's decisions as a multiplier mask (bit 4 nt + e keeps element e of m-tile
// mt's n-tile nt, 16 n-tiles at most an m-tile): the mma.sync backward's S and dP tiles.
template <int kNTiles>
__device__ __forceinline__ uint64_t forward_keep_mask(const DropoutStream& d, int64_t row0, int64_t col0) {
  static_assert(kNTiles % 2 == 0 && kNTiles <= 16, "pairs of n-tiles, 64 decisions at most");
  uint64_t keep = 0;
#pragma unroll
  for (int pair = 0; pair < kNTiles / 2; ++pair)
    keep |= static_cast<uint64_t>(forward_keep_bits(d, row0, col0 + 16 * pair)) << (8 * pair);
  return keep;
}

// The keep decisions of a transposed fragment of kNTiles n-tiles (query rows from query0, query0
// % 16 == 2 (lane % 4); keys key0 and key0 + 8, key0 % 16 < 8): bit 4 nt + e keeps element e of
// n-tile nt. Every lane of the warp must call it together (a shuffle with lane ^ 4).
template <int kNTiles>
__device__ __forceinline__ uint64_t transposed_keep_mask(const DropoutStream& d, int64_t key0, int64_t query0) {
  static_assert(kNTiles % 2 == 0 && kNTiles <= 16, "pairs of n-tiles, 64 decisions at most");
  const int other_parity = static_cast<int>(key0 % 2) ^ 1;
  uint64_t keep = 0;
#pragma unroll
  for (int pair = 0; pair < kNTiles / 2; ++pair) {
    const PhiloxWords own = transposed_pair_call(d, key0, query0 + 16 * pair);
    const HalfWords sent = halves_of_parity(own, other_parity);
    HalfWords other;
    other.x = __shfl_xor_sync(0xFFFFFFFFu, sent.x, 4);
    other.y = __shfl_xor_sync(0xFFFFFFFFu, sent.y, 4);
    keep |= static_cast<uint64_t>(transposed_keep_bits(d, own, other, key0)) << (8 * pair);
  }
  return keep;
}

// x <- x * Z for a fragment of kNTiles n-tiles, Z = scale where bit 4 nt + e of keep is set, else
// 0: a multiply, as the CPU kernel and the references do, so that a NaN stays NaN.
template <int kNTiles>
__device__ __forceinline__ void apply_keep_mask(float (&x)[kNTiles][4], uint64_t keep, float scale) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[nt][e] *= (keep >> (4 * nt + e)) & 1u ? scale : 0.f;
}
#endif  // __CUDACC__

}  // namespace jax_flash::cuda
