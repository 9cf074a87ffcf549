// From XLA FFI buffers and attributes to FwdParams / BwdParams, with errors that name the
// operand and its shape. Shared by the CPU and CUDA handlers, which add only what is their own
// (dtype limits, workspaces).
//
// The custom calls can be reached by name through jax.ffi.ffi_call with any operands, so nothing
// here trusts the caller: every buffer's dtype and shape and every attribute's range is checked
// before a pointer reaches a kernel. The bindings take every buffer as AnyBuffer and check dtypes
// here: a typed Buffer<S32> would be checked by XLA too, but its error names only the operand's
// position.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <utility>

#include "common/attention_params.h"
#include "common/dropout_bits.h"
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

inline std::string dtype_string(xla::ffi::DataType dtype) {
  using xla::ffi::DataType;
  switch (dtype) {
    case DataType::F32: return "float32";
    case DataType::BF16: return "bfloat16";
    case DataType::F16: return "float16";
    case DataType::F64: return "float64";
    case DataType::S8: return "int8";
    case DataType::S16: return "int16";
    case DataType::S32: return "int32";
    case DataType::S64: return "int64";
    case DataType::U8: return "uint8";
    case DataType::U16: return "uint16";
    case DataType::U32: return "uint32";
    case DataType::U64: return "uint64";
    case DataType::PRED: return "bool";
    default: return "dtype #" + std::to_string(static_cast<int>(dtype));
  }
}

// "k(2, 128, 4, 64) bfloat16": how an operand is named in every error.
inline std::string describe(const char* name, const xla::ffi::AnyBuffer& buffer) {
  return std::string(name) + shape_string(buffer.dimensions()) + " " + dtype_string(buffer.element_type());
}

inline xla::ffi::Error invalid(const std::string& message) {
  return xla::ffi::Error::InvalidArgument("jax_flash: " + message);
}

inline int64_t leading_product(xla::ffi::Span<const int64_t> dims, size_t trailing) {
  int64_t n = 1;
  for (size_t i = 0; i + trailing < dims.size(); ++i) n *= dims[i];
  return n;
}

// Whether `buffer` is shaped q's batch dims (all but q's last three: (..., T, N, H)) followed by
// `tail`: how every per-(batch, head) operand (ALiBi slopes, block masks and their lists) is
// laid out, vmap adding leading dims to it as to q.
inline bool has_batch_dims_then(const xla::ffi::AnyBuffer& buffer, const xla::ffi::AnyBuffer& q,
                                std::initializer_list<int64_t> tail) {
  const auto d = buffer.dimensions(), qd = q.dimensions();
  if (d.size() + 3 != qd.size() + tail.size()) return false;
  size_t i = 0;
  for (; i + 3 < qd.size(); ++i)
    if (d[i] != qd[i]) return false;
  for (int64_t t : tail)
    if (d[i++] != t) return false;
  return true;
}

inline xla::ffi::Error expect_dtype(const char* name, const xla::ffi::AnyBuffer& buffer,
                                    xla::ffi::DataType dtype) {
  if (buffer.element_type() != dtype)
    return invalid(describe(name, buffer) + ": must be " + dtype_string(dtype));
  return xla::ffi::Error::Success();
}

// A float32 buffer of exactly `expected` elements (lse, delta, workspaces); its layout is the
// kernels', so only the count is checked.
inline xla::ffi::Error expect_float32(const char* name, const xla::ffi::AnyBuffer& buffer, int64_t expected) {
  JF_RETURN_IF_ERROR(expect_dtype(name, buffer, xla::ffi::DataType::F32));
  if (static_cast<int64_t>(buffer.element_count()) != expected)
    return invalid(describe(name, buffer) + ": has " + std::to_string(buffer.element_count()) +
                   " elements, expected " + std::to_string(expected));
  return xla::ffi::Error::Success();
}

// `buffer` must have the shape and dtype of `like` (outputs and cotangents).
inline xla::ffi::Error expect_like(const char* name, const xla::ffi::AnyBuffer& buffer, const char* like_name,
                                   const xla::ffi::AnyBuffer& like) {
  if (buffer.element_type() != like.element_type() || !(buffer.dimensions() == like.dimensions()))
    return invalid(describe(name, buffer) + ": must match the shape and dtype of " +
                   describe(like_name, like));
  return xla::ffi::Error::Success();
}

