"""jax_flash.dot_product_attention: the public drop-in for jax.nn.dot_product_attention."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash import (_context_parallel, _derivatives, _dispatch, _dropout, _ops, _registry,
                       _rounding, _sharding, _validation)
from jax_flash._blockwise import blockwise_attention
from jax_flash._dispatch import Implementation
from jax_flash._reference import attention_reference

# The paths that are plain XLA, not jax_flash's kernels.
_XLA_PATHS = {"xla": attention_reference, "blockwise": blockwise_attention}


# segment_ids: None or (q_ids (B, T), kv_ids (B, S)) int32; alibi_slopes: None or (B, N)
# float32; block_mask: None or (B, N, Tb, Sb) bool; dropout_seeds: None or (B, N, SEED_WORDS) uint32
# (jax_flash._dropout.seeds), exactly when config.dropout_rate > 0. Like the lengths, none is
# differentiated (their cotangents are None: zero). bias and mask: None or jax.nn's arrays,
# (B|1, N|1, T|1, S|1) float and bool, as the caller broadcast them; the bias is differentiated
# (the backward kernel sums dS over its broadcast dims) where something differentiates it: the
# forward rules get symbolic zeros (custom_vjp's CustomVJPPrimal: `perturbed`), so a constant
# bias costs the backward no dbias. The bool mask is not (None).
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_attention(q, k, v, q_lens, kv_lens, config: _ops.KernelConfig, segment_ids=None,
                     alibi_slopes=None, block_mask=None, dropout_seeds=None, bias=None,
                     mask=None):
  return _sharding.flash_fwd(q, k, v, q_lens, kv_lens, config, segment_ids, alibi_slopes,
                             block_mask, dropout_seeds, bias, mask)


def _output_and_residual(o32, q, config, keep_float32=False):
  """(the caller's o in q's dtype, the o the backward gets, its o_error or None) from the
  forward's o32 (float32 from for_backward, or already 16-bit from the CUDA decode kernel). The
  backward forms delta = rowsum(dO * O) from it at full precision (issue 13): the CPU keeps o32
  whole; CUDA keeps the 16-bit o plus its int8 rounding error (1 byte an element, not 2 more),
  or, with `keep_float32` (narrow calls: _narrow_cuda_call), o32 whole too."""
  if config.implementation == "cuda" and o32.dtype != q.dtype and not keep_float32:
    o, o_error = _rounding.split_rounding(o32, q.dtype)
    return o, o, o_error
  return o32.astype(q.dtype), o32, None


def _narrow_cuda_call(q, k, config, segment_ids, alibi_slopes, block_mask, dropout_seeds) -> bool:
  """Whether a CUDA call is narrow (unless JAX_FLASH_CUDA_NARROW=off): a plain call
  whose rows see few keys (cuda/common/mask.h narrow_shape). Its kernels take P and dS as
  hi + lo, and its differentiated forward keeps o in float32 for the backward's delta, which on
  peaked rows needs more than the int8 residual's 16 bits of o (issue 13)."""
  if (config.implementation != "cuda" or segment_ids is not None or alibi_slopes is not None
      or block_mask is not None or dropout_seeds is not None or config.logits_soft_cap):
    return False
  return _registry.cuda_narrow_split_call(config.is_causal, config.window_left,
                                          config.window_right, q.shape[-3], k.shape[-3])


