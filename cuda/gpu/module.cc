// The nanobind extension jax_flash._native_cuda: the CUDA handlers' capsules. A module of its own
// so that the CPU extension imports on machines without an NVIDIA driver.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/attention_params.h"
#include "gpu/decode_ffi_handlers.h"
#include "gpu/ffi_handlers.h"
#include "gpu/flash_decode.h"
#include "gpu/kernel_choice.h"
#include "gpu/launch.h"
#include "sm90/fwd_timeline.h"

namespace nb = nanobind;

NB_MODULE(_native_cuda, m) {
  m.doc() = "jax_flash CUDA kernels (XLA FFI handlers)";
  m.def("registrations", [] {
    nb::dict cuda;
    cuda["jax_flash_cuda_fwd"] = nb::capsule(reinterpret_cast<void*>(jax_flash::kCudaFlashFwd));
    cuda["jax_flash_cuda_bwd"] = nb::capsule(reinterpret_cast<void*>(jax_flash::kCudaFlashBwd));
    cuda["jax_flash_cuda_decode"] = nb::capsule(reinterpret_cast<void*>(jax_flash::kCudaFlashDecode));
    cuda["jax_flash_cuda_paged"] = nb::capsule(reinterpret_cast<void*>(jax_flash::kCudaFlashPaged));
    nb::dict out;
    out["cuda"] = cuda;
    return out;
  });
  // Constants of the CUDA kernels that the Python side needs (read here, never copied).
  m.def("kernel_constants", [] {
    nb::dict c;
    c["head_dim_multiple"] = jax_flash::cuda::kHeadDimMultiple;
    c["max_head_dim"] = jax_flash::kMaxHeadDim;
    c["segment_id_span_rows"] = jax_flash::kSegmentIdSpanRows;
    c["decode_rows_per_cta"] = jax_flash::cuda::kDecodeRowsPerCta;
    c["decode_block_n"] = jax_flash::cuda::kDecodeBlockN;
    c["decode_max_head_dim"] = jax_flash::cuda::kDecodeMaxHeadDim;
    c["fwd_scheduler_elements"] = jax_flash::cuda::kFwdSchedulerElements;
    return c;
  });
  m.def("dq_accum_elements",
        [](int64_t batch, int64_t seq_q, int64_t seq_k, int64_t heads_q, int64_t heads_k, int64_t head_dim,
           int64_t head_dim_v, bool deterministic) {
          const jax_flash::AttentionShape shape{batch, seq_q, seq_k, heads_q, heads_k, head_dim, head_dim_v};
          return jax_flash::cuda::dq_accum_elements(shape, deterministic);
        },
        "Elements of the CUDA backward's float32 workspace (dQ's accumulator, and dK's and dV's "
        "where the Hopper backward splits a group's heads) for v's head dim as the call passes it: "
        "what its handler checks.");
  m.def("narrow_split_call",
        [](bool is_causal, int64_t window_left, int64_t window_right, int64_t seq_q, int64_t seq_k) {
          const jax_flash::MaskParams mask{is_causal, window_left, window_right};
          return jax_flash::cuda::narrow_split_enabled() && jax_flash::narrow_shape(mask, seq_q, seq_k);
        },
        "Whether a plain call of this mask and shape runs the narrow split (JAX_FLASH_CUDA_NARROW=split; "
        "gpu/score_mods.cuh narrow_plain_call).");
  m.def("forward_takes_value_head_dim",
        [](int64_t head_dim, int64_t head_dim_v) {
          jax_flash::AttentionShape shape{1, 1, 1, 1, 1, head_dim, head_dim_v};
          return jax_flash::cuda::forward_takes_value_head_dim(shape);
        },
        "Whether a forward of these head dims (H != Hv, padded to the kernels' multiple) runs a kernel "
        "of the pair, taking v as it is (gpu/launch.h forward_takes_value_head_dim).");
  m.def("backward_takes_value_head_dim",
        [](int64_t head_dim, int64_t head_dim_v, bool deterministic) {
          jax_flash::AttentionShape shape{1, 1, 1, 1, 1, head_dim, head_dim_v};
          return jax_flash::cuda::backward_takes_value_head_dim(shape, deterministic);
        },
        "Whether a backward of these head dims (H != Hv, padded to the kernels' multiple) runs a "
        "kernel of the pair, taking v and dO as they are (gpu/launch.h backward_takes_value_head_dim).");
#ifdef JF_FWD_TIMELINE
  // The debug build's forward timeline (sm90/fwd_timeline.h): zero it before the launch to
  // record, read it after (bytes of kFwdTimelineWords uint64 words, [cta][warpgroup][entry]).
  m.def("fwd_timeline_reset", [] {
    if (cudaError_t e = jax_flash::cuda::reset_fwd_timeline()) throw std::runtime_error(cudaGetErrorString(e));
  });
  m.def("fwd_timeline", [] {
    using namespace jax_flash::cuda;
    std::vector<uint64_t> words(kFwdTimelineWords);
    if (cudaError_t e = read_fwd_timeline(words.data())) throw std::runtime_error(cudaGetErrorString(e));
    nb::dict out;
    out["words"] = nb::bytes(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(uint64_t));
    out["shape"] = nb::make_tuple(kFwdTimelineCtas, kFwdTimelineGroups, kFwdTimelineEntries);
    nb::list events;
    for (const char* name : kFwdEventNames) events.append(name);
    out["events"] = events;
    return out;
  });
#endif
  m.def("device_sm_count", [] { return jax_flash::cuda::device_sm_count(); },
        "Streaming multiprocessors of the current CUDA device (asked once; 0 if CUDA cannot say).");
}