// o and do: q's dimensions but for the last, which is v's head dim Hv (one output row per query
// row and head), and `dtype`.
inline xla::ffi::Error expect_value_rows(const char* name, const xla::ffi::AnyBuffer& buffer,
                                         const xla::ffi::AnyBuffer& q, int64_t head_dim_v,
                                         xla::ffi::DataType dtype) {
  const auto bd = buffer.dimensions(), qd = q.dimensions();
  bool match = buffer.element_type() == dtype && bd.size() == qd.size();
  for (size_t i = 0; match && i < qd.size(); ++i) match = bd[i] == (i + 1 < qd.size() ? qd[i] : head_dim_v);
  if (!match)
    return invalid(describe(name, buffer) + ": must match the shape of " + describe("q", q) +
                   " with v's head dim Hv=" + std::to_string(head_dim_v) + " as its last, and be " +
                   dtype_string(dtype));
  return xla::ffi::Error::Success();
}

// Whether a handler's kernels take a value head dim Hv of their own (v (..., S, K, Hv), o and do
// (..., T, N, Hv): MLA-style attention): the CPU kernels do; the CUDA ones take Hv == H only,
// which is the default of every check below.
enum class ValueHeadDim { kSameAsQk, kOwn };

// q_lens / kv_lens: int32, one entry per batch element of q.
inline xla::ffi::Error expect_lens(const char* name, const xla::ffi::AnyBuffer& lens,
                                   const xla::ffi::AnyBuffer& q, int64_t batch) {
  JF_RETURN_IF_ERROR(expect_dtype(name, lens, xla::ffi::DataType::S32));
  if (static_cast<int64_t>(lens.element_count()) != batch)
    return invalid(describe(name, lens) + ": needs one entry per batch element of " + describe("q", q) +
                   " (" + std::to_string(batch) + ")");
  return xla::ffi::Error::Success();
}

// q (..., T, N, H), k (..., S, K, H) and v (..., S, K, Hv) with the same leading dimensions, N a
// multiple of K, 1 <= H, Hv <= kMaxHeadDim, and Hv == H unless `value_dim` is kOwn; q_lens and
// kv_lens int32 with one entry per batch element. Every leading dimension is folded into the
// batch (that is how vmap reaches the kernel).
inline xla::ffi::Error attention_shape(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k,
                                       const xla::ffi::AnyBuffer& v, const xla::ffi::AnyBuffer& q_lens,
                                       const xla::ffi::AnyBuffer& kv_lens, AttentionShape& shape,
                                       ValueHeadDim value_dim = ValueHeadDim::kSameAsQk) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const std::string operands = describe("q", q) + ", " + describe("k", k) + ", " + describe("v", v);
  if (qd.size() < 3 || kd.size() != qd.size() || vd.size() != qd.size())
    return invalid("q, k and v must have one rank >= 3; got " + operands);
  const size_t r = qd.size();
  for (size_t i = 0; i + 1 < r; ++i)
    if (kd[i] != vd[i])
      return invalid("k and v shapes differ (beyond v's head dim Hv: v is (..., S, K, Hv)); got " + operands);
  for (size_t i = 0; i < r; ++i) {
    if (qd[i] < 0 || kd[i] < 0) return invalid("negative dimension in " + operands);
    if (i + 3 < r && qd[i] != kd[i])
      return invalid("q and k/v need the same batch dimensions (all but the last 3); got " + operands);
  }
  shape.batch = leading_product(qd, 3);
  shape.seq_q = qd[r - 3];
  shape.heads_q = qd[r - 2];
  shape.head_dim = qd[r - 1];
  shape.seq_k = kd[r - 3];
  shape.heads_k = kd[r - 2];
  shape.head_dim_v = vd[r - 1];
  if (kd[r - 1] != shape.head_dim)
    return invalid("q (..., T, N, H) and k (..., S, K, H) need the same head dim H; got " + operands);
  if (shape.head_dim_v != shape.head_dim && value_dim != ValueHeadDim::kOwn)
    return invalid("v's head dim Hv=" + std::to_string(shape.head_dim_v) + " differs from q and k's H=" +
                   std::to_string(shape.head_dim) + ", and these kernels take Hv == H only (the CPU " +
                   "kernels take Hv != H); got " + operands);
  if (shape.heads_k < 1 || shape.heads_q % shape.heads_k != 0)
    return invalid("query heads N must be a multiple of key/value heads K >= 1; got " + operands);
  if (shape.head_dim < 1 || shape.head_dim > kMaxHeadDim)
    return invalid("head dim H=" + std::to_string(shape.head_dim) + " is outside the supported 1.." +
                   std::to_string(kMaxHeadDim) + "; got " + operands);
  if (shape.head_dim_v < 1 || shape.head_dim_v > kMaxHeadDim)
    return invalid("v's head dim Hv=" + std::to_string(shape.head_dim_v) + " is outside the supported 1.." +
                   std::to_string(kMaxHeadDim) + "; got " + operands);
  JF_RETURN_IF_ERROR(expect_lens("q_lens", q_lens, q, shape.batch));
  JF_RETURN_IF_ERROR(expect_lens("kv_lens", kv_lens, q, shape.batch));
  return xla::ffi::Error::Success();
}

