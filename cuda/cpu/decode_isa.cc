// One instruction-set variant of the CPU decode kernel (see kernels_isa.cc: CMake compiles this
// file once per JF_ISA with the matching flags; decode_dispatch.cc picks the variant).
#include "cpu/flash_decode.h"

namespace jax_flash::cpu::JF_ISA {

void flash_decode(const DecodeParams& params, const TaskRunner& runner) {
  switch (params.dtype) {
    case Dtype::kFloat32: return flash_decode_typed<float>(params, runner);
    case Dtype::kBFloat16: return flash_decode_typed<BFloat16>(params, runner);
    case Dtype::kFloat16: return flash_decode_typed<_Float16>(params, runner);
  }
}

}  // namespace jax_flash::cpu::JF_ISA
