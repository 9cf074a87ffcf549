// Instantiations and launcher of the sm_80+ backward kernels.
#include <algorithm>

#include "flash_bwd_sm80.cuh"
#include "flash_dispatch.cuh"
#include "flash_launch.h"
#include "kernel_choice.h"

namespace jax_flash::cuda {
namespace {

// Tile shapes per head dim: (kBlockM, kBlockN, warps, then the warp grids' row counts for S/dP,
// dK/dV and dQ). 8 warps; key blocks of 128 up to head dim 128, of 64 beyond (shared memory).
template <int kHeadDim>
using BwdTraitsFor = std::conditional_t<(kHeadDim <= 128), BwdTraits<kHeadDim, 64, 128, 8, 2, 4, 4>,
                                        BwdTraits<kHeadDim, 64, 64, 8, 2, 4, 4>>;

// The deterministic dQ kernel: query blocks of 64 (16 rows a warp), key blocks as the forward.
template <int kHeadDim>
using DqTraitsFor = std::conditional_t<(kHeadDim <= 128), FwdTraits<kHeadDim, 64, 64, 4>,
                                       FwdTraits<kHeadDim, 64, 32, 4>>;

template <typename T, int kHeadDim>
struct Launch {
  static cudaError_t run(const BwdParams& p, cudaStream_t stream);
};

template <typename T, int kHeadDim>
cudaError_t Launch<T, kHeadDim>::run(const BwdParams& p, cudaStream_t stream) {
  using Traits = BwdTraitsFor<kHeadDim>;
  const AttentionShape& sh = p.shape;
  const int64_t rows = sh.batch * sh.seq_q * sh.heads_q;
  constexpr int kRowThreads = prepare_threads_per_row(kHeadDim);
  flash_bwd_prepare_kernel<T, kRowThreads><<<(rows * kRowThreads + 255) / 256, 256, 0, stream>>>(p);
  if (cudaError_t e = cudaGetLastError()) return e;

  if (sh.seq_k > 0) {  // with no keys, dK and dV are empty and dQ stays 0
    const dim3 grid((sh.seq_k + Traits::kBlockN - 1) / Traits::kBlockN, sh.heads_k, sh.batch);
    const cudaError_t e = backward_kernel(p) == KernelFamily::kSm90
                              ? launch_flash_bwd_main_sm90(p, stream)
                              : launch_with_smem(flash_bwd_kernel<Traits, T>, grid, Traits::kThreads,
                                                 Traits::kSmemBytes, stream, p);
    if (e != cudaSuccess) return e;
  }

  if (p.deterministic) {
    using DqTraits = DqTraitsFor<kHeadDim>;
    constexpr int dq_smem = 2 * (2 * DqTraits::QTile::kElements + 4 * DqTraits::KVTile::kElements);
    const dim3 dq_grid((sh.seq_q + DqTraits::kBlockM - 1) / DqTraits::kBlockM, sh.heads_q, sh.batch);
    return launch_with_smem(flash_bwd_dq_kernel<DqTraits, T>, dq_grid, DqTraits::kThreads, dq_smem, stream, p);
  }
  const int64_t groups = rows * sh.head_dim / 8;  // the convert kernel's 8 elements a thread
  const int blocks = static_cast<int>(std::min<int64_t>((groups + 255) / 256, 65536));
  flash_bwd_convert_dq_kernel<T><<<blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_flash_bwd(const BwdParams& params, cudaStream_t stream) {
  if (params.shape.batch == 0 || params.shape.seq_q == 0) return cudaSuccess;  // empty outputs
  return dispatch_dtype_head_dim<Launch>(params, stream);
}

}  // namespace jax_flash::cuda
