// The one matrix product the CPU kernels need, on float32 tiles that sit in cache:
//   C[M x N] = alpha * A[M x K] * B[K x N]   (or += when accumulate)
// B and C row-major with leading dimensions ldb, ldc; N and ldb, ldc are multiples of kLanes
// (tiles are zero-padded). A is read one element at a time (broadcast), so it may be laid out
// either way: element (r, k) sits at a[r * a_row + k * a_col]. A^T*B is then the same routine with
// the strides swapped (no transposed copy); A*B^T is avoided by computing its transpose B*A^T.
//
// Register blocking as in BLIS: a kRows x (kVecs * kLanes) block of C stays in registers while
// K streams through; elements of A are broadcast, rows of B are loaded as vectors. Per k the
// block does kRows * kVecs FMAs against kVecs vector loads and kRows broadcasts.
//
// K is taken in panels of kKPanel, each summed in fresh registers and then added to C: a sum
// over K is then a chain of at most kKPanel FMAs plus one addition a panel, not one chain of K.
// At head dims past 64 that is the difference between the scores' float32 error and XLA's
// (issue 13: with logits near +-90 a sequential chain over 212 products gave the output 3x
// jax.nn's error against float64; panels of 64 bring it to jax.nn's), for one load, add and
// store of the C block per 64 k (under 2% of the block's FMAs).
#pragma once

#include <utility>

#include "cpu/simd.h"

namespace jax_flash::cpu::JF_ISA {

#if JF_SIMD_LANES == 16
// 24 of the 32 zmm registers hold C; a 64-wide tile row is one panel.
inline constexpr int kRows = 6, kVecs = 4;
#elif JF_SIMD_LANES == 8
// 12 of the 16 ymm registers hold C, 2 hold B, 1 the broadcast (the BLIS Haswell/Zen shape).
// 4 x 3 (the previous choice) split a 64-wide row into panels of 3, 3 and 2 vectors; 6 x 2 tiles
// it exactly and loads 8 values per 12 FMAs instead of 7 (both within Zen 3's and Haswell's two
// loads a cycle beside two FMAs).
inline constexpr int kRows = 6, kVecs = 2;
#else
inline constexpr int kRows = 4, kVecs = 2;
#endif

inline constexpr int64_t kKPanel = 64;

// One panel: C (+)= alpha * A[:, k0:k1] * B[k0:k1, :] for an MR x NV block.
template <int MR, int NV>
inline void gemm_panel(int64_t k0, int64_t k1, float alpha, const float* __restrict a, int64_t a_row,
                       int64_t a_col, const float* __restrict b, int64_t ldb,
                       float* __restrict c, int64_t ldc, bool accumulate) {
  Vec acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec{};
  const float* ar[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) ar[r] = a + r * a_row;
  // Two k a trip (the same FMA chain per accumulator: bit-identical sums): with AVX-512, one
  // thread, load ~1.5 (session 18): the seq-4096 hd-128 forward 143-151 -> 151-159 GFLOP/s,
  // hd 64 +2%; AVX2 within the spread.
#pragma GCC unroll 2
  for (int64_t k = k0; k < k1; ++k) {
    Vec bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = load(b + k * ldb + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const Vec av = splat(ar[r][k * a_col]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] += av * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      float* p = c + r * ldc + v * kLanes;
      const Vec x = alpha == 1.f ? acc[r][v] : acc[r][v] * alpha;
      store(p, accumulate ? load(p) + x : x);
    }
}

template <int MR, int NV>
inline void gemm_block(int64_t K, float alpha, const float* __restrict a, int64_t a_row,
                       int64_t a_col, const float* __restrict b, int64_t ldb,
                       float* __restrict c, int64_t ldc, bool accumulate) {
  for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kKPanel)
    gemm_panel<MR, NV>(k0, k0 + kKPanel < K ? k0 + kKPanel : K, alpha, a, a_row, a_col, b, ldb, c, ldc,
                       accumulate || k0 > 0);
}

using GemmBlockFn = void (*)(int64_t, float, const float*, int64_t, int64_t, const float*,
                             int64_t, float*, int64_t, bool);

template <int MR, int... NV>
constexpr void fill_row(GemmBlockFn* row, std::integer_sequence<int, NV...>) {
  ((row[NV] = &gemm_block<MR, NV + 1>), ...);
}

template <int... MR>
constexpr auto make_gemm_table(std::integer_sequence<int, MR...>) {
  struct Table {
    GemmBlockFn fn[kRows][kVecs];
  } table{};
  ((fill_row<MR + 1>(table.fn[MR], std::make_integer_sequence<int, kVecs>{})), ...);
  return table;
}

// C = alpha * A * B (+ C), A element (r, k) at a[r * a_row + k * a_col].
inline void gemm_strided(int64_t M, int64_t N, int64_t K, float alpha, const float* a,
                         int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c,
                         int64_t ldc, bool accumulate) {
  static constexpr auto table = make_gemm_table(std::make_integer_sequence<int, kRows>{});
  const int64_t n_vecs = N / kLanes;
  for (int64_t v0 = 0; v0 < n_vecs; v0 += kVecs) {
    const int nv = static_cast<int>(n_vecs - v0 < kVecs ? n_vecs - v0 : kVecs);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      int64_t mr = left < kRows ? left : kRows;
      // A remainder under half a block (128 = 21 x 6 + 2) would run on too few accumulators to
      // cover the FMA latency (2 x 2 on AVX2: 4 chains for 2 pipes x 4 cycles): it joins the
      // last whole block and the two split evenly (20 x 6 + 4 + 4).
      if (left > kRows && left < kRows + kRows / 2) mr = (left + 1) / 2;
      table.fn[mr - 1][nv - 1](K, alpha, a + m0 * a_row, a_row, a_col, b + v0 * kLanes, ldb,
                               c + m0 * ldc + v0 * kLanes, ldc, accumulate);
      m0 += mr;
    }
  }
}

// C = alpha * A * B (+ C), A row-major with leading dimension lda.
inline void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t lda,
                 const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  gemm_strided(M, N, K, alpha, a, lda, 1, b, ldb, c, ldc, accumulate);
}

// C = alpha * A^T * B (+ C), A (K x M) row-major with leading dimension lda: no transposed copy.
inline void gemm_at(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t lda,
                    const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  gemm_strided(M, N, K, alpha, a, 1, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace jax_flash::cpu::JF_ISA
