// Hopper (sm_90a) warpgroup MMA: wgmma.mma_async wrappers, shared-memory matrix descriptors, and
// the fences that order them. Only meaningful in code compiled for sm_90a (the callers guard
// their bodies with JF_SM90A, defined below).
//
// A warpgroup (4 consecutive warps, the first a multiple of 4) computes D[64 x N] (+)= A[64 x 16]
// * B[16 x N]. Accumulator fragments d[j][e] (j < N/8): rows 16 w + lane/4 (+8 for e >= 2) of
// warp w of the group, columns 8 j + 2 (lane % 4) + e % 2 -- the mma.sync m16n8 layout repeated
// along N. A from registers uses the mma.sync m16n8k16 A layout (accumulator_to_a makes it).
//
// Shared operands use the 128-byte swizzle: rows of 64 16-bit elements (128 B) in blocks of
// 8 rows (1 KiB), the 16-byte chunk c of row r stored at chunk c ^ (r % 8), tiles 1 KiB aligned
// (GmmaTile in sm90/gmma_tile.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JF_SM90A 1
#else
#define JF_SM90A 0
#endif

namespace jax_flash::cuda {

// A shared-memory matrix descriptor with 128-byte swizzling. `address` is the shared address of
// the operand's first element; `leading` and `stride` are byte offsets: for a K-major operand the
// stride is between 8-row groups (the leading offset is unused); for an MN-major one the leading
// offset is between 64-element column blocks and the stride between 8-row (k) groups.
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t address, uint32_t leading, uint32_t stride) {
  constexpr uint64_t kSwizzle128B = 1;
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((leading & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((stride & 0x3FFFF) >> 4) << 32 | kSwizzle128B << 62;
}

// The descriptor `desc` moved `bytes` (a multiple of 16) further into shared memory: its start
// address field (bits 0-13, in 16-byte units) plus bytes / 16, which never carries into the next
// field (shared addresses are below 256 KiB), so it equals the descriptor made at that address.
// A tile's descriptor is made once per issue and moved per k-step (an add), where making each
// one anew cost about a dozen instructions a product in every warp (session 18's SASS: ~190 of
// the forward's ~600 a key block).
__device__ __forceinline__ uint64_t descriptor_at(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }
// `desc` as made where it is used, for an operand that stays put across the caller's loop (the
// forward's Q, the backward's K and V): the compiler may not hoist it and the k-steps'
// descriptors derived from it out of the loop, where a head dim's worth of them held 16-32
// registers and the larger kernels spilled (session 18, ptxas).
__device__ __forceinline__ uint64_t made_here(uint64_t desc) {
  asm volatile("" : "+l"(desc));
  return desc;
}
// The consumer warpgroup of warp `warp` in a warp-specialised kernel (warps 0-3 are the
// producer's). With kUniform broadcast from lane 0, so that ptxas knows it warp-uniform: the wgmma
// descriptors derived from it then live in uniform registers, moved per k-step by one UIADD3.64
// instead of a 64-bit add and two R2UR in the vector pipe (head dim 128's backward visit: 929 ->
// 729 instructions, session 24). The callers say where that pays (ptxas may spill more with it).
template <bool kUniform>
__device__ __forceinline__ int consumer_warpgroup(int warp) {
  return kUniform ? __shfl_sync(0xffffffff, warp / 4 - 1, 0) : warp / 4 - 1;
}

// Orders this thread's earlier register writes before the warpgroup's next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared memory written through the generic proxy (cp.async, st.shared) becomes visible to the
// async proxy (wgmma) of this CTA; each writing thread, before the barrier that publishes it.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of wgmma's register operands across its fence, issue
// and wait: call it on the accumulators and A fragments before wgmma_fence, and on the
// accumulators after wgmma_wait.
template <int kRows, int kCols>
__device__ __forceinline__ void fence_registers(float (&x)[kRows][kCols]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < kCols; ++j) asm volatile("" : "+f"(x[i][j])::"memory");
}
template <int kRows, int kCols>
__device__ __forceinline__ void fence_registers(uint32_t (&x)[kRows][kCols]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < kCols; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
}

template <typename T, int kN>
struct Wgmma;

// The asm operands of an accumulator d[kN / 8][4]: "+f" for d[j][0..3], n-tile by n-tile, and
// the PTX list that names them (%0 .. %(kN / 2 - 1)); the operands after them follow.
#define JF_WGMMA_ACC(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define JF_WGMMA_ACC_N64 \
  JF_WGMMA_ACC(0), JF_WGMMA_ACC(1), JF_WGMMA_ACC(2), JF_WGMMA_ACC(3), \
  JF_WGMMA_ACC(4), JF_WGMMA_ACC(5), JF_WGMMA_ACC(6), JF_WGMMA_ACC(7)
#define JF_WGMMA_ACC_N128 \
  JF_WGMMA_ACC_N64, \
  JF_WGMMA_ACC(8), JF_WGMMA_ACC(9), JF_WGMMA_ACC(10), JF_WGMMA_ACC(11), \
  JF_WGMMA_ACC(12), JF_WGMMA_ACC(13), JF_WGMMA_ACC(14), JF_WGMMA_ACC(15)
#define JF_WGMMA_REGS_N64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define JF_WGMMA_REGS_N128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// N = 8: the differentiated forward's row sums of the 16-bit P (P times a column of ones,
// sm90/fwd_gemms.cuh issue_output).
#define JF_WGMMA_ACC_N8 JF_WGMMA_ACC(0)
#define JF_WGMMA_REGS_N8 "{%0, %1, %2, %3}"
// N = 80 and 112: the forward's key blocks at head dims 256 and 192 (sm90ws_wide).
#define JF_WGMMA_ACC_N80 \
  JF_WGMMA_ACC(0), JF_WGMMA_ACC(1), JF_WGMMA_ACC(2), JF_WGMMA_ACC(3), \
  JF_WGMMA_ACC(4), JF_WGMMA_ACC(5), JF_WGMMA_ACC(6), JF_WGMMA_ACC(7), \
  JF_WGMMA_ACC(8), JF_WGMMA_ACC(9)
#define JF_WGMMA_REGS_N80 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39}"
#define JF_WGMMA_ACC_N112 \
  JF_WGMMA_ACC(0), JF_WGMMA_ACC(1), JF_WGMMA_ACC(2), JF_WGMMA_ACC(3), \
  JF_WGMMA_ACC(4), JF_WGMMA_ACC(5), JF_WGMMA_ACC(6), JF_WGMMA_ACC(7), \
  JF_WGMMA_ACC(8), JF_WGMMA_ACC(9), JF_WGMMA_ACC(10), JF_WGMMA_ACC(11), \
  JF_WGMMA_ACC(12), JF_WGMMA_ACC(13)
#define JF_WGMMA_REGS_N112 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55}"
// N = 176: the forward's wide key blocks (sm90ws_wide: FlashAttention-3's non-causal tile at
// head dim 128).
#define JF_WGMMA_ACC_N176 \
  JF_WGMMA_ACC_N128, \
  JF_WGMMA_ACC(16), JF_WGMMA_ACC(17), JF_WGMMA_ACC(18), JF_WGMMA_ACC(19), \
  JF_WGMMA_ACC(20), JF_WGMMA_ACC(21)
#define JF_WGMMA_REGS_N176 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87}"

// N = 96: head dim 96's products over the head dim (O += P V; dV, dK), whose operand tiles are
// 128 columns wide (sm90/traits.cuh kTileHeadDim) and read 1.5 column blocks.
#define JF_WGMMA_ACC_N96 \
  JF_WGMMA_ACC_N64, JF_WGMMA_ACC(8), JF_WGMMA_ACC(9), JF_WGMMA_ACC(10), JF_WGMMA_ACC(11)
#define JF_WGMMA_REGS_N96 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"

// N = 32: the backward's split tiles at head dim 256 (sm90/traits.cuh kSplitHeadDim): a
// warpgroup's S^T and dP^T columns (32 queries).
#define JF_WGMMA_ACC_N32 JF_WGMMA_ACC(0), JF_WGMMA_ACC(1), JF_WGMMA_ACC(2), JF_WGMMA_ACC(3)
#define JF_WGMMA_REGS_N32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

// wgmma m64nNk16 with float32 accumulators for the 16-bit type T whose PTX name is PTX ("bf16" or
// "f16"). ACC and REGS are the accumulator operands and their PTX list for N; the next operand
// numbers are given as strings: SS (the two descriptors, the accumulate predicate, then the two
// transpose immediates) and RS (A's four registers and B's descriptor, then the predicate).
#define JF_DEFINE_WGMMA(T, PTX, N, ACC, REGS, SS_DESCS, SS_PRED, SS_TRANS, RS_OPERANDS, RS_PRED)         \
  template <>                                                                                       \
  struct Wgmma<T, N> {                                                                              \
    /* D[64 x N] (+)= A[64 x 16] * B[16 x N], both from shared memory: A K-major (stored [m][k]) or, \
       with kTransposeA, M-major ([k][m]); B K-major ([n][k]) or, with kTransposeB, N-major ([k][n]). */ \
    template <int kTransposeA, int kTransposeB>                                                     \
    __device__ __forceinline__ static void ss_layout(float (&d)[N / 8][4], uint64_t a_desc,         \
                                                     uint64_t b_desc, bool accumulate) {          \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_PRED ", 0;\n"                             \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " REGS ", " SS_DESCS \
                   ", p, 1, 1, " SS_TRANS ";\n}\n"                                                  \
                   : ACC                                                                            \
                   : "l"(a_desc), "l"(b_desc), "r"(static_cast<int>(accumulate)), "n"(kTransposeA), \
                     "n"(kTransposeB));                                                             \
    }                                                                                               \
    /* Both K-major. */                                                                             \
    __device__ __forceinline__ static void ss(float (&d)[N / 8][4], uint64_t a_desc, uint64_t b_desc, \
                                              bool accumulate) {                                  \
      ss_layout<0, 0>(d, a_desc, b_desc, accumulate);                                               \
    }                                                                                               \
    /* A M-major, B N-major. */                                                                     \
    __device__ __forceinline__ static void ss_transposed(float (&d)[N / 8][4], uint64_t a_desc,     \
                                                         uint64_t b_desc, bool accumulate) {      \
      ss_layout<1, 1>(d, a_desc, b_desc, accumulate);                                               \
    }                                                                                               \
    /* A M-major, B K-major. */                                                                     \
    __device__ __forceinline__ static void ss_a_transposed(float (&d)[N / 8][4], uint64_t a_desc,   \
                                                           uint64_t b_desc, bool accumulate) {    \
      ss_layout<1, 0>(d, a_desc, b_desc, accumulate);                                               \
    }                                                                                               \
    /* A K-major, B N-major. */                                                                     \
    __device__ __forceinline__ static void ss_b_transposed(float (&d)[N / 8][4], uint64_t a_desc,   \
                                                           uint64_t b_desc, bool accumulate) {    \
      ss_layout<0, 1>(d, a_desc, b_desc, accumulate);                                               \
    }                                                                                               \
    /* D[64 x N] (+)= A[64 x 16] (registers) * B[16 x N] (shared, N-major: stored [k][n]). */      \
    __device__ __forceinline__ static void rs_b_transposed(float (&d)[N / 8][4], const uint32_t (&a)[4], \
                                                           uint64_t b_desc, bool accumulate) {    \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_PRED ", 0;\n"                             \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " REGS ", " RS_OPERANDS \
                   ", p, 1, 1, 1;\n}\n"                                                             \
                   : ACC                                                                            \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc),                       \
                     "r"(static_cast<int>(accumulate)));                                            \
    }                                                                                               \
  };

