// FlashAttention backward on the CPU, by recomputation. Three passes:
//   1. delta = rowsum(dO * O) per query row, and the dQ accumulators zeroed;
//   2. one task per (batch, key/value head, dQ split): for each key block it owns (blocks are
//      dealt round-robin to the splits) it recomputes P from Q, K and lse for every query block
//      and query head of the group that sees it, accumulates dK and dV for the block in local
//      tiles, and adds its share of dQ into the float32 accumulator of its split (its key blocks
//      walk the query blocks up to kMaxBwdKeyBlocksInStep at a time, sharing each block's rows from L2);
//   3. dQ = sum of the split accumulators, in the input dtype.
// With dS = P * (dP - delta): dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K. With logit
// soft-capping dS is first multiplied by the cap's derivative 1 - tanh^2(scale q.k / c), recomputed
// per tile from the raw scores (soft_cap in flash_fwd.h). ALiBi's bias slope * (j - i) is added to
// each recomputed score tile as the forward added it (alibi_rows in flash_fwd.h); it depends on
// neither Q nor K, so dS needs nothing more, and the slopes get no gradient. With a block mask
// the query tiles are aligned at row 0 (on the tile grid: each of kBlockQ rows inside one
// kBlockMaskRows mask block, as each key block of kBlockK keys inside one kBlockMaskKeys one)
// and a tile whose mask block is hidden is skipped: its P is 0. With dropout (Z = keep /
// (1 - rate), regenerated per tile as the forward made it: dropout_columns in flash_fwd.h) the
// forward's O = (P * Z) V gives dV = (P * Z)^T dO and dS = P * (dP * Z - delta), delta =
// rowsum(dO * O) as without. jax.nn's bias and mask arrays (logit_arrays.h): the bias is added to
// each recomputed score tile as the forward added it and the mask hides what it hid; dbias is
// dS (the gradient of the biased score, before the soft cap's factor), summed over the bias's
// broadcast dims into float32 partials that only one task writes (FlashBwdMain's tasks).
// v's head dim Hv may differ from q's and k's H (MLA): O, dO, V and dV are Hv wide, Q, K, dQ and
// dK H wide; only dP = dO V^T and dV = P^T dO run over Hv.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

#include "cpu/bwd_products.h"
#include "cpu/flash_fwd.h"
#include "cpu/logit_arrays.h"

namespace jax_flash::cpu::JF_ISA {

// Where split s's dQ partial of (batch b, query head h) starts in the workspace: the partials are
// (split, batch, heads_q, seq_q, dp), a head's rows contiguous (its rows a whole heads_q x dp
// apart put a query block's 64 rows in a few L1 sets; the dQ product loads and stores them
// once per key block).
inline int64_t dq_accum_offset(const AttentionShape& sh, int64_t dp, int64_t s, int64_t b, int64_t h) {
  return ((s * sh.batch + b) * sh.heads_q + h) * sh.seq_q * dp;
}

template <typename T>
struct FlashBwdDelta {
  const BwdParams& p;
  int64_t dp;  // H padded: the dQ accumulator's row
  int64_t num_tasks() const { return p.shape.batch * p.shape.heads_q; }

