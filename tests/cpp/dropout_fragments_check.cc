// Runs cuda/gpu/dropout_fragments.h for every lane of every 16-row warp tile over a T x S grid of
// scores, in the forward's layout (rows = query rows) or the backward's transposed one (rows =
// keys), and prints the keep decisions as T lines of S characters ('1' kept, '0' dropped) in
// (query row, key) order, for tests/test_dropout_bits.py to compare with jax_flash/_dropout.py.
//   usage: dropout_fragments_check forward|transposed key0 key1 head batch row_word column_word
//          threshold T S
// (the seed words in common/dropout_bits.h's DropoutSeedWord order), T and S multiples of 16.
// Exits 1 if some element is given no decision or two.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gpu/dropout_fragments.h"

int main(int argc, char** argv) {
  constexpr int kWords = jax_flash::kDropoutSeedWords;
  if (argc != 5 + kWords) return 2;
  const bool forward = std::strcmp(argv[1], "forward") == 0;
  uint32_t seed[kWords];
  for (int i = 0; i < kWords; ++i) seed[i] = static_cast<uint32_t>(std::strtoul(argv[2 + i], nullptr, 10));
  const auto threshold = static_cast<uint32_t>(std::strtoul(argv[2 + kWords], nullptr, 10));
  const long T = std::atol(argv[3 + kWords]), S = std::atol(argv[4 + kWords]);
  if (T % 16 || S % 16) return 2;
  const jax_flash::cuda::DropoutStream stream(seed, threshold);
  std::vector<int> keep(T * S, -1);
  int collisions = 0;
  auto set = [&](long query, long key, bool kept) {
    int& cell = keep[query * S + key];
    collisions += cell != -1;
    cell = kept;
  };
  using namespace jax_flash::cuda;
  for (long row_base = 0; row_base < T; row_base += 16)  // forward: 16 query rows a warp tile
    for (long pair = 0; forward && pair < S / 16; ++pair)
      for (int lane = 0; lane < 32; ++lane) {
        const long row0 = row_base + lane / 4, col0 = pair * 16 + 2 * (lane % 4);
        const uint32_t bits = forward_keep_bits(stream, row0, col0);
        for (int t = 0; t < 2; ++t)
          for (int e = 0; e < 4; ++e) set(row0 + 8 * (e / 2), col0 + 8 * t + e % 2, (bits >> (4 * t + e)) & 1);
      }
  for (long key_base = 0; key_base < S; key_base += 16)  // transposed: 16 keys a warp tile
    for (long pair = 0; !forward && pair < T / 16; ++pair) {
      // Every lane's own call first, then each lane's decisions from its call and the halves
      // lane ^ 4 sends it (the device's shuffle).
      jax_flash::PhiloxWords own[32];
      for (int lane = 0; lane < 32; ++lane)
        own[lane] = transposed_pair_call(stream, key_base + lane / 4, pair * 16 + 2 * (lane % 4));
      for (int lane = 0; lane < 32; ++lane) {
        const long key0 = key_base + lane / 4, query0 = pair * 16 + 2 * (lane % 4);
        const HalfWords other = halves_of_parity(own[lane ^ 4], static_cast<int>(key0 % 2));
        const uint32_t bits = transposed_keep_bits(stream, own[lane], other, key0);
        for (int t = 0; t < 2; ++t)
          for (int e = 0; e < 4; ++e) set(query0 + 8 * t + e % 2, key0 + 8 * (e / 2), (bits >> (4 * t + e)) & 1);
      }
    }
  for (long r = 0; r < T; ++r) {
    for (long c = 0; c < S; ++c) {
      if (keep[r * S + c] < 0) return 1;
      std::putchar('0' + keep[r * S + c]);
    }
    std::putchar('\n');
  }
  return collisions ? 1 : 0;
}
