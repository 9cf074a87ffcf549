// jax.nn's bias and mask arrays (AttentionParams::bias, logit_mask) in the CPU kernels: read
// tile by tile where they lie, through their strides (0 along a broadcast dim), never broadcast
// to (B, N, T, S). The forward adds the bias to its transposed score tiles (keys x rows), the
// backward to its row-major ones, both after the soft cap and ALiBi and before the masks; a false
// mask element makes its score -inf. The backward sums dbias = dS over the bias's broadcast dims
// into float32 partials in the bias's own layout (accumulate_dbias), which finish_dbias turns
// into the bias's dtype.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/attention_params.h"
#include "common/mask.h"
#include "cpu/parallel.h"
#include "cpu/tile_io.h"

namespace jax_flash::cpu::JF_ISA {

// f(typed pointer to the bias's elements), once per call site: the dtype switch stays outside
// the loops.
template <typename F>
inline void with_bias_elements(const LogitArray& a, F&& f) {
  switch (a.dtype) {
    case Dtype::kFloat32: return f(static_cast<const float*>(a.data));
    case Dtype::kBFloat16: return f(static_cast<const BFloat16*>(a.data));
    case Dtype::kFloat16: return f(static_cast<const _Float16*>(a.data));
  }
}

// The bias of query rows i0.. and keys j0.. of the (b, h) slice `base` (LogitArray::offset),
// times `factor` (log2(e): the kernels' scores are base 2), added to transposed scores:
// st[c * ld + r] is row i0 + r and key j0 + c, for r < rows and c < cols.
inline void bias_columns(float* st, int64_t ld, const LogitArray& a, int64_t base, int64_t i0, int64_t rows,
                         int64_t j0, int64_t cols, float factor) {
  with_bias_elements(a, [&](const auto* x) {
    // Key by key, the rows' scores contiguous (the bias's column read down its rows, which a
    // tile holds in L1).
    const auto* first = x + base + i0 * a.row + j0 * a.col;
    for (int64_t c = 0; c < cols; ++c) {
      const auto* column = first + c * a.col;
      float* out = st + c * ld;
      for (int64_t r = 0; r < rows; ++r) out[r] += to_float(column[r * a.row]) * factor;
    }
  });
}

// The same on row-major scores: s[r * ld + c] is row i0 + r and key j0 + c.
inline void bias_rows(float* s, int64_t ld, const LogitArray& a, int64_t base, int64_t i0, int64_t rows,
                      int64_t j0, int64_t cols, float factor) {
  with_bias_elements(a, [&](const auto* x) {
    for (int64_t r = 0; r < rows; ++r) {
      const auto* row = x + base + (i0 + r) * a.row + j0 * a.col;
      float* out = s + r * ld;
      for (int64_t c = 0; c < cols; ++c) out[c] += to_float(row[c * a.col]) * factor;
    }
  });
}

// The mask's elements of row i and keys j0.. of the (b, h) slice `base`: element c at
// [c * a.col].
inline const uint8_t* mask_row_at(const LogitArray& a, int64_t base, int64_t i, int64_t j0) {
  return static_cast<const uint8_t*>(a.data) + base + i * a.row + j0 * a.col;
}

// Whether the mask lets some row i0.. (rows of them) see some key j0.. (cols of them): a tile
// where it does not is skipped whole (its scores would all be -inf).
inline bool mask_tile_any(const LogitArray& a, int64_t base, int64_t i0, int64_t rows, int64_t j0, int64_t cols) {
  const int64_t distinct_rows = a.row ? rows : 1, distinct_cols = a.col ? cols : 1;
  for (int64_t r = 0; r < distinct_rows; ++r) {
    const uint8_t* m = mask_row_at(a, base, i0 + r, j0);
    for (int64_t c = 0; c < distinct_cols; ++c)
      if (m[c * a.col]) return true;
  }
  return false;
}

// The mask on one row of a score tile (key c at s[c * ld], keys j0 + c for c < cols; ld the
// tile's step between keys: the rows' count in the forward's transposed tiles, 1 in the
// backward's): -inf where the mask row `m` (mask_row_at) hides the key, within the row's key
// range `keys` (the range masks set the rest); with kv_ids (the keys' segment ids, from j0) also
// where a key's id differs from the row's `id`. Returns whether some key of the range survives.
inline bool mask_keys(float* s, int64_t ld, int64_t j0, int64_t cols, KeyRange keys, const uint8_t* m,
                      int64_t m_col, const int32_t* kv_ids, int32_t id) {
  const int64_t lo = min64(max64(keys.begin - j0, 0), cols);
  const int64_t hi = max64(min64(keys.end - j0, cols), lo);
  bool any = false;
  for (int64_t c = lo; c < hi; ++c) {
    if (m[c * m_col] && (!kv_ids || kv_ids[c] == id)) any = true;
    else s[c * ld] = -INFINITY;
  }
  return any;
}

// dbias += dS over a tile: acc (the float32 partial in the bias's layout, at the (b, h) slice)
// gains ds[r * ld + c] at row i0 + r and key j0 + c, for r < rows and c < cols. Along a
// broadcast dim (stride 0) the tile's elements add into one, in a fixed order (rows, then keys).
inline void accumulate_dbias(float* acc, const LogitArray& a, const float* ds, int64_t ld, int64_t i0,
                             int64_t rows, int64_t j0, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* out = acc + (i0 + r) * a.row + j0 * a.col;
    const float* in = ds + r * ld;
    if (a.col) {
      for (int64_t c = 0; c < cols; ++c) out[c * a.col] += in[c];
    } else {
      float sum = 0.f;
      for (int64_t c = 0; c < cols; ++c) sum += in[c];
      out[0] += sum;
    }
  }
}

