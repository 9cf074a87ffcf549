// FlashAttention forward on the CPU: one task per (batch, query head, block of kBlockQ query
// rows). Each task streams the key/value blocks its rows can see through an online softmax;
// nothing of size seq_q x seq_k exists anywhere.
#pragma once

#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "common/dropout_bits.h"
#include "common/mask.h"
#include "cpu/fwd_products.h"
#include "cpu/logit_arrays.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "cpu/tile_gemm.h"
#include "cpu/tile_io.h"

namespace jax_flash::cpu::JF_ISA {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// A row's lse in natural units from its base-2 reference and sum, and back, in double so that
// each direction rounds once (a float32 product with a rounded ln 2 or log2 e rounds twice, and
// the backward's probabilities of a row all inherit that error, about |lse| 2^-24, as one
// common factor).
inline float natural_lse(float ref2, float sum) {
  return static_cast<float>((static_cast<double>(ref2) + std::log2(static_cast<double>(sum))) *
                            0.69314718055994530942);
}
inline float base2_lse(float lse) {
  return static_cast<float>(static_cast<double>(lse) * 1.44269504088896340736);
}


// Sets s[c] = -inf for the columns c of a score row (keys j0 + c) outside [keys.begin, keys.end)
// and for the padding columns [cols, padded_cols).
inline void mask_row(float* s, int64_t j0, int64_t cols, int64_t padded_cols, KeyRange keys) {
  const float neg_inf = -INFINITY;
  const int64_t lo = min64(max64(keys.begin - j0, 0), cols);
  const int64_t hi = max64(min64(keys.end - j0, cols), lo);
  for (int64_t c = 0; c < lo; ++c) s[c] = neg_inf;
  for (int64_t c = hi; c < padded_cols; ++c) s[c] = neg_inf;
}

// The reference a row's exponentials are taken against: its running max plus kSumHeadroom,
// raised further by the power of two that takes the earlier sum (rescaled to it) below 1. Each
// key block's probabilities then sum to at most 1 (blocks are at most 2^kSumHeadroom keys) and
// the row's sum stays below 2, so the unnormalised P V accumulator stays within twice the
// largest |value|: finite wherever jax.nn's normalised output is (values near FLT_MAX / keys
// overflowed it: issue 13 item 4). lse = (reference + log2 sum) ln 2 holds for any reference;
// keys more than 2^-121 below the max (not 2^-127) round to 0 (with AVX-512's exp2 to a subnormal
// down to 2^-143), far under float32's precision.
inline constexpr float kSumHeadroom = 6.f;
static_assert(kBlockK <= 64, "a block's probabilities sum to at most 2^kSumHeadroom");
// A forward whose key blocks hold up to 128 keys (both products classes of the forward: one
// P V product per 128 keys halves the loads and stores of the O^T tiles on the bfloat16 path,
// and the per-block work around the float32 products) takes one more bit of headroom, so
// that such a block's probabilities, each at most 2^-7, still sum to at most 1.
inline constexpr int64_t kWideKeyBlock = 128;
inline constexpr float kWideSumHeadroom = 7.f;
inline constexpr float sum_headroom(int64_t key_block) {
  return key_block <= 64 ? kSumHeadroom : kWideSumHeadroom;
}
// Where the reference must rise (a row's max passed it less the headroom), the wide blocks raise
// it `kWideRaiseSlack` more: a row's max then rarely passes it again, and every raise costs a
// rescale of that row's O^T (a 16-row group's), nearly every block with
// random scores. Probabilities only shrink by a power of two (each still at most 2^-7).
inline constexpr float kWideRaiseSlack = 2.f;
inline constexpr float raise_slack(int64_t key_block) {
  return key_block <= 64 ? 0.f : kWideRaiseSlack;
}
// A block mask's blocks (kBlockMaskRows x kBlockMaskKeys, attention_params.h) hold whole tiles:
// a tile on the tile grid (rows from a multiple of kBlockQ, keys from a multiple of kBlockK)
// lies inside one mask block, whose bit decides it whole.
static_assert(kBlockMaskRows % kBlockQ == 0 && kBlockMaskKeys % kBlockK == 0 &&
                  kBlockMaskKeys % kWideKeyBlock == 0,
              "the CPU tiles must divide the block mask's block");

inline float raised_reference(float old_ref, float tile_max, float old_sum) {
  const float headroom = tile_max + kSumHeadroom;
  const float ref = old_ref > headroom ? old_ref : headroom;  // NaN (a NaN score) stays NaN
  const float earlier = old_ref == -INFINITY ? 0.f : old_sum * __builtin_exp2f(old_ref - ref);
  if (!(earlier >= 1.f) || earlier == INFINITY) return ref;
  int exponent;
  std::frexp(earlier, &exponent);  // earlier in [2^(exponent - 1), 2^exponent)
  return ref + static_cast<float>(exponent);
}

// The same for kLanes rows.
inline Vec raised_reference(Vec old_ref, Vec tile_max, Vec old_sum,
                            float sum_headroom = kSumHeadroom, float slack = 0.f) {
  const Vec neg_inf = splat(-INFINITY);
  const Vec headroom = tile_max + sum_headroom;
  // (old_ref == headroom keeps old_ref either way; a NaN max gives NaN.)
  const Vec ref = old_ref >= headroom ? old_ref : headroom + slack;
  const Vec earlier = old_ref == neg_inf ? Vec{} : old_sum * exp2_nonpositive(old_ref - ref);
  IVec bits;
  std::memcpy(&bits, &earlier, sizeof(bits));
  // For earlier in [1, inf): its exponent field minus 126 is the exponent that frexp gives.
  const IVec exponent = ((bits >> 23) & 0xFF) - 126;
  const IVec raise = (earlier >= 1.f) & (earlier < INFINITY);
  return raise ? ref + __builtin_convertvector(exponent, Vec) : ref;
}

// Online softmax step for one row of base-2 scores s (padded_cols wide, masked entries -inf):
// turns s into probabilities relative to the row's new reference (raised_reference) and returns
// the factor by which the row's earlier accumulators must be rescaled. A NaN score stays NaN in
// its probability and the row's sum (so the output shows it, as jax.nn's does); a row that has
// met only -inf scores so far keeps reference -inf and takes its exponentials relative to 0 (0
// for -inf, NaN for NaN). (The forward uses the transposed form below; this one serves
// row-major callers.)
inline float softmax_row_update(float* s, int64_t padded_cols, float& row_ref, float& row_sum) {
  Vec mx = splat(-INFINITY);
  for (int64_t c = 0; c < padded_cols; c += kLanes) mx = vmax(mx, load(s + c));
  const float new_ref = raised_reference(row_ref, reduce_max(mx), row_sum);
  const Vec m = splat(new_ref == -INFINITY ? 0.f : new_ref);
  Vec sum = Vec{};
  for (int64_t c = 0; c < padded_cols; c += kLanes) {
    const Vec p = exp2_nonpositive(load(s + c) - m);
    store(s + c, p);
    sum += p;
  }
  // Nothing but -inf seen before: the accumulators hold 0 (or NaN, which 0 keeps).
  const float correction = row_ref == -INFINITY ? 0.f : __builtin_exp2f(row_ref - new_ref);
  row_sum = row_sum * correction + reduce_sum(sum);
  row_ref = new_ref;
  return correction;
}

// The same on a column of transposed scores (key c of the column at s[c * ld]), keys [0, cols).
inline void mask_column(float* s, int64_t ld, int64_t j0, int64_t cols, KeyRange keys) {
  const float neg_inf = -INFINITY;
  const int64_t lo = min64(max64(keys.begin - j0, 0), cols);
  const int64_t hi = max64(min64(keys.end - j0, cols), lo);
  for (int64_t c = 0; c < lo; ++c) s[c * ld] = neg_inf;
  for (int64_t c = hi; c < cols; ++c) s[c * ld] = neg_inf;
}

// Online softmax step for kLanes query rows at once, on transposed base-2 scores: st[c * ld] is
// the vector of the kLanes rows' scores for key c < cols (masked entries -inf). Turns the scores
// into probabilities relative to the rows' new references (raised_reference) and returns the
// factors by which the rows' earlier accumulators must be rescaled. A NaN score stays NaN in its
// probability and the row's sum (so the output shows it, as jax.nn's does); a row that has met
// only -inf scores so far keeps reference -inf and takes its exponentials relative to 0 (0 for
// -inf, NaN for NaN). Every reduction runs across keys, lane by lane: no horizontal operation.
inline Vec softmax_columns_update(float* st, int64_t ld, int64_t cols, float* row_ref,
                                  float* row_sum, float sum_headroom = kSumHeadroom,
                                  float slack = 0.f) {
  const Vec neg_inf = splat(-INFINITY);
  Vec mx0 = neg_inf, mx1 = neg_inf;
  int64_t c = 0;
  for (; c + 1 < cols; c += 2) {
    mx0 = vmax(mx0, load(st + c * ld));
    mx1 = vmax(mx1, load(st + (c + 1) * ld));
  }
  if (c < cols) mx0 = vmax(mx0, load(st + c * ld));
  // vmax may drop a NaN met earlier in a chain (as the one-row form's does); a NaN score reaches
  // the output through its probability anyway.
  const Vec old_ref = load(row_ref);
  const Vec new_ref = raised_reference(old_ref, vmax(mx0, mx1), load(row_sum), sum_headroom, slack);
  const Vec m = new_ref == neg_inf ? Vec{} : new_ref;
  Vec sum0 = Vec{}, sum1 = Vec{};
  for (c = 0; c + 1 < cols; c += 2) {
    const Vec p0 = exp2_nonpositive(load(st + c * ld) - m);
    const Vec p1 = exp2_nonpositive(load(st + (c + 1) * ld) - m);
    store(st + c * ld, p0);
    store(st + (c + 1) * ld, p1);
    sum0 += p0;
    sum1 += p1;
  }
  if (c < cols) {
    const Vec p0 = exp2_nonpositive(load(st + c * ld) - m);
    store(st + c * ld, p0);
    sum0 += p0;
  }
  // Nothing but -inf seen before: the accumulators hold 0 (or NaN, which 0 keeps).
  const Vec correction = old_ref == neg_inf ? Vec{} : exp2_nonpositive(old_ref - new_ref);
  store(row_sum, load(row_sum) * correction + (sum0 + sum1));
  store(row_ref, new_ref);
  return correction;
}

// The segment-id mask on a column of transposed scores: s[c * ld] = -inf for the keys c < cols
// outside [keys.begin, keys.end) (as mask_column) or whose id kv_ids[c] differs from the row's
// `id`. Returns whether some key survives both.
inline bool mask_column_segment(float* s, int64_t ld, int64_t j0, int64_t cols, KeyRange keys,
                                const int32_t* kv_ids, int32_t id) {
  mask_column(s, ld, j0, cols, keys);
  const int64_t lo = min64(max64(keys.begin - j0, 0), cols);
  const int64_t hi = max64(min64(keys.end - j0, cols), lo);
  bool any = false;
  for (int64_t c = lo; c < hi; ++c) {
    if (kv_ids[c] != id) s[c * ld] = -INFINITY;
    else any = true;
  }
  return any;
}

// Logit soft-capping (Gemma 2), the one score policy both passes apply to a tile of base-2
// scores s2 = scale * log2(e) * q.k right after the product that forms it (before the masks):
// s2 becomes c2 * tanh(s2 / c2) with c2 = c * log2(e), which is log2(e) * c * tanh(scale q.k / c).
// Off (c2 == 0) the kernels skip it with one branch per tile.
struct SoftCap {
  float c2 = 0.f;      // c * log2(e); 0: off
  float inv_c2 = 0.f;  // 1 / c2
  explicit SoftCap(float c) : c2(c * kLog2e), inv_c2(c > 0.f ? 1.f / (c * kLog2e) : 0.f) {}
  explicit operator bool() const { return c2 > 0.f; }
};

// Caps s[0, n) (n a multiple of kLanes) in place; with `deriv`, also writes there the derivative
// of the capped score by the raw one, 1 - tanh^2(u) (u = s2 / c2), which the backward multiplies
// dS by. With a = |u| and e = exp(-2a): tanh(a) = (1 - e) / (1 + e) and 1 - tanh^2 = 4e / (1 + e)^2
// (no cancellation as tanh nears 1); below a = 0.25, where 1 - e would cancel, s2 * tanh(u) / u
// from its Taylor series to u^8 (truncation < 1e-8 relative), which also keeps the raw score
// exactly where u underflows (a huge c). A NaN score stays NaN; +-inf caps to +-c2.
inline void soft_cap(float* s, int64_t n, const SoftCap& cap, float* deriv) {
  const Vec c2 = splat(cap.c2), inv_c2 = splat(cap.inv_c2);
  for (int64_t x = 0; x < n; x += kLanes) {
    const Vec s2 = load(s + x);
    const Vec u = s2 * inv_c2;
    const Vec a = u < 0.f ? -u : u;
    const Vec e = exp2_nonpositive(a * (-2.f * kLog2e));
    const Vec z = a * a;
    Vec r = splat(62.f / 2835.f);
    r = r * z - 17.f / 315.f;
    r = r * z + 2.f / 15.f;
    r = r * z - 1.f / 3.f;
    r = r * z + 1.f;
    const Vec one_plus_e = 1.f + e;
    const Vec big = c2 * (1.f - e) / one_plus_e;
    store(s + x, a < 0.25f ? s2 * r : (u < 0.f ? -big : big));
    if (deriv) store(deriv + x, 4.f * e / (one_plus_e * one_plus_e));
  }
}

// ALiBi, the second score policy: the score of query row i and key j gains slope * (j - i), in
// base 2 slope2 = slope * log2(e) times (j - i), added to each tile right after the soft cap
// (before the masks: a masked score is -inf whatever it gained), so nothing T x S is stored.
// i and j are the indices the masks compare (common/mask.h). Both passes form j - i as an
// integer, converted to float once (exact below 2^24), and add slope2 * (j - i) to the score:
// the backward recomputes the forward's biased scores value for value. Off (no slopes) the
// kernels skip it with one branch per tile.
struct Alibi {
  float slope2 = 0.f;  // slope * log2(e) of this (batch, query head)
  bool on = false;
  Alibi(const float* slopes, int64_t index)
      : slope2(slopes ? slopes[index] * kLog2e : 0.f), on(slopes != nullptr) {}
  explicit operator bool() const { return on; }
};

// {0, 1, ..., kLanes - 1}.
inline Vec lane_indices() {
  Vec v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(l);
  return v;
}

// ALiBi on transposed scores: st[c * ld + r] is query row i0 + r and key j0 + c, for c < cols and
// r < rows (a multiple of kLanes); `offset` = j0 - i0.
inline void alibi_columns(float* st, int64_t ld, int64_t cols, int64_t rows, int64_t offset,
                          const Alibi& alibi) {
  const Vec slope2 = splat(alibi.slope2), lanes = lane_indices();
  for (int64_t c = 0; c < cols; ++c) {
    float* column = st + c * ld;
    for (int64_t r = 0; r < rows; r += kLanes) {
      const Vec distance = splat(static_cast<float>(offset + c - r)) - lanes;  // j - i
      store(column + r, load(column + r) + slope2 * distance);
    }
  }
}

// ALiBi on row-major scores: s[r * ld + c] is query row i0 + r and key j0 + c, for r < rows and
// c < cols (a multiple of kLanes); `offset` = j0 - i0.
inline void alibi_rows(float* s, int64_t ld, int64_t rows, int64_t cols, int64_t offset,
                       const Alibi& alibi) {
  const Vec slope2 = splat(alibi.slope2), lanes = lane_indices();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    for (int64_t c = 0; c < cols; c += kLanes) {
      const Vec distance = splat(static_cast<float>(offset - r + c)) + lanes;  // j - i
      store(row + c, load(row + c) + slope2 * distance);
    }
  }
}

