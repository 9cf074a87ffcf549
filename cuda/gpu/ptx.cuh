// Thin wrappers over the sm_80+ instructions the CUDA kernels are built from: asynchronous
// global->shared copies, ldmatrix, mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate), exp2.
//
// Fragment layouts of mma.m16n8k16 (lane = 4 * g + t, g = lane / 4, t = lane % 4):
//   A 16x16: a[0] (row g, k 2t..2t+1), a[1] (row g+8, k 2t..), a[2] (row g, k 2t+8..),
//            a[3] (row g+8, k 2t+8..), each register two 16-bit values
//   B 16x8:  b[0] (k 2t..2t+1, col g), b[1] (k 2t+8.., col g)
//   C 16x8:  c[0], c[1] (row g, cols 2t, 2t+1), c[2], c[3] (row g+8, cols 2t, 2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jax_flash::cuda {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that bypasses L1; when !valid the destination is zero-filled
// and the source is not read.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(src_bytes));
}
// The same with a hint to L2: kEvictFirst (with l2_evict_first_policy) marks the line first to
// go, for data read once; kPrefetch256 asks L2 to fetch the whole 256-byte block around it.
enum class L2Hint { kNone, kEvictFirst, kPrefetch256 };
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
template <L2Hint kHint>
__device__ __forceinline__ void cp_async_16_hinted(void* smem, const void* gmem, bool valid, uint64_t policy) {
  const int src_bytes = valid ? 16 : 0;
  if constexpr (kHint == L2Hint::kEvictFirst)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_address(smem)),
                 "l"(gmem), "r"(src_bytes), "l"(policy));
  else if constexpr (kHint == L2Hint::kPrefetch256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)),
                 "l"(gmem), "r"(src_bytes));
  else
    cp_async_16(smem, gmem, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Asks L2 for the 128-byte line holding p (no result, no fault semantics beyond the address).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
// An upper bound of the SM count (PTX %nsmid).
__device__ __forceinline__ int sm_id_bound() {
  int n;
  asm volatile("mov.u32 %0, %%nsmid;\n" : "=r"(n));
  return n;
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 16-bit matrices; lane l gives the shared address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// Four 8x8 16-bit matrices stored transposed (sm_90): register i of each lane holds its
// mma.sync fragment pair of matrix i (row lane / 4, columns 2 (lane % 4) and + 1), and lane l
// gives the shared address where row l % 8 of matrix l / 8's transpose (its column l % 8) goes.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t address, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// The same four matrices stored as they are (sm_90): lane l gives the address of row l % 8 of
// matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(uint32_t address, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

__device__ __forceinline__ void st_shared_b32(uint32_t address, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(value));
}

template <typename T>
struct MmaOp;

template <>
struct MmaOp<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4],
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <>
struct MmaOp<__half> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4],
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// The two floats of a pair MmaOp<T>::pack made (bfloat16: the high halves of float32 words).
template <typename T>
__device__ __forceinline__ float2 unpack_pair(uint32_t packed) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&packed));
  } else {
    return make_float2(__uint_as_float(packed << 16), __uint_as_float(packed & 0xffff0000u));
  }
}

// p[0] += a, p[1] += b in global memory (p 8-byte aligned); one vector reduction on sm_90.
__device__ __forceinline__ void atomic_add_pair(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// p[0..3] += (a, b, c, d): one 16-byte atomic on sm_90 (p 16-byte aligned).
__device__ __forceinline__ void atomic_add_quad(float* p, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(p), make_float4(a, b, c, d));
#else
  atomic_add_pair(p, a, b);
  atomic_add_pair(p + 2, c, d);
#endif
}

// min(x, y) that keeps a NaN (fminf returns the other operand).
__device__ __forceinline__ float min_keeping_nan(float x, float y) {
  float z;
  asm("min.NaN.f32 %0, %1, %2;\n" : "=f"(z) : "f"(x), "f"(y));
  return z;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace jax_flash::cuda
