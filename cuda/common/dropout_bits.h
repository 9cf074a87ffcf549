// The random bits behind fused dropout (issue 17): Philox4x32-10 (Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3", SC'11), a counter-based generator, so that any kernel (CPU or
// CUDA, forward or backward) regenerates the keep decision of any score element from its
// coordinates alone and nothing T x S is stored. jax_flash/_dropout.py computes the same bits in
// JAX (the reference the kernels' tests compare against); tests/test_dropout_bits.py checks both
// against the generator's published known-answer vectors and each other.
//
// One Philox call gives four 32-bit words, eight 16-bit halves: one each for the 2 x 4 score
// elements rows r, r + 8 and columns c, c + 1, c + 8, c + 9 (r % 16 < 8; c even, c % 16 < 8):
//   counter = (column word + (c / 16) * 4 + (c % 16) / 2, row word + (r / 16) * 8 + r % 8, head,
//              batch), the row and column words 0 where the kernel's operands start the
//              sequence (DropoutSeedWord below),
//   key = the JAX key's two words,
//   word index = 2 * ((r / 8) % 2) + (c / 8) % 2, its low half for even c, high half for odd c.
// An element is kept when its half is >= the threshold round(rate * 2^16) (keep probability
// 1 - threshold / 2^16: the rate to 2^-17, far inside the 3-standard-error test over 10^7).
// The group is what the CUDA kernels' threads hold of two adjacent 8-column n-tiles: the
// forward's S fragments hold all eight, the backward's transposed S^T fragments (rows = keys)
// hold the four of one parity of c, so neighbouring lanes (keys c and c + 1) each make one of
// two calls and swap halves (gpu/dropout_fragments.h): one call per eight decisions either way
// (16-bit halves, not whole words: Philox's rounds were 2-3x the tile's own work at 32 bits).
#pragma once

#include <cstdint>

#include "common/attention_params.h"

namespace jax_flash {

struct PhiloxWords {
  uint32_t w[4];
};

// Philox4x32-10's constants: the round multipliers and the key schedule's increments. (Plain
// constexpr, internal linkage: the CPU kernels' per-ISA objects, which must export no symbol
// outside their own namespace, use them in their vector form of the rounds, cpu/flash_fwd.h.)
constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxBump0 = 0x9E3779B9u, kPhiloxBump1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

JF_HOST_DEVICE inline PhiloxWords philox4x32_10(PhiloxWords counter, uint32_t key0, uint32_t key1) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxMul0) * counter.w[0];
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxMul1) * counter.w[2];
    counter = {{static_cast<uint32_t>(p1 >> 32) ^ counter.w[1] ^ key0, static_cast<uint32_t>(p1),
                static_cast<uint32_t>(p0 >> 32) ^ counter.w[3] ^ key1, static_cast<uint32_t>(p0)}};
    key0 += kPhiloxBump0;
    key1 += kPhiloxBump1;
  }
  return counter;
}

// What a kernel takes per (batch element, query head) (AttentionParams::dropout_seeds), in this
// order: the Philox key's two words, the counter's head and batch words, and the counter's row
// and column words of the kernel's row 0 and key 0. Those are 0 where the kernel's operands
// start the sequence; a kernel over rows [R, ...) and keys [C, ...) of it (a context-parallel
// block pair: R and C multiples of 16) takes R / 2 and C / 4, and then draws each element's
// bits at its place in the sequence (the counter words below are base + the local formula).
enum DropoutSeedWord : int {
  kSeedKey0,
  kSeedKey1,
  kSeedHead,
  kSeedBatch,
  kSeedRowWord,
  kSeedColumnWord,
  kDropoutSeedWords  // the count
};
// A kernel's row and column offsets must be multiples of this for its row and column words to
// name them (the layout's 16 x 16 groups).
constexpr int kDropoutOffsetMultiple = 16;

// The Philox counter of score element (row, column) of (batch, head), its row and column words
// based at row_word0 and column_word0 (the seeds' kSeedRowWord and kSeedColumnWord), the index
// of its word and its 16 bits (dropout_bits).
JF_HOST_DEVICE inline PhiloxWords dropout_counter(int64_t batch, int64_t head, int64_t row, int64_t column,
                                                  uint32_t row_word0 = 0, uint32_t column_word0 = 0) {
  return {{column_word0 + static_cast<uint32_t>((column / 16) * 4 + (column % 8) / 2),
           row_word0 + static_cast<uint32_t>((row / 16) * 8 + row % 8), static_cast<uint32_t>(head),
           static_cast<uint32_t>(batch)}};
}
JF_HOST_DEVICE inline int dropout_word_index(int64_t row, int64_t column) {
  return static_cast<int>(2 * ((row / 8) % 2) + (column / 8) % 2);
}
JF_HOST_DEVICE inline uint32_t dropout_half(uint32_t word, int64_t column) {
  return column % 2 ? word >> 16 : word & 0xFFFFu;
}

// The keep threshold of a dropout rate in [0, 1), in [0, 2^16]: halves below it drop their
// element (2^16, rates within 2^-17 of 1: every element).
JF_HOST_DEVICE inline uint32_t dropout_threshold(double rate) {
  return static_cast<uint32_t>(rate * 65536.0 + 0.5);
}

}  // namespace jax_flash
