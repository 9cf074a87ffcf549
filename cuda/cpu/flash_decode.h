// Split-KV decode forward on the CPU (flash-decoding; see common/decode_params.h): one task per
// (batch, kv head, tile of packed query rows, key chunk), then a combine pass per (batch, query
// head). The packed rows of a kv head are its group's query heads at each query position,
// position-major (row p: position p / group, head hk * group + p % group), so one K/V tile
// serves every query head of the group. Contiguous and paged K/V differ only in where a key
// row is read from (key_row). v's head dim Hv may differ from q's and k's H (MLA): V, o and the
// partial outputs are Hv wide.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/decode_params.h"
#include "common/mask.h"
#include "cpu/flash_fwd.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "cpu/tile_gemm.h"
#include "cpu/tile_io.h"

namespace jax_flash::cpu::JF_ISA {

template <typename T>
struct FlashDecode {
  const DecodeParams& p;
  int64_t dp;          // q's and k's head dim H padded to kHeadDimAlign
  int64_t hvp;         // v's and o's head dim Hv padded likewise
  int64_t group;       // query heads per kv head
  int64_t packed;      // packed query rows per (batch, kv head): seq_q * group
  int64_t row_tiles;   // tiles of kBlockQ packed rows

  explicit FlashDecode(const DecodeParams& params)
      : p(params),
        dp(padded_head_dim(params.shape.head_dim)),
        hvp(padded_head_dim(params.shape.head_dim_v)),
        group(params.shape.group()),
        packed(params.shape.seq_q * params.shape.group()),
        row_tiles(ceil_div(params.shape.seq_q * params.shape.group(), kBlockQ)) {}

  int64_t num_tasks() const { return p.shape.batch * p.shape.heads_k * row_tiles * p.num_splits; }

  // The keys query row t sees (its position shifted to the end of the keys with queries_at_end).
  KeyRange row_keys(int64_t t, int64_t q_len, int64_t kv_len) const {
    const int64_t offset = p.queries_at_end ? kv_len - p.shape.seq_q : 0;
    return key_range(p.mask, t + offset, q_len + offset, kv_len);
  }

  // Key (or value) row j < seq_k of batch element b and kv head hk, rows `width` wide (H for
  // keys, Hv for values). A page table entry is clamped into [0, num_pages) before use: the
  // handler refuses tables whose entries a sequence reaches outside that range, and the kernel
  // never trusts them beyond it either.
  const T* key_row(const void* base, int64_t width, int64_t b, int64_t hk, int64_t j) const {
    const AttentionShape& sh = p.shape;
    const T* x = static_cast<const T*>(base);
    if (!p.paged) return x + ((b * sh.seq_k + j) * sh.heads_k + hk) * width;
    int64_t page = p.page_table[b * p.pages_per_seq + j / p.page_size];
    page = page < 0 ? 0 : (page >= p.num_pages ? p.num_pages - 1 : page);
    return x + ((page * p.page_size + j % p.page_size) * sh.heads_k + hk) * width;
  }

