// The CPU FlashAttention kernels: entry points for the FFI handlers.
//
// The kernels are compiled once per instruction set (AVX-512 with AMX or BF16, AVX-512, AVX2,
// baseline) into separate namespaces (kernels_isa.cc); flash_fwd / flash_bwd pick the best one
// the running CPU has. Those translation units use no standard-library templates, so no function compiled with wider
// instructions can be merged by the linker into code that runs on a CPU without them: scratch
// memory and threads come through the plain interfaces below.
#pragma once

#include <cstdint>

#include "common/attention_params.h"

namespace jax_flash::cpu {

// Tile sizes of the CPU kernels (query rows x key rows), and the alignment of the head dim in
// the tiles; the dQ accumulator workspace is padded to it.
inline constexpr int64_t kBlockQ = 64;
inline constexpr int64_t kBlockK = 64;
// The most key blocks that walk a head's query blocks together (FlashBwdMain::run): each query
// block's Q, dO and dQ rows, fetched from L3 for the first, serve the others from L2
// (bwd_key_blocks_in_step says how many).
inline constexpr int kMaxBwdKeyBlocksInStep = 8;
inline constexpr int64_t kHeadDimAlign = 16;

static inline int64_t padded_head_dim(int64_t head_dim) {
  return (head_dim + kHeadDimAlign - 1) / kHeadDimAlign * kHeadDimAlign;
}

// Elements of the backward's float32 dQ workspace: one partial per split, each (batch, heads_q,
// seq_q, padded head dim): flash_bwd.h's dq_accum_offset.
static inline int64_t dq_accum_elements(const AttentionShape& shape, int64_t dq_splits) {
  return dq_splits * shape.batch * shape.heads_q * shape.seq_q * padded_head_dim(shape.head_dim);
}

// Whether each dbias element takes one dS at most: the bias (leading dims' product bias_batch,
// then bias_heads x bias_rows x bias_keys) has size 1 along a dim only where the call's size is 1
// too. Then the backward stores dS into dbias itself, in the bias's dtype (BwdParams::dbias_direct):
// no float32 partials to zero, add into and convert.
static inline bool dbias_one_each(int64_t bias_batch, int64_t bias_heads, int64_t bias_rows, int64_t bias_keys,
                                  const AttentionShape& shape) {
  return (bias_batch == shape.batch || shape.batch == 1) && (bias_heads == shape.heads_q || shape.heads_q == 1) &&
         (bias_rows == shape.seq_q || shape.seq_q == 1) && (bias_keys == shape.seq_k || shape.seq_k == 1);
}

// The backward's float32 dbias workspace (BwdParams::dbias_accum): partials of the bias's
// elements, one per dQ split where the bias has no key dim (every split adds to each of its
// elements), else one; none where that one is dbias itself (a float32 bias) or where each element
// takes one dS (dbias_one_each).
static inline int64_t dbias_parts(bool keys_broadcast, int64_t dq_splits) { return keys_broadcast ? dq_splits : 1; }
static inline int64_t dbias_accum_elements(int64_t bias_elements, bool keys_broadcast, bool float32,
                                           int64_t dq_splits, bool one_each) {
  const int64_t parts = dbias_parts(keys_broadcast, dq_splits);
  return one_each || (parts == 1 && float32) ? 0 : parts * bias_elements;
}

// Runs body(arg, i) for every i in [0, n) on the caller's thread pool and returns when all ran.
struct TaskRunner {
  using Body = void (*)(void* arg, int64_t i);
  void (*run)(const void* self, int64_t n, Body body, void* arg);
  const void* self;
};

// A float32 scratch area of at least `count` elements that belongs to the calling thread and
// stays valid until its next call from the same thread.
float* thread_scratch(int64_t count);

void flash_fwd(const FwdParams& params, const TaskRunner& runner);
void flash_bwd(const BwdParams& params, const TaskRunner& runner);
// The backward's key blocks in step, each holding `key_tile_bytes` of tiles: as many as fill one
// core's L2 (the query side they share fits beside them), 1 to kMaxBwdKeyBlocksInStep; or as
// many as the environment variable JAX_FLASH_CPU_BWD_KEY_BLOCKS names (the same range), read at
// each call for tests and measurements (the results are the same bit for bit whatever the count).
int bwd_key_blocks_in_step(int64_t key_tile_bytes);

// "avx512_amx", "avx512_bf16", "avx512", "avx2" or "baseline": the kernel variant this CPU runs.
const char* kernel_isa();

// One core's float32 FMA peak in GFLOP/s with the running variant's vectors, measured on the
// calling thread (independent FMA chains for about `seconds`): what the benchmark divides by.
double fma_peak_gflops(double seconds = 0.05);

}  // namespace jax_flash::cpu
