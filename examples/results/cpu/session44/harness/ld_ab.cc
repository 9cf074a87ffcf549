// Alternating rounds of the forward's pair and the backward's five products on a task's tiles,
// leading dims of the 64-wide tiles 64 + pad and of the d-wide ones d + pad; best of the rounds.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <ctime>
#include "cpu/tile_gemm.h"
using namespace jax_flash::cpu::JF_ISA;
static double now() { timespec ts; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
static float* buf(int64_t n) { float* p = static_cast<float*>(aligned_alloc(64, ((n * 4 + 63) / 64) * 64)); for (int64_t i = 0; i < n; ++i) p[i] = (rand() / float(RAND_MAX) - .5f) * .1f; return p; }
struct Case {
  int64_t d, pad, q, dl, seq = 4096, vld;
  float *K, *Vt, *qt, *st, *ot, *Q, *dO, *dq, *kt, *k, *vt, *dkt, *dvt, *p, *ds;
  Case(int64_t d_, int64_t pad_) : d(d_), pad(pad_), q(64 + pad_), dl(d_ + pad_) {
    vld = seq + 16;
    K = buf(seq * d); Vt = buf(d * vld); qt = buf(d * q); st = buf(128 * q); ot = buf(d * q);
    Q = buf(seq * d); dO = buf(seq * d); dq = buf(seq * dl);
    kt = buf(d * q); k = buf(64 * dl); vt = buf(d * q); dkt = buf(d * q); dvt = buf(d * q); p = buf(64 * q); ds = buf(64 * q);
  }
  void fwd() { for (int64_t j = 0; j < seq; j += 128) { gemm(128, 64, d, 1.f, K + j * d, d, qt, q, st, q, false); gemm(d, 64, 128, 1.f, Vt + j, vld, st, q, ot, q, true); } }
  void bwd() { for (int64_t i = 0; i < seq; i += 64) {
    gemm(64, 64, d, 1.f, Q + i * d, d, kt, q, p, q, false);
    gemm_strided(d, 64, 64, 1.f, dO + i * d, 1, d, p, q, dvt, q, true);
    gemm(64, 64, d, 1.f, dO + i * d, d, vt, q, ds, q, false);
    gemm(64, d, 64, .1f, ds, q, k, dl, dq + i * dl, dl, true);
    gemm_strided(d, 64, 64, .1f, Q + i * d, 1, d, ds, q, dkt, q, true); } }
};
int main(int argc, char** argv) {
  const int64_t d = atoi(argv[1]);
  const int rounds = argc > 2 ? atoi(argv[2]) : 10;
  std::vector<int64_t> pads;
  for (int i = 3; i < argc; ++i) pads.push_back(atoi(argv[i]));
  std::vector<Case*> cases; for (auto pd : pads) cases.push_back(new Case(d, pd));
  std::vector<double> bf(pads.size(), 1e9), bb(pads.size(), 1e9);
  for (int r = 0; r < rounds; ++r)
    for (size_t c = 0; c < cases.size(); ++c) {
      double t0 = now(); for (int x = 0; x < 4; ++x) cases[c]->fwd(); bf[c] = std::min(bf[c], (now() - t0) / 4);
      t0 = now(); for (int x = 0; x < 2; ++x) cases[c]->bwd(); bb[c] = std::min(bb[c], (now() - t0) / 2);
    }
  const double fl = 2.0 * 64 * 4096 * d;
  for (size_t c = 0; c < cases.size(); ++c)
    printf("d=%ld pad=%ld  fwd pair %.1f GFLOP/s  bwd five %.1f GFLOP/s\n", (long)d, (long)pads[c], 2 * fl / bf[c] / 1e9, 5 * fl / bb[c] / 1e9);
}