// q, k and v share one dtype of those the kernels take (float32, bfloat16, float16); a backend
// that takes fewer checks that itself.
inline xla::ffi::Error attention_dtype(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k,
                                       const xla::ffi::AnyBuffer& v, Dtype& dtype) {
  switch (q.element_type()) {
    case xla::ffi::DataType::F32: dtype = Dtype::kFloat32; break;
    case xla::ffi::DataType::BF16: dtype = Dtype::kBFloat16; break;
    case xla::ffi::DataType::F16: dtype = Dtype::kFloat16; break;
    default:
      return invalid(describe("q", q) + ": unsupported dtype; float32, bfloat16 and float16 are supported");
  }
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return invalid("q, k and v must have one dtype; got " + describe("q", q) + ", " + describe("k", k) +
                   ", " + describe("v", v));
  return xla::ffi::Error::Success();
}

// The scales the kernels take, as the float32 they compute with: positive (the Python side makes
// them so; masked scores are -inf, which a scale <= 0 turns into +inf or NaN), normal (a
// subnormal one is flushed to 0 on XLA's threads), and finite once multiplied by log2(e) (the
// kernels use exp2). So 1e-50, 1e-44, 1e39 and 3e38 are refused; the Python side refuses the
// large ones too, at trace time, by the same rule.
inline xla::ffi::Error attention_scale(double scale, float& out) {
  out = static_cast<float>(scale);
  if (!(out >= FLT_MIN && std::isfinite(out * 1.4426950408889634f))) {  // NaN fails too
    char text[128];
    std::snprintf(text, sizeof(text),
                  "scale must be a positive normal float32 whose product with log2(e) is finite; got %.9g",
                  scale);
    return invalid(text);
  }
  return xla::ffi::Error::Success();
}

// logits_soft_cap: 0 (off), or c > 0 as the float32 the kernels compute with: normal, and finite
// once multiplied by log2(e) (the kernels cap base-2 scores at c * log2(e)). NaN, inf, negative
// and subnormal values are refused; the Python side refuses them first, by the same rule.
inline xla::ffi::Error attention_soft_cap(double cap, float& out) {
  out = static_cast<float>(cap);
  if (cap == 0.0) return xla::ffi::Error::Success();
  if (!(out >= FLT_MIN && std::isfinite(out * 1.4426950408889634f))) {  // NaN fails too
    char text[160];
    std::snprintf(text, sizeof(text),
                  "logits_soft_cap must be 0 (off) or a positive normal float32 whose product with "
                  "log2(e) is finite; got %.9g",
                  cap);
    return invalid(text);
  }
  return xla::ffi::Error::Success();
}

// A window side is -1 (unbounded) or >= 0. A side wider than T + S masks nothing more (every
// query row is < T and every key < S), so it is clamped there: the mask arithmetic
// (i + window_right + 1 and friends in common/mask.h) then never nears int64 overflow, and what
// it computes for any row and key is unchanged.
inline xla::ffi::Error attention_window(const char* name, int64_t window, const AttentionShape& shape,
                                        int64_t& out) {
  if (window < -1)
    return invalid(std::string(name) + " must be -1 (unbounded) or >= 0; got " + std::to_string(window));
  out = window < shape.seq_q + shape.seq_k ? window : shape.seq_q + shape.seq_k;
  return xla::ffi::Error::Success();
}

// Checks the operands every pass takes (q, k, v and the lengths) and the mask/scale attributes,
// and fills the fields of `params` they determine.
inline xla::ffi::Error set_attention_inputs(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k,
                                            const xla::ffi::AnyBuffer& v, const xla::ffi::AnyBuffer& q_lens,
                                            const xla::ffi::AnyBuffer& kv_lens, double scale, bool is_causal,
                                            int64_t window_left, int64_t window_right,
                                            AttentionParams& params,
                                            ValueHeadDim value_dim = ValueHeadDim::kSameAsQk) {
  JF_RETURN_IF_ERROR(attention_shape(q, k, v, q_lens, kv_lens, params.shape, value_dim));
  JF_RETURN_IF_ERROR(attention_dtype(q, k, v, params.dtype));
  JF_RETURN_IF_ERROR(attention_scale(scale, params.scale));
  params.mask.causal = is_causal;
  JF_RETURN_IF_ERROR(attention_window("window_left", window_left, params.shape, params.mask.window_left));
  JF_RETURN_IF_ERROR(attention_window("window_right", window_right, params.shape, params.mask.window_right));
  params.q = q.untyped_data();
  params.k = k.untyped_data();
  params.v = v.untyped_data();
  params.q_lens = q_lens.typed_data<int32_t>();
  params.kv_lens = kv_lens.typed_data<int32_t>();
  return xla::ffi::Error::Success();
}