// Fused dropout (FlashAttention's), the third tile policy: the keep decision of the score
// element of query row i and key j is common/dropout_bits.h's Philox word of (i, j) under this
// (batch, query head)'s seed words, compared with the threshold; both passes regenerate it per
// tile, so nothing T x S is stored and the backward drops what the forward dropped. The
// forward zeroes the dropped probabilities before P V and scales the output row by
// 1 / (1 - rate) where it divides by the row sum (which, like the lse, keeps every
// probability); the backward forms Z = keep / (1 - rate) per tile (dropout_multipliers). Off
// (no seeds) the kernels skip it with one branch per tile.
struct Dropout {
  uint32_t key0 = 0, key1 = 0;  // the Philox key
  uint32_t head = 0, batch = 0;  // the counter's head and batch words
  uint32_t row_word0 = 0, column_word0 = 0;  // the counter's row and column words of row 0, key 0
  uint32_t threshold = 0;  // 16-bit halves below it drop their element
  float scale = 1.f;  // 1 / (1 - rate)
  bool on = false;
  Dropout(const AttentionParams& p, int64_t b, int64_t h) {
    if (!p.dropout_seeds) return;
    const uint32_t* seed = p.dropout_seeds + (b * p.shape.heads_q + h) * kDropoutSeedWords;
    key0 = seed[kSeedKey0], key1 = seed[kSeedKey1], head = seed[kSeedHead], batch = seed[kSeedBatch];
    row_word0 = seed[kSeedRowWord], column_word0 = seed[kSeedColumnWord];
    threshold = p.dropout_threshold;
    scale = p.dropout_scale;
    on = true;
  }
  explicit operator bool() const { return on; }
};

