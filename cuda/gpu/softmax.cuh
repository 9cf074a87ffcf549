// The forward's online softmax in base 2 (running row maxima and sums with lazy rescaling), on
// the m16n8 accumulator layout both CUDA families use (a warpgroup's wgmma accumulator is its
// warps' m16n8 tiles).
#pragma once

#include <cmath>

#include "gpu/ptx.cuh"

namespace jax_flash::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;
// Lazy rescaling threshold of the forward's online softmax: probabilities stay <= 2^8.
inline constexpr float kRescaleLog2 = 8.f;
// Rows whose reference |max * scale log2e| reaches this exponentiate from rounded products: one
// FFMA (s c - max c, s c unrounded) leaves the maximum's own argument up to half an ulp of max c
// above its true value, 1e12 at 1e19 logits, and exp2 overflows; rounding s c first, as the
// reference is rounded, makes the maximum's argument exactly 0. Below it the FFMA's error is
// under 2^-8 (one instruction a score saved on every ordinary row).
inline constexpr float kFusedExponentLimit = 65536.f;

// x 2^n for an integral 0 <= n < 128, exact.
__device__ __forceinline__ float times_power_of_two(float x, float n) {
  return x * __int_as_float((127 + static_cast<int>(n)) << 23);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The online softmax of a warp's kMTiles 16-row tiles (this thread: rows lane/4 and lane/4 + 8
// of each), with lazy rescaling. A row's reference maximum (max) moves only when some row of the
// warp meets a score more than kRescaleLog2 (in log2 units) above its own, or sees its first
// key; then every row of the warp moves to its new maximum and O and the sums are rescaled.
// Otherwise P = exp2(S - reference) stays <= 2^kRescaleLog2 and nothing is rescaled: exact, since
// the final normalisation and lse use the same reference. After the first blocks a warp rarely
// rescales (saving 128 multiplies a thread per block at head dim 128). Needs scale_log2 >= 0
// (ops.py keeps the scale positive).
//
// For a differentiated call the tiled forwards also keep the sum of P as rounded to 16 bits for
// the P V product (add_rounded_sums; the epilogue divides O by it, while lse comes from the
// unrounded sum): the weights O is built from then sum to 1, so a row of one key gives exactly V
// and the backward's delta = rowsum(dO * O) matches its dS (issue 13; examples/results/h200/
// session9/differential_cuda_analysis.md, step 1). It costs ~15% of the forward at head dim 64
// on the H200, so inference (16-bit o) skips it.
//
// headroom (FwdParams::pv_headroom_log2, an integer): P is exp2(S scale log2e - reference -
// headroom), and so are the sums; lse_of undoes it.
template <int kMTiles>
struct OnlineSoftmax {
  float max[kMTiles][2];
  float sum[kMTiles][2];  // this thread's part; quad_sum gives the row's
  float sum_rounded[kMTiles][2];  // the same of P rounded to 16 bits (add_rounded_sums)
  float new_max[kMTiles][2];
  float correction[kMTiles][2];  // of the last move_reference
  float headroom;

  __device__ __forceinline__ explicit OnlineSoftmax(float headroom_log2) : headroom(headroom_log2) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        max[mt][half] = -INFINITY;
        sum[mt][half] = 0.f;
        sum_rounded[mt][half] = 0.f;
      }
  }

  // The rows' maxima including this block's scores s; whether the warp must rescale.
  template <int kNTiles>
  __device__ __forceinline__ bool must_rescale(const float (&s)[kMTiles][kNTiles][4], float scale_log2) {
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
          tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
        const float old_max = max[mt][half];
        new_max[mt][half] = fmaxf(old_max, quad_max(tile_max));
        grow |= old_max == -INFINITY ? new_max[mt][half] != -INFINITY
                                     : (new_max[mt][half] - old_max) * scale_log2 > kRescaleLog2;
      }
    return __any_sync(0xffffffffu, grow);
  }

  // Moves every row's reference to its new maximum and rescales the sums; O still needs
  // rescale_output (which may wait until O's pending product is in).
  __device__ __forceinline__ void move_reference(float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // A row with nothing visible yet keeps max -inf: its correction is exp2(-inf) = 0.
        const float base = new_max[mt][half] == -INFINITY ? 0.f : new_max[mt][half] * scale_log2;
        correction[mt][half] = fast_exp2(__fmul_rn(max[mt][half], scale_log2) - base);  // exact: see exponentiate
        max[mt][half] = new_max[mt][half];
        sum[mt][half] *= correction[mt][half];
        sum_rounded[mt][half] *= correction[mt][half];
      }
  }

  // O relative to the references move_reference set.
  template <int kDTiles>
  __device__ __forceinline__ void rescale_output(float (&o)[kMTiles][kDTiles][4]) const {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          o[mt][dt][2 * half] *= correction[mt][half];
          o[mt][dt][2 * half + 1] *= correction[mt][half];
        }
  }

  template <int kDTiles>
  __device__ __forceinline__ void rescale(float (&o)[kMTiles][kDTiles][4], float scale_log2) {
    move_reference(scale_log2);
    rescale_output(o);
  }

  // s <- P = exp2(S scale log2e - reference), added to the sums. A warp with some row past
  // kFusedExponentLimit takes the rounded-product form (one vote a block, a uniform branch).
  template <int kNTiles>
  __device__ __forceinline__ void exponentiate(float (&s)[kMTiles][kNTiles][4], float scale_log2) {
    bool huge = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        huge |= max[mt][half] != -INFINITY && fabsf(max[mt][half] * scale_log2) >= kFusedExponentLimit;
    if (__any_sync(0xffffffffu, huge))
      exponentiate_as<false>(s, scale_log2);
    else
      exponentiate_as<true>(s, scale_log2);
  }

  // exponentiate with the argument formed by one FFMA (kFused) or from the rounded product.
  template <bool kFused, int kNTiles>
  __device__ __forceinline__ void exponentiate_as(float (&s)[kMTiles][kNTiles][4], float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // -inf reference (nothing seen yet): subtract 0 so that exp2(-inf) gives 0. The fused
        // form's references are small enough (kFusedExponentLimit) to take the headroom exactly;
        // the rounded form subtracts it after the reference (whose argument is exactly 0).
        const float reference = max[mt][half] == -INFINITY ? 0.f : max[mt][half] * scale_log2;
        const float base = kFused ? reference + headroom : reference;
        float block_sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            const float x = s[mt][nt][e];
            s[mt][nt][e] = fast_exp2(kFused ? x * scale_log2 - base
                                            : (__fmul_rn(x, scale_log2) - base) - headroom);
            block_sum += s[mt][nt][e];
          }
        sum[mt][half] += block_sum;
      }
  }

  // The natural-log log-sum-exp of a row whose quad-summed sum is `row_sum` (scale: the softmax
  // scale, natural units).
  __device__ __forceinline__ float lse_of(int mt, int half, float row_sum, float scale) const {
    return max[mt][half] * scale + logf(times_power_of_two(row_sum, headroom));
  }

  // Adds P as rounded to T for P V, read back from the A operand accumulator_to_a<T> packed
  // (a[nt / 2][mt][2 (nt % 2) + half]: rows lane / 4 + 8 half), to sum_rounded: no conversion
  // of its own, an unpack and an add per element.
  template <typename T, int kKSteps>
  __device__ __forceinline__ void add_rounded_sums(const uint32_t (&a)[kKSteps][kMTiles][4]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float block_sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2 * kKSteps; ++nt) {
          const float2 pair = unpack_pair<T>(a[nt / 2][mt][(nt % 2) * 2 + half]);
          block_sum += pair.x + pair.y;
        }
        sum_rounded[mt][half] += block_sum;
      }
  }
};

}  // namespace jax_flash::cuda
