// The forward's two products for bfloat16 inputs on bfloat16 tiles (bf16_tiles.h: AMX, or
// vdpbf16ps), float32 accumulation; FlashFwd (flash_fwd.h) runs the same online softmax, masks
// and score policies between them as on the float32 path (fwd_products.h).
//
//   S^T = K Q^T:    A = K's rows as they lie (16 keys x 32 dims a tile), B = the block's query
//                   rows in pairs of dims (made once per task).
//   O^T += V^T P^T: A = V^T (made once per (batch, kv head) for every task of the call: Shared),
//                   B = P^T in pairs of keys, rounded to bfloat16 (as the GPU kernels do), made
//                   from the softmax's transposed probabilities per key block.
// The accumulator is O^T (dims x query rows): the softmax's rescaling is then one vector of
// query rows per dim, and the rows are written out transposed once at the end.
#pragma once

#include <cstring>
#include <new>

#include "cpu/bf16_tiles.h"
#include "cpu/parallel.h"
#include "cpu/simd.h"
#include "cpu/tile_io.h"

namespace jax_flash::cpu::JF_ISA {

static_assert(kBlockQ % 32 == 0 && kBlockK % 32 == 0, "blocks are whole 2 x 2 blocks of tiles");

inline int64_t tile_depth_padded(int64_t dim) { return round_up(dim, kTileDepth); }

struct Bf16FwdProducts {
  // Query columns come in 2 x 16 (one 2 x 2 block of C tiles spans 32 rows).
  static constexpr int64_t kRowAlign = 32;
  // Keys a step: 128, so that O^T's C tiles are loaded and stored once per 128 keys of P V (they
  // were once per 64: about as many tile loads and stores as products at head dim 128).
  static constexpr int64_t kKeyBlock = 128;
  static_assert(kKeyBlock % 32 == 0, "whole 2 x 2 blocks of tiles");
  // One query block a task: pairs (fwd_products.h) were measured on float32 tiles only (an AVX2
  // Zen 3, session 45), and no machine here runs AMX or vdpbf16ps to measure them on.
  static constexpr bool kPairsQueryBlocks = false;

  // V^T of every (batch, kv head): vt[((b * heads_k + hk) * dims + c) * ld + j] for dims
  // c < dims (hv padded to 32; zero past hv) and keys j < ld (past seq_k by a tile's depth, so
  // a block's last chunk stays inside; zero past seq_k).
  //
  // K of every (batch, kv head) in whole tiles: 16 keys x 32 dims a contiguous 1 KiB, the
  // depth's tiles of 16 keys one after the other (kt + head * k_head + (j / 16 * depth / 32 +
  // c / 32) * 512 + j % 16 * 32 + c % 32; zero past d and past seq_k). Read in place, each tile
  // row sat a whole K row (heads_k * d values) from the next, 16 rows in different pages at
  // head dim 128: the A tile's load was the forward's largest stall.
  struct Shared {
    int64_t dims = 0, ld = 0;
    BFloat16* vt = nullptr;
    int64_t depth = 0, k_head = 0;
    BFloat16* kt = nullptr;

    Shared(const FwdParams& p, const TaskRunner& runner) {
      const AttentionShape& sh = p.shape;
      dims = tile_depth_padded(sh.head_dim_v);
      ld = round_up(sh.seq_k, kTileDepth) + kTileDepth;
      const int64_t heads = sh.batch * sh.heads_k;
      vt = static_cast<BFloat16*>(
          ::operator new[](heads * dims * ld * sizeof(BFloat16), std::align_val_t{64}));
      depth = tile_depth_padded(sh.head_dim);
      k_head = round_up(sh.seq_k, kTileRows) * depth;
      kt = static_cast<BFloat16*>(
          ::operator new[](heads * k_head * sizeof(BFloat16), std::align_val_t{64}));
      auto pack_head = [&](int64_t head) {
        const int64_t b = head / sh.heads_k, hk = head % sh.heads_k;
        const int64_t v_stride = sh.heads_k * sh.head_dim_v;
        const BFloat16* v =
            static_cast<const BFloat16*>(p.v) + b * sh.seq_k * v_stride + hk * sh.head_dim_v;
        pack_transposed(v, v_stride, sh.seq_k, sh.head_dim_v, dims, ld, vt + head * dims * ld);
        const int64_t k_stride = sh.heads_k * sh.head_dim;
        const BFloat16* k =
            static_cast<const BFloat16*>(p.k) + b * sh.seq_k * k_stride + hk * sh.head_dim;
        BFloat16* out = kt + head * k_head;
        for (int64_t j = 0; j < k_head / depth; ++j)
          for (int64_t c = 0; c < depth; c += kTileDepth) {
            BFloat16* row = out + (j / kTileRows * depth + c) * kTileRows + j % kTileRows * kTileDepth;
            const int64_t n = j < sh.seq_k ? min64(kTileDepth, max64(0, sh.head_dim - c)) : 0;
            if (n == kTileDepth) {  // the common case: one 64-byte copy of a fixed size
              std::memcpy(row, k + j * k_stride + c, kTileBytes);
              continue;
            }
            if (n) std::memcpy(row, k + j * k_stride + c, n * sizeof(BFloat16));
            std::memset(row + n, 0, (kTileDepth - n) * sizeof(BFloat16));
          }
      };
      parallel_for(runner, heads, pack_head);
    }
    // Called once the call's tasks are done. (No destructor: the per-ISA objects carry no
    // unwinding code, whose personality reference the linker could merge; check_isa_symbols.)
    void release() {
      ::operator delete[](vt, std::align_val_t{64});
      ::operator delete[](kt, std::align_val_t{64});
    }
  };

