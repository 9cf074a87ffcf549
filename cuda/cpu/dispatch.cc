// Picks the CPU kernel variant for the running processor, and provides the per-thread scratch
// memory the kernels use (kept here, out of the per-ISA files; see kernels.h).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>

#include "common/attention_params.h"
#include "common/mask.h"
#include "cpu/kernels.h"

#if JF_HAVE_BF16_VARIANTS
#include <cpuid.h>
#endif
#if JF_HAVE_BF16_VARIANTS && defined(__linux__)
#include <sys/syscall.h>
#endif
#if defined(__unix__)
#include <unistd.h>  // sysconf
#endif

// The per-ISA entry points (kernels_isa.cc), declared by the variants CMake built.
#define JF_DECLARE_VARIANT(isa)                                        \
  namespace jax_flash::cpu::isa {                                      \
  void flash_fwd(const FwdParams& params, const TaskRunner& runner);   \
  void flash_bwd(const BwdParams& params, const TaskRunner& runner);   \
  float fma_loop(int64_t iters);                                       \
  int fma_loop_flops_per_iter();                                       \
  }
JF_DECLARE_VARIANT(baseline)
#if JF_HAVE_X86_VARIANTS
JF_DECLARE_VARIANT(avx2)
JF_DECLARE_VARIANT(avx512)
#endif
#if JF_HAVE_BF16_VARIANTS
JF_DECLARE_VARIANT(avx512_amx)
JF_DECLARE_VARIANT(avx512_bf16)
#endif

namespace jax_flash::cpu {
namespace {

struct Variant {
  const char* name;
  void (*fwd)(const FwdParams&, const TaskRunner&);
  void (*bwd)(const BwdParams&, const TaskRunner&);
  float (*fma_loop)(int64_t);
  int (*fma_flops_per_iter)();
};

#if JF_HAVE_BF16_VARIANTS
// Whether the CPU has AVX512-BF16 (CPUID leaf 7, subleaf 1, EAX bit 5; read directly, as
// compilers' __builtin_cpu_supports name it differently or not at all). Its state is the
// AVX-512 state the avx512 checks already cover.
bool cpu_has_avx512_bf16() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5));
}

// Whether avx512_bf16's bfloat16 products (vdpbf16ps: two products a lane) outrun avx512's
// float32 ones on bfloat16 inputs: on AMD's AVX-512 cores (Zen 4 and 5) vdpbf16ps issues at the
// float32 FMA's rate, so it does twice the products. Session 21, a 2-core Zen 4 EPYC, bf16
// inputs beside avx512 (PERF_NOTES CPU v3.4): fwd 1.5-2.0x, fwd+bwd 1.2-1.4x. On the one Intel
// CPU measured (an AMX Xeon, its tiles unused) it was slower (PERF_NOTES CPU v3).
bool bf16_products_preferred() { return cpu_has_avx512_bf16() && __builtin_cpu_is("amd"); }