typedef uint32_t UVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
// The same bits as kLanes / 2 64-bit lanes: lane l holds 32-bit lanes 2l (low half) and 2l + 1.
typedef uint64_t UPairs __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline UPairs as_pairs(UVec x) {
  UPairs y;
  std::memcpy(&y, &x, sizeof(y));
  return y;
}
inline UVec as_lanes(UPairs x) {
  UVec y;
  std::memcpy(&y, &x, sizeof(y));
  return y;
}

// The 64-bit products of the low halves of x's and k's 64-bit lanes (x86's pmuludq: one
// instruction, where the compiler makes a general 64-bit product of several).
inline UPairs mul_low_halves(UPairs x, UPairs k) {
#if defined(__x86_64__) || defined(__i386__)
#if JF_SIMD_LANES == 16
  return reinterpret_cast<UPairs>(_mm512_mul_epu32(reinterpret_cast<__m512i>(x), reinterpret_cast<__m512i>(k)));
#elif JF_SIMD_LANES == 8
  return reinterpret_cast<UPairs>(_mm256_mul_epu32(reinterpret_cast<__m256i>(x), reinterpret_cast<__m256i>(k)));
#else
  return reinterpret_cast<UPairs>(_mm_mul_epu32(reinterpret_cast<__m128i>(x), reinterpret_cast<__m128i>(k)));
#endif
#else
  return (x & 0xFFFFFFFFull) * (k & 0xFFFFFFFFull);
#endif
}