#define JF_DEFINE_WGMMA_N8(T, PTX)                                                                  \
  JF_DEFINE_WGMMA(T, PTX, 8, JF_WGMMA_ACC_N8, JF_WGMMA_REGS_N8, "%4, %5", "%6", "%7, %8",          \
                  "{%4, %5, %6, %7}, %8", "%9")
#define JF_DEFINE_WGMMA_N64(T, PTX)                                                                 \
  JF_DEFINE_WGMMA(T, PTX, 64, JF_WGMMA_ACC_N64, JF_WGMMA_REGS_N64, "%32, %33", "%34", "%35, %36",  \
                  "{%32, %33, %34, %35}, %36", "%37")
#define JF_DEFINE_WGMMA_N128(T, PTX)                                                                \
  JF_DEFINE_WGMMA(T, PTX, 128, JF_WGMMA_ACC_N128, JF_WGMMA_REGS_N128, "%64, %65", "%66", "%67, %68", \
                  "{%64, %65, %66, %67}, %68", "%69")
#define JF_DEFINE_WGMMA_N80(T, PTX)                                                                \
  JF_DEFINE_WGMMA(T, PTX, 80, JF_WGMMA_ACC_N80, JF_WGMMA_REGS_N80, "%40, %41", "%42", "%43, %44", \
                  "{%40, %41, %42, %43}, %44", "%45")
