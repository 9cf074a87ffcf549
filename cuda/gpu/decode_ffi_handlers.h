// XLA FFI handler symbols of the CUDA split-KV decode (platform "CUDA"): contiguous and paged.
#pragma once

#include "xla/ffi/api/api.h"

namespace jax_flash {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaFlashDecode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaFlashPaged);

}  // namespace jax_flash
