// Host-side launchers of the CUDA kernels (flash_{fwd,bwd}_sm{80,90}.cu).
#pragma once

#include <cuda_runtime.h>

#include "attention_params.h"

namespace jax_flash::cuda {

// The kernels are compiled for head dims 32, 64, 128, 192 and 256 (flash_dispatch.cuh); inputs
// are padded by the caller to a multiple of 8 and run on the smallest that holds them.

// Forward: o and lse. The launch shape comes from the shapes alone (CUDA-graph safe). Which
// kernel runs (mma.sync, or wgmma on Hopper: flash_fwd_sm90.cu) is kernel_choice.h's rule.
cudaError_t launch_flash_fwd(const FwdParams& params, cudaStream_t stream);
cudaError_t launch_flash_fwd_sm90(const FwdParams& params, cudaStream_t stream);

// Backward: dq, dk, dv, using params.delta and params.dq_accum (batch, seq_q, heads_q, head_dim
// floats) as workspaces the caller owns.
cudaError_t launch_flash_bwd(const BwdParams& params, cudaStream_t stream);
// The Hopper (wgmma) main backward kernel (flash_bwd_sm90.cu), where kernel_choice.h picks it;
// the prepare / convert / deterministic dQ kernels are the sm80 ones on every GPU.
cudaError_t launch_flash_bwd_main_sm90(const BwdParams& params, cudaStream_t stream);

}  // namespace jax_flash::cuda
