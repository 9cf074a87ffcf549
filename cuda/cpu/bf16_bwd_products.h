// The backward's five products for bfloat16 inputs on bfloat16 tiles (bf16_tiles.h: AMX, or
// vdpbf16ps), float32 accumulation; FlashBwdMain (flash_bwd.h) forms P and dS between them as on
// the float32 path (bwd_products.h). P is rounded to bfloat16 before dV's product (as the GPU
// kernels do); scale * dS enters dQ's and dK's as the sum of two bfloat16 values (hi + lo, about
// 16 significant bits): rounded to one, dQ and dK missed the accuracy rule of the tests (2x
// the error of the reference computed in bfloat16) by 3-16% on a few calls, as the GPU
// kernels' do (issue 13).
//
//   S = Q K^T:           A = Q's rows as they lie, B = K in pairs of dims (per key block).
//   dP = dO V^T:         A = dO's rows as they lie, B = V in pairs of dims (per key block).
//   dV^T += dO^T P:      A = dO^T (made once per (batch, query head) for the call: Shared),
//                        B = P in pairs of query rows.
//   dK^T += Q^T dS:      A = Q^T (Shared likewise), B = scale dS in pairs of query rows, its
//                        hi and lo parts one product each.
//   dQ += dS K:          A = scale dS (hi and lo parts of each chunk of 32 keys side by side),
//                        B = K in pairs of keys, each chunk twice (per key block),
//                        summed into a tile and then added to the split's float32 accumulator
//                        (whose rows past the block belong to other tasks).
// dK and dV are accumulated transposed (dims x keys) and written out once per key block.
#pragma once

#include <cstring>
#include <new>

#include "cpu/bf16_tiles.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "cpu/tile_io.h"

namespace jax_flash::cpu::JF_ISA {

struct Bf16BwdProducts {
  // Q^T and dO^T of every (batch, query head): qt[((b * heads_q + h) * depth + c) * ld + i]
  // for dims c < depth (H padded to 32; zero past H) and rows i < ld (past seq_q by a tile's
  // depth; zero past seq_q); dot likewise with dims (Hv padded).
  struct Shared {
    int64_t depth = 0, dims = 0, ld = 0;
    BFloat16* qt = nullptr;
    BFloat16* dot = nullptr;

    Shared(const BwdParams& p, const TaskRunner& runner) {
      const AttentionShape& sh = p.shape;
      depth = round_up(sh.head_dim, kTileDepth);
      dims = round_up(sh.head_dim_v, kTileDepth);
      ld = round_up(sh.seq_q, kTileDepth) + kTileDepth;
      const int64_t heads = sh.batch * sh.heads_q;
      qt = static_cast<BFloat16*>(
          ::operator new[](heads * (depth + dims) * ld * sizeof(BFloat16), std::align_val_t{64}));
      dot = qt + heads * depth * ld;
      auto pack_head = [&](int64_t head) {
        const int64_t b = head / sh.heads_q, h = head % sh.heads_q;
        const int64_t q_stride = sh.heads_q * sh.head_dim, o_stride = sh.heads_q * sh.head_dim_v;
        const BFloat16* q =
            static_cast<const BFloat16*>(p.q) + b * sh.seq_q * q_stride + h * sh.head_dim;
        const BFloat16* d_o =
            static_cast<const BFloat16*>(p.d_o) + b * sh.seq_q * o_stride + h * sh.head_dim_v;
        pack_transposed(q, q_stride, sh.seq_q, sh.head_dim, depth, ld, qt + head * depth * ld);
        pack_transposed(d_o, o_stride, sh.seq_q, sh.head_dim_v, dims, ld, dot + head * dims * ld);
      };
      parallel_for(runner, heads, pack_head);
    }
    // Called once the call's tasks are done (no destructor: see Bf16FwdProducts::Shared).
    void release() { ::operator delete[](qt, std::align_val_t{64}); }
  };

