// XLA FFI handler symbols of the CPU kernels (platform "cpu").
#pragma once

#include "xla/ffi/api/api.h"

namespace jax_flash {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuFlashFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuFlashBwd);

}  // namespace jax_flash