// Checks o against q (after set_attention_inputs): q's shape with v's head dim and q's dtype, or
// float32 for 16-bit inputs: the forward's output kept at full precision for the backward
// (AttentionParams::o_float32).
inline xla::ffi::Error set_output_rows(const xla::ffi::AnyBuffer& o, const xla::ffi::AnyBuffer& q,
                                       AttentionParams& params) {
  params.o_float32 = o.element_type() == xla::ffi::DataType::F32 && q.element_type() != xla::ffi::DataType::F32;
  return expect_value_rows("o", o, q, params.shape.head_dim_v,
                           params.o_float32 ? xla::ffi::DataType::F32 : q.element_type());
}

// Rows of lse and delta: (batch, heads_q, seq_q).
inline int64_t lse_elements(const AttentionShape& shape) { return shape.batch * shape.heads_q * shape.seq_q; }

// Checks the forward's operands and fills every field of `params` they determine.
inline xla::ffi::Error make_fwd_params(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k,
                                       const xla::ffi::AnyBuffer& v, const xla::ffi::AnyBuffer& q_lens,
                                       const xla::ffi::AnyBuffer& kv_lens, const xla::ffi::AnyBuffer& o,
                                       const xla::ffi::AnyBuffer& lse, double scale, bool is_causal,
                                       int64_t window_left, int64_t window_right, FwdParams& params,
                                       ValueHeadDim value_dim = ValueHeadDim::kSameAsQk) {
  JF_RETURN_IF_ERROR(set_attention_inputs(q, k, v, q_lens, kv_lens, scale, is_causal, window_left, window_right,
                                          params, value_dim));
  JF_RETURN_IF_ERROR(set_output_rows(o, q, params));
  JF_RETURN_IF_ERROR(expect_float32("lse", lse, lse_elements(params.shape)));
  params.o = o.untyped_data();
  params.lse = lse.typed_data<float>();
  params.pv_headroom_log2 = pv_headroom_log2(params.dtype, params.shape.seq_k);
  return xla::ffi::Error::Success();
}

// Checks the backward's operands but o (and o_error) and fills every field of `params` they
// determine (all but the dQ accumulator, whose form is the backend's). delta is the CPU kernel's
// workspace (it forms delta = rowsum(dO * O) from o), the CUDA kernels' input (XLA forms it).
inline xla::ffi::Error make_bwd_params_without_o(
    const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
    const xla::ffi::AnyBuffer& lse, const xla::ffi::AnyBuffer& d_o, const xla::ffi::AnyBuffer& q_lens,
    const xla::ffi::AnyBuffer& kv_lens, const xla::ffi::AnyBuffer& dq, const xla::ffi::AnyBuffer& dk,
    const xla::ffi::AnyBuffer& dv, const xla::ffi::AnyBuffer& delta, double scale, bool is_causal,
    int64_t window_left, int64_t window_right, BwdParams& params, ValueHeadDim value_dim = ValueHeadDim::kSameAsQk) {
  JF_RETURN_IF_ERROR(set_attention_inputs(q, k, v, q_lens, kv_lens, scale, is_causal, window_left, window_right,
                                          params, value_dim));
  JF_RETURN_IF_ERROR(expect_value_rows("do", d_o, q, params.shape.head_dim_v, q.element_type()));
  JF_RETURN_IF_ERROR(expect_like("dq", dq, "q", q));
  JF_RETURN_IF_ERROR(expect_like("dk", dk, "k", k));
  JF_RETURN_IF_ERROR(expect_like("dv", dv, "v", v));
  JF_RETURN_IF_ERROR(expect_float32("lse", lse, lse_elements(params.shape)));
  JF_RETURN_IF_ERROR(expect_float32("delta", delta, lse_elements(params.shape)));
  params.d_o = d_o.untyped_data();
  params.lse = lse.typed_data<float>();
  params.dq = dq.untyped_data();
  params.dk = dk.untyped_data();
  params.dv = dv.untyped_data();
  params.delta = delta.typed_data<float>();
  return xla::ffi::Error::Success();
}

