// jax.nn's bias and mask arrays (AttentionParams::bias, logit_mask) in the Hopper kernels' score
// tiles, read where they lie through their strides (common/attention_params.h LogitArray: 0
// along a broadcast dim), never broadcast to (B, N, T, S) (the mask's bits along the keys only,
// T S / 8 bytes at most): the same semantics as the CPU kernel's
// cpu/logit_arrays.h. A false mask element makes its score -inf; the bias is added to the scores
// the masks left (a masked score stays -inf, whatever the bias holds), after the soft cap and
// ALiBi, in the tiles' units (the cap's with one: the bias over the cap). The forward tracks
// which rows met a key that every mask lets through (SeenRows, from the mask's bits and the rows'
// key ranges, never from the values); the backward adds dS = P (dP - delta) into a float32 copy
// of the bias's shape (AttentionParams::dbias_accum) by atomics.
//
// Experimental (issue 16 item 3): a general kernel instantiation of its own (kLogitArrays), run
// only where the Python side passes the arrays (JAX_FLASH_CUDA_LOGIT_ARRAYS=on). Where the bias
// allows (bias_stages: the inputs' 16-bit type, keys contiguous, rows 16-byte aligned) and the
// kernel's shared memory has room, the bias tile of each key block (forward) or visit (backward)
// goes into shared memory a stage ahead: by TMA where it has a descriptor (sm90/tensor_map.h
// make_bias_tensor_map: rows not broadcast), else by the producer warp's copies
// (stage_bias_tile); the consumers read it by ldmatrix (add_staged_bias,
// add_staged_bias_transposed); otherwise its elements are scalar global loads in the consumers'
// path. The mask comes as bits in the fragments' order, a word a thread, row and 128 keys
// (jax_flash._logit_arrays.cuda_mask_bits; keys in rows for the backward), two loads a thread
// and 128-key block in the forward (64 byte loads before, session 36). dbias takes 16-byte atomics of four keys where its layout allows
// (dbias_quads). JAX_FLASH_CUDA_BIAS_LOADS=staged keeps the warp's copies, =direct the scalar
// loads and float32 atomics (cuda/PERF_NOTES.md "Bias and mask arrays in the kernels"). A staged
// bias alone (staged_bias_alone) runs in instantiations without the ids' code (kLogitArrays &&
// !kIds).
//
// Fragment layouts as gpu/score_mods.cuh's: the forward's element (0, nt, e) is query row
// lane / 4 (+ 8 for e >= 2) and key 8 nt + 2 (lane % 4) + e % 2 of the warp's tile; the
// backward's transposed tiles hold keys in rows and queries in columns.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/attention_params.h"
#include "common/mask.h"
#include "gpu/mask.cuh"
#include "gpu/score_mods.cuh"
#include "gpu/segment_ids.cuh"
#include "gpu/smem_tile.cuh"
#include "gpu/tile_io.cuh"

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

// The word of mask bits (jax_flash._logit_arrays.cuda_mask_bits: the CUDA handlers' mask,
// common/ffi_params.h set_mask_bits) that a thread of quad lane lane % 4 reads for line `line`
// of slice (b, h) (a query row of the forward's tiles, a key row of the backward's transposed
// ones) from column column0 (a multiple of 8) on: bit 2 nt + c of the result is column
// column0 + 8 nt + 2 (lane % 4) + c, for the columns up to the end of column0's group of 128.
__device__ __forceinline__ uint32_t mask_bits_word(const LogitArray& a, int64_t b, int64_t h, int64_t line,
                                                   int64_t column0, int lane) {
  const uint32_t* words = static_cast<const uint32_t*>(a.data) + a.offset(b, h) + line * a.row;
  return words[column0 / kMaskBitsGroup * kMaskBitsWords + lane % kMaskBitsWords] >> (column0 % kMaskBitsGroup / 8 * 2);
}

