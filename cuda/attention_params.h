// Parameters of one attention pass, shared by every backend (CPU now, CUDA kernels later).
//
// Layouts (row-major, innermost last):
//   q, o, dq, do : (batch, seq_q, heads_q, head_dim)
//   k, v, dk, dv : (batch, seq_k, heads_k, head_dim)
//   lse, delta   : (batch, heads_q, seq_q), float32
//   q_lens, kv_lens : (batch,), int32; valid query / key rows per batch element
// "batch" is every leading dimension folded together (vmap adds them).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JF_HOST_DEVICE __host__ __device__
#else
#define JF_HOST_DEVICE
#endif

namespace jax_flash {

enum class Dtype : int { kFloat32, kBFloat16, kFloat16 };

// The masks jax.nn.dot_product_attention supports are all "key ranges per query row":
// query row i of batch b attends keys j in [key_begin(i), key_end(i)).
struct MaskParams {
  bool causal = false;          // j <= i (top-left aligned, like jax.nn)
  int64_t window_left = -1;     // j >= i - window_left; < 0 means unbounded
  int64_t window_right = -1;    // j <= i + window_right; < 0 means unbounded
};

struct AttentionShape {
  int64_t batch = 0;
  int64_t seq_q = 0;
  int64_t seq_k = 0;
  int64_t heads_q = 0;
  int64_t heads_k = 0;
  int64_t head_dim = 0;
  int64_t group() const { return heads_q / heads_k; }
};

struct FwdParams {
  AttentionShape shape;
  MaskParams mask;
  Dtype dtype = Dtype::kFloat32;
  float scale = 1.f;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
};

struct BwdParams {
  AttentionShape shape;
  MaskParams mask;
  Dtype dtype = Dtype::kFloat32;
  float scale = 1.f;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* d_o = nullptr;
  const float* lse = nullptr;
  const int32_t* q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  // Workspaces, returned to XLA as extra outputs so no memory is hidden from it.
  float* delta = nullptr;        // (batch, heads_q, seq_q): rowsum(dO * O)
  float* dq_accum = nullptr;     // float32 dQ partials (layout per backend; unused when
                                 // deterministic on CUDA)
  int64_t dq_splits = 1;         // CPU: key blocks are dealt round-robin to this many partials
  bool deterministic = false;    // CUDA: dQ without atomics (the CPU is always deterministic)
};

// The log-sum-exp stored for a query row that attends to nothing: finite, and exp(x - lse) of
// any other finite value is 0, so merging partial results treats such a row as empty.
inline constexpr float kEmptyRowLse = -3.4028234663852886e38f;

// Half-open range of keys that query row i may attend to; empty when begin >= end.
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

}  // namespace jax_flash