// make_bwd_params_without_o and o (the CPU backward's operands).
inline xla::ffi::Error make_bwd_params(
    const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
    const xla::ffi::AnyBuffer& o, const xla::ffi::AnyBuffer& lse, const xla::ffi::AnyBuffer& d_o,
    const xla::ffi::AnyBuffer& q_lens, const xla::ffi::AnyBuffer& kv_lens, const xla::ffi::AnyBuffer& dq,
    const xla::ffi::AnyBuffer& dk, const xla::ffi::AnyBuffer& dv, const xla::ffi::AnyBuffer& delta,
    double scale, bool is_causal, int64_t window_left, int64_t window_right, BwdParams& params,
    ValueHeadDim value_dim = ValueHeadDim::kSameAsQk) {
  JF_RETURN_IF_ERROR(make_bwd_params_without_o(q, k, v, lse, d_o, q_lens, kv_lens, dq, dk, dv, delta, scale,
                                               is_causal, window_left, window_right, params, value_dim));
  JF_RETURN_IF_ERROR(set_output_rows(o, q, params));
  params.o = o.untyped_data();
  return xla::ffi::Error::Success();
}

// The CUDA forward's optional o_error result (FwdParams::o_error): int8 of o's shape beside a
// 16-bit o, or no elements for none.
inline xla::ffi::Error set_o_error(xla::ffi::AnyBuffer& o_error, const xla::ffi::AnyBuffer& o, FwdParams& params) {
  JF_RETURN_IF_ERROR(expect_dtype("o_error", o_error, xla::ffi::DataType::S8));
  if (o_error.element_count() == 0) {
    params.o_error = nullptr;
    return xla::ffi::Error::Success();
  }
  if (params.o_float32 || !(o_error.dimensions() == o.dimensions()))
    return invalid(describe("o_error", o_error) + ": must be empty or have the shape of a 16-bit " +
                   describe("o", o));
  params.o_error = o_error.typed_data<int8_t>();
  return xla::ffi::Error::Success();
}

// Segment ids (packed documents): with `segment_ids`, q_segment_ids (..., T) and kv_segment_ids
// (..., S), int32, their leading dimensions those of q and k (vmap adds the same ones to all);
// without, both hold no elements (the callers pass int32 (0,) placeholders). Call after the
// attention inputs are set (it reads params.shape).
inline xla::ffi::Error set_segment_ids(const xla::ffi::AnyBuffer& q_ids, const xla::ffi::AnyBuffer& kv_ids,
                                       bool segment_ids, const xla::ffi::AnyBuffer& q,
                                       const xla::ffi::AnyBuffer& k, AttentionParams& params) {
  JF_RETURN_IF_ERROR(expect_dtype("q_segment_ids", q_ids, xla::ffi::DataType::S32));
  JF_RETURN_IF_ERROR(expect_dtype("kv_segment_ids", kv_ids, xla::ffi::DataType::S32));
  if (!segment_ids) {
    if (q_ids.element_count() != 0 || kv_ids.element_count() != 0)
      return invalid("segment_ids=false takes empty segment-id operands; got " + describe("q_segment_ids", q_ids) +
                     ", " + describe("kv_segment_ids", kv_ids));
    params.q_segment_ids = params.kv_segment_ids = nullptr;
    return xla::ffi::Error::Success();
  }
  // (leading dims of x..., x's dim at `seq`): what the ids of x's rows must be shaped.
  auto ids_match = [](const xla::ffi::AnyBuffer& ids, const xla::ffi::AnyBuffer& x) {
    const auto id = ids.dimensions(), xd = x.dimensions();
    if (id.size() + 2 != xd.size()) return false;
    for (size_t i = 0; i < id.size(); ++i)
      if (id[i] != xd[i]) return false;
    return true;
  };
  if (!ids_match(q_ids, q))
    return invalid(describe("q_segment_ids", q_ids) + ": must have the shape of q without its last two dims (" +
                   "one id per query row), " + describe("q", q));
  if (!ids_match(kv_ids, k))
    return invalid(describe("kv_segment_ids", kv_ids) + ": must have the shape of k without its last two dims " +
                   "(one id per key row), " + describe("k", k));
  params.q_segment_ids = q_ids.typed_data<int32_t>();
  params.kv_segment_ids = kv_ids.typed_data<int32_t>();
  return xla::ffi::Error::Success();
}

