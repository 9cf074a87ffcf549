// XLA FFI handlers for the CUDA kernels: shapes and attributes in, FwdParams / BwdParams out,
// kernels launched on XLA's stream. No allocation, synchronisation or device reads happen here,
// so the handlers are safe to capture in CUDA graphs (kCmdBufferCompatible).
#include "gpu/ffi_handlers.h"

#include <cuda_runtime.h>

#include <optional>
#include <string>
#include <utility>

#include "common/ffi_params.h"
#include "gpu/kernel_choice.h"
#include "gpu/launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

ffi::Error cuda_error(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("jax_flash: ") + what + ": " + cudaGetErrorString(e));
}

// The CUDA kernels take bfloat16/float16 with the head dim a multiple of kHeadDimMultiple (the
// Python side pads it); anything else is a caller bug, reported with the shape.
ffi::Error check_cuda_inputs(const ffi::AnyBuffer& q, const AttentionShape& shape, Dtype dtype) {
  if (const std::string& error = cuda::kernel_override_error(); !error.empty())
    return ffi::Error::InvalidArgument(error);
  if (dtype == Dtype::kFloat32)
    return invalid("the CUDA kernels take bfloat16 or float16; got " + describe("q", q));
  if (shape.head_dim % cuda::kHeadDimMultiple != 0 || shape.head_dim_v % cuda::kHeadDimMultiple != 0)
    return invalid("the CUDA kernels need the head dims padded to a multiple of " +
                   std::to_string(cuda::kHeadDimMultiple) + "; got " + describe("q", q) + " and v's head dim Hv=" +
                   std::to_string(shape.head_dim_v));
  return ffi::Error::Success();
}

// A pass whose value head dim Hv differs from H: only where a kernel of that pair runs it
// (gpu/launch.h forward_takes_value_head_dim, and for the backward, given `deterministic`,
// backward_takes_value_head_dim); the Python side pads v (and dO) to H elsewhere.
ffi::Error check_value_head_dim(const AttentionShape& s, std::optional<bool> deterministic = std::nullopt) {
  if (s.head_dim_v == s.head_dim) return ffi::Error::Success();
  const bool backward = deterministic.has_value();
  if (backward ? cuda::backward_takes_value_head_dim(s, *deterministic) : cuda::forward_takes_value_head_dim(s))
    return ffi::Error::Success();
  return invalid("v's head dim Hv=" + std::to_string(s.head_dim_v) + " differs from q and k's H=" +
                 std::to_string(s.head_dim) + ", and no CUDA " + (backward ? "backward" : "forward") +
                 " of that pair runs this call (the kernels of gpu/tile_shapes.cuh JF_SM90_" +
                 (backward ? "BWD" : "FWD") + "_VALUE_HEAD_DIMS, on Hopper, unless " +
                 "JAX_FLASH_CUDA_VALUE_HEAD_DIM=padded" + (backward ? "; not deterministic" : "") + "): pad v" +
                 (backward ? " and do" : "") + " to H");
}

