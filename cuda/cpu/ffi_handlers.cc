// XLA FFI handlers for the CPU kernels: shapes and attributes in, FwdParams / BwdParams out, the
// kernel run on XLA's intra-op thread pool. Every pass takes a value head dim Hv of its own
// (ValueHeadDim::kOwn: v, o, do, dv (..., Hv) beside q, k, dq, dk (..., H)).
#include "cpu/ffi_handlers.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "cpu/decode.h"
#include "cpu/kernels.h"
#include "common/decode_ffi_params.h"
#include "common/ffi_params.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

// Runs tasks on XLA's thread pool, the calling thread taking part. Helpers that start late
// (the pool busy elsewhere) find no work left and leave without touching the caller's state,
// which is why the shared part lives in a shared_ptr.
struct PoolRunner {
  ffi::ThreadPool* pool;

  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
    std::mutex mutex;
    std::condition_variable done;
  };

  static void drain(Shared& shared, int64_t n, cpu::TaskRunner::Body body, void* arg) {
    for (int64_t i; (i = shared.next.fetch_add(1)) < n;) body(arg, i);
  }

  static void run(const void* self, int64_t n, cpu::TaskRunner::Body body, void* arg) {
    if (n <= 0) return;
    ffi::ThreadPool* pool = static_cast<const PoolRunner*>(self)->pool;
    // XLA's intra-op pool has a thread per core, and the caller (which on the CPU client is not
    // one of them) works too: a helper per pool thread put one thread more than cores on the
    // tasks. With few tasks that was the backward's loss: its 4 (batch 1, 4 kv heads, one dQ
    // split) ran 3 at a time on 2 cores, the last alone (2.5 task-lengths instead of 2).
    const int64_t helpers = std::min<int64_t>(pool->num_threads() - 1, n - 1);
    auto shared = std::make_shared<Shared>();
    for (int64_t t = 0; t < helpers; ++t) {
      pool->Schedule([shared, n, body, arg] {
        shared->active.fetch_add(1);
        drain(*shared, n, body, arg);
        if (shared->active.fetch_sub(1) == 1) {
          std::lock_guard<std::mutex> lock(shared->mutex);
          shared->done.notify_all();
        }
      });
    }
    drain(*shared, n, body, arg);
    // Every task has been claimed; wait for the helpers still running one.
    std::unique_lock<std::mutex> lock(shared->mutex);
    shared->done.wait(lock, [&] { return shared->active.load() == 0; });
  }
};

// dq_splits beyond this is a caller bug (the Python side asks for at most 8): each split is a
// float32 copy of dQ, and the bound keeps the workspace size arithmetic far from overflow.
constexpr int64_t kMaxDqSplits = 64;

// The block-sparse mask: with `blocks`, block_mask (..., N, ceil(T / kBlockMaskRows),
// ceil(S / kBlockMaskKeys)) bool (blocks of 128 x 128: attention_params.h), its leading
// dimensions those of q (vmap adds leading dimensions to it as to q), N q's query heads;
// without, a bool operand of no elements (the callers pass a (0,) placeholder).
// Call after the attention inputs are set (it reads params.shape).
ffi::Error set_block_mask(const ffi::AnyBuffer& mask, bool blocks, const ffi::AnyBuffer& q,
                          AttentionParams& params) {
  JF_RETURN_IF_ERROR(expect_dtype("block_mask", mask, ffi::DataType::PRED));
  if (!blocks) {
    if (mask.element_count() != 0)
      return invalid("block_sparse=false takes an empty block_mask operand; got " + describe("block_mask", mask));
    params.block_mask = nullptr;
    return ffi::Error::Success();
  }
  const AttentionShape& sh = params.shape;
  const int64_t q_blocks = (sh.seq_q + kBlockMaskRows - 1) / kBlockMaskRows;
  const int64_t k_blocks = (sh.seq_k + kBlockMaskKeys - 1) / kBlockMaskKeys;
  if (!has_batch_dims_then(mask, q, {sh.heads_q, q_blocks, k_blocks}))
    return invalid(describe("block_mask", mask) + ": must be q's batch dims, query heads and (" +
                   std::to_string(q_blocks) + ", " + std::to_string(k_blocks) +
                   ") blocks of " + std::to_string(kBlockMaskRows) + " x " + std::to_string(kBlockMaskKeys) +
                   " (..., N, ceil(T / block_q), ceil(S / block_k)), for " + describe("q", q) + " and seq_k " +
                   std::to_string(sh.seq_k));
  params.block_mask = static_cast<const uint8_t*>(mask.untyped_data());
  params.block_mask_q_blocks = q_blocks;
  params.block_mask_k_blocks = k_blocks;
  return ffi::Error::Success();
}

