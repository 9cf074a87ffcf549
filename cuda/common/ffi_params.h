// From XLA FFI buffers and attributes to FwdParams / BwdParams, with errors that name the
// operand and its shape. Shared by the CPU and CUDA handlers, which add only what is their own
// (dtype limits, workspaces).
#pragma once

#include <cstdint>
#include <string>

#include "common/attention_params.h"
#include "xla/ffi/api/ffi.h"

#define JF_RETURN_IF_ERROR(expr)                        \
  do {                                                  \
    ::xla::ffi::Error jf_error_ = (expr);               \
    if (jf_error_.failure()) return jf_error_;          \
  } while (0)

namespace jax_flash {

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

// Checks the operands both passes take (q, k, v, o and the lengths) and fills the fields of
// `params` they and the mask/scale attributes determine.
inline xla::ffi::Error set_attention_inputs(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k,
                                            const xla::ffi::AnyBuffer& v, const xla::ffi::AnyBuffer& o,
                                            const xla::ffi::Buffer<xla::ffi::S32>& q_lens,
                                            const xla::ffi::Buffer<xla::ffi::S32>& kv_lens, double scale,
                                            bool is_causal, int64_t window_left, int64_t window_right,
                                            AttentionParams& params) {
  JF_RETURN_IF_ERROR(attention_shape(q, k, v, q_lens, kv_lens, params.shape));
  JF_RETURN_IF_ERROR(attention_dtype(q, params.dtype));
  JF_RETURN_IF_ERROR(expect_like("o", o, q));
  params.mask = {is_causal, window_left, window_right};
  params.scale = static_cast<float>(scale);
  params.q = q.untyped_data();
  params.k = k.untyped_data();
  params.v = v.untyped_data();
  params.q_lens = q_lens.typed_data();
  params.kv_lens = kv_lens.typed_data();
  return xla::ffi::Error::Success();
}

// Checks the forward's operands and fills every field of `params` they determine.
inline xla::ffi::Error make_fwd_params(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k,
                                       const xla::ffi::AnyBuffer& v,
                                       const xla::ffi::Buffer<xla::ffi::S32>& q_lens,
                                       const xla::ffi::Buffer<xla::ffi::S32>& kv_lens,
                                       const xla::ffi::AnyBuffer& o,
                                       const xla::ffi::Buffer<xla::ffi::F32>& lse, double scale,
                                       bool is_causal, int64_t window_left, int64_t window_right,
                                       FwdParams& params) {
  JF_RETURN_IF_ERROR(set_attention_inputs(q, k, v, o, q_lens, kv_lens, scale, is_causal, window_left,
                                          window_right, params));
  const AttentionShape& sh = params.shape;
  JF_RETURN_IF_ERROR(expect_count("lse", lse.element_count(), sh.batch * sh.heads_q * sh.seq_q));
  params.o = o.untyped_data();
  params.lse = lse.typed_data();
  return xla::ffi::Error::Success();
}

// Checks the backward's operands and fills every field of `params` they determine (all but the
// dQ accumulator, whose form is the backend's).
inline xla::ffi::Error make_bwd_params(
    const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
    const xla::ffi::AnyBuffer& o, const xla::ffi::Buffer<xla::ffi::F32>& lse,
    const xla::ffi::AnyBuffer& d_o, const xla::ffi::Buffer<xla::ffi::S32>& q_lens,
    const xla::ffi::Buffer<xla::ffi::S32>& kv_lens, const xla::ffi::AnyBuffer& dq,
    const xla::ffi::AnyBuffer& dk, const xla::ffi::AnyBuffer& dv,
    const xla::ffi::Buffer<xla::ffi::F32>& delta, double scale, bool is_causal,
    int64_t window_left, int64_t window_right, BwdParams& params) {
  JF_RETURN_IF_ERROR(set_attention_inputs(q, k, v, o, q_lens, kv_lens, scale, is_causal, window_left,
                                          window_right, params));
  JF_RETURN_IF_ERROR(expect_like("do", d_o, q));
  JF_RETURN_IF_ERROR(expect_like("dq", dq, q));
  JF_RETURN_IF_ERROR(expect_like("dk", dk, k));
  JF_RETURN_IF_ERROR(expect_like("dv", dv, v));
  const AttentionShape& sh = params.shape;
  const int64_t rows = sh.batch * sh.heads_q * sh.seq_q;
  JF_RETURN_IF_ERROR(expect_count("lse", lse.element_count(), rows));
  JF_RETURN_IF_ERROR(expect_count("delta", delta.element_count(), rows));
  params.o = o.untyped_data();
  params.d_o = d_o.untyped_data();
  params.lse = lse.typed_data();
  params.dq = dq.untyped_data();
  params.dk = dk.untyped_data();
  params.dv = dv.untyped_data();
  params.delta = delta.typed_data();
  return xla::ffi::Error::Success();
}

// The FFI signatures of the two passes, shared by the CPU and CUDA handlers: `Ctx` is how the
// backend runs (XLA's thread pool, or its CUDA stream); backend-specific attributes follow.
template <typename Ctx>
auto fwd_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()           // q (..., T, N, H)
      .template Arg<ffi::AnyBuffer>()           // k (..., S, K, H)
      .template Arg<ffi::AnyBuffer>()           // v (..., S, K, H)
      .template Arg<ffi::Buffer<ffi::S32>>()    // q_lens (...)
      .template Arg<ffi::Buffer<ffi::S32>>()    // kv_lens (...)
      .template Ret<ffi::AnyBuffer>()           // o (..., T, N, H)
      .template Ret<ffi::Buffer<ffi::F32>>()    // lse (..., N, T)
      .template Attr<double>("scale")
      .template Attr<bool>("is_causal")
      .template Attr<int64_t>("window_left")    // < 0: unbounded
      .template Attr<int64_t>("window_right");  // < 0: unbounded
}

template <typename Ctx>
auto bwd_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()           // q
      .template Arg<ffi::AnyBuffer>()           // k
      .template Arg<ffi::AnyBuffer>()           // v
      .template Arg<ffi::AnyBuffer>()           // o
      .template Arg<ffi::Buffer<ffi::F32>>()    // lse (..., N, T)
      .template Arg<ffi::AnyBuffer>()           // do, the output cotangent
      .template Arg<ffi::Buffer<ffi::S32>>()    // q_lens
      .template Arg<ffi::Buffer<ffi::S32>>()    // kv_lens
      .template Ret<ffi::AnyBuffer>()           // dq
      .template Ret<ffi::AnyBuffer>()           // dk
      .template Ret<ffi::AnyBuffer>()           // dv
      .template Ret<ffi::Buffer<ffi::F32>>()    // delta workspace (..., N, T)
      .template Ret<ffi::Buffer<ffi::F32>>()    // dq_accum workspace (form per backend)
      .template Attr<double>("scale")
      .template Attr<bool>("is_causal")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right");
}

}  // namespace jax_flash
