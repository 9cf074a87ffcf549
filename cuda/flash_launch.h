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
// Compute capability major of the current device (0 if CUDA cannot say).
int device_compute_major();

// Backward: dq, dk, dv, using params.delta and params.dq_accum (batch, seq_q, heads_q, head_dim
// floats) as workspaces the caller owns.
cudaError_t launch_flash_bwd(const BwdParams& params, cudaStream_t stream);
// The Hopper (wgmma) main backward kernel, opt-in with JAX_FLASH_CUDA_BACKWARD=sm90 on compute
// capability 9.x for head dims 33..128 (flash_bwd_sm90.cu); the prepare/convert/dQ kernels stay.
bool sm90_backward_applies(const BwdParams& params);
cudaError_t launch_flash_bwd_main_sm90(const BwdParams& params, cudaStream_t stream);

}  // namespace jax_flash::cuda
