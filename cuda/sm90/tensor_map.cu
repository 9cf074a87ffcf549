// make_head_tensor_map: cuTensorMapEncodeTiled, reached through the runtime's driver entry point
// (the extension links the CUDA runtime statically and not libcuda).
#include "sm90/tensor_map.h"

#include <cudaTypedefs.h>

#include "gpu/logit_arrays.cuh"

namespace jax_flash::cuda {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      function = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

// A 4-dim descriptor of 16-bit `dtype` read in boxes of 64 innermost elements x 1 x `rows` x 1
// into shared memory with the 128-byte swizzle (a GmmaTile's 64-column block), zeros past the
// bounds.
CUresult encode_boxes(CUtensorMap* map, PFN_cuTensorMapEncodeTiled_v12000 encode, Dtype dtype, const void* base,
                      const cuuint64_t (&dims)[4], const cuuint64_t (&strides)[3], int rows) {
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode(map, dtype == Dtype::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace

cudaError_t make_head_tensor_map(CUtensorMap* map, const void* base, Dtype dtype, int64_t batch, int64_t seq,
                                 int64_t heads, int64_t head_dim, int rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_function();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (dtype != Dtype::kBFloat16 && dtype != Dtype::kFloat16) return cudaErrorInvalidValue;
  constexpr int64_t kBytes = 2;
  // Innermost first: head_dim, heads, seq, batch; strides (bytes) of all but the first.
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(seq), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_dim * kBytes),
                                 static_cast<cuuint64_t>(heads * head_dim * kBytes),
                                 static_cast<cuuint64_t>(seq * heads * head_dim * kBytes)};
  return encode_boxes(map, encode, dtype, base, dims, strides, rows) == CUDA_SUCCESS ? cudaSuccess
                                                                                    : cudaErrorInvalidValue;
}

cudaError_t make_bias_tensor_map(CUtensorMap* map, const AttentionParams& p, int rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_function();
  const LogitArray& a = p.bias;
  if (encode == nullptr || !bias_stages(p) || a.row == 0) return cudaErrorNotSupported;
  constexpr int64_t kBytes = 2;
  const AttentionShape& s = p.shape;
  // A broadcast dim (stride 0) has extent 1; its stride is never used, but must be a legal one.
  auto stride = [&](int64_t elements) { return static_cast<cuuint64_t>((elements ? elements : s.seq_k) * kBytes); };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(s.seq_k), static_cast<cuuint64_t>(a.head ? s.heads_q : 1),
                              static_cast<cuuint64_t>(s.seq_q),
                              static_cast<cuuint64_t>(a.batch ? (s.batch + a.batch_div - 1) / a.batch_div : 1)};
  const cuuint64_t strides[3] = {stride(a.head), stride(a.row), stride(a.batch)};
  return encode_boxes(map, encode, p.dtype, a.data, dims, strides, rows) == CUDA_SUCCESS ? cudaSuccess
                                                                                        : cudaErrorNotSupported;
}

cudaError_t make_qkv_tensor_maps(const AttentionParams& p, int q_rows, int kv_rows, CUtensorMap* q, CUtensorMap* k,
                                 CUtensorMap* v) {
  const AttentionShape& s = p.shape;
  if (cudaError_t e = make_head_tensor_map(q, p.q, p.dtype, s.batch, s.seq_q, s.heads_q, s.head_dim, q_rows)) return e;
  if (cudaError_t e = make_head_tensor_map(k, p.k, p.dtype, s.batch, s.seq_k, s.heads_k, s.head_dim, kv_rows)) return e;
  return make_head_tensor_map(v, p.v, p.dtype, s.batch, s.seq_k, s.heads_k, s.head_dim_v, kv_rows);
}

}  // namespace jax_flash::cuda
