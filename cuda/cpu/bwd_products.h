// The backward's five products on float32 tiles (tile_gemm.h), for every input dtype, with
// 16-bit inputs converted to float32 in the tile loads: S = Q K^T, dV += P^T dO, dP = dO V^T,
// dQ += scale dS K, dK += scale dS^T Q. FlashBwdMain (flash_bwd.h) forms P and dS between them;
// a products class owns the key block's K/V tiles and dK/dV accumulators and the query block's
// Q/dO tiles, so that another one (bf16_bwd_products.h) can hold them in its own layout.
#pragma once

#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "cpu/tile_gemm.h"
#include "cpu/tile_io.h"

namespace jax_flash::cpu::JF_ISA {

template <typename T>
struct FloatBwdProducts {
  // What every task of a call shares (nothing here).
  struct Shared {
    Shared(const BwdParams&, const TaskRunner&) {}
    void release() {}
  };

  int64_t d, hv;
  int64_t dp;   // H padded to kHeadDimAlign
  int64_t hvp;  // Hv padded likewise
  float* k_tile;   // K, kBlockK x dp
  float* kt_tile;  // K^T, dp x kBlockK
  float* vt_tile;  // V^T, hvp x kBlockK
  float* dk_acc;   // kBlockK x dp
  float* dv_acc;   // kBlockK x hvp
  float* q_tile;   // kBlockQ x dp (16-bit inputs, or a padded head dim)
  float* do_tile;  // kBlockQ x hvp
  const float* qs = nullptr;   // the query block's Q rows (q_tile, or float32 Q in place)
  const float* dos = nullptr;  // and dO rows
  int64_t ldq = 0, ldo = 0;

  static int64_t scratch_floats(const AttentionShape& sh) {
    const int64_t dp = padded_head_dim(sh.head_dim), hvp = padded_head_dim(sh.head_dim_v);
    return 3 * kBlockK * dp + 2 * kBlockK * hvp + kBlockQ * dp + kBlockQ * hvp;
  }

  FloatBwdProducts(const BwdParams& p, const Shared&, int64_t /*b*/, int64_t /*hk*/, float* scratch)
      : d(p.shape.head_dim),
        hv(p.shape.head_dim_v),
        dp(padded_head_dim(d)),
        hvp(padded_head_dim(hv)),
        k_tile(scratch),
        kt_tile(k_tile + kBlockK * dp),
        vt_tile(kt_tile + dp * kBlockK),
        dk_acc(vt_tile + hvp * kBlockK),
        dv_acc(dk_acc + kBlockK * dp),
        q_tile(dv_acc + kBlockK * hvp),
        do_tile(q_tile + kBlockQ * dp) {}

  void finish() {}

  // Takes the key block's live keys (k row c at k[c * k_stride], v likewise) and clears the
  // block's dK and dV.
  void load_keys(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int64_t live_cols) {
    load_rows(k, k_stride, live_cols, d, k_tile, dp);
    load_rows_transposed(k, k_stride, live_cols, d, kt_tile, kBlockK, dp);
    load_rows_transposed(v, v_stride, live_cols, hv, vt_tile, kBlockK, hvp);
    for (int64_t x = 0; x < kBlockK * dp; ++x) dk_acc[x] = 0.f;
    for (int64_t x = 0; x < kBlockK * hvp; ++x) dv_acc[x] = 0.f;
  }

  // Takes the query block's rows (q row r at q[r * q_stride], d_o likewise: rows i0 + r of
  // query head h). float32 Q and dO are read where they lie when the head dim needs no padding.
  void load_queries(const T* q, int64_t q_stride, const T* d_o, int64_t o_stride, int64_t /*h*/,
                    int64_t /*i0*/, int64_t rows) {
    qs = rows_as_tile(q, q_stride, rows, d, q_tile, dp, ldq);
    dos = rows_as_tile(d_o, o_stride, rows, hv, do_tile, hvp, ldo);
  }

  // probs[r * kBlockK + c] = scale * q_r . k_c for rows r < rows and every column of the block.
  void scores(int64_t rows, float scale, float* probs) {
    gemm(rows, kBlockK, dp, scale, qs, ldq, kt_tile, kBlockK, probs, kBlockK, false);
  }

  // dV += P^T dO (P rows x kBlockK, row-major).
  void accumulate_dv(const float* probs, int64_t rows, int64_t live_cols) {
    gemm_at(live_cols, hvp, rows, 1.f, probs, kBlockK, dos, ldo, dv_acc, hvp, true);
  }

  // dscores = dP = dO V^T.
  void score_grads(int64_t rows, float* dscores) {
    gemm(rows, kBlockK, hvp, 1.f, dos, ldo, vt_tile, kBlockK, dscores, kBlockK, false);
  }

  // dQ += scale dS K into the float32 accumulator rows dq[r * dq_stride]; dK += scale dS^T Q.
  void accumulate_dq_dk(const float* dscores, int64_t rows, int64_t live_cols, float scale, float* dq,
                        int64_t dq_stride) {
    gemm(rows, dp, live_cols, scale, dscores, kBlockK, k_tile, dp, dq, dq_stride, true);
    gemm_at(live_cols, dp, rows, scale, dscores, kBlockK, qs, ldq, dk_acc, dp, true);
  }

  // Key r's gradients.
  void store_key_row(int64_t r, T* dk, T* dv) const {
    store_row(dk_acc + r * dp, d, 1.f, dk);
    store_row(dv_acc + r * hvp, hv, 1.f, dv);
  }
};

}  // namespace jax_flash::cpu::JF_ISA