#define JF_DEFINE_WGMMA_N112(T, PTX)                                                                \
  JF_DEFINE_WGMMA(T, PTX, 112, JF_WGMMA_ACC_N112, JF_WGMMA_REGS_N112, "%56, %57", "%58", "%59, %60", \
                  "{%56, %57, %58, %59}, %60", "%61")
#define JF_DEFINE_WGMMA_N176(T, PTX)                                                                \
  JF_DEFINE_WGMMA(T, PTX, 176, JF_WGMMA_ACC_N176, JF_WGMMA_REGS_N176, "%88, %89", "%90", "%91, %92", \
                  "{%88, %89, %90, %91}, %92", "%93")
#define JF_DEFINE_WGMMA_N96(T, PTX)                                                                 \
  JF_DEFINE_WGMMA(T, PTX, 96, JF_WGMMA_ACC_N96, JF_WGMMA_REGS_N96, "%48, %49", "%50", "%51, %52",  \
                  "{%48, %49, %50, %51}, %52", "%53")
#define JF_DEFINE_WGMMA_N32(T, PTX)                                                                 \
  JF_DEFINE_WGMMA(T, PTX, 32, JF_WGMMA_ACC_N32, JF_WGMMA_REGS_N32, "%16, %17", "%18", "%19, %20",  \
                  "{%16, %17, %18, %19}, %20", "%21")
