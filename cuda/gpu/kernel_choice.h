// Which CUDA kernel family runs each pass. On Hopper (compute capability 9.x) the wgmma (sm90)
// family, wherever gpu/tile_shapes.cuh has a wgmma kernel for the head dim; the mma.sync (sm80)
// family everywhere else. Two environment variables, read once per process, override the choice
// for experiments and comparisons:
//   JAX_FLASH_CUDA_FORWARD  = sm80 | sm90 | sm90ws | sm90ws_grid | sm90ws_m192
//                                                                  (default on Hopper: sm90ws)
//   JAX_FLASH_CUDA_BACKWARD = sm80 | sm90 | sm90ws | sm90ws_bulkdq  (default on Hopper: sm90)
// sm90ws is the warp-specialised TMA forward on a persistent grid, sm90ws_grid the same kernel
// with a CTA per tile; sm90ws_m192 the persistent one with 192-row tiles (3 consumer warpgroups)
// at head dim 64 (experimental, not yet run on a GPU); sm90 the first wgmma forward (all
// threads load and compute). For the
// backward, sm90ws is the sm90 main kernel with its loads moved to a TMA producer warpgroup,
// sm90ws_bulkdq the same with dQ added by bulk reductions from shared memory (experimental: not
// yet run on a GPU).
// A Hopper choice only applies on Hopper, and only where a Hopper kernel exists.
#pragma once

#include <string>

namespace jax_flash::cuda {

// The kernel family of a pass: mma.sync (sm80), wgmma (sm90), or the warp-specialised wgmma
// forward on a persistent grid, on a CTA per tile, or with wide tiles (sm90ws, sm90ws_grid,
// sm90ws_m192); for the backward sm90ws and sm90ws_bulkdq.
enum class KernelFamily { kSm80, kSm90, kSm90Ws, kSm90WsGrid, kSm90WsWide, kSm90WsBulkDq };

// Empty when the variables are unset or hold a known value; else a message naming the variable,
// its value and the values it takes (the FFI handlers return it as an error).
const std::string& kernel_override_error();

// The family each pass prefers on the current device (gpu/launch.cu falls back to sm80 where the
// family has no kernel for the head dim).
KernelFamily forward_family();
KernelFamily backward_family();

// Compute capability major of the current device (0 if CUDA cannot say).
int device_compute_major();
// Streaming multiprocessors of the current device (0 if CUDA cannot say).
int device_sm_count();

}  // namespace jax_flash::cuda
