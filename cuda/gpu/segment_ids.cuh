// Segment ids (packed documents) in the CUDA kernels: query row i of batch element b attends key j
// only when q_segment_ids[b, i] == kv_segment_ids[b, j], on top of the masks of common/mask.h.
//
// The kernels read, besides the ids, their spans [lo, hi] over runs of kSegmentIdSpanRows rows
// (keys) aligned at 0 (formed in XLA beside the call: jax_flash._ops), and with them
//   - narrow a tile's walk to the blocks between the first and the last whose ids can meet the
//     tile's (narrow_query_block, narrow_key_block; a warp's 32 lanes test 32 runs at once), so a
//     row of sorted documents visits only the blocks along their diagonal blocks;
//   - apply the element mask only on blocks whose rows and keys do not all share one id
//     (needs_id_mask), and there together with the range mask (mask_with_ids and its transposed
//     form for the Hopper backward);
//   - track which rows met a visible key (SeenRows): a row whose document has no visible key is
//     empty (0 and kEmptyRowLse), decided by the masks, never by its values, as without ids.
// Ids need not be sorted for any of this to be exact; unsorted ids only narrow less.
#pragma once

#include <climits>
#include <cstdint>

#include "common/attention_params.h"
#include "common/mask.h"
#include "gpu/block_geometry.cuh"
#include "gpu/mask.cuh"

namespace jax_flash::cuda {

// The ids and spans of one batch element (all null without ids).
struct SegmentIds {
  const int32_t* q_ids = nullptr;
  const int32_t* kv_ids = nullptr;
  const int2* q_spans = nullptr;  // (lo, hi) of each run of kSegmentIdSpanRows rows
  const int2* kv_spans = nullptr;
  int64_t seq_q = 0, seq_k = 0;
  int q_runs = 0, kv_runs = 0;

  SegmentIds() = default;
  __device__ SegmentIds(const AttentionParams& p, int64_t b) {
    if (!p.q_segment_ids) return;
    seq_q = p.shape.seq_q;
    seq_k = p.shape.seq_k;
    q_runs = static_cast<int>((seq_q + kSegmentIdSpanRows - 1) / kSegmentIdSpanRows);
    kv_runs = static_cast<int>((seq_k + kSegmentIdSpanRows - 1) / kSegmentIdSpanRows);
    q_ids = p.q_segment_ids + b * seq_q;
    kv_ids = p.kv_segment_ids + b * seq_k;
    q_spans = reinterpret_cast<const int2*>(p.q_segment_id_spans) + b * q_runs;
    kv_spans = reinterpret_cast<const int2*>(p.kv_segment_id_spans) + b * kv_runs;
  }
  __device__ bool present() const { return q_ids != nullptr; }

  // Rows past the array (a partial last block: padding, masked anyway) read the last id.
  __device__ int32_t q_id(int64_t i) const { return __ldg(q_ids + (i < seq_q ? i : seq_q - 1)); }
  __device__ int32_t kv_id(int64_t j) const { return __ldg(kv_ids + (j < seq_k ? j : seq_k - 1)); }

  // The span of the ids of rows (keys) [begin, end), end > begin: the union of its runs'.
  __device__ IdSpan rows_span(int64_t begin, int64_t end) const { return span(q_spans, q_runs, begin, end); }
  __device__ IdSpan keys_span(int64_t begin, int64_t end) const { return span(kv_spans, kv_runs, begin, end); }