// The block mask's lists (gpu/block_sparse.cuh; jax_flash._ops.block_sparse_lists forms them):
// with block_sparse, kv_lists (..., N, Tb, Sb) and kv_counts (..., N, Tb), and for the backward
// (q_visits non-null) q_visits (..., K, Sb, N / K * Tb) and q_counts (..., K, Sb), all int32,
// with Tb, Sb = ceil(T / 128), ceil(S / 128) and q's batch dims; without, every one empty.
ffi::Error set_block_lists(const ffi::AnyBuffer& kv_lists, const ffi::AnyBuffer& kv_counts,
                           const ffi::AnyBuffer* q_visits, const ffi::AnyBuffer* q_counts, bool block_sparse,
                           const ffi::AnyBuffer& q, AttentionParams& params) {
  const ffi::AnyBuffer* buffers[] = {&kv_lists, &kv_counts, q_visits, q_counts};
  const char* names[] = {"kv_block_lists", "kv_block_counts", "q_block_visits", "q_block_visit_counts"};
  for (int i = 0; i < 4; ++i)
    if (buffers[i]) JF_RETURN_IF_ERROR(expect_dtype(names[i], *buffers[i], ffi::DataType::S32));
  if (!block_sparse) {
    for (int i = 0; i < 4; ++i)
      if (buffers[i] && buffers[i]->element_count() != 0)
        return invalid(std::string("block_sparse=false takes empty block-list operands; got ") +
                       describe(names[i], *buffers[i]));
    return ffi::Error::Success();
  }
  const AttentionShape& sh = params.shape;
  const int64_t tb = (sh.seq_q + kBlockMaskRows - 1) / kBlockMaskRows;
  const int64_t sb = (sh.seq_k + kBlockMaskKeys - 1) / kBlockMaskKeys;
  const std::string blocks = " (Tb, Sb = ceil(T / " + std::to_string(kBlockMaskRows) + "), ceil(S / " +
                             std::to_string(kBlockMaskKeys) + ")) for " + describe("q", q);
  if (!has_batch_dims_then(kv_lists, q, {sh.heads_q, tb, sb}))
    return invalid(describe("kv_block_lists", kv_lists) + ": must be q's batch dims and (N, Tb, Sb)" + blocks);
  if (!has_batch_dims_then(kv_counts, q, {sh.heads_q, tb}))
    return invalid(describe("kv_block_counts", kv_counts) + ": must be q's batch dims and (N, Tb)" + blocks);
  const int64_t group = sh.heads_q / sh.heads_k;
  if (q_visits && !has_batch_dims_then(*q_visits, q, {sh.heads_k, sb, group * tb}))
    return invalid(describe("q_block_visits", *q_visits) + ": must be q's batch dims and (K, Sb, N / K * Tb)" +
                   blocks);
  if (q_counts && !has_batch_dims_then(*q_counts, q, {sh.heads_k, sb}))
    return invalid(describe("q_block_visit_counts", *q_counts) + ": must be q's batch dims and (K, Sb)" + blocks);
  params.block_mask_q_blocks = tb;
  params.block_mask_k_blocks = sb;
  params.kv_block_lists = kv_lists.typed_data<int32_t>();
  params.kv_block_counts = kv_counts.typed_data<int32_t>();
  if (q_visits) params.q_block_visits = q_visits->typed_data<int32_t>();
  if (q_counts) params.q_block_visit_counts = q_counts->typed_data<int32_t>();
  return ffi::Error::Success();
}

// Fused dropout runs in the kernels' dropout instantiations (gpu/dropout_fragments.h), which have
// no ids' code: not beside segment ids or a block mask.
ffi::Error check_dropout(const AttentionParams& params) {
  if (params.dropout_seeds == nullptr) return ffi::Error::Success();
  if (params.q_segment_ids != nullptr || params.kv_block_lists != nullptr)
    return invalid("dropout on the CUDA kernels: not beside segment ids or a block mask yet; use "
                   "implementation=\"blockwise\" for this call");
  return ffi::Error::Success();
}

// jax.nn's bias and mask arrays (common/ffi_params.h set_logit_arrays) run in the Hopper kernels'
// kLogitArrays instantiations (gpu/logit_arrays.cuh; experimental): not beside dropout, segment
// ids (a mask array decides the rows' emptiness alone) or, with a bias, a soft cap (dS there
// holds the cap's chain rule, which dbias must not); a bias of the inputs' dtype or float32.
ffi::Error check_logit_arrays(const AttentionParams& params, bool backward, bool deterministic) {
  if (!logit_arrays(params)) return ffi::Error::Success();
  const char* instead = "; use implementation=\"blockwise\" for this call";
  if (!cuda::hopper_takes_logit_arrays(params.shape, backward, deterministic))
    return invalid(std::string("bias and mask arrays on the CUDA kernels: the Hopper kernels only (on an H100/H200, ") +
                   "head dims above 32, no JAX_FLASH_CUDA_* override to the mma.sync family" +
                   (backward ? ", not deterministic" : "") + "); head dim " + std::to_string(params.shape.head_dim) +
                   " here" + instead);
  if (params.dropout_seeds != nullptr || params.q_segment_ids != nullptr)
    return invalid(std::string("bias and mask arrays on the CUDA kernels: not beside dropout or segment ids yet") +
                   instead);
  if (params.bias && params.logits_soft_cap > 0.f)
    return invalid(std::string("a bias array on the CUDA kernels: not beside logits_soft_cap yet") + instead);
  if (params.bias && params.bias.dtype != Dtype::kFloat32 && params.bias.dtype != params.dtype)
    return invalid("a bias array on the CUDA kernels: float32 or the inputs' dtype (the Python side casts others)");
  return ffi::Error::Success();
}

