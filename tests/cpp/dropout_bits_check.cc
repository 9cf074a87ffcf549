// Prints cuda/common/dropout_bits.h's 16 bits for every score element of a small grid, for
// tests/test_dropout_bits.py to compare with jax_flash/_dropout.py.
//   usage: dropout_bits_check key0 key1 batch heads seq_q seq_k   (one value per line, row-major)
#include <cstdio>
#include <cstdlib>

#include "common/dropout_bits.h"

int main(int argc, char** argv) {
  if (argc != 7) return 2;
  const auto key0 = static_cast<uint32_t>(std::strtoul(argv[1], nullptr, 10));
  const auto key1 = static_cast<uint32_t>(std::strtoul(argv[2], nullptr, 10));
  const long dims[4] = {std::atol(argv[3]), std::atol(argv[4]), std::atol(argv[5]), std::atol(argv[6])};
  for (long b = 0; b < dims[0]; ++b)
    for (long h = 0; h < dims[1]; ++h)
      for (long r = 0; r < dims[2]; ++r)
        for (long c = 0; c < dims[3]; ++c) {
          const jax_flash::PhiloxWords words = jax_flash::philox4x32_10(jax_flash::dropout_counter(b, h, r, c), key0, key1);
          std::printf("%u\n", jax_flash::dropout_half(words.w[jax_flash::dropout_word_index(r, c)], c));
        }
  return 0;
}
