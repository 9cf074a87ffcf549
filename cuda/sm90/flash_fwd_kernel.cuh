// FlashAttention forward for Hopper (sm_90a) on warpgroup MMA (wgmma), head dims 64 and 128.
//
// CTA = 2 warpgroups x 64 query rows of one (batch, query head). Key/value tiles of kBlockN rows
// stream through shared memory in two stages (cp.async, as the sm80 kernel), laid out for wgmma
// (GmmaTile, 128-byte swizzle). Per key block: S = Q K^T (wgmma, both operands in shared
// memory), masks and the online softmax with lazy rescaling in registers (gpu/softmax.cuh, as the sm80 kernel),
// then O += P V with P straight from registers (wgmma RS; V read N-major), each warpgroup's
// softmax of the next block running under its P V product. No warp specialisation or TMA yet:
// the two warpgroups run the same steps between barriers. (A variant without the overlap measured
// within a few percent of this one: cuda/PERF_NOTES.md, v4.)
#pragma once

#include <cuda_runtime.h>

#include "common/attention_params.h"
#include "gpu/block_geometry.cuh"
#include "gpu/epilogue.cuh"
#include "gpu/fragments.cuh"
#include "gpu/mask.cuh"
#include "gpu/softmax.cuh"
#include "sm90/fwd_gemms.cuh"
#include "sm90/traits.cuh"

namespace jax_flash::cuda {

// Shared memory of a Hopper forward CTA: Q, then two stages of K and of V, from a 1 KiB boundary
// (wgmma's swizzle pattern is anchored to 1 KiB boundaries of the shared address space).
template <typename Traits, typename T>
struct Sm90FwdSmem {
  T* q;
  T* k;  // two stages
  T* v;  // two stages
  __device__ explicit Sm90FwdSmem(unsigned char* raw) {
    q = first_tile_boundary<T>(raw);
    k = q + Traits::QTile::kElements;
    v = k + 2 * Traits::KVTile::kElements;
  }
  __device__ uint32_t k_address(int stage) const { return smem_address(k + stage * Traits::KVTile::kElements); }
  __device__ uint32_t v_address(int stage) const { return smem_address(v + stage * Traits::KVTile::kElements); }
};

// The Hopper forward: 2 warpgroups x 64 query rows against key/value blocks of kBlockN, each
// warpgroup's softmax overlapped with its P V product (FlashAttention-3's intra-warpgroup
// pipelining): per key block i, S(i+1) = Q K(i+1)^T and
// O += P(i) V(i) are issued together; the softmax of block i+1 works on S(i+1) while the product
// runs; O's rescale (rare with lazy rescaling) waits for the product. K(j), V(j) live in
// stage j % 2; stage i % 2 is refilled with block i+2 once every warpgroup is done with block i.
template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ FwdParams p) {
#if JF_SM90A
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  using QTile = typename Traits::QTile;
  using KVTile = typename Traits::KVTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Sm90FwdSmem<Traits, T> smem(smem_raw);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = warp / 4;
  const QueryBlockTask<kBM, kBN> task(p);
  const QueryBlock<kBM, kBN>& blk = task.blk;
  const int64_t m0 = blk.m0;
  const int warp_m0 = group * 64 + warp % 4 * 16;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  OnlineSoftmax<1> softmax;
  float o[1][kD / 8][4] = {};
  const float scale_log2 = p.scale * kLog2e;

  // Blocks are visited last first: visit i is key block n_last - i.
  const int count = blk.n_last - blk.n_first + 1;
  if (count > 0) {
    auto load_kv = [&](int i) {  // K(i) and V(i) into stage i % 2, one group each
      task.template load_keys<KVTile, kThreads>(smem.k + i % 2 * KVTile::kElements, k, blk.n_last - i, tid);
      cp_async_commit();
      task.template load_keys<KVTile, kThreads>(smem.v + i % 2 * KVTile::kElements, v, blk.n_last - i, tid);
      cp_async_commit();
    };
    // Masks of visit i's block (key block n_last - i) on its scores.
    auto mask_block = [&](float (&s)[1][kBN / 8][4], int i) {
      const int64_t n0 = static_cast<int64_t>(blk.n_last - i) * kBN;
      if (blk.needs_mask(n0)) mask_scores(s, p.mask, m0 + warp_m0, n0, task.q_len, task.kv_len, lane);
    };

    // Groups in flight, oldest first: (Q, K(0)), V(0), K(1), V(1).
    task.template load_queries<QTile, kThreads>(smem.q, static_cast<const T*>(p.q), tid);
    load_kv(0);
    if (count > 1) {
      load_kv(1);
      cp_async_wait<3>();
    } else {
      cp_async_wait<1>();
    }
    fence_proxy_async();
    __syncthreads();
    float s[1][kBN / 8][4];
    issue_scores<Traits, T>(s, smem_address(smem.q), group * 64, smem.k_address(0));
    wgmma_wait<0>();
    fence_registers(s[0]);
    mask_block(s, 0);
    if (softmax.must_rescale(s, scale_log2)) softmax.rescale(o, scale_log2);
    softmax.exponentiate(s, scale_log2);
    uint32_t pa[kBN / 16][1][4];
    accumulator_to_a<T>(pa, s);

    // Every visit but the last has a next block to overlap with.
    for (int i = 0; i + 1 < count; ++i) {
      // V(i) and K(i + 1) have landed (V(i + 1) may still be in flight).
      cp_async_wait<1>();
      fence_proxy_async();
      __syncthreads();
      // S(i + 1) and then P(i) V(i) are issued back to back; waiting for all but the newest
      // group waits for S(i + 1) only, so the softmax of block i + 1 (touching neither O nor
      // P(i)) runs while P(i) V(i) is on the tensor cores.
      issue_scores<Traits, T>(s, smem_address(smem.q), group * 64, smem.k_address((i + 1) % 2));
      issue_output<Traits, T>(o, pa, smem.v_address(i % 2));
      wgmma_wait<1>();
      fence_registers(s[0]);
      mask_block(s, i + 1);
      const bool moved = softmax.must_rescale(s, scale_log2);
      if (moved) softmax.move_reference(scale_log2);
      softmax.exponentiate(s, scale_log2);
      wgmma_wait<0>();  // P(i) V(i) is in: O, P(i)'s registers and stage i % 2 are free
      fence_registers(o[0]);
      if (moved) softmax.rescale_output(o);
      accumulator_to_a<T>(pa, s);
      if (i + 2 < count) {
        __syncthreads();  // every warpgroup is done with stage i % 2
        load_kv(i + 2);
      }
    }
    cp_async_wait<0>();  // the last V
    fence_proxy_async();
    __syncthreads();
    issue_output<Traits, T>(o, pa, smem.v_address((count - 1) % 2));
    wgmma_wait<0>();
    fence_registers(o[0]);
  }

  store_output<T>(p.o, p.o_float32, task.q_offset, task.q_stride, p.lse + task.stat_offset + m0, o, softmax,
               p.scale, warp_m0, blk.rows, p.shape.head_dim, p.mask, m0, task.q_len, task.kv_len,
               lane);
#endif  // JF_SM90A
}

}  // namespace jax_flash::cuda
