// The bfloat16 tile products (bf16_tiles.h) on AVX-512 BF16 (the avx512_bf16 variant: CPUs
// with avx512_bf16 but no AMX, e.g. AMD Zen 4 and 5, Intel Cooper Lake).
//
// vdpbf16ps adds to each of 16 float32 lanes the two products of a pair of bfloat16 values:
// with B's tile row kk (16 pairs, VNNI layout) as one operand and A's pair (A[m][2kk],
// A[m][2kk + 1]) broadcast as the other, it adds row kk's share to row m of a C tile. A block of
// kRowsAtOnce C rows x 2 tiles (32 columns) stays in registers while the depth streams through:
// per pair row, 2 vector loads of B and kRowsAtOnce broadcasts feed 2 * kRowsAtOnce products.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace jax_flash::cpu::JF_ISA {

inline void configure_tiles() {}
inline void release_tiles() {}

inline constexpr int kRowsAtOnce = 8;  // 16 accumulators, 2 B rows, 1 broadcast: 19 of 32 zmm

// A 2 x 2 block of C tiles, operands as bf16_tiles.h describes.
inline void tile_block_2x2(int64_t depth, const uint8_t* a, int64_t a_stride, int64_t a_next,
                           int64_t a_chunk, const uint8_t* b, int64_t b_stride, int64_t b_next,
                           int64_t b_chunk, float* c, int64_t c_stride, int64_t c_next,
                           bool accumulate) {
  for (int i = 0; i < 2; ++i) {
    for (int m0 = 0; m0 < 16; m0 += kRowsAtOnce) {
      uint8_t* c_rows = reinterpret_cast<uint8_t*>(c + i * c_next) + m0 * c_stride;
      const uint8_t* a_rows = a + i * a_next + m0 * a_stride;
      __m512 acc[kRowsAtOnce][2];
#pragma GCC unroll 8
      for (int r = 0; r < kRowsAtOnce; ++r) {
        const float* row = reinterpret_cast<const float*>(c_rows + r * c_stride);
        acc[r][0] = accumulate ? _mm512_loadu_ps(row) : _mm512_setzero_ps();
        acc[r][1] = accumulate ? _mm512_loadu_ps(row + 16) : _mm512_setzero_ps();
      }
      for (int64_t t = 0; t < depth; ++t) {
        const uint8_t* b0 = b + t * b_chunk;
        const uint8_t* b1 = b0 + b_next;
        const uint8_t* at = a_rows + t * a_chunk;
        for (int kk = 0; kk < 16; ++kk) {
          const __m512bh bv0 = (__m512bh)_mm512_loadu_si512(b0 + kk * b_stride);
          const __m512bh bv1 = (__m512bh)_mm512_loadu_si512(b1 + kk * b_stride);
#pragma GCC unroll 8
          for (int r = 0; r < kRowsAtOnce; ++r) {
            int32_t pair;
            std::memcpy(&pair, at + r * a_stride + kk * 4, sizeof(pair));
            const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, bv0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, bv1);
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRowsAtOnce; ++r) {
        float* row = reinterpret_cast<float*>(c_rows + r * c_stride);
        _mm512_storeu_ps(row, acc[r][0]);
        _mm512_storeu_ps(row + 16, acc[r][1]);
      }
    }
  }
}

}  // namespace jax_flash::cpu::JF_ISA