// The backward's dbias result: float32 in the bias's shape, which the launch zeroes and the
// kernel's atomics sum into (the Python side casts it to the bias's dtype); a float32 (0,) with
// no bias, or for a bias nothing differentiates.
ffi::Error set_cuda_dbias(ffi::AnyBuffer& dbias, const ffi::AnyBuffer& bias, BwdParams& params) {
  if (!params.bias || (dbias.dimensions().size() == 1 && dbias.element_count() == 0))
    return expect_float32("dbias", dbias, 0);
  JF_RETURN_IF_ERROR(expect_float32("dbias", dbias, static_cast<int64_t>(bias.element_count())));
  if (dbias.dimensions().size() != bias.dimensions().size())
    return invalid(describe("dbias", dbias) + ": must have the shape of " + describe("bias", bias));
  for (size_t i = 0; i < bias.dimensions().size(); ++i)
    if (dbias.dimensions()[i] != bias.dimensions()[i])
      return invalid(describe("dbias", dbias) + ": must have the shape of " + describe("bias", bias));
  params.dbias_accum = dbias.typed_data<float>();
  return ffi::Error::Success();
}

// The forward's scheduler workspace: int32, at least kFwdSchedulerElements elements (vmap
// prepends its batch dims; the kernel uses the first). The launch zeroes what it uses.
ffi::Error set_tile_counter(const ffi::AnyBuffer& scheduler, FwdParams& params) {
  JF_RETURN_IF_ERROR(expect_dtype("scheduler", scheduler, ffi::DataType::S32));
  if (static_cast<int64_t>(scheduler.element_count()) < cuda::kFwdSchedulerElements)
    return invalid(describe("scheduler", scheduler) + ": must hold at least " +
                   std::to_string(cuda::kFwdSchedulerElements) + " int32 elements");
  params.tile_counter = scheduler.typed_data<int32_t>();
  return ffi::Error::Success();
}

ffi::Error run_fwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::AnyBuffer> lse, double scale, bool is_causal, int64_t window_left,
                   int64_t window_right, ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                   bool segment_ids, ffi::AnyBuffer q_segment_id_spans, ffi::AnyBuffer kv_segment_id_spans,
                   double logits_soft_cap, ffi::AnyBuffer alibi_slopes, bool alibi, ffi::AnyBuffer kv_block_lists,
                   ffi::AnyBuffer kv_block_counts, bool block_sparse, ffi::AnyBuffer dropout_seeds,
                   double dropout_rate, ffi::AnyBuffer bias, bool has_bias, ffi::AnyBuffer mask, bool has_mask,
                   ffi::Result<ffi::AnyBuffer> o_error, ffi::Result<ffi::AnyBuffer> scheduler) {
  FwdParams params;
  JF_RETURN_IF_ERROR(make_fwd_params(q, k, v, q_lens, kv_lens, *o, *lse, scale, is_causal,
                                     window_left, window_right, params, ValueHeadDim::kOwn));
  JF_RETURN_IF_ERROR(check_cuda_inputs(q, params.shape, params.dtype));
  JF_RETURN_IF_ERROR(set_segment_ids(q_segment_ids, kv_segment_ids, segment_ids, q, k, params));
  JF_RETURN_IF_ERROR(
      set_segment_id_spans(q_segment_id_spans, kv_segment_id_spans, q_segment_ids, kv_segment_ids, params));
  JF_RETURN_IF_ERROR(attention_soft_cap(logits_soft_cap, params.logits_soft_cap));
  JF_RETURN_IF_ERROR(set_alibi_slopes(alibi_slopes, alibi, q, params));
  JF_RETURN_IF_ERROR(set_block_lists(kv_block_lists, kv_block_counts, nullptr, nullptr, block_sparse, q, params));
  JF_RETURN_IF_ERROR(set_dropout(dropout_seeds, dropout_rate, q, params));
  JF_RETURN_IF_ERROR(check_dropout(params));
  JF_RETURN_IF_ERROR(set_logit_arrays(bias, has_bias, mask, has_mask, q, params, MaskOperand::kBitsQueryRows));
  JF_RETURN_IF_ERROR(check_logit_arrays(params, false, false));
  JF_RETURN_IF_ERROR(set_o_error(*o_error, *o, params));
  JF_RETURN_IF_ERROR(set_tile_counter(*scheduler, params));
  JF_RETURN_IF_ERROR(check_value_head_dim(params.shape));
  params.o_vector_stores = cuda::vector_stores_enabled();
  if (cudaError_t e = cuda::launch_flash_fwd(params, stream)) return cuda_error("forward launch", e);
  return ffi::Error::Success();
}