def _flash_attention_fwd(q, k, v, q_lens, kv_lens, config, segment_ids=None,
                         alibi_slopes=None, block_mask=None, dropout_seeds=None, bias=None,
                         mask=None):
  wants_dbias = _derivatives.wants_gradient(bias)
  (q, k, v, q_lens, kv_lens, segment_ids, alibi_slopes, block_mask, dropout_seeds, bias,
   mask) = _derivatives.primal_values((q, k, v, q_lens, kv_lens, segment_ids, alibi_slopes,
                                       block_mask, dropout_seeds, bias, mask))
  narrow = _narrow_cuda_call(q, k, config, segment_ids, alibi_slopes, block_mask, dropout_seeds)
  fwd_config = _ops.for_backward(config, split=not narrow)
  outputs = _sharding.flash_fwd(q, k, v, q_lens, kv_lens, fwd_config, segment_ids,
                                alibi_slopes, block_mask, dropout_seeds, bias, mask)
  if fwd_config.o_split:  # the CUDA kernel split o itself
    o, lse, o_error = outputs
    o_kept = o
  else:
    o32, lse = outputs
    o, o_kept, o_error = _output_and_residual(o32, q, config, keep_float32=narrow)
  return (o, lse), (q, k, v, o_kept, o_error, lse, q_lens, kv_lens, segment_ids, alibi_slopes,
                    block_mask, dropout_seeds, bias, mask, wants_dbias)


def _backward_kernel(q, k, v, o, lse, d_o, q_lens, kv_lens, config, segment_ids, o_error,
                     alibi_slopes, block_mask, dropout_seeds, bias, mask, wants_dbias):
  """(dq, dk, dv, dbias or None) of the backward kernel; dbias None unless `wants_dbias`
  (_derivatives.wants_gradient)."""
  dbias = bias is not None and bool(wants_dbias)
  grads = _sharding.flash_bwd(q, k, v, o, lse, _derivatives.cotangent_array(d_o), q_lens,
                              kv_lens, config, segment_ids, o_error, alibi_slopes, block_mask,
                              dropout_seeds, bias, mask, dbias)
  return grads if dbias else (*grads, None)


def _flash_attention_bwd(config, residuals, cotangents):
  (q, k, v, o, o_error, lse, q_lens, kv_lens, segment_ids, alibi_slopes, block_mask,
   dropout_seeds, bias, mask, wants_dbias) = residuals
  d_o, _ = cotangents  # lse leaves through stop_gradient: its cotangent is always zero
  dq, dk, dv, dbias = _backward_kernel(q, k, v, o, lse, d_o, q_lens, kv_lens, config,
                                       segment_ids, o_error, alibi_slopes, block_mask,
                                       dropout_seeds, bias, mask, wants_dbias)
  if dbias is not None and bias.shape[-1] == 1:  # (not with sinks: _flash_attention_sinks_bwd)
    dbias = _ops.row_bias_gradient(dbias)
  return dq, dk, dv, None, None, None, None, None, None, dbias, None


_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd, symbolic_zeros=True)


# Attention sinks (gpt-oss) on the kernels. The kernels compute the keys' part, (o_k, lse_k);
# a row's sink c joins it afterwards in XLA, as one more term of the softmax with no value (the
# merge the ring does of two blocks' partial results):
#   lse = logaddexp(lse_k, c),  o = o_k * exp(lse_k - lse).
# A row with no visible key (lse_k EMPTY_ROW_LSE) gets o = 0 and lse = c. The backward kernel
# needs nothing more: given that o and lse (which includes the sink), it recomputes
# P = exp(s - lse), the sinks' P, and dS = P (dP - D) with D = rowsum(dO o) is the sinks' dS.
# The sinks' own gradient is formed here: d c_h = -sum over (batch, rows of head h) of
# exp(c_h - lse) D (o depends on c only through the normaliser: do/dc = -exp(c - lse) o).
# The join is elementwise over (B, N, T), so it shards as the heads and rows do under jit, and
# sequence-sharded calls (whose kernels return the rows' global lse) take it as they are.
# Dropout needs nothing more either: the kernel's o_k = sum_j exp(s_j - lse_k) Z_j v_j joined
# is sum_j exp(s_j - lse) Z_j v_j, the dropped weights normalised with the sink; the backward
# kernel's dS = P (dP Z - D) and the sinks' gradient hold as they are (o still depends on c
# only through the normaliser).
def _join_sinks(o32, lse, sinks):
  """(o, lse) of the keys and the sinks (N,) from the keys' own (o32 (B, T, N, H) float32,
  lse (B, N, T))."""
  total = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
  weight = jnp.exp(lse - total)  # 0 for a row with no key (lse EMPTY_ROW_LSE)
  return o32 * jnp.swapaxes(weight, 1, 2)[..., None], total


