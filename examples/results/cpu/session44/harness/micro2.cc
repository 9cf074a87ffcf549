// gemm on tiles in L1/L2 (no streaming): the 6 x 2 block's rate by M, K.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <algorithm>
#include "cpu/tile_gemm.h"
using namespace jax_flash::cpu::JF_ISA;
static double now() { timespec ts; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
int main() {
  alignas(64) static float a[128 * 512], b[512 * 64], c[128 * 64];
  for (auto& x : a) x = 1e-3f; for (auto& x : b) x = 1e-3f;
  auto run = [&](const char* name, int M, int K, int reps, auto f) {
    double best = 1e9; for (int t = 0; t < 25; ++t) { double t0 = now(); for (int r = 0; r < reps; ++r) f(); best = std::min(best, now() - t0); }
    printf("%-28s %7.1f GFLOP/s\n", name, 2.0 * M * 64 * K * reps / best / 1e9);
  };
  run("gemm 48x64 K64 (L1)", 48, 64, 4000, [&] { gemm(48, 64, 64, 1.f, a, 64, b, 64, c, 64, true); });
  run("gemm 48x64 K64 ld 80", 48, 64, 4000, [&] { gemm(48, 64, 64, 1.f, a, 64, b, 80, c, 80, true); });
  run("gemm 126x64 K64", 126, 64, 2000, [&] { gemm(126, 64, 64, 1.f, a, 64, b, 64, c, 64, true); });
  run("gemm 128x64 K64", 128, 64, 2000, [&] { gemm(128, 64, 64, 1.f, a, 64, b, 64, c, 64, true); });
  run("gemm 128x64 K128", 128, 128, 1000, [&] { gemm(128, 64, 128, 1.f, a, 128, b, 64, c, 64, true); });
  run("gemm 120x64 K128", 120, 128, 1000, [&] { gemm(120, 64, 128, 1.f, a, 128, b, 64, c, 64, true); });
  run("gemm 128x64 K128 alpha", 128, 128, 1000, [&] { gemm(128, 64, 128, .3f, a, 128, b, 64, c, 64, false); });
  run("gemm 48x64 K512 (1 panel?)", 48, 512, 500, [&] { gemm(48, 64, 512, 1.f, a, 512, b, 64, c, 64, true); });
}