  int64_t d, hv;
  int64_t depth;  // q's and k's head dim padded to kTileDepth
  int64_t dims;   // v's padded likewise: the accumulator's rows
  const Shared& shared;
  const BFloat16* vt;  // this (batch, kv head)'s V^T
  const BFloat16* kt;  // and its K in tiles
  uint32_t* q_pairs;   // depth / 2 x kBlockQ
  float* acc_t;        // O^T, dims x kBlockQ
  BFloat16* k_pack;    // kKeyBlock x depth: K rows that cannot be read in place
  uint32_t* p_pairs;   // kKeyBlock / 2 x kBlockQ
  BFloat16* v_tail;    // dims x kTileDepth: a block's last, partial chunk of V^T

  static int64_t scratch_floats(const AttentionShape& sh) {
    const int64_t depth = tile_depth_padded(sh.head_dim), dims = tile_depth_padded(sh.head_dim_v);
    return depth / 2 * kBlockQ + dims * kBlockQ + kKeyBlock * depth / 2 + kKeyBlock / 2 * kBlockQ +
           dims * kTileDepth / 2;
  }

  Bf16FwdProducts(const FwdParams& p, const Shared& shared_state, int64_t b, int64_t hk,
                  float* scratch)
      : d(p.shape.head_dim),
        hv(p.shape.head_dim_v),
        depth(tile_depth_padded(d)),
        dims(shared_state.dims),
        shared(shared_state),
        vt(shared_state.vt + (b * p.shape.heads_k + hk) * shared_state.dims * shared_state.ld),
        kt(shared_state.kt + (b * p.shape.heads_k + hk) * shared_state.k_head) {
    q_pairs = reinterpret_cast<uint32_t*>(scratch);
    acc_t = scratch + depth / 2 * kBlockQ;
    k_pack = reinterpret_cast<BFloat16*>(acc_t + dims * kBlockQ);
    p_pairs = reinterpret_cast<uint32_t*>(k_pack + kKeyBlock * depth);
    v_tail = reinterpret_cast<BFloat16*>(p_pairs + kKeyBlock / 2 * kBlockQ);
    configure_tiles();
  }
  // Called at the end of the task: frees the tile state (the thread may then be switched out
  // without saving 8 KiB of tiles).
  void finish() { release_tiles(); }

  void load_queries(const BFloat16* q, int64_t q_stride, int64_t live_rows) {
    pack_dim_pairs(q, q_stride, live_rows, d, depth / 2, kBlockQ, q_pairs);
    std::memset(acc_t, 0, dims * kBlockQ * sizeof(float));
  }