// The forward: a warp's 16 x (8 kNTiles) tile s, its first row query m0 and first key n0, of
// batch element b and query head h, after the range masks and the ids'; `seen` gains the rows
// that meet a key the mask and the rows' key ranges let through (with a mask array only: the
// caller starts it at none). Element (0, nt, 2 half + c) is row m0 + lane / 4 + 8 half and key
// n0 + 2 (lane % 4) + 8 nt + c.
// With `bias_staged` the bias is left to add_staged_bias.
template <typename T, int kNTiles>
__device__ __forceinline__ void apply_logit_arrays(float (&s)[1][kNTiles][4], const AttentionParams& p, int64_t b,
                                                   int64_t h, int64_t m0, int64_t n0, int64_t q_len, int64_t kv_len,
                                                   int lane, SeenRows<1>& seen, bool bias_staged) {
  const int keys_left = static_cast<int>(p.shape.seq_k - n0) - (lane % 4) * 2;  // this thread's keys in the call
  const int64_t j0 = n0 + (lane % 4) * 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t i = m0 + half * 8 + lane / 4;
    if (i >= p.shape.seq_q) continue;
    if (p.logit_mask) {
      static_assert(kNTiles * 8 <= kMaskBitsGroup, "a tile's keys in one group (mask_bits_word)");
      const uint32_t bits = mask_bits_word(p.logit_mask, b, h, i, n0, lane);
      const KeyRange r = key_range(p.mask, i, q_len, kv_len);
      const auto [begin, end] = span_in_tile(r, j0, kNTiles * 8);
      bool any = false;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int jj = nt * 8 + c;  // the key, less j0
          if (jj >= keys_left) continue;
          const bool keep = (bits >> (2 * nt + c)) & 1u;
          any |= keep && jj >= begin && jj < end;
          if (!keep) s[0][nt][2 * half + c] = -INFINITY;
        }
      if (any) seen.seen[0][half] = true;
    }
    if (p.bias && !bias_staged) {
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

// Whether the forward may stage the bias's tiles (stage_bias_tile): the inputs' 16-bit type,
// keys contiguous, and every row of every (b, h) slice starting on 16 bytes with whole 16-byte
// chunks up to the call's last key (strides and seq_k multiples of 8 elements).
JF_HOST_DEVICE inline bool bias_stages(const AttentionParams& p) {
  const LogitArray& a = p.bias;
  return a && p.dtype != Dtype::kFloat32 && a.dtype == p.dtype && a.col == 1 && a.row % 8 == 0 && a.head % 8 == 0 &&
         a.batch % 8 == 0 && p.shape.seq_k % 8 == 0 && reinterpret_cast<uintptr_t>(a.data) % 16 == 0;
}

// Whether a call's arrays are a bias alone, with no mask array, segment ids or block mask: staged,
// it runs in the Hopper kernels' kLogitArrays instantiations without the ids' code.
inline bool staged_bias_alone(const AttentionParams& p) {
  return p.bias && !p.logit_mask && p.q_segment_ids == nullptr && p.kv_block_lists == nullptr;
}

// The coordinates of slice (b, h) in the bias's TMA descriptor (sm90/tensor_map.h
// make_bias_tensor_map: a broadcast dim has extent 1).
struct BiasSlice {
  int head, batch;
};
JF_HOST_DEVICE inline BiasSlice bias_slice(const LogitArray& a, int64_t b, int64_t h) {
  return {a.head ? static_cast<int>(h) : 0, a.batch ? static_cast<int>(b / a.batch_div) : 0};
}

// The producer warp's copy of the bias tile of query rows m0.. and keys n0.. (a Tile, kRows x
// kCols) of slice (b, h) into shared memory, zero past the call's rows and keys. The caller
// makes the copies arrive on the tile's barrier.
template <typename Tile, typename T>
__device__ __forceinline__ void stage_bias_tile(T* tile, const AttentionParams& p, int64_t b, int64_t h, int64_t m0,
                                                int64_t n0, int lane) {
  const LogitArray& a = p.bias;
  const T* first = static_cast<const T*>(a.data) + a.offset(b, h) + m0 * a.row + n0;
  const int rows = static_cast<int>(min64(Tile::kRows, p.shape.seq_q - m0));
  const int chunks = static_cast<int>(min64(Tile::kChunks, (p.shape.seq_k - n0) / 8));
  warp_load_tile<Tile>(tile, first, a.row, rows, chunks, lane);
}

// add_bias of the four pairs of one ldmatrix x4 (matrix m: n-tile nt + m / 2, row half m % 2 of
// a thread's fragment: the same places in the forward's tiles and the backward's transposed ones).
template <typename T, int kNTiles>
__device__ __forceinline__ void add_bias_pairs(float (&s)[1][kNTiles][4], int nt, const uint32_t (&pairs)[4],
                                               float factor) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float2 bias = unpack_pair<T>(pairs[m]);
    float* x = &s[0][nt + m / 2][2 * (m % 2)];
    x[0] = add_bias(x[0], bias.x, factor);
    x[1] = add_bias(x[1], bias.y, factor);
  }
}

// Whether a tile's swizzle moves chunks by XOR within a row (SmemTile::physical_chunk).
template <typename Tile, typename = void>
inline constexpr bool kHasPhysicalChunk = false;
template <typename Tile>
inline constexpr bool kHasPhysicalChunk<Tile, std::void_t<decltype(Tile::physical_chunk(0, 0))>> = true;

