// Checks cuda/common/rounding_residual.h against jax_flash/_rounding.py (tests/test_rounding.py).
// Without arguments it reads lines "hi k float16" (hi a float32 bit pattern in hex) and prints
// join_rounding of each as a float32 bit pattern; with "encode" it reads lines "o hi float16"
// (float32 bit patterns: o and o rounded to the 16-bit dtype) and prints rounding_error's k.
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "common/rounding_residual.h"

namespace {

float from_bits(unsigned bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  const bool encode = argc > 1 && std::strcmp(argv[1], "encode") == 0;
  unsigned a_bits, hi_bits;
  int k, float16;
  if (encode) {
    while (std::scanf("%x %x %d", &a_bits, &hi_bits, &float16) == 3)
      std::printf("%d\n", jax_flash::rounding_error(from_bits(a_bits), from_bits(hi_bits), float16 != 0));
    return 0;
  }
  while (std::scanf("%x %d %d", &hi_bits, &k, &float16) == 3) {
    const float o = jax_flash::join_rounding(from_bits(hi_bits), static_cast<int8_t>(k), float16 != 0);
    uint32_t o_bits;
    std::memcpy(&o_bits, &o, sizeof o_bits);
    std::printf("%08x\n", o_bits);
  }
  return 0;
}
