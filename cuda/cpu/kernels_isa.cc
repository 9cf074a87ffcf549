// One instruction-set variant of the CPU kernels. CMake compiles this file once per variant, with
// JF_ISA = avx512_amx / avx512_bf16 / avx512 / avx2 / baseline, JF_SIMD_LANES = 16 / 16 / 16 / 8
// / 4 and the matching -m flags (avx512_amx and avx512_bf16: JF_BF16_PRODUCTS, bfloat16 inputs'
// products on bfloat16 tiles, with JF_AMX on AMX); the
// dispatcher (dispatch.cc) calls the variant the running CPU supports.
#include "cpu/flash_bwd.h"
#include "cpu/flash_fwd.h"
#include "cpu/kernels.h"
#if JF_BF16_PRODUCTS
#include "cpu/bf16_bwd_products.h"
#include "cpu/bf16_fwd_products.h"
#endif

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
#if JF_BF16_PRODUCTS
// bfloat16 forwards take their products on bfloat16 tiles (AMX or vdpbf16ps).
template <>
struct Fwd<BFloat16> {
  static void run(const FwdParams& p, const TaskRunner& r) {
    flash_fwd_typed<BFloat16, Bf16FwdProducts>(p, r);
  }
};
#endif
template <typename T>
struct Bwd {
  static void run(const BwdParams& p, const TaskRunner& r) { flash_bwd_typed<T>(p, r); }
};
#if JF_BF16_PRODUCTS
// And their backwards.
template <>
struct Bwd<BFloat16> {
  static void run(const BwdParams& p, const TaskRunner& r) {
    flash_bwd_typed<BFloat16, Bf16BwdProducts>(p, r);
  }
};
#endif

// The FMA peak micro-benchmark's loop: kChains independent chains of vector FMAs (enough to
// cover two FMA pipes' latency on every x86 core we know: 2 x 4 to 2 x 5 in flight), `iters`
// rounds. Returns a value that depends on every chain so nothing is optimised away; the caller
// counts iters * kChains * kLanes * 2 FLOPs.
inline constexpr int kFmaChains = 12;
float fma_loop(int64_t iters) {
  Vec acc[kFmaChains];
#pragma GCC unroll 16
  for (int i = 0; i < kFmaChains; ++i) acc[i] = splat(1.f + i * 1e-3f);
  const Vec m = splat(0.999999f), c = splat(1e-6f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kFmaChains; ++i) {
      acc[i] = acc[i] * m + c;
      __asm__ volatile("" : "+x"(acc[i]));  // keep each chain a real FMA every round
    }
  }
  Vec sum = Vec{};
#pragma GCC unroll 16
  for (int i = 0; i < kFmaChains; ++i) sum += acc[i];
  return reduce_sum(sum);
}
int fma_loop_flops_per_iter() { return kFmaChains * kLanes * 2; }

void flash_fwd(const FwdParams& params, const TaskRunner& runner) { run_typed<Fwd>(params, runner); }
void flash_bwd(const BwdParams& params, const TaskRunner& runner) { run_typed<Bwd>(params, runner); }

}  // namespace jax_flash::cpu::JF_ISA
