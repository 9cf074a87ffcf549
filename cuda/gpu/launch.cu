// The one place a CUDA kernel is picked: the dtype and the compiled head dim (gpu/tile_shapes.cuh)
// become template constants, the family comes from gpu/kernel_choice.h (wgmma where a Hopper
// kernel exists for the head dim), and the backward's kernels are sequenced around the family's
// main kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstddef>
#include <optional>
#include <type_traits>

#include "gpu/bwd_postprocess.cuh"
#include "gpu/dq_accum_layout.cuh"
#include "gpu/kernel_choice.h"
#include "gpu/launch.h"
#include "gpu/score_mods.cuh"
#include "gpu/tile_shapes.cuh"

namespace jax_flash::cuda {
namespace {

// run(TypeTag<T>{}, std::integral_constant<int, D>{}) for the 16-bit dtype T and the smallest
// compiled head dim D >= head_dim (of JF_HEAD_DIMS; 96 skipped under JAX_FLASH_CUDA_HD96=padded,
// 192 where `skip_192`: pads_192_backward); cudaErrorInvalidValue for anything else. The mma.sync
// launchers then run at sm80_head_dim(D).
template <typename Run>
cudaError_t dispatch_dtype_head_dim(Dtype dtype, int64_t head_dim, Run&& run, bool skip_192 = false) {
  const bool native_96 = native_head_dim_96_enabled();
  auto with_type = [&](auto type) -> cudaError_t {
#define JF_HEAD_DIM_CASE(D) \
  if (head_dim <= D && (D != 96 || native_96) && (D != 192 || !skip_192)) \
    return run(type, std::integral_constant<int, D>{});
    JF_HEAD_DIMS(JF_HEAD_DIM_CASE)
#undef JF_HEAD_DIM_CASE
    return cudaErrorInvalidValue;
  };
  switch (dtype) {
    case Dtype::kBFloat16: return with_type(TypeTag<__nv_bfloat16>{});
    case Dtype::kFloat16: return with_type(TypeTag<__half>{});
    default: return cudaErrorInvalidValue;
  }
}

// The backward family of a call of this head dim: backward_family(), but mma.sync for head dims
// 129..192 under JAX_FLASH_CUDA_HD192_BWD=sm80.
KernelFamily backward_family_of(int64_t head_dim) {
  if (head_dim > 128 && head_dim <= 192 && head_dim_192_backward() == HeadDim192Backward::kSm80)
    return KernelFamily::kSm80;
  return backward_family();
}

// Whether a backward of this family runs head dims 129..192 on the kernels of 256 (the split wgmma
// backward, TMA zero-filling columns 192..255; session 28's default, 1.42-1.49x the mma.sync one
// at 192 on the H200): under JAX_FLASH_CUDA_HD192_BWD=padded, on Hopper, not deterministic (whose
// dQ kernel would run padded too).
bool pads_192_backward(KernelFamily family, bool deterministic) {
  return head_dim_192_backward() == HeadDim192Backward::kPadded && family != KernelFamily::kSm80 && !deterministic &&
         device_compute_major() == 9;
}

}  // namespace

bool tiled_dq_accum(const AttentionShape& shape) {
  const KernelFamily family = backward_family_of(shape.head_dim);
  bool tiled_kernel = false;  // the call's compiled head dim has the tiled kernel (128's)
  dispatch_dtype_head_dim(Dtype::kBFloat16, shape.head_dim, [&](auto, auto head_dim) -> cudaError_t {
    tiled_kernel = TileShapes<decltype(head_dim)::value>::kHasSm90BwdTiledDq;
    return cudaSuccess;
  });
  return tiled_kernel && (((family == KernelFamily::kSm90Ws || family == KernelFamily::kSm90WsM80 ||
                            family == KernelFamily::kSm90WsDeferDq || family == KernelFamily::kSm90WsStageDq) &&
                           shape.head_dim == 128) ||
                          family == KernelFamily::kSm90WsTiledDq);
}

bool staged_dq_accum(const AttentionShape& shape, bool deterministic) {
  const KernelFamily family = backward_family_of(shape.head_dim);
  if (family != KernelFamily::kSm90WsStageDq || deterministic) return false;
  bool staged_kernel = false;  // the call's compiled head dim has the staged kernel (256's)
  dispatch_dtype_head_dim(
      Dtype::kBFloat16, shape.head_dim,
      [&](auto, auto head_dim) -> cudaError_t {
        staged_kernel = TileShapes<decltype(head_dim)::value>::kHasSm90BwdStageDq;
        return cudaSuccess;
      },
      pads_192_backward(family, deterministic));
  return staged_kernel;
}

int kv_head_splits(const AttentionShape& shape, bool deterministic) {
  if (deterministic || shape.heads_k <= 0 || shape.heads_q <= shape.heads_k) return 1;
  if (shape.head_dim_v != shape.head_dim) return 1;  // (the float32 dK and dV accumulators have one head dim)
  const KernelFamily family = backward_family_of(shape.head_dim);
  if (family == KernelFamily::kSm80 || device_compute_major() != 9) return 1;
  // The Hopper backward's key blocks at the compiled head dim the call runs on (0: none there).
  int64_t block_n = 0;
  dispatch_dtype_head_dim(
      Dtype::kBFloat16, shape.head_dim,
      [&](auto, auto head_dim) -> cudaError_t {
        constexpr int kD = decltype(head_dim)::value;
        if constexpr (TileShapes<kD>::kHasSm90Bwd) block_n = TileShapes<kD>::Sm90BwdWs::kBlockN;
        return cudaSuccess;
      },
      pads_192_backward(family, deterministic));
  if (block_n == 0) return 1;
  const int64_t ctas = (shape.seq_k + block_n - 1) / block_n * shape.heads_k * shape.batch;
  const int64_t wanted = device_sm_count() * 3 / 2, group = shape.heads_q / shape.heads_k;
  for (int64_t d = 1; d <= group; ++d)
    if (group % d == 0 && ctas * d >= wanted) return static_cast<int>(d);
  return static_cast<int>(group);
}

int key_major_groups(const BwdParams& p, dim3 grid) {
  const int64_t key_blocks = grid.x;
  if (!p.mask.causal || key_blocks <= 1 || !longest_first_enabled()) return 0;
  const int64_t two_waves = 2 * std::max(1, device_sm_count());
  const int64_t group_ctas = key_blocks * (p.batch_innermost ? grid.z : 1);  // a group's CTAs
  return static_cast<int>(std::max<int64_t>(1, (two_waves + group_ctas - 1) / group_ctas));
}

bool transposed_dq_accum(const AttentionShape& shape) {
  return backward_family() == KernelFamily::kSm90WsM80 && shape.head_dim == 128;
}

bool defer_dq_call(const BwdParams& p) {
  return backward_family() == KernelFamily::kSm90WsDeferDq && p.shape.head_dim == 128 && !p.deterministic &&
         !general_kernel(p) && !narrow_plain_call(p);
}

bool m80_call(const BwdParams& p) {
  return transposed_dq_accum(p.shape) && !p.deterministic && !general_kernel(p) && !narrow_plain_call(p);
}

namespace {

// The compiled head dim that a call of this head dim runs at (dispatch_dtype_head_dim's); 0 for
// none.
int compiled_head_dim(int64_t head_dim) {
  int compiled = 0;
  dispatch_dtype_head_dim(Dtype::kBFloat16, head_dim, [&](auto, auto d) -> cudaError_t {
    compiled = decltype(d)::value;
    return cudaSuccess;
  });
  return compiled;
}

// The options of a warp-specialised forward `family` (any wgmma forward family) for call `p`.
Sm90FwdOptions sm90_fwd_options(KernelFamily family, const FwdParams& p) {
  Sm90FwdOptions options;
  options.grid = forward_grid_override();  // (unset: the launch's measured deal)
  options.tensor_sums = family != KernelFamily::kSm90WsAluSums;
  options.tma_store = family != KernelFamily::kSm90WsDirectStore;
  options.tiles = family == KernelFamily::kSm90WsNarrow ? Sm90FwdTiles::kNarrow
                  : family == KernelFamily::kSm90WsWide ? Sm90FwdTiles::kWide
                                                        : Sm90FwdTiles::kMeasured;
  return options;
}

// The (H, Hv) pairs of each pass's kernels (gpu/tile_shapes.cuh's X-macros), as arrays.
struct HeadDimPair {
  int head_dim, head_dim_v;
};
#define JF_PAIR_ENTRY(D, DV) HeadDimPair{D, DV},
constexpr HeadDimPair kForwardPairs[] = {JF_SM90_FWD_VALUE_HEAD_DIMS(JF_PAIR_ENTRY)};
constexpr HeadDimPair kBackwardPairs[] = {JF_SM90_BWD_VALUE_HEAD_DIMS(JF_PAIR_ENTRY)};
#undef JF_PAIR_ENTRY

// Whether the compiled head dims of the shape's H and Hv are one of `pairs`.
template <size_t kPairs>
bool compiled_pair_in(const HeadDimPair (&pairs)[kPairs], const AttentionShape& shape) {
  const int d = compiled_head_dim(shape.head_dim), dv = compiled_head_dim(shape.head_dim_v);
  for (const HeadDimPair& pair : pairs)
    if (pair.head_dim == d && pair.head_dim_v == dv) return true;
  return false;
}

}  // namespace

bool forward_takes_value_head_dim(const AttentionShape& shape) {
  if (shape.head_dim_v == shape.head_dim || !own_value_head_dim_enabled()) return false;
  if (forward_family() == KernelFamily::kSm80) return false;  // (as it is off Hopper)
  return compiled_pair_in(kForwardPairs, shape);
}

bool backward_takes_value_head_dim(const AttentionShape& shape, bool deterministic) {
  if (shape.head_dim_v == shape.head_dim || deterministic || !own_value_head_dim_enabled()) return false;
  const KernelFamily family = backward_family_of(shape.head_dim);  // (mma.sync off Hopper)
  if (family == KernelFamily::kSm80 || pads_192_backward(family, deterministic)) return false;
  return compiled_pair_in(kBackwardPairs, shape);
}

bool hopper_takes_logit_arrays(const AttentionShape& shape, bool backward, bool deterministic) {
  if (device_compute_major() != 9) return false;
  bool hopper_kernel = false;  // the call's compiled head dim has the pass's Hopper kernel
  dispatch_dtype_head_dim(Dtype::kBFloat16, shape.head_dim, [&](auto, auto head_dim) -> cudaError_t {
    constexpr int kD = decltype(head_dim)::value;
    hopper_kernel = backward ? TileShapes<kD>::kHasSm90Bwd : TileShapes<kD>::kHasSm90Fwd;
    return cudaSuccess;
  });
  if (!hopper_kernel) return false;
  if (!backward) return forward_family() != KernelFamily::kSm80;
  return !deterministic && backward_family_of(shape.head_dim) != KernelFamily::kSm80;
}

cudaError_t launch_flash_fwd(const FwdParams& p, cudaStream_t stream) {
  if (logit_arrays(p) && !hopper_takes_logit_arrays(p.shape, false, false)) return cudaErrorInvalidValue;
  if (p.shape.seq_q == 0 || p.shape.batch == 0) return cudaSuccess;
  if (p.shape.head_dim_v != p.shape.head_dim) {
    // A value head dim of its own: the pair's kernel (the handler checked that it runs), narrow
    // calls included (their hi + lo P is the mma.sync kernels').
    if (!forward_takes_value_head_dim(p.shape)) return cudaErrorInvalidValue;
    const Sm90FwdOptions options = sm90_fwd_options(forward_family(), p);
    const int d = compiled_head_dim(p.shape.head_dim), dv = compiled_head_dim(p.shape.head_dim_v);
    auto run_pair = [&](auto type) -> cudaError_t {
      using T = typename decltype(type)::type;
#define JF_PAIR_CASE(D, DV) \
  if (d == D && dv == DV) return launch_fwd_sm90_ws<T, D, DV>(p, options, stream);
      JF_SM90_FWD_VALUE_HEAD_DIMS(JF_PAIR_CASE)
#undef JF_PAIR_CASE
      return cudaErrorInvalidValue;
    };
    return p.dtype == Dtype::kBFloat16 ? run_pair(TypeTag<__nv_bfloat16>{})
           : p.dtype == Dtype::kFloat16 ? run_pair(TypeTag<__half>{})
                                        : cudaErrorInvalidValue;
  }
  // Narrow calls (few keys a row) on the mma.sync kernels, with P and dS as hi + lo.
  const KernelFamily family = narrow_plain_call(p) ? KernelFamily::kSm80 : forward_family();
  return dispatch_dtype_head_dim(p.dtype, p.shape.head_dim, [&](auto type, auto head_dim) -> cudaError_t {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    if constexpr (TileShapes<kD>::kHasSm90Fwd) {
      // Every forward family but mma.sync is the warp-specialised kernel with options
      // (forward_family never gives a backward-only one).
      if (family != KernelFamily::kSm80) return launch_fwd_sm90_ws<T, kD>(p, sm90_fwd_options(family, p), stream);
    }
    return launch_fwd_sm80<T, sm80_head_dim(kD)>(p, stream);
  });
}

// Whether a Hopper variant's kernel adds dQ by atomics (sm90/bwd_steps.cuh add_dq; the others
// hand it off to bulk reductions), which then writes the accumulator in the quad order where
// gpu/dq_accum_layout.cuh's rule allows.
template <int kD>
bool sm90_dq_by_atomics(Sm90BwdVariant variant) {
  if constexpr (!TileShapes<kD>::kHasSm90Bwd) {
    return false;
  } else {
    return with_sm90_bwd_traits<kD>(variant, [](auto traits) { return !decltype(traits)::type::kBulkDq; });
  }
}

// dQ accumulator zeroed -> main (either family) -> convert dQ, or the deterministic dQ kernel
// instead of the atomics and the convert. delta = rowsum(dO * O) comes formed (BwdParams::delta).
cudaError_t launch_flash_bwd(const BwdParams& p, cudaStream_t stream) {
  if (logit_arrays(p) && !hopper_takes_logit_arrays(p.shape, true, p.deterministic)) return cudaErrorInvalidValue;
  // dbias (float32, the bias's shape) takes the kernel's atomics; zero where nothing runs.
  if (p.dbias_accum)
    if (cudaError_t e = cudaMemsetAsync(p.dbias_accum, 0, p.bias.elements * sizeof(float), stream)) return e;
  if (p.shape.batch == 0 || p.shape.seq_q == 0) return cudaSuccess;  // empty outputs
  // A value head dim of its own: the pair's kernel (the handler checked that it runs; narrow calls
  // included, whose hi + lo dS is the mma.sync kernels').
  const bool own_value_head_dim = p.shape.head_dim_v != p.shape.head_dim;
  if (own_value_head_dim && !backward_takes_value_head_dim(p.shape, p.deterministic)) return cudaErrorInvalidValue;
  const int compiled_value_head_dim = own_value_head_dim ? compiled_head_dim(p.shape.head_dim_v) : 0;
  // Deterministic calls with dropout run the mma.sync main kernel beside the mma.sync dQ kernel
  // (the Hopper kernel's deterministic instantiations have no dropout: compile time).
  const KernelFamily family = (narrow_plain_call(p) && !own_value_head_dim) || (p.deterministic && p.dropout_seeds)
                                  ? KernelFamily::kSm80
                                  : backward_family_of(p.shape.head_dim);
  const bool skip_192 = pads_192_backward(family, p.deterministic);
  return dispatch_dtype_head_dim(p.dtype, p.shape.head_dim, [&](auto type, auto head_dim) -> cudaError_t {
    using T = typename decltype(type)::type;
    constexpr int kD = decltype(head_dim)::value;
    const AttentionShape& sh = p.shape;
    const int64_t rows = sh.batch * sh.seq_q * sh.heads_q;
    // The atomics and bulk reductions add into the accumulator (a memset: a graph node when XLA
    // captures the call).
    const size_t dq_accum_bytes = static_cast<size_t>(dq_accum_elements(sh, false)) * sizeof(float);
    // dQ in tiles: the tiled kernel and its convert, where the call runs the Hopper backward and
    // tiled_dq_accum says so (narrow calls run mma.sync: the accumulator is as large, in rows).
    constexpr bool kTiledDqKernel = TileShapes<kD>::kHasSm90BwdTiledDq;
    const bool tiled = kTiledDqKernel && family != KernelFamily::kSm80 && tiled_dq_accum(sh);
    // 80-row visits with dQ^T in tiles (experimental: sm90ws_m80), and their own convert.
    const bool m80 = TileShapes<kD>::kHasSm90BwdM80 && m80_call(p);
    // The split kernels' dQ through the stage, in tiles (experimental: sm90ws_stagedq); narrow
    // calls run mma.sync (the accumulator is as large, in rows).
    const bool staged = TileShapes<kD>::kHasSm90BwdStageDq && family != KernelFamily::kSm80 && staged_dq_accum(sh, p.deterministic);
    if (!p.deterministic)
      if (cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, dq_accum_bytes, stream)) return e;

    // The Hopper backward's head splits (kv_head_splits) in plain calls (segment ids' and block
    // masks' walks take the whole group; the score variants' kernels have not run split yet):
    // dK and dV then come from float32 accumulators after the dQ part of the workspace.
    BwdParams hp = p;
    if (TileShapes<kD>::kHasSm90Bwd && family != KernelFamily::kSm80 && !general_kernel(p) && !m80)
      hp.kv_head_splits = kv_head_splits(sh, p.deterministic);
    if (hp.kv_head_splits > 1) hp.dkv_accum = p.dq_accum + dq_part_elements(sh);

    // The Hopper variant that runs the main kernel, if one does.
    std::optional<Sm90BwdVariant> sm90_variant;
    if constexpr (TileShapes<kD>::kHasSm90Bwd) {
      using V = Sm90BwdVariant;
      constexpr V kDefault = TileShapes<kD>::kHasSm90BwdBlockM128    ? V::kBlockM128
                             : TileShapes<kD>::kSm90BwdBulkDqByDefault ? V::kBulkDq
                                                                       : V::kAtomicDq;
      if (m80)
        sm90_variant = V::kM80;
      else if (staged)
        sm90_variant = V::kStageDq;
      else if (tiled)
        sm90_variant = defer_dq_call(p) ? V::kDeferDq : V::kTiledDq;
      else if (family == KernelFamily::kSm90Ws || family == KernelFamily::kSm90WsM80 ||
               family == KernelFamily::kSm90WsDeferDq || family == KernelFamily::kSm90WsTiledDq ||
               family == KernelFamily::kSm90WsStageDq)
        sm90_variant = kDefault;
      else if (family == KernelFamily::kSm90WsAtomicDq)
        sm90_variant = V::kAtomicDq;
      else if (family == KernelFamily::kSm90WsBulkDq)
        sm90_variant = V::kBulkDq;
    }
    // Whether the main kernel adds dQ by atomics in the quad order (gpu/dq_accum_layout.cuh's
    // rule), which the convert below then reads: a Hopper variant whose kernel adds dQ by atomics
    // (the kernel applies the rule itself); the mma.sync kernel on a Hopper device, whose sm_90a
    // build writes quads (BwdParams::dq_quads; +12-13% on head dim 192's backward, session 28).
    const bool quad_order_kernel = sm90_variant ? sm90_dq_by_atomics<kD>(*sm90_variant) : device_compute_major() == 9;
    const bool dq_quads = quad_order_kernel && !p.deterministic && dq_accum_in_quads(p.dq_accum, sh.head_dim);
    if (!sm90_variant) hp.dq_quads = dq_quads;
    // The Hopper main kernel: of the head dim, or of the (H, Hv) pair.
    auto launch_sm90_main = [&](Sm90BwdVariant variant) -> cudaError_t {
      if constexpr (TileShapes<kD>::kHasSm90Bwd) {
        if (!own_value_head_dim) return launch_bwd_main_sm90_ws<T, kD>(hp, variant, stream);
#define JF_PAIR_CASE(D, DV) \
  if constexpr (kD == D)    \
    if (compiled_value_head_dim == DV) return launch_bwd_main_sm90_ws<T, D, DV>(hp, variant, stream);
        JF_SM90_BWD_VALUE_HEAD_DIMS(JF_PAIR_CASE)
#undef JF_PAIR_CASE
      }
      return cudaErrorInvalidValue;
    };
    if (sh.seq_k > 0) {  // with no keys, dK and dV are empty and dQ stays 0
      const cudaError_t e = sm90_variant ? launch_sm90_main(*sm90_variant)
                                         : launch_bwd_main_sm80<T, sm80_head_dim(kD)>(hp, stream);
      if (e != cudaSuccess) return e;
      if (hp.kv_head_splits > 1) {
        const int64_t groups = 2 * sh.batch * sh.seq_k * sh.heads_k * sh.head_dim / 8;  // a thread's 8
        const int blocks = static_cast<int>(std::min<int64_t>((groups + 255) / 256, 65536));
        flash_bwd_convert_dkv_kernel<T><<<blocks, 256, 0, stream>>>(hp);
        if (cudaError_t e2 = cudaGetLastError()) return e2;
      }
    }

    if (p.deterministic) return launch_bwd_dq_sm80<T, sm80_head_dim(kD)>(p, stream);
    if (m80) {  // a CTA a tile
      const int64_t tiles = sh.batch * sh.heads_q * ((sh.seq_q + kTransposedDqRows - 1) / kTransposedDqRows);
      const int blocks = static_cast<int>(std::min<int64_t>(tiles, 1 << 20));
      flash_bwd_convert_transposed_dq_kernel<T><<<blocks, 256, 0, stream>>>(p);
      return cudaGetLastError();
    }
    if (tiled || staged) {
      const int columns = static_cast<int>(tiled ? kTiledDqColumns : staged_dq_columns(sh));
      const int64_t quads = dq_tiles_elements(sh, kTiledDqRows, columns) / 4;  // the convert's float4 a thread
      const int blocks = static_cast<int>(std::min<int64_t>((quads + 255) / 256, 65536));
      if (columns == 128)
        flash_bwd_convert_tiled_dq_kernel<T, 128><<<blocks, 256, 0, stream>>>(p);
      else if (columns == 192)
        flash_bwd_convert_tiled_dq_kernel<T, 192><<<blocks, 256, 0, stream>>>(p);
      else if (columns == 256)
        flash_bwd_convert_tiled_dq_kernel<T, 256><<<blocks, 256, 0, stream>>>(p);
      else
        return cudaErrorInvalidValue;  // no tiled dQ of another width (gpu/launch.h staged_dq_columns)
      return cudaGetLastError();
    }
    // The Hopper kernels leave the softmax scale out of dS (sm90/bwd_steps.cuh
    // transposed_score_gradients); dQ takes it here.
    const float dq_scale = sm90_variant ? p.scale : 1.f;
    if (dq_quads) {
      const int64_t groups = rows * sh.head_dim / 16;  // a thread's 16-column group
      const int blocks = static_cast<int>(std::min<int64_t>((groups + 255) / 256, 65536));
      flash_bwd_convert_quad_dq_kernel<T><<<blocks, 256, 0, stream>>>(p, dq_scale);
      return cudaGetLastError();
    }
    const int64_t groups = rows * sh.head_dim / 8;  // the convert kernel's 8 elements a thread
    const int blocks = static_cast<int>(std::min<int64_t>((groups + 255) / 256, 65536));
    flash_bwd_convert_dq_kernel<T><<<blocks, 256, 0, stream>>>(p, dq_scale);
    return cudaGetLastError();
  }, skip_192);
}

}  // namespace jax_flash::cuda
