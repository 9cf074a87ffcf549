// Score modifications in the CUDA kernels: dot_product_attention's logits_soft_cap (Gemma 2) and
// alibi_slopes (ALiBi), on a tile of raw scores q.k in registers, before the masks (the CPU
// kernel's order, cpu/flash_fwd.h):
//   s = scale q.k;  s = c tanh(s / c) with a cap c;  s += slope (j - i) with slopes,
// i and j the row and key indices the masks use. The general kernels (kGeneral, chosen per call
// where either is present: the plain kernels stay as they are) apply them. With a cap the tiles
// hold the scores in the cap's units, s / c = tanh(q.k scale / c) + (slope / c)(j - i): one FMUL
// and one MUFU.TANH a capped score, and the softmax and the lse take c as their scale
// (ScoreMods::softmax_scale), so P and the lse are those of s. The backward's dS gets the cap's
// chain rule, 1 - tanh^2, folded into dP (fold_chain_rule), tanh read off the tile itself.
// Fragment layouts: a thread's element (mt, nt, e) of an m16n8 accumulator is row 16 mt + lane / 4
// (+ 8 for e >= 2), column 8 nt + 2 (lane % 4) + e % 2; the backward's transposed tiles hold keys
// in rows and queries in columns.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/attention_params.h"
#include "gpu/kernel_choice.h"

namespace jax_flash::cuda {

// Whether a call takes the general kernels (kGeneral: host side, where the launchers choose):
// those instantiated with the score modifications here, the segment ids of gpu/segment_ids.cuh,
// the block mask's walks of gpu/block_sparse.cuh, fused dropout (gpu/dropout_fragments.h) and
// jax.nn's bias and mask arrays (gpu/logit_arrays.cuh), the last two in instantiations of their
// own; the plain calls' kernels hold none of their code.
inline bool general_kernel(const AttentionParams& p) {
  return p.logits_soft_cap > 0.f || p.alibi_slopes != nullptr || p.q_segment_ids != nullptr ||
         p.kv_block_lists != nullptr || p.dropout_seeds != nullptr || logit_arrays(p);
}

// Whether a general call needs the general kernels' ids and block-walk code (kIds): segment ids
// or a block mask. Calls with only a soft cap or ALiBi slopes run general kernels without it
// (the ids' code made the capped and ALiBi calls 5-7% slower at head dim 128 when it came,
// session 15, cuda/PERF_NOTES.md v14).
// Calls with jax.nn's bias or mask array (common/attention_params.h logit_arrays) run it too: the
// Hopper kernels' kLogitArrays instantiations have it.
inline bool general_ids(const AttentionParams& p) {
  return p.q_segment_ids != nullptr || p.kv_block_lists != nullptr || logit_arrays(p);
}

// Plain calls that are narrow (common/mask.h narrow_shape) run the mma.sync kernels with P
// and dS as hi + lo under JAX_FLASH_CUDA_NARROW=split.
inline bool narrow_plain_call(const AttentionParams& p) {
  return narrow_split_enabled() && !general_kernel(p) && narrow_shape(p.mask, p.shape.seq_q, p.shape.seq_k);
}

// Whether a block-sparse call needs nothing of the general kernels but the block mask's walk (no
// score modification, segment ids, dropout or local window): then its rows need no tracking either
// (gpu/segment_ids.cuh's tracks_seen_rows), and the plain Hopper kernels with the walk run it.
inline bool plain_block_walk_suffices(const AttentionParams& p) {
  return p.kv_block_lists != nullptr && p.logits_soft_cap <= 0.f && p.alibi_slopes == nullptr &&
         p.q_segment_ids == nullptr && p.dropout_seeds == nullptr && !logit_arrays(p) && !p.mask.windowed();
}

// tanh by the hardware's approximation (one MUFU operation; relative error 2^-11, below the
// rounding of a 16-bit score, and the CUDA kernels take 16-bit inputs only). The softmax's
// exponential is already one MUFU operation per score and the forward is bound by them: tanhf
// (several) made the capped forward 2.9x slower, 1 - 2 / (2^(2x log2 e) + 1) by ex2 and rcp (two)
// 1.7x (H200, session 14). +-inf give +-1, NaN stays NaN.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

struct ScoreMods {
  float scale;  // scale / c with a cap c, else scale
  float slope;  // slope / c with a cap c, else slope (0 without slopes)
  bool capped;

  // For batch element b and query head h of the call (once per tile task: it reads the slope).
  __device__ __forceinline__ ScoreMods(const AttentionParams& p, int64_t b, int64_t h)
      : scale(p.scale),
        slope(p.alibi_slopes ? p.alibi_slopes[b * p.shape.heads_q + h] : 0.f),
        capped(p.logits_soft_cap > 0.f) {
    if (capped) {  // the cap's units
      scale /= p.logits_soft_cap;
      slope /= p.logits_soft_cap;
    }
  }

  // The scale the softmax and the lse take in the general kernels: the cap (the scores are in
  // its units), else 1 (they are in score units).
  __host__ __device__ __forceinline__ static float softmax_scale(const AttentionParams& p) {
    return p.logits_soft_cap > 0.f ? p.logits_soft_cap : 1.f;
  }

  // The modified score (in the cap's units with one) of raw score x whose key index less query
  // index, j - i, is `offset` (exact in float below 2^24). NaN stays NaN.
  // kCap: a cap; kSlope: the slope is added (the tiles below branch once, not per score).
  template <bool kCap, bool kSlope>
  __device__ __forceinline__ float apply(float x, float offset) const {
    float s = x * scale;
    if constexpr (kCap) s = fast_tanh(s);
    if constexpr (kSlope) s = fmaf(slope, offset, s);
    return s;
  }

