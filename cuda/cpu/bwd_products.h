// The backward's five products on float32 tiles (tile_gemm.h), for every input dtype, with
// 16-bit inputs converted to float32 in the tile loads: S = Q K^T, dV += P^T dO, dP = dO V^T,
// dQ += scale dS K, dK += scale dS^T Q. FlashBwdMain (flash_bwd.h) forms P and dS between them;
// a products class owns the key block's K/V tiles and dK/dV accumulators and the query block's
// Q/dO tiles, so that another one (bf16_bwd_products.h) can hold them in its own layout.
#pragma once

#include <new>

#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "cpu/tile_gemm.h"
#include "cpu/tile_io.h"

namespace jax_flash::cpu::JF_ISA {

template <typename T>
struct FloatBwdProducts {
  // Q and dO of every (batch, query head) as float32 rows, for every task of the call:
  //   q[head * q_head + i * dp + c]    = Q[i][c]   (zero for c in [d, dp));
  //   d_o[head * o_head + i * hvp + c] = dO[i][c]  (zero for c in [hv, hvp)).
  // Read in place, their rows sat heads_q x d values apart (2 KiB at 4 x 128), a query block's
  // rows in a few L1 sets, reloaded from L2 by every product that streams them.
  struct Shared {
    int64_t dp = 0, hvp = 0, q_head = 0, o_head = 0;
    float* q = nullptr;
    float* d_o = nullptr;

    Shared(const BwdParams& p, const TaskRunner& runner) {
      const AttentionShape& sh = p.shape;
      dp = padded_head_dim(sh.head_dim);
      hvp = padded_head_dim(sh.head_dim_v);
      q_head = sh.seq_q * dp;
      o_head = sh.seq_q * hvp;
      const int64_t heads = sh.batch * sh.heads_q;
      q = static_cast<float*>(::operator new[](heads * q_head * sizeof(float), std::align_val_t{64}));
      d_o = static_cast<float*>(::operator new[](heads * o_head * sizeof(float), std::align_val_t{64}));
      const int64_t chunks = ceil_div(sh.seq_q, kPackRows);  // tasks of kPackRows rows of one head
      auto pack = [&](int64_t task) {
        const int64_t head = task / chunks, i0 = task % chunks * kPackRows;
        const int64_t b = head / sh.heads_q, h = head % sh.heads_q;
        const int64_t rows = min64(kPackRows, sh.seq_q - i0);
        const int64_t q_stride = sh.heads_q * sh.head_dim, o_stride = sh.heads_q * sh.head_dim_v;
        load_rows(static_cast<const T*>(p.q) + (b * sh.seq_q + i0) * q_stride + h * sh.head_dim, q_stride,
                  rows, sh.head_dim, q + head * q_head + i0 * dp, dp);
        load_rows(static_cast<const T*>(p.d_o) + (b * sh.seq_q + i0) * o_stride + h * sh.head_dim_v,
                  o_stride, rows, sh.head_dim_v, d_o + head * o_head + i0 * hvp, hvp);
      };
      parallel_for(runner, heads * chunks, pack);
    }
    // Called once the call's tasks are done (no destructor: see FloatFwdProducts::Shared).
    void release() {
      ::operator delete[](q, std::align_val_t{64});
      ::operator delete[](d_o, std::align_val_t{64});
    }
    static constexpr int64_t kPackRows = 256;
  };

  int64_t d, hv;
  int64_t dp;   // H padded to kHeadDimAlign
  int64_t hvp;  // Hv padded likewise
  const Shared& shared;
  int64_t b;
  int64_t heads_q, seq_q;
  // The tiles' rows are kTilePad floats longer than their width: rows 256 or 512 bytes apart
  // put a product's panel of 16 columns into a quarter or an eighth of the L1 sets.
  static constexpr int64_t kTilePad = 16;
  static constexpr int64_t kLd = kBlockK + kTilePad;  // K^T's, V^T's, dK^T's and dV^T's rows
  int64_t k_ld;    // K's rows: dp + kTilePad
  float* k_tile;   // K, kBlockK x dp
  float* kt_tile;  // K^T, dp x kBlockK
  float* vt_tile;  // V^T, hvp x kBlockK
  float* dkt_acc;  // dK^T, dp x kBlockK
  float* dvt_acc;  // dV^T, hvp x kBlockK
  const float* qs = nullptr;   // the query block's packed Q rows (Shared::q)
  const float* dos = nullptr;  // and dO rows