JF_DEFINE_WGMMA_N8(__nv_bfloat16, "bf16")
JF_DEFINE_WGMMA_N8(__half, "f16")
JF_DEFINE_WGMMA_N64(__nv_bfloat16, "bf16")
JF_DEFINE_WGMMA_N64(__half, "f16")
JF_DEFINE_WGMMA_N128(__nv_bfloat16, "bf16")
JF_DEFINE_WGMMA_N128(__half, "f16")
JF_DEFINE_WGMMA_N80(__nv_bfloat16, "bf16")
JF_DEFINE_WGMMA_N80(__half, "f16")
JF_DEFINE_WGMMA_N112(__nv_bfloat16, "bf16")
JF_DEFINE_WGMMA_N112(__half, "f16")
JF_DEFINE_WGMMA_N176(__nv_bfloat16, "bf16")
JF_DEFINE_WGMMA_N176(__half, "f16")
JF_DEFINE_WGMMA_N96(__nv_bfloat16, "bf16")
JF_DEFINE_WGMMA_N96(__half, "f16")
JF_DEFINE_WGMMA_N32(__nv_bfloat16, "bf16")
JF_DEFINE_WGMMA_N32(__half, "f16")
#undef JF_DEFINE_WGMMA_N8
#undef JF_DEFINE_WGMMA_N64
#undef JF_DEFINE_WGMMA_N128
#undef JF_DEFINE_WGMMA_N80
#undef JF_DEFINE_WGMMA_N112
#undef JF_DEFINE_WGMMA_N176
#undef JF_DEFINE_WGMMA_N32
#undef JF_DEFINE_WGMMA_N96
#undef JF_DEFINE_WGMMA
#undef JF_WGMMA_REGS_N8
#undef JF_WGMMA_REGS_N64
#undef JF_WGMMA_REGS_N128
#undef JF_WGMMA_REGS_N80
#undef JF_WGMMA_REGS_N112
#undef JF_WGMMA_REGS_N176
#undef JF_WGMMA_REGS_N32
#undef JF_WGMMA_REGS_N96
#undef JF_WGMMA_ACC_N8
#undef JF_WGMMA_ACC_N64
#undef JF_WGMMA_ACC_N128
#undef JF_WGMMA_ACC_N80
#undef JF_WGMMA_ACC_N112
#undef JF_WGMMA_ACC_N176
#undef JF_WGMMA_ACC_N32
#undef JF_WGMMA_ACC_N96
#undef JF_WGMMA_ACC

}  // namespace jax_flash::cuda