  // scores_t[c * kBlockQ + r] = scale * k_c . q_r for keys c < cols and query columns r < nq
  // (keys up to cols rounded to 32 are computed too, from zero rows).
  void scores(const BFloat16* k, int64_t k_stride, int64_t j0, int64_t cols, int64_t nq,
              float scale, float* scores_t) {
    const int64_t key_rows = round_up(cols, 32);
    const uint8_t* b_bytes = reinterpret_cast<const uint8_t*>(q_pairs);
    constexpr int64_t q_row_bytes = kBlockQ * sizeof(uint32_t);
    constexpr int64_t tile_bytes = kTileRows * kTileBytes;
    if (cols == key_rows && j0 % kTileRows == 0) {
      // Whole strips of 32 keys on the tile grid: K's tiles (Shared::kt), each contiguous.
      const uint8_t* a_bytes = reinterpret_cast<const uint8_t*>(kt + j0 * depth);
      const int64_t strip_bytes = depth / kTileDepth * tile_bytes;  // 16 keys, every dim
      for (int64_t c0 = 0; c0 < key_rows; c0 += 32)
        for (int64_t r0 = 0; r0 < nq; r0 += 32)
          tile_block_2x2(depth / kTileDepth, a_bytes + c0 / kTileRows * strip_bytes, kTileBytes,
                         strip_bytes, tile_bytes, b_bytes + r0 * sizeof(uint32_t), q_row_bytes,
                         kTileBytes, kTileRows * q_row_bytes, scores_t + c0 * kBlockQ + r0,
                         q_row_bytes, 16 * kBlockQ, false);
    } else {
      // A partial block (copied with zeros past it: keys past it may hold NaN) or one off the
      // tile grid (a window's or a length's start): K's rows copied.
      pack_rows(k, k_stride, cols, d, depth, key_rows, k_pack);
      const uint8_t* a_bytes = reinterpret_cast<const uint8_t*>(k_pack);
      const int64_t a_stride = depth * sizeof(BFloat16);
      for (int64_t c0 = 0; c0 < key_rows; c0 += 32)
        for (int64_t r0 = 0; r0 < nq; r0 += 32)
          tile_block_2x2(depth / kTileDepth, a_bytes + c0 * a_stride, a_stride, 16 * a_stride,
                         kTileBytes, b_bytes + r0 * sizeof(uint32_t), q_row_bytes, kTileBytes,
                         kTileRows * q_row_bytes, scores_t + c0 * kBlockQ + r0, q_row_bytes,
                         16 * kBlockQ, false);
    }
    const Vec s = splat(scale);
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = 0; r < nq; r += kLanes) {
        float* x = scores_t + c * kBlockQ + r;
        store(x, load(x) * s);
      }
  }

  // O^T column r *= correction[r], kLanes columns at a time where a live row's factor is not 1
  // (rows past live_rows have factors too, finite, but nothing reads their columns).
  void rescale(const float* correction, int64_t live_rows, int64_t nq) {
    scale_transposed_columns(acc_t, kBlockQ, hv, correction, live_rows, nq);
  }

  // O^T += V^T P^T over keys [j0, j0 + cols): P from the transposed probabilities (key c of
  // row r at scores_t[c * kBlockQ + r]).
  void accumulate(const float* scores_t, const BFloat16* /*v*/, int64_t /*v_stride*/, int64_t j0,
                  int64_t cols, int64_t /*live_rows*/, int64_t nq) {
    const int64_t chunks = ceil_div(cols, kTileDepth);
    pack_float_rows_in_pairs(scores_t, kBlockQ, cols, chunks * kTileDepth / 2, nq, 1.f, p_pairs);
    // Keys past the block in its last, partial chunk may hold anything (past kv_len, outside a
    // window): 0 * inf would be NaN, so that chunk is copied with zeros there. Whole chunks are
    // read in place.
    const int64_t whole = cols / kTileDepth;
    const int64_t ld_bytes = shared.ld * sizeof(BFloat16);
    const uint8_t* p_bytes = reinterpret_cast<const uint8_t*>(p_pairs);
    constexpr int64_t p_row_bytes = kBlockQ * sizeof(uint32_t);
    constexpr int64_t p_chunk_bytes = kTileDepth / 2 * p_row_bytes;
    if (whole < chunks)
      copy_partial_chunk(vt, shared.ld, dims, j0 + whole * kTileDepth, cols - whole * kTileDepth,
                         v_tail);
    constexpr int64_t tail_bytes = kTileDepth * sizeof(BFloat16);
    for (int64_t c0 = 0; c0 < dims; c0 += 32)
      for (int64_t r0 = 0; r0 < nq; r0 += 32) {
        float* c = acc_t + c0 * kBlockQ + r0;
        const uint8_t* b = p_bytes + r0 * sizeof(uint32_t);
        if (whole > 0)
          tile_block_2x2(whole, reinterpret_cast<const uint8_t*>(vt + c0 * shared.ld + j0), ld_bytes,
                         16 * ld_bytes, kTileBytes, b, p_row_bytes, kTileBytes, p_chunk_bytes, c,
                         p_row_bytes, 16 * kBlockQ, true);
        if (whole < chunks)
          tile_block_2x2(1, reinterpret_cast<const uint8_t*>(v_tail + c0 * kTileDepth), tail_bytes,
                         16 * tail_bytes, kTileBytes, b + whole * p_chunk_bytes, p_row_bytes,
                         kTileBytes, p_chunk_bytes, c, p_row_bytes, 16 * kBlockQ, true);
      }
  }

  // out[c] = scale * O[r][c] for c < hv.
  template <typename U>
  void store_output_row(int64_t r, float scale, U* out) const {
    store_column(acc_t + r, kBlockQ, hv, scale, out);
  }
};

}  // namespace jax_flash::cpu::JF_ISA