 private:
  __device__ static IdSpan span(const int2* spans, int runs, int64_t begin, int64_t end) {
    const int first = static_cast<int>(begin / kSegmentIdSpanRows);
    const int last = static_cast<int>(min64((end - 1) / kSegmentIdSpanRows, runs - 1));
    const int2 s = __ldg(spans + first);
    IdSpan out{s.x, s.y};
    for (int r = first + 1; r <= last; ++r) {
      const int2 t = __ldg(spans + r);
      out.lo = min(out.lo, t.x);
      out.hi = max(out.hi, t.y);
    }
    return out;
  }
};

// The first and last of runs [begin, end) whose span meets `span` ({INT_MAX, -1}: none), tested
// by the 32 lanes of a warp, 32 runs a step. Every lane of the warp must call it.
__device__ inline int2 runs_meeting(const int2* spans, int begin, int end, IdSpan span, int lane) {
  int first = INT_MAX, last = -1;
  for (int base = begin; base < end; base += 32) {
    bool meets = false;
    if (base + lane < end) {
      const int2 s = __ldg(spans + base + lane);
      meets = IdSpan{s.x, s.y}.meets(span);
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, meets);
    if (ballot) {
      if (first == INT_MAX) first = base + __ffs(ballot) - 1;
      last = base + 31 - __clz(ballot);
    }
  }
  return make_int2(first, last);
}

// Blocks [first, last] of kBlock rows (keys) narrowed to those between the first and the last
// whose runs (`spans`, `runs` of them) meet `span`: {first, first - 1} when none does.
// Warp-collective.
template <int kBlock>
__device__ inline int2 narrow_blocks(int first, int last, const int2* spans, int runs, IdSpan span, int lane) {
  const int begin = static_cast<int>(static_cast<int64_t>(first) * kBlock / kSegmentIdSpanRows);
  const int end = static_cast<int>(
      min64((static_cast<int64_t>(last + 1) * kBlock + kSegmentIdSpanRows - 1) / kSegmentIdSpanRows, runs));
  const int2 meeting = runs_meeting(spans, begin, end, span, lane);
  if (meeting.y < 0) return make_int2(first, first - 1);
  return make_int2(max(first, static_cast<int>(static_cast<int64_t>(meeting.x) * kSegmentIdSpanRows / kBlock)),
                   min(last, static_cast<int>((static_cast<int64_t>(meeting.y + 1) * kSegmentIdSpanRows - 1) / kBlock)));
}

// A query block's key blocks [n_first, n_last] narrowed to those between the first and the last
// whose keys' ids can meet its rows' (none: n_last < n_first). Warp-collective.
template <int kBlockM, int kBlockN>
__device__ inline void narrow_query_block(QueryBlock<kBlockM, kBlockN>& blk, const SegmentIds& ids, int lane) {
  if (!ids.present() || blk.n_last < blk.n_first) return;
  const int2 blocks = narrow_blocks<kBlockN>(blk.n_first, blk.n_last, ids.kv_spans, ids.kv_runs,
                                             ids.rows_span(blk.m0, blk.m0 + blk.live_rows), lane);
  blk.n_first = blocks.x;
  blk.n_last = blocks.y;
}

// A key block's visits narrowed to the query blocks between the first and the last whose rows'
// ids can meet its keys' (iterations 0: none). Warp-collective.
template <int kBlockM, int kBlockN, bool kSplitsHeads>
__device__ inline void narrow_key_block(KeyBlockTask<kBlockM, kBlockN, kSplitsHeads>& task, const SegmentIds& ids,
                                        int lane) {
  if (!ids.present() || task.mb_count == 0) return;
  const int2 blocks = narrow_blocks<kBlockM>(task.mb_first, task.mb_first + task.mb_count - 1, ids.q_spans, ids.q_runs,
                                             ids.keys_span(task.n0, task.n0 + task.live_keys), lane);
  task.mb_first = blocks.x;
  task.mb_count = blocks.y - blocks.x + 1;
  task.iterations = task.mb_count * task.heads_per_kv;  // (calls with ids split no heads)
}

// Whether the scores of rows [m0, m1) and keys [n0, n1) (both non-empty, inside the arrays) need
// the id mask: not when every row and key share one id.
__device__ inline bool needs_id_mask(const SegmentIds& ids, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  return !ids.rows_span(m0, m1).same_single_id(ids.keys_span(n0, n1));
}

// Whether a call's rows must be tracked as having met a visible key (SeenRows): with segment ids,
// or a block mask beside a local window, a row may see no key of the tiles visited although its
// range meets the key range; otherwise the range masks and the tile's count decide empty rows
// (untracked_seen_rows).
//
// A block mask alone (with causal masking and lengths) needs no tracking: a query tile lies in
// one block row and its rows' ranges are [0, end) or all keys, so every live row sees the first
// key of every tile visited (a tile of a causal diagonal block starts at or before the tile's
// first row, and a 64-key tile past it shares its 128-key block, hence its bit, with the one that
// does); a tile none of whose blocks is live visits nothing, and its rows are all empty.
__device__ __forceinline__ bool tracks_seen_rows(const AttentionParams& p) {
  return p.q_segment_ids != nullptr ||
         (p.kv_block_lists != nullptr && p.mask.windowed());
}

// The rows seen without tracking: all of them where the tile visits some key block, none where it
// visits none (whose rows then have no key either way: its range masks, or its hidden blocks).
__device__ __forceinline__ bool untracked_seen_rows(int visited_key_blocks) { return visited_key_blocks > 0; }

// Which of a warp's rows (kMTiles 16-row tiles; this thread's rows lane / 4 and + 8 of each) have
// met a key the masks let through, from this thread's columns; any() combines the quad's.
template <int kMTiles>
struct SeenRows {
  bool seen[kMTiles][2];