  const Shared& shared;
  int64_t d, hv, depth, dims;
  int64_t batch_heads;  // b * heads_q: this task's first (batch, query head)
  // The key block's.
  uint32_t* k_dim_pairs;  // depth / 2 x kBlockK: B of S
  uint32_t* v_dim_pairs;  // dims / 2 x kBlockK: B of dP
  uint32_t* k_key_pairs;  // kBlockK x depth: B of dQ (each chunk's pair rows twice)
  float* dkt_acc;         // dK^T, depth x kBlockK
  float* dvt_acc;         // dV^T, dims x kBlockK
  // The query block's.
  BFloat16* q_pack;   // kBlockQ x depth: Q rows that cannot be read in place
  BFloat16* do_pack;  // kBlockQ x dims
  uint32_t* row_pairs;     // kBlockQ / 2 x kBlockK: P, or scale dS's hi part, in pairs of rows
  uint32_t* lo_row_pairs;  // kBlockQ / 2 x kBlockK: scale dS's lo part
  BFloat16* ds_rows;       // kBlockQ x 2 kBlockK: scale dS, hi and lo
  float* dq_tile;       // kBlockQ x depth
  BFloat16* tail;       // max(depth, dims) x kTileDepth: a partial chunk of Q^T or dO^T
  const BFloat16* q_rows = nullptr;   // A of S (q_pack, or Q in place)
  const BFloat16* do_rows = nullptr;  // A of dP
  int64_t q_rows_stride = 0, do_rows_stride = 0;  // bytes
  const BFloat16* qt = nullptr;   // this query block's Q^T: column 0 is its row i0
  const BFloat16* dot = nullptr;  // and dO^T
  int64_t rows = 0, padded_rows = 0;

  // The key block's tiles (K and V in pairs of dims, K in pairs of keys, dK^T and dV^T);
  // scratch_floats adds the query block's.
  static int64_t key_tile_floats(const AttentionShape& sh) {
    const int64_t depth = round_up(sh.head_dim, kTileDepth), dims = round_up(sh.head_dim_v, kTileDepth);
    return depth / 2 * kBlockK + dims / 2 * kBlockK + kBlockK * depth + depth * kBlockK + dims * kBlockK;
  }
  static int64_t scratch_floats(const AttentionShape& sh) {
    const int64_t depth = round_up(sh.head_dim, kTileDepth), dims = round_up(sh.head_dim_v, kTileDepth);
    return key_tile_floats(sh) + kBlockQ * depth / 2 + kBlockQ * dims / 2 + kBlockQ * kBlockK +
           kBlockQ * kBlockK + kBlockQ * depth + (depth > dims ? depth : dims) * kTileDepth / 2;
  }
  static int64_t key_tile_bytes(const AttentionShape& sh) { return key_tile_floats(sh) * sizeof(float); }

  Bf16BwdProducts(const BwdParams& p, const Shared& shared_state, int64_t b, int64_t /*hk*/,
                  float* scratch)
      : shared(shared_state),
        d(p.shape.head_dim),
        hv(p.shape.head_dim_v),
        depth(shared_state.depth),
        dims(shared_state.dims),
        batch_heads(b * p.shape.heads_q) {
    k_dim_pairs = reinterpret_cast<uint32_t*>(scratch);
    v_dim_pairs = k_dim_pairs + depth / 2 * kBlockK;
    k_key_pairs = v_dim_pairs + dims / 2 * kBlockK;
    dkt_acc = reinterpret_cast<float*>(k_key_pairs + kBlockK * depth);
    dvt_acc = dkt_acc + depth * kBlockK;
    q_pack = reinterpret_cast<BFloat16*>(dvt_acc + dims * kBlockK);
    do_pack = q_pack + kBlockQ * depth;
    row_pairs = reinterpret_cast<uint32_t*>(do_pack + kBlockQ * dims);
    lo_row_pairs = row_pairs + kBlockQ / 2 * kBlockK;
    ds_rows = reinterpret_cast<BFloat16*>(lo_row_pairs + kBlockQ / 2 * kBlockK);
    dq_tile = reinterpret_cast<float*>(ds_rows + kBlockQ * 2 * kBlockK);
    tail = reinterpret_cast<BFloat16*>(dq_tile + kBlockQ * depth);
    configure_tiles();
  }
  void finish() { release_tiles(); }

