// The nanobind extension jax_flash._native: hands the FFI handler capsules to Python.
#include <nanobind/nanobind.h>

#include <cstdint>

#include "common/attention_params.h"
#include "common/decode_params.h"
#include "common/dropout_bits.h"
#include "common/mask.h"
#include "cpu/ffi_handlers.h"
#include "cpu/kernels.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule handler_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jax_flash native kernels (XLA FFI handlers)";
  // name -> {platform -> capsule}; Python registers each one with jax.ffi.register_ffi_target.
  m.def("registrations", [] {
    nb::dict cpu;
    cpu["jax_flash_cpu_fwd"] = handler_capsule(jax_flash::kCpuFlashFwd);
    cpu["jax_flash_cpu_bwd"] = handler_capsule(jax_flash::kCpuFlashBwd);
    cpu["jax_flash_cpu_decode"] = handler_capsule(jax_flash::kCpuFlashDecode);
    cpu["jax_flash_cpu_paged"] = handler_capsule(jax_flash::kCpuFlashPaged);
    nb::dict out;
    out["cpu"] = cpu;
    return out;
  });
  // Constants of the kernels that the Python side needs (it reads them here, never copies them).
  m.def("kernel_constants", [] {
    nb::dict c;
    c["max_head_dim"] = jax_flash::kMaxHeadDim;
    c["empty_row_lse"] = jax_flash::kEmptyRowLse;
    c["cpu_block_q"] = jax_flash::cpu::kBlockQ;
    c["cpu_block_k"] = jax_flash::cpu::kBlockK;
    // The block-sparse mask's block (jax_flash.BLOCK_MASK_BLOCK), its own size, not the tiles'.
    c["block_mask_block_q"] = jax_flash::kBlockMaskRows;
    c["block_mask_block_k"] = jax_flash::kBlockMaskKeys;
    c["cpu_head_dim_align"] = jax_flash::cpu::kHeadDimAlign;
    c["max_decode_splits"] = jax_flash::kMaxDecodeSplits;
    // The CUDA kernels' mask bits (jax_flash._logit_arrays.cuda_mask_bits): common/ to both
    // builds, here so that the packing is tested where no CUDA module was built.
    c["mask_bits_group"] = jax_flash::kMaskBitsGroup;
    c["mask_bits_words"] = jax_flash::kMaskBitsWords;
    // Fused dropout's seed words (common/dropout_bits.h DropoutSeedWord) and the multiple a
    // kernel's row and key offsets in the sequence must be (jax_flash._dropout.at_offset).
    c["dropout_seed_words"] = static_cast<int>(jax_flash::kDropoutSeedWords);
    c["dropout_offset_multiple"] = jax_flash::kDropoutOffsetMultiple;
    return c;
  });
  m.def("cpu_dq_accum_elements",
        [](int64_t dq_splits, int64_t batch, int64_t seq_q, int64_t heads_q, int64_t head_dim) {
          const jax_flash::AttentionShape shape{batch, seq_q, /*seq_k=*/0, heads_q, /*heads_k=*/0, head_dim};
          return jax_flash::cpu::dq_accum_elements(shape, dq_splits);
        },
        "Elements of the CPU backward's float32 dQ workspace (what its handler checks).");
  m.def("cpu_dbias_accum_elements", &jax_flash::cpu::dbias_accum_elements,
        "Elements of the CPU backward's float32 dbias workspace (bias_elements, keys_broadcast: "
        "the bias's key dim is 1, float32: the bias is float32, dq_splits, one_each: "
        "cpu_dbias_one_each); 0: none.");
  m.def("cpu_dbias_one_each",
        [](int64_t bias_batch, int64_t bias_heads, int64_t bias_rows, int64_t bias_keys, int64_t batch,
           int64_t heads_q, int64_t seq_q, int64_t seq_k) {
          const jax_flash::AttentionShape shape{batch, seq_q, seq_k, heads_q, /*heads_k=*/0, /*head_dim=*/0};
          return jax_flash::cpu::dbias_one_each(bias_batch, bias_heads, bias_rows, bias_keys, shape);
        },
        "Whether each element of the CPU backward's dbias takes one dS (the bias's leading dims' "
        "product, heads, rows and keys; the call's batch, query heads, T and S): then it is stored "
        "directly, with no float32 workspace.");
  m.def("decode_workspace_elements",
        [](int64_t num_splits, int64_t batch, int64_t seq_q, int64_t heads_q, int64_t head_dim_v) {
          // o_partial holds output rows: v's head dim Hv (q's and k's does not enter).
          const jax_flash::AttentionShape shape{batch,         seq_q,      /*seq_k=*/0, heads_q,
                                                /*heads_k=*/0, head_dim_v, head_dim_v};
          return nb::make_tuple(jax_flash::decode_o_partial_elements(shape, num_splits),
                                jax_flash::decode_lse_partial_elements(shape, num_splits));
        },
        "Elements of the split-KV decode's float32 workspaces (o_partial, lse_partial) for output "
        "rows of v's head dim head_dim_v.");
  m.def("cpu_kernel_isa", [] { return jax_flash::cpu::kernel_isa(); },
        "The instruction set of the CPU kernel variant this processor runs.");
  m.def("cpu_fma_peak_gflops", [] { return jax_flash::cpu::fma_peak_gflops(); },
        "One core's float32 FMA peak (GFLOP/s), measured now with the CPU kernel's vectors.");
  // For tests: the mask arithmetic every kernel (CPU and CUDA) walks tiles by, from
  // common/mask.h. Returns ([key_range(i) for i < rows], [query_range(j) for j < keys],
  // queries_seeing_keys(j0, j1)), each range a (begin, end) pair.
  m.def("_mask_ranges", [](bool causal, int64_t window_left, int64_t window_right, int64_t q_len, int64_t kv_len,
                           int64_t rows, int64_t keys, int64_t j0, int64_t j1) {
    const jax_flash::MaskParams mask{causal, window_left, window_right};
    nb::list key_ranges, query_ranges;
    for (int64_t i = 0; i < rows; ++i) {
      const jax_flash::KeyRange r = jax_flash::key_range(mask, i, q_len, kv_len);
      key_ranges.append(nb::make_tuple(r.begin, r.end));
    }
    for (int64_t j = 0; j < keys; ++j) {
      const jax_flash::QueryRange r = jax_flash::query_range(mask, j, q_len, kv_len);
      query_ranges.append(nb::make_tuple(r.begin, r.end));
    }
    const jax_flash::QueryRange seeing = jax_flash::queries_seeing_keys(mask, j0, j1, q_len, kv_len);
    return nb::make_tuple(key_ranges, query_ranges, nb::make_tuple(seeing.begin, seeing.end));
  });
  // common/mask.h's static_keys_per_row (the CUDA launches' narrow-call bound), for its test.
  m.def("_static_keys_per_row",
        [](bool causal, int64_t window_left, int64_t window_right, int64_t seq_q, int64_t seq_k) {
          return jax_flash::static_keys_per_row(jax_flash::MaskParams{causal, window_left, window_right}, seq_q,
                                                seq_k);
        });
}