// The CUDA kernels' spans of the segment ids (AttentionParams::q_segment_id_spans): with ids,
// q_spans (..., ceil(T / kSegmentIdSpanRows), 2) and kv_spans (..., ceil(S / ...), 2) int32, the
// leading dimensions those of the ids; without, both empty. Call after set_segment_ids.
inline xla::ffi::Error set_segment_id_spans(const xla::ffi::AnyBuffer& q_spans, const xla::ffi::AnyBuffer& kv_spans,
                                            const xla::ffi::AnyBuffer& q_ids, const xla::ffi::AnyBuffer& kv_ids,
                                            AttentionParams& params) {
  JF_RETURN_IF_ERROR(expect_dtype("q_segment_id_spans", q_spans, xla::ffi::DataType::S32));
  JF_RETURN_IF_ERROR(expect_dtype("kv_segment_id_spans", kv_spans, xla::ffi::DataType::S32));
  if (!params.q_segment_ids) {
    if (q_spans.element_count() != 0 || kv_spans.element_count() != 0)
      return invalid("segment_ids=false takes empty segment-id span operands; got " +
                     describe("q_segment_id_spans", q_spans) + ", " + describe("kv_segment_id_spans", kv_spans));
    params.q_segment_id_spans = params.kv_segment_id_spans = nullptr;
    return xla::ffi::Error::Success();
  }
  // The ids' leading dims, then the runs of their last dim and 2.
  auto spans_match = [](const xla::ffi::AnyBuffer& spans, const xla::ffi::AnyBuffer& ids) {
    const auto sd = spans.dimensions(), id = ids.dimensions();
    if (sd.size() != id.size() + 1) return false;
    for (size_t i = 0; i + 1 < id.size(); ++i)
      if (sd[i] != id[i]) return false;
    return sd[id.size() - 1] == (id[id.size() - 1] + kSegmentIdSpanRows - 1) / kSegmentIdSpanRows &&
           sd[id.size()] == 2;
  };
  if (!spans_match(q_spans, q_ids))
    return invalid(describe("q_segment_id_spans", q_spans) + ": must be the (lo, hi) of every " +
                   std::to_string(kSegmentIdSpanRows) + " ids of " + describe("q_segment_ids", q_ids));
  if (!spans_match(kv_spans, kv_ids))
    return invalid(describe("kv_segment_id_spans", kv_spans) + ": must be the (lo, hi) of every " +
                   std::to_string(kSegmentIdSpanRows) + " ids of " + describe("kv_segment_ids", kv_ids));
  params.q_segment_id_spans = q_spans.typed_data<int32_t>();
  params.kv_segment_id_spans = kv_spans.typed_data<int32_t>();
  return xla::ffi::Error::Success();
}

// ALiBi slopes: with `alibi`, alibi_slopes (..., N) float32, its leading dimensions those of q
// and its last q's query heads (one slope per batch element and query head; vmap adds leading
// dimensions to it as to q); without, a float32 operand of no elements (the callers pass a (0,)
// placeholder). Call after the attention inputs are set (it reads params.shape).
inline xla::ffi::Error set_alibi_slopes(const xla::ffi::AnyBuffer& slopes, bool alibi,
                                        const xla::ffi::AnyBuffer& q, AttentionParams& params) {
  JF_RETURN_IF_ERROR(expect_dtype("alibi_slopes", slopes, xla::ffi::DataType::F32));
  if (!alibi) {
    if (slopes.element_count() != 0)
      return invalid("alibi=false takes an empty alibi_slopes operand; got " + describe("alibi_slopes", slopes));
    params.alibi_slopes = nullptr;
    return xla::ffi::Error::Success();
  }
  if (!has_batch_dims_then(slopes, q, {params.shape.heads_q}))
    return invalid(describe("alibi_slopes", slopes) + ": must be q's batch dims and query heads (..., N), " +
                   "one slope per batch element and query head, for " + describe("q", q));
  params.alibi_slopes = slopes.typed_data<float>();
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
      .template Arg<ffi::AnyBuffer>()           // v (..., S, K, Hv), Hv == H on CUDA
      .template Arg<ffi::AnyBuffer>()           // q_lens (...) int32
      .template Arg<ffi::AnyBuffer>()           // kv_lens (...) int32
      .template Ret<ffi::AnyBuffer>()           // o (..., T, N, Hv)
      .template Ret<ffi::AnyBuffer>()           // lse (..., N, T) float32
      .template Attr<double>("scale")           // > 0
      .template Attr<bool>("is_causal")
      .template Attr<int64_t>("window_left")    // -1: unbounded
      .template Attr<int64_t>("window_right");  // -1: unbounded
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
      .template Arg<ffi::AnyBuffer>()           // lse (..., N, T) float32
      .template Arg<ffi::AnyBuffer>()           // do, the output cotangent
      .template Arg<ffi::AnyBuffer>()           // q_lens int32
      .template Arg<ffi::AnyBuffer>()           // kv_lens int32
      .template Ret<ffi::AnyBuffer>()           // dq
      .template Ret<ffi::AnyBuffer>()           // dk
      .template Ret<ffi::AnyBuffer>()           // dv
      .template Ret<ffi::AnyBuffer>()           // delta workspace (..., N, T) float32
      .template Ret<ffi::AnyBuffer>()           // dq_accum workspace float32 (form per backend)
      .template Attr<double>("scale")
      .template Attr<bool>("is_causal")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right");
}

