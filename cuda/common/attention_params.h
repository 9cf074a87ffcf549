// Parameters of one attention pass, shared by every backend (the CPU kernel and both CUDA families).
//
// Layouts (row-major, innermost last):
//   q, dq        : (batch, seq_q, heads_q, head_dim)
//   k, dk        : (batch, seq_k, heads_k, head_dim)
//   v, dv        : (batch, seq_k, heads_k, head_dim_v)
//   o, do        : (batch, seq_q, heads_q, head_dim_v)
//   lse, delta   : (batch, heads_q, seq_q), float32
//   q_lens, kv_lens : (batch,), int32; valid query / key rows per batch element
//   q_segment_ids, kv_segment_ids : (batch, seq_q), (batch, seq_k), int32, or absent
//   alibi_slopes : (batch, heads_q), float32, or absent
//   block_mask   : (batch, heads_q, q_blocks, k_blocks), bool, or absent (CPU); blocks of
//                  kBlockMaskRows x kBlockMaskKeys (128 x 128)
//   dropout_seeds : (batch, heads_q, kDropoutSeedWords = 6), uint32, or absent
//   bias, mask   : broadcastable to (batch, heads_q, seq_q, seq_k) (LogitArray), or absent (CPU)
// "batch" is every leading dimension folded together (vmap adds them).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JF_HOST_DEVICE __host__ __device__
#else
#define JF_HOST_DEVICE
#endif

