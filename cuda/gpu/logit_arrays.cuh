// jax.nn's bias and mask arrays (AttentionParams::bias, logit_mask) in the Hopper kernels' score
// tiles, read where they lie through their strides (common/attention_params.h LogitArray: 0
// along a broadcast dim), never broadcast to (B, N, T, S): the same semantics as the CPU kernel's
// cpu/logit_arrays.h. A false mask element makes its score -inf; the bias is added to the scores
// the masks left (a masked score stays -inf, whatever the bias holds), after the soft cap and
// ALiBi, in the tiles' units (the cap's with one: the bias over the cap). The forward tracks
// which rows met a key that every mask lets through (SeenRows, from the mask's bits and the rows'
// key ranges, never from the values); the backward adds dS = P (dP - delta) into a float32 copy
// of the bias's shape (AttentionParams::dbias_accum) by atomics.
//
// Experimental (issue 16 item 3): a general kernel instantiation of its own (kLogitArrays), run
// only where the Python side passes the arrays (JAX_FLASH_CUDA_LOGIT_ARRAYS=on). Element reads
// are scalar global loads in the consumers' path; a TMA tile per stage is the next step
// (cuda/PERF_NOTES.md "Bias and mask arrays in the kernels").
//
// Fragment layouts as gpu/score_mods.cuh's: the forward's element (0, nt, e) is query row
// lane / 4 (+ 8 for e >= 2) and key 8 nt + 2 (lane % 4) + e % 2 of the warp's tile; the
// backward's transposed tiles hold keys in rows and queries in columns.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "common/attention_params.h"
#include "common/mask.h"
#include "gpu/score_mods.cuh"
#include "gpu/segment_ids.cuh"

namespace jax_flash::cuda {

// The elements of a thread's fragment lie on two lines of the array (its two rows, or in the
// backward's transposed tiles its two keys) at small distances along the other dim: each line's
// address is formed once, in 64 bits, and each element's in 32 (a tile's extent times a stride).
// f(typed pointer) with the bias's elements as float32 or the inputs' T (the Python side casts
// any other dtype; the handler checks it): the dtype branch outside the element loops.
template <typename T, typename F>
__device__ __forceinline__ void with_bias_elements(const LogitArray& a, F&& f) {
  if (a.dtype == Dtype::kFloat32)
    f(static_cast<const float*>(a.data));
  else
    f(static_cast<const T*>(a.data));
}

// A score the masks left gains the bias (times `factor`, 1 / the softmax scale of the general
// kernels); -inf stays -inf. A NaN bias makes the score NaN.
__device__ __forceinline__ float add_bias(float s, float bias, float factor) {
  return s == -INFINITY ? s : fmaf(bias, factor, s);
}

// The forward: a warp's 16 x (8 kNTiles) tile s, its first row query m0 and first key n0, of
// batch element b and query head h, after the range masks and the ids'; `seen` gains the rows
// that meet a key the mask and the rows' key ranges let through (with a mask array only: the
// caller starts it at none). Element (0, nt, 2 half + c) is row m0 + lane / 4 + 8 half and key
// n0 + 2 (lane % 4) + 8 nt + c.
template <typename T, int kNTiles>
__device__ __forceinline__ void apply_logit_arrays(float (&s)[1][kNTiles][4], const AttentionParams& p, int64_t b,
                                                   int64_t h, int64_t m0, int64_t n0, int64_t q_len, int64_t kv_len,
                                                   int lane, SeenRows<1>& seen) {
  const int keys_left = static_cast<int>(p.shape.seq_k - n0) - (lane % 4) * 2;  // this thread's keys in the call
  const int64_t j0 = n0 + (lane % 4) * 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t i = m0 + half * 8 + lane / 4;
    if (i >= p.shape.seq_q) continue;
    if (p.logit_mask) {
      const LogitArray& a = p.logit_mask;
      const uint8_t* line = static_cast<const uint8_t*>(a.data) + a.offset(b, h) + i * a.row + j0 * a.col;
      const int step = static_cast<int>(a.col);
      const KeyRange r = key_range(p.mask, i, q_len, kv_len);
      const int begin = static_cast<int>(max64(-1, min64(r.begin - j0, kNTiles * 8)));
      const int end = static_cast<int>(max64(-1, min64(r.end - j0, kNTiles * 8)));
      bool any = false;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int jj = nt * 8 + c;  // the key, less j0
          if (jj >= keys_left) continue;
          const bool keep = line[jj * step] != 0;
          any |= keep && jj >= begin && jj < end;
          if (!keep) s[0][nt][2 * half + c] = -INFINITY;
        }
      if (any) seen.seen[0][half] = true;
    }
    if (p.bias) {
      const LogitArray& a = p.bias;
      const float factor = 1.f / ScoreMods::softmax_scale(p);
      const int64_t at = a.offset(b, h) + i * a.row + j0 * a.col;
      const int step = static_cast<int>(a.col);
      with_bias_elements<T>(a, [&](const auto* elements) {
        const auto* line = elements + at;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int jj = nt * 8 + c;
            if (jj < keys_left)
              s[0][nt][2 * half + c] = add_bias(s[0][nt][2 * half + c], static_cast<float>(line[jj * step]), factor);
          }
      });
    }
  }
}

