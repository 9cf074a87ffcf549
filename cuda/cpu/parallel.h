// parallel_for over a TaskRunner with a lambda body (compiled per ISA, see kernels.h).
#pragma once

#include "cpu/kernels.h"

namespace jax_flash::cpu::JF_ISA {

template <typename F>
inline void parallel_for(const TaskRunner& runner, int64_t n, F& body) {
  runner.run(runner.self, n, [](void* arg, int64_t i) { (*static_cast<F*>(arg))(i); }, &body);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t clamp_len(const int32_t* lens, int64_t b, int64_t full) {
  return max64(0, min64(static_cast<int64_t>(lens[b]), full));
}

}  // namespace jax_flash::cpu::JF_ISA