// Whether this process may run the avx512_amx variant: the CPU has AMX tiles with bfloat16
// products (and avx512_bf16, for the conversions beside them), the OS saves the tile state
// (XCR0 bits 17-18), and Linux granted this process the tile data (ARCH_REQ_XCOMP_PERM; without
// it the first tile instruction faults). Asked once per process.
bool amx_bf16_usable() {
#if defined(__linux__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
  if (!amx_bf16 || !amx_tile || !cpu_has_avx512_bf16()) return false;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE
  uint32_t xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

// The variants this CPU can run, best first.
int supported_variants(Variant* out) {
  int n = 0;
#if JF_HAVE_X86_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
#if JF_HAVE_BF16_VARIANTS
    static const bool amx = amx_bf16_usable();
    if (amx)
      out[n++] = {"avx512_amx", avx512_amx::flash_fwd, avx512_amx::flash_bwd, avx512_amx::fma_loop,
                  avx512_amx::fma_loop_flops_per_iter};
#endif
#if JF_HAVE_BF16_VARIANTS
    // avx512_bf16 above avx512 where its products are the faster (bf16_products_preferred: AMD),
    // else below it, so that only JAX_FLASH_CPU_ISA picks it: on an AMX Xeon, its tiles unused,
    // its bfloat16 kernels ran at fwd+bwd 156-186 GFLOP/s, avx512's (converting to float32) at
    // 227-268 (PERF_NOTES CPU v3). Its float32 kernels are avx512's.
    const Variant bf16 = {"avx512_bf16", avx512_bf16::flash_fwd, avx512_bf16::flash_bwd, avx512_bf16::fma_loop,
                          avx512_bf16::fma_loop_flops_per_iter};
    static const bool bf16_first = bf16_products_preferred();
    if (bf16_first) out[n++] = bf16;
#endif
    out[n++] = {"avx512", avx512::flash_fwd, avx512::flash_bwd, avx512::fma_loop,
                avx512::fma_loop_flops_per_iter};
#if JF_HAVE_BF16_VARIANTS
    if (!bf16_first && cpu_has_avx512_bf16()) out[n++] = bf16;
#endif
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    out[n++] = {"avx2", avx2::flash_fwd, avx2::flash_bwd, avx2::fma_loop,
                avx2::fma_loop_flops_per_iter};
#endif
  out[n++] = {"baseline", baseline::flash_fwd, baseline::flash_bwd, baseline::fma_loop,
              baseline::fma_loop_flops_per_iter};
  return n;
}

// The best variant, or the one JAX_FLASH_CPU_ISA names if this CPU supports it (for testing
// every variant on one machine).
Variant detect() {
  Variant variants[5];
  const int n = supported_variants(variants);
  if (const char* wanted = std::getenv("JAX_FLASH_CPU_ISA"))
    for (int i = 0; i < n; ++i)
      if (std::strcmp(wanted, variants[i].name) == 0) return variants[i];
  return variants[0];
}

const Variant& variant() {
  static const Variant v = detect();
  return v;
}

// Narrow calls (common/mask.h narrow_shape) never take the 16-bit products of P and dS
// (avx512_amx's tiles, avx512_bf16's vdpbf16ps: the same rounding) but avx512's float32 ones: on
// rows of a few keys the rounding of P and dS put dq/dk past the accuracy rule (issue 13; the
// seed-0 differential run's [1084], rows of one key at head dim 256, bfloat16: dq and dk at
// 2.63x the bound on avx512_amx, within it on avx512).
Variant detect_for_narrow_calls() {
  const Variant& chosen = variant();
  if (std::strcmp(chosen.name, "avx512_amx") != 0 && std::strcmp(chosen.name, "avx512_bf16") != 0) return chosen;
  Variant variants[5];
  const int n = supported_variants(variants);
  for (int i = 0; i < n; ++i)
    if (std::strcmp(variants[i].name, "avx512") == 0) return variants[i];
  return chosen;
}

const Variant& variant_for(const AttentionParams& p) {
  static const Variant narrow = detect_for_narrow_calls();
  return narrow_shape(p.mask, p.shape.seq_q, p.shape.seq_k) ? narrow : variant();
}

// One core's L2 in bytes, 0 where the C library cannot tell.
int64_t l2_bytes() {
#ifdef _SC_LEVEL2_CACHE_SIZE
  const long bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return bytes > 0 ? bytes : 0;
#else
  return 0;
#endif
}

}  // namespace

float* thread_scratch(int64_t count) {
  // Cache-line aligned, grown on demand, freed when the thread ends.
  struct Buffer {
    float* data = nullptr;
    int64_t size = 0;
    ~Buffer() { ::operator delete[](data, std::align_val_t{64}); }
  };
  thread_local Buffer buffer;
  if (buffer.size < count) {
    ::operator delete[](buffer.data, std::align_val_t{64});
    buffer.data = static_cast<float*>(::operator new[](count * sizeof(float), std::align_val_t{64}));
    buffer.size = count;
  }
  return buffer.data;
}

void flash_fwd(const FwdParams& params, const TaskRunner& runner) { variant_for(params).fwd(params, runner); }

int bwd_key_blocks_in_step(int64_t key_tile_bytes) {
  if (const char* wanted = std::getenv("JAX_FLASH_CPU_BWD_KEY_BLOCKS")) {
    const int n = std::atoi(wanted);
    if (n >= 1 && n <= kMaxBwdKeyBlocksInStep) return n;
  }
  // Key blocks whose tiles outgrow L2 would each be read from L3 at every visit, as the query side
  // was before they walked together: a 1 MiB L2 (Zen 4) holds eight bfloat16 ones at head dim
  // 128 and five float32 ones, a 512 KiB L2 (Zen 3) two float32 ones.
  static const int64_t l2 = l2_bytes();
  if (l2 <= 0 || key_tile_bytes <= 0) return kMaxBwdKeyBlocksInStep;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxBwdKeyBlocksInStep, l2 / key_tile_bytes)));
}

void flash_bwd(const BwdParams& params, const TaskRunner& runner) { variant_for(params).bwd(params, runner); }
const char* kernel_isa() { return variant().name; }

double fma_peak_gflops(double seconds) {
  using Clock = std::chrono::steady_clock;
  const Variant& v = variant();
  volatile float sink = v.fma_loop(1 << 12);  // warm up (and let the clock ramp)
  // Grow the round count until one run lasts `seconds`, then report that run's rate.
  for (int64_t iters = 1 << 14;; iters *= 2) {
    const auto start = Clock::now();
    sink = sink + v.fma_loop(iters);
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (elapsed >= seconds || iters >= (int64_t{1} << 40))
      return static_cast<double>(iters) * v.fma_flops_per_iter() / elapsed * 1e-9;
  }
}

}  // namespace jax_flash::cpu