// add_bias of the staged tile's elements to a warp's 16 x (8 kNTiles) scores s (the tile's rows
// row0.. and every key). One ldmatrix gives a thread its two rows' pairs of two n-tiles: lanes
// 8 m .. 8 m + 7 address matrix m's rows (rows row0 + 8 (m % 2).., chunk nt + m / 2). Tile: the
// producer's copy's SmemTile, or the TMA's GmmaTile (its offset: the same chunk's place there).
template <typename Tile, typename T, int kNTiles>
__device__ __forceinline__ void add_staged_bias(float (&s)[1][kNTiles][4], const T* tile, int row0, float factor,
                                                int lane) {
  static_assert(kNTiles == Tile::kChunks && kNTiles % 2 == 0, "a tile row of whole chunk pairs");
  const int row = row0 + lane % 8 + (lane / 8 % 2) * 8;
  if constexpr (kHasPhysicalChunk<Tile>) {
    // Chunk nt + c of the row (nt even, c < 2) is at physical chunk physical_chunk(row, c) ^ nt.
    const uint32_t row_address = smem_address(tile + row * Tile::kCols);
    const int chunk = Tile::physical_chunk(row, lane / 16);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t pairs[4];
      ldmatrix_x4(pairs, row_address + (chunk ^ nt) * 16);
      add_bias_pairs<T>(s, nt, pairs, factor);
    }
  } else {
    const uint32_t base = smem_address(tile);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t pairs[4];
      ldmatrix_x4(pairs, base + Tile::offset(row, nt + lane / 16) * static_cast<int>(sizeof(T)));
      add_bias_pairs<T>(s, nt, pairs, factor);
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

// add_bias of the staged tile's elements (a Tile of queries in rows, keys in columns: the
// producer's copy's SmemTile or the TMA's GmmaTile, as in the forward) to a backward warp's
// transposed scores st (keys key0 .. + 15 of the tile's columns in rows, its queries query0 ..
// in columns). ldmatrix .trans hands each thread its transposed pairs: lanes 8 m .. 8 m + 7
// address matrix m's query rows (query0 + 8 (nt + m / 2) .., key chunk key0 / 8 + m % 2).
template <typename Tile, typename T, int kNTiles>
__device__ __forceinline__ void add_staged_bias_transposed(float (&st)[1][kNTiles][4], const T* tile, int key0,
                                                           int query0, float factor, int lane) {
  static_assert(kNTiles % 2 == 0, "whole pairs of query n-tiles");
  const int row = query0 + lane % 8 + (lane / 16) * 8;
  // Rows 8 apart share the swizzle in both tiles: one chunk place for every n-tile pair, rows a
  // whole row (SmemTile) or a row of the chunk's 64-column block (GmmaTile) apart.
  constexpr int kRowElements = kHasPhysicalChunk<Tile> ? Tile::kCols : 64;
  const uint32_t address = smem_address(tile + Tile::offset(row, key0 / 8 + lane / 8 % 2));
#pragma unroll
  for (int nt = 0; nt < kNTiles; nt += 2) {
    uint32_t pairs[4];
    ldmatrix_x4_trans(pairs, address + nt * 8 * kRowElements * 2);
    add_bias_pairs<T>(st, nt, pairs, factor);
  }
}

// The backward's transposed tile st, after its range masks; with `bias_staged` the bias is left
// to add_staged_bias_transposed.
template <typename T, int kNTiles>
__device__ __forceinline__ void apply_logit_arrays_transposed(float (&st)[1][kNTiles][4], const AttentionParams& p,
                                                              int64_t b, int64_t h, int64_t key0, int64_t query0,
                                                              int lane, bool bias_staged) {
  if (p.logit_mask) {
    // Its bits with keys in rows (the backward's, set_mask_bits): a word a key row.
    static_assert(kNTiles * 8 <= kMaskBitsGroup, "a tile's queries in one group (mask_bits_word)");
    uint32_t bits = 0;
    for_each_transposed(
        st, p.shape, key0, query0, lane,
        [&](int half) { bits = mask_bits_word(p.logit_mask, b, h, key0 + lane / 4 + half * 8, query0, lane); },
        [&](int ii, float& x) {
          if (!((bits >> (ii / 8 * 2 + ii % 2)) & 1u)) x = -INFINITY;
        });
  }
  if (p.bias && !bias_staged) {
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

// Whether dbias's float32 elements take the quads' 16-byte atomics (add_dbias_transposed): keys
// contiguous, every row of every slice on 16 bytes.
JF_HOST_DEVICE inline bool dbias_quads(const AttentionParams& p) {
  const LogitArray& a = p.bias;
  return a.col == 1 && a.row % 4 == 0 && a.head % 4 == 0 && a.batch % 4 == 0;
}

// Whether several batch elements add into each slice of dbias (a bias broadcast over the batch):
// the Hopper backward then runs their CTAs side by side (BwdParams::batch_innermost).
JF_HOST_DEVICE inline bool dbias_shared_by_batch(const BwdParams& p) {
  return p.dbias_accum != nullptr && p.shape.batch > 1 && (p.bias.batch == 0 || p.bias.batch_div > 1);
}

// dbias += dS^T (dst: P^T (dP^T - delta), the softmax scale left out as the kernels leave it: the
// bias enters the scores after the scale) over the transposed tile, into the float32 copy of the
// bias's shape. Along a broadcast dim several elements add into one (atomics: the order varies;
// a bias without broadcast dims takes one add an element, exact).
// With `quads` (dbias_quads) a 16-byte atomic adds four keys of one query: lanes r = lane / 4 % 4
// of a quad column (one lane % 4) hold keys k0 + r of the same queries, which two exchanges
// transpose so that lane r holds query r of each four (two n-tiles' two columns) at keys k0 ..
// k0 + 3; a quarter of the atomics for four shuffles (dbias at a (1, N, T, S) bias is a float32
// atomic a score and batch element otherwise).
template <int kNTiles>
__device__ __forceinline__ void add_dbias_transposed(const float (&dst)[1][kNTiles][4], const BwdParams& p, int64_t b,
                                                     int64_t h, int64_t key0, int64_t query0, int lane, bool quads) {
  const LogitArray& a = p.bias;
  if (!quads) {
    float* line = nullptr;
    const int step = static_cast<int>(a.row);
    for_each_transposed(
        dst, p.shape, key0, query0, lane,
        [&](int half) { line = p.dbias_accum + transposed_line(a, b, h, key0, query0, lane, half); },
        [&](int ii, float ds) {
          if (ds != 0.f) atomicAdd(line + ii * step, ds);
        });
    return;
  }
  static_assert(kNTiles % 2 == 0, "whole pairs of query n-tiles");
  const bool odd = lane & 4, high = lane & 8;  // r's bits
  float* const slice = p.dbias_accum + a.offset(b, h);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t k0 = key0 + 8 * half + ((lane & 16) ? 4 : 0);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      // x[j], j = 2 (n-tile - nt) + column: this lane's key k0 + r at the four queries.
      const float x0 = dst[0][nt][2 * half], x1 = dst[0][nt][2 * half + 1];
      const float x2 = dst[0][nt + 1][2 * half], x3 = dst[0][nt + 1][2 * half + 1];
      // With lane r ^ 1: keep the queries j of r's parity, give the others; then each kept
      // query holds keys (r & 2) + 0 and + 1 (lo, hi).
      const float g0 = __shfl_xor_sync(0xffffffffu, odd ? x0 : x1, 4);
      const float g1 = __shfl_xor_sync(0xffffffffu, odd ? x2 : x3, 4);
      const float own0 = odd ? x1 : x0, own1 = odd ? x3 : x2;
      const float u0_lo = odd ? g0 : own0, u0_hi = odd ? own0 : g0;  // query j = parity
      const float u1_lo = odd ? g1 : own1, u1_hi = odd ? own1 : g1;  // query j = parity + 2
      // With lane r ^ 2: keep query r (j = parity + 2 high), give the other, and take the
      // partner's keys ((r & 2) ^ 2) + 0 and + 1 of query r.
      const float t0 = __shfl_xor_sync(0xffffffffu, high ? u0_lo : u1_lo, 8);
      const float t1 = __shfl_xor_sync(0xffffffffu, high ? u0_hi : u1_hi, 8);
      const float keep_lo = high ? u1_lo : u0_lo, keep_hi = high ? u1_hi : u0_hi;
      const float4 keys = high ? make_float4(t0, t1, keep_lo, keep_hi) : make_float4(keep_lo, keep_hi, t0, t1);
      const int64_t q = query0 + 2 * (lane % 4) + 8 * (nt + (high ? 1 : 0)) + (odd ? 1 : 0);
      if (q >= p.shape.seq_q || (keys.x == 0.f && keys.y == 0.f && keys.z == 0.f && keys.w == 0.f)) continue;
      float* const at = slice + q * a.row + k0;
      if (k0 + 3 < p.shape.seq_k) {
        atomic_add_quad(at, keys.x, keys.y, keys.z, keys.w);
      } else {  // the call's last keys
        const float each[4] = {keys.x, keys.y, keys.z, keys.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (k0 + i < p.shape.seq_k && each[i] != 0.f) atomicAdd(at + i, each[i]);
      }
    }
  }
}

}  // namespace jax_flash::cuda