// The high and low 32-bit words of x * k, lane by lane: the even lanes' products and the odd
// lanes' (shifted down into the low halves) taken apart and interleaved again.
inline void mul_hi_lo(UVec x, uint32_t k, UVec& hi, UVec& lo) {
  const UPairs kk = static_cast<uint64_t>(k) - UPairs{};
  const UPairs even = mul_low_halves(as_pairs(x), kk), odd = mul_low_halves(as_pairs(x) >> 32, kk);
  hi = as_lanes((even >> 32) | (odd & 0xFFFFFFFF00000000ull));
  lo = as_lanes((even & 0xFFFFFFFFull) | (odd << 32));
}

// Philox4x32-10 (common/dropout_bits.h's philox4x32_10) on kLanes counters at once: w[0..3]
// are the counters' words, lane by lane; they become the four output words.
inline void philox_lanes(UVec w[4], uint32_t key0, uint32_t key1) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    UVec hi0, lo0, hi1, lo1;
    mul_hi_lo(w[0], kPhiloxMul0, hi0, lo0);
    mul_hi_lo(w[2], kPhiloxMul1, hi1, lo1);
    w[0] = hi1 ^ w[1] ^ key0;
    w[1] = lo1;
    w[2] = hi0 ^ w[3] ^ key1;
    w[3] = lo0;
    key0 += kPhiloxBump0;
    key1 += kPhiloxBump1;
  }
}