// The backward's dbias result (the bias's shape and dtype; a float32 (0,) with no bias, or for a
// bias nothing differentiates: then no dbias is formed) and its float32 workspace
// (cpu::dbias_accum_elements of them; none: dbias itself is the one partial, or each of its
// elements takes one dS, stored there directly: cpu::dbias_one_each). Call after
// set_logit_arrays and with params.dq_splits set.
ffi::Error set_dbias(ffi::AnyBuffer& dbias, ffi::AnyBuffer& accum, const ffi::AnyBuffer& bias, BwdParams& params) {
  // (A bias has q's rank, >= 3: a rank-1 dbias is the (0,) of "none".)
  if (!params.bias || (dbias.dimensions().size() == 1 && dbias.element_count() == 0)) {
    JF_RETURN_IF_ERROR(expect_float32("dbias", dbias, 0));
    return expect_float32("dbias_accum", accum, 0);
  }
  JF_RETURN_IF_ERROR(expect_like("dbias", dbias, "bias", bias));
  const LogitArray& b = params.bias;
  const AttentionShape& sh = params.shape;
  const bool keys_broadcast = b.col == 0, float32 = b.dtype == Dtype::kFloat32;
  const bool one_each = cpu::dbias_one_each(sh.batch / b.batch_div, b.head ? sh.heads_q : 1, b.row ? sh.seq_q : 1,
                                            b.col ? sh.seq_k : 1, sh);
  const int64_t elements = cpu::dbias_accum_elements(b.elements, keys_broadcast, float32, params.dq_splits, one_each);
  JF_RETURN_IF_ERROR(expect_float32("dbias_accum", accum, elements));
  params.dbias = dbias.untyped_data();
  params.dbias_direct = one_each;
  params.dbias_parts = cpu::dbias_parts(keys_broadcast, params.dq_splits);
  params.dbias_accum = elements ? accum.typed_data<float>() : one_each ? nullptr : static_cast<float*>(params.dbias);
  return ffi::Error::Success();
}

ffi::Error run_fwd(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::AnyBuffer> lse, double scale, bool is_causal, int64_t window_left,
                   int64_t window_right, ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                   bool segment_ids, double logits_soft_cap, ffi::AnyBuffer alibi_slopes, bool alibi,
                   ffi::AnyBuffer block_mask, bool block_sparse, ffi::AnyBuffer dropout_seeds,
                   double dropout_rate, ffi::AnyBuffer bias, bool has_bias, ffi::AnyBuffer mask,
                   bool has_mask) {
  FwdParams params;
  JF_RETURN_IF_ERROR(make_fwd_params(q, k, v, q_lens, kv_lens, *o, *lse, scale, is_causal,
                                     window_left, window_right, params, ValueHeadDim::kOwn));
  JF_RETURN_IF_ERROR(set_segment_ids(q_segment_ids, kv_segment_ids, segment_ids, q, k, params));
  JF_RETURN_IF_ERROR(attention_soft_cap(logits_soft_cap, params.logits_soft_cap));
  JF_RETURN_IF_ERROR(set_alibi_slopes(alibi_slopes, alibi, q, params));
  JF_RETURN_IF_ERROR(set_block_mask(block_mask, block_sparse, q, params));
  JF_RETURN_IF_ERROR(set_dropout(dropout_seeds, dropout_rate, q, params));
  JF_RETURN_IF_ERROR(set_logit_arrays(bias, has_bias, mask, has_mask, q, params, MaskOperand::kBools));
  PoolRunner runner{&pool};
  cpu::flash_fwd(params, {&PoolRunner::run, &runner});
  return ffi::Error::Success();
}

ffi::Error run_bwd(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer d_o, ffi::AnyBuffer q_lens,
                   ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> dq,
                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                   ffi::Result<ffi::AnyBuffer> delta, ffi::Result<ffi::AnyBuffer> dq_accum,
                   double scale, bool is_causal, int64_t window_left, int64_t window_right,
                   ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, bool segment_ids,
                   int64_t dq_splits, bool /*deterministic: the CPU backward always is*/,
                   double logits_soft_cap, ffi::AnyBuffer alibi_slopes, bool alibi,
                   ffi::AnyBuffer block_mask, bool block_sparse, ffi::AnyBuffer dropout_seeds,
                   double dropout_rate, ffi::AnyBuffer bias, bool has_bias, ffi::AnyBuffer mask,
                   bool has_mask, ffi::Result<ffi::AnyBuffer> dbias,
                   ffi::Result<ffi::AnyBuffer> dbias_accum) {
  BwdParams params;
  JF_RETURN_IF_ERROR(make_bwd_params(q, k, v, o, lse, d_o, q_lens, kv_lens, *dq, *dk, *dv, *delta,
                                     scale, is_causal, window_left, window_right, params,
                                     ValueHeadDim::kOwn));
  JF_RETURN_IF_ERROR(set_segment_ids(q_segment_ids, kv_segment_ids, segment_ids, q, k, params));
  JF_RETURN_IF_ERROR(attention_soft_cap(logits_soft_cap, params.logits_soft_cap));
  JF_RETURN_IF_ERROR(set_alibi_slopes(alibi_slopes, alibi, q, params));
  JF_RETURN_IF_ERROR(set_block_mask(block_mask, block_sparse, q, params));
  JF_RETURN_IF_ERROR(set_dropout(dropout_seeds, dropout_rate, q, params));
  if (dq_splits < 1 || dq_splits > kMaxDqSplits)
    return invalid("dq_splits must be in [1, " + std::to_string(kMaxDqSplits) + "]; got " +
                   std::to_string(dq_splits));
  JF_RETURN_IF_ERROR(expect_float32("dq_accum", *dq_accum, cpu::dq_accum_elements(params.shape, dq_splits)));
  params.dq_accum = dq_accum->typed_data<float>();
  params.dq_splits = dq_splits;
  JF_RETURN_IF_ERROR(set_logit_arrays(bias, has_bias, mask, has_mask, q, params, MaskOperand::kBools));
  JF_RETURN_IF_ERROR(set_dbias(*dbias, *dbias_accum, bias, params));
  PoolRunner runner{&pool};
  cpu::flash_bwd(params, {&PoolRunner::run, &runner});
  return ffi::Error::Success();
}

