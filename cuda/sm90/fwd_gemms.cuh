// The forward's two products on wgmma, each issued and committed as one group and not waited
// for (the callers overlap them with the softmax): S = Q K^T and O += P V.
#pragma once

#include <cstdint>

#include "sm90/wgmma.cuh"

namespace jax_flash::cuda {

// S = Q K^T for the warpgroup's 64 query rows (from row q_row0 of the Q tile) against the K tile
// at k_address: issued and committed as one wgmma group, not waited for.
template <typename Traits, typename T>
__device__ __forceinline__ void issue_scores(float (&s)[1][Traits::kBlockN / 8][4], uint32_t q_address, int q_row0,
                                             uint32_t k_address) {
  using QTile = typename Traits::QTile;
  using KTile = typename Traits::KTile;
  const uint64_t q_desc = made_here(QTile::k_major(q_address, q_row0, 0));  // (the tile's every key block)
  const uint64_t k_desc = KTile::k_major(k_address, 0, 0);
  fence_registers(s[0]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk)
    Wgmma<T, Traits::kBlockN>::ss(s[0], QTile::k_major_from(q_desc, 0, kk), KTile::k_major_from(k_desc, 0, kk),
                                  kk > 0);
  wgmma_commit();
}

// A descriptor of the ones tile (1 KiB of 16-bit ones, 1 KiB aligned) as the B operand of an
// N = 8 product, N-major: every k row reads the same 128-byte swizzle atom rows, all ones.
__device__ __forceinline__ uint64_t ones_descriptor(uint32_t ones_address) {
  return smem_descriptor(ones_address, 0, 0);
}

// O += P V for the warpgroup: P from registers, V (N-major) at v_address; one wgmma group, not
// waited for. O and V have the value head dim (Traits::kValueHeadDim). Head dims past 128 are done as products of N = 128 (and a last one of 64) over the
// column blocks of V and O; head dim 96 as one of N = 96 (1.5 of V's column blocks). With kRowSums also row_sums += P times a column of ones (the
// ones tile's descriptor): each row's sum of P as rounded to 16 bits, in float32, on the tensor
// cores (every column of the m64n8 accumulator holds it), where the softmax would otherwise
// unpack and add every 16-bit P (OnlineSoftmax::add_rounded_sums). `row_sums` is a pointer only
// to be optional at compile time (callers pass a local's address: it stays in registers).
template <typename Traits, typename T, bool kRowSums = false>
__device__ __forceinline__ void issue_output(float (&o)[1][Traits::kValueHeadDim / 8][4],
                                             uint32_t (&pa)[Traits::kBlockN / 16][1][4], uint32_t v_address,
                                             float (*row_sums)[1][4] = nullptr, uint64_t ones_desc = 0) {
  using VTile = typename Traits::VTile;
  constexpr int kD = Traits::kValueHeadDim;
  constexpr int kN = kD < 128 ? kD : 128;  // columns of each product
  static_assert(kD % 64 == 0 || kD == 96, "whole 64-column blocks, or one product of N = 96");
  const uint64_t v_base = VTile::n_major(v_address, 0);
  fence_registers(o[0]);
  if constexpr (kRowSums) fence_registers(*row_sums);
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) fence_registers(pa[kk]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) {
    const uint64_t v_desc = VTile::n_major_from(v_base, kk);
#pragma unroll
    for (int col = 0; col + kN <= kD; col += kN)
      Wgmma<T, kN>::rs_b_transposed(*reinterpret_cast<float(*)[kN / 8][4]>(&o[0][col / 8]), pa[kk][0],
                                    v_desc + ((col / 64 * VTile::kBlockBytes) >> 4), true);
    if constexpr (kD % kN != 0)
      Wgmma<T, 64>::rs_b_transposed(*reinterpret_cast<float(*)[8][4]>(&o[0][(kD - 64) / 8]), pa[kk][0],
                                    v_desc + (((kD - 64) / 64 * VTile::kBlockBytes) >> 4), true);
    if constexpr (kRowSums) Wgmma<T, 8>::rs_b_transposed(*row_sums, pa[kk][0], ones_desc, true);
  }
  wgmma_commit();
}

}  // namespace jax_flash::cuda
