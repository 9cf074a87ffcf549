// The nanobind extension jax_flash._native_cuda: the CUDA handlers' capsules. A module of its own
// so that the CPU extension imports on machines without an NVIDIA driver.
#include <nanobind/nanobind.h>

#include "cuda_ffi_handlers.h"

namespace nb = nanobind;

NB_MODULE(_native_cuda, m) {
  m.doc() = "jax_flash CUDA kernels (XLA FFI handlers)";
  m.def("registrations", [] {
    nb::dict cuda;
    cuda["jax_flash_cuda_fwd"] = nb::capsule(reinterpret_cast<void*>(jax_flash::kCudaFlashFwd));
    cuda["jax_flash_cuda_bwd"] = nb::capsule(reinterpret_cast<void*>(jax_flash::kCudaFlashBwd));
    nb::dict out;
    out["cuda"] = cuda;
    return out;
  });
}