  void operator()(int64_t task) const {
    const AttentionShape& sh = p.shape;
    const int64_t h = task % sh.heads_q, b = task / sh.heads_q, hv = sh.head_dim_v;  // O's and dO's
    const int64_t stride = sh.heads_q * hv;
    const int64_t offset = b * sh.seq_q * stride + h * hv;
    const T* d_o = static_cast<const T*>(p.d_o) + offset;
    float* delta = p.delta + task * sh.seq_q;
    // O in float32 where the forward kept it so (AttentionParams::o_float32), else in T. Summed
    // in the panels of kKPanel columns that the dP = dO V^T product sums in (tile_gemm.h), one
    // chain a panel: on a row with a single visible key O = V, and dP - delta is then exactly 0,
    // as jax.nn's dS is there.
    auto row_dot = [&](const auto* o) {
      for (int64_t i = 0; i < sh.seq_q; ++i) {
        float sum = 0.f;
        for (int64_t c0 = 0; c0 < hv; c0 += kKPanel) {
          float panel = 0.f;
          for (int64_t c = c0; c < std::min(hv, c0 + kKPanel); ++c)
            panel += to_float(o[i * stride + c]) * to_float(d_o[i * stride + c]);
          sum = c0 == 0 ? panel : sum + panel;
        }
        delta[i] = sum;
      }
    };
    if (p.o_float32)
      row_dot(static_cast<const float*>(p.o) + offset);
    else
      row_dot(static_cast<const T*>(p.o) + offset);
    for (int64_t s = 0; s < p.dq_splits; ++s) {
      float* dq = p.dq_accum + dq_accum_offset(sh, dp, s, b, h);
      for (int64_t x = 0; x < sh.seq_q * dp; ++x) dq[x] = 0.f;
    }
  }
};

// The segment-id mask on a row of scores: s[c] = -inf for the keys c < cols whose id kv_ids[c]
// differs from the row's `id`.
inline void mask_row_segment(float* s, int64_t cols, const int32_t* kv_ids, int32_t id) {
  for (int64_t c = 0; c < cols; ++c)
    if (kv_ids[c] != id) s[c] = -INFINITY;
}

// The main pass: T the inputs' dtype, Products the five tile products and the layouts of the
// K/V tiles and dK/dV accumulators they own (bwd_products.h: float32 tiles; bf16_bwd_products.h:
// bfloat16 on AMX or vdpbf16ps tiles).
template <typename T, typename Products = FloatBwdProducts<T>>
struct FlashBwdMain {
  const BwdParams& p;
  const typename Products::Shared& shared;
  const int in_step;  // key blocks walking the query blocks together (run)

  // Tasks: (batch elements, kv heads, dQ split), one batch element and one kv head each but
  // where dbias is formed, and every dbias element must have one owner among the tasks that run
  // at once: a task then takes every batch element sharing its slice of the bias (batch_div of
  // them) and, where the bias has no head dim, every kv head. A split owns the dbias columns of
  // its key blocks; a bias without a key dim has a partial per split (dbias_parts).
  int64_t batch_units() const { return p.dbias ? p.shape.batch / p.bias.batch_div : p.shape.batch; }
  int64_t kv_units() const { return p.dbias && p.bias.head == 0 ? 1 : p.shape.heads_k; }
  int64_t num_tasks() const { return batch_units() * kv_units() * p.dq_splits; }

  void operator()(int64_t task) const {
    const int64_t split = task % p.dq_splits;
    const int64_t unit = task / p.dq_splits;
    const int64_t per_batch = p.shape.batch / batch_units(), per_kv = p.shape.heads_k / kv_units();
    const int64_t b0 = unit / kv_units() * per_batch, hk0 = unit % kv_units() * per_kv;
    for (int64_t b = b0; b < b0 + per_batch; ++b)
      for (int64_t hk = hk0; hk < hk0 + per_kv; ++hk) run(b, hk, split);
  }

  // A key block of a task's walk: its keys [j0, j0 + cols) (live_cols of them before the
  // sequence's length), the query rows [first_row, end_row) that see them, their segment ids and
  // span, and the products holding its K/V tiles and dK/dV accumulators.
  struct KeyBlock {
    int64_t j0 = 0, cols = 0, live_cols = 0, first_row = 0, end_row = 0;
    const int32_t* kv_ids = nullptr;
    IdSpan k_span{0, 0};
    Products* products = nullptr;
  };