// Rows of a tile of keep decisions that dropout_columns produces together: one group of 16
// rows (dropout_bits.h's call covers rows i and i + 8), two with 16 lanes.
inline constexpr int64_t kDropoutRows = kLanes > 8 ? 32 : 16;

// The keep decisions of a tile, kLanes query rows a vector, as the forward's transposed scores
// want them: calls apply(c, r, keep) for every key j0 + c (0 <= c < cols) and every vector of
// the rows i0 + r, ..., i0 + r + kLanes - 1 (0 <= r < round_up(rows, kDropoutRows), r a multiple
// of kLanes), `keep` the mask of the lanes whose element dropout keeps. i0 must be a multiple
// of kDropoutRows. dropout_bits.h's layout: the Philox call of row word (i / 16) * 8 + i % 8 and
// column word (j / 16) * 4 + (j % 16) / 2 (j even, j % 16 < 8) gives the bits of keys j, j + 1
// (word 0's halves) and j + 8, j + 9 (word 1's) for row i, words 2 and 3 for row i + 8; kLanes
// consecutive row words go through the rounds together, so words 0 and 1 are the keys'
// decisions for kLanes consecutive rows of one 16-row group (the first 8), words 2 and 3 for the
// next rows (the last 8); with 16 lanes two groups, regrouped by a shuffle.
template <typename Apply>
inline void dropout_columns(const Dropout& dropout, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                            Apply&& apply) {
  UVec lanes;
  for (int l = 0; l < kLanes; ++l) lanes[l] = static_cast<uint32_t>(l);
  const UVec threshold = dropout.threshold - UVec{};
  const int64_t group_begin = j0 / 16, group_end = (j0 + cols + 15) / 16;  // 16-key groups
  for (int64_t span = 0; span < rows; span += kDropoutRows) {
    const int64_t first_word = dropout.row_word0 + (i0 + span) / 2;  // the span's first row word: 8 per 16 rows
    for (int64_t w0 = 0; w0 < kDropoutRows / 2; w0 += kLanes) {
      const UVec row_words = static_cast<uint32_t>(first_word + w0) + lanes;
      for (int64_t group = group_begin; group < group_end; ++group)
        for (int pair = 0; pair < 4; ++pair) {
          UVec w[4] = {dropout.column_word0 + static_cast<uint32_t>(group * 4 + pair) - UVec{}, row_words,
                       dropout.head - UVec{}, dropout.batch - UVec{}};
          philox_lanes(w, dropout.key0, dropout.key1);
          for (int k = 0; k < 4; ++k) {  // keys + 0, + 1 (word 0's halves), + 8, + 9 (word 1's)
            const int64_t c = 16 * group + 2 * pair + 8 * (k / 2) + k % 2 - j0;  // the tile column
            if (c < 0 || c >= cols) continue;
            const int word = k / 2;
            // rows +0..7 and +8..15 of a group
            const UVec top = k % 2 ? w[word] >> 16 : w[word] & 0xFFFFu;
            const UVec bottom = k % 2 ? w[2 + word] >> 16 : w[2 + word] & 0xFFFFu;
#if JF_SIMD_LANES == 16
            // Lanes 0-7 are the first group's rows, 8-15 the second's.
            const UVec first = __builtin_shufflevector(top, bottom, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                                       20, 21, 22, 23);
            const UVec second = __builtin_shufflevector(top, bottom, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                                        26, 27, 28, 29, 30, 31);
            apply(c, span, first >= threshold);
            apply(c, span + 16, second >= threshold);
#else
            apply(c, span + w0, top >= threshold);
            apply(c, span + 8 + w0, bottom >= threshold);
#endif
          }
        }
    }
  }
}

// Whether the key range of a row meets the keys [j0, j0 + cols).
inline bool range_meets(KeyRange keys, int64_t j0, int64_t cols) {
  return max64(keys.begin, j0) < min64(keys.end, j0 + cols);
}

// Calls with at least this many tasks of two query blocks take them two a task (FlashFwd):
// fewer would leave cores idle where the blocks' lengths differ (a causal mask's).
inline constexpr int64_t kMinPairedTasks = 16;