// Segment ids: two more operands after the shared ones (operands decode in order among
// operands, attributes by name) and their switch; set_segment_ids checks them.
template <typename Binding>
auto with_segment_ids(Binding binding) {
  namespace ffi = xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q_segment_ids (..., T) int32, or (0,) without
      .template Arg<ffi::AnyBuffer>()  // kv_segment_ids (..., S) int32, or (0,) without
      .template Attr<bool>("segment_ids");
}

// Fused dropout: with dropout_rate in (0, 1), dropout_seeds (..., N, 6) uint32, its leading
// dimensions those of q and N q's query heads (per batch element and query head the Philox key
// words and the counter's head, batch, row and column words: AttentionParams::dropout_seeds,
// common/dropout_bits.h DropoutSeedWord); with rate 0,
// a uint32 operand of no elements (the callers pass a (0,) placeholder). Call after the
// attention inputs are set (it reads params.shape). The CPU and CUDA passes take it alike.
inline xla::ffi::Error set_dropout(const xla::ffi::AnyBuffer& seeds, double rate, const xla::ffi::AnyBuffer& q,
                                   AttentionParams& params) {
  JF_RETURN_IF_ERROR(expect_dtype("dropout_seeds", seeds, xla::ffi::DataType::U32));
  if (!(rate >= 0.0 && rate < 1.0)) {  // NaN fails too
    char text[80];
    std::snprintf(text, sizeof(text), "dropout_rate must be in [0, 1); got %.9g", rate);
    return invalid(text);
  }
  if (rate == 0.0) {
    if (seeds.element_count() != 0)
      return invalid("dropout_rate=0 takes an empty dropout_seeds operand; got " + describe("dropout_seeds", seeds));
    params.dropout_seeds = nullptr;
    return xla::ffi::Error::Success();
  }
  const auto sd = seeds.dimensions(), qd = q.dimensions();
  bool match = sd.size() + 1 == qd.size();
  for (size_t i = 0; match && i + 2 < sd.size(); ++i) match = sd[i] == qd[i];
  if (match) match = sd[sd.size() - 2] == params.shape.heads_q && sd[sd.size() - 1] == kDropoutSeedWords;
  if (!match)
    return invalid(describe("dropout_seeds", seeds) + ": must be q's batch dims, query heads and " +
                   std::to_string(kDropoutSeedWords) + " words (..., N, " + std::to_string(kDropoutSeedWords) +
                   "), for " + describe("q", q));
  params.dropout_seeds = static_cast<const uint32_t*>(seeds.untyped_data());
  params.dropout_threshold = dropout_threshold(rate);
  params.dropout_scale = static_cast<float>(1.0 / (1.0 - rate));
  return xla::ffi::Error::Success();
}

// Where an operand of q's rank shaped (..., N|1, R|1, C) lies (LogitArray's strides, in
// elements): its leading dims (folded as q's) a batch that divides q's; C the `columns`, or 1
// where `broadcast_columns`. Whether it has that shape.
inline bool set_array_layout(const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& q, const AttentionShape& sh,
                             int64_t rows, int64_t columns, bool broadcast_columns, LogitArray& out) {
  const auto d = x.dimensions();
  const size_t r = d.size();
  const int64_t batch = leading_product(d, 3);
  if (!(r == q.dimensions().size() && r >= 3 && (d[r - 3] == 1 || d[r - 3] == sh.heads_q) &&
        (d[r - 2] == 1 || d[r - 2] == rows) && (d[r - 1] == columns || (broadcast_columns && d[r - 1] == 1)) &&
        batch >= 1 && sh.batch % batch == 0))
    return false;
  out.data = x.untyped_data();
  out.batch_div = sh.batch / batch > 0 ? sh.batch / batch : 1;
  out.col = d[r - 1] == 1 ? 0 : 1;
  out.row = d[r - 2] == 1 ? 0 : d[r - 1];
  out.head = d[r - 3] == 1 ? 0 : d[r - 2] * d[r - 1];
  out.batch = d[r - 3] * d[r - 2] * d[r - 1];
  out.elements = static_cast<int64_t>(x.element_count());
  return true;
}

// "N=.. T=.. S=.. and batch .." of a call, for the arrays' messages.
inline std::string call_dims(const AttentionShape& sh) {
  return "N=" + std::to_string(sh.heads_q) + " T=" + std::to_string(sh.seq_q) + " S=" + std::to_string(sh.seq_k) +
         " and batch " + std::to_string(sh.batch);
}