// f(ii, x) for each element x of a transposed tile st (keys from key0 in rows, queries from
// query0 in columns) inside the call's seq_q x seq_k: ii its query less the thread's first,
// query0 + 2 (lane % 4); half its key's, key0 + lane / 4 + 8 half. `line(half)` runs first for
// each key row inside the call.
template <int kNTiles, typename Element, typename Line, typename F>
__device__ __forceinline__ void for_each_transposed(Element (&st)[1][kNTiles][4], const AttentionShape& sh,
                                                    int64_t key0, int64_t query0, int lane, Line&& line, F&& f) {
  const int queries_left = static_cast<int>(sh.seq_q - query0) - (lane % 4) * 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (key0 + half * 8 + lane / 4 >= sh.seq_k) continue;
    line(half);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int ii = nt * 8 + c;
        if (ii < queries_left) f(ii, st[0][nt][2 * half + c]);
      }
  }
}

// Where element (query0 + 2 (lane % 4), key0 + lane / 4 + 8 half) of the (b, h) slice of `a` is.
__device__ __forceinline__ int64_t transposed_line(const LogitArray& a, int64_t b, int64_t h, int64_t key0,
                                                   int64_t query0, int lane, int half) {
  return a.offset(b, h) + (query0 + (lane % 4) * 2) * a.row + (key0 + lane / 4 + half * 8) * a.col;
}

// The backward's transposed tile st, after its range masks.
template <typename T, int kNTiles>
__device__ __forceinline__ void apply_logit_arrays_transposed(float (&st)[1][kNTiles][4], const AttentionParams& p,
                                                              int64_t b, int64_t h, int64_t key0, int64_t query0,
                                                              int lane) {
  if (p.logit_mask) {
    const LogitArray& a = p.logit_mask;
    const uint8_t* line = nullptr;
    const int step = static_cast<int>(a.row);
    for_each_transposed(
        st, p.shape, key0, query0, lane,
        [&](int half) { line = static_cast<const uint8_t*>(a.data) + transposed_line(a, b, h, key0, query0, lane, half); },
        [&](int ii, float& x) {
          if (line[ii * step] == 0) x = -INFINITY;
        });
  }
  if (p.bias) {
    const LogitArray& a = p.bias;
    const float factor = 1.f / ScoreMods::softmax_scale(p);
    const int step = static_cast<int>(a.row);
    with_bias_elements<T>(a, [&](const auto* elements) {
      decltype(elements) line = nullptr;
      for_each_transposed(
          st, p.shape, key0, query0, lane,
          [&](int half) { line = elements + transposed_line(a, b, h, key0, query0, lane, half); },
          [&](int ii, float& x) { x = add_bias(x, static_cast<float>(line[ii * step]), factor); });
    });
  }
}

// dbias += dS^T (dst: P^T (dP^T - delta), the softmax scale left out as the kernels leave it: the
// bias enters the scores after the scale) over the transposed tile, into the float32 copy of the
// bias's shape. Along a broadcast dim several elements add into one (atomics: the order varies;
// a bias without broadcast dims takes one add an element, exact).
template <int kNTiles>
__device__ __forceinline__ void add_dbias_transposed(const float (&dst)[1][kNTiles][4], const BwdParams& p, int64_t b,
                                                     int64_t h, int64_t key0, int64_t query0, int lane) {
  const LogitArray& a = p.bias;
  float* line = nullptr;
  const int step = static_cast<int>(a.row);
  for_each_transposed(
      dst, p.shape, key0, query0, lane,
      [&](int half) { line = p.dbias_accum + transposed_line(a, b, h, key0, query0, lane, half); },
      [&](int ii, float ds) {
        if (ds != 0.f) atomicAdd(line + ii * step, ds);
      });
}

}  // namespace jax_flash::cuda
