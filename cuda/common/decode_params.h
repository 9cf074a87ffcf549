// Parameters of the split-KV decode forward (flash-decoding), contiguous or paged K/V.
//
// A few query rows against many keys: the rows of the heads_q / heads_k query heads that share a
// kv head are packed into one query tile (pack-GQA, so K/V are read once per group), and each
// tile's key range is cut into num_splits chunks run in parallel. Each chunk writes its rows'
// partial output (normalised by the chunk's own sum) and partial lse into the workspaces; a
// combine pass merges them into o and lse. With num_splits == 1 the chunk writes o and lse
// directly and the workspaces are unused (they have no elements).
//
// Layouts (row-major, innermost last), besides FwdParams':
//   o_partial   : (num_splits, batch, heads_q, seq_q, head_dim_v) float32
//   lse_partial : (num_splits, batch, heads_q, seq_q) float32; -inf where the chunk holds no key
//                 the row sees
// q_lens may be null: every query row is live (the paged entry point has no query lengths).
// Paged K/V (paged == true): k and v point to pages (num_pages, page_size, heads_k, head_dim)
// and (num_pages, page_size, heads_k, head_dim_v);
// key j of batch element b is row j % page_size of page page_table[b, j / page_size];
// page_table is (batch, pages_per_seq) int32 and shape.seq_k = pages_per_seq * page_size.
#pragma once

#include <cstdint>

#include "common/attention_params.h"

namespace jax_flash {

struct DecodeParams : FwdParams {
  int64_t num_splits = 1;
  float* o_partial = nullptr;
  float* lse_partial = nullptr;

  bool paged = false;
  const int32_t* page_table = nullptr;
  int64_t num_pages = 0;
  int64_t page_size = 0;
  int64_t pages_per_seq = 0;

  // Where the query rows sit among the keys. false: row t at position t (top-left, as
  // jax.nn's and the tiled forward's masks). true: row t at position kv_len - seq_q + t, the
  // rows the newest tokens of their sequence (bottom-right, as FlashAttention's
  // flash_attn_with_kvcache and vLLM align a decode step's causal mask and window).
  bool queries_at_end = false;
};

// Elements of the two workspaces for num_splits chunks (none with one chunk).
inline int64_t decode_o_partial_elements(const AttentionShape& shape, int64_t num_splits) {
  return num_splits > 1 ? num_splits * shape.batch * shape.heads_q * shape.seq_q * shape.head_dim_v : 0;
}
inline int64_t decode_lse_partial_elements(const AttentionShape& shape, int64_t num_splits) {
  return num_splits > 1 ? num_splits * shape.batch * shape.heads_q * shape.seq_q : 0;
}

// More chunks than this is a caller bug (the Python side asks for at most 64).
inline constexpr int64_t kMaxDecodeSplits = 256;

}  // namespace jax_flash
