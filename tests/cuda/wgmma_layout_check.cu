// A direct check of the Hopper forward's building blocks, apart from attention: one warpgroup
// multiplies bf16 matrices with wgmma through the same shared tiles (GmmaTile), descriptors
// (k_major, n_major) and register fragments (accumulator layout, accumulator_to_a) that
// flash_fwd_sm90.cuh uses, against a float reference on the host. If the attention kernel fails
// on a GPU, this says whether the layouts are the cause.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -Icuda tests/cuda/wgmma_layout_check.cu -o /tmp/wgmma_layout_check && /tmp/wgmma_layout_check
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "gpu/fragments.cuh"
#include "sm90/gmma_tile.cuh"
#include "sm90/wgmma.cuh"

using namespace jax_flash::cuda;
using bf16 = __nv_bfloat16;

constexpr int kM = 64, kN = 128, kK = 128;  // D[kM x kN] = A[kM x kK] * B

// Copies a row-major [rows][cols] global matrix into a GmmaTile (element by element).
template <typename Tile>
__device__ void fill(bf16* tile, const bf16* src) {
  for (int i = threadIdx.x; i < Tile::kRows * Tile::kCols; i += blockDim.x) {
    const int r = i / Tile::kCols, c = i % Tile::kCols;
    tile[Tile::offset(r, c / 8) + c % 8] = src[i];
  }
}

// Writes a warpgroup accumulator D[64 x kN] row-major.
__device__ void store(float* d, const float (&acc)[kN / 8][4]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      d[(16 * warp + lane / 4 + 8 * (e / 2)) * kN + 8 * j + 2 * (lane % 4) + e % 2] = acc[j][e];
}

__device__ bf16* aligned_smem(unsigned char* raw) {
  const uint32_t address = smem_address(raw);
  return reinterpret_cast<bf16*>(raw + (((address + 1023) & ~1023u) - address));
}

// mode 0: A (shared, K-major) * B^T with B given [kN][kK] (K-major), as S = Q K^T.
// mode 1: A (registers, from a [kM][kK] matrix) * B with B given [kK][kN] (N-major), as O = P V.
template <int mode>
__global__ void check_kernel(const bf16* a, const bf16* b, float* d) {
#if JF_SM90A
  extern __shared__ unsigned char smem_raw[];
  bf16* s_a = aligned_smem(smem_raw);
  bf16* s_b = s_a + kM * kK;
  using ATile = GmmaTile<kM, kK>;
  using BkTile = GmmaTile<kN, kK>;  // [n][k]
  using BnTile = GmmaTile<kK, kN>;  // [k][n]
  if constexpr (mode == 0) {
    fill<ATile>(s_a, a);
    fill<BkTile>(s_b, b);
  } else {
    fill<BnTile>(s_b, b);
  }
  fence_proxy_async();
  __syncthreads();
  float acc[kN / 8][4];
  if constexpr (mode == 0) {
    fence_registers(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk)
      Wgmma<bf16, kN>::ss(acc, ATile::k_major(smem_address(s_a), 0, kk), BkTile::k_major(smem_address(s_b), 0, kk),
                          kk > 0);
  } else {
    // A as an accumulator-shaped float array (16-column pairs of n-tiles), then to fragments.
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float a_acc[1][kK / 8][4];
#pragma unroll
    for (int j = 0; j < kK / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        a_acc[0][j][e] = __bfloat162float(a[(16 * warp + lane / 4 + 8 * (e / 2)) * kK + 8 * j + 2 * (lane % 4) + e % 2]);
    uint32_t frag[kK / 16][1][4];
    accumulator_to_a<bf16>(frag, a_acc);
    fence_registers(acc);
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) fence_registers(frag[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk)
      Wgmma<bf16, kN>::rs_b_transposed(acc, frag[kk][0], BnTile::n_major(smem_address(s_b), kk), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(acc);
  store(d, acc);
#endif
}

#define CHECK(call)                                                                  \
  do {                                                                               \
    cudaError_t e_ = (call);                                                         \
    if (e_ != cudaSuccess) {                                                         \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 2;                                                                      \
    }                                                                                \
  } while (0)

int main() {
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  std::vector<bf16> a(kM * kK), bk(kN * kK), bn(kK * kN);
  std::vector<float> af(a.size()), bkf(bk.size()), bnf(bn.size());
  for (size_t i = 0; i < a.size(); ++i) af[i] = __bfloat162float(a[i] = __float2bfloat16(normal(rng)));
  for (size_t i = 0; i < bk.size(); ++i) bkf[i] = __bfloat162float(bk[i] = __float2bfloat16(normal(rng)));
  for (size_t i = 0; i < bn.size(); ++i) bnf[i] = __bfloat162float(bn[i] = __float2bfloat16(normal(rng)));

  bf16 *da, *dbk, *dbn;
  float* dd;
  CHECK(cudaMalloc(&da, a.size() * 2));
  CHECK(cudaMalloc(&dbk, bk.size() * 2));
  CHECK(cudaMalloc(&dbn, bn.size() * 2));
  CHECK(cudaMalloc(&dd, kM * kN * 4));
  CHECK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dbk, bk.data(), bk.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dbn, bn.data(), bn.size() * 2, cudaMemcpyHostToDevice));
  const int smem = (kM * kK + kN * kK) * 2 + 1024;
  CHECK(cudaFuncSetAttribute(check_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(check_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

  int failures = 0;
  for (int mode = 0; mode < 2; ++mode) {
    CHECK(cudaMemset(dd, 0xff, kM * kN * 4));  // NaN: an element never written fails
    if (mode == 0)
      check_kernel<0><<<1, 128, smem>>>(da, dbk, dd);
    else
      check_kernel<1><<<1, 128, smem>>>(da, dbn, dd);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<float> d(kM * kN);
    CHECK(cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost));
    double max_err = 0, max_ref = 0;
    for (int i = 0; i < kM; ++i)
      for (int j = 0; j < kN; ++j) {
        double ref = 0;
        for (int k = 0; k < kK; ++k)
          ref += double(af[i * kK + k]) * (mode == 0 ? bkf[j * kK + k] : bnf[k * kN + j]);
        const double got = d[i * kN + j];
        max_err = std::isfinite(got) ? std::fmax(max_err, std::fabs(got - ref)) : INFINITY;
        max_ref = std::fmax(max_ref, std::fabs(ref));
      }
    const bool ok = max_err <= 1e-4 * max_ref + 1e-4;
    std::printf("%s: max |error| %.3g (max |D| %.3g): %s\n",
                mode == 0 ? "SS, A and B K-major (S = Q K^T)" : "RS, B N-major (O = P V)", max_err, max_ref,
                ok ? "ok" : "FAILED");
    failures += !ok;
  }
  return failures ? 1 : 0;
}
