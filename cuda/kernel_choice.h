// Which CUDA kernel runs each pass. On Hopper (compute capability 9.x) head dims 33..128 (padded
// to 64 or 128) run the wgmma kernels, everything else the mma.sync (sm80) ones. Two environment
// variables, read once per process, override the choice for experiments and comparisons:
//   JAX_FLASH_CUDA_FORWARD  = sm80 | sm90                    (default on Hopper: sm90)
//   JAX_FLASH_CUDA_BACKWARD = sm80 | sm90                    (default on Hopper: sm90)
// A Hopper choice only applies where a Hopper kernel exists.
#pragma once

#include <string>

#include "attention_params.h"

namespace jax_flash::cuda {

// The kernel family of a pass: mma.sync (sm80) or wgmma (sm90).
enum class KernelFamily { kSm80, kSm90 };

// Empty when the variables are unset or hold a known value; else a message naming the variable,
// its value and the values it takes (the FFI handlers return it as an error).
const std::string& kernel_override_error();

KernelFamily forward_kernel(const FwdParams& params);
KernelFamily backward_kernel(const BwdParams& params);

// Compute capability major of the current device (0 if CUDA cannot say).
int device_compute_major();

}  // namespace jax_flash::cuda