  // Key blocks split, split + dq_splits, ... of batch element b and kv head hk.
  void run(int64_t b, int64_t hk, int64_t split) const {
    const AttentionShape& sh = p.shape;
    const int64_t d = sh.head_dim, hv = sh.head_dim_v;
    const int64_t dp = padded_head_dim(d);  // the dQ accumulator's row
    const int64_t q_stride = sh.heads_q * d, k_stride = sh.heads_k * d;
    const int64_t o_stride = sh.heads_q * hv, v_stride = sh.heads_k * hv;
    const int64_t q_len = clamp_len(p.q_lens, b, sh.seq_q);
    const int64_t kv_len = clamp_len(p.kv_lens, b, sh.seq_k);
    const float score_scale = p.scale * kLog2e;
    const SoftCap cap(p.logits_soft_cap);
    constexpr int64_t bq = kBlockQ, bk = kBlockK;
    const bool blocks = p.block_mask != nullptr;
    const LogitArray& bias = p.bias;
    const LogitArray& logit_mask = p.logit_mask;
    float* dbias_part =
        p.dbias && !p.dbias_direct ? p.dbias_accum + (p.dbias_parts > 1 ? split : 0) * bias.elements : nullptr;

    // Scratch tiles: P, dS, lse, delta for the query block, with soft-capping the cap's
    // derivative per score, and with dropout Z and then P * Z, and Z^T as drawn (rows from a
    // multiple of kDropoutRows); then the products' own (the K/V tiles and dK/dV accumulators of
    // the key block, the Q/dO tiles of the query block).
    constexpr int64_t ldz = bq + kDropoutRows;
    float* probs =
        thread_scratch(4 * bq * bk + 2 * bq + bk * ldz + in_step * Products::scratch_floats(sh));
    float* dscores = probs + bq * bk;
    float* lse2 = dscores + bq * bk;
    float* delta = lse2 + bq;
    float* cap_grad = delta + bq;  // (bq, bk): 1 - tanh^2 of each raw score, with soft-capping
    float* dropped = cap_grad + bq * bk;  // (bq, bk): with dropout Z, then P * Z
    float* dropped_t = dropped + bq * bk;  // (bk, ldz): Z^T, rows from i0 rounded down
    std::optional<Products> products[kMaxBwdKeyBlocksInStep];
    for (int n = 0; n < in_step; ++n)
      products[n].emplace(p, shared, b, hk, dropped_t + bk * ldz + n * Products::scratch_floats(sh));

    const T* k = static_cast<const T*>(p.k) + b * sh.seq_k * k_stride + hk * d;
    const T* v = static_cast<const T*>(p.v) + b * sh.seq_k * v_stride + hk * hv;
    T* dk = static_cast<T*>(p.dk) + b * sh.seq_k * k_stride + hk * d;
    T* dv = static_cast<T*>(p.dv) + b * sh.seq_k * v_stride + hk * hv;
    const int64_t key_blocks = ceil_div(sh.seq_k, bk);

    // Key blocks kb0, kb0 + dq_splits, ... (in_step of them) walk each query head's blocks
    // together (KeyBlock; the order below), so a query block's Q, dO and dQ rows, brought from L3
    // for the first key block, serve the others from L2: from seq 4096 a head's query side
    // outgrows L2, and with a 64-key block per pass over it the bfloat16 backward ran 23% slower
    // at seq 8192 than at 2048 (PERF_NOTES CPU v3.11).
    for (int64_t kb0 = split; kb0 < key_blocks; kb0 += in_step * p.dq_splits) {
      KeyBlock walking[kMaxBwdKeyBlocksInStep];
      int count = 0;
      for (int n = 0; n < in_step; ++n) {
        const int64_t kb = kb0 + n * p.dq_splits;
        if (kb >= key_blocks) break;
        KeyBlock& key = walking[count];
        key.j0 = kb * bk;
        key.cols = min64(bk, sh.seq_k - key.j0);
        key.live_cols = max64(0, min64(key.cols, kv_len - key.j0));
        const QueryRange rows = queries_seeing_keys(p.mask, key.j0, key.j0 + key.live_cols, q_len, kv_len);
        key.first_row = rows.begin;
        key.end_row = rows.end;
        if (key.end_row <= key.first_row) {  // no query sees these keys: zero gradients
          for (int64_t r = 0; r < key.cols; ++r) {
            store_zeros(d, dk + (key.j0 + r) * k_stride);
            store_zeros(hv, dv + (key.j0 + r) * v_stride);
          }
          continue;
        }
        // Segment ids of these keys (null without), and their span: a query block whose ids
        // cannot meet it is skipped.
        key.kv_ids = p.kv_segment_ids ? p.kv_segment_ids + b * sh.seq_k + key.j0 : nullptr;
        key.k_span = key.kv_ids ? id_span(key.kv_ids, key.live_cols) : IdSpan{0, 0};
        key.products = &*products[count];
        key.products->load_keys(k + key.j0 * k_stride, k_stride, v + key.j0 * v_stride, v_stride, key.live_cols);
        ++count;
      }
      const int32_t* q_ids = p.q_segment_ids ? p.q_segment_ids + b * sh.seq_q : nullptr;

      for (int64_t h = hk * sh.group(); h < (hk + 1) * sh.group(); ++h) {
        const T* q = static_cast<const T*>(p.q) + b * sh.seq_q * q_stride + h * d;
        const T* d_o = static_cast<const T*>(p.d_o) + b * sh.seq_q * o_stride + h * hv;
        const float* lse = p.lse + (b * sh.heads_q + h) * sh.seq_q;
        const float* delta_h = p.delta + (b * sh.heads_q + h) * sh.seq_q;
        float* dq = p.dq_accum + dq_accum_offset(sh, dp, split, b, h);
        const int64_t dq_stride = dp;
        const Alibi alibi(p.alibi_slopes, b * sh.heads_q + h);
        const Dropout dropout(p, b, h);
        const int64_t bias_base = bias ? bias.offset(b, h) : 0;
        const int64_t mask_base = logit_mask ? logit_mask.offset(b, h) : 0;

        // One key block's visit of the query block at row i0.
        auto visit = [&](const KeyBlock& key, int64_t i0) {
          Products& products = *key.products;
          const int64_t j0 = key.j0, live_cols = key.live_cols, end_row = key.end_row;
          const int32_t* kv_ids = key.kv_ids;
          const IdSpan& k_span = key.k_span;
          const int64_t rows = min64(bq, end_row - i0);
          if (blocks && !p.block_visible(b, h, i0 / kBlockMaskRows, j0 / kBlockMaskKeys)) return;
          bool split_ids = false;
          if (q_ids) {
            const IdSpan q_span = id_span(q_ids + i0, rows);
            if (!q_span.meets(k_span)) return;
            split_ids = !q_span.same_single_id(k_span);
          }
          // A tile the mask array hides from every row is skipped: its P and dS are 0.
          if (logit_mask && !mask_tile_any(logit_mask, mask_base, i0, rows, j0, live_cols)) return;
          products.load_queries(q + i0 * q_stride, q_stride, d_o + i0 * o_stride, o_stride, h, i0, rows);
          for (int64_t r = 0; r < rows; ++r) {
            // A row with no visible key (the forward wrote kEmptyRowLse; inside a visited block
            // only where segment ids leave its document no key) gets +inf: every probability
            // of it exp2(-inf - inf) = 0, where -FLT_MAX * log2(e) = -inf would give NaN.
            lse2[r] = lse[i0 + r] == kEmptyRowLse ? INFINITY : base2_lse(lse[i0 + r]);
            delta[r] = delta_h[i0 + r];
          }
          // P = exp2(S * scale * log2e - lse * log2e), masked (S soft-capped and biased first,
          // as the forward formed it).
          products.scores(rows, score_scale, probs);
          if (cap) soft_cap(probs, rows * bk, cap, cap_grad);  // recomputed, never stored T x S
          if (alibi) alibi_rows(probs, bk, rows, bk, j0 - i0, alibi);
          if (bias) bias_rows(probs, bk, bias, bias_base, i0, rows, j0, live_cols, kLog2e);
          const KeyRange first = key_range(p.mask, i0, q_len, kv_len);
          const KeyRange last = key_range(p.mask, i0 + rows - 1, q_len, kv_len);
          const bool whole = live_cols == bk && j0 >= last.begin && j0 + bk <= first.end;
          for (int64_t r = 0; r < rows; ++r) {
            float* s = probs + r * bk;
            if (!whole || split_ids) mask_row(s, j0, live_cols, bk, key_range(p.mask, i0 + r, q_len, kv_len));
            if (split_ids) mask_row_segment(s, live_cols, kv_ids, q_ids[i0 + r]);
            if (logit_mask)
              mask_keys(s, 1, j0, live_cols, key_range(p.mask, i0 + r, q_len, kv_len),
                        mask_row_at(logit_mask, mask_base, i0 + r, j0), logit_mask.col, nullptr, 0);
            const Vec l = splat(lse2[r]);
            for (int64_t c = 0; c < bk; c += kLanes) store(s + c, exp2_nonpositive(vmin0(load(s + c) - l)));
          }
          if (dropout) {
            // Z over the whole tile width (keys past the sequence get a finite Z; their P is 0),
            // drawn transposed from the row group i0 falls in, then transposed into place.
            const int64_t shift = i0 % kDropoutRows;
            const Vec scale = splat(dropout.scale);
            dropout_columns(dropout, i0 - shift, shift + rows, j0, bk, [&](int64_t c, int64_t r, IVec keep) {
              store(dropped_t + c * ldz + r, keep ? scale : Vec{});
            });
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c = 0; c < bk; ++c) dropped[r * bk + c] = dropped_t[c * ldz + shift + r];
            // dP = dO V^T, then dS = P * (dP * Z - delta), and P * Z in place of Z
            products.score_grads(rows, dscores);
            for (int64_t r = 0; r < rows; ++r) {
              const Vec dr = splat(delta[r]);
              for (int64_t c = 0; c < bk; c += kLanes) {
                const int64_t x = r * bk + c;
                const Vec pr = load(probs + x), z = load(dropped + x);
                store(dscores + x, pr * (load(dscores + x) * z - dr));
                store(dropped + x, pr * z);
              }
            }
            // dV += (P * Z)^T dO
            products.accumulate_dv(dropped, rows, live_cols);
          } else {
            // dV += P^T dO
            products.accumulate_dv(probs, rows, live_cols);
            // dP = dO V^T, then dS = P * (dP - delta)
            products.score_grads(rows, dscores);
            for (int64_t r = 0; r < rows; ++r) {
              const Vec dr = splat(delta[r]);
              for (int64_t c = 0; c < bk; c += kLanes) {
                const Vec pr = load(probs + r * bk + c);
                store(dscores + r * bk + c, pr * (load(dscores + r * bk + c) - dr));
              }
            }
          }
          // dbias += dS (by the biased score: the bias comes after the cap).
          if (dbias_part) accumulate_dbias(dbias_part + bias_base, bias, dscores, bk, i0, rows, j0, live_cols);
          if (p.dbias_direct) store_dbias(p.dbias, bias, bias_base, dscores, bk, i0, rows, j0, live_cols);
          // Soft-capping: dS by the raw score is dS by the capped one times 1 - tanh^2.
          if (cap)
            for (int64_t x = 0; x < rows * bk; x += kLanes) store(dscores + x, load(dscores + x) * load(cap_grad + x));
          // dQ += scale dS K (into this split's float32 accumulator), dK += scale dS^T Q
          products.accumulate_dq_dk(dscores, rows, live_cols, p.scale, dq + i0 * dq_stride, dq_stride);
        };

        // A block mask: query tiles on the tile grid (aligned at row 0, each inside one mask
        // block), those whose mask block (i0 / kBlockMaskRows, j0 / kBlockMaskKeys) it hides
        // never visited. Each key block's next query block is next[n]; a dQ row takes its key
        // blocks' terms in their order, as when they walk one at a time (the same sums, bit for
        // bit): key block n visits rows [i, i + bq) only once every earlier one has passed them.
        // Of the visits allowed, the lowest row goes first, so the walks stay within a block.
        int64_t next[kMaxBwdKeyBlocksInStep];
        for (int n = 0; n < count; ++n)
          next[n] = blocks ? walking[n].first_row / bq * bq : walking[n].first_row;
        for (;;) {
          int chosen = -1;
          int64_t earliest_unvisited = INT64_MAX;  // the lowest row an earlier walk has yet to visit
          for (int n = 0; n < count; ++n) {
            const bool done = next[n] >= walking[n].end_row;
            if (!done && next[n] + bq <= earliest_unvisited && (chosen < 0 || next[n] < next[chosen])) chosen = n;
            if (!done) earliest_unvisited = min64(earliest_unvisited, next[n]);
          }
          if (chosen < 0) break;
          visit(walking[chosen], next[chosen]);
          next[chosen] += bq;
        }
      }
      for (int n = 0; n < count; ++n) {
        const KeyBlock& key = walking[n];
        for (int64_t r = 0; r < key.cols; ++r) {
          if (r < key.live_cols) {
            key.products->store_key_row(r, dk + (key.j0 + r) * k_stride, dv + (key.j0 + r) * v_stride);
          } else {
            store_zeros(d, dk + (key.j0 + r) * k_stride);
            store_zeros(hv, dv + (key.j0 + r) * v_stride);
          }
        }
      }
    }
    for (int n = 0; n < in_step; ++n) products[n]->finish();
  }
};