# segment_ids, alibi_slopes, block_mask, dropout_seeds, bias and mask as in _flash_attention
# (None without them); sinks (N,) differentiable.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_attention_sinks(q, k, v, q_lens, kv_lens, config: _ops.KernelConfig, segment_ids,
                           sinks, alibi_slopes=None, block_mask=None, dropout_seeds=None,
                           bias=None, mask=None):
  (o, lse), _ = _flash_attention_sinks_fwd(q, k, v, q_lens, kv_lens, config, segment_ids, sinks,
                                           alibi_slopes, block_mask, dropout_seeds, bias, mask)
  return o, lse


def _flash_attention_sinks_fwd(q, k, v, q_lens, kv_lens, config, segment_ids, sinks,
                               alibi_slopes=None, block_mask=None, dropout_seeds=None,
                               bias=None, mask=None):
  # o in float32 from the kernel (also undifferentiated: the join scales it before the one
  # rounding to q's dtype).
  o32, lse = _sharding.flash_fwd(q, k, v, q_lens, kv_lens, _ops.for_backward(config),
                                 segment_ids, alibi_slopes, block_mask, dropout_seeds, bias,
                                 mask)
  o32, lse = _join_sinks(o32.astype(jnp.float32), lse, sinks)
  o, o_kept, o_error = _output_and_residual(o32, q, config)
  return (o, lse), (q, k, v, o_kept, o_error, lse, q_lens, kv_lens, segment_ids, sinks,
                    alibi_slopes, block_mask, dropout_seeds, bias, mask)


def _flash_attention_sinks_bwd(config, residuals, cotangents):
  (q, k, v, o, o_error, lse, q_lens, kv_lens, segment_ids, sinks, alibi_slopes,
   block_mask, dropout_seeds, bias, mask) = residuals
  d_o, _ = cotangents  # lse leaves through stop_gradient
  # (No symbolic zeros here: a bias's dbias is always formed.)
  dq, dk, dv, dbias = _backward_kernel(q, k, v, o, lse, d_o, q_lens, kv_lens, config,
                                       segment_ids, o_error, alibi_slopes, block_mask,
                                       dropout_seeds, bias, mask, wants_dbias=(None,))
  delta = _ops.delta_rows(o, d_o, o_error)
  dsinks = -jnp.sum(jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse) * delta,
                    axis=(0, 2))
  return (dq, dk, dv, None, None, None, dsinks.astype(sinks.dtype), None, None, None, dbias,
          None)


_flash_attention_sinks.defvjp(_flash_attention_sinks_fwd, _flash_attention_sinks_bwd)


