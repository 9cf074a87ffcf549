// TMA descriptors (CUtensorMap) of the attention arrays, made on the host at launch time and
// passed to the kernels as __grid_constant__ parameters (safe under CUDA-graph capture: they
// are copied into the launch like any parameter).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/attention_params.h"

namespace jax_flash::cuda {

// The descriptor of a (batch, seq, heads, head_dim) array of 16-bit `dtype` at `base`, read in
// boxes of `rows` sequence rows x 64 head-dim columns of one head of one batch element, written
// to shared memory with the 128-byte swizzle (sm90/gmma_tile.cuh's layout: a box is one
// 64-column block of a GmmaTile). Reads past seq or head_dim give zeros.
cudaError_t make_head_tensor_map(CUtensorMap* map, const void* base, Dtype dtype, int64_t batch, int64_t seq,
                                 int64_t heads, int64_t head_dim, int rows);

// The descriptor of a 16-bit bias array (AttentionParams::bias, where gpu/logit_arrays.cuh
// bias_stages holds and its rows are not broadcast), read in boxes of `rows` query rows x 64 keys
// of one (head, batch element) slice into a GmmaTile's 64-key blocks (the 128-byte swizzle). Dims
// innermost first: keys, heads, query rows, batch elements, a broadcast dim of extent 1 (its
// coordinate 0: logit_arrays.cuh bias_slice). Reads past seq_q or seq_k give zeros.
// cudaErrorNotSupported where the bias has no such descriptor.
cudaError_t make_bias_tensor_map(CUtensorMap* map, const AttentionParams& p, int rows);

// The descriptors of q (boxes of q_rows rows), k and v (kv_rows rows; v at its head dim Hv) of a pass.
cudaError_t make_qkv_tensor_maps(const AttentionParams& p, int q_rows, int kv_rows, CUtensorMap* q, CUtensorMap* k,
                                 CUtensorMap* v);

}  // namespace jax_flash::cuda