template <typename T>
struct FlashBwdDq {
  const BwdParams& p;
  int64_t dp;
  int64_t num_tasks() const { return p.shape.batch * p.shape.seq_q; }

  void operator()(int64_t row) const {  // one (batch, query position): every head
    const AttentionShape& sh = p.shape;
    const int64_t b = row / sh.seq_q, i = row % sh.seq_q;
    const int64_t split_stride = sh.batch * sh.heads_q * sh.seq_q * dp;
    T* dq = static_cast<T*>(p.dq) + row * sh.heads_q * sh.head_dim;
    for (int64_t h = 0; h < sh.heads_q; ++h) {
      const float* acc = p.dq_accum + dq_accum_offset(sh, dp, 0, b, h) + i * dp;
      for (int64_t c = 0; c < sh.head_dim; ++c) {
        float sum = 0.f;
        for (int64_t s = 0; s < p.dq_splits; ++s) sum += acc[s * split_stride + c];
        dq[h * sh.head_dim + c] = from_float<T>(sum);
      }
    }
  }
};

template <typename T, typename Products = FloatBwdProducts<T>>
void flash_bwd_typed(const BwdParams& params, const TaskRunner& runner) {
  const int64_t dp = padded_head_dim(params.shape.head_dim);
  FlashBwdDelta<T> delta{params, dp};
  parallel_for(runner, delta.num_tasks(), delta);
  if (params.dbias) zero_dbias(params, runner);
  typename Products::Shared shared(params, runner);
  // (Never more products than a split has key blocks to hold.)
  const int64_t split_key_blocks = ceil_div(ceil_div(params.shape.seq_k, kBlockK), params.dq_splits);
  const int in_step = static_cast<int>(
      min64(bwd_key_blocks_in_step(Products::key_tile_bytes(params.shape)), max64(1, split_key_blocks)));
  FlashBwdMain<T, Products> main{params, shared, in_step};
  parallel_for(runner, main.num_tasks(), main);
  shared.release();
  FlashBwdDq<T> dq{params, dp};
  parallel_for(runner, dq.num_tasks(), dq);
  if (params.dbias) finish_dbias(params, runner);
}

}  // namespace jax_flash::cpu::JF_ISA