ffi::Error run_bwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer lse, ffi::AnyBuffer delta, ffi::AnyBuffer d_o, ffi::AnyBuffer q_lens,
                   ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> dq,
                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                   ffi::Result<ffi::AnyBuffer> dq_accum, double scale, bool is_causal, int64_t window_left,
                   int64_t window_right, bool deterministic, ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                   bool segment_ids, ffi::AnyBuffer q_segment_id_spans, ffi::AnyBuffer kv_segment_id_spans,
                   double logits_soft_cap, ffi::AnyBuffer alibi_slopes, bool alibi, ffi::AnyBuffer kv_block_lists,
                   ffi::AnyBuffer kv_block_counts, ffi::AnyBuffer q_block_visits, ffi::AnyBuffer q_block_visit_counts,
                   bool block_sparse, ffi::AnyBuffer dropout_seeds, double dropout_rate, ffi::AnyBuffer bias,
                   bool has_bias, ffi::AnyBuffer mask, bool has_mask, ffi::Result<ffi::AnyBuffer> dbias) {
  BwdParams params;
  JF_RETURN_IF_ERROR(make_bwd_params_without_o(q, k, v, lse, d_o, q_lens, kv_lens, *dq, *dk, *dv, delta, scale,
                                               is_causal, window_left, window_right, params, ValueHeadDim::kOwn));
  JF_RETURN_IF_ERROR(check_cuda_inputs(q, params.shape, params.dtype));
  JF_RETURN_IF_ERROR(check_value_head_dim(params.shape, deterministic));
  JF_RETURN_IF_ERROR(set_segment_ids(q_segment_ids, kv_segment_ids, segment_ids, q, k, params));
  JF_RETURN_IF_ERROR(
      set_segment_id_spans(q_segment_id_spans, kv_segment_id_spans, q_segment_ids, kv_segment_ids, params));
  JF_RETURN_IF_ERROR(attention_soft_cap(logits_soft_cap, params.logits_soft_cap));
  JF_RETURN_IF_ERROR(set_alibi_slopes(alibi_slopes, alibi, q, params));
  JF_RETURN_IF_ERROR(set_block_lists(kv_block_lists, kv_block_counts, &q_block_visits, &q_block_visit_counts,
                                     block_sparse, q, params));
  JF_RETURN_IF_ERROR(set_dropout(dropout_seeds, dropout_rate, q, params));
  JF_RETURN_IF_ERROR(check_dropout(params));
  JF_RETURN_IF_ERROR(set_logit_arrays(bias, has_bias, mask, has_mask, q, params, MaskOperand::kBitsKeyRows));
  JF_RETURN_IF_ERROR(set_cuda_dbias(*dbias, bias, params));
  JF_RETURN_IF_ERROR(check_logit_arrays(params, true, deterministic));
  JF_RETURN_IF_ERROR(
      expect_float32("dq_accum", *dq_accum, cuda::dq_accum_elements(params.shape, deterministic)));
  params.dq_accum = deterministic ? nullptr : dq_accum->typed_data<float>();
  params.deterministic = deterministic;
  if (cudaError_t e = cuda::launch_flash_bwd(params, stream)) return cuda_error("backward launch", e);
  return ffi::Error::Success();
}

