#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "cpu/tile_gemm.h"
using namespace jax_flash::cpu::JF_ISA;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  const int64_t d = atoi(argv[1]), seq = 4096, B = 64;
  std::vector<float> Q(seq * d), dO(seq * d), dq(seq * d);
  for (auto& x : Q) x = rand() / float(RAND_MAX) - .5f;
  for (auto& x : dO) x = rand() / float(RAND_MAX) - .5f;
  alignas(64) static float kt[256 * 64], k[64 * 256], vt[256 * 64], dkt[256 * 64], dvt[256 * 64], p[64 * 64], ds[64 * 64], dkk[64*256];
  for (auto& x : kt) x = .01f; for (auto& x : k) x = .01f; for (auto& x : vt) x = .01f; for (auto& x : p) x = .01f; for (auto& x : ds) x = .01f;
  const int reps = 8;
  double flops = 2.0 * 64 * seq * d * reps;
  auto run = [&](const char* name, auto f) {
    f(); double t = now(); for (int r = 0; r < reps; ++r) f(); t = now() - t;
    printf("%-34s d=%ld %7.1f GFLOP/s\n", name, (long)d, flops / t / 1e9);
  };
  run("S = Q K^T", [&] { for (int64_t i = 0; i < seq; i += B) gemm(B, 64, d, 1.f, Q.data() + i * d, d, kt, 64, p, 64, false); });
  run("dVt += dO^T P", [&] { for (int64_t i = 0; i < seq; i += B) gemm_strided(d, 64, B, 1.f, dO.data() + i * d, 1, d, p, 64, dvt, 64, true); });
  run("dP = dO V^T", [&] { for (int64_t i = 0; i < seq; i += B) gemm(B, 64, d, 1.f, dO.data() + i * d, d, vt, 64, ds, 64, false); });
  run("dQ += dS K", [&] { for (int64_t i = 0; i < seq; i += B) gemm(B, d, 64, .1f, ds, 64, k, d, dq.data() + i * d, d, true); });
  run("dKt += Q^T dS", [&] { for (int64_t i = 0; i < seq; i += B) gemm_strided(d, 64, B, .1f, Q.data() + i * d, 1, d, ds, 64, dkt, 64, true); });
  run("old dK += dS^T Q", [&] { for (int64_t i = 0; i < seq; i += B) gemm_at(64, d, B, .1f, ds, 64, Q.data() + i * d, d, dkk, d, true); });
}
