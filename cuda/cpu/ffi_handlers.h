// XLA FFI handler symbols of the CPU kernels (platform "cpu").
#pragma once

#include "xla/ffi/api/api.h"

namespace jax_flash {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuFlashFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuFlashBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuFlashDecode);  // split-KV decode, contiguous K/V
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuFlashPaged);   // split-KV decode, paged K/V

}  // namespace jax_flash
