// Products on bfloat16 tiles, float32 accumulation, for the bfloat16 forward and backward
// (bf16_fwd_products.h, bf16_bwd_products.h): one interface, two machines. With JF_AMX (the
// avx512_amx variant) on AMX tiles (amx_tiles.h), else with AVX-512 BF16's vdpbf16ps
// (dpbf16_tiles.h, the avx512_bf16 variant).
//
// The unit is the AMX tile product: C[16 x 16] (float32) += A[16 x 32] B[32 x 16] (bfloat16),
// A row-major and B in "VNNI pairs": row kk of the B tile holds, for each of its 16 columns n,
// the 32-bit pair (B[2kk][n] low, B[2kk + 1][n] high); every tile is 16 rows of 64 bytes.
// tile_block_2x2 runs a 2 x 2 block of them; the packings below make the operands.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/tile_io.h"

#if !defined(__AVX512BF16__)
#error "bf16_tiles.h needs -mavx512bf16"
#endif

namespace jax_flash::cpu::JF_ISA {

inline constexpr int64_t kTileRows = 16;   // rows of every tile
inline constexpr int64_t kTileDepth = 32;  // bfloat16 values along k in one A row
inline constexpr int64_t kTileBytes = 64;  // bytes of a tile row

}  // namespace jax_flash::cpu::JF_ISA

// configure_tiles(), release_tiles() (per task) and
// tile_block_2x2(depth, a, a_stride, a_next, a_chunk, b, b_stride, b_next, b_chunk, c, c_stride,
//                c_next, accumulate):
// a 2 x 2 block of C tiles accumulated over `depth` chunks of kTileDepth: A tile (i, chunk t) at
// a + i * a_next + t * a_chunk (bytes; rows a_stride bytes apart), B tile (chunk t, j) at
// b + j * b_next + t * b_chunk (rows b_stride); C tile (i, j) at c + i * c_next + j * 16 floats
// (rows c_stride bytes); `accumulate`: loaded from c first, else started at 0.
#if JF_AMX
#include "cpu/amx_tiles.h"
#else
#include "cpu/dpbf16_tiles.h"
#endif

namespace jax_flash::cpu::JF_ISA {

// Rows in pairs of dims, as the B operand of a product over the dims (S^T = K Q^T: Q's rows;
// S = Q K^T: K's): pairs[kk * block_rows + n] = (x[n][2kk] low, x[n][2kk + 1] high) for pairs
// kk < depth_pairs and rows n < block_rows; zero past the head dim d and past `rows` (row n at
// x[n * stride]).
inline void pack_dim_pairs(const BFloat16* x, int64_t stride, int64_t rows, int64_t d,
                           int64_t depth_pairs, int64_t block_rows, uint32_t* pairs) {
  // 16 rows' pair kk at once: a gather of 32-bit words kk from the rows (element offsets,
  // scale 2), where the 16 rows and both halves of the pair exist.
  alignas(64) int32_t row_offsets[16];
  for (int n = 0; n < 16; ++n) row_offsets[n] = static_cast<int32_t>(n * stride);
  const __m512i offsets = _mm512_load_si512(row_offsets);
  for (int64_t kk = 0; kk < depth_pairs; ++kk) {
    uint32_t* out = pairs + kk * block_rows;
    int64_t n = 0;
    if (2 * kk + 1 < d)
      for (; n + 16 <= rows; n += 16)
        _mm512_storeu_si512(out + n, _mm512_i32gather_epi32(offsets, x + n * stride + 2 * kk, 2));
    for (; n < block_rows; ++n) {
      uint32_t lo = 0, hi = 0;
      if (n < rows) {
        if (2 * kk < d) lo = x[n * stride + 2 * kk].bits;
        if (2 * kk + 1 < d) hi = x[n * stride + 2 * kk + 1].bits;
      }
      out[n] = lo | hi << 16;
    }
  }
}

// from_float<BFloat16> (tile_io.h) on 16 values: round to nearest even, a NaN kept quiet.
inline __m256i round_to_bfloat16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// out[c] = scale * x[c * ld] for c < cols: a column of a float32 tile (stride ld) as a row, in
// float32 or bfloat16 (as from_float rounds).
template <typename U>
inline void store_column(const float* x, int64_t ld, int64_t cols, float scale, U* out) {
  const __m512i index = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(ld)));
  const __m512 s = _mm512_set1_ps(scale);
  int64_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(index, x + c * ld, 4), s);
    if constexpr (sizeof(U) == sizeof(float))
      _mm512_storeu_ps(out + c, v);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), round_to_bfloat16(v));
  }
  for (; c < cols; ++c) out[c] = from_float<U>(x[c * ld] * scale);
}

