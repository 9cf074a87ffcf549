// Host-side face of the CUDA split-KV decode (flash-decoding with pack-GQA; contiguous or paged
// K/V; common/decode_params.h has the contract it shares with the CPU kernel). The kernel is
// gpu/flash_decode_kernel.cuh, its launcher gpu/flash_decode.cu, its FFI handlers
// gpu/decode_ffi_handlers.cc. Launch shapes come from shapes and attributes alone (graph-safe).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/decode_params.h"

namespace jax_flash::cuda {

// Packed query rows (T x G rows of the G query heads sharing a kv head) per CTA: one m16 tile
// of mma.sync. A kv head with more packed rows takes several CTAs per key chunk, each reading
// the chunk's K/V (from L2 after the first).
inline constexpr int64_t kDecodeRowsPerCta = 16;
// Keys per shared-memory block: 16 for each of the CTA's 4 warps.
inline constexpr int64_t kDecodeBlockN = 64;
// The largest head dim the decode kernel is compiled for (every head dim of the CUDA forward).
inline constexpr int64_t kDecodeMaxHeadDim = 256;

inline int64_t decode_row_tiles(const AttentionShape& shape) {
  return (shape.seq_q * shape.group() + kDecodeRowsPerCta - 1) / kDecodeRowsPerCta;
}

// CTAs of the split kernel: one per (batch, kv head, key chunk, tile of packed rows); a 1-D grid.
inline int64_t decode_split_ctas(const AttentionShape& shape, int64_t num_splits) {
  return shape.batch * shape.heads_k * num_splits * decode_row_tiles(shape);
}

// Rows the combine kernel merges (one warp each, 4 warps a CTA).
inline constexpr int64_t kDecodeCombineRowsPerCta = 4;
inline int64_t decode_combine_ctas(const AttentionShape& shape) {
  return (shape.batch * shape.heads_q * shape.seq_q + kDecodeCombineRowsPerCta - 1) / kDecodeCombineRowsPerCta;
}

// Runs the split kernel and, with num_splits > 1, the combine kernel on `stream`: o and lse
// (and the workspaces in between). bfloat16/float16, head dim a multiple of 8 up to
// kDecodeMaxHeadDim; cudaErrorInvalidValue otherwise.
cudaError_t launch_flash_decode(const DecodeParams& params, cudaStream_t stream);

}  // namespace jax_flash::cuda
