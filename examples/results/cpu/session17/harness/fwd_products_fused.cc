#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "cpu/tile_gemm.h"
using namespace jax_flash::cpu::JF_ISA;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
// panel-outer variant of gemm for S^T
inline void gemm_po(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t lda,
                    const float* b, int64_t ldb, float* c, int64_t ldc) {
  for (int64_t k0 = 0; k0 < K; k0 += kKPanel) {
    const int64_t kk = K - k0 < kKPanel ? K - k0 : kKPanel;
    gemm_strided(M, N, kk, alpha, a + k0, lda, 1, b + k0 * ldb, ldb, c, ldc, k0 > 0);
  }
}
int main(int argc, char** argv) {
  const int64_t seq = atoi(argv[2]), d = atoi(argv[1]), ld = seq + 16;
  const int reps = 10;
  std::vector<float> Kp(seq * d), Vt(ld * d);
  for (auto& x : Kp) x = rand() / float(RAND_MAX) - .5f;
  for (auto& x : Vt) x = rand() / float(RAND_MAX) - .5f;
  alignas(64) static float qt[256 * 64], s[128 * 64], acct[256 * 64];
  for (auto& x : qt) x = .01f;
  double flops = 4.0 * 64 * seq * d * reps;
  auto run = [&](const char* name, auto f) {
    f(); double t = now(); for (int r = 0; r < reps; ++r) f(); t = now() - t;
    printf("%-28s d=%ld seq=%ld %7.1f GFLOP/s\n", name, (long)d, (long)seq, flops / t / 1e9);
  };
  run("fused", [&] { for (int64_t j = 0; j < seq; j += 64) {
    gemm(64, 64, d, 1.f, Kp.data() + j * d, d, qt, 64, s, 64, false);
    gemm(d, 64, 64, 1.f, Vt.data() + j, ld, s, 64, acct, 64, true); } });
  run("fused panel-outer", [&] { for (int64_t j = 0; j < seq; j += 64) {
    gemm_po(64, 64, d, 1.f, Kp.data() + j * d, d, qt, 64, s, 64);
    gemm(d, 64, 64, 1.f, Vt.data() + j, ld, s, 64, acct, 64, true); } });
  run("fused 128 keys", [&] { for (int64_t j = 0; j < seq; j += 128) {
    gemm(128, 64, d, 1.f, Kp.data() + j * d, d, qt, 64, s, 64, false);
    gemm(d, 64, 128, 1.f, Vt.data() + j, ld, s, 64, acct, 64, true); } });
  run("fused 128 keys panel-outer", [&] { for (int64_t j = 0; j < seq; j += 128) {
    gemm_po(128, 64, d, 1.f, Kp.data() + j * d, d, qt, 64, s, 64);
    gemm(d, 64, 128, 1.f, Vt.data() + j, ld, s, 64, acct, 64, true); } });
}