// Consecutive rows in pairs, as the B operand of a product over the rows (dQ = dS K: K's keys):
// pairs[kk * width + n] = (x[2kk][n] low, x[2kk + 1][n] high) for kk < row_pairs and n < width;
// zero for n >= cols and rows >= `rows`.
inline void pack_rows_in_pairs(const BFloat16* x, int64_t stride, int64_t rows, int64_t cols,
                               int64_t row_pairs, int64_t width, uint32_t* pairs) {
  for (int64_t kk = 0; kk < row_pairs; ++kk) {
    uint32_t* out = pairs + kk * width;
    const int64_t r = 2 * kk;
    for (int64_t n = 0; n < width; ++n) {
      const uint32_t lo = r < rows && n < cols ? x[r * stride + n].bits : 0;
      const uint32_t hi = r + 1 < rows && n < cols ? x[(r + 1) * stride + n].bits : 0;
      out[n] = lo | hi << 16;
    }
  }
}

// Rows [0, rows) of a bfloat16 array as zero-padded rows of `width` values (a multiple of
// kTileDepth), out to `padded_rows` rows: the A operand when the rows cannot be read in place.
inline void pack_rows(const BFloat16* src, int64_t src_stride, int64_t rows, int64_t cols,
                      int64_t width, int64_t padded_rows, BFloat16* dst) {
  for (int64_t r = 0; r < padded_rows; ++r) {
    BFloat16* d = dst + r * width;
    const int64_t n = r < rows ? cols : 0;
    if (n) std::memcpy(d, src + r * src_stride, n * sizeof(BFloat16));
    std::memset(d + n, 0, (width - n) * sizeof(BFloat16));
  }
}

// V^T of one (batch, kv head): vt[c * ld + j] = v[j * v_stride + c] for dims c < hv and keys
// j < seq; zero for c in [hv, dims) and j in [seq, ld). The A operand of O^T += V^T P^T.
inline void pack_transposed(const BFloat16* v, int64_t v_stride, int64_t seq, int64_t hv,
                            int64_t dims, int64_t ld, BFloat16* vt) {
  constexpr int64_t kStrip = 32;  // keys a pass: their rows of v stay in L1 across the dims
  for (int64_t j0 = 0; j0 < ld; j0 += kStrip) {
    const int64_t j1 = j0 + kStrip < seq ? j0 + kStrip : seq;
    for (int64_t c = 0; c < dims; ++c) {
      BFloat16* out = vt + c * ld;
      for (int64_t j = j0; j < j0 + kStrip; ++j)
        out[j].bits = (c < hv && j < j1) ? v[j * v_stride + c].bits : uint16_t{0};
    }
  }
}

// Consecutive float32 rows in pairs, times `scale` and rounded to bfloat16 (nearest even), as
// the B operand of a product over the rows (O^T += V^T P^T: the keys of P^T; dV^T += dO^T P and
// dK^T += Q^T dS: the query rows of P and dS): pairs[kk * ld + n] = (x[2kk][n] low,
// x[2kk + 1][n] high) for kk < row_pairs and n < width (a multiple of 16), row c at x[c * ld];
// rows at or past `rows` give 0 (whatever they hold).
inline void pack_float_rows_in_pairs(const float* x, int64_t ld, int64_t rows, int64_t row_pairs,
                                     int64_t width, float scale, uint32_t* pairs) {
  // Lane 2n takes element n of the first row, lane 2n + 1 element n of the second.
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512 zero = _mm512_setzero_ps(), s = _mm512_set1_ps(scale);
  const bool scaled = scale != 1.f;  // P is taken as it is
  for (int64_t kk = 0; kk < row_pairs; ++kk) {
    const int64_t c = 2 * kk;
    const float* row0 = x + c * ld;
    const float* row1 = row0 + ld;
    for (int64_t n = 0; n < width; n += 16) {
      __m512 x0 = c < rows ? _mm512_loadu_ps(row0 + n) : zero;
      __m512 x1 = c + 1 < rows ? _mm512_loadu_ps(row1 + n) : zero;
      if (scaled) x0 = _mm512_mul_ps(x0, s), x1 = _mm512_mul_ps(x1, s);
      // Elements 0-15 from x0, 16-31 from x1.
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
      _mm512_storeu_si512(pairs + kk * ld + n, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// scale * x as a sum of two bfloat16 vectors, hi = bf16(scale * x) and lo = bf16(scale * x - hi):
// about 16 significant bits, where one bfloat16 holds 8. A value hi cannot hold finitely (inf,
// NaN) is carried by hi alone (lo 0), so the sum keeps it.
inline void split_to_bfloat16(__m512 v, __m256bh& hi, __m256bh& lo) {
  hi = _mm512_cvtneps_pbh(v);
  const __m512 hi_f = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)(hi)), 16));
  const __mmask16 special = _mm512_fpclass_ps_mask(hi_f, 0x99);  // NaN or +-inf
  lo = _mm512_cvtneps_pbh(_mm512_maskz_sub_ps(static_cast<__mmask16>(~special), v, hi_f));
}