ffi::Error run_decode(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                      ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> o_partial,
                      ffi::Result<ffi::AnyBuffer> lse_partial, double scale, bool is_causal,
                      int64_t window_left, int64_t window_right, int64_t num_splits) {
  DecodeParams params;
  JF_RETURN_IF_ERROR(make_decode_params(q, k, v, q_lens, kv_lens, *o, *lse, *o_partial, *lse_partial, scale,
                                        is_causal, window_left, window_right, num_splits, params,
                                        ValueHeadDim::kOwn));
  PoolRunner runner{&pool};
  cpu::flash_decode(params, {&PoolRunner::run, &runner});
  return ffi::Error::Success();
}

ffi::Error run_paged(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                     ffi::AnyBuffer page_table, ffi::AnyBuffer kv_lens, ffi::Result<ffi::AnyBuffer> o,
                     ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> o_partial,
                     ffi::Result<ffi::AnyBuffer> lse_partial, double scale, bool is_causal,
                     int64_t window_left, int64_t window_right, int64_t num_splits) {
  DecodeParams params;
  JF_RETURN_IF_ERROR(make_paged_params(q, k_pages, v_pages, page_table, kv_lens, *o, *lse, *o_partial,
                                       *lse_partial, scale, is_causal, window_left, window_right, num_splits,
                                       params, ValueHeadDim::kOwn));
  PoolRunner runner{&pool};
  cpu::flash_decode(params, {&PoolRunner::run, &runner});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuFlashDecode, run_decode, decode_binding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuFlashPaged, run_paged, paged_binding<ffi::ThreadPool>());

// And the score policies: logit soft-capping ("logits_soft_cap", c > 0 or 0 for off;
// attention_soft_cap checks it) and ALiBi (one more operand after the segment ids, and its
// switch; set_alibi_slopes checks them), and the block-sparse mask (one more operand and its
// switch; set_block_mask checks them), and fused dropout (one more operand and its rate, 0 for
// off; set_dropout checks them), and jax.nn's bias and mask arrays (an operand and its switch
// each; set_logit_arrays checks them).
template <typename Binding>
auto with_score_policies(Binding binding) {
  return std::move(binding)
      .template Attr<double>("logits_soft_cap")
      .template Arg<ffi::AnyBuffer>()  // alibi_slopes (..., N) float32, or (0,) without
      .template Attr<bool>("alibi")
      .template Arg<ffi::AnyBuffer>()  // block_mask (..., N, Tb, Sb) bool, or (0,) without
      .template Attr<bool>("block_sparse")
      .template Arg<ffi::AnyBuffer>()  // dropout_seeds (..., N, 4) uint32, or (0,) without
      .template Attr<double>("dropout_rate")
      .template Arg<ffi::AnyBuffer>()  // bias (..., N|1, T|1, S|1) float, or (0,) float32 without
      .template Attr<bool>("bias")
      .template Arg<ffi::AnyBuffer>()  // mask (..., N|1, T|1, S|1) bool, or (0,) without
      .template Attr<bool>("mask");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuFlashFwd, run_fwd,
                              with_score_policies(with_segment_ids(fwd_binding<ffi::ThreadPool>())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuFlashBwd, run_bwd,
                              with_score_policies(with_segment_ids(bwd_binding<ffi::ThreadPool>())
                                                      .Attr<int64_t>("dq_splits")
                                                      .Attr<bool>("deterministic"))
                                  .Ret<ffi::AnyBuffer>()    // dbias: the bias's shape and dtype, or (0,) float32
                                  .Ret<ffi::AnyBuffer>());  // dbias_accum workspace float32 (set_dbias)

}  // namespace jax_flash
