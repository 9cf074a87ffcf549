// Reads lines "hi k float16" (hi a float32 bit pattern in hex) and prints cuda/common/
// rounding_residual.h's join_rounding of each as a float32 bit pattern, for
// tests/test_rounding.py to compare with jax_flash/_rounding.py.
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "common/rounding_residual.h"

int main() {
  unsigned hi_bits;
  int k, float16;
  while (std::scanf("%x %d %d", &hi_bits, &k, &float16) == 3) {
    float hi;
    std::memcpy(&hi, &hi_bits, sizeof hi);
    const float o = jax_flash::join_rounding(hi, static_cast<int8_t>(k), float16 != 0);
    uint32_t o_bits;
    std::memcpy(&o_bits, &o, sizeof o_bits);
    std::printf("%08x\n", o_bits);
  }
  return 0;
}