// f(typed pointer to dbias's elements, in the bias's dtype `dtype`), as with_bias_elements.
template <typename F>
inline void with_dbias_elements(void* dbias, Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kFloat32: return f(static_cast<float*>(dbias));
    case Dtype::kBFloat16: return f(static_cast<BFloat16*>(dbias));
    case Dtype::kFloat16: return f(static_cast<_Float16*>(dbias));
  }
}

// dbias = dS over a tile where each dbias element takes one dS (BwdParams::dbias_direct): dbias
// (the bias's dtype, at the (b, h) slice) gets ds[r * ld + c] at row i0 + r and key j0 + c.
inline void store_dbias(void* dbias, const LogitArray& a, int64_t base, const float* ds, int64_t ld, int64_t i0,
                        int64_t rows, int64_t j0, int64_t cols) {
  with_dbias_elements(dbias, a.dtype, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    for (int64_t r = 0; r < rows; ++r) {
      T* out = typed + base + (i0 + r) * a.row + j0 * a.col;
      const float* in = ds + r * ld;
      for (int64_t c = 0; c < cols; ++c) out[c * a.col] = from_float<T>(in[c]);
    }
  });
}

// Elements of the dbias workspace each task of zero_dbias / finish_dbias takes.
inline constexpr int64_t kDbiasChunk = 1 << 14;

// Zeroes the dbias partials before the backward's main pass; with direct stores dbias itself (the
// elements no visited tile stores: hidden, past the lengths, out of the masks' ranges).
inline void zero_dbias(const BwdParams& p, const TaskRunner& runner) {
  if (p.dbias_direct) {
    const int64_t bytes = p.bias.elements * (p.bias.dtype == Dtype::kFloat32 ? 4 : 2);
    auto zero = [&](int64_t task) {
      const int64_t begin = task * kDbiasChunk * 4;
      std::memset(static_cast<char*>(p.dbias) + begin, 0, min64(bytes - begin, kDbiasChunk * 4));
    };
    parallel_for(runner, ceil_div(bytes, kDbiasChunk * 4), zero);
    return;
  }
  const int64_t n = p.dbias_parts * p.bias.elements;
  auto zero = [&](int64_t task) {
    for (int64_t x = task * kDbiasChunk; x < min64(n, (task + 1) * kDbiasChunk); ++x) p.dbias_accum[x] = 0.f;
  };
  parallel_for(runner, ceil_div(n, kDbiasChunk), zero);
}

// dbias = the sum of its partials (in order: the same bits every run), in the bias's dtype;
// nothing to do where the one partial is dbias itself or the tiles stored into it directly.
inline void finish_dbias(const BwdParams& p, const TaskRunner& runner) {
  const int64_t n = p.bias.elements;
  if (p.dbias_direct || p.dbias_accum == p.dbias) return;
  auto finish = [&](int64_t task) {
    const int64_t end = min64(n, (task + 1) * kDbiasChunk);
    with_dbias_elements(p.dbias, p.bias.dtype, [&](auto* dbias) {
      using T = std::remove_pointer_t<decltype(dbias)>;
      for (int64_t x = task * kDbiasChunk; x < end; ++x) {
        float sum = p.dbias_accum[x];
        for (int64_t part = 1; part < p.dbias_parts; ++part) sum += p.dbias_accum[part * n + x];
        dbias[x] = from_float<T>(sum);
      }
    });
  };
  parallel_for(runner, ceil_div(n, kDbiasChunk), finish);
}

}  // namespace jax_flash::cpu::JF_ISA