  static int64_t scratch_floats(const AttentionShape& sh) {
    const int64_t dp = padded_head_dim(sh.head_dim), hvp = padded_head_dim(sh.head_dim_v);
    return kBlockK * (dp + kTilePad) + 2 * dp * kLd + 2 * hvp * kLd;
  }
  // What a key block's tiles take (all of scratch_floats: K, K^T, V^T, dK^T, dV^T).
  static int64_t key_tile_bytes(const AttentionShape& sh) { return scratch_floats(sh) * sizeof(float); }

  FloatBwdProducts(const BwdParams& p, const Shared& shared_state, int64_t batch, int64_t /*hk*/,
                   float* scratch)
      : d(p.shape.head_dim),
        hv(p.shape.head_dim_v),
        dp(padded_head_dim(d)),
        hvp(padded_head_dim(hv)),
        shared(shared_state),
        b(batch),
        heads_q(p.shape.heads_q),
        seq_q(p.shape.seq_q),
        k_ld(dp + kTilePad),
        k_tile(scratch),
        kt_tile(k_tile + kBlockK * k_ld),
        vt_tile(kt_tile + dp * kLd),
        dkt_acc(vt_tile + hvp * kLd),
        dvt_acc(dkt_acc + dp * kLd) {}

  void finish() {}

  // Takes the key block's live keys (k row c at k[c * k_stride], v likewise) and clears the
  // block's dK and dV.
  void load_keys(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int64_t live_cols) {
    load_rows(k, k_stride, live_cols, d, k_tile, k_ld);
    load_rows_transposed(k, k_stride, live_cols, d, kt_tile, kLd, dp);
    load_rows_transposed(v, v_stride, live_cols, hv, vt_tile, kLd, hvp);
    for (int64_t x = 0; x < dp * kLd; ++x) dkt_acc[x] = 0.f;
    for (int64_t x = 0; x < hvp * kLd; ++x) dvt_acc[x] = 0.f;
  }

  // Takes the query block's rows i0.. of query head h (from Shared's packed rows).
  void load_queries(const T* /*q*/, int64_t /*q_stride*/, const T* /*d_o*/, int64_t /*o_stride*/, int64_t h,
                    int64_t i0, int64_t /*rows*/) {
    const int64_t head = b * heads_q + h;
    qs = shared.q + head * shared.q_head + i0 * dp;
    dos = shared.d_o + head * shared.o_head + i0 * hvp;
  }

  // probs[r * kBlockK + c] = scale * q_r . k_c for rows r < rows and every column of the block.
  void scores(int64_t rows, float scale, float* probs) {
    gemm(rows, kBlockK, dp, scale, qs, dp, kt_tile, kLd, probs, kBlockK, false);
  }

  // dV^T += dO^T P (P rows x kBlockK, row-major: B as it lies; dO^T read from dO's rows).
  void accumulate_dv(const float* probs, int64_t rows, int64_t live_cols) {
    gemm_strided(hvp, round_up(live_cols, kLanes), rows, 1.f, dos, 1, hvp, probs, kBlockK, dvt_acc,
                 kLd, true);
  }

  // dscores = dP = dO V^T.
  void score_grads(int64_t rows, float* dscores) {
    gemm(rows, kBlockK, hvp, 1.f, dos, hvp, vt_tile, kLd, dscores, kBlockK, false);
  }

  // dQ += scale dS K into the float32 accumulator rows dq[r * dq_stride]; dK^T += scale Q^T dS.
  void accumulate_dq_dk(const float* dscores, int64_t rows, int64_t live_cols, float scale, float* dq,
                        int64_t dq_stride) {
    gemm(rows, dp, live_cols, scale, dscores, kBlockK, k_tile, k_ld, dq, dq_stride, true);
    gemm_strided(dp, round_up(live_cols, kLanes), rows, scale, qs, 1, dp, dscores, kBlockK, dkt_acc,
                 kLd, true);
  }

  // Key r's gradients.
  void store_key_row(int64_t r, T* dk, T* dv) const {
    for (int64_t c = 0; c < d; ++c) dk[c] = from_float<T>(dkt_acc[c * kLd + r]);
    for (int64_t c = 0; c < hv; ++c) dv[c] = from_float<T>(dvt_acc[c * kLd + r]);
  }
};

}  // namespace jax_flash::cpu::JF_ISA
