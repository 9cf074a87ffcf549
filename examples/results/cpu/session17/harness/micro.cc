#include <chrono>
#include <cstdio>
#include "cpu/tile_gemm.h"
using namespace jax_flash::cpu::JF_ISA;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
template <int MR, int NV>
inline void panel_u2(int64_t K, const float* __restrict a, int64_t lda, const float* __restrict b, int64_t ldb, float* __restrict c, int64_t ldc) {
  Vec acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec{};
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    Vec bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = load(b + k * ldb + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const Vec av = splat(a[r * lda + k]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] += av * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) store(c + r * ldc + v * kLanes, load(c + r * ldc + v * kLanes) + acc[r][v]);
}
int main() {
  alignas(64) static float a[96 * 64], b[64 * 64], c[96 * 64];
  for (auto& x : a) x = 1e-3f; for (auto& x : b) x = 1e-3f;
  const int reps = 20000;
  auto run = [&](const char* name, int M, auto f) {
    f(); double t = now(); for (int r = 0; r < reps; ++r) f(); t = now() - t;
    printf("%-24s %7.1f GFLOP/s\n", name, 2.0 * M * 64 * 64 * reps / t / 1e9);
  };
  run("gemm 48x64x64", 48, [&] { gemm(48, 64, 64, 1.f, a, 64, b, 64, c, 64, true); });
  run("gemm 96x64x64", 96, [&] { gemm(96, 64, 64, 1.f, a, 64, b, 64, c, 64, true); });
  run("gemm 64x64x64", 64, [&] { gemm(64, 64, 64, 1.f, a, 64, b, 64, c, 64, true); });
  run("u2 6x4 48", 48, [&] { for (int m = 0; m < 48; m += 6) panel_u2<6, 4>(64, a + m * 64, 64, b, 64, c + m * 64, 64); });
  run("u2 8x3 48 (N=48)", 48 * 3 / 4, [&] { for (int m = 0; m < 48; m += 8) panel_u2<8, 3>(64, a + m * 64, 64, b, 64, c + m * 64, 64); });
  run("u2 12x2 48 (N=32)", 48 / 2, [&] { for (int m = 0; m < 48; m += 12) panel_u2<12, 2>(64, a + m * 64, 64, b, 64, c + m * 64, 64); });
}
