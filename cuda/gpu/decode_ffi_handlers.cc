// XLA FFI handlers of the CUDA split-KV decode: the CPU decode's signatures and checks
// (common/decode_ffi_params.h), then the CUDA kernels' own limits, then a launch on XLA's
// stream. No allocation (the split workspaces are outputs), no synchronisation and no reads of
// device data (the paged handler leaves the page table to the kernel, which turns a sequence
// reaching a bad entry into NaN), so both are safe to capture in CUDA graphs.
#include "gpu/decode_ffi_handlers.h"

#include <cuda_runtime.h>

#include <climits>
#include <string>

#include "common/decode_ffi_params.h"
#include "gpu/flash_decode.h"
#include "gpu/kernel_choice.h"
#include "gpu/launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

// No misspelt kernel choice (gpu/kernel_choice.h); bfloat16/float16; the head dim a multiple of kHeadDimMultiple (the Python side pads it) and at
// most the decode kernel's largest; grids that fit a launch.
ffi::Error check_cuda_decode(const ffi::AnyBuffer& q, const DecodeParams& params) {
  if (const std::string& error = cuda::kernel_override_error(); !error.empty())
    return ffi::Error::InvalidArgument(error);
  if (params.dtype == Dtype::kFloat32)
    return invalid("the CUDA decode kernel takes bfloat16 or float16; got " + describe("q", q));
  if (params.shape.head_dim % cuda::kHeadDimMultiple != 0 || params.shape.head_dim > cuda::kDecodeMaxHeadDim)
    return invalid("the CUDA decode kernel needs the head dim a multiple of " +
                   std::to_string(cuda::kHeadDimMultiple) + " and at most " +
                   std::to_string(cuda::kDecodeMaxHeadDim) + "; got " + describe("q", q));
  if (cuda::decode_split_ctas(params.shape, params.num_splits) > INT_MAX ||
      cuda::decode_combine_ctas(params.shape) > INT_MAX)
    return invalid("too many rows for one CUDA decode launch (batch x kv heads x num_splits x row tiles > " +
                   std::to_string(INT_MAX) + "); got " + describe("q", q) + ", num_splits=" +
                   std::to_string(params.num_splits));
  return ffi::Error::Success();
}

ffi::Error launch(const DecodeParams& params, cudaStream_t stream) {
  if (cudaError_t e = cuda::launch_flash_decode(params, stream))
    return ffi::Error::Internal(std::string("jax_flash: decode launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error run_decode(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                      ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> o_partial,
                      ffi::Result<ffi::AnyBuffer> lse_partial, double scale, bool is_causal,
                      int64_t window_left, int64_t window_right, int64_t num_splits) {
  DecodeParams params;
  JF_RETURN_IF_ERROR(make_decode_params(q, k, v, q_lens, kv_lens, *o, *lse, *o_partial, *lse_partial, scale,
                                        is_causal, window_left, window_right, num_splits, params));
  JF_RETURN_IF_ERROR(check_cuda_decode(q, params));
  return launch(params, stream);
}

ffi::Error run_paged(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                     ffi::AnyBuffer page_table, ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                     ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> o_partial,
                     ffi::Result<ffi::AnyBuffer> lse_partial, double scale, bool is_causal,
                     int64_t window_left, int64_t window_right, int64_t num_splits) {
  DecodeParams params;
  JF_RETURN_IF_ERROR(make_paged_shape_params(q, k_pages, v_pages, page_table, kv_lens, *o, *lse, *o_partial,
                                             *lse_partial, scale, is_causal, window_left, window_right,
                                             num_splits, params));
  JF_RETURN_IF_ERROR(check_cuda_decode(q, params));
  return launch(params, stream);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaFlashDecode, run_decode, decode_binding<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaFlashPaged, run_paged, paged_binding<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_flash
