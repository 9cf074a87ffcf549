// The kernel choice of kernel_choice.h: environment overrides read once, the device asked once.
#include "kernel_choice.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <optional>

namespace jax_flash::cuda {
namespace {

constexpr const char* kForwardVariable = "JAX_FLASH_CUDA_FORWARD";
constexpr const char* kBackwardVariable = "JAX_FLASH_CUDA_BACKWARD";

struct Overrides {
  std::optional<ForwardKernel> forward;
  std::optional<BackwardKernel> backward;
  std::string error;
};

Overrides read_overrides() {
  Overrides o;
  auto bad = [&](const char* variable, const std::string& value, const char* allowed) {
    o.error += std::string(o.error.empty() ? "" : "; ") + "jax_flash: " + variable + "=" + value +
               " is not one of " + allowed;
  };
  if (const char* value = std::getenv(kForwardVariable); value != nullptr && *value != '\0') {
    const std::string v = value;
    if (v == "sm80") o.forward = ForwardKernel::kSm80;
    else if (v == "sm90") o.forward = ForwardKernel::kSm90;
    else bad(kForwardVariable, v, "sm80, sm90");
  }
  if (const char* value = std::getenv(kBackwardVariable); value != nullptr && *value != '\0') {
    const std::string v = value;
    if (v == "sm80") o.backward = BackwardKernel::kSm80;
    else if (v == "sm90") o.backward = BackwardKernel::kSm90;
    else bad(kBackwardVariable, v, "sm80, sm90");
  }
  return o;
}

const Overrides& overrides() {
  static const Overrides o = read_overrides();
  return o;
}

// The head dims the wgmma kernels are compiled for (64 and 128), after padding.
bool hopper_head_dim(int64_t head_dim) { return head_dim > 32 && head_dim <= 128; }

}  // namespace

const std::string& kernel_override_error() { return overrides().error; }

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

ForwardKernel forward_kernel(const FwdParams& params) {
  if (!hopper_head_dim(params.shape.head_dim) || device_compute_major() != 9) return ForwardKernel::kSm80;
  return overrides().forward.value_or(ForwardKernel::kSm90);
}

BackwardKernel backward_kernel(const BwdParams& params) {
  if (!hopper_head_dim(params.shape.head_dim) || device_compute_major() != 9) return BackwardKernel::kSm80;
  return overrides().backward.value_or(BackwardKernel::kSm90);
}

}  // namespace jax_flash::cuda
