// Checks simd.h exp2_nonpositive (built with AVX-512: roundscale/scalef) against the previous
// clamp-and-bits form on random x in [-130, 0]: bit-identical for x >= -126, and the special inputs.
// g++ -O2 -std=c++17 -mavx512f -mavx512vl -mavx512bw -mavx512dq -mavx2 -mfma -DJF_ISA=h -DJF_SIMD_LANES=16 -I<tree>/cuda exp2_check.cc
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include "cpu/simd.h"
using namespace jax_flash::cpu::JF_ISA;
Vec old_exp2(Vec x) {
  const Vec lo = splat(-127.f); x = lo > x ? lo : x;
  const Vec magic = splat(12582912.f); const Vec t = x + magic; const Vec n = t - magic;
  const Vec p = exp2_polynomial(x - n); IVec bits; std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits - (0x4B400000 - 127)) << 23; Vec scale; std::memcpy(&scale, &bits, sizeof(scale)); return p * scale;
}
int main() {
  long diff = 0, n = 0; double maxrel = 0;
  for (long i = 0; i < 20000000; ++i) {
    Vec x; for (int l = 0; l < kLanes; ++l) x[l] = -(rand() / (float)RAND_MAX) * ((i % 3 == 0) ? 130.f : 20.f);
    Vec a = exp2_nonpositive(x), b = old_exp2(x);
    for (int l = 0; l < kLanes; ++l) { ++n; if (x[l] >= -126.f && memcmp(&a[l], &b[l], 4)) ++diff;
      if (x[l] > -126) { double r = fabs(a[l] / exp2((double)x[l]) - 1); if (r > maxrel) maxrel = r; } }
  }
  Vec s = splat(0.f); s[0] = -INFINITY; s[1] = NAN; s[2] = -127.f; s[3] = -1e30f; s[4] = -126.f; s[5] = 0.f; s[6] = -0.f; s[7] = -140.f; s[8] = -149.5f; s[9]=-0.5f; s[10]=-126.5f;
  Vec a = exp2_nonpositive(s);
  printf("diff %ld of %ld maxrel %g\n", diff, n, maxrel);
  for (int l = 0; l < 11; ++l) printf("%g -> %g (old %g)\n", s[l], a[l], old_exp2(s)[l]);
}
