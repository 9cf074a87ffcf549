// The mask arithmetic every kernel (CPU and CUDA) walks its tiles by: which keys a query row
// sees, which query rows see a key, and which rows see any key of a block. Host and device code.
#pragma once

#include <cstdint>

#include "common/attention_params.h"

namespace jax_flash {

// Half-open range of keys that query row i may attend to; empty when begin >= end.
// Windows here are -1 or at most seq_q + seq_k (the FFI handlers clamp wider ones, which mask
// nothing more), so i + window + 1 and the like stay far from int64 overflow.
struct KeyRange {
  int64_t begin;
  int64_t end;
  JF_HOST_DEVICE bool empty() const { return begin >= end; }
};

// static: internal linkage, so the copies compiled with different ISA flags never merge.
JF_HOST_DEVICE static inline KeyRange key_range(const MaskParams& m, int64_t i, int64_t q_len, int64_t kv_len) {
  if (i >= q_len) return {0, 0};
  int64_t begin = 0;
  int64_t end = kv_len;
  if (m.causal && i + 1 < end) end = i + 1;
  if (m.window_right >= 0 && i + m.window_right + 1 < end) end = i + m.window_right + 1;
  if (m.window_left >= 0 && i - m.window_left > begin) begin = i - m.window_left;
  return {begin, end};
}

// The most keys a query row can see by the call's shape and window alone (the lengths are device
// data that a launch does not read): seq_k, at most seq_q under a causal mask (row i sees keys
// <= i), and at most the window's width where both of its sides are bounded (a causal mask
// bounds the right side at 0).
JF_HOST_DEVICE static inline int64_t static_keys_per_row(const MaskParams& m, int64_t seq_q, int64_t seq_k) {
  int64_t bound = seq_k;
  if (m.causal && seq_q < bound) bound = seq_q > 0 ? seq_q : 1;
  const int64_t right = m.causal ? 0 : m.window_right;
  if (m.window_left >= 0 && right >= 0 && m.window_left < seq_k && right < seq_k && m.window_left + right + 1 < bound)
    bound = m.window_left + right + 1;
  return bound;
}

// Narrow calls: rows that see few keys (or few that matter: a peaked softmax) sum few products,
// and there 16-bit P (the forward's P V) and 16-bit dS (the backward's dQ and dK) put dq/dk past
// FlashAttention's accuracy rule (issue 13). Narrow: the rows see at most kNarrowRowKeys keys by
// the call's shape, causal mask and window, or its heads at most kNarrowScores scores by that
// bound (seq_q times it). The CUDA kernels then take P and dS as hi + lo 16-bit pairs
// (gpu/kernel_choice.h); the CPU kernel never takes its 16-bit (AMX) products (cpu/dispatch.cc).
inline constexpr int64_t kNarrowRowKeys = 16;
inline constexpr int64_t kNarrowScores = 64 * 64;
JF_HOST_DEVICE static inline bool narrow_shape(const MaskParams& mask, int64_t seq_q, int64_t seq_k) {
  const int64_t keys = static_keys_per_row(mask, seq_q, seq_k);
  return keys <= kNarrowRowKeys || seq_q * keys <= kNarrowScores;
}

// Half-open range of query rows that attend to key j: the rows i with key_range(i) holding j.
// Both bounds grow with j, and an empty range is only ever followed by empty ones.
struct QueryRange {
  int64_t begin;
  int64_t end;
  JF_HOST_DEVICE bool empty() const { return begin >= end; }
};

JF_HOST_DEVICE static inline QueryRange query_range(const MaskParams& m, int64_t j, int64_t q_len, int64_t kv_len) {
  if (j < 0 || j >= kv_len) return {0, 0};
  int64_t begin = 0;
  int64_t end = q_len;
  if (m.causal && j > begin) begin = j;                                             // i >= j
  if (m.window_right >= 0 && j - m.window_right > begin) begin = j - m.window_right;  // j <= i + right
  if (m.window_left >= 0 && j + m.window_left + 1 < end) end = j + m.window_left + 1;  // j >= i - left
  return {begin, end};
}

// Half-open range of query rows that attend to some key in [j0, j1): the union of their
// query_range (one interval, since the bounds grow with j and the empty ranges come last).
JF_HOST_DEVICE static inline QueryRange queries_seeing_keys(const MaskParams& m, int64_t j0, int64_t j1, int64_t q_len,
                                                           int64_t kv_len) {
  // The last key of [j0, j1) that some query sees (a key is unseen only past the last query
  // under a causal or right-window mask, or past kv_len).
  int64_t last = j1 < kv_len ? j1 - 1 : kv_len - 1;
  if (m.causal && q_len - 1 < last) last = q_len - 1;
  if (m.window_right >= 0 && q_len - 1 + m.window_right < last) last = q_len - 1 + m.window_right;
  if (j0 < 0) j0 = 0;
  if (last < j0) return {0, 0};
  return {query_range(m, j0, q_len, kv_len).begin, query_range(m, last, q_len, kv_len).end};
}

// The span of segment ids [lo, hi] of a run of rows or keys. Two blocks whose spans are disjoint
// share no id, so no query of one attends any key of the other: the kernels skip that tile. Ids
// need not be sorted for this to be correct; sorted ids (packed documents) make the spans narrow,
// so that only the tiles along the documents' diagonal blocks are visited.
struct IdSpan {
  int32_t lo;
  int32_t hi;
  JF_HOST_DEVICE bool meets(const IdSpan& o) const { return lo <= o.hi && o.lo <= hi; }
  // Every row of one span and every key of the other share the one id: no element mask needed.
  JF_HOST_DEVICE bool same_single_id(const IdSpan& o) const { return lo == hi && o.lo == o.hi && lo == o.lo; }
};

// The span of ids[0..n), n >= 1.
JF_HOST_DEVICE static inline IdSpan id_span(const int32_t* ids, int64_t n) {
  IdSpan s{ids[0], ids[0]};
  for (int64_t x = 1; x < n; ++x) {
    if (ids[x] < s.lo) s.lo = ids[x];
    if (ids[x] > s.hi) s.hi = ids[x];
  }
  return s;
}

}  // namespace jax_flash