// scale * x (rows of width values, a multiple of 32, row r at x[r * ld]) split as
// split_to_bfloat16 does, as the A operand of a product over the width whose B repeats each
// chunk of 32 (pack_rows_in_pairs_twice): out row r holds, per chunk of 32 columns, the 32 hi
// values then the 32 lo values (2 * width values a row); zero rows from `rows` up to
// padded_rows.
inline void pack_float_rows_split(const float* x, int64_t ld, int64_t rows, int64_t padded_rows,
                                  int64_t width, float scale, BFloat16* out) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < padded_rows; ++r)
    for (int64_t n = 0; n < width; n += kTileDepth) {
      BFloat16* chunk = out + r * 2 * width + 2 * n;
      for (int64_t half = 0; half < kTileDepth; half += 16) {
        const __m512 v = r < rows ? _mm512_mul_ps(_mm512_loadu_ps(x + r * ld + n + half), s)
                                  : _mm512_setzero_ps();
        __m256bh hi, lo;
        split_to_bfloat16(v, hi, lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(chunk + half), (__m256i)(hi));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(chunk + kTileDepth + half),
                            (__m256i)(lo));
      }
    }
}

// The same split of consecutive rows in pairs (pack_float_rows_in_pairs with a scale): hi_pairs
// and lo_pairs, each row_pairs x width words.
inline void pack_float_rows_in_pairs_split(const float* x, int64_t ld, int64_t rows,
                                           int64_t row_pairs, int64_t width, float scale,
                                           uint32_t* hi_pairs, uint32_t* lo_pairs) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512 zero = _mm512_setzero_ps(), s = _mm512_set1_ps(scale);
  for (int64_t kk = 0; kk < row_pairs; ++kk) {
    const int64_t c = 2 * kk;
    const float* row0 = x + c * ld;
    const float* row1 = row0 + ld;
    for (int64_t n = 0; n < width; n += 16) {
      const __m512 x0 = c < rows ? _mm512_mul_ps(_mm512_loadu_ps(row0 + n), s) : zero;
      const __m512 x1 = c + 1 < rows ? _mm512_mul_ps(_mm512_loadu_ps(row1 + n), s) : zero;
      __m256bh hi0, lo0, hi1, lo1;
      split_to_bfloat16(x0, hi0, lo0);
      split_to_bfloat16(x1, hi1, lo1);
      // Elements 0-15 from row 2kk, 16-31 from row 2kk + 1; then interleaved into pairs.
      const __m512i hi = _mm512_inserti64x4(
          _mm512_castsi256_si512((__m256i)(hi0)), (__m256i)(hi1), 1);
      const __m512i lo = _mm512_inserti64x4(
          _mm512_castsi256_si512((__m256i)(lo0)), (__m256i)(lo1), 1);
      _mm512_storeu_si512(hi_pairs + kk * ld + n, _mm512_permutexvar_epi16(interleave, hi));
      _mm512_storeu_si512(lo_pairs + kk * ld + n, _mm512_permutexvar_epi16(interleave, lo));
    }
  }
}

// K in pairs of keys (pack_rows_in_pairs) with each chunk of kTileDepth keys' 16 pair rows
// stored twice in a row: the B operand for pack_float_rows_split's hi and lo halves of a chunk.
// pairs holds 2 * row_pairs rows of width words.
inline void pack_rows_in_pairs_twice(const BFloat16* x, int64_t stride, int64_t rows, int64_t cols,
                                     int64_t row_pairs, int64_t width, uint32_t* pairs) {
  constexpr int64_t kChunkPairs = kTileDepth / 2;
  for (int64_t kk0 = 0; kk0 < row_pairs; kk0 += kChunkPairs) {
    uint32_t* first = pairs + 2 * kk0 * width;
    const int64_t r0 = 2 * kk0;
    const int64_t chunk_rows = rows - r0 < 0 ? 0 : rows - r0;
    pack_rows_in_pairs(x + r0 * stride, stride, chunk_rows, cols, kChunkPairs, width, first);
    std::memcpy(first + kChunkPairs * width, first, kChunkPairs * width * sizeof(uint32_t));
  }
}

// Columns [col0, col0 + cols) of a bfloat16 array (rows of ld values), `rows` of them, copied as
// rows of kTileDepth values with zeros past cols: the last, partial chunk of an A operand whose
// rows run along the product's depth (V^T, Q^T, dO^T), so that the columns past it (keys or
// query rows outside the block, which may hold anything) never meet a 0 probability.
inline void copy_partial_chunk(const BFloat16* x, int64_t ld, int64_t rows, int64_t col0,
                               int64_t cols, BFloat16* out) {
  for (int64_t r = 0; r < rows; ++r) {
    BFloat16* dst = out + r * kTileDepth;
    std::memcpy(dst, x + r * ld + col0, cols * sizeof(BFloat16));
    std::memset(dst + cols, 0, (kTileDepth - cols) * sizeof(BFloat16));
  }
}

}  // namespace jax_flash::cpu::JF_ISA
