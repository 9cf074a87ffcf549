// The recorder of the Hopper forward's timeline (sm90/fwd_timeline.h). Without JF_FWD_TIMELINE
// every stamp compiles to nothing.
#pragma once

#include <cstdint>

#include "sm90/fwd_timeline.h"

namespace jax_flash::cuda {

#ifdef JF_FWD_TIMELINE
// The one buffer (this header is included by the forward's one translation unit).
__device__ uint64_t g_fwd_timeline[kFwdTimelineWords];

__device__ __forceinline__ uint64_t sm_clock() {
  uint64_t c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory");
  return c;
}

struct FwdTimeline {
  uint64_t* slot = nullptr;  // this thread's entries, or null where it does not record
  uint64_t start = 0;
  int n = 0;
  __device__ explicit FwdTimeline(int group) {
    if (blockIdx.x < kFwdTimelineCtas && threadIdx.x % 128 == 0 && group < kFwdTimelineGroups) {
      slot = g_fwd_timeline + (int64_t{blockIdx.x} * kFwdTimelineGroups + group) * kFwdTimelineEntries;
      start = sm_clock();
      slot[0] = start;
      n = 1;
    }
  }
  // (Each stamp orders the instructions around it, so the record of every phase, JF_FWD_TIMELINE
  // 2, slows the loop; 1 stamps the tiles' phases and each block's end only, 3 those and two
  // points of each block: fwd_event_recorded.)
  __device__ __forceinline__ void operator()(FwdEvent event, int arg = 0) {
    if (!fwd_event_recorded(event, JF_FWD_TIMELINE)) return;
    if (slot != nullptr && n < kFwdTimelineEntries)
      slot[n++] = (sm_clock() - start) << 32 | static_cast<uint64_t>(arg & 0xffffff) << 8 | event;
  }
};
#else
struct FwdTimeline {
  __device__ explicit FwdTimeline(int) {}
  __device__ __forceinline__ void operator()(FwdEvent, int = 0) {}
};
#endif

}  // namespace jax_flash::cuda
