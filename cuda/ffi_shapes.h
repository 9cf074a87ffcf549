// Reading attention shapes and dtypes out of XLA FFI buffers, with errors that name the operand
// and its shape. Shared by the CPU and CUDA handlers.
#pragma once

#include <cstdint>
#include <string>

#include "attention_params.h"
#include "xla/ffi/api/ffi.h"

#define JF_RETURN_IF_ERROR(expr)                        \
  do {                                                  \
    ::xla::ffi::Error jf_error_ = (expr);               \
    if (jf_error_.failure()) return jf_error_;          \
  } while (0)

namespace jax_flash {

inline constexpr int64_t kMaxHeadDim = 256;

inline std::string shape_string(xla::ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

inline int64_t leading_product(xla::ffi::Span<const int64_t> dims, size_t trailing) {
  int64_t n = 1;
  for (size_t i = 0; i + trailing < dims.size(); ++i) n *= dims[i];
  return n;
}

// q (..., T, N, H), k and v (..., S, K, H), q_lens and kv_lens with one entry per batch element;
// every leading dimension is folded into the batch (that is how vmap reaches the kernel).
inline xla::ffi::Error attention_shape(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k,
                                       const xla::ffi::AnyBuffer& v,
                                       const xla::ffi::Buffer<xla::ffi::S32>& q_lens,
                                       const xla::ffi::Buffer<xla::ffi::S32>& kv_lens,
                                       AttentionShape& shape) {
  using xla::ffi::Error;
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() < 3 || kd.size() != qd.size())
    return Error::InvalidArgument("jax_flash: q and k must have the same rank >= 3, got q" +
                                  shape_string(qd) + " k" + shape_string(kd));
  if (!(kd == vd))
    return Error::InvalidArgument("jax_flash: k and v shapes differ: k" + shape_string(kd) +
                                  " v" + shape_string(vd));
  const size_t r = qd.size();
  shape.batch = leading_product(qd, 3);
  shape.seq_q = qd[r - 3];
  shape.heads_q = qd[r - 2];
  shape.head_dim = qd[r - 1];
  shape.seq_k = kd[r - 3];
  shape.heads_k = kd[r - 2];
  if (leading_product(kd, 3) != shape.batch || kd[r - 1] != shape.head_dim ||
      shape.heads_k <= 0 || shape.heads_q % shape.heads_k != 0)
    return Error::InvalidArgument(
        "jax_flash: q" + shape_string(qd) + " and k" + shape_string(kd) +
        " need equal batch and head dim, and query heads a multiple of key/value heads");
  if (shape.head_dim > kMaxHeadDim)
    return Error::InvalidArgument("jax_flash: head dim " + std::to_string(shape.head_dim) +
                                  " is larger than the supported maximum of " +
                                  std::to_string(kMaxHeadDim));
  if (static_cast<int64_t>(q_lens.element_count()) != shape.batch ||
      static_cast<int64_t>(kv_lens.element_count()) != shape.batch)
    return Error::InvalidArgument("jax_flash: q_lens" + shape_string(q_lens.dimensions()) +
                                  " and kv_lens" + shape_string(kv_lens.dimensions()) +
                                  " need one entry per batch element (" +
                                  std::to_string(shape.batch) + ")");
  return Error::Success();
}

inline xla::ffi::Error attention_dtype(const xla::ffi::AnyBuffer& q, Dtype& dtype) {
  switch (q.element_type()) {
    case xla::ffi::DataType::F32: dtype = Dtype::kFloat32; break;
    case xla::ffi::DataType::BF16: dtype = Dtype::kBFloat16; break;
    case xla::ffi::DataType::F16: dtype = Dtype::kFloat16; break;
    default:
      return xla::ffi::Error::InvalidArgument(
          "jax_flash: unsupported dtype; float32, bfloat16 and float16 are supported");
  }
  return xla::ffi::Error::Success();
}

// `buffer` must have the shape and dtype of `like` (outputs and cotangents).
inline xla::ffi::Error expect_like(const char* name, const xla::ffi::AnyBuffer& buffer,
                                   const xla::ffi::AnyBuffer& like) {
  if (buffer.element_type() != like.element_type() || !(buffer.dimensions() == like.dimensions()))
    return xla::ffi::Error::InvalidArgument(std::string("jax_flash: ") + name + shape_string(buffer.dimensions()) +
                                            " must match the shape and dtype of " +
                                            shape_string(like.dimensions()));
  return xla::ffi::Error::Success();
}

inline xla::ffi::Error expect_count(const char* name, size_t count, int64_t expected) {
  if (static_cast<int64_t>(count) != expected)
    return xla::ffi::Error::InvalidArgument(std::string("jax_flash: ") + name + " has " +
                                            std::to_string(count) + " elements, expected " +
                                            std::to_string(expected));
  return xla::ffi::Error::Success();
}

}  // namespace jax_flash