  // d(modified score) / d(scale q.k) at a modified (and masked: -inf) score s of a capped call:
  // 1 - tanh^2, tanh being s less the slope's term; 0 where masked.
  __device__ __forceinline__ float chain_rule(float s, float offset) const {
    const float t = fmaf(-slope, offset, s);
    return fmaxf(0.f, fmaf(-t, t, 1.f));  // -inf (masked) gives 0; NaN stays in P
  }

  // Calls `each(kCap, kSlope)` (std::bool_constant arguments) with this call's modifications:
  // branching on the cap, and with kSlopeBranch on whether the slope is 0 too (four copies of a
  // tile's loop: the Hopper kernels without the ids' code; the others spilled more with them).
  template <bool kSlopeBranch, typename Each>
  __device__ __forceinline__ void dispatch(Each&& each) const {
    auto with_cap = [&](auto cap) {
      if constexpr (kSlopeBranch) {
        if (slope != 0.f) each(cap, std::true_type{}); else each(cap, std::false_type{});
      } else {
        each(cap, std::true_type{});
      }
    };
    if (capped) with_cap(std::true_type{}); else with_cap(std::false_type{});
  }

  // The offsets j - i of an m16n8 accumulator tile are this thread's j - i at its first element
  // (`base`, one conversion a tile) plus a constant of the element's place; the additions are
  // exact, so every kernel (and the backward's recomputation) gets the same float offset.
  // Plain tiles (queries in rows from m0, keys in columns from n0):
  __device__ __forceinline__ static float tile_base(int64_t m0, int64_t n0, int lane) {
    return static_cast<float>(static_cast<int>(n0 - m0) + (lane % 4) * 2 - lane / 4);
  }
  __device__ __forceinline__ static constexpr int tile_step(int mt, int nt, int e) {
    return nt * 8 + e % 2 - mt * 16 - (e / 2) * 8;
  }
  // The Hopper backward's transposed tiles (keys in rows from key0, queries in columns from
  // query0):
  __device__ __forceinline__ static float transposed_base(int64_t key0, int64_t query0, int lane) {
    return static_cast<float>(static_cast<int>(key0 - query0) + lane / 4 - (lane % 4) * 2);
  }
  __device__ __forceinline__ static constexpr int transposed_step(int nt, int e) {
    return (e / 2) * 8 - nt * 8 - e % 2;
  }

  // A warp's kMTiles x kNTiles tile of raw scores, its first row query m0 and column key n0.
  template <bool kSlopeBranch = false, int kMTiles, int kNTiles>
  __device__ __forceinline__ void apply(float (&s)[kMTiles][kNTiles][4], int64_t m0, int64_t n0, int lane) const {
    const float base = tile_base(m0, n0, lane);
    dispatch<kSlopeBranch>([&](auto cap, auto sloped) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mt][nt][e] = apply<decltype(cap)::value, decltype(sloped)::value>(s[mt][nt][e], base + tile_step(mt, nt, e));
    });
  }

  // The transposed tile of the Hopper backward: rows keys from key0 (this thread's lane / 4
  // and + 8), columns queries from query0.
  template <bool kSlopeBranch = false, int kNTiles>
  __device__ __forceinline__ void apply_transposed(float (&s)[1][kNTiles][4], int64_t key0, int64_t query0,
                                                   int lane) const {
    const float base = transposed_base(key0, query0, lane);
    dispatch<kSlopeBranch>([&](auto cap, auto sloped) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[0][nt][e] = apply<decltype(cap)::value, decltype(sloped)::value>(s[0][nt][e], base + transposed_step(nt, e));
    });
  }

  // dp <- delta + chain_rule (dp - delta) on a capped call's tile (s modified and masked; delta per row), so
  // that the kernels' dS = scale P (dP - delta) becomes scale P (dP - delta) (1 - tanh^2).
  template <int kMTiles, int kNTiles>
  __device__ __forceinline__ void fold_chain_rule(float (&dp)[kMTiles][kNTiles][4],
                                                  const float (&s)[kMTiles][kNTiles][4],
                                                  const float (&delta)[kMTiles][2], int64_t m0, int64_t n0,
                                                  int lane) const {
    if (!capped) return;
    const float base = tile_base(m0, n0, lane);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float d = delta[mt][e / 2];
          const float f = chain_rule(s[mt][nt][e], base + tile_step(mt, nt, e));
          dp[mt][nt][e] = fmaf(f, dp[mt][nt][e] - d, d);
        }
  }

  // The same on the transposed tiles (delta per query column, from shared memory).
  template <int kNTiles>
  __device__ __forceinline__ void fold_chain_rule_transposed(float (&dpt)[1][kNTiles][4],
                                                             const float (&st)[1][kNTiles][4],
                                                             const float* delta, int64_t key0, int64_t query0,
                                                             int lane) const {
    if (!capped) return;
    const float base = transposed_base(key0, query0, lane);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float d = delta[nt * 8 + (lane % 4) * 2 + e % 2];
        const float f = chain_rule(st[0][nt][e], base + transposed_step(nt, e));
        dpt[0][nt][e] = fmaf(f, dpt[0][nt][e] - d, d);
      }
  }
};

}  // namespace jax_flash::cuda
