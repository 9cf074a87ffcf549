// The forward's two products on float32 tiles (tile_gemm.h), for every input dtype: S^T = K Q^T
// and O^T += V^T P^T, with 16-bit inputs converted to float32 once per call. FlashFwd
// (flash_fwd.h) runs the online softmax between them; a products class owns the query tile and
// the output accumulator, so that another one (bf16_fwd_products.h) can hold them in its own
// layout.
//
//   S^T = K Q^T:    A = K's rows, packed once per (batch, kv head) for every task of the call
//                   (Shared), B = Q^T (made once per task);
//   O^T += V^T P^T: A = V^T, packed likewise, B = the softmax's transposed probabilities as
//                   they lie (keys x query rows: P^T itself), C = O^T (dims x query rows).
// Read in place, K's and V's rows sat a whole row of the array (heads_k x d values) apart: at 4
// heads x 128 dims, 2 KiB, so a block's 64 rows fell into a few L1 sets, and O += P V reloaded
// them from L2 for every 6 query rows. One core, tiles as in a seq-4096 task (session 17's
// harness): S^T 177-179 -> 204 GFLOP/s, P V 117-124 -> 196-198 (O^T from packed V^T).
#pragma once

#include <new>

#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "cpu/tile_gemm.h"
#include "cpu/tile_io.h"

namespace jax_flash::cpu::JF_ISA {

template <typename T>
struct FloatFwdProducts {
  // Query columns of S^T are computed in multiples of this many rows.
  static constexpr int64_t kRowAlign = kLanes;
  // Keys a step: 128, with the headroom and raise slack of such blocks (flash_fwd.h). Against
  // 64 (session 17 harness, one thread, CPU time, load ~4): the same or 2-6% faster per row
  // (fewer calls and row-statistics passes, rarer rescales); the O^T product still sums its keys
  // in panels of kKPanel.
  static constexpr int64_t kKeyBlock = 128;
  // Two query blocks a task where the call has tasks enough (FlashFwd): each K and V^T block
  // then serves 128 rows from cache, not 64.
  static constexpr bool kPairsQueryBlocks = true;

  // K and V^T of every (batch, kv head) in float32, for every task of the call:
  //   k[head * k_head + j * dp + c]  = K[j][c]   (zero for c in [d, dp));
  //   vt[head * v_head + c * ld + j] = V[j][c]   (zero for c in [hv, hvp) and j in [seq_k, ld)).
  // ld is seq_k rounded up to kLanes plus kLanes: V^T's rows are then not a multiple of 4 KiB
  // apart at the usual lengths (those would map the 6 rows an A block broadcasts from to one
  // L1 set).
  struct Shared {
    int64_t dp = 0, hvp = 0, ld = 0, k_head = 0, v_head = 0;
    float* k = nullptr;
    float* vt = nullptr;

    Shared(const FwdParams& p, const TaskRunner& runner) {
      const AttentionShape& sh = p.shape;
      dp = padded_head_dim(sh.head_dim);
      hvp = padded_head_dim(sh.head_dim_v);
      ld = round_up(sh.seq_k, kLanes) + kLanes;
      k_head = sh.seq_k * dp;
      v_head = hvp * ld;
      const int64_t heads = sh.batch * sh.heads_k;
      k = static_cast<float*>(::operator new[](heads * k_head * sizeof(float), std::align_val_t{64}));
      vt = static_cast<float*>(::operator new[](heads * v_head * sizeof(float), std::align_val_t{64}));
      // Tasks of kPackKeys keys of one head: work for every core even with one kv head.
      const int64_t chunks = ceil_div(ld, kPackKeys);
      auto pack = [&](int64_t task) {
        const int64_t head = task / chunks, j0 = task % chunks * kPackKeys;
        const int64_t b = head / sh.heads_k, hk = head % sh.heads_k;
        const int64_t k_stride = sh.heads_k * sh.head_dim, v_stride = sh.heads_k * sh.head_dim_v;
        const int64_t keys = max64(0, min64(kPackKeys, sh.seq_k - j0));  // the chunk's keys in K
        const T* k_src = static_cast<const T*>(p.k) + b * sh.seq_k * k_stride + hk * sh.head_dim;
        const T* v_src = static_cast<const T*>(p.v) + b * sh.seq_k * v_stride + hk * sh.head_dim_v;
        if (keys > 0) load_rows(k_src + j0 * k_stride, k_stride, keys, sh.head_dim, k + head * k_head + j0 * dp, dp);
        const int64_t width = min64(kPackKeys, ld - j0);  // keys past seq_k: zero
        transpose_rows(v_src + j0 * v_stride, v_stride, keys, sh.head_dim_v, vt + head * v_head + j0, ld, width,
                       hvp);
      };
      parallel_for(runner, heads * chunks, pack);
    }
    // Called once the call's tasks are done. (No destructor: the per-ISA objects carry no
    // unwinding code, whose personality reference the linker could merge; check_isa_symbols.)
    void release() {
      ::operator delete[](k, std::align_val_t{64});
      ::operator delete[](vt, std::align_val_t{64});
    }
    static constexpr int64_t kPackKeys = 256;
  };

