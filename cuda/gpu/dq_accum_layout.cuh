// The row-major float32 dQ accumulator's column order where a backward kernel adds dQ by atomics
// (the Hopper kernels' sm90/bwd_steps.cuh add_dq, the mma.sync kernel's sm80/flash_bwd_kernel.cuh;
// read back by gpu/bwd_postprocess.cuh).
//
// A wgmma accumulator, like an m16n8 mma.sync one, gives a thread two adjacent columns an 8-column
// tile (2 (lane % 4) and + 1, rows lane / 4 and + 8), so row-major columns take one 8-byte atomic
// a tile and row. The "quad"
// order stores each 16-column group's two tiles interleaved by thread: logical column
// 16 g + 8 h + 2 c + e sits at 16 g + 4 c + 2 h + e, so a thread's pairs of tiles 2j and 2j + 1
// are four consecutive floats, one 16-byte atomic (red.global.add.v4.f32, sm_90) instead of two.
#pragma once

#include <cstdint>

#include "gpu/ptx.cuh"

namespace jax_flash::cuda {

// Whether the accumulator at `accum` for this head dim is in the quad order: 16-byte aligned
// quads need whole 16-column groups and a 16-byte aligned base. The main kernel and the convert
// decide by this one rule.
__host__ __device__ __forceinline__ bool dq_accum_in_quads(const float* accum, int64_t head_dim) {
  return head_dim % 16 == 0 && reinterpret_cast<uintptr_t>(accum) % 16 == 0;
}

// Whether this compilation of the mma.sync backward can write the quad order (BwdParams::dq_quads):
// its sm_90a build, whose 16-byte atomics it is for. The sm_80 build keeps the row-major order
// alone (both orders' code cost its head-dim-128 kernel 32 bytes of spills there, for no gain:
// sm_80 has no 16-byte atomics). The kernels are SASS for sm_80 and sm_90a alone (no PTX,
// gpu/cuda_build.cmake), so the sm_90a build is the one that runs on a device of compute
// capability 9, which is what gpu/launch.cu asks before it sets dq_quads.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
inline constexpr bool kQuadOrderBuild = true;
#else
inline constexpr bool kQuadOrderBuild = false;
#endif

// Where logical column `logical` (8 h + 2 c + e) of a 16-column group sits: 4 c + 2 h + e.
__host__ __device__ constexpr int quad_physical_column(int logical) {
  return logical % 8 / 2 * 4 + logical / 8 * 2 + logical % 2;
}
static_assert(quad_physical_column(0) == 0 && quad_physical_column(1) == 1 && quad_physical_column(8) == 2 &&
                  quad_physical_column(2) == 4 && quad_physical_column(15) == 15,
              "a thread's pairs of tiles 2j and 2j + 1 side by side");

// Adds one half (rows lane / 4 + 8 half) of a thread's kNTiles accumulator n-tiles (frag[nt][2 half]
// and [2 half + 1]: columns 8 nt + 2 (lane % 4) and + 1) to the accumulator, `at` being the
// thread's first float of the tiles' row (2 (lane % 4) past their start in row-major order, 4
// (lane % 4) in the quad order) and `col0` the tiles' first column, the tiles from `live_cols`
// columns on skipped: in the quad order
// by 16-byte atomics (kQuads), else row-major by 8-byte ones. Both families' dQ atomics
// (sm90/bwd_steps.cuh add_dq, sm80/flash_bwd_kernel.cuh), each choosing the order where its loops
// had it (the same SASS as before the helper).
template <bool kQuads, int kNTiles>
__device__ __forceinline__ void add_fragment_half(float* at, const float (&frag)[kNTiles][4], int half, int col0,
                                                  int live_cols) {
  if constexpr (kQuads) {
    static_assert(kNTiles % 2 == 0, "whole 16-column groups");
#pragma unroll
    for (int j = 0; j < kNTiles / 2; ++j)
      if (col0 + j * 16 < live_cols)
        atomic_add_quad(at + (col0 + j * 16), frag[2 * j][2 * half], frag[2 * j][2 * half + 1], frag[2 * j + 1][2 * half],
                        frag[2 * j + 1][2 * half + 1]);
  } else {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
      if (col0 + nt * 8 < live_cols) atomic_add_pair(at + (col0 + nt * 8), frag[nt][2 * half], frag[nt][2 * half + 1]);
  }
}

}  // namespace jax_flash::cuda
