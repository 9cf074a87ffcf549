#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include "cpu/tile_gemm.h"
using namespace jax_flash::cpu::JF_ISA;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  const int64_t seq = 4096, heads = 4, d = atoi(argv[1]);
  const int reps = 20;
  std::vector<float> K(seq * heads * d), V(seq * heads * d), Kp(seq * d), Vt(seq * d);
  for (auto& x : K) x = rand() / float(RAND_MAX) - .5f;
  for (auto& x : V) x = rand() / float(RAND_MAX) - .5f;
  for (int64_t j = 0; j < seq; ++j) for (int64_t c = 0; c < d; ++c) { Kp[j * d + c] = K[j * heads * d + c]; Vt[c * seq + j] = V[j * heads * d + c]; }
  alignas(64) static float qt[256 * 64], s[128 * 64], acc[64 * 256], acct[256 * 64];
  for (auto& x : qt) x = .01f;
  for (auto& x : s) x = .01f;
  const int64_t ks = heads * d;
  double flops = 2.0 * 64 * seq * d * reps;
  auto run = [&](const char* name, auto f) {
    f(); double t = now(); for (int r = 0; r < reps; ++r) f(); t = now() - t;
    printf("%-28s d=%ld %7.1f GFLOP/s\n", name, (long)d, flops / t / 1e9);
  };
  run("st K in place", [&] { for (int64_t j = 0; j < seq; j += 64) gemm(64, 64, d, 1.f, K.data() + j * ks, ks, qt, 64, s, 64, false); });
  run("st K packed", [&] { for (int64_t j = 0; j < seq; j += 64) gemm(64, 64, d, 1.f, Kp.data() + j * d, d, qt, 64, s, 64, false); });
  run("st K packed 128", [&] { for (int64_t j = 0; j < seq; j += 128) gemm(128, 64, d, 1.f, Kp.data() + j * d, d, qt, 64, s, 64, false); });
  run("st K packed 96", [&] { for (int64_t j = 0; j + 96 <= seq; j += 96) gemm(96, 64, d, 1.f, Kp.data() + j * d, d, qt, 64, s, 64, false); });
  run("pv V in place", [&] { for (int64_t j = 0; j < seq; j += 64) gemm_at(64, d, 64, 1.f, s, 64, V.data() + j * ks, ks, acc, d, true); });
  run("pv V packed rows", [&] { for (int64_t j = 0; j < seq; j += 64) gemm_at(64, d, 64, 1.f, s, 64, Kp.data() + j * d, d, acc, d, true); });
  run("pvT V^T packed (O^T)", [&] { for (int64_t j = 0; j < seq; j += 64) gemm(d, 64, 64, 1.f, Vt.data() + j, seq, s, 64, acct, 64, true); });
  run("pvT V in place (O^T)", [&] { for (int64_t j = 0; j < seq; j += 64) gemm_strided(d, 64, 64, 1.f, V.data() + j * ks, 1, ks, s, 64, acct, 64, true); });
  run("pvT 128 keys V^T (O^T)", [&] { for (int64_t j = 0; j < seq; j += 128) gemm(d, 64, 128, 1.f, Vt.data() + j, seq, s, 64, acct, 64, true); });
  {
    const int64_t ld2 = seq + 16;
    std::vector<float> Vt2(ld2 * d), Vtt(seq * d);
    for (int64_t j = 0; j < seq; ++j) for (int64_t c = 0; c < d; ++c) { Vt2[c * ld2 + j] = V[j * heads * d + c]; Vtt[(j / 64) * 64 * d + c * 64 + j % 64] = V[j * heads * d + c]; }
    run("pvT V^T ld+16", [&] { for (int64_t j = 0; j < seq; j += 64) gemm(d, 64, 64, 1.f, Vt2.data() + j, ld2, s, 64, acct, 64, true); });
    run("pvT V^T tiled 64", [&] { for (int64_t j = 0; j < seq; j += 64) gemm(d, 64, 64, 1.f, Vtt.data() + j * d, 64, s, 64, acct, 64, true); });
    run("pvT V^T ld+16, 128 keys", [&] { for (int64_t j = 0; j < seq; j += 128) gemm(d, 64, 128, 1.f, Vt2.data() + j, ld2, s, 64, acct, 64, true); });
  }
  return 0;
}