  int64_t dp;    // q's and k's head dim padded to kHeadDimAlign
  int64_t hvp;   // v's and o's head dim padded likewise
  int64_t d, hv;
  const Shared& shared;
  const float* k;   // this (batch, kv head)'s packed K
  const float* vt;  // and V^T
  float* qt_tile;   // Q^T, dp x kBlockQ
  float* acc_t;     // the output accumulator O^T, hvp x kBlockQ
  float* o_rows;    // kLanes rows of O (hvp apart) from O^T, for store_output_row
  int64_t o_rows_first = -1;  // the first of those rows; -1: none yet

  static int64_t scratch_floats(const AttentionShape& sh) {
    const int64_t dp = padded_head_dim(sh.head_dim), hvp = padded_head_dim(sh.head_dim_v);
    return dp * kBlockQ + hvp * kBlockQ + kLanes * hvp;
  }

  FloatFwdProducts(const FwdParams& p, const Shared& shared_state, int64_t b, int64_t hk, float* scratch)
      : dp(padded_head_dim(p.shape.head_dim)),
        hvp(padded_head_dim(p.shape.head_dim_v)),
        d(p.shape.head_dim),
        hv(p.shape.head_dim_v),
        shared(shared_state),
        k(shared_state.k + (b * p.shape.heads_k + hk) * shared_state.k_head),
        vt(shared_state.vt + (b * p.shape.heads_k + hk) * shared_state.v_head),
        qt_tile(scratch),
        acc_t(qt_tile + dp * kBlockQ),
        o_rows(acc_t + hvp * kBlockQ) {}

  void finish() {}

  // Takes the block's live query rows (q row r at q[r * q_stride]) and clears the accumulator.
  void load_queries(const T* q, int64_t q_stride, int64_t live_rows) {
    load_rows_transposed(q, q_stride, live_rows, d, qt_tile, kBlockQ, dp);
    for (int64_t x = 0; x < hvp * kBlockQ; ++x) acc_t[x] = 0.f;
  }

  // scores_t[c * kBlockQ + r] = scale * k_c . q_r for keys j0 + c, c < cols, and query columns
  // r < nq.
  void scores(const T* /*k*/, int64_t /*k_stride*/, int64_t j0, int64_t cols, int64_t nq, float scale,
              float* scores_t) {
    gemm(cols, nq, dp, scale, k + j0 * dp, dp, qt_tile, kBlockQ, scores_t, kBlockQ, false);
  }

  // O^T column r *= correction[r], kLanes columns at a time where a live row's factor is not 1
  // (rows past live_rows have factors too, finite, but nothing reads their columns).
  void rescale(const float* correction, int64_t live_rows, int64_t nq) {
    scale_transposed_columns(acc_t, kBlockQ, hv, correction, live_rows, nq);
  }

  // O^T += V^T P^T over keys [j0, j0 + cols): P^T is S^T after the softmax (key c of row r at
  // scores_t[c * kBlockQ + r]), V^T's keys past the block are not read.
  void accumulate(const float* scores_t, const T* /*v*/, int64_t /*v_stride*/, int64_t j0, int64_t cols,
                  int64_t /*live_rows*/, int64_t nq) {
    gemm(hvp, nq, cols, 1.f, vt + j0, shared.ld, scores_t, kBlockQ, acc_t, kBlockQ, true);
  }

  // out[c] = scale * O[r][c] for c < hv. O^T's columns are turned into rows kLanes at a time
  // (transpose_lanes), when the first row of a group is asked for: read down a column, a row's
  // hv values were hv loads kBlockQ apart (2% of the seq-2048 hd-64 causal forward's time).
  template <typename U>
  void store_output_row(int64_t r, float scale, U* out) {
    const int64_t first = r / kLanes * kLanes;
    if (first != o_rows_first) {
      transpose_rows(acc_t + first, kBlockQ, hv, kLanes, o_rows, hvp, hv, kLanes);
      o_rows_first = first;
    }
    store_row(o_rows + (r - first) * hvp, hv, scale, out);
  }
};

}  // namespace jax_flash::cpu::JF_ISA
