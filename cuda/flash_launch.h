// Host-side launchers of the CUDA kernels (flash_fwd_sm80.cu, flash_bwd_sm80.cu).
#pragma once

#include <cuda_runtime.h>

#include "attention_params.h"

namespace jax_flash::cuda {

// The kernels are compiled for head dims 32, 64, 128, 192 and 256 (flash_dispatch.cuh); inputs
// are padded by the caller to a multiple of 8 and run on the smallest that holds them.

// Forward: o and lse. The launch shape comes from the shapes alone (CUDA-graph safe). On Hopper
// (compute capability 9.x) head dims 33..128 run the wgmma kernel (flash_fwd_sm90.cu), others the
// mma.sync one.
cudaError_t launch_flash_fwd(const FwdParams& params, cudaStream_t stream);
bool sm90_forward_applies(const FwdParams& params);
cudaError_t launch_flash_fwd_sm90(const FwdParams& params, cudaStream_t stream);

// Backward: dq, dk, dv, using params.delta and params.dq_accum (batch, seq_q, heads_q, head_dim
// floats) as workspaces the caller owns.
cudaError_t launch_flash_bwd(const BwdParams& params, cudaStream_t stream);

}  // namespace jax_flash::cuda