// jax.nn's bias or mask array (AttentionParams::bias, logit_mask; `is_mask` picks which): with
// `on`, an operand of q's rank shaped (..., N|1, T|1, S|1), its leading dims (folded as q's)
// a batch that divides q's; the bias float32, bfloat16 or float16, the mask bool; without, an
// operand of no elements (the callers pass (0,) placeholders). Call after the attention inputs
// are set (it reads params.shape). The CPU handlers take both so; the CUDA ones the bias so
// and the mask as its bits (set_mask_bits).
inline xla::ffi::Error set_logit_array(const char* name, const xla::ffi::AnyBuffer& x, bool on, bool is_mask,
                           const xla::ffi::AnyBuffer& q, const AttentionShape& sh, LogitArray& out) {
  out = LogitArray{};
  if (is_mask) {
    JF_RETURN_IF_ERROR(expect_dtype(name, x, xla::ffi::DataType::PRED));
  } else {
    switch (x.element_type()) {
      case xla::ffi::DataType::F32: out.dtype = Dtype::kFloat32; break;
      case xla::ffi::DataType::BF16: out.dtype = Dtype::kBFloat16; break;
      case xla::ffi::DataType::F16: out.dtype = Dtype::kFloat16; break;
      default: return invalid(describe(name, x) + ": must be float32, bfloat16 or float16");
    }
  }
  if (!on) {
    if (x.element_count() != 0)
      return invalid(std::string(name) + "=false takes an empty " + name + " operand; got " + describe(name, x));
    return xla::ffi::Error::Success();
  }
  if (!set_array_layout(x, q, sh, sh.seq_q, sh.seq_k, true, out))
    return invalid(describe(name, x) + ": must be (..., N|1, T|1, S|1) with q's rank and leading dims whose " +
                   "product divides q's batch, for " + describe("q", q) + ", " + call_dims(sh));
  return xla::ffi::Error::Success();
}

// The CUDA handlers' mask: its bits (jax_flash._logit_arrays.cuda_mask_bits), uint32 words
// (..., N|1, R|1, ceil(C / kMaskBitsGroup) * kMaskBitsWords) with rows R and columns C the queries and keys, or with
// `transposed` (the backward's) the keys and queries; leading dims as set_logit_array's. `out`
// then holds word strides (gpu/logit_arrays.cuh mask_bits_word).
inline xla::ffi::Error set_mask_bits(const xla::ffi::AnyBuffer& x, bool on, bool transposed,
                                     const xla::ffi::AnyBuffer& q, const AttentionShape& sh, LogitArray& out) {
  out = LogitArray{};
  JF_RETURN_IF_ERROR(expect_dtype("mask", x, xla::ffi::DataType::U32));
  if (!on) {
    if (x.element_count() != 0) return invalid("mask=false takes an empty mask operand; got " + describe("mask", x));
    return xla::ffi::Error::Success();
  }
  const int64_t rows = transposed ? sh.seq_k : sh.seq_q, columns = transposed ? sh.seq_q : sh.seq_k;
  const int64_t words = (columns + kMaskBitsGroup - 1) / kMaskBitsGroup * kMaskBitsWords;
  if (!set_array_layout(x, q, sh, rows, words, false, out))
    return invalid(describe("mask", x) + ": the mask's bits must be (..., N|1, " + (transposed ? "S" : "T") + "|1, " +
                   std::to_string(words) + ") with q's rank and leading dims whose product divides q's batch, for " +
                   describe("q", q) + ", " + call_dims(sh) + " (jax_flash._logit_arrays.cuda_mask_bits forms them)");
  return xla::ffi::Error::Success();
}

// How a handler takes the mask array: as bools (the CPU kernel's), or as the CUDA kernels' bits
// with queries in rows (the forward's) or keys in rows (the backward's).
enum class MaskOperand { kBools, kBitsQueryRows, kBitsKeyRows };

// Both arrays: the bias, and the mask as `mask_operand` says.
inline xla::ffi::Error set_logit_arrays(const xla::ffi::AnyBuffer& bias, bool has_bias, const xla::ffi::AnyBuffer& mask,
                                        bool has_mask, const xla::ffi::AnyBuffer& q, AttentionParams& params,
                                        MaskOperand mask_operand) {
  JF_RETURN_IF_ERROR(set_logit_array("bias", bias, has_bias, false, q, params.shape, params.bias));
  if (mask_operand == MaskOperand::kBools)
    return set_logit_array("mask", mask, has_mask, true, q, params.shape, params.logit_mask);
  return set_mask_bits(mask, has_mask, mask_operand == MaskOperand::kBitsKeyRows, q, params.shape, params.logit_mask);
}

}  // namespace jax_flash