  // Untracked (tracks_seen_rows false), every row counts as seen: the range masks decide empty
  // rows alone.
  __device__ explicit SeenRows(bool all) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) seen[mt][0] = seen[mt][1] = all;
  }

  // A block every row of the tile sees whole (no range mask, no id mask): all rows see keys.
  __device__ __forceinline__ void note_all() {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) seen[mt][0] = seen[mt][1] = true;
  }
  // Rows whose key range meets keys [n0, n1) of a block without the id mask (its rows and keys
  // share one id): they see those keys.
  __device__ __forceinline__ void note_ranges(const MaskParams& mask, int64_t m0, int64_t n0, int64_t n1, int64_t q_len,
                              int64_t kv_len, int lane) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const KeyRange r = key_range(mask, m0 + mt * 16 + half * 8 + lane / 4, q_len, kv_len);
        if (r.begin < r.end && r.begin < n1 && r.end > n0) seen[mt][half] = true;
      }
  }
  // Whether some thread of the quad holding the row saw a key (every lane must call it).
  __device__ __forceinline__ bool any(int mt, int half) const {
    unsigned v = seen[mt][half] ? 1u : 0u;
    v |= __shfl_xor_sync(0xffffffffu, v, 1);
    v |= __shfl_xor_sync(0xffffffffu, v, 2);
    return v != 0;
  }
};

// The range and id masks together on a tile of scores (queries in rows from m0, keys in columns
// from n0; fragment element (mt, nt, e): row 16 mt + lane / 4 (+ 8 for e >= 2), column 8 nt +
// 2 (lane % 4) + e % 2): -inf where the key is outside the row's range or its id differs. With
// `seen`, the rows that keep some key are noted there. Key ids are read a column pair at a time
// and used for the two rows of a 16-row tile (so few registers hold them).
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void mask_with_ids(float (&s)[kMTiles][kNTiles][4], const SegmentIds& ids,
                                              const MaskParams& mask, int64_t m0, int64_t n0, int64_t q_len,
                                              int64_t kv_len, int lane, SeenRows<kMTiles>* seen) {
  const int64_t j0 = n0 + (lane % 4) * 2;  // this thread's first column
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    int begin[2], end[2];  // the two rows' key ranges, from j0, clamped to the tile
    int32_t id[2];
    bool any[2] = {false, false};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t i = m0 + mt * 16 + half * 8 + lane / 4;
      const KeyRange r = key_range(mask, i, q_len, kv_len);
      const TileSpan span = span_in_tile(r, j0, kNTiles * 8);
      begin[half] = span.begin;
      end[half] = span.end;
      id[half] = ids.q_id(i);
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int32_t key_id[2] = {ids.kv_id(j0 + nt * 8), ids.kv_id(j0 + nt * 8 + 1)};
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + e;
          const bool visible = c >= begin[half] && c < end[half] && key_id[e] == id[half];
          if (!visible) s[mt][nt][2 * half + e] = -INFINITY;
          any[half] |= visible;
        }
    }
    if (seen) {
      seen->seen[mt][0] |= any[0];
      seen->seen[mt][1] |= any[1];
    }
  }
}

