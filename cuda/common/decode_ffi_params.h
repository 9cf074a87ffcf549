// From XLA FFI buffers and attributes to DecodeParams (common/decode_params.h), contiguous or
// paged, with errors that name the operand and its shape; and the FFI signatures of the two
// decode targets. As in ffi_params.h, nothing here trusts the caller.
#pragma once

#include <cstdint>
#include <string>

#include "common/decode_params.h"
#include "common/ffi_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {

// num_splits in [1, kMaxDecodeSplits] and the two float32 workspaces of its size.
inline xla::ffi::Error set_decode_splits(int64_t num_splits, const xla::ffi::AnyBuffer& o_partial,
                                         const xla::ffi::AnyBuffer& lse_partial, DecodeParams& params) {
  if (num_splits < 1 || num_splits > kMaxDecodeSplits)
    return invalid("num_splits must be in [1, " + std::to_string(kMaxDecodeSplits) + "]; got " +
                   std::to_string(num_splits));
  JF_RETURN_IF_ERROR(
      expect_float32("o_partial", o_partial, decode_o_partial_elements(params.shape, num_splits)));
  JF_RETURN_IF_ERROR(
      expect_float32("lse_partial", lse_partial, decode_lse_partial_elements(params.shape, num_splits)));
  params.num_splits = num_splits;
  params.o_partial = num_splits > 1 ? o_partial.typed_data<float>() : nullptr;
  params.lse_partial = num_splits > 1 ? lse_partial.typed_data<float>() : nullptr;
  return xla::ffi::Error::Success();
}

// The contiguous decode: the forward's operands (make_fwd_params) and the split workspaces.
inline xla::ffi::Error make_decode_params(
    const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
    const xla::ffi::AnyBuffer& q_lens, const xla::ffi::AnyBuffer& kv_lens, const xla::ffi::AnyBuffer& o,
    const xla::ffi::AnyBuffer& lse, const xla::ffi::AnyBuffer& o_partial, const xla::ffi::AnyBuffer& lse_partial,
    double scale, bool is_causal, int64_t window_left, int64_t window_right, int64_t num_splits,
    DecodeParams& params, ValueHeadDim value_dim = ValueHeadDim::kSameAsQk) {
  JF_RETURN_IF_ERROR(make_fwd_params(q, k, v, q_lens, kv_lens, o, lse, scale, is_causal, window_left,
                                     window_right, params, value_dim));
  return set_decode_splits(num_splits, o_partial, lse_partial, params);
}

// The paged decode's operands as its errors name them.
inline std::string describe_paged_operands(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k_pages,
                                           const xla::ffi::AnyBuffer& v_pages, const xla::ffi::AnyBuffer& page_table) {
  return describe("q", q) + ", " + describe("key_pages", k_pages) + ", " + describe("value_pages", v_pages) + ", " +
         describe("page_table", page_table);
}

