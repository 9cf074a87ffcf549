// The nanobind extension jax_flash._native: hands the FFI handler capsules to Python.
#include <nanobind/nanobind.h>

#include "cpu_ffi_handlers.h"
#include "cpu_kernels.h"

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
    nb::dict out;
    out["cpu"] = cpu;
    return out;
  });
  m.def("cpu_kernel_isa", [] { return jax_flash::cpu::kernel_isa(); },
        "The instruction set of the CPU kernel variant this processor runs.");
}
