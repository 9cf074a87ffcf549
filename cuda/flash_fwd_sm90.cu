// Launcher of the Hopper forward kernel, and the rule that picks it.
#include <cstdlib>
#include <cstring>

#include "flash_dispatch.cuh"
#include "flash_fwd_sm90.cuh"
#include "flash_launch.h"

namespace jax_flash::cuda {
namespace {

// Which forward kernel JAX_FLASH_CUDA_FORWARD asks for (read once): "sm80" (mma.sync), "sm90"
// (wgmma, the default on Hopper) or "sm90-pipelined" (wgmma with the softmax overlapped).
enum class ForwardChoice { kDefault, kSm80, kSm90Pipelined };

ForwardChoice forward_choice() {
  static const ForwardChoice choice = [] {
    const char* value = std::getenv("JAX_FLASH_CUDA_FORWARD");
    if (value == nullptr) return ForwardChoice::kDefault;
    if (std::strcmp(value, "sm80") == 0) return ForwardChoice::kSm80;
    if (std::strcmp(value, "sm90-pipelined") == 0) return ForwardChoice::kSm90Pipelined;
    return ForwardChoice::kDefault;
  }();
  return choice;
}

template <typename T, int kHeadDim>
struct LaunchSm90 {
  static cudaError_t run(const FwdParams& p, cudaStream_t stream) {
    if constexpr (kHeadDim == 64 || kHeadDim == 128) {
      using Traits = Sm90FwdTraits<kHeadDim, 128>;
      const bool pipelined = forward_choice() == ForwardChoice::kSm90Pipelined;
      const dim3 grid((p.shape.seq_q + Traits::kBlockM - 1) / Traits::kBlockM, p.shape.heads_q, p.shape.batch);
      return launch_with_smem(pipelined ? flash_fwd_sm90_pipelined_kernel<Traits, T> : flash_fwd_sm90_kernel<Traits, T>,
                              grid, Traits::kThreads, Traits::kSmemBytes, stream, p);
    } else {
      return cudaErrorNotSupported;
    }
  }
};

}  // namespace

int device_compute_major() {
  // Asked once per device (no stream work, so safe while XLA captures a CUDA graph).
  constexpr int kMaxDevices = 64;
  static int majors[kMaxDevices] = {};  // 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 0;
  if (majors[device] == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return 0;
    majors[device] = major;
  }
  return majors[device];
}

bool sm90_forward_applies(const FwdParams& params) {
  const int64_t d = params.shape.head_dim;
  return forward_choice() != ForwardChoice::kSm80 && d > 32 && d <= 128 && device_compute_major() == 9;
}

cudaError_t launch_flash_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
  if (params.shape.seq_q == 0 || params.shape.batch == 0) return cudaSuccess;
  return dispatch_dtype_head_dim<LaunchSm90>(params, stream);
}

}  // namespace jax_flash::cuda