// The paged decode's operands without reading any of them: q (B, T, N, H); key_pages
// (num_pages, page_size, K, H) and value_pages (num_pages, page_size, K, Hv) of q's dtype, Hv ==
// H unless `value_dim` is kOwn; o (B, T, N, Hv); page_table (B, pages_per_seq) int32; kv_lens
// (B,) int32. The CUDA handler stops here (its buffers live on the device; its kernel
// turns a sequence that reaches a bad entry into NaN); the CPU one goes on to
// check_page_table_on_host.
inline xla::ffi::Error make_paged_shape_params(
    const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k_pages, const xla::ffi::AnyBuffer& v_pages,
    const xla::ffi::AnyBuffer& page_table, const xla::ffi::AnyBuffer& kv_lens, const xla::ffi::AnyBuffer& o,
    const xla::ffi::AnyBuffer& lse, const xla::ffi::AnyBuffer& o_partial, const xla::ffi::AnyBuffer& lse_partial,
    double scale, bool is_causal, int64_t window_left, int64_t window_right, int64_t num_splits,
    DecodeParams& params, ValueHeadDim value_dim = ValueHeadDim::kSameAsQk) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), vd = v_pages.dimensions(),
             td = page_table.dimensions();
  const std::string operands = describe_paged_operands(q, k_pages, v_pages, page_table);
  if (qd.size() != 4 || kd.size() != 4)
    return invalid("q must be (B, T, N, H) and key_pages/value_pages (num_pages, page_size, K, H); got " +
                   operands);
  if (vd.size() != 4 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2])
    return invalid("key_pages and value_pages shapes differ (beyond value_pages' head dim Hv); got " +
                   operands);
  if (td.size() != 2 || td[0] != qd[0])
    return invalid("page_table must be (B, pages_per_sequence) with B = q's batch; got " + operands);
  JF_RETURN_IF_ERROR(expect_dtype("page_table", page_table, xla::ffi::DataType::S32));
  for (int64_t x : {qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], kd[3], vd[3], td[1]})
    if (x < 0) return invalid("negative dimension in " + operands);
  if (kd[1] < 1) return invalid("page_size must be >= 1; got " + operands);
  if (td[1] > INT32_MAX / kd[1])
    return invalid("pages_per_sequence * page_size must fit int32 (the lengths are int32); got " + operands);
  AttentionShape& shape = params.shape;
  shape = AttentionShape{qd[0], qd[1], td[1] * kd[1], qd[2], kd[2], qd[3], vd[3]};
  if (kd[3] != shape.head_dim)
    return invalid("q and key_pages need the same head dim H; got " + operands);
  if (shape.head_dim_v != shape.head_dim && value_dim != ValueHeadDim::kOwn)
    return invalid("value_pages' head dim Hv=" + std::to_string(shape.head_dim_v) + " differs from q and " +
                   "key_pages' H=" + std::to_string(shape.head_dim) + ", and this kernel takes Hv == H only " +
                   "(the CPU kernel takes Hv != H); got " + operands);
  if (shape.heads_k < 1 || shape.heads_q % shape.heads_k != 0)
    return invalid("query heads N must be a multiple of key/value heads K >= 1; got " + operands);
  if (shape.head_dim < 1 || shape.head_dim > kMaxHeadDim)
    return invalid("head dim H=" + std::to_string(shape.head_dim) + " is outside the supported 1.." +
                   std::to_string(kMaxHeadDim) + "; got " + operands);
  if (shape.head_dim_v < 1 || shape.head_dim_v > kMaxHeadDim)
    return invalid("value_pages' head dim Hv=" + std::to_string(shape.head_dim_v) + " is outside the " +
                   "supported 1.." + std::to_string(kMaxHeadDim) + "; got " + operands);
  JF_RETURN_IF_ERROR(attention_dtype(q, k_pages, v_pages, params.dtype));
  JF_RETURN_IF_ERROR(expect_lens("kv_lens", kv_lens, q, shape.batch));
  JF_RETURN_IF_ERROR(expect_value_rows("o", o, q, shape.head_dim_v, q.element_type()));
  JF_RETURN_IF_ERROR(expect_float32("lse", lse, lse_elements(shape)));
  JF_RETURN_IF_ERROR(attention_scale(scale, params.scale));
  params.mask.causal = is_causal;
  JF_RETURN_IF_ERROR(attention_window("window_left", window_left, shape, params.mask.window_left));
  JF_RETURN_IF_ERROR(attention_window("window_right", window_right, shape, params.mask.window_right));
  JF_RETURN_IF_ERROR(set_decode_splits(num_splits, o_partial, lse_partial, params));
  params.q = q.untyped_data();
  params.k = k_pages.untyped_data();
  params.v = v_pages.untyped_data();
  params.q_lens = nullptr;
  params.kv_lens = kv_lens.typed_data<int32_t>();
  params.o = o.untyped_data();
  params.lse = lse.typed_data<float>();
  params.paged = true;
  params.page_table = page_table.typed_data<int32_t>();
  params.num_pages = kd[0];
  params.page_size = kd[1];
  params.pages_per_seq = td[1];
  params.queries_at_end = true;
  params.pv_headroom_log2 = pv_headroom_log2(params.dtype, shape.seq_k);
  return xla::ffi::Error::Success();
}

