// The bfloat16 tile products (bf16_tiles.h) on Intel AMX (the avx512_amx variant, compiled with
// -mamx-tile -mamx-bf16; dispatch.cc offers it only where the CPU has AMX and the OS granted this
// process the tile state).
//
// tdpbf16ps computes a whole C tile, C[16 x 16] (float32) += A[16 x 32] B[32 x 16] (bfloat16),
// from tile registers. Tiles 0-3 hold a 2 x 2 block of C, tiles 4-5 two A tiles, 6-7 two B
// tiles: each A and B tile loaded feeds two products.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "amx_tiles.h needs -mamx-tile -mamx-bf16"
#endif

namespace jax_flash::cpu::JF_ISA {

// Palette 1 with all eight tiles 16 x 64 bytes, loaded once per task (the thread's tile state
// then holds it until released).
inline void configure_tiles() {
  alignas(64) uint8_t config[64] = {};
  config[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
    const uint16_t colsb = 64;
    std::memcpy(config + 16 + 2 * t, &colsb, 2);  // bytes 16-47: each tile's row width
    config[48 + t] = 16;                          // bytes 48-63: each tile's rows
  }
  _tile_loadconfig(config);
}

inline void release_tiles() { _tile_release(); }

// A 2 x 2 block of C tiles, operands as bf16_tiles.h describes.
inline void tile_block_2x2(int64_t depth, const uint8_t* a, int64_t a_stride, int64_t a_next,
                           int64_t a_chunk, const uint8_t* b, int64_t b_stride, int64_t b_next,
                           int64_t b_chunk, float* c, int64_t c_stride, int64_t c_next,
                           bool accumulate) {
  float* c10 = c + c_next;
  if (accumulate) {
    _tile_loadd(0, c, c_stride);
    _tile_loadd(1, c + 16, c_stride);
    _tile_loadd(2, c10, c_stride);
    _tile_loadd(3, c10 + 16, c_stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t t = 0; t < depth; ++t) {
    _tile_loadd(4, a + t * a_chunk, a_stride);
    _tile_loadd(6, b + t * b_chunk, b_stride);
    _tile_loadd(7, b + b_next + t * b_chunk, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + a_next + t * a_chunk, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + 16, c_stride);
  _tile_stored(2, c10, c_stride);
  _tile_stored(3, c10 + 16, c_stride);
}

}  // namespace jax_flash::cpu::JF_ISA
