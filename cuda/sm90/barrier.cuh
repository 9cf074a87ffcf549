// Synchronisation of warp-specialised Hopper (sm_90a) kernels: shared-memory mbarriers (a
// producer's asynchronous copies complete a phase by their byte count; consumers release a stage
// by arriving), named barriers between warpgroups, and the register split between producer and
// consumer warpgroups (setmaxnreg). Only meaningful in code compiled for sm_90a.
#pragma once

#include <cstdint>

#include "gpu/ptx.cuh"

namespace jax_flash::cuda {

// An mbarrier in shared memory, by its shared address.
struct Mbarrier {
  uint32_t address;

  __device__ explicit Mbarrier(const uint64_t* bar) : address(smem_address(bar)) {}

  // One thread, before any other use; visible to the CTA after fence_init() and a barrier.
  __device__ __forceinline__ void init(int arrivals) const {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(address), "r"(arrivals));
  }
  __device__ __forceinline__ static void fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Counts one arrival and expects `bytes` more of asynchronous copies in this phase.
  __device__ __forceinline__ void arrive_expect_bytes(uint32_t bytes) const {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(address), "r"(bytes)
                 : "memory");
  }
  // Expects `bytes` more of asynchronous copies in this phase, without arriving.
  __device__ __forceinline__ void expect_bytes(uint32_t bytes) const {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(address), "r"(bytes) : "memory");
  }
  __device__ __forceinline__ void arrive() const {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(address) : "memory");
  }
  // Counts one arrival once every cp.async this thread has issued so far is complete (the
  // barrier's count includes the arrival: .noinc).
  __device__ __forceinline__ void arrive_after_copies() const {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(address) : "memory");
  }
  // Waits until the phase of parity `phase` has completed (a fresh barrier is in phase 0, and
  // waiting on parity 1 returns at once: producers start there for their empty slots).
  __device__ __forceinline__ void wait(int phase) const {
    asm volatile(
        "{\n.reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(address),
        "r"(phase)
        : "memory");
  }
};

// Named barriers (id 0 is __syncthreads'): `threads` threads, whole warps, take part; sync waits
// for them all, arrive counts this warp without waiting.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Per-thread register limits of a warpgroup (every warp of it executes the same call): the
// producer gives registers back, the consumers take them.
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace jax_flash::cuda