  void load_keys(const BFloat16* k, int64_t k_stride, const BFloat16* v, int64_t v_stride,
                 int64_t live_cols) {
    pack_dim_pairs(k, k_stride, live_cols, d, depth / 2, kBlockK, k_dim_pairs);
    pack_dim_pairs(v, v_stride, live_cols, hv, dims / 2, kBlockK, v_dim_pairs);
    pack_rows_in_pairs_twice(k, k_stride, live_cols, d, kBlockK / 2, depth, k_key_pairs);
    std::memset(dkt_acc, 0, depth * kBlockK * sizeof(float));
    std::memset(dvt_acc, 0, dims * kBlockK * sizeof(float));
  }

  void load_queries(const BFloat16* q, int64_t q_stride, const BFloat16* d_o, int64_t o_stride,
                    int64_t h, int64_t i0, int64_t block_rows) {
    rows = block_rows;
    padded_rows = round_up(rows, 32);
    // Rows are read in place when they are whole tile rows and the block whole strips of 32.
    const bool whole_rows = rows == padded_rows;
    if (whole_rows && d == depth) {
      q_rows = q, q_rows_stride = q_stride * sizeof(BFloat16);
    } else {
      pack_rows(q, q_stride, rows, d, depth, padded_rows, q_pack);
      q_rows = q_pack, q_rows_stride = depth * sizeof(BFloat16);
    }
    if (whole_rows && hv == dims) {
      do_rows = d_o, do_rows_stride = o_stride * sizeof(BFloat16);
    } else {
      pack_rows(d_o, o_stride, rows, hv, dims, padded_rows, do_pack);
      do_rows = do_pack, do_rows_stride = dims * sizeof(BFloat16);
    }
    qt = shared.qt + (batch_heads + h) * depth * shared.ld + i0;
    dot = shared.dot + (batch_heads + h) * dims * shared.ld + i0;
  }

  // C[padded_rows x kBlockK] = A B over `chunks` of the depth: A rows of bytes a_stride, B in
  // pairs (rows of kBlockK words).
  void rows_by_keys(const BFloat16* a, int64_t a_stride, const uint32_t* b, int64_t chunks, float* c) {
    const uint8_t* a_bytes = reinterpret_cast<const uint8_t*>(a);
    const uint8_t* b_bytes = reinterpret_cast<const uint8_t*>(b);
    constexpr int64_t row_bytes = kBlockK * sizeof(uint32_t);
    for (int64_t r0 = 0; r0 < padded_rows; r0 += 32)
      for (int64_t c0 = 0; c0 < kBlockK; c0 += 32)
        tile_block_2x2(chunks, a_bytes + r0 * a_stride, a_stride, 16 * a_stride, kTileBytes,
                       b_bytes + c0 * sizeof(uint32_t), row_bytes, kTileBytes, kTileRows * row_bytes,
                       c + r0 * kBlockK + c0, kBlockK * sizeof(float), 16 * kBlockK, false);
  }

  void scores(int64_t /*rows*/, float scale, float* probs) {
    rows_by_keys(q_rows, q_rows_stride, k_dim_pairs, depth / kTileDepth, probs);
    const Vec s = splat(scale);
    for (int64_t x = 0; x < rows * kBlockK; x += kLanes) store(probs + x, load(probs + x) * s);
  }

  void score_grads(int64_t /*rows*/, float* dscores) {
    rows_by_keys(do_rows, do_rows_stride, v_dim_pairs, dims / kTileDepth, dscores);
  }

