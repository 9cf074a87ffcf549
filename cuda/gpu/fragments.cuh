// Register fragments both CUDA families share: mma.sync's m16n8 accumulator layout is also each
// warp's part of a wgmma accumulator, and its A-operand layout is wgmma's register A operand
// (gpu/ptx.cuh documents the layouts).
#pragma once

#include <cstdint>

#include "gpu/ptx.cuh"

namespace jax_flash::cuda {

// x <- x - r16(x): what rounding to the 16-bit type T leaves out, so that a value enters a
// product as two 16-bit operands, hi = r16(x) and lo = r16(x - hi) (about float32's precision).
template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void subtract_rounded(float (&x)[kMTiles][kNTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const float2 rounded = unpack_pair<T>(MmaOp<T>::pack(x[mt][nt][e], x[mt][nt][e + 1]));
        x[mt][nt][e] -= rounded.x;
        x[mt][nt][e + 1] -= rounded.y;
      }
}

// The A operand (16-bit pairs) of an accumulator: columns 16kk..16kk+15 of each m-tile.
template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void accumulator_to_a(uint32_t (&a)[kNTiles / 2][kMTiles][4],
                                                 const float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      a[nt / 2][mt][(nt % 2) * 2 + 0] = MmaOp<T>::pack(acc[mt][nt][0], acc[mt][nt][1]);
      a[nt / 2][mt][(nt % 2) * 2 + 1] = MmaOp<T>::pack(acc[mt][nt][2], acc[mt][nt][3]);
    }
}

}  // namespace jax_flash::cuda