// Every page_table entry a sequence's length reaches (its first ceil(kv_len / page_size)
// entries, kv_len clamped to [0, pages_per_seq * page_size]) must lie in [0, num_pages); the
// others are never read. Reads the table and the lengths: host buffers only (the CPU handler).
inline xla::ffi::Error check_page_table_on_host(const DecodeParams& params, const std::string& operands) {
  const AttentionShape& shape = params.shape;
  const int32_t* table = params.page_table;
  const int32_t* lens = params.kv_lens;
  const int64_t page_size = params.page_size, num_pages = params.num_pages, pages_per_seq = params.pages_per_seq;
  for (int64_t b = 0; b < shape.batch; ++b) {
    const int64_t len = lens[b] < 0 ? 0 : (lens[b] > shape.seq_k ? shape.seq_k : lens[b]);
    for (int64_t i = 0; i < (len + page_size - 1) / page_size; ++i) {
      const int32_t page = table[b * pages_per_seq + i];
      if (page < 0 || page >= num_pages)
        return invalid("page_table[" + std::to_string(b) + ", " + std::to_string(i) + "] = " +
                       std::to_string(page) + " is outside [0, num_pages=" + std::to_string(num_pages) +
                       "), and kv_lengths[" + std::to_string(b) + "] = " + std::to_string(lens[b]) +
                       " reaches that page (" + operands + ")");
    }
  }
  return xla::ffi::Error::Success();
}

// The paged decode on host buffers: make_paged_shape_params, then check_page_table_on_host.
inline xla::ffi::Error make_paged_params(
    const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k_pages, const xla::ffi::AnyBuffer& v_pages,
    const xla::ffi::AnyBuffer& page_table, const xla::ffi::AnyBuffer& kv_lens, const xla::ffi::AnyBuffer& o,
    const xla::ffi::AnyBuffer& lse, const xla::ffi::AnyBuffer& o_partial, const xla::ffi::AnyBuffer& lse_partial,
    double scale, bool is_causal, int64_t window_left, int64_t window_right, int64_t num_splits,
    DecodeParams& params, ValueHeadDim value_dim = ValueHeadDim::kSameAsQk) {
  JF_RETURN_IF_ERROR(make_paged_shape_params(q, k_pages, v_pages, page_table, kv_lens, o, lse, o_partial,
                                             lse_partial, scale, is_causal, window_left, window_right,
                                             num_splits, params, value_dim));
  return check_page_table_on_host(params, describe_paged_operands(q, k_pages, v_pages, page_table));
}

template <typename Ctx>
auto decode_binding() {
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
      .template Ret<ffi::AnyBuffer>()           // o_partial workspace float32
      .template Ret<ffi::AnyBuffer>()           // lse_partial workspace float32
      .template Attr<double>("scale")           // > 0
      .template Attr<bool>("is_causal")
      .template Attr<int64_t>("window_left")    // -1: unbounded
      .template Attr<int64_t>("window_right")   // -1: unbounded
      .template Attr<int64_t>("num_splits");    // key chunks, >= 1
}

template <typename Ctx>
auto paged_binding() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()           // q (B, T, N, H)
      .template Arg<ffi::AnyBuffer>()           // key_pages (num_pages, page_size, K, H)
      .template Arg<ffi::AnyBuffer>()           // value_pages (num_pages, page_size, K, Hv)
      .template Arg<ffi::AnyBuffer>()           // page_table (B, pages_per_sequence) int32
      .template Arg<ffi::AnyBuffer>()           // kv_lens (B,) int32
      .template Ret<ffi::AnyBuffer>()           // o (B, T, N, Hv)
      .template Ret<ffi::AnyBuffer>()           // lse (B, N, T) float32
      .template Ret<ffi::AnyBuffer>()           // o_partial workspace float32
      .template Ret<ffi::AnyBuffer>()           // lse_partial workspace float32
      .template Attr<double>("scale")
      .template Attr<bool>("is_causal")         // bottom-right aligned: queries end the sequence
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<int64_t>("num_splits");
}

}  // namespace jax_flash