// The forward of one call: T the inputs' dtype, Products the two tile products and the layout of
// the query tile and output accumulator they own (fwd_products.h: float32 tiles;
// bf16_fwd_products.h: bfloat16 on AMX or vdpbf16ps tiles).
//
// A task is one query block of kBlockQ rows, or two neighbouring ones where Products allows it
// (kPairsQueryBlocks) and the call has tasks enough: the two then walk their key blocks in step,
// so that each K and V^T block, brought from L3 for the first, serves the second from L2. At
// seq 8192 a head's K and V^T are 8 MiB (hd 128), streamed from L3 once per 64 rows otherwise.
template <typename T, typename Products = FloatFwdProducts<T>>
struct FlashFwd {
  const FwdParams& p;
  const typename Products::Shared& shared;
  int64_t q_blocks;         // per (batch, head)
  int64_t blocks_per_task;  // 1 or 2
  int64_t tasks_per_head;
  int64_t block_floats;     // one query block's scratch, a whole number of cache lines

  // Key tile rows: Products::kKeyBlock (128 for both products classes), with the headroom
  // that block size needs.
  static constexpr int64_t kp = Products::kKeyBlock;
  static_assert(kp <= kWideKeyBlock && kp % kLanes == 0, "the headroom covers the block");
  static constexpr float kHeadroom = sum_headroom(kp), kSlack = raise_slack(kp);
  static constexpr int64_t qp = kBlockQ;  // query columns of S^T, a multiple of kLanes

  FlashFwd(const FwdParams& params, const typename Products::Shared& shared_state)
      : p(params), shared(shared_state), q_blocks(ceil_div(params.shape.seq_q, kBlockQ)) {
    const AttentionShape& sh = p.shape;
    const bool pair = Products::kPairsQueryBlocks && q_blocks > 1 &&
                      sh.batch * sh.heads_q * ceil_div(q_blocks, 2) >= kMinPairedTasks;
    blocks_per_task = pair ? 2 : 1;
    tasks_per_head = ceil_div(q_blocks, blocks_per_task);
    block_floats = round_up(kp * qp + 4 * qp + Products::scratch_floats(sh), 16);
  }

  int64_t num_tasks() const { return p.shape.batch * p.shape.heads_q * tasks_per_head; }

  // What a task's query blocks share: their (batch, query head), lengths, K and V, and the
  // score policies.
  struct Head {
    int64_t b, h, hk;
    int64_t q_len, kv_len;
    int64_t q_stride, o_stride;
    const T* k;
    const T* v;
    int64_t k_stride, v_stride;
    const int32_t* kv_ids;  // the batch element's key segment ids (null without)
    float score_scale;      // scores in base 2: exp2 instead of exp
    SoftCap cap;
    Alibi alibi;
    Dropout dropout;
    int64_t bias_base, mask_base;
    // With segment ids, a block mask or a mask array, `seen` decides empty rows (a row whose
    // keys the masks all hide); without, key_range alone does.
    bool track_seen;

    Head(const FwdParams& p, int64_t b_, int64_t h_)
        : b(b_),
          h(h_),
          hk(h_ / p.shape.group()),
          q_len(clamp_len(p.q_lens, b_, p.shape.seq_q)),
          kv_len(clamp_len(p.kv_lens, b_, p.shape.seq_k)),
          q_stride(p.shape.heads_q * p.shape.head_dim),
          o_stride(p.shape.heads_q * p.shape.head_dim_v),
          k(static_cast<const T*>(p.k) + b_ * p.shape.seq_k * p.shape.heads_k * p.shape.head_dim +
            hk * p.shape.head_dim),
          v(static_cast<const T*>(p.v) + b_ * p.shape.seq_k * p.shape.heads_k * p.shape.head_dim_v +
            hk * p.shape.head_dim_v),
          k_stride(p.shape.heads_k * p.shape.head_dim),
          v_stride(p.shape.heads_k * p.shape.head_dim_v),
          kv_ids(p.kv_segment_ids ? p.kv_segment_ids + b_ * p.shape.seq_k : nullptr),
          score_scale(p.scale * kLog2e),
          cap(p.logits_soft_cap),
          alibi(p.alibi_slopes, b_ * p.shape.heads_q + h_),
          dropout(p, b_, h_),
          bias_base(p.bias ? p.bias.offset(b_, h_) : 0),
          mask_base(p.logit_mask ? p.logit_mask.offset(b_, h_) : 0),
          track_seen(kv_ids || p.block_mask != nullptr || p.logit_mask) {}
  };

  // One query block of kBlockQ rows from i0: its scratch (transposed scores, row statistics,
  // then the products' own tiles: the query tile, the output accumulator, K and V tiles), and
  // the key blocks it visits, [j_begin, j_end) in steps of kp. Scores are formed transposed,
  // S^T = K Q^T (keys x query rows): K is then read row by row as it lies (no transposed copy
  // of every K tile) and the softmax's reductions over keys run down columns, kLanes query rows
  // a vector.
  struct QueryBlock {
    int64_t i0, rows, live_rows;
    int64_t nq;  // query columns computed
    float* scores_t;
    float* row_ref;
    float* row_sum;
    float* correction;
    // With segment ids, 1 where a row has met a key the masks let through: a row whose document
    // has no visible key is empty. (Without them key_range decides that alone.)
    float* seen;
    Products products;
    const int32_t* q_ids;  // the block's rows' segment ids (null without)
    IdSpan q_span;
    KeyRange first, last;  // the key ranges of the block's first and last live rows
    int64_t mask_block_row;  // the block's row of mask blocks
    int64_t j_begin, j_end;

