// Moving tiles between the arrays XLA hands us (float32, bfloat16, float16; strided rows) and the
// float32, zero-padded tiles the CPU kernels compute on. Compiled once per ISA (see simd.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/simd.h"

namespace jax_flash::cpu::JF_ISA {

struct BFloat16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline _Float16 from_float<_Float16>(float x) { return static_cast<_Float16>(x); }
template <>
inline BFloat16 from_float<BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((bits >> 16) | 0x40)};
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return {static_cast<uint16_t>(bits >> 16)};
}

// dst[r][c] = src[r * src_stride + c] for r < rows, c < cols; zero for cols <= c < padded_cols.
template <typename T>
inline void load_rows(const T* src, int64_t src_stride, int64_t rows, int64_t cols,
                      float* dst, int64_t padded_cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * src_stride;
    float* d = dst + r * padded_cols;
    for (int64_t c = 0; c < cols; ++c) d[c] = to_float(s[c]);
    for (int64_t c = cols; c < padded_cols; ++c) d[c] = 0.f;
  }
}

// Rows [0, rows) of a strided array as a float32 tile the products can read: the array itself
// (leading dimension src_stride) where it already is float32 and needs no padding (cols ==
// padded_cols), else a padded copy in `scratch` (leading dimension padded_cols). `ld` is set to
// the tile's leading dimension.
template <typename T>
inline const float* rows_as_tile(const T* src, int64_t src_stride, int64_t rows, int64_t cols,
                                 float* scratch, int64_t padded_cols, int64_t& ld) {
  if constexpr (sizeof(T) == sizeof(float)) {
    if (cols == padded_cols) {
      ld = src_stride;
      return reinterpret_cast<const float*>(src);
    }
  }
  load_rows(src, src_stride, rows, cols, scratch, padded_cols);
  ld = padded_cols;
  return scratch;
}

// The first and second halves of a and b's lanes interleaved: a0 b0 a1 b1 ... (zip_low) and
// the same from the middle lane on (zip_high).
inline Vec zip_low(Vec a, Vec b) {
#if JF_SIMD_LANES == 16
  return __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
#elif JF_SIMD_LANES == 8
  return __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11);
#else
  return __builtin_shufflevector(a, b, 0, 4, 1, 5);
#endif
}
inline Vec zip_high(Vec a, Vec b) {
#if JF_SIMD_LANES == 16
  return __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#elif JF_SIMD_LANES == 8
  return __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15);
#else
  return __builtin_shufflevector(a, b, 2, 6, 3, 7);
#endif
}

// dst[c * dst_ld + r] = src[r * src_ld + c] for r, c < kLanes, in registers: log2(kLanes)
// rounds of zipping row i with row i + kLanes / 2 (one two-source permute each; 64 for 16
// lanes) turn the rows into the columns. Element for element a scalar loop's result, at about
// a quarter of a cycle per element instead of a load and a store each.
inline void transpose_lanes(const float* src, int64_t src_ld, float* dst, int64_t dst_ld) {
  Vec v[kLanes];
  for (int i = 0; i < kLanes; ++i) v[i] = load(src + i * src_ld);
  for (int round = 1; round < kLanes; round *= 2) {
    Vec next[kLanes];
    for (int i = 0; i < kLanes / 2; ++i) {
      next[2 * i] = zip_low(v[i], v[i + kLanes / 2]);
      next[2 * i + 1] = zip_high(v[i], v[i + kLanes / 2]);
    }
    for (int i = 0; i < kLanes; ++i) v[i] = next[i];
  }
  for (int i = 0; i < kLanes; ++i) store(dst + i * dst_ld, v[i]);
}

// dst[c * dst_ld + r] = src[r * src_stride + c] for r < rows, c < cols: the transpose, with zero
// columns r in [rows, width) and zero rows c in [cols, padded_cols). Whole kLanes x kLanes
// blocks of a float32 source go through registers (transpose_lanes), the edges one element at a
// time.
template <typename T>
inline void transpose_rows(const T* src, int64_t src_stride, int64_t rows, int64_t cols, float* dst,
                           int64_t dst_ld, int64_t width, int64_t padded_cols) {
  int64_t whole_rows = 0, whole_cols = 0;
  if constexpr (sizeof(T) == sizeof(float)) {
    whole_rows = rows / kLanes * kLanes;
    whole_cols = cols / kLanes * kLanes;
    for (int64_t c = 0; c < whole_cols; c += kLanes)
      for (int64_t r = 0; r < whole_rows; r += kLanes)
        transpose_lanes(reinterpret_cast<const float*>(src) + r * src_stride + c, src_stride,
                        dst + c * dst_ld + r, dst_ld);
  }
  for (int64_t c = 0; c < padded_cols; ++c) {
    float* d = dst + c * dst_ld;
    const int64_t r0 = c < whole_cols ? whole_rows : 0;
    if (c < cols)
      for (int64_t r = r0; r < rows; ++r) d[r] = to_float(src[r * src_stride + c]);
    else
      for (int64_t r = 0; r < rows; ++r) d[r] = 0.f;
    for (int64_t r = rows; r < width; ++r) d[r] = 0.f;
  }
}

// dst[c][r] = src[r * src_stride + c]: the transpose, padded with zero rows up to padded_cols
// and zero columns up to padded_rows.
template <typename T>
inline void load_rows_transposed(const T* src, int64_t src_stride, int64_t rows, int64_t cols,
                                 float* dst, int64_t padded_rows, int64_t padded_cols) {
  transpose_rows(src, src_stride, rows, cols, dst, padded_rows, padded_rows, padded_cols);
}

// Transpose of a float32 tile: dst (cols x padded_rows) from src (rows x src_stride).
inline void transpose(const float* src, int64_t src_stride, int64_t rows, int64_t cols,
                      float* dst, int64_t padded_rows) {
  for (int64_t c = 0; c < cols; ++c) {
    float* d = dst + c * padded_rows;
    for (int64_t r = 0; r < rows; ++r) d[r] = src[r * src_stride + c];
    for (int64_t r = rows; r < padded_rows; ++r) d[r] = 0.f;
  }
}

template <typename T>
inline void store_row(const float* src, int64_t cols, float scale, T* dst) {
  for (int64_t c = 0; c < cols; ++c) dst[c] = from_float<T>(src[c] * scale);
}

template <typename T>
inline void store_zeros(int64_t cols, T* dst) {
  for (int64_t c = 0; c < cols; ++c) dst[c] = from_float<T>(0.f);
}

// Column r of a transposed accumulator (acc_t[c * ld + r], c < dims) times factor[r], kLanes
// columns at a time and only where some live row's factor is not 1 (rows past live_rows have
// factors too, finite, but nothing reads their columns): the forwards' O^T rescaling.
inline void scale_transposed_columns(float* acc_t, int64_t ld, int64_t dims, const float* factor, int64_t live_rows,
                                     int64_t cols) {
  for (int64_t r = 0; r < cols; r += kLanes) {
    bool any = false;
    for (int64_t x = r; x < r + kLanes && x < live_rows; ++x) any |= factor[x] != 1.f;
    if (!any) continue;
    const Vec fv = load(factor + r);
    for (int64_t c = 0; c < dims; ++c) {
      float* x = acc_t + c * ld + r;
      store(x, load(x) * fv);
    }
  }
}

}  // namespace jax_flash::cpu::JF_ISA
