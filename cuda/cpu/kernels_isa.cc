// One instruction-set variant of the CPU kernels. CMake compiles this file three times, with
// JF_ISA = avx512 / avx2 / baseline, JF_SIMD_LANES = 16 / 8 / 4 and the matching -m flags; the
// dispatcher (dispatch.cc) calls the variant the running CPU supports.
#include "cpu/flash_bwd.h"
#include "cpu/flash_fwd.h"
#include "cpu/kernels.h"

namespace jax_flash::cpu::JF_ISA {

template <template <typename> class Kernel, typename Params>
void run_typed(const Params& params, const TaskRunner& runner) {
  switch (params.dtype) {
    case Dtype::kFloat32: return Kernel<float>::run(params, runner);
    case Dtype::kBFloat16: return Kernel<BFloat16>::run(params, runner);
    case Dtype::kFloat16: return Kernel<_Float16>::run(params, runner);
  }
}

template <typename T>
struct Fwd {
  static void run(const FwdParams& p, const TaskRunner& r) { flash_fwd_typed<T>(p, r); }
};
template <typename T>
struct Bwd {
  static void run(const BwdParams& p, const TaskRunner& r) { flash_bwd_typed<T>(p, r); }
};

void flash_fwd(const FwdParams& params, const TaskRunner& runner) { run_typed<Fwd>(params, runner); }
void flash_bwd(const BwdParams& params, const TaskRunner& runner) { run_typed<Bwd>(params, runner); }

}  // namespace jax_flash::cpu::JF_ISA