    QueryBlock(const FwdParams& p, const typename Products::Shared& shared, const Head& head,
               int64_t qb, float* scratch)
        : i0(qb * kBlockQ),
          rows(min64(kBlockQ, p.shape.seq_q - i0)),
          live_rows(max64(0, min64(rows, head.q_len - i0))),
          nq(round_up(live_rows, Products::kRowAlign)),
          scores_t(scratch),
          row_ref(scores_t + kp * qp),
          row_sum(row_ref + qp),
          correction(row_sum + qp),
          seen(correction + qp),
          products(p, shared, head.b, head.hk, seen + qp),
          q_ids(p.q_segment_ids ? p.q_segment_ids + head.b * p.shape.seq_q + i0 : nullptr),
          q_span(q_ids && live_rows > 0 ? id_span(q_ids, live_rows) : IdSpan{0, 0}),
          first{0, 0},
          last{0, 0},
          mask_block_row(i0 / kBlockMaskRows),
          j_begin(0),
          j_end(0) {
      if (live_rows == 0) return;  // no key block to visit
      const T* q = static_cast<const T*>(p.q) + (head.b * p.shape.seq_q + i0) * head.q_stride +
                   head.h * p.shape.head_dim;
      products.load_queries(q, head.q_stride, live_rows);
      for (int64_t r = 0; r < qp; ++r) {
        row_ref[r] = -INFINITY;
        row_sum[r] = 0.f;
        seen[r] = 0.f;
      }
      first = key_range(p.mask, i0, head.q_len, head.kv_len);
      last = key_range(p.mask, i0 + live_rows - 1, head.q_len, head.kv_len);
      // A block mask: key tiles on the tile grid (aligned at key 0, kp keys, so each inside
      // one kBlockMaskKeys mask block), those whose block it hides from this tile's rows never
      // visited; `seen` decides empty rows as with segment ids.
      j_begin = p.block_mask ? first.begin / kp * kp : first.begin;
      j_end = max64(j_begin, last.end);
    }
  };

  void operator()(int64_t task) const {
    const AttentionShape& sh = p.shape;
    // Last query blocks first: under a causal mask they are the longest tasks.
    const int64_t qb = (tasks_per_head - 1 - task % tasks_per_head) * blocks_per_task;
    const Head head(p, task / (tasks_per_head * sh.heads_q), (task / tasks_per_head) % sh.heads_q);
    float* scratch = thread_scratch(blocks_per_task * block_floats);
    QueryBlock a(p, shared, head, qb, scratch);
    if (qb + 1 >= q_blocks || blocks_per_task == 1) {
      for (int64_t j0 = a.j_begin; j0 < a.j_end; j0 += kp) key_block(head, a, j0);
      write_output(head, a);
      return;
    }
    // Two blocks in step: the n-th key block of each (the same block where both start at the
    // same key, as without a window or with a causal mask alone).
    QueryBlock b(p, shared, head, qb + 1, scratch + block_floats);
    for (int64_t ja = a.j_begin, jb = b.j_begin; ja < a.j_end || jb < b.j_end; ja += kp, jb += kp) {
      if (ja < a.j_end) key_block(head, a, ja);
      if (jb < b.j_end) key_block(head, b, jb);
    }
    write_output(head, a);
    write_output(head, b);
  }