  void operator()(int64_t task) const {
    const AttentionShape& sh = p.shape;
    const int64_t split = task % p.num_splits;
    const int64_t tile = (task / p.num_splits) % row_tiles;
    const int64_t hk = (task / (p.num_splits * row_tiles)) % sh.heads_k;
    const int64_t b = task / (p.num_splits * row_tiles * sh.heads_k);
    const int64_t d = sh.head_dim, hv = sh.head_dim_v;
    const int64_t q_len = p.q_lens ? clamp_len(p.q_lens, b, sh.seq_q) : sh.seq_q;
    const int64_t kv_len = clamp_len(p.kv_lens, b, sh.seq_k);

    const int64_t p0 = tile * kBlockQ;
    const int64_t rows = min64(kBlockQ, packed - p0);
    const int64_t live_rows = max64(0, min64(rows, q_len * group - p0));

    // Each row's keys; their union [lo, hi) is cut into the chunks, this task taking one.
    KeyRange keys[kBlockQ];
    int64_t lo = INT64_MAX, hi = 0, max_begin = 0, min_end = INT64_MAX;
    for (int64_t r = 0; r < rows; ++r) {
      keys[r] = r < live_rows ? row_keys((p0 + r) / group, q_len, kv_len) : KeyRange{0, 0};
      if (r >= live_rows) continue;
      max_begin = max64(max_begin, keys[r].begin);
      min_end = min64(min_end, keys[r].end);
      if (keys[r].empty()) continue;
      lo = min64(lo, keys[r].begin);
      hi = max64(hi, keys[r].end);
    }
    int64_t c0 = 0, c1 = 0;
    if (lo < hi) {
      const int64_t chunk = round_up(ceil_div(hi - lo, p.num_splits), kBlockK);
      c0 = min64(hi, lo + split * chunk);
      c1 = min64(hi, c0 + chunk);
    }

    const int64_t kp = kBlockK;
    float* q_tile =
        thread_scratch(kBlockQ * dp + kBlockQ * hvp + dp * kp + kp * hvp + kBlockQ * kp + 2 * kBlockQ);
    float* acc = q_tile + kBlockQ * dp;
    float* kt_tile = acc + kBlockQ * hvp;
    float* v_tile = kt_tile + dp * kp;
    float* scores = v_tile + kp * hvp;
    float* row_ref = scores + kBlockQ * kp;
    float* row_sum = row_ref + kBlockQ;
    for (int64_t r = 0; r < rows; ++r) {
      row_ref[r] = -INFINITY;
      row_sum[r] = 0.f;
    }

    if (c0 < c1 && live_rows > 0) {
      for (int64_t r = 0; r < live_rows; ++r) {
        const int64_t t = (p0 + r) / group, h = hk * group + (p0 + r) % group;
        load_rows(static_cast<const T*>(p.q) + ((b * sh.seq_q + t) * sh.heads_q + h) * d, 0, 1, d,
                  q_tile + r * dp, dp);
      }
      for (int64_t x = 0; x < live_rows * hvp; ++x) acc[x] = 0.f;
      const float score_scale = p.scale * kLog2e;  // base-2 scores, as the tiled forward
      for (int64_t j0 = c0; j0 < c1; j0 += kp) {
        const int64_t cols = min64(kp, c1 - j0);
        // K^T (dp x kp, zero padded) and V (cols x dp), row by row: a tile may span pages.
        for (int64_t c = 0; c < cols; ++c) {
          const T* k = key_row(p.k, d, b, hk, j0 + c);
          for (int64_t e = 0; e < d; ++e) kt_tile[e * kp + c] = to_float(k[e]);
          load_rows(key_row(p.v, hv, b, hk, j0 + c), 0, 1, hv, v_tile + c * hvp, hvp);
        }
        for (int64_t e = 0; e < dp; ++e)
          for (int64_t c = (e < d ? cols : 0); c < kp; ++c) kt_tile[e * kp + c] = 0.f;
        gemm(live_rows, kp, dp, score_scale, q_tile, dp, kt_tile, kp, scores, kp, false);
        const bool whole = cols == kp && j0 >= max_begin && j0 + cols <= min_end;
        for (int64_t r = 0; r < live_rows; ++r) {
          float* s = scores + r * kp;
          if (!whole) mask_row(s, j0, cols, kp, keys[r]);
          const float correction = softmax_row_update(s, kp, row_ref[r], row_sum[r]);
          if (correction != 1.f) {
            const Vec cv = splat(correction);
            for (int64_t c = 0; c < hvp; c += kLanes) store(acc + r * hvp + c, load(acc + r * hvp + c) * cv);
          }
        }
        gemm(live_rows, hvp, cols, 1.f, scores, kp, v_tile, hvp, acc, hvp, true);
      }
    }

    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = (p0 + r) / group, h = hk * group + (p0 + r) % group;
      // Whether the row sees a key of this chunk; with one chunk, whether it sees any key (a row
      // is empty by the masks, never by its values: a NaN sum gives NaN, as the tiled forward).
      const bool seen = r < live_rows && !keys[r].empty() && keys[r].begin < c1 && keys[r].end > c0;
      if (p.num_splits == 1) {
        const int64_t out_row = ((b * sh.seq_q + t) * sh.heads_q + h) * hv;
        const float inv = seen ? 1.f / row_sum[r] : 0.f;
        if (p.o_float32)
          seen ? store_row(acc + r * hvp, hv, inv, static_cast<float*>(p.o) + out_row)
               : store_zeros(hv, static_cast<float*>(p.o) + out_row);
        else
          seen ? store_row(acc + r * hvp, hv, inv, static_cast<T*>(p.o) + out_row)
               : store_zeros(hv, static_cast<T*>(p.o) + out_row);
        p.lse[(b * sh.heads_q + h) * sh.seq_q + t] =
            seen ? natural_lse(row_ref[r], row_sum[r]) : kEmptyRowLse;
      } else {
        const int64_t row = ((split * sh.batch + b) * sh.heads_q + h) * sh.seq_q + t;
        float* o_part = p.o_partial + row * hv;
        seen ? store_row(acc + r * hvp, hv, 1.f / row_sum[r], o_part) : store_zeros(hv, o_part);
        p.lse_partial[row] = seen ? natural_lse(row_ref[r], row_sum[r]) : -INFINITY;
      }
    }
  }
};

