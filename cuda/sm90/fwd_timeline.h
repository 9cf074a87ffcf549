// The Hopper forward's timeline, a debug instrument (CMake option JAX_FLASH_CUDA_TIMELINE=TILES,
// BLOCKS or CHAIN, OFF in every released build; it defines JF_FWD_TIMELINE as 1, 2 or 3,
// fwd_event_recorded): the first thread of each consumer warpgroup of the grid's first
// kFwdTimelineCtas CTAs records the SM's clock at each phase of its key blocks (FwdEvent) into a
// device buffer that _native_cuda.fwd_timeline() returns, so that a block's time can be split
// into waiting for its turn, for S, for P V, and the softmax's own work (.ci/gpu/fwd_timeline.py
// reads it). Host-side declarations; the recorder is sm90/fwd_timeline.cuh.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_flash::cuda {

// What an entry marks. Entry 0 of a recorder is its start clock (clock64); each later entry is
// (cycles since it) << 32 | arg << 8 | event, and a zero entry ends the record.
enum FwdEvent : uint32_t {
  kFwdEventNone = 0,     // past the last entry
  kFwdEventTileReady,    // the producer's hand-over of the next tile (or the end) is read
  kFwdEventTile,         // the tile's task is formed (arg: its key blocks)
  kFwdEventFirstS,       // the tile's first S is in registers
  kFwdEventKeyFull,      // block arg's K stage has landed (loop top)
  kFwdEventTurn,         // this warpgroup's turn to issue (ping-pong)
  kFwdEventIssued,       // S(arg) and P V(arg - 1) issued, the turn passed on
  kFwdEventScores,       // S(arg) is in registers
  kFwdEventMasked,       // S(arg) masked (and modified)
  kFwdEventMaxed,        // the rows' maxima taken (and the reference moved where it must)
  kFwdEventSoftmax,      // S(arg) exponentiated
  kFwdEventOutput,       // P V(arg - 1) is in: O's registers free
  kFwdEventConverted,    // P(arg) converted to 16-bit operands
  kFwdEventStoreStart,   // the epilogue begins (every block's P V in)
  kFwdEventStoreSynced,  // (TMA store) the O tile free and the warpgroup at its barrier
  kFwdEventStoreWritten, // O normalised and written (to the tile, or to global memory)
  kFwdEventStoreEnd,     // the tile's O stored (or its TMA store issued)
};

// The events' names, in FwdEvent's order (what _native_cuda.fwd_timeline() reports them as).
inline constexpr const char* kFwdEventNames[] = {
    "none",   "tile_ready", "tile",    "first_s",     "key_full",     "turn",          "issued",
    "scores", "masked",     "maxed",   "softmax",     "output",       "converted",     "store_start",
    "store_synced", "store_written", "store_end"};
static_assert(sizeof(kFwdEventNames) / sizeof(kFwdEventNames[0]) == kFwdEventStoreEnd + 1, "a name an event");

// Whether a build of timeline level `level` records `event`. 1 (TILES): the tiles' phases and each
// block's end (kFwdEventConverted); 2 (BLOCKS): every phase of every block; 3 (CHAIN): level 1's
// and, of each block, only S in and the exponentials done, so that a warpgroup's own chain (S's
// wait, the softmax, the conversion) shows with two stamps a block instead of BLOCKS's nine,
// each of which orders the code around it.
constexpr bool fwd_event_recorded(FwdEvent event, int level) {
  const bool block_phase = event >= kFwdEventKeyFull && event <= kFwdEventOutput;
  if (level == 3) return !block_phase || event == kFwdEventScores || event == kFwdEventSoftmax;
  return !block_phase || level >= 2;
}

constexpr int kFwdTimelineCtas = 2;
constexpr int kFwdTimelineGroups = 3;  // consumer warpgroups at most
constexpr int kFwdTimelineEntries = 16384;
constexpr int64_t kFwdTimelineWords = int64_t{kFwdTimelineCtas} * kFwdTimelineGroups * kFwdTimelineEntries;

#ifdef JF_FWD_TIMELINE
// Zeroes the buffer (before the launch to record) / copies it out (after it): kFwdTimelineWords
// words, [cta][warpgroup][entry]. Defined in sm90/flash_fwd_ws.cu.
cudaError_t reset_fwd_timeline();
cudaError_t read_fwd_timeline(uint64_t* words);
#endif

}  // namespace jax_flash::cuda