// The same on the Hopper backward's transposed tiles (keys in rows from key0: this thread's
// lane / 4 and + 8; queries in columns from query0: 8 nt + 2 (lane % 4) + e % 2).
template <int kNTiles>
__device__ __forceinline__ void mask_transposed_with_ids(float (&s)[1][kNTiles][4], const SegmentIds& ids,
                                                         const MaskParams& mask, int64_t key0, int64_t query0,
                                                         int64_t q_len, int64_t kv_len, int lane) {
  const int64_t i0 = query0 + (lane % 4) * 2;  // this thread's first column
  int begin[2], end[2];                        // each key row's query range, from i0
  int32_t id[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t j = key0 + lane / 4 + half * 8;
    const QueryRange r = query_range(mask, j, q_len, kv_len);
    const TileSpan span = span_in_tile(r, i0, kNTiles * 8);
    begin[half] = span.begin;
    end[half] = span.end;
    id[half] = ids.kv_id(j);
  }
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    const int32_t query_id[2] = {ids.q_id(i0 + nt * 8), ids.q_id(i0 + nt * 8 + 1)};
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = nt * 8 + c;
        if (!(col >= begin[half] && col < end[half] && query_id[c] == id[half])) s[0][nt][2 * half + c] = -INFINITY;
      }
  }
}

// The masks of a forward's key block [n0, n0 + kBlockN) on a warp's rows from m0 (those of the
// query block's rows [row0, row1)), for batch element b: with ids, the id mask where the
// block's rows and keys do not all share one id (with the range mask, noting the rows that keep
// a key), else the range mask where `range_mask` (QueryBlock::needs_mask), noting with ids or a
// block mask (whose hidden blocks are never visited) the rows whose range meets the block
// (`seen` null: not tracked). The ids' pointers and the rows'
// span are formed here from p (kernel parameters), not kept in registers across the key loop.
template <int kBlockN, int kMTiles, int kNTiles>
__device__ __forceinline__ void mask_forward_block(float (&s)[kMTiles][kNTiles][4], const AttentionParams& p,
                                                   int64_t b, int64_t row0, int64_t row1, bool range_mask, int64_t m0,
                                                   int64_t n0, int64_t q_len, int64_t kv_len, int lane,
                                                   SeenRows<kMTiles>* seen) {
  if (p.q_segment_ids) {
    const SegmentIds ids(p, b);
    if (needs_id_mask(ids, row0, row1, n0, min64(n0 + kBlockN, ids.seq_k))) {
      mask_with_ids(s, ids, p.mask, m0, n0, q_len, kv_len, lane, seen);
      return;
    }
  }
  // Without the range mask every row sees the whole block (QueryBlock::needs_mask): the rows'
  // ranges need not be formed (a block-sparse call's interior tiles).
  if (seen && tracks_seen_rows(p)) {
    if (range_mask) seen->note_ranges(p.mask, m0, n0, n0 + kBlockN, q_len, kv_len, lane);
    else seen->note_all();
  }
  if (range_mask) mask_scores(s, p.mask, m0, n0, q_len, kv_len, lane);
}

}  // namespace jax_flash::cuda
