// Which CUDA kernel family runs each pass. On Hopper (compute capability 9.x) the warp-specialised
// wgmma (sm90ws) kernels, wherever gpu/tile_shapes.cuh has one for the head dim; the mma.sync
// (sm80) family everywhere else. These environment variables, read once per process, override the
// choice for experiments and comparisons:
//   JAX_FLASH_CUDA_FORWARD  = sm80 | sm90ws | sm90ws_narrow | sm90ws_wide | sm90ws_alusums |
//                             sm90ws_directstore
//                             (default on Hopper: sm90ws)
//   JAX_FLASH_CUDA_BACKWARD = sm80 | sm90ws | sm90ws_atomicdq | sm90ws_bulkdq | sm90ws_tileddq |
//                             sm90ws_m80 | sm90ws_deferdq | sm90ws_stagedq
//                             (default on Hopper: sm90ws)
// The forward's sm90ws runs on a persistent grid whose CTAs take tiles from a counter as they free
// (sm90/tile_scheduler.cuh kDynamic, session 25) where there is no causal mask or the tiles are
// 192 rows high (head dim 64), and are dealt them statically in pairs of a long and a short causal
// block on 128-row tiles under a causal mask (kStaticPairs; sm90/flash_fwd_ws.cu measured_grid), with
// FlashAttention-3's wider tiles where they measured faster (gpu/tile_shapes.cuh
// kWideTilesByDefault; JAX_FLASH_CUDA_FWD_GRID below deals the tiles otherwise); sm90ws_narrow
// never takes the wide tiles, sm90ws_wide wherever they exist; sm90ws takes a plain
// differentiated call's sums of the 16-bit P from the tensor cores (P times a column of ones) on
// the 128 x 128 tiles at head dims 64 and 128 (+0.9-2.4% fwd+bwd at hd128, session 18),
// sm90ws_alusums from the softmax's own unpacking and adding, as before;
// sm90ws stores a plain call's 16-bit O by TMA from shared memory at head dims 64 and 128
// (FlashAttention-3's epilogue; +1-7% on the inference forward, session 21),
// sm90ws_directstore by every thread's 4-byte stores, as before. The
// backward's sm90ws runs the variant measured fastest for the head dim (TileShapes:
// 128-row query blocks with dK from registers at head dim 64, dQ added as FlashAttention-3 does at
// 128: one bulk reduction a warpgroup a visit into an accumulator in the fragments' order,
// sm90/traits.cuh kTiledDq; bulk row reductions at 97..127, atomics elsewhere, 65..96 among
// them since session 28); sm90ws_atomicdq
// and sm90ws_bulkdq force 64-row query blocks with dQ added by atomics or by bulk row reductions
// from shared memory (the general calls too: soft cap, ALiBi, segment ids); sm90ws_tileddq takes
// the tiled dQ at the head dims that run the kernels of 128 (97..128, or 65..128 under
// JAX_FLASH_CUDA_HD96=padded; elsewhere sm90ws); sm90ws_m80 (experimental, session 21)
// visits 80-row query blocks in the plain non-deterministic calls at head dim 128, dQ computed
// transposed (FlashAttention-3's non-causal tile; sm90/traits.cuh kDqTransposed); sm90ws_deferdq
// (experimental, session 22) runs those calls on head dim 128's tiled kernel without the
// consumers' barrier, each visit's dQ computed during the next (sm90/traits.cuh kDeferDq);
// sm90ws_stagedq (experimental, session 28) runs the split kernels of 256 (head dims 193..256)
// with dQ handed off through the stage's Q and dO tiles to bulk reductions, no atomics
// (sm90/traits.cuh kStageDq; non-deterministic calls; elsewhere sm90ws). At head dims 129..256
// every Hopper backward choice runs the split head-dim kernels of 192 and 256 (sm90/traits.cuh
// kSplitHeadDim: the warpgroups share 64-key blocks, dQ by atomics; JAX_FLASH_CUDA_HD192_BWD
// below for 129..192).
// A Hopper choice only applies on Hopper, and only where a Hopper kernel exists.
//   JAX_FLASH_CUDA_ORDER = longest | grid (default: longest since session 23): the order in which
//                          the main backward's CTAs (both families) start on a causal call:
//                          longest key blocks first, in chunks of about two waves
//                          (gpu/block_geometry.cuh key_block_of_cta), or the grid's own order
//                          (each head's key blocks one after another), as before. Under
//                          `longest` the Hopper backward also runs the batch's CTAs of a key
//                          block side by side where the batch shares a dbias (session 38).
//   JAX_FLASH_CUDA_HD96 = native | padded (default: native since session 23): head dims 65..96
//                         run the kernels compiled for head dim 96 (the wgmma ones: 128-column
//                         tiles whose products stop at 96, sm90/traits.cuh tile_head_dim; the
//                         mma.sync family runs them at 128 either way), or those of 128, as before.
//   JAX_FLASH_CUDA_HD192_BWD = native | padded | sm80 (default: native since session 29): on Hopper
//                              the backward of head dims 129..192 runs the split wgmma kernels of
//                              192 (sm90/traits.cuh kSplitHeadDim), or those of 256 with columns
//                              192..255 zero-filled by TMA (session 28's default; deterministic
//                              calls keep 192's), or the mma.sync kernels of 192.
//   JAX_FLASH_CUDA_VALUE_HEAD_DIM = native | padded (default: native since session 30, +18-31% on
//                                   the forward at 192 / 128): a forward whose value head dim Hv
//                                   differs from H (MLA's 192 / 128) runs on Hopper a kernel of
//                                   that pair where one is compiled (gpu/tile_shapes.cuh
//                                   JF_SM90_FWD_VALUE_HEAD_DIMS: P V makes Hv columns), or the
//                                   kernels of H with v zero-padded to H (jax_flash._ops pads;
//                                   the backward pads either way).
//   JAX_FLASH_CUDA_DECODE_LOADS = plain | evict_first | prefetch256 (default: plain; experimental,
//                                 session 31): the split-KV decode kernel's K/V copies as they
//                                 are, or with an L2 hint: evict-first (K/V are read once), or a
//                                 256-byte prefetch (gpu/ptx.cuh cp_async_16_hinted).
//   JAX_FLASH_CUDA_BIAS_LOADS = tma | staged | direct (default: tma since session 36: the forward
//                               with a (1, N, T, S) bias 2.0-2.4x faster than by the warp's
//                               copies on the H100; experimental behind
//                               JAX_FLASH_CUDA_LOGIT_ARRAYS=on): a 16-bit bias's tiles go
//                               through shared memory a stage ahead where gpu/logit_arrays.cuh
//                               bias_stages allows and the kernel has room, by TMA where the
//                               bias has a descriptor (sm90/tensor_map.h make_bias_tensor_map:
//                               rows not broadcast), else by the producer warp's copies; dbias
//                               takes 16-byte atomics of four keys where its layout allows
//                               (gpu/logit_arrays.cuh dbias_quads). `staged`: the warp's copies
//                               always (session 34). `direct`: every element a global load in
//                               the consumers' path and dbias a float32 atomic (session 33's
//                               first version).
//   JAX_FLASH_CUDA_FWD_GRID = measured | per_tile | static | dynamic (default: measured): how the
//                             Hopper forward's CTAs take their query tiles
//                             (sm90/tile_scheduler.cuh QueryTileGrid), whatever the mask and tiles:
//                             measured is gpu/launch.cu's choice (static pairs with a causal mask,
//                             the counter without), the others force a CTA per tile, static pairs
//                             (everywhere the default before session 25) or the counter. (Until
//                             session 43 also JAX_FLASH_CUDA_FORWARD=sm90ws_grid, sm90ws_static and
//                             sm90ws_dynamic.)
//   JAX_FLASH_CUDA_FWD_ROWS = end | start (default: end since session 48, whose reference,
//                             sanitizer and NaN cases passed under it; measured faster in
//                             sessions 44, 45 and 48): where the Hopper plain forward's query tiles lie
//                             when the tile height does not divide the sequence (the 192-row
//                             tiles of head dim 64 at every length that is a multiple of 128):
//                             from the sequence's end (to within 64 rows), the first tile's rows
//                             before row 0 its padding, which under a causal mask sees the fewest
//                             key blocks; or from row 0, the last tile's rows past the sequence
//                             its padding.
//   JAX_FLASH_CUDA_FWD_UNSEEN = skip | compute (default: skip since session 48): whether each
//                             consumer warpgroup of the Hopper plain forward skips the products
//                             and softmax of a key block that none of its own 64 rows sees (it
//                             still waits its turn and releases the buffers). Such blocks are
//                             those the tile's other rows see: under a causal mask the 192-row
//                             tiles' last one or two blocks for their upper warpgroups (about
//                             11% of head dim 64's work at seq 1024, 6% at 2048), and an
//                             end-aligned first tile's padding warpgroups. With FWD_ROWS=end:
//                             head dim 64's causal forward +5-16% at seq 1024-8192 (session 45).
//                             Only the 192-row tiles' kernels (head dims up to 64) have the skip
//                             since session 50 (Sm90FwdWsTraits::kSkipsUnseenBlocks): its code
//                             cost the others 7-20% even when off.
//   JAX_FLASH_CUDA_FWD_STORES = vectors | pairs (default: vectors since session 52): how a forward
//                             stores O from registers (the differentiated forwards at every head
//                             dim, the plain ones where no TMA store runs: head dims 96, 192, 256
//                             and the mma.sync kernels; gpu/epilogue.cuh): 8 adjacent columns a
//                             lane (16 bytes, and 8 of o_error) after a quad's shuffles, where the
//                             rows are aligned for it (store_output_vectors), or each lane its
//                             pairs of columns, 4 bytes a store, as before. On an H100 (session
//                             52) vectors ran head dim 256's forward 12-35% faster at seq
//                             1024-2048, head dim 128's fwd+bwd up to 9% at seq 1024.
//   JAX_FLASH_CUDA_NARROW = split | off (default: split since session 19, whose differential run
//                           of 2000 configurations gave 0 misses under it): narrow plain calls
//                           (narrow_shape below) run the mma.sync kernels with P and dS as hi +
//                           lo, and single-key rows get dS = 0 exactly (gpu/score_mods.cuh
//                           narrow_plain_call; issue 13); off runs them as any other call.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/mask.h"

