// Warp-level tile products on mma.sync m16n8k16, with operands in swizzled shared tiles
// (SmemTile) or, for A, already in registers. A warp computes
//   acc[kMTiles][kNTiles] (16x8 fp32 fragments) += A (16*kMTiles x 16*kSteps) * B (16*kSteps x 8*kNTiles)
// Operands start at column (k) 0 of their tiles and at the warp's rows m0 / n0, stored:
//   A [m][k] (kATransposed = false) or [k][m] (true);
//   B [n][k] (kBTransposed = false, e.g. K for Q K^T) or [k][n] (true, e.g. V for P V).
// ldmatrix (.trans where the storage is the other way round) turns either into the fragments.
//
// Addressing: each operand has one lane address, at its first fragment (SmemOperand); every other
// fragment is a fixed move (dr rows, dc chunks) from it. Where the chunk moves never share a bit
// with the lane's own chunk, a move is an XOR of dc into the swizzled chunk plus dr rows as an
// immediate (gpu/smem_tile.cuh says why that is exact): non-transposed operands move by 2 chunks
// a k-step from chunk 0/1; transposed ones by 2 chunks per fragment from the warp's offset,
// which the callers keep a multiple of the operand's span (m0 of 16*kMTiles rows, n0 of
// 8*kNTiles columns), so power-of-two fragment counts qualify. Others (head dim 192) recompute
// the swizzle per fragment. The lane address is made opaque to the compiler so that it is not
// expanded into one hoisted register per fragment (which spilled).
#pragma once

#include "gpu/fragments.cuh"
#include "gpu/ptx.cuh"
#include "gpu/smem_tile.cuh"

namespace jax_flash::cuda {

// Lane addresses of A (rows m0.. of its tile, 16*kMTiles of them) and of B (rows n0..).
template <typename Tile, bool kTransposed, int kMTiles, typename T>
__device__ __forceinline__ auto a_operand(const T* tile, int m0, int lane) {
  if constexpr (!kTransposed)
    return SmemOperand<Tile, true>(tile, m0 + lane / 8 % 2 * 8 + lane % 8, lane / 16);
  else
    return SmemOperand<Tile, kPowerOfTwo<kMTiles>>(tile, lane / 16 * 8 + lane % 8, m0 / 8 + lane / 8 % 2);
}
template <typename Tile, bool kTransposed, int kNTiles, typename T>
__device__ __forceinline__ auto b_operand(const T* tile, int n0, int lane) {
  if constexpr (!kTransposed)
    return SmemOperand<Tile, true>(tile, n0 + lane / 16 * 8 + lane % 8, lane / 8 % 2);
  else
    return SmemOperand<Tile, kPowerOfTwo<kNTiles>>(tile, lane / 8 % 2 * 8 + lane % 8, n0 / 8 + lane / 16);
}

// A fragments of m-tiles 0..kMTiles-1 at k-step kk.
template <bool kTransposed, int kMTiles, typename Operand>
__device__ __forceinline__ void load_a_fragments(uint32_t (&a)[kMTiles][4], const Operand& op, int kk) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    if constexpr (!kTransposed)
      ldmatrix_x4(a[mt], op.at(mt * 16, kk * 2));
    else
      ldmatrix_x4_trans(a[mt], op.at(kk * 16, mt * 2));
  }
}

// B fragments of n-tiles 2np and 2np+1 at k-step kk: b[0], b[1] for the first, b[2], b[3] for
// the second.
template <bool kTransposed, typename Operand>
__device__ __forceinline__ void load_b_pair(uint32_t (&b)[4], const Operand& op, int np, int kk) {
  if constexpr (!kTransposed)
    ldmatrix_x4(b, op.at(np * 16, kk * 2));
  else
    ldmatrix_x4_trans(b, op.at(kk * 16, np * 2));
}

template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void mma_pair(float (&acc)[kMTiles][kNTiles][4], const uint32_t (&a)[kMTiles][4],
                                         const uint32_t (&b)[4], int np) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    MmaOp<T>::run(acc[mt][2 * np], a[mt], b[0], b[1]);
    MmaOp<T>::run(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
  }
}

// Both operands from shared memory: A at rows m0 of its tile, B at rows n0 of its.
template <typename ATile, bool kATransposed, typename BTile, bool kBTransposed, int kSteps,
          int kMTiles, int kNTiles, typename T>
__device__ __forceinline__ void warp_gemm(float (&acc)[kMTiles][kNTiles][4], const T* a_tile, int a_m0,
                                          const T* b_tile, int b_n0, int lane) {
  static_assert(kNTiles % 2 == 0, "B fragments come in pairs of n-tiles");
  const auto a_op = a_operand<ATile, kATransposed, kMTiles>(a_tile, a_m0, lane);
  const auto b_op = b_operand<BTile, kBTransposed, kNTiles>(b_tile, b_n0, lane);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    uint32_t a[kMTiles][4];
    load_a_fragments<kATransposed>(a, a_op, kk);
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      load_b_pair<kBTransposed>(b, b_op, np, kk);
      mma_pair<T>(acc, a, b, np);
    }
  }
}

// A from registers (a[kk][mt]: k-step kk of m-tile mt), B from shared memory at rows n0.
template <typename BTile, bool kBTransposed, int kSteps, int kMTiles, int kNTiles, typename T>
__device__ __forceinline__ void warp_gemm_a_regs(float (&acc)[kMTiles][kNTiles][4],
                                                 const uint32_t (&a)[kSteps][kMTiles][4], const T* b_tile,
                                                 int b_n0, int lane) {
  static_assert(kNTiles % 2 == 0, "B fragments come in pairs of n-tiles");
  const auto b_op = b_operand<BTile, kBTransposed, kNTiles>(b_tile, b_n0, lane);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      load_b_pair<kBTransposed>(b, b_op, np, kk);
      mma_pair<T>(acc, a[kk], b, np);
    }
}

}  // namespace jax_flash::cuda
