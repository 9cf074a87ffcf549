// Which rows and keys a CTA owns, and which of the other side's blocks they meet: the query-block
// task of the forward kernels (and the deterministic dQ kernel), the key-block task of the
// backward kernels, and the query blocks a warpgroup's keys take part in. The mask arithmetic
// itself is common/mask.h's.
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "common/mask.h"
#include "gpu/block_sparse.cuh"
#include "gpu/tile_io.cuh"

namespace jax_flash::cuda {

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ int64_t clamp_len(const int32_t* lens, int64_t b, int64_t full) {
  const int64_t n = lens[b];
  return n < 0 ? 0 : (n > full ? full : n);
}

// Key blocks [first, last] (none: last < first).
struct KeyBlockSpan {
  int first = 0, last = -1;
  __device__ bool holds(int n_block) const { return n_block >= first && n_block <= last; }
};
// The key blocks that a run of rows sees, from the key ranges of its first and last rows (each
// row's keys are one range whose ends grow with the row).
template <int kBlockN>
__device__ __forceinline__ KeyBlockSpan key_block_span(KeyRange first, KeyRange last) {
  if (last.end <= first.begin) return {};
  return {static_cast<int>(first.begin / kBlockN), static_cast<int>((last.end - 1) / kBlockN)};
}

// The query rows [m0, m0 + rows) of a CTA (live: from 0 and before q_len) and the key blocks
// [n_first, n_last] that any of them sees. Block m_block starts at row m_block * kBlockM -
// row_shift: with a shift (the plain Hopper forward's tiles that end at the sequence's end,
// sm90/flash_fwd_ws.cu query_row_shift) the first block's rows before 0 are padding.
template <int kBlockM, int kBlockN>
struct QueryBlock {
  int64_t m0;
  int rows, live_rows;  // rows [0, live_rows) lie before q_len; those before row -m0 are padding too
  KeyRange first{0, 0}, last{0, 0};  // key ranges of the first and last live rows
  int n_first = 0, n_last = -1;
  bool has_padding_rows;

  __device__ QueryBlock(const MaskParams& mask, int m_block, int64_t seq_q, int64_t q_len,
                        int64_t kv_len, int row_shift = 0)
      : m0(static_cast<int64_t>(m_block) * kBlockM - row_shift),
        rows(static_cast<int>(min64(kBlockM, seq_q - m0))),
        live_rows(q_len > max64(m0, 0) ? static_cast<int>(min64(rows, q_len - m0)) : 0),
        has_padding_rows(m0 < 0 || m0 + kBlockM > q_len) {
    if (live_rows > 0) {
      first = key_range(mask, max64(m0, 0), q_len, kv_len);
      last = key_range(mask, m0 + live_rows - 1, q_len, kv_len);
      const KeyBlockSpan keys = key_block_span<kBlockN>(first, last);
      n_first = keys.first;
      n_last = keys.last;
    }
  }

