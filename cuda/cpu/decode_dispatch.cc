// Runs the decode kernel's variant for the instruction set the tiled kernels run here
// (kernel_isa(), chosen in dispatch.cc, JAX_FLASH_CPU_ISA included).
#include <cstring>

#include "cpu/decode.h"

#define JF_DECLARE_DECODE_VARIANT(isa)                                     \
  namespace jax_flash::cpu::isa {                                          \
  void flash_decode(const DecodeParams& params, const TaskRunner& runner); \
  }
JF_DECLARE_DECODE_VARIANT(baseline)
#if JF_HAVE_X86_VARIANTS
JF_DECLARE_DECODE_VARIANT(avx2)
JF_DECLARE_DECODE_VARIANT(avx512)
#endif

namespace jax_flash::cpu {
namespace {

using DecodeFn = void (*)(const DecodeParams&, const TaskRunner&);

DecodeFn detect() {
#if JF_HAVE_X86_VARIANTS
  // avx512_amx's and avx512_bf16's bfloat16 tiles serve the tiled kernels' products; decoding is
  // their avx512 kernel.
  if (std::strncmp(kernel_isa(), "avx512", 6) == 0) return avx512::flash_decode;
  if (std::strcmp(kernel_isa(), "avx2") == 0) return avx2::flash_decode;
#endif
  return baseline::flash_decode;
}

}  // namespace

void flash_decode(const DecodeParams& params, const TaskRunner& runner) {
  static const DecodeFn fn = detect();
  fn(params, runner);
}

}  // namespace jax_flash::cpu