  // acc^T[dims_a x kBlockK] += A B: A = xt (dims_a x query rows of this block, rows of
  // shared.ld values), B = `pairs` (rows in pairs); the block's last partial chunk of 32 rows
  // copied with zeros past it.
  void accumulate_transposed(const BFloat16* xt, int64_t dims_a, const uint32_t* pairs, float* acc) {
    const int64_t chunks = padded_rows / kTileDepth, whole = rows / kTileDepth;
    const int64_t ld_bytes = shared.ld * sizeof(BFloat16);
    const uint8_t* b_bytes = reinterpret_cast<const uint8_t*>(pairs);
    constexpr int64_t row_bytes = kBlockK * sizeof(uint32_t);
    constexpr int64_t chunk_bytes = kTileDepth / 2 * row_bytes;
    constexpr int64_t tail_bytes = kTileDepth * sizeof(BFloat16);
    if (whole < chunks)
      copy_partial_chunk(xt, shared.ld, dims_a, whole * kTileDepth, rows - whole * kTileDepth, tail);
    for (int64_t c0 = 0; c0 < dims_a; c0 += 32)
      for (int64_t n0 = 0; n0 < kBlockK; n0 += 32) {
        float* c = acc + c0 * kBlockK + n0;
        const uint8_t* b = b_bytes + n0 * sizeof(uint32_t);
        if (whole > 0)
          tile_block_2x2(whole, reinterpret_cast<const uint8_t*>(xt + c0 * shared.ld), ld_bytes,
                         16 * ld_bytes, kTileBytes, b, row_bytes, kTileBytes, chunk_bytes, c,
                         kBlockK * sizeof(float), 16 * kBlockK, true);
        if (whole < chunks)
          tile_block_2x2(1, reinterpret_cast<const uint8_t*>(tail + c0 * kTileDepth), tail_bytes,
                         16 * tail_bytes, kTileBytes, b + whole * chunk_bytes, row_bytes, kTileBytes,
                         chunk_bytes, c, kBlockK * sizeof(float), 16 * kBlockK, true);
      }
  }

  void accumulate_dv(const float* probs, int64_t /*rows*/, int64_t /*live_cols*/) {
    pack_float_rows_in_pairs(probs, kBlockK, rows, padded_rows / 2, kBlockK, 1.f, row_pairs);
    accumulate_transposed(dot, dims, row_pairs, dvt_acc);
  }

  void accumulate_dq_dk(const float* dscores, int64_t /*rows*/, int64_t live_cols, float scale,
                        float* dq, int64_t dq_stride) {
    // dQ = (hi + lo) K over the chunks of 32 keys that hold live keys (K's pairs are zero
    // past): each chunk twice along the depth, hi then lo.
    pack_float_rows_split(dscores, kBlockK, rows, padded_rows, kBlockK, scale, ds_rows);
    const int64_t key_chunks = ceil_div(live_cols, kTileDepth);
    const uint8_t* a_bytes = reinterpret_cast<const uint8_t*>(ds_rows);
    const uint8_t* b_bytes = reinterpret_cast<const uint8_t*>(k_key_pairs);
    constexpr int64_t a_stride = 2 * kBlockK * sizeof(BFloat16);
    const int64_t b_stride = depth * sizeof(uint32_t);
    // Whole tiles of the accumulator (every row of the block's 32-row strips live, its rows
    // depth wide) are summed into in place; else into dq_tile, then added row by row.
    const bool in_place = rows == padded_rows && padded_head_dim(d) == depth;
    float* c = in_place ? dq : dq_tile;
    const int64_t ldc = in_place ? dq_stride : depth;
    for (int64_t r0 = 0; r0 < padded_rows; r0 += 32)
      for (int64_t c0 = 0; c0 < depth; c0 += 32)
        tile_block_2x2(2 * key_chunks, a_bytes + r0 * a_stride, a_stride, 16 * a_stride, kTileBytes,
                       b_bytes + c0 * sizeof(uint32_t), b_stride, kTileBytes, kTileRows * b_stride,
                       c + r0 * ldc + c0, ldc * sizeof(float), 16 * ldc, in_place);
    if (!in_place) {
      // The accumulator's rows are d padded to kHeadDimAlign; dq_tile is 0 past d.
      const int64_t dp = padded_head_dim(d);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t x = 0; x < dp; x += kLanes)
          store(dq + r * dq_stride + x, load(dq + r * dq_stride + x) + load(dq_tile + r * depth + x));
    }
    // dK^T += Q^T (hi + lo)
    pack_float_rows_in_pairs_split(dscores, kBlockK, rows, padded_rows / 2, kBlockK, scale, row_pairs,
                                   lo_row_pairs);
    accumulate_transposed(qt, depth, row_pairs, dkt_acc);
    accumulate_transposed(qt, depth, lo_row_pairs, dkt_acc);
  }

  void store_key_row(int64_t r, BFloat16* dk, BFloat16* dv) const {
    store_column(dkt_acc + r, kBlockK, d, 1.f, dk);
    store_column(dvt_acc + r, kBlockK, hv, 1.f, dv);
  }
};

}  // namespace jax_flash::cpu::JF_ISA
