// The CPU split-KV decode forward (contiguous and paged K/V): its entry point for the FFI
// handlers. Compiled once per instruction set like the other kernels (decode_isa.cc);
// flash_decode runs the variant the tiled kernels run (kernel_isa()).
#pragma once

#include "common/decode_params.h"
#include "cpu/kernels.h"

namespace jax_flash::cpu {

void flash_decode(const DecodeParams& params, const TaskRunner& runner);

}  // namespace jax_flash::cpu