namespace jax_flash {

enum class Dtype : int { kFloat32, kBFloat16, kFloat16 };

// One block of the block-sparse mask (AttentionParams::block_mask): kBlockMaskRows query rows x
// kBlockMaskKeys keys, aligned at row 0 and key 0 (the last blocks partial). Its own size, not
// any kernel's tile: 128 so that every tile of every kernel (the CPU kernel's 64 x 64, the CUDA
// kernels' 64 or 128 rows/keys) lies inside one mask block and is skipped whole when the
// block's bit is 0 (with 64 x 64 blocks a 128 x 128 CUDA tile would straddle four bits, and a
// random mask at 25% density leaves 68% of such tiles with some bit set). FlexAttention's
// default block is 128 x 128 too. The Python side reads these (jax_flash.BLOCK_MASK_BLOCK).
inline constexpr int64_t kBlockMaskRows = 128;
inline constexpr int64_t kBlockMaskKeys = 128;

// The CUDA kernels' mask array as bits (common/ffi_params.h set_mask_bits, gpu/logit_arrays.cuh
// mask_bits_word): a row's keys in groups of kMaskBitsGroup, each group kMaskBitsWords uint32
// words, one per quad lane of the mma fragments (a 128-key block's 16 n-tiles x 2 columns of a
// lane). The Python side packs them so (jax_flash._logit_arrays.cuda_mask_bits reads these).
inline constexpr int64_t kMaskBitsGroup = 128;
inline constexpr int64_t kMaskBitsWords = 4;
static_assert(kMaskBitsGroup == kMaskBitsWords * 32, "a group's words hold its keys' bits");

// The masks jax.nn.dot_product_attention supports are all "key ranges per query row":
// query row i of batch b attends keys j in [key_begin(i), key_end(i)).
struct MaskParams {
  bool causal = false;          // j <= i (top-left aligned, like jax.nn)
  int64_t window_left = -1;     // j >= i - window_left; < 0 means unbounded
  int64_t window_right = -1;    // j <= i + window_right; < 0 means unbounded
  // A local window: some side bounded.
  JF_HOST_DEVICE bool windowed() const { return window_left >= 0 || window_right >= 0; }
};

// jax.nn's `bias` (float32, bfloat16 or float16) or `mask` (bool, one byte) array, broadcastable
// to (batch, heads_q, seq_q, seq_k) and read where it lies, never broadcast: element (b, h, i, j)
// is data[(b / batch_div) * batch + h * head + i * row + j * col], strides in elements, 0 along a
// dim of size 1. batch_div is how many batch elements share one slice of it (its leading dims
// folded as q's are: 1 where it has q's batch, the whole batch where it has none; vmap folds
// its axis in front of both, which keeps that form).
struct LogitArray {
  const void* data = nullptr;
  Dtype dtype = Dtype::kFloat32;  // a bias's; a mask is bool (the CUDA kernels': uint32 bits)
  int64_t batch_div = 1;
  int64_t batch = 0, head = 0, row = 0, col = 0;  // strides
  int64_t elements = 0;                           // its own size
  JF_HOST_DEVICE explicit operator bool() const { return data != nullptr; }
  // Where the (b, h) slice of it starts.
  JF_HOST_DEVICE int64_t offset(int64_t b, int64_t h) const { return b / batch_div * batch + h * head; }
};

struct AttentionShape {
  int64_t batch = 0;
  int64_t seq_q = 0;
  int64_t seq_k = 0;
  int64_t heads_q = 0;
  int64_t heads_k = 0;
  int64_t head_dim = 0;  // H: q's and k's
  // Hv: v's, and so o's, do's and dv's. MLA-style attention (DeepSeek-V2: q/k 192, v 128) has
  // Hv != H; only the CPU kernels take that (the shared FFI checks refuse it unless the handler
  // asks for ValueHeadDim::kOwn; the CUDA ones do not). An aggregate initialised without it
  // (AttentionShape{b, t, s, n, k, h}) gets Hv = H.
  int64_t head_dim_v = head_dim;
  int64_t group() const { return heads_q / heads_k; }
};

// What both passes read: the problem, its masks and scale, the inputs.
struct AttentionParams {
  AttentionShape shape;
  MaskParams mask;
  Dtype dtype = Dtype::kFloat32;
  float scale = 1.f;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  // Segment ids (packed documents), or null for none: query row i of batch b attends key j only
  // when q_segment_ids[b * seq_q + i] == kv_segment_ids[b * seq_k + j], on top of the masks
  // above. The CUDA kernels also read their spans: (lo, hi) int32 pairs of each run of
  // kSegmentIdSpanRows rows (keys) from 0, batch element by batch element (gpu/segment_ids.cuh);
  // the CPU kernel forms its own.
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  const int32_t* q_segment_id_spans = nullptr;   // (batch, ceil(seq_q / kSegmentIdSpanRows), 2)
  const int32_t* kv_segment_id_spans = nullptr;  // (batch, ceil(seq_k / kSegmentIdSpanRows), 2)
  // o is float32 while the inputs are 16-bit: the forward's output kept at full precision when
  // it is differentiated, so that the backward forms delta = rowsum(dO * O) from it and not from
  // O rounded to 16 bits (issue 13: that rounding cost dQ/dK their accuracy on peaked softmaxes).
  bool o_float32 = false;
  // Logit soft-capping (Gemma 2): with c > 0 every score s = scale * q.k becomes c * tanh(s / c)
  // before the masks and the softmax; 0 is off.
  float logits_soft_cap = 0.f;
  // ALiBi, or null for none: the score of query row i and key j of batch b, head h gains
  // alibi_slopes[b * heads_q + h] * (j - i), after the soft cap and before the masks and the
  // softmax. i and j are the positions the masks use (row and key indices, top-left aligned, so
  // j - i is what causal masking compares with 0). One slope per (batch, query head): vmap and
  // batch sharding fold into the batch like every other operand.
  const float* alibi_slopes = nullptr;
  // Block-sparse mask, or null for none: bool (one byte) per (batch, query head, query block,
  // key block), blocks of kBlockMaskRows query rows x kBlockMaskKeys keys (128 x 128, aligned at
  // row and key 0; each holds whole tiles of the kernels). 0 hides every key of the key block
  // from every row of the query block, on top of the masks above; the CPU kernels never visit
  // a tile of such a block. Only the CPU kernel reads it (the CUDA handlers take no such
  // operand, and the Python side refuses it there).
  const uint8_t* block_mask = nullptr;
  int64_t block_mask_q_blocks = 0;  // its last two dimensions (the CUDA lists' too)
  int64_t block_mask_k_blocks = 0;
  // The block mask as the CUDA kernels read it (gpu/block_sparse.cuh), or null: per (batch, query
  // head, query block) the live key blocks ascending (k_blocks slots) and their count; per
  // (batch, kv head, key block) the live (query head in group, query block) entries ascending
  // (heads_q / heads_k * q_blocks slots) and their count. Formed in XLA beside the call.
  const int32_t* kv_block_lists = nullptr;
  const int32_t* kv_block_counts = nullptr;
  const int32_t* q_block_visits = nullptr;
  const int32_t* q_block_visit_counts = nullptr;
  // Fused dropout (FlashAttention, Dao et al. 2022), or null for none: per (batch, query head)
  // six words (key0, key1, head, batch, row word, column word: common/dropout_bits.h
  // DropoutSeedWord), the Philox key and the counter's words, which give every score element's
  // keep decision from its row and key (so nothing T x S is stored, and the backward
  // regenerates the forward's mask). The head and batch words are the caller's (the global
  // indices under batch or head sharding and vmap; the same for every element where one mask
  // is shared), and so are the row and column words of the kernel's first row and key (0, or a
  // context-parallel block's place in the sequence). The normalised probabilities P
  // become P * keep / (1 - rate) before P V; the lse is not affected. The CPU kernel reads
  // it, and the Hopper CUDA kernels' dropout instantiations (gpu/dropout_fragments.h;
  // experimental: the Python side passes it to them only under JAX_FLASH_CUDA_DROPOUT=on).
  const uint32_t* dropout_seeds = nullptr;
  uint32_t dropout_threshold = 0;  // 16-bit halves below it drop their element (dropout_threshold(rate))
  float dropout_scale = 1.f;       // 1 / (1 - rate): the kept elements' factor
  // jax.nn's bias and mask arrays (LogitArray), or empty for none: the bias (times log2(e) in
  // the kernels' base-2 scores) is added after the soft cap and ALiBi, before the masks; a false
  // mask element hides its key from its row on top of every other mask (a row left no key is
  // empty: output 0). The CPU kernel reads the mask's bools, the Hopper kernels (experimental)
  // its bits, in word strides (common/ffi_params.h set_mask_bits).
  LogitArray bias;
  LogitArray logit_mask;