namespace jax_flash::cuda {

// The kernel family of a pass: mma.sync (sm80) or warp-specialised wgmma (sm90ws); for the
// backward also sm90ws with 64-row query blocks and dQ forced to atomics or to bulk reductions.
// sm90ws_narrow / sm90ws_wide (forward): sm90ws with the plain calls' wide tiles never / wherever
// they exist (head dim 128 non-causal: key blocks of 176; head dim 64: 192 query rows, three
// consumer warpgroups; head dims 192 and 256: key blocks of 112 and 80).
enum class KernelFamily {
  kSm80, kSm90Ws, kSm90WsNarrow, kSm90WsWide, kSm90WsAluSums, kSm90WsDirectStore,
  kSm90WsAtomicDq, kSm90WsBulkDq, kSm90WsTiledDq, kSm90WsM80, kSm90WsDeferDq, kSm90WsStageDq
};

// Empty when the variables are unset or hold a known value; else a message naming the variable,
// its value and the values it takes (the FFI handlers return it as an error).
const std::string& kernel_override_error();

// The family each pass prefers on the current device (gpu/launch.cu falls back to sm80 where the
// family has no kernel for the head dim).
KernelFamily forward_family();
KernelFamily backward_family();
// Whether narrow calls run the split (unless JAX_FLASH_CUDA_NARROW=off).
bool narrow_split_enabled();
// Whether causal backward calls start their longest key blocks first, and the Hopper backward
// runs a batch-shared dbias's CTAs side by side (unless JAX_FLASH_CUDA_ORDER=grid; gpu/launch.h
// key_major_groups, BwdParams::batch_innermost).
bool longest_first_enabled();
// Whether head dims 65..96 run the kernels of head dim 96 (unless JAX_FLASH_CUDA_HD96=padded:
// those of 128).
bool native_head_dim_96_enabled();
// The kernels that Hopper backwards of head dims 129..192 run on (JAX_FLASH_CUDA_HD192_BWD).
enum class HeadDim192Backward { kNative, kPadded, kSm80 };
HeadDim192Backward head_dim_192_backward();
// Whether a Hopper forward of a value head dim Hv != H runs a kernel of that (H, Hv) pair where
// one is compiled (unless JAX_FLASH_CUDA_VALUE_HEAD_DIM=padded, which zero-pads v to H:
// gpu/launch.h forward_takes_value_head_dim).
bool own_value_head_dim_enabled();

// The L2 hint of the decode kernel's K/V copies (JAX_FLASH_CUDA_DECODE_LOADS).
enum class DecodeLoads { kPlain, kEvictFirst, kPrefetch256 };
DecodeLoads decode_loads();
// How the Hopper kernels read a bias array (JAX_FLASH_CUDA_BIAS_LOADS).
enum class BiasLoads { kTma, kStaged, kDirect };
// How the Hopper forward's CTAs take their query tiles (sm90/tile_scheduler.cuh): a CTA per tile, or
// a persistent grid dealt them statically in pairs or taking them from a counter.
enum class QueryTileGrid : int { kPerTile, kStaticPairs, kDynamic };
// JAX_FLASH_CUDA_FWD_GRID's deal, where it forces one (gpu/launch.cu sm90_fwd_options).
std::optional<QueryTileGrid> forward_grid_override();
// Whether the plain Hopper forward's tiles end at the sequence's end (the default;
// JAX_FLASH_CUDA_FWD_ROWS=start lays them from row 0; sm90/flash_fwd_ws.cu query_row_shift).
bool end_aligned_rows_enabled();
// Whether the plain Hopper forward's consumer warpgroups skip the key blocks none of their own
// rows sees (the default; JAX_FLASH_CUDA_FWD_UNSEEN=compute computes them;
// FwdTmaParams::skip_unseen_blocks).
bool skip_unseen_blocks_enabled();
// Whether the forwards store 16-bit O rows (and their rounding errors) from registers 8 columns
// a lane at once (unless JAX_FLASH_CUDA_FWD_STORES=pairs; FwdParams::o_vector_stores).
bool vector_stores_enabled();
// Whether the Hopper kernels stage a 16-bit bias array's tiles through shared memory where they
// can (unless JAX_FLASH_CUDA_BIAS_LOADS=direct), and whether they copy them by TMA where it can
// (unless JAX_FLASH_CUDA_BIAS_LOADS=staged or direct).
bool staged_bias_enabled();
bool tma_bias_enabled();

// Narrow calls (common/mask.h narrow_shape): by default (JAX_FLASH_CUDA_NARROW=split) plain ones
// run the mma.sync kernels with P and dS as hi + lo (two 16-bit operands: about float32;
// gpu/score_mods.cuh narrow_plain_call), and a differentiated one keeps its o in float32 for
// delta (jax_flash._attention; on peaked rows the int8 residual's 16 bits of o were not enough,
// the model's [776]). The extra products cost little at such sizes. The CUDA differential run's
// misses [98] and [127] were rows of 2-3 keys; tests/cuda_numerics_model.py over the 2000
// configurations of seed 0: 24 misses without the split (single-key rows zeroed), 0 with it
// (hilo8_lsum_split_small_o32_1key), and the H200 run of the 2000 (session 19): 0.

// Compute capability major of the current device (0 if CUDA cannot say).
int device_compute_major();
// Streaming multiprocessors of the current device (0 if CUDA cannot say).
int device_sm_count();
// The most dynamic shared memory a CTA of the current device may opt in to (0 if CUDA cannot say).
int device_max_smem_per_block();

}  // namespace jax_flash::cuda