  // Whether some row sees only part of key block n0 (or is padding): then masks apply.
  __device__ bool needs_mask(int64_t n0) const { return has_padding_rows || live_rows_need_mask(n0); }
  // Whether some live row sees only part of key block n0: the plain forwards' masks apply only
  // there. A row past q_len needs none in a forward (its softmax is its own and the epilogue
  // writes it empty, from the mask alone), and masking every block of a tile that holds such rows
  // cost its loop half again (the 192-row tiles' last at seq 8192, session 43); a backward still
  // masks them (needs_mask), since their P would reach dK and dV.
  __device__ bool live_rows_need_mask(int64_t n0) const { return n0 < last.begin || n0 + kBlockN > first.end; }
};

// The key blocks [first, last] that the rows [r0, r0 + rows) before q_len see (none: last <
// first): those of one warpgroup's rows of a taller tile (the Hopper forward's unseen blocks,
// sm90/flash_fwd_ws_kernel.cuh).
template <int kBlockN>
__device__ __forceinline__ KeyBlockSpan key_blocks_seen(const MaskParams& mask, int64_t r0, int rows, int64_t q_len,
                                                        int64_t kv_len) {
  const int64_t begin = max64(r0, 0), end = min64(r0 + rows, q_len);
  if (end <= begin) return {};
  return key_block_span<kBlockN>(key_range(mask, begin, q_len, kv_len), key_range(mask, end - 1, q_len, kv_len));
}

// A query-block CTA's problem (the forward kernels and the deterministic dQ kernel): batch b, query
// head h and its kv head hk, valid lengths, row strides, its query rows with the key blocks they
// see (longest causal blocks first: block gridDim.x - 1 - blockIdx.x), and element offsets of its
// first query row in q / o / dq / dO, of its kv head in k / v, and of its (b, h) row 0 in lse /
// delta.
template <int kBlockM, int kBlockN>
struct QueryBlockTask {
  int b, h, hk;
  int64_t q_len, kv_len, q_stride, kv_stride;
  int chunks;  // 16-byte chunks of a row's head dim
  QueryBlock<kBlockM, kBlockN> blk;
  int64_t q_offset, kv_offset, stat_offset;
  // The key blocks visited, walked from the last (keys.descending(i)): [blk.n_first, blk.n_last],
  // or with a block mask its live ones there (walk_keys, after any narrowing of blk).
  TileWalk<kBlockN> keys;

  // The CTA's task on query_block_grid.
  template <typename Params>
  __device__ explicit QueryBlockTask(const Params& p)
      : QueryBlockTask(p, static_cast<int>(gridDim.x - 1 - blockIdx.x), static_cast<int>(blockIdx.y),
                       static_cast<int>(blockIdx.z)) {}

  // Query block m_block of head h of batch element b (row_shift: QueryBlock's).
  template <typename Params>
  __device__ QueryBlockTask(const Params& p, int m_block, int head, int batch, int row_shift = 0)
      : b(batch),
        h(head),
        hk(static_cast<int>(head / (p.shape.heads_q / p.shape.heads_k))),
        q_len(clamp_len(p.q_lens, batch, p.shape.seq_q)),
        kv_len(clamp_len(p.kv_lens, batch, p.shape.seq_k)),
        q_stride(p.shape.heads_q * p.shape.head_dim),
        kv_stride(p.shape.heads_k * p.shape.head_dim),
        chunks(static_cast<int>(p.shape.head_dim / 8)),
        blk(p.mask, m_block, p.shape.seq_q, q_len, kv_len, row_shift),
        q_offset((b * p.shape.seq_q + blk.m0) * q_stride + h * p.shape.head_dim),
        kv_offset(b * p.shape.seq_k * kv_stride + hk * p.shape.head_dim),
        stat_offset((static_cast<int64_t>(b) * p.shape.heads_q + h) * p.shape.seq_q),
        keys(blk.n_first, blk.n_last) {}

  // The walk over blk's key blocks again (after segment ids narrowed them), with a block mask
  // its live ones only (gpu/block_sparse.cuh). The general kernels only.
  __device__ void walk_keys(const AttentionParams& p) {
    keys = key_tile_walk<kBlockN>(p, b, h, blk.m0, blk.n_first, blk.n_last);
  }