  // One online-softmax step of a query block over the keys [j0, j0 + kp) (fewer at the end):
  // the scores, the score policies and masks, the softmax, O^T += V^T P^T.
  void key_block(const Head& head, QueryBlock& blk, int64_t j0) const {
    const int64_t i0 = blk.i0, live_rows = blk.live_rows, nq = blk.nq;
    const KeyRange first = blk.first, last = blk.last;
    float* scores_t = blk.scores_t;
    const int32_t* q_ids = blk.q_ids;
    const int32_t* kv_ids = head.kv_ids;
    const LogitArray& bias = p.bias;
    const LogitArray& logit_mask = p.logit_mask;
    const int64_t q_len = head.q_len, kv_len = head.kv_len;
    const int64_t cols = min64(kp, last.end - j0);
    // Block-sparse: a tile of a hidden mask block is skipped.
    if (p.block_mask && !p.block_visible(head.b, head.h, blk.mask_block_row, j0 / kBlockMaskKeys)) return;
    // Segment ids: a tile whose keys' ids cannot meet the rows' is skipped whole; one where
    // rows and keys share a single id needs no element mask.
    bool split_ids = false;
    if (kv_ids) {
      const IdSpan k_span = id_span(kv_ids + j0, cols);
      if (!blk.q_span.meets(k_span)) return;
      split_ids = !blk.q_span.same_single_id(k_span);
    }
    // A tile the mask array hides from every row is skipped.
    if (logit_mask && !mask_tile_any(logit_mask, head.mask_base, i0, live_rows, j0, cols)) return;
    blk.products.scores(head.k + j0 * head.k_stride, head.k_stride, j0, cols, nq, head.score_scale, scores_t);
    if (head.cap)
      for (int64_t c = 0; c < cols; ++c) soft_cap(scores_t + c * qp, nq, head.cap, nullptr);
    if (head.alibi) alibi_columns(scores_t, qp, cols, nq, j0 - i0, head.alibi);
    if (bias) bias_columns(scores_t, qp, bias, head.bias_base, i0, live_rows, j0, cols, kLog2e);
    // Masks apply only on tiles some row sees partly (the diagonal, window edges), and
    // wherever a mask array is given.
    const bool whole = j0 >= last.begin && j0 + cols <= first.end;
    float* seen = blk.seen;
    if (logit_mask) {
      for (int64_t r = 0; r < live_rows; ++r) {
        const KeyRange keys = key_range(p.mask, i0 + r, q_len, kv_len);
        mask_column(scores_t + r, qp, j0, cols, keys);
        if (mask_keys(scores_t + r, qp, j0, cols, keys, mask_row_at(logit_mask, head.mask_base, i0 + r, j0),
                      logit_mask.col, split_ids ? kv_ids + j0 : nullptr, split_ids ? q_ids[r] : 0))
          seen[r] = 1.f;
      }
    } else if (split_ids) {
      for (int64_t r = 0; r < live_rows; ++r)
        if (mask_column_segment(scores_t + r, qp, j0, cols, key_range(p.mask, i0 + r, q_len, kv_len),
                                kv_ids + j0, q_ids[r]))
          seen[r] = 1.f;
    } else if (!whole) {
      for (int64_t r = 0; r < live_rows; ++r) {
        const KeyRange keys = key_range(p.mask, i0 + r, q_len, kv_len);
        mask_column(scores_t + r, qp, j0, cols, keys);
        if (head.track_seen && range_meets(keys, j0, cols)) seen[r] = 1.f;
      }
    } else if (head.track_seen) {
      for (int64_t r = 0; r < live_rows; ++r) seen[r] = 1.f;
    }
    for (int64_t r = 0; r < nq; r += kLanes)
      store(blk.correction + r, softmax_columns_update(scores_t + r, qp, cols, blk.row_ref + r,
                                                       blk.row_sum + r, kHeadroom, kSlack));
    blk.products.rescale(blk.correction, live_rows, nq);
    // Dropout: the dropped probabilities of the rows' P (S^T, key c at scores_t[c * qp])
    // become 0; the row sums above keep them, and 1 / (1 - rate) joins 1 / row sum below.
    if (head.dropout)
      dropout_columns(head.dropout, i0, live_rows, j0, cols, [&](int64_t c, int64_t r, IVec keep) {
        float* s = scores_t + c * qp + r;
        store(s, keep ? load(s) : Vec{});
      });
    // O += P V, P read from S^T.
    blk.products.accumulate(scores_t, head.v + j0 * head.v_stride, head.v_stride, j0, cols, live_rows, nq);
  }

  // The block's output rows and lse. A row is empty when the masks leave it no key, never
  // because of its values: a NaN sum (a NaN or inf in the inputs) gives a NaN output and lse,
  // as jax.nn's does.
  void write_output(const Head& head, QueryBlock& blk) const {
    const AttentionShape& sh = p.shape;
    const int64_t hv = sh.head_dim_v;
    const int64_t out_offset = (head.b * sh.seq_q + blk.i0) * head.o_stride + head.h * hv;
    float* lse = p.lse + (head.b * sh.heads_q + head.h) * sh.seq_q + blk.i0;
    for (int64_t r = 0; r < blk.rows; ++r) {
      const bool empty = r >= blk.live_rows || key_range(p.mask, blk.i0 + r, head.q_len, head.kv_len).empty() ||
                         (head.track_seen && blk.seen[r] == 0.f);
      const float inv = empty ? 0.f : p.dropout_scale / blk.row_sum[r];  // dropout_scale 1: none
      const int64_t out_row = out_offset + r * head.o_stride;
      if (p.o_float32)
        empty ? store_zeros(hv, static_cast<float*>(p.o) + out_row)
              : blk.products.store_output_row(r, inv, static_cast<float*>(p.o) + out_row);
      else
        empty ? store_zeros(hv, static_cast<T*>(p.o) + out_row)
              : blk.products.store_output_row(r, inv, static_cast<T*>(p.o) + out_row);
      lse[r] = empty ? kEmptyRowLse : natural_lse(blk.row_ref[r], blk.row_sum[r]);
    }
    blk.products.finish();
  }
};

template <typename T, typename Products = FloatFwdProducts<T>>
void flash_fwd_typed(const FwdParams& params, const TaskRunner& runner) {
  typename Products::Shared shared(params, runner);
  FlashFwd<T, Products> kernel(params, shared);
  parallel_for(runner, kernel.num_tasks(), kernel);
  shared.release();
}

}  // namespace jax_flash::cpu::JF_ISA
