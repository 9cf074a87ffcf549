// The forward's two products on float32 tiles (tile_gemm.h), for every input dtype: S^T = K Q^T
// and O += P V, with 16-bit inputs converted to float32 in the tile loads. FlashFwd (flash_fwd.h)
// runs the online softmax between them; a products class owns the query tile and the output
// accumulator, so that another one (bf16_fwd_products.h) can hold them in its own layout.
#pragma once

#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "cpu/tile_gemm.h"
#include "cpu/tile_io.h"

namespace jax_flash::cpu::JF_ISA {

template <typename T>
struct FloatFwdProducts {
  // Query columns of S^T are computed in multiples of this many rows.
  static constexpr int64_t kRowAlign = kLanes;
  static constexpr int64_t kKeyBlock = kBlockK;  // keys a step

  // What every task of a call shares (nothing here).
  struct Shared {
    Shared(const FwdParams&, const TaskRunner&) {}
    void release() {}
  };

  int64_t dp;    // q's and k's head dim padded to kHeadDimAlign
  int64_t hvp;   // v's and o's head dim padded likewise
  int64_t d, hv;
  float* qt_tile;  // Q^T, dp x kBlockQ
  float* acc;      // the output accumulator, kBlockQ x hvp
  float* k_tile;   // K tile, kBlockK x dp (16-bit inputs, or a padded head dim)
  float* v_tile;   // V tile, kBlockK x hvp

  static int64_t scratch_floats(const AttentionShape& sh) {
    const int64_t dp = padded_head_dim(sh.head_dim), hvp = padded_head_dim(sh.head_dim_v);
    return dp * kBlockQ + kBlockQ * hvp + kBlockK * dp + kBlockK * hvp;
  }

  FloatFwdProducts(const FwdParams& p, const Shared&, int64_t /*b*/, int64_t /*hk*/, float* scratch)
      : dp(padded_head_dim(p.shape.head_dim)),
        hvp(padded_head_dim(p.shape.head_dim_v)),
        d(p.shape.head_dim),
        hv(p.shape.head_dim_v),
        qt_tile(scratch),
        acc(qt_tile + dp * kBlockQ),
        k_tile(acc + kBlockQ * hvp),
        v_tile(k_tile + kBlockK * dp) {}

  void finish() {}

  // Takes the block's live query rows (q row r at q[r * q_stride]) and clears the accumulator.
  void load_queries(const T* q, int64_t q_stride, int64_t live_rows) {
    load_rows_transposed(q, q_stride, live_rows, d, qt_tile, kBlockQ, dp);
    for (int64_t x = 0; x < live_rows * hvp; ++x) acc[x] = 0.f;
  }

  // scores_t[c * kBlockQ + r] = scale * k_c . q_r for keys c < cols (k row c at k[c * k_stride])
  // and query columns r < nq.
  void scores(const T* k, int64_t k_stride, int64_t /*j0*/, int64_t cols, int64_t nq, float scale,
              float* scores_t) {
    int64_t ldk;  // float32 K is read where it lies when the head dim needs no padding
    const float* kt = rows_as_tile(k, k_stride, cols, d, k_tile, dp, ldk);
    gemm(cols, nq, dp, scale, kt, ldk, qt_tile, kBlockQ, scores_t, kBlockQ, false);
  }

  // acc row r *= correction[r] for the rows r < live_rows whose factor is not 1.
  void rescale(const float* correction, int64_t live_rows, int64_t /*nq*/) {
    for (int64_t r = 0; r < live_rows; ++r) {
      if (correction[r] != 1.f) {
        const Vec cv = splat(correction[r]);
        for (int64_t c = 0; c < hvp; c += kLanes) store(acc + r * hvp + c, load(acc + r * hvp + c) * cv);
      }
    }
  }

  // O += P V: P read from S^T (key c of row r at scores_t[c * kBlockQ + r]), keys c < cols (v row
  // c at v[c * v_stride]).
  void accumulate(const float* scores_t, const T* v, int64_t v_stride, int64_t /*j0*/, int64_t cols,
                  int64_t live_rows, int64_t /*nq*/) {
    int64_t ldv;
    const float* vt = rows_as_tile(v, v_stride, cols, hv, v_tile, hvp, ldv);
    gemm_at(live_rows, hvp, cols, 1.f, scores_t, kBlockQ, vt, ldv, acc, hvp, true);
  }

  // out[c] = scale * O[r][c] for c < hv.
  template <typename U>
  void store_output_row(int64_t r, float scale, U* out) const {
    store_row(acc + r * hvp, hv, scale, out);
  }
};

}  // namespace jax_flash::cpu::JF_ISA