def dot_product_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.typing.ArrayLike | None = None,
    key_value_seq_lengths: jax.typing.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: jax.typing.ArrayLike | None = None,
    kv_segment_ids: jax.typing.ArrayLike | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.typing.ArrayLike | None = None,
    alibi_slopes: jax.typing.ArrayLike | None = None,
    block_mask: jax.typing.ArrayLike | None = None,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
    implementation: Implementation | None = None,
    return_residual: bool = False,
    deterministic: bool = False,
    context_parallel: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Scaled dot-product attention computed by FlashAttention kernels.

  A drop-in for :func:`jax.nn.dot_product_attention`: the same arguments, shapes and masking
  semantics, computed in tiles with an online softmax so that memory grows linearly with the
  sequence length, and differentiated by a backward pass that recomputes the tiles.

  Args:
    query: ``(B, T, N, H)`` or ``(T, N, H)``; float32, bfloat16 or float16.
    key: ``(B, S, K, H)`` or ``(S, K, H)``, ``N % K == 0`` (grouped-query attention).
    value: ``(B, S, K, Hv)`` or ``(S, K, Hv)``, the dtype of ``key``; ``key``'s shape but for
      its head dim ``Hv``, which may differ from ``H`` (MLA-style attention, e.g. DeepSeek-V2's
      ``H = 192``, ``Hv = 128``; the output then has ``Hv``; ``scale`` still defaults to
      ``1 / sqrt(H)``). Taken by "cpu" (tiled and split-KV decode kernels, forward and
      backward), "blockwise" and "xla", by sharded and context-parallel calls on "cpu", and
      by "cuda", whose kernels take one head dim: q and k, or v, zero-padded to the larger.
    bias: added to the scaled logits, broadcastable to ``(B, N, T, S)`` (fewer dims gain
      leading ones; each dim 1 or full), differentiable (its gradient, dS summed over its
      broadcast dims, comes back in its shape and dtype; exactly 0 for a bias with no key dim,
      which the softmax cancels, unless ``sinks`` are given). Added in float32 after
      ``logits_soft_cap`` and ALiBi, before the masks. Taken by "cpu" (the kernel reads it
      where it lies, through its strides: nothing ``(B, N, T, S)`` is formed; its backward
      sums dbias deterministically), "blockwise" and "xla"; the CUDA kernels raise
      ``NotImplementedError`` (so does ``None`` where it picks them). Sharded calls shard it
      with the batch and the heads where it has them; a sequence-sharded call runs its
      context-parallel strategy with each device's query rows of it and of ``mask``.
    mask: bool, ``True`` where a query may attend a key, broadcastable like ``bias``, on top
      of every other mask (a row left no key gives zeros); the same paths take it (the "cpu"
      kernel skips the tiles it hides). Causal, padding and window masks are cheaper through
      ``is_causal``, the sequence lengths and ``local_window_size``, which every path takes.
    scale: logit scale; ``1 / sqrt(H)`` by default. Any sign; it must be finite as a float32,
      and so must its product with log2(e) (``|scale|`` up to about 2.3587e38), or a
      ``ValueError`` names it.
    is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned, as jax.nn).
    query_seq_lengths: ``(B,)`` int32 (as jax.nn, other dtypes raise ``ValueError``); output
      rows at or past the length are zero.
    key_value_seq_lengths: ``(B,)`` int32; keys at or past the length are ignored.
    local_window_size: ``w`` or ``(left, right)``: query ``i`` attends keys
      ``i - left <= j <= i + right``.
    q_segment_ids: ``(B, T)`` (``(T,)`` for rank-3 inputs) int32: packed documents. Query
      ``i`` attends key ``j`` only where ``q_segment_ids[b, i] == kv_segment_ids[b, j]``, on
      top of every other mask (causal, window, lengths: positions stay those of the packed
      row). Give both or neither (one alone raises ``ValueError``); int32 only, as the
      lengths (another dtype raises, naming the cast). Any int32 values, in any order; ids
      sorted by position (documents laid end to end) let the kernels skip every tile whose
      documents cannot meet, so a row of many documents costs about what the documents cost
      one by one. A row whose document has no visible key gives zeros (and lse the most
      negative float32), as any row with no key. Taken by "cpu", "cuda" (the tiled kernels;
      such calls never run the split-KV decode kernel), "blockwise" and "xla", and by
      sequence-sharded calls (the key-side ids travel with K and V). Not differentiated.
    kv_segment_ids: ``(B, S)`` (``(S,)``) int32: the keys' document ids.
    logits_soft_cap: ``c`` (Gemma 2's ``attn_logit_softcapping``): every score
      ``s = scale * q.k`` becomes ``c * tanh(s / c)`` before the bias, the masks and the
      softmax, and the backward applies the tanh's derivative. A concrete Python float, finite
      and ``> 0`` (a normal float32 whose product with log2(e) is finite), or ``None`` for no
      cap; anything else raises ``ValueError`` naming it. Taken by "cpu" and "cuda" (the
      tiled kernels; such calls never run the split-KV decode kernel), "blockwise" and
      "xla".
    sinks: attention sinks (gpt-oss): ``(N,)``, one learnable logit per query head (float32,
      bfloat16 or float16; exactly ``(N,)``, no broadcasting, also for rank-3 inputs), in the
      units of the scores (``scale * q.k``, after ``logits_soft_cap``), that joins every row's
      softmax denominator without a value: ``p_ij = exp(s_ij) / (exp(sinks[h]) +
      sum_j exp(s_ij))``, so a row's weights sum to less than 1. Differentiable (its gradient
      comes back in its dtype). The lse includes it; a row with no visible key gives zeros and
      lse ``sinks[h]``. Every mask, GQA, ``logits_soft_cap`` and sequence-sharded calls
      combine with it. Taken by "cpu" and "cuda" (the kernels compute the keys' part in float32;
      the sink joins it in XLA; on CUDA decode-shaped calls then run the tiled forward),
      "blockwise" and "xla". A wrong shape or dtype raises ``ValueError`` naming ``sinks``.
    alibi_slopes: ALiBi (Press et al., 2022): ``(N,)``, one slope per query head (float32,
      bfloat16 or float16, computed in float32; exactly ``(N,)``, also for rank-3 inputs).
      The score of query ``i`` and key ``j`` in head ``h`` becomes
      ``s_ij + alibi_slopes[h] * (j - i)``, computed in the kernel tile by tile, never as a
      ``(T, S)`` array. ``i`` and ``j`` are the positions the masks compare: row and key
      indices, top-left aligned as ``is_causal`` (query ``i`` sees ``j <= i``), so with
      ``T != S`` query 0 sits at key 0, and padding past the sequence lengths does not move
      them; under ``is_causal`` every bias is ``<= 0`` for positive slopes (the usual ALiBi),
      without it keys after the query get a positive bias (signed, not FA2's ``-|i - j|``).
      The bias is added after ``logits_soft_cap`` (the cap is not applied to it) and before
      the masks and the softmax; the lse includes it. Not differentiated: its gradient is
      zero (the slopes are constants of the model, as the lengths). Taken by "cpu" and "cuda"
      (the tiled kernels; such calls never run the split-KV decode kernel), "blockwise" and
      "xla". Batch-, head- and sequence-sharded calls take them (every context-parallel
      strategy: positions stay global). A wrong shape or dtype raises ``ValueError`` naming
      ``alibi_slopes``.
    block_mask: block-sparse attention (FlashAttention, Dao et al. 2022, section 3.3): a bool
      array broadcastable to ``(B, N, Tb, Sb)`` (``(N, Tb, Sb)`` for rank-3 inputs; fewer
      dims gain leading ones, B and N each 1 or full, Tb and Sb exact), one bit per block of
      ``jax_flash.BLOCK_MASK_BLOCK = (block_q, block_k) = (128, 128)`` query rows x keys
      (a multiple of every kernel's tiles, so that each tile lies inside one block and a
      hidden one is skipped whole: the "cpu" kernel's tiles are 64 x 64, the CUDA kernels'
      64 or 128 rows/keys; FlexAttention's default block is 128 too), blocks aligned at
      query 0 and key 0, the last partial:
      ``(Tb, Sb) = jax_flash.block_mask_shape(T, S) = (ceil(T / block_q),
      ceil(S / block_k))``. ``False`` hides every key of the key block from every query of
      the query block, on top of every other mask (causal, window, lengths, segment ids,
      ``mask``); a row left no key gives zeros and lse the most negative float32, as any
      empty row. The "cpu" and "cuda" kernels never visit a tile of a hidden block, forward
      or backward (their time falls with the density; the keys and values there are never
      read); "xla" expands it to an element mask (``(B|1, N|1, T, S)`` bool, quadratic
      memory), "blockwise" only each scan step's columns (memory linear in S), and both visit
      every block. Such calls never run the split-KV decode kernel. A sequence-sharded call
      carries it where the shards are whole blocks (128-row query slices, see
      ``jax_flash.context_parallel_attention``), else gathers the
      sequence (a requested ``context_parallel`` raises). Not differentiated. A wrong dtype
      or shape raises ``ValueError`` naming ``block_mask`` and the shape passed.
    dropout_rate: attention dropout fused into the kernels, as FlashAttention (Dao et al.
      2022) fuses it: each normalised probability ``p_ij`` is dropped with probability
      ``dropout_rate`` and the kept ones are scaled by ``1 / (1 - dropout_rate)``, so
      ``out = (P * keep / (1 - rate)) V``; the lse is that of the undropped softmax. A concrete
      Python float in ``[0, 1)`` (a static setting; anything else raises ``ValueError`` naming
      it); ``0`` is no dropout at all (the key is then not used). The mask is never stored:
      the kernels draw the decision of query row ``i`` and key ``j`` of batch element ``b``
      and query head ``h`` from a counter-based generator (Philox4x32-10) at that position,
      and the backward pass draws the same decisions again. Every implementation that takes
      it drops the same elements: ``jax_flash._dropout.keep_mask(dropout_key, dropout_rate,
      B, N, T, S)[b, h, i, j]``, so "cpu", "blockwise" and "xla" agree up to rounding; the
      same key gives the same mask run after run, and (as any JAX key) a new key per step
      gives a new mask. ``b`` and ``h`` are the indices of the call (under ``vmap`` each
      mapped call numbers its own batch from 0; under batch or head sharding the global
      indices). Taken by "cpu" (tiled kernel; such calls never run the split-KV decode
      kernel), "blockwise" (the decisions of one key block at a time: linear memory) and
      "xla"; the CUDA kernels raise ``NotImplementedError`` (pass
      ``implementation="blockwise"`` on a GPU). A sequence-sharded call runs every
      context-parallel strategy and drops what one device drops (the ring's and the
      all-gather's kernels take the seeds moved to their slices' first row and key, which must
      start 16 x 16 groups of the decisions: else the strategy is passed over, and a request
      raises). Rows and keys outside every mask get no weight whether dropped or kept.
    dropout_key: the JAX PRNG key the mask is drawn from, required when ``dropout_rate > 0``
      (``ValueError`` naming it otherwise): one key, ``jax.random.key(seed)`` (a typed key of
      the default threefry2x32 implementation) or ``jax.random.PRNGKey(seed)`` (raw
      ``uint32[2]``); it may be traced. Other shapes and key implementations raise
      ``ValueError`` naming ``dropout_key``.
    implementation: ``None`` picks the path for the default backend: ``"cpu"`` on the host,
      ``"cuda"`` on NVIDIA GPUs for bfloat16/float16, ``"blockwise"`` there for float32.
      ``"cpu"``/``"cuda"`` force a kernel; ``"blockwise"`` is FlashAttention in plain XLA (key
      blocks in a scan, linear memory, products at JAX's default precision: TF32 on recent
      GPUs, as any float32 matmul in JAX); ``"xla"`` is the plain quadratic-memory reference.
    return_residual: also return the log-sum-exp of each query row's logits, ``(B, T, N)``
      (or ``(T, N)``) in float32, under ``stop_gradient`` as in jax.nn.
    deterministic: make the backward pass bit-identical run after run. The CUDA backward
      otherwise adds dQ with float32 atomics, whose order varies (on Hopper dK and dV too where
      few kv heads leave the SMs short of work, e.g. MQA: a kv head's query heads are then split
      over several blocks); deterministic mode computes dQ in a separate pass and never splits
      (slower). The CPU backward is always deterministic.
    context_parallel: under ``jax.jit`` with the sequence axis of the query sharded over a
      mesh axis, how the kernels run over it: ``"ring"``, ``"all_to_all"`` or
      ``"all_gather"`` (see ``jax_flash.context_parallel_attention``), optionally with the
      layout they compute in, ``"ring:zigzag"``, ``"ring:contiguous"``,
      ``"all_gather:zigzag"``, ``"all_gather:contiguous"`` (zigzag balances causal work; the
      op moves the slices itself, the caller's arrays keep their layout). ``None`` chooses
      (the README's rule, provisional until measured on GPUs). Only the kernels ("cpu",
      "cuda") take a value; a strategy that cannot run the call raises when the call is
      compiled (the shardings are known only then; JAX hands the ``ValueError`` on as a
      ``JaxRuntimeError`` with its message). No effect without a sharded sequence.

  Returns:
    The attention output, shaped and typed like ``query`` but for its head dim, which is the
    value's ``Hv`` (``query``'s shape where ``Hv == H``); with ``return_residual``, the pair
    ``(output, lse)``. A query row with no key to attend to gives zeros (and a log-sum-exp of
    the most negative float32), never NaN, whatever the inputs hold; a NaN or inf among what a
    row attends to (or scores that overflow float32) gives NaN there, as in jax.nn. Empty
    inputs (B, T, S or N of 0) give empty or zero results and gradients, as jax.nn's.

  Differentiation: reverse mode (``jax.grad``, ``jax.vjp``, ``jax.jacrev``) on every path. On
  the kernels ("cpu", "cuda") once only: a second derivative (``jax.grad`` of ``jax.grad``,
  ``jax.hessian``) raises ``NotImplementedError`` naming jax_flash; "blockwise" and "xla"
  have them. Forward mode (``jax.jvp``, ``jax.jacfwd``) runs on "xla" only; elsewhere it raises
  ``TypeError``, in jax_flash's words when evaluated eagerly and in JAX's ("can't apply
  forward-mode autodiff (jvp) to a custom_vjp function.") under ``jit``, where JAX raises it
  while compiling, outside any jax_flash code.
  """
  return _dot_product_attention(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, logits_soft_cap=logits_soft_cap, sinks=sinks,
      alibi_slopes=alibi_slopes, block_mask=block_mask, dropout_rate=dropout_rate,
      dropout_key=dropout_key, implementation=implementation, return_residual=return_residual,
      deterministic=deterministic, context_parallel=context_parallel)


def _dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                           is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                           local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
                           logits_soft_cap=None, sinks=None, alibi_slopes=None, block_mask=None,
                           dropout_rate=0.0, dropout_key=None, implementation=None,
                           return_residual=False, deterministic=False, context_parallel=None,
                           dropout_shared=False):
  """dot_product_attention, plus `dropout_shared`: one dropout mask for every batch element and
  head, keep_mask(dropout_key, dropout_rate, 1, 1, T, S)[0, 0] (jax_flash.flax's
  broadcast_dropout=True, Flax's semantics)."""
  _dispatch.check_implementation(implementation)
  _context_parallel.check_request(context_parallel)
  if not isinstance(deterministic, bool):
    raise ValueError(f"deterministic must be a bool; got {deterministic!r}")
  query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  _validation.check_qkv(query, key, value)
  query_shape, value_shape = query.shape, value.shape  # as passed, for the messages
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  batch, seq_q, heads_q, head_dim = query.shape
  seq_k = key.shape[1]
  q_lens = _validation.check_seq_lengths("query_seq_lengths", query_seq_lengths, batch, seq_q)
  kv_lens = _validation.check_seq_lengths(
      "key_value_seq_lengths", key_value_seq_lengths, batch, seq_k)
  window = _validation.check_window(local_window_size, seq_q + seq_k)
  scale = _validation.check_scale(scale, head_dim)
  logits_soft_cap = _validation.check_logits_soft_cap(logits_soft_cap)
  sinks = _validation.check_sinks(sinks, heads_q, query_shape)
  alibi_slopes = _validation.check_alibi_slopes(alibi_slopes, heads_q, query_shape)
  dropout_rate = _validation.check_dropout_rate(dropout_rate)
  dropout_key = _validation.check_dropout_key(dropout_key, dropout_rate)
  segment_ids = _validation.check_segment_ids(q_segment_ids, kv_segment_ids, batch, seq_q,
                                              seq_k, unbatched)
  block_mask_shape_as_passed = None if block_mask is None else jnp.shape(block_mask)
  block_mask = _validation.check_block_mask(block_mask, batch, heads_q, seq_q, seq_k, unbatched,
                                            query_shape, key.shape[1:] if unbatched else
                                            key.shape)
  call = _dispatch.Call(
      query_shape, query.dtype,
      segment_ids=None if segment_ids is None else (jnp.shape(q_segment_ids),
                                                    jnp.shape(kv_segment_ids)),
      bias=None if bias is None else jnp.shape(bias),
      mask=None if mask is None else jnp.shape(mask),
      mask_forms=_dispatch.mask_forms(is_causal=bool(is_causal), local_window=window is not None,
                                      seq_lengths=q_lens is not None or kv_lens is not None),
      deterministic=deterministic, logits_soft_cap=logits_soft_cap,
      sinks=None if sinks is None else sinks.shape,
      alibi_slopes=None if alibi_slopes is None else alibi_slopes.shape,
      block_mask=None if block_mask is None else block_mask_shape_as_passed,
      dropout_rate=dropout_rate,
      value=None if value_shape[-1] == head_dim else value_shape)
  bias = _validation.check_logit_array("bias", bias, batch, heads_q, seq_q, seq_k)
  mask = _validation.check_logit_array("mask", mask, batch, heads_q, seq_q, seq_k)
  implementation = _dispatch.select(implementation, call)
  if context_parallel is not None and implementation in _XLA_PATHS:
    raise ValueError(f"context_parallel={context_parallel!r} applies to the kernels "
                     f"(implementation 'cpu' or 'cuda'); implementation={implementation!r} is "
                     "plain XLA, which XLA partitions itself")

  if q_lens is None:
    q_lens = jnp.full((batch,), seq_q, jnp.int32)
  if kv_lens is None:
    kv_lens = jnp.full((batch,), seq_k, jnp.int32)
  window_left, window_right = window if window is not None else (-1, -1)
  dropout_seeds = None
  if dropout_rate is not None:
    dropout_seeds = _dropout.seeds(dropout_key, batch, heads_q, shared=dropout_shared)
  if implementation in _XLA_PATHS:
    with _derivatives.explain_forward_mode("jax_flash.dot_product_attention", implementation):
      out, lse = _XLA_PATHS[implementation](
          query, key, value, q_lens, kv_lens, scale=scale, is_causal=bool(is_causal),
          window_left=window_left, window_right=window_right, bias=bias, mask=mask,
          segment_ids=segment_ids, logits_soft_cap=logits_soft_cap, sinks=sinks,
          alibi_slopes=alibi_slopes, block_mask=block_mask, dropout_rate=dropout_rate,
          dropout_seeds=dropout_seeds)
  else:
    attention = _flash_attention if sinks is None else _flash_attention_sinks
    out, lse = _ops.call_kernels(
        attention, query, key, value, q_lens, kv_lens, implementation=implementation,
        scale=scale, is_causal=bool(is_causal), window_left=window_left,
        window_right=window_right, deterministic=deterministic,
        context_parallel=context_parallel, segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap, sinks=sinks, alibi_slopes=alibi_slopes,
        block_mask=block_mask, dropout_rate=dropout_rate, dropout_seeds=dropout_seeds,
        bias=bias, mask=mask)
  lse = jax.lax.stop_gradient(lse)

  if unbatched:
    out, lse = out[0], lse[0]
  if not return_residual:
    return out
  return out, jnp.swapaxes(lse, -1, -2)  # (..., N, T) -> (..., T, N)
