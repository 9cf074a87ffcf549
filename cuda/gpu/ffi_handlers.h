// XLA FFI handler symbols of the CUDA kernels (platform "CUDA").
#pragma once

#include "xla/ffi/api/api.h"

namespace jax_flash {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaFlashFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaFlashBwd);

}  // namespace jax_flash