// The CUDA backward's operands: the CPU's (common/ffi_params.h's bwd_binding) with delta, formed by
// XLA from o and its rounding error, in place of o (BwdParams::delta), and no delta workspace.
auto cuda_bwd_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()  // q
      .Arg<ffi::AnyBuffer>()  // k
      .Arg<ffi::AnyBuffer>()  // v
      .Arg<ffi::AnyBuffer>()  // lse (..., N, T) float32
      .Arg<ffi::AnyBuffer>()  // delta (..., N, T) float32: rowsum(dO * O)
      .Arg<ffi::AnyBuffer>()  // do, the output cotangent
      .Arg<ffi::AnyBuffer>()  // q_lens int32
      .Arg<ffi::AnyBuffer>()  // kv_lens int32
      .Ret<ffi::AnyBuffer>()  // dq
      .Ret<ffi::AnyBuffer>()  // dk
      .Ret<ffi::AnyBuffer>()  // dv
      .Ret<ffi::AnyBuffer>()  // dq_accum workspace float32 (gpu/launch.h: dq_accum_elements)
      .Attr<double>("scale")
      .Attr<bool>("is_causal")
      .Attr<int64_t>("window_left")
      .Attr<int64_t>("window_right");
}

// After the segment ids (with_segment_ids, as the CPU passes take them): their spans
// (gpu/segment_ids.cuh; set_segment_id_spans checks them), then the score modifications
// (gpu/score_mods.cuh), as the CPU passes take them: logit soft-capping ("logits_soft_cap",
// c > 0 or 0 for off; attention_soft_cap checks it) and ALiBi (one more operand and its switch;
// set_alibi_slopes checks them), then the block mask's lists (set_block_lists): the forward's
// two, the backward's four, and the switch "block_sparse".
template <typename Binding>
auto with_kernel_options(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q_segment_id_spans (..., ceil(T / 64), 2) int32, or (0,)
      .template Arg<ffi::AnyBuffer>()  // kv_segment_id_spans (..., ceil(S / 64), 2) int32, or (0,)
      .template Attr<double>("logits_soft_cap")
      .template Arg<ffi::AnyBuffer>()  // alibi_slopes (..., N) float32, or (0,) without
      .template Attr<bool>("alibi")
      .template Arg<ffi::AnyBuffer>()   // kv_block_lists (..., N, Tb, Sb) int32, or (0,)
      .template Arg<ffi::AnyBuffer>();  // kv_block_counts (..., N, Tb) int32, or (0,)
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaFlashFwd, run_fwd,
                              with_kernel_options(with_segment_ids(fwd_binding<ffi::PlatformStream<cudaStream_t>>()))
                                  .Attr<bool>("block_sparse")
                                  .Arg<ffi::AnyBuffer>()   // dropout_seeds (..., N, 4) uint32, or (0,) without
                                  .Attr<double>("dropout_rate")
                                  .Arg<ffi::AnyBuffer>()   // bias (..., N|1, T|1, S|1), or (0,) float32 without
                                  .Attr<bool>("bias")
                                  .Arg<ffi::AnyBuffer>()   // mask (..., N|1, T|1, S|1) bool, or (0,) without
                                  .Attr<bool>("mask")
                                  .Ret<ffi::AnyBuffer>()   // o_error int8, o's shape (o 16-bit) or empty
                                  .Ret<ffi::AnyBuffer>(),  // scheduler workspace int32 (kFwdSchedulerElements)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaFlashBwd, run_bwd,
                              with_kernel_options(with_segment_ids(cuda_bwd_binding().Attr<bool>("deterministic")))
                                  .Arg<ffi::AnyBuffer>()  // q_block_visits (..., K, Sb, N / K * Tb) int32, or (0,)
                                  .Arg<ffi::AnyBuffer>()  // q_block_visit_counts (..., K, Sb) int32, or (0,)
                                  .Attr<bool>("block_sparse")
                                  .Arg<ffi::AnyBuffer>()  // dropout_seeds (..., N, 4) uint32, or (0,) without
                                  .Attr<double>("dropout_rate")
                                  .Arg<ffi::AnyBuffer>()  // bias (..., N|1, T|1, S|1), or (0,) float32 without
                                  .Attr<bool>("bias")
                                  .Arg<ffi::AnyBuffer>()  // mask (..., N|1, T|1, S|1) bool, or (0,) without
                                  .Attr<bool>("mask")
                                  .Ret<ffi::AnyBuffer>(),  // dbias float32, the bias's shape, or (0,)
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_flash
