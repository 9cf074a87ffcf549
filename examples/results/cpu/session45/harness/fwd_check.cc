// Standalone timing of FlashFwd<float> (the kernel's source, no JAX): threads, seq, hd, causal.
#include <atomic>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <thread>
#include <vector>
#include "cpu/flash_fwd.h"
namespace jax_flash::cpu {
float* thread_scratch(int64_t count) {
  thread_local float* data = nullptr; thread_local int64_t size = 0;
  if (size < count) { data = static_cast<float*>(::operator new[](count * 4, std::align_val_t{64})); size = count; }
  return data;
}
}
using namespace jax_flash;
static int g_threads = 2;
static void run_tasks(const void*, int64_t n, cpu::TaskRunner::Body body, void* arg) {
  std::atomic<int64_t> next{0};
  auto drain = [&] { for (int64_t i; (i = next.fetch_add(1)) < n;) body(arg, i); };
  std::vector<std::thread> ts;
  for (int t = 1; t < g_threads; ++t) ts.emplace_back(drain);
  drain();
  for (auto& t : ts) t.join();
}
int main(int argc, char** argv) {
  g_threads = atoi(argv[1]);
  const int64_t seq = atoi(argv[2]), hd = atoi(argv[3]); const bool causal = argv[4][0] == 'Y';
  const int reps = argc > 5 ? atoi(argv[5]) : 5;
  const int64_t heads = 4;
  std::vector<float> q(seq * heads * hd), k(q.size()), v(q.size()), o(q.size()), lse(heads * seq);
  for (auto* a : {&q, &k, &v}) for (auto& x : *a) x = (rand() / float(RAND_MAX) - .5f) * 3.f;
  std::vector<int32_t> lens(1, seq);
  FwdParams p;
  p.shape = AttentionShape{1, seq, seq, heads, heads, hd, hd};
  p.mask.causal = causal; p.scale = 1.f / std::sqrt(float(hd));
  p.q = q.data(); p.k = k.data(); p.v = v.data(); p.q_lens = lens.data(); p.kv_lens = lens.data();
  p.o = o.data(); p.lse = lse.data();
  cpu::TaskRunner runner{&run_tasks, nullptr};
  double best = 1e9, best_cpu = 1e9;
  auto cpu_now = [] { timespec ts; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; };
  for (int r = 0; r < reps + 1; ++r) {
    auto t0 = std::chrono::steady_clock::now(); double c0 = cpu_now();
    cpu::h::flash_fwd_typed<float>(p, runner);
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double ct = cpu_now() - c0;
    if (r) best = std::min(best, t), best_cpu = std::min(best_cpu, ct);
  }
  const double flops = 4.0 * seq * seq * hd * heads / (causal ? 2 : 1);
  { double cs = 0; for (size_t i = 0; i < o.size(); ++i) cs += o[i] * (1 + i % 7); for (auto x : lse) cs += x; printf("sum %.17g | ", cs); }
  printf("cpu-time %.1f GFLOP/s per thread | ", flops / best_cpu / 1e9);
  printf("threads %d seq %ld hd %ld causal %c: %.2f ms %.1f GFLOP/s (%.1f per thread) o[7]=%g\n", g_threads, (long)seq, (long)hd,
         causal ? 'Y' : 'N', best * 1e3, flops / best / 1e9, flops / best / 1e9 / g_threads, o[7]);
}