  // Rows [0, rows) of key block n_block's K or V (from `base`, k or v) into a shared tile.
  template <typename Tile, int kThreads, typename T>
  __device__ __forceinline__ void load_keys(T* tile, const T* base, int n_block, int tid) const {
    const int64_t n0 = static_cast<int64_t>(n_block) * kBlockN;
    load_tile<Tile, kThreads>(tile, base + kv_offset + n0 * kv_stride, kv_stride,
                              static_cast<int>(min64(kBlockN, kv_len - n0)), chunks, tid);
  }
  // This block's query rows of q or dO into a shared tile (rows past q_len zero).
  template <typename Tile, int kThreads, typename T>
  __device__ __forceinline__ void load_queries(T* tile, const T* base, int tid) const {
    load_tile<Tile, kThreads>(tile, base + q_offset, q_stride, blk.live_rows, chunks, tid);
  }
};

// Where a task's rows of V lie, and those of the query-side array with the value head dim (O in
// the forward, from the task's first query row; dO in the backward, from the batch element's
// first row): with kOwnHeadDim (their head dim Hv differs from H: the kernels of
// sm90/traits.cuh kValueHeadDim) from Hv, else the task's K and Q layout as it is.
struct ValueRows {
  int64_t v_stride, v_offset, row_stride, row_offset, head_dim;
  int chunks;  // 16-byte chunks of a V row
};
// A query-block task's (QueryBlockTask: O from the block's first row; V from key 0).
template <bool kOwnHeadDim, typename Task>
__device__ __forceinline__ ValueRows value_rows(const AttentionParams& p, const Task& task) {
  if constexpr (!kOwnHeadDim) {
    return {task.kv_stride, task.kv_offset, task.q_stride, task.q_offset, p.shape.head_dim, task.chunks};
  } else {
    const int64_t hv = p.shape.head_dim_v, v_stride = p.shape.heads_k * hv, o_stride = p.shape.heads_q * hv;
    return {v_stride, task.b * p.shape.seq_k * v_stride + task.hk * hv,
            o_stride, (task.b * p.shape.seq_q + task.blk.m0) * o_stride + task.h * hv, hv, static_cast<int>(hv / 8)};
  }
}

// The (key block, kv-head slot, batch element) of the backward CTA at launch position `cta`
// (blockIdx in launch order: x fastest) of a key_block_grid (x key blocks, y kv-head slots, z
// batch). With key_major_groups = 0 that is the grid's own order: each group's (slot, batch) key
// blocks one after another. With C > 0 (gpu/launch.h key_major_groups: causal calls)
// the groups are taken C at a time, and within such a chunk every group's first key block comes
// first, then every group's second, ...: under a causal mask key block j sees the queries from
// j on, so the longest start first, and the SMs, which start CTAs in launch order, end together
// instead of a last group's long blocks starting behind the others' short ones (MQA's two waves
// of CTAs: ~1.6x the least time the work allows, by a list-scheduling model). A chunk holds about
// two waves of CTAs on a few heads, whose Q and dO they share in L2.
// With batch_innermost (BwdParams::batch_innermost: a dbias the batch shares) the batch's CTAs
// of each (key block, slot) come next to each other and the order above runs over the slots
// alone: their dbias atomics then meet on the same tiles in L2 rather than in DRAM waves apart.
struct KeyBlockCoords {
  int kb, slot, b;
};
__device__ __forceinline__ KeyBlockCoords key_block_of_cta(int64_t cta, int key_major_groups, bool batch_innermost) {
  const int64_t blocks = gridDim.x, slots = gridDim.y, inner = batch_innermost ? gridDim.z : 1;
  const int64_t b_inner = cta % inner;
  cta /= inner;
  auto coords = [&](int64_t kb, int64_t group) {
    return KeyBlockCoords{static_cast<int>(kb), static_cast<int>(group % slots),
                          static_cast<int>(group / slots * inner + b_inner)};
  };
  if (key_major_groups <= 0) return coords(cta % blocks, cta / blocks);
  const int64_t chunk_ctas = key_major_groups * blocks;
  const int64_t first_group = cta / chunk_ctas * key_major_groups;
  const int64_t groups = min64(key_major_groups, slots * (gridDim.z / inner) - first_group);  // (the last chunk's fewer)
  const int64_t r = cta - first_group * blocks;
  return coords(r / groups, first_group + r % groups);
}
// This CTA's launch position.
__device__ __forceinline__ int64_t cta_launch_position() {
  return blockIdx.x + static_cast<int64_t>(gridDim.x) * (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
}

// A key-block CTA's problem (both families' main backward kernels): batch b, kv head hk and the
// heads_per_kv query heads that share it, valid lengths, row strides, its keys [n0, n0 + keys)
// (live: before kv_len), and the visits of its loop: every query block (of kBlockM rows) of every
// query head of the group whose rows see some live key, head by head. Element offsets: kv_offset
// of key row n0 of head hk in k / v / dk / dv, q_batch_offset of batch b's row 0 in q / dO.
// kSplitsHeads: the task may take a part of its group's query heads (p.kv_head_splits, the Hopper
// backward's; a kernel that never splits takes its slot as the kv head: the division's registers
// spilled the 80-row visits of sm90ws_m80 and the mma.sync backward at head dim 256).
template <int kBlockM, int kBlockN, bool kSplitsHeads = false>
struct KeyBlockTask {
  struct Visit {
    int h, mb;  // query head, query block
    int e;      // block-sparse: the entry of `visits` it belongs to (0 otherwise)
  };
  // hk: the kv head; heads_per_kv: the query heads of its group, of which the task visits
  // heads_per_task() from head0 (all of them but with p.kv_head_splits > 1: one split's).
  int b, hk, heads_per_kv, head0;
  int64_t q_len, kv_len, q_stride, kv_stride;
  int chunks;  // 16-byte chunks of a row's head dim
  int64_t n0;
  int keys, live_keys;
  int mb_first = 0, mb_count = 0;
  int iterations = 0;
  int64_t kv_offset, q_batch_offset;
  // Block-sparse (walk_visits): this key block's live (head in group, query block) entries, as
  // gpu/block_sparse.cuh describes them, or null; the query blocks of the mask.
  const int32_t* visits = nullptr;
  int visit_count = 0, mask_q_blocks = 0;
  static constexpr int kQueryTilesPerBlock = static_cast<int>(kBlockMaskRows / kBlockM);
  // Whether every tile lies in one block of the block mask (the walks need it; the 80-row
  // visits of sm90ws_m80 do not walk).
  static constexpr bool kTilesInMaskBlocks = kBlockMaskRows % kBlockM == 0 && kBlockMaskKeys % kBlockN == 0;

  __device__ explicit KeyBlockTask(const BwdParams& p)
      : KeyBlockTask(p, key_block_of_cta(cta_launch_position(), p.key_major_groups, p.batch_innermost)) {}
  __device__ KeyBlockTask(const BwdParams& p, const KeyBlockCoords& at)
      : b(at.b),
        hk(kSplitsHeads ? at.slot / p.kv_head_splits : at.slot),
        heads_per_kv(static_cast<int>(p.shape.heads_q / p.shape.heads_k)),
        head0(hk * heads_per_kv + (kSplitsHeads ? at.slot % p.kv_head_splits * (heads_per_kv / p.kv_head_splits) : 0)),
        q_len(clamp_len(p.q_lens, b, p.shape.seq_q)),
        kv_len(clamp_len(p.kv_lens, b, p.shape.seq_k)),
        q_stride(p.shape.heads_q * p.shape.head_dim),
        kv_stride(p.shape.heads_k * p.shape.head_dim),
        chunks(static_cast<int>(p.shape.head_dim / 8)),
        n0(static_cast<int64_t>(at.kb) * kBlockN),
        keys(static_cast<int>(min64(kBlockN, p.shape.seq_k - n0))),
        live_keys(static_cast<int>(max64(0, min64(keys, kv_len - n0)))),
        kv_offset((b * p.shape.seq_k + n0) * kv_stride + hk * p.shape.head_dim),
        q_batch_offset(b * p.shape.seq_q * q_stride) {
    const QueryRange seeing = queries_seeing_keys(p.mask, n0, n0 + live_keys, q_len, kv_len);
    mb_first = static_cast<int>(seeing.begin / kBlockM);
    mb_count = seeing.end > seeing.begin ? static_cast<int>((seeing.end - 1) / kBlockM) - mb_first + 1 : 0;
    iterations = mb_count * (kSplitsHeads ? heads_per_kv / p.kv_head_splits : heads_per_kv);
  }

  // With kSparse and a block mask, the visits become the mask's live (head, query block) pairs
  // of this key block within [mb_first, mb_first + mb_count) (call after any narrowing; every
  // head of the group: block-sparse calls do not split them, gpu/launch.h kv_head_splits).
  template <bool kSparse>
  __device__ void walk_visits(const BwdParams& p) {
    static_assert(!kSparse || kTilesInMaskBlocks, "every backward tile lies in one block of the block mask");
    if (!kSparse || p.q_block_visits == nullptr) return;
    mask_q_blocks = static_cast<int>(p.block_mask_q_blocks);
    const int64_t row = (static_cast<int64_t>(b) * p.shape.heads_k + hk) * p.block_mask_k_blocks + n0 / kBlockMaskKeys;
    const int entries = heads_per_kv * mask_q_blocks;
    visits = p.q_block_visits + row * entries;
    const int n = __ldg(p.q_block_visit_counts + row);
    visit_count = n < 0 ? 0 : (n > entries ? entries : n);
    iterations = 0;
    for (int e = 0; e < visit_count; ++e) {
      const int first = entry_first(e), last = entry_last(e);
      if (last >= first) iterations += last - first + 1;
    }
  }

  // Dense: iteration it visits query block mb_first + it % mb_count of query head head0 +
  // it / mb_count, kept as two counters (no division in the loop). Sparse: the query blocks of
  // each entry in turn.
  __device__ Visit first_visit() const {
    if (visits != nullptr) return entry_visit(0);
    return {head0, mb_first, 0};
  }
  __device__ Visit next_visit(Visit v) const {
    if (visits != nullptr) {
      if ((v.mb + 1) % kQueryTilesPerBlock != 0 && v.mb + 1 < mb_first + mb_count) return {v.h, v.mb + 1, v.e};
      return entry_visit(v.e + 1);
    }
    return v.mb + 1 < mb_first + mb_count ? Visit{v.h, v.mb + 1, 0} : Visit{v.h + 1, mb_first, 0};
  }
  // Live query rows of a visit's block (0 past q_len).
  __device__ int rows(Visit v) const {
    return static_cast<int>(max64(0, min64(kBlockM, q_len - static_cast<int64_t>(v.mb) * kBlockM)));
  }

 private:
  // Entry e's query head in the group and mask block (clamped into range: see block_sparse.cuh).
  __device__ int entry_head(int e) const {
    const int v = __ldg(visits + e) / mask_q_blocks;
    return v < 0 ? 0 : (v >= heads_per_kv ? heads_per_kv - 1 : v);
  }
  __device__ int entry_block(int e) const {
    const int v = __ldg(visits + e) % mask_q_blocks;
    return v < 0 ? 0 : v;
  }
  // The query tiles of entry e within [mb_first, mb_first + mb_count).
  __device__ int entry_first(int e) const {
    const int t = entry_block(e) * kQueryTilesPerBlock;
    return t > mb_first ? t : mb_first;
  }
  __device__ int entry_last(int e) const {
    const int t = entry_block(e) * kQueryTilesPerBlock + kQueryTilesPerBlock - 1, end = mb_first + mb_count - 1;
    return t < end ? t : end;
  }
  // The first visit of the first entry from e on that has one.
  __device__ Visit entry_visit(int e) const {
    for (; e < visit_count; ++e)
      if (entry_last(e) >= entry_first(e)) return {hk * heads_per_kv + entry_head(e), entry_first(e), e};
    return {hk * heads_per_kv, mb_first, e};
  }
};

// Warms L2 with the K and V tiles of the key-block CTA that should start on this SM about a
// wave after this one (one CTA an SM, CTAs started in launch order: key_block_of_cta): its
// prologue, which has nothing to overlap its loads with, then waits on L2 rather than DRAM.
// kThreads threads (this one `tid`) share the tile's 128-byte lines. kValueHeadDim: V's head
// dim where it differs (its rows then have their own strides).
template <int kBlockN, int kHeadDim, int kThreads, typename T, int kValueHeadDim = kHeadDim>
__device__ __forceinline__ void prefetch_next_wave_keys(const BwdParams& p, int tid) {
  const AttentionShape& sh = p.shape;
  // (Past the grid's last CTA there is none; key_block_of_cta's chunks would divide by zero there.)
  const int64_t later_cta = cta_launch_position() + sm_id_bound();
  if (later_cta >= static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z) return;
  const KeyBlockCoords later = key_block_of_cta(later_cta, p.key_major_groups, p.batch_innermost);
  const int64_t later_n0 = static_cast<int64_t>(later.kb) * kBlockN;
  const int64_t later_hk = later.slot / p.kv_head_splits, later_b = later.b;
  constexpr int kLinesPerRow = (kHeadDim + 63) / 64;  // a row is kHeadDim 16-bit elements
  const int64_t kv_stride = sh.heads_k * sh.head_dim;
  constexpr int kLines = kBlockN * kLinesPerRow;
#pragma unroll
  for (int pass = 0; pass < (kLines + kThreads - 1) / kThreads; ++pass) {
    const int index = tid + pass * kThreads;
    const int row = index / kLinesPerRow, line = index % kLinesPerRow;
    if (later_b < sh.batch && index < kLines && later_n0 + row < sh.seq_k && line * 64 < sh.head_dim) {
      const int64_t offset = (later_b * sh.seq_k + later_n0 + row) * kv_stride + later_hk * sh.head_dim + line * 64;
      prefetch_l2(static_cast<const T*>(p.k) + offset);
      if constexpr (kValueHeadDim == kHeadDim) {
        prefetch_l2(static_cast<const T*>(p.v) + offset);
      } else if (line * 64 < sh.head_dim_v) {
        const int64_t v_row = (later_b * sh.seq_k + later_n0 + row) * sh.heads_k + later_hk;
        prefetch_l2(static_cast<const T*>(p.v) + v_row * sh.head_dim_v + line * 64);
      }
    }
  }
}

// A key-block task's (KeyBlockTask: V and dV from the block's first key, as kv_offset; dO from
// the batch element's first row, as q_batch_offset).
template <bool kOwnHeadDim, typename Task>
__device__ __forceinline__ ValueRows key_block_value_rows(const AttentionParams& p, const Task& task) {
  if constexpr (!kOwnHeadDim) {
    return {task.kv_stride, task.kv_offset, task.q_stride, task.q_batch_offset, p.shape.head_dim, task.chunks};
  } else {
    const int64_t hv = p.shape.head_dim_v, v_stride = p.shape.heads_k * hv, do_stride = p.shape.heads_q * hv;
    return {v_stride, (task.b * p.shape.seq_k + task.n0) * v_stride + task.hk * hv, do_stride,
            task.b * p.shape.seq_q * do_stride, hv, static_cast<int>(hv / 8)};
  }
}

// The query blocks of kBlockM rows a warpgroup's keys [key0, key_end) take part in: `live` those
// whose rows see some of the keys (outside them the warpgroup's scores are all masked), `whole`
// those whose rows all see every key (inside them no mask is needed; empty unless 64 keys live).
struct KeyGroupBlocks {
  int live_begin = 0, live_end = 0, whole_begin = 0, whole_end = 0;

  template <int kBlockM>
  __device__ static KeyGroupBlocks of(const MaskParams& mask, int64_t key0, int64_t key_end, int64_t q_len,
                                      int64_t kv_len) {
    KeyGroupBlocks g;
    if (key_end <= key0) return g;
    const QueryRange any = queries_seeing_keys(mask, key0, key_end, q_len, kv_len);
    if (!any.empty()) {
      g.live_begin = static_cast<int>(any.begin / kBlockM);
      g.live_end = static_cast<int>((any.end + kBlockM - 1) / kBlockM);
    }
    const QueryRange first = query_range(mask, key0, q_len, kv_len);
    const QueryRange last = query_range(mask, key_end - 1, q_len, kv_len);
    if (key_end - key0 == 64 && last.begin < first.end) {
      g.whole_begin = static_cast<int>((last.begin + kBlockM - 1) / kBlockM);
      g.whole_end = static_cast<int>(first.end / kBlockM);
    }
    return g;
  }
  __device__ bool live(int mb) const { return mb >= live_begin && mb < live_end; }
  __device__ bool whole(int mb) const { return mb >= whole_begin && mb < whole_end; }
};

}  // namespace jax_flash::cuda