// Merges the chunks' partial results of every row of one (batch, query head):
//   lse = log(sum_s exp(lse_s)),  o = sum_s exp(lse_s - lse) * o_s
// over the chunks (a chunk without the row's keys has lse_s = -inf and weight 0). A NaN lse_s
// (a NaN or inf the row saw in that chunk) makes the weights' sum, o and lse NaN.
template <typename T>
struct DecodeCombine {
  const DecodeParams& p;

  int64_t num_tasks() const { return p.shape.batch * p.shape.heads_q; }

  void operator()(int64_t task) const {
    const AttentionShape& sh = p.shape;
    const int64_t h = task % sh.heads_q, b = task / sh.heads_q;
    const int64_t d = sh.head_dim_v;  // the outputs'
    const int64_t q_len = p.q_lens ? clamp_len(p.q_lens, b, sh.seq_q) : sh.seq_q;
    const int64_t kv_len = clamp_len(p.kv_lens, b, sh.seq_k);
    const int64_t offset = p.queries_at_end ? kv_len - sh.seq_q : 0;
    const int64_t splits = p.num_splits, split_rows = sh.batch * sh.heads_q * sh.seq_q;
    float* out = thread_scratch(padded_head_dim(d));
    for (int64_t t = 0; t < sh.seq_q; ++t) {
      const int64_t row = (b * sh.heads_q + h) * sh.seq_q + t;  // of split 0
      const int64_t out_row = ((b * sh.seq_q + t) * sh.heads_q + h) * d;
      const bool empty = key_range(p.mask, t + offset, q_len + offset, kv_len).empty();
      float lse = kEmptyRowLse;
      if (!empty) {
        float max_lse = -INFINITY;
        for (int64_t s = 0; s < splits; ++s) {
          const float x = p.lse_partial[s * split_rows + row];
          max_lse = x > max_lse ? x : max_lse;  // NaN never compares greater
        }
        float sum = 0.f;
        for (int64_t e = 0; e < d; ++e) out[e] = 0.f;
        for (int64_t s = 0; s < splits; ++s) {
          const float x = p.lse_partial[s * split_rows + row];
          if (x == -INFINITY) continue;  // the chunk holds none of the row's keys
          const float w = __builtin_expf(x - max_lse);
          const float* o_part = p.o_partial + (s * split_rows + row) * d;
          for (int64_t e = 0; e < d; ++e) out[e] += w * o_part[e];
          sum += w;
        }
        lse = max_lse + __builtin_logf(sum);
        if (p.o_float32)
          store_row(out, d, 1.f / sum, static_cast<float*>(p.o) + out_row);
        else
          store_row(out, d, 1.f / sum, static_cast<T*>(p.o) + out_row);
      } else if (p.o_float32) {
        store_zeros(d, static_cast<float*>(p.o) + out_row);
      } else {
        store_zeros(d, static_cast<T*>(p.o) + out_row);
      }
      p.lse[row] = lse;
    }
  }
};

template <typename T>
void flash_decode_typed(const DecodeParams& params, const TaskRunner& runner) {
  FlashDecode<T> split_pass(params);
  parallel_for(runner, split_pass.num_tasks(), split_pass);
  if (params.num_splits > 1) {
    DecodeCombine<T> combine{params};
    parallel_for(runner, combine.num_tasks(), combine);
  }
}

}  // namespace jax_flash::cpu::JF_ISA