  // Whether the block mask lets query block qb of (b, h) see key block kb (true without one):
  // qb and kb index mask blocks (rows qb * kBlockMaskRows.., keys kb * kBlockMaskKeys..), not a
  // kernel's tiles; a tile at row i0 and key j0 takes the bit (i0 / kBlockMaskRows,
  // j0 / kBlockMaskKeys).
  bool block_visible(int64_t b, int64_t h, int64_t qb, int64_t kb) const {
    if (!block_mask) return true;
    return block_mask[((b * shape.heads_q + h) * block_mask_q_blocks + qb) * block_mask_k_blocks + kb] != 0;
  }
};

struct FwdParams : AttentionParams {
  void* o = nullptr;
  float* lse = nullptr;
  // A differentiated call's 16-bit o split for the backward (CUDA): o rounded to 16 bits, its
  // rounding error here as int8 in units of ulp/256 (common/rounding_residual.h), o's shape;
  // null for none. Instead of o in float32 (o_float32), which XLA would then split.
  int8_t* o_error = nullptr;
  // Whether o is the backward's residual (normalised by the sum of the rounded P its P V used).
  JF_HOST_DEVICE bool for_backward() const { return o_float32 || o_error != nullptr; }
  // The CUDA forwards' P is 2^-pv_headroom_log2 of exp2(S - reference), so that their unnormalised
  // P V cannot overflow where jax.nn's normalised one does not (pv_headroom_log2 below).
  float pv_headroom_log2 = 0.f;
  // The Hopper forward's tile counter (CUDA; its persistent grid takes tiles from it: the
  // scheduler workspace, an output of the custom call, zeroed by the launch).
  int* tile_counter = nullptr;
  // The CUDA forwards' 16-bit O rows stored 8 columns a lane at once where they fit (the default;
  // JAX_FLASH_CUDA_FWD_STORES=pairs: 4 bytes a pair; gpu/epilogue.cuh store_output_vectors).
  bool o_vector_stores = false;
};

// The CUDA forwards sum P V unnormalised: up to seq_k weights of at most 2^8 (their lazy
// rescaling's bound) times |V|, which overflows float32 for bfloat16 values near FLT_MAX / seq_k
// where jax.nn, normalising first, is finite (issue 13, item 4). bfloat16 calls take P smaller by
// 2^(8 + ceil(log2 seq_k)), so that the weights sum to at most 1: a power of two (the same
// roundings; the epilogue scales the sum back for lse), and bfloat16 keeps float32's range, so
// the weights dropped, below about 2^(headroom - 126) of the row's largest, are far below its
// precision (jax.nn's normalised weights, about 1/seq_k, meet the same floor). float16 values
// (<= 65504) cannot overflow that way, and a smaller float16 P would lose bits: 0.
inline float pv_headroom_log2(Dtype dtype, int64_t seq_k) {
  if (dtype != Dtype::kBFloat16) return 0.f;
  int ceil_log2 = 0;
  while ((int64_t{1} << ceil_log2) < seq_k) ++ceil_log2;
  return static_cast<float>(8 + ceil_log2);
}

struct BwdParams : AttentionParams {
  const void* o = nullptr;  // CPU only (the CUDA kernels take delta instead)
  const void* d_o = nullptr;
  const float* lse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  // (batch, heads_q, seq_q): rowsum(dO * O). The CPU kernel's workspace (returned to XLA as an
  // extra output, so no memory is hidden from it), formed from o; the CUDA kernels' input, formed
  // by XLA beside the call (jax_flash._ops._flash_bwd), so that o and its rounding error are no
  // longer live when the call's dQ accumulator is.
  float* delta = nullptr;
  // Workspaces, returned to XLA as extra outputs so no memory is hidden from it.
  float* dq_accum = nullptr;     // float32 dQ partials (layout per backend; unused when
                                 // deterministic on CUDA)
  int64_t dq_splits = 1;         // CPU: key blocks are dealt round-robin to this many partials
  bool deterministic = false;    // CUDA: dQ without atomics (the CPU is always deterministic)
  // CUDA (the Hopper backward, gpu/launch.h kv_head_splits): a key block's query heads split over
  // this many CTAs, each adding its dK and dV into the float32 dkv_accum ((2, batch, seq_k,
  // heads_k, head_dim): dK's then dV's; in dq_accum, after the dQ part), converted last.
  int kv_head_splits = 1;
  float* dkv_accum = nullptr;
  // CUDA (both families' main backward, gpu/block_geometry.cuh key_block_of_cta): the CTAs run
  // key block major in chunks of this many (kv-head slot, batch) groups, longest causal key
  // blocks first; 0: the grid's own order. Set by the launchers (gpu/launch.h key_major_groups).
  int key_major_groups = 0;
  // CUDA (the Hopper backward, where a dbias is shared by the batch: gpu/logit_arrays.cuh
  // dbias_shared_by_batch): the batch's CTAs of a key block run side by side (key_block_of_cta).
  bool batch_innermost = false;
  // CUDA (the mma.sync backward, narrow calls: gpu/score_mods.cuh narrow_plain_call): dS = 0
  // exactly on rows whose masks leave one key, where P = 1.
  bool zero_single_key_ds = false;
  // CUDA (the mma.sync backward, gpu/launch.cu): dQ goes into dq_accum in the quad order
  // (gpu/dq_accum_layout.cuh), which the launch then converts back; decided there.
  bool dq_quads = false;
  // CPU, with a bias: its gradient dS summed over the bias's broadcast dims, in the bias's shape
  // and dtype (null: not asked for); dbias_accum holds dbias_parts float32 partial sums in the
  // bias's own layout (one per dQ split where the bias has no key dim, else one; dbias itself
  // where that one is float32).
  void* dbias = nullptr;
  float* dbias_accum = nullptr;
  int64_t dbias_parts = 1;
  // CPU: each dbias element takes one dS (cpu::dbias_one_each): stored into dbias directly, in its
  // dtype, after dbias is zeroed (dbias_accum then unused).
  bool dbias_direct = false;
};

// Whether a call has jax.nn's bias or mask array (the CPU kernel's, and the Hopper CUDA kernels'
// kLogitArrays instantiations: experimental, passed by the Python side only under
// JAX_FLASH_CUDA_LOGIT_ARRAYS=on).
inline bool logit_arrays(const AttentionParams& p) {
  return static_cast<bool>(p.bias) || static_cast<bool>(p.logit_mask);
}

// The largest head dim any kernel takes (the Python side reads it from the native module).
inline constexpr int64_t kMaxHeadDim = 256;

// The rows (keys) of a run whose segment-id span the CUDA kernels read (AttentionParams::
// q_segment_id_spans; the Python side reads it from the CUDA module).
inline constexpr int64_t kSegmentIdSpanRows = 64;

// The log-sum-exp stored for a query row that attends to nothing: finite, and exp(x - lse) of
// any other finite value is 0, so merging partial results treats such a row as empty.
inline constexpr float kEmptyRowLse = -3.4028234663852886e38f;

}  // namespace jax_flash
