"""Flax integration: an ``attention_fn`` for Flax's attention modules, and ready modules.

Flax is an optional dependency (``pip install -e ".[examples]"``); import this module on its own,
``import jax_flash.flax``: ``import jax_flash`` never imports Flax.

* :func:`dot_product_attention` takes the arguments Flax passes to ``attention_fn`` (mask, bias,
  dropout_rng, dropout_rate, broadcast_dropout, deterministic, dtype, precision, module,
  is_causal, ...) and maps them onto :func:`jax_flash.dot_product_attention`;
  :func:`make_attention_fn` returns one with options fixed (``is_causal``, ``implementation``,
  ...). Both go into ``flax.nnx.MultiHeadAttention(attention_fn=...)`` and
  ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)``.
* :class:`FlashMultiHeadAttention` (NNX) and :class:`FlashMultiHeadDotProductAttention` (Linen)
  are Flax's modules with FlashAttention inside: the same constructor arguments and the same
  parameter tree, so parameters move between the stock and the flash module either way; plus
  ``is_causal``, ``num_kv_heads`` (grouped-query attention), ``implementation`` and per-call
  ``query_seq_lengths`` / ``key_value_seq_lengths`` (padding) and ``q_segment_ids`` /
  ``kv_segment_ids`` (packed documents, in place of Flax's
  ``make_attention_mask(segment_ids, segment_ids, jnp.equal)``) and ``block_mask``
  (block-sparse attention). Attention dropout applies as in Flax's modules (``dropout_rate``,
  ``deterministic=False``, the "dropout" rng stream; ``broadcast_dropout`` shares one mask over
  the batch and the heads), fused into the kernels. ``decode=True`` keeps Flax's
  autoregressive cache (collection "cache": ``cached_key``, ``cached_value``, ``cache_index``,
  as the stock modules make it, so a cache moves between them too) and attends over its valid
  prefix with the kernels (``_flax_cache.py``).

What FlashAttention cannot honour raises at trace time, never silently: an attention ``mask`` or
``bias`` on the CUDA kernels (not yet; use ``is_causal`` and the sequence lengths, or
``implementation="blockwise"``, FlashAttention in XLA, which takes both; the "cpu" kernel takes
them), dropout on the CUDA kernels (``implementation="blockwise"`` takes it; experimental
under ``JAX_FLASH_CUDA_DROPOUT=on``), sowing the
attention weights (``sow_weights=True`` / ``module=``), the stock modules' ``decode=True`` with
this ``attention_fn`` on the CUDA kernels (the stock module passes the cache's valid prefix as a
mask; the Flash modules pass it as a length), and AQT's replacement einsums or a replacement
``einsum_dot_general``. Flax's ``promote_dtype`` hook is honoured.

Names that mean something else in Flax: Flax's ``deterministic`` means "no dropout";
jax_flash's bit-reproducible backward pass is ``deterministic_backward`` here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

try:
  import flax.linen as nn
  from flax import nnx
except ModuleNotFoundError as e:
  if e.name is not None and e.name.split(".")[0] != "flax":
    raise  # Flax is there but broken: its own error says more
  raise ImportError(
      "jax_flash.flax needs Flax, which jax_flash does not install by default: "
      'pip install "jax_flash[examples]" (the extra with flax>=0.12.7), or pip install flax'
  ) from e

import jax_flash
from jax_flash import _attention, _dispatch, _flax_cache, _validation
from jax_flash._dispatch import Implementation

__all__ = [
    "AttentionFn",
    "FlashMultiHeadAttention",
    "FlashMultiHeadDotProductAttention",
    "dot_product_attention",
    "make_attention_fn",
]

_MASK_HELP = (
    "Pass implementation='blockwise' (FlashAttention in XLA, which takes both arrays; on the "
    "host the 'cpu' kernel takes them too), or "
    "express the mask in the kernels' terms: causal self-attention is "
    "`is_causal=True` (FlashMultiHeadAttention(is_causal=True), "
    "FlashMultiHeadDotProductAttention(is_causal=True), make_attention_fn(is_causal=True), or "
    "nnx.MultiHeadAttention's own `is_causal=True` call argument) instead of "
    "nn.make_causal_mask / nnx.make_causal_mask; padding is `query_seq_lengths` / "
    "`key_value_seq_lengths` (call arguments of the Flash modules and of "
    "jax_flash.flax.dot_product_attention); sliding windows are `local_window_size`. The stock "
    "modules' `decode=True` cache also passes a mask: decode with FlashMultiHeadAttention / "
    "FlashMultiHeadDotProductAttention(decode=True), which pass the cache's length instead.")


def _fold_logit_array(name: str, x, batch_dims: tuple[int, ...],
                      scores: tuple[int, int, int]) -> jax.Array | None:
  """A bias or mask broadcastable to (batch..., N, T, S), as jax_flash takes it: rank 4 with the
  batch dims folded into one (kept 1 where they all broadcast), a mask as bool (Flax's masks are
  often float, nonzero meaning attend, as its make_attention_mask gives them). `scores` is
  (N, T, S); errors name the shape the caller passed."""
  if x is None:
    return None
  x = jnp.asarray(x)
  given, want = x.shape, batch_dims + tuple(scores)
  if name == "mask":
    x = x.astype(bool)
  rank = len(want)
  if x.ndim > rank:
    raise ValueError(f"jax_flash.flax: {name} must have at most {rank} dims (batch..., N, T, "
                     f"S) = {want}; got {name}{given}")
  x = x.reshape((1,) * (rank - x.ndim) + x.shape)
  if any(d not in (1, w) for d, w in zip(x.shape, want)):
    raise ValueError(f"jax_flash.flax: {name} must be broadcastable to (batch..., N, T, S) = "
                     f"{want} (each dim 1 or that size, leading dims 1 if left out); got "
                     f"{name}{given}")
  if all(d == 1 for d in x.shape[:-3]):
    return x.reshape(1, *x.shape[-3:])
  return jnp.broadcast_to(x, batch_dims + x.shape[-3:]).reshape(-1, *x.shape[-3:])


def _promote(query, key, value, dtype):
  """Flax's promote_dtype: cast to `dtype`, or to the inputs' common (inexact) dtype."""
  arrays = [jnp.asarray(x) for x in (query, key, value)]
  if dtype is None:
    dtype = jnp.result_type(*arrays)
    if not jnp.issubdtype(dtype, jnp.inexact):
      dtype = jnp.promote_types(jnp.float32, dtype)
  return [x.astype(dtype) for x in arrays]


def _flat_segment_ids(name: str, ids, batch_dims: tuple[int, ...], seq: int):
  """Segment ids shaped (batch..., seq) -> (prod(batch_dims), seq); None stays None."""
  if ids is None:
    return None
  ids = jnp.asarray(ids)
  if ids.shape != (*batch_dims, seq):
    raise ValueError(
        f"{name} must have one id per position, shape {(*batch_dims, seq)} (the batch dims of "
        f"the query, then the sequence); got {name}{ids.shape}")
  return ids.reshape(-1, seq)


def _fold_block_mask(block_mask, batch_dims: tuple[int, ...], heads: int, seq_q: int, seq_k: int):
  """A block mask broadcastable to (batch..., N, Tb, Sb) as jax_flash takes it: rank 4 with the
  batch dims folded into one (kept 1 where they all broadcast); None stays None. Errors name
  the shape the caller passed (jax_flash checks the folded form again, by its own rule)."""
  if block_mask is None:
    return None
  x = jnp.asarray(block_mask)
  blocks = jax_flash.block_mask_shape(seq_q, seq_k)
  want = (*batch_dims, heads, *blocks)
  given = x.shape
  if not (2 <= x.ndim <= len(want) and x.shape[-2:] == blocks and
          all(d in (1, w) for d, w in zip(x.shape[::-1][2:], want[::-1][2:]))):
    raise ValueError(
        f"jax_flash.flax: block_mask must be a bool array broadcastable to (batch..., N, Tb, Sb) "
        f"= {want} (blocks of jax_flash.BLOCK_MASK_BLOCK = {jax_flash.BLOCK_MASK_BLOCK}; "
        f"leading dims 1 if left out); got block_mask{given}")
  x = x.reshape((1,) * (len(want) - x.ndim) + x.shape)
  if all(d == 1 for d in x.shape[:-3]):
    return x.reshape(1, *x.shape[-3:])
  return jnp.broadcast_to(x, (*batch_dims, *x.shape[-3:])).reshape(-1, *x.shape[-3:])


def _flat_lengths(name: str, lengths, batch_dims: tuple[int, ...]):
  """Per-sequence lengths shaped like the batch dims -> (prod(batch_dims),)."""
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if lengths.shape != batch_dims:
    raise ValueError(
        f"{name} must have one length per sequence, shape {batch_dims} (the batch dims of the "
        f"query); got {lengths.shape}")
  return lengths.reshape(-1)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    *,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., jax.Array] | None = None,
    qk_attn_weights_einsum: Callable[..., jax.Array] | None = None,
    attn_weights_value_einsum: Callable[..., jax.Array] | None = None,
    promote_dtype: Callable[..., Any] | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Implementation | None = None,
    deterministic_backward: bool = False,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    block_mask: jax.Array | None = None,
) -> jax.Array:
  """FlashAttention with the signature of Flax's ``dot_product_attention``.

  Pass it as ``attention_fn`` to ``nnx.MultiHeadAttention`` or ``nn.MultiHeadDotProductAttention``
  (or call it directly). Positional arguments follow Flax's order up to ``module``; the rest are
  keyword-only. It takes every argument of Linen's and of NNX's ``dot_product_attention``
  (``einsum_dot_general`` and the AQT einsums from Linen's, ``promote_dtype`` and
  ``is_causal`` from NNX's), so it can replace either inside a ``functools.partial``.

  Args:
    query: ``(batch..., T, N, H)``; any number of batch dims, including none.
    key: ``(batch..., S, K, H)`` with ``N % K == 0`` (grouped-query attention).
    value: ``(batch..., S, K, Hv)``: shaped like ``key`` but for its head dim ``Hv``, which may
      differ from ``H`` (as Flax's ``v_depth_per_head``; MLA-style attention), on the paths of
      :func:`jax_flash.dot_product_attention` that take it ("cpu", "blockwise", "xla"). The
      modules project q, k and v to one head dim, so they never pass ``Hv != H``.
    bias: broadcastable to ``(batch..., N, T, S)``, added to the scaled logits; on the paths
      that take it, ``"cpu"``, ``"blockwise"`` and ``"xla"`` (also ``None`` where it picks
      ``"blockwise"``: float32 on a GPU); the CUDA kernels raise ``NotImplementedError`` (see
      the message for what to use), by the same rule as
      :func:`jax_flash.dot_product_attention`.
    mask: bool, broadcastable like ``bias`` (True: attend); the same paths take it. On the
      CUDA kernels use ``is_causal``, the sequence lengths or ``local_window_size`` instead
      (on every kernel they are cheaper than an array).
    broadcast_dropout: as Flax's: ``True`` (Flax's default) draws one dropout mask of
      ``(T, S)`` and uses it for every batch element and head; ``False`` draws one per batch
      element and head. Without dropout it has no effect.
    dropout_rng: the JAX PRNG key of the dropout mask (Flax's modules pass one from their
      "dropout" rng stream); required when dropout applies (``ValueError`` naming it
      otherwise): one key, ``jax.random.key`` (threefry2x32) or ``jax.random.PRNGKey``.
    dropout_rate: attention dropout, as Flax's: with ``deterministic=False`` and a rate in
      ``(0, 1)`` each attention weight is dropped with that probability and the kept ones are
      scaled by ``1 / (1 - dropout_rate)``. Fused into the kernels (never a ``(T, S)`` array;
      :func:`jax_flash.dot_product_attention`'s ``dropout_rate``): the mask is Philox bits at
      each weight's position under ``dropout_rng``, not the bits ``jax.random.bernoulli``
      would draw, so a stock module and a flash one with the same rng drop different weights
      (at the same rate). Taken by "cpu", "blockwise" and "xla"; the CUDA kernels raise
      ``NotImplementedError``. A concrete Python float in ``[0, 1)``.
    deterministic: Flax's meaning: True turns dropout off. (jax_flash's reproducible backward is
      ``deterministic_backward``.)
    dtype: the computation dtype: query, key and value are cast to it (default: their common
      dtype, as Flax's promote_dtype); the output has this dtype.
    precision: accepted and ignored: the kernels multiply input-dtype values exactly and
      accumulate in float32 (float32 inputs are computed in full float32), at least what any
      ``jax.lax.Precision`` asks for.
    module: Flax passes the module here to sow the attention weights (``sow_weights=True``);
      FlashAttention never materialises them, so a module raises ``NotImplementedError``.
    force_fp32_for_softmax: honoured whatever its value: the softmax is always float32.
    einsum_dot_general: Linen's replacement for the ``dot_general`` of the attention's two
      products; ``None`` or ``jax.lax.dot_general`` (what Linen uses for ``None``) has no
      effect, anything else raises ``NotImplementedError``: the products are the kernels'.
    qk_attn_weights_einsum: AQT's replacement einsum; must be None (raises otherwise).
    attn_weights_value_einsum: AQT's replacement einsum; must be None (raises otherwise).
    promote_dtype: NNX's hook that casts ``(query, key, value)`` to one dtype, called as NNX
      calls it, ``promote_dtype((query, key, value), dtype=dtype)``; ``None`` casts as Flax's
      default does (to ``dtype``, or to the inputs' common inexact dtype).
    is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned, as jax.nn).
    scale: logit scale, ``1 / sqrt(H)`` by default (as Flax).
    query_seq_lengths: int array shaped like the batch dims; output rows at or past the
      length are zero.
    key_value_seq_lengths: int array shaped like the batch dims; keys at or past the length
      are ignored (padding).
    local_window_size: ``w`` or ``(left, right)``: query ``i`` attends keys
      ``i - left <= j <= i + right``.
    implementation: ``None`` (the best path for the backend and dtype), ``"cpu"``, ``"cuda"``,
      ``"blockwise"`` or ``"xla"``, as in :func:`jax_flash.dot_product_attention`.
    deterministic_backward: jax_flash's ``deterministic``: a bit-reproducible backward pass.
    q_segment_ids: int32 ``(batch..., T)``: packed documents; query ``i`` attends key ``j``
      only where its id equals ``kv_segment_ids[..., j]`` (what Flax expresses as
      ``mask=make_attention_mask(ids, ids, jnp.equal)``, without the ``(T, S)`` array). Both or
      neither; the paths that take them are those of
      :func:`jax_flash.dot_product_attention` ("cpu", "blockwise", "xla").
    kv_segment_ids: int32 ``(batch..., S)``: the keys' ids.
    logits_soft_cap: ``c``: scores ``s`` become ``c * tanh(s / c)`` before the masks and the
      softmax (Gemma 2); ``None``: no cap. Flax's own functions have no such argument. Taken by
      the paths of :func:`jax_flash.dot_product_attention` ("cpu", "blockwise", "xla").
    sinks: ``(N,)``: attention sinks (gpt-oss), one logit per query head joining every row's
      softmax denominator without a value; differentiable (pass the model's parameter). As in
      :func:`jax_flash.dot_product_attention` ("cpu", "blockwise", "xla"). The modules
      (``FlashMultiHeadAttention``, ``FlashMultiHeadDotProductAttention``) hold no sink
      parameter yet: call this function from your own module for that.
    alibi_slopes: ``(N,)``: ALiBi, one slope per query head; the score of query ``i`` and key
      ``j`` gains ``alibi_slopes[h] * (j - i)`` (positions as the causal mask's, after the soft
      cap), computed in the kernel. Not differentiated. As in
      :func:`jax_flash.dot_product_attention` ("cpu", "blockwise", "xla"). Flax's own functions
      have no such argument; the modules hold no slopes (call this function from your own
      module for that).
    block_mask: block-sparse attention: a bool array broadcastable to ``(batch..., N, Tb,
      Sb)``, one bit per block of ``jax_flash.BLOCK_MASK_BLOCK`` query rows x keys,
      ``(Tb, Sb) = jax_flash.block_mask_shape(T, S)`` (leading dims 1 if left out, each 1 or
      full); ``False`` hides the block's keys from its queries, on top of every other mask.
      As in :func:`jax_flash.dot_product_attention` ("cpu", which skips hidden blocks,
      "blockwise", "xla").

  Returns:
    ``(batch..., T, N, Hv)`` in the computation dtype.
  """
  _dispatch.check_implementation(implementation)
  # Dropout applies as in Flax: a rate > 0 without deterministic. Its rng is then required.
  rate = 0.0 if deterministic else _validation.check_dropout_rate(dropout_rate) or 0.0
  if rate and dropout_rng is None:
    raise ValueError(
        f"jax_flash.flax: dropout applies (dropout_rate={rate!r}, deterministic=False) but "
        "dropout_rng is None: pass a JAX PRNG key (Flax's modules draw it from their 'dropout' "
        "rng stream), or deterministic=True for evaluation")
  if module is not None:
    raise NotImplementedError(
        "jax_flash.flax: cannot sow attention weights (sow_weights=True passes `module`): "
        "FlashAttention never materialises the attention matrix")
  if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
    raise NotImplementedError(
        "jax_flash.flax: qk_attn_weights_einsum / attn_weights_value_einsum (e.g. AQT's "
        "quantised einsums, from qk_attn_weights_einsum_cls / attn_weights_value_einsum_cls) "
        "cannot replace the products inside the FlashAttention kernels")
  if einsum_dot_general is not None and einsum_dot_general is not jax.lax.dot_general:
    raise NotImplementedError(
        f"jax_flash.flax: einsum_dot_general={einsum_dot_general!r} cannot replace the "
        "products inside the FlashAttention kernels; pass None (or jax.lax.dot_general)")
  del precision, force_fp32_for_softmax  # see the docstring

  if promote_dtype is None:
    query, key, value = _promote(query, key, value, dtype)
  else:
    query, key, value = (jnp.asarray(x) for x in promote_dtype((query, key, value), dtype=dtype))
  if not query.ndim == key.ndim == value.ndim >= 3:
    raise ValueError(
        "query, key and value must all have shape (batch..., length, heads, head_dim) with the "
        f"same number of batch dims; got query{query.shape}, key{key.shape}, value{value.shape}")
  batch_dims = query.shape[:-3]
  if key.shape[:-3] != batch_dims or value.shape[:-3] != batch_dims:
    raise ValueError(
        "query, key and value must have the same batch dims; got "
        f"query{query.shape}, key{key.shape}, value{value.shape}")
  _validation.check_qkv(query, key, value, any_batch_dims=True)
  q_lens = _flat_lengths("query_seq_lengths", query_seq_lengths, batch_dims)
  kv_lens = _flat_lengths("key_value_seq_lengths", key_value_seq_lengths, batch_dims)
  q_ids = _flat_segment_ids("q_segment_ids", q_segment_ids, batch_dims, query.shape[-3])
  kv_ids = _flat_segment_ids("kv_segment_ids", kv_segment_ids, batch_dims, key.shape[-3])
  blocks = _fold_block_mask(block_mask, batch_dims, query.shape[-2], query.shape[-3],
                            key.shape[-3])

  # jax_flash takes (B, T, N, H): fold every batch dim (or none) into one.
  batch = math.prod(batch_dims)
  query4, key4, value4 = (x.reshape(batch, *x.shape[-3:]) for x in (query, key, value))
  scores = (query.shape[-2], query.shape[-3], key.shape[-3])  # (N, T, S)
  bias4, mask4 = (_fold_logit_array(name, x, batch_dims, scores)
                  for name, x in (("bias", bias), ("mask", mask)))
  # The core API asks the same again: asked here first, so that a bias or mask on the kernels
  # is refused in Flax's terms, by the rule the core applies.
  _dispatch.select(
      implementation,
      _dispatch.Call(query.shape, query.dtype,
                     bias=None if bias is None else jnp.shape(bias),
                     mask=None if mask is None else jnp.shape(mask),
                     segment_ids=None if q_ids is None or kv_ids is None else
                     (jnp.shape(q_segment_ids), jnp.shape(kv_segment_ids)),
                     logits_soft_cap=_validation.check_logits_soft_cap(logits_soft_cap),
                     sinks=None if sinks is None else jnp.shape(sinks),
                     alibi_slopes=None if alibi_slopes is None else jnp.shape(alibi_slopes),
                     block_mask=None if block_mask is None else jnp.shape(block_mask),
                     dropout_rate=rate or None,
                     value=None if value.shape[-1] == query.shape[-1] else value.shape),
      caller="jax_flash.flax.dot_product_attention", mask_advice=_MASK_HELP)
  out = _attention._dot_product_attention(
      query4, key4, value4, bias4, mask4, scale=scale, is_causal=is_causal,
      query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens, local_window_size=local_window_size,
      implementation=implementation, deterministic=deterministic_backward,
      q_segment_ids=q_ids, kv_segment_ids=kv_ids, logits_soft_cap=logits_soft_cap, sinks=sinks,
      alibi_slopes=alibi_slopes, block_mask=blocks, dropout_rate=rate,
      dropout_key=dropout_rng if rate else None, dropout_shared=bool(broadcast_dropout))
  return out.reshape(*query.shape[:-1], value.shape[-1])


@dataclasses.dataclass(frozen=True)
class AttentionFn:
  """:func:`dot_product_attention` with options fixed; build it with :func:`make_attention_fn`.

  A frozen (hashable) dataclass rather than a ``functools.partial``, for two reasons: a
  call-time ``is_causal=False`` (which ``nnx.MultiHeadAttention`` always passes) must not undo a
  fixed ``is_causal=True`` (the two are or-ed), and NNX keeps ``attention_fn`` as a static
  attribute, which compares by value here.
  """

  is_causal: bool = False
  scale: float | None = None
  local_window_size: int | tuple[int, int] | None = None
  implementation: Implementation | None = None
  deterministic_backward: bool = False
  logits_soft_cap: float | None = None

  # Linen passes only the keyword arguments this signature names, so it names all of them.
  def __call__(self, query, key, value, bias=None, mask=None, broadcast_dropout=True,
               dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
               precision=None, module=None, *, force_fp32_for_softmax=False,
               einsum_dot_general=None, qk_attn_weights_einsum=None,
               attn_weights_value_einsum=None, promote_dtype=None, is_causal=False,
               query_seq_lengths=None, key_value_seq_lengths=None, q_segment_ids=None,
               kv_segment_ids=None, block_mask=None, sinks=None, alibi_slopes=None) -> jax.Array:
    return dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, force_fp32_for_softmax=force_fp32_for_softmax,
        einsum_dot_general=einsum_dot_general, qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum, promote_dtype=promote_dtype,
        is_causal=self.is_causal or bool(is_causal), scale=self.scale,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=self.local_window_size, implementation=self.implementation,
        deterministic_backward=self.deterministic_backward, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, logits_soft_cap=self.logits_soft_cap,
        block_mask=block_mask, sinks=sinks, alibi_slopes=alibi_slopes)


def _module_alibi_slopes(alibi_slopes, num_heads: int, owner: str) -> tuple[float, ...] | None:
  """A module's fixed ALiBi slopes as a tuple of floats (None without), checked when the module
  is built (each call's own check, _validation.check_alibi_slopes, names the query instead)."""
  if alibi_slopes is None:
    return None
  slopes = tuple(float(x) for x in alibi_slopes)
  if len(slopes) != num_heads:
    raise ValueError(f"{owner}: alibi_slopes must hold one slope per query head, shape "
                     f"({num_heads},); got shape ({len(slopes)},)")
  return slopes


def _slopes_array(alibi_slopes: tuple[float, ...] | None) -> jax.Array | None:
  return None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32)


def _no_segment_ids_in_decode(owner: str, q_segment_ids, kv_segment_ids,
                              block_mask=None) -> None:
  if q_segment_ids is not None or kv_segment_ids is not None:
    raise NotImplementedError(
        f"{owner}: q_segment_ids/kv_segment_ids with decode=True are not supported yet (the "
        "cache keeps no ids); pass them on calls without decode")
  if block_mask is not None:
    raise NotImplementedError(
        f"{owner}: block_mask with decode=True is not supported (a decode step's one query "
        "row sits at cache_index, not in the mask's first query block); pass it on calls "
        "without decode")


def make_attention_fn(
    *,
    is_causal: bool = False,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Implementation | None = None,
    deterministic_backward: bool = False,
    logits_soft_cap: float | None = None,
) -> AttentionFn:
  """An ``attention_fn`` for Flax's attention modules with jax_flash's options fixed.

  ``is_causal=True`` gives causal self-attention in ``nn.MultiHeadDotProductAttention`` (whose
  call takes no ``is_causal``) and in ``nnx.MultiHeadAttention`` whatever its call passes. Call
  the modules without ``mask=nn.make_causal_mask(...)``: a mask raises ``NotImplementedError``.
  ``logits_soft_cap`` ``c`` caps every score at ``c * tanh(s / c)`` (Gemma 2); it is checked
  here, a ``ValueError`` naming it.
  """
  if not isinstance(is_causal, bool):
    raise ValueError(f"is_causal must be a bool; got {is_causal!r}")
  if not isinstance(deterministic_backward, bool):
    raise ValueError(f"deterministic_backward must be a bool; got {deterministic_backward!r}")
  _dispatch.check_implementation(implementation)
  if isinstance(local_window_size, list):
    local_window_size = tuple(local_window_size)
  return AttentionFn(is_causal=is_causal, scale=scale, local_window_size=local_window_size,
                     implementation=implementation,
                     deterministic_backward=deterministic_backward,
                     logits_soft_cap=_validation.check_logits_soft_cap(logits_soft_cap))


def _decoding(attention_fn: AttentionFn, owner: str) -> AttentionFn:
  """`attention_fn` for a decode call: the cache's valid length (key_value_seq_lengths) is
  what keeps the query from later positions, so the module's is_causal is dropped (top-left
  aligned, it would let the one query see key 0 only). A local window is relative to the
  query's position, which the kernels do not know in a decode call: refused."""
  if attention_fn.local_window_size is not None:
    raise NotImplementedError(
        f"{owner}: local_window_size={attention_fn.local_window_size!r} with decode=True is not "
        "supported yet (the window would be placed at position 0, not at cache_index)")
  return dataclasses.replace(attention_fn, is_causal=False)


# ---------------------------------------------------------------------------------------------
# NNX


def _keys_and_values(inputs_q, inputs_k, inputs_v, stock: str):
  """The key and value inputs as Flax's `stock` module defaults them: self-attention without
  inputs_k, values from the keys without inputs_v."""
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError(f"`inputs_k` cannot be None if `inputs_v` is not None (as in {stock})")
    inputs_k = inputs_q
  if inputs_v is None:
    inputs_v = inputs_k
  return inputs_k, inputs_v


class FlashMultiHeadAttention(nnx.MultiHeadAttention):
  """``nnx.MultiHeadAttention`` computed by jax_flash.

  The constructor takes every argument of ``nnx.MultiHeadAttention`` (including
  ``num_kv_heads`` for grouped-query attention) and builds the same submodules (``query``,
  ``key``, ``value``, ``out`` LinearGeneral, optional ``query_ln``/``key_ln``), so its state is
  interchangeable with the stock module's (``nnx.update(flash, nnx.state(stock))``). Added:

  Args:
    is_causal: causal self-attention (query ``i`` attends keys ``j <= i``) on every call.
    local_window_size: ``w`` or ``(left, right)`` sliding-window attention.
    implementation: jax_flash's kernel choice (``None``: the best for the backend).
    deterministic_backward: bit-reproducible backward pass (see jax_flash).
    logits_soft_cap: Gemma 2's cap ``c``: scores ``s`` become ``c * tanh(s / c)`` on every call
      (a constructor argument: ``nnx.MultiHeadAttention`` has none); ``None``: no cap.
    sinks: learned attention sinks (gpt-oss): an ``nnx.Param`` ``sinks`` ``(num_heads,)``
      (``param_dtype``, zeros), one logit per query head joining every row's softmax
      denominator (see :func:`dot_product_attention`). The stock module has no such parameter.
    alibi_slopes: fixed ALiBi slopes, one per query head (not a parameter).

  ``attention_fn`` cannot be given (the module sets it). ``dropout_rate > 0`` drops attention
  weights as the stock module does (``deterministic=False``; the key from the call's ``rngs``,
  or the constructor's ``rngs.dropout`` stream with ``keep_rngs``; ``broadcast_dropout``
  shares one mask over the batch and the heads), fused into the kernels (not the stock
  module's bits: see :func:`dot_product_attention`); ``sow_weights`` raises
  ``NotImplementedError``; unlike the stock module, ``decode`` may be left unset (it means
  False).

  ``decode=True`` works as in the stock module: ``init_cache(input_shape, dtype)`` (or
  ``nnx.view(module, decode=True, batch_size=..., max_length=...)``) makes the ``nnx.Cache``
  variables ``cached_key``, ``cached_value`` ``(batch..., max_length, num_kv_heads, head_dim)``
  and ``cache_index``; each call then takes one position ``(batch..., 1, in_features)``, writes
  its key and value at ``cache_index`` and attends to positions ``0 .. cache_index`` (so
  ``is_causal`` is implied; ``local_window_size`` raises). Past ``max_length`` it does what the
  stock module does: no error, the last slot is overwritten. The cache is written only when the
  call succeeds.
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               in_kv_features: int | None = None, *, is_causal: bool = False,
               local_window_size: int | tuple[int, int] | None = None,
               implementation: Implementation | None = None,
               deterministic_backward: bool = False, logits_soft_cap: float | None = None,
               sinks: bool = False, alibi_slopes: tuple[float, ...] | None = None,
               rngs: nnx.Rngs, **kwargs):
    if "attention_fn" in kwargs:
      raise ValueError(
          "FlashMultiHeadAttention sets attention_fn itself; for another attention_fn use "
          "nnx.MultiHeadAttention")
    attention_fn = make_attention_fn(
        is_causal=is_causal, local_window_size=local_window_size,
        implementation=implementation, deterministic_backward=deterministic_backward,
        logits_soft_cap=logits_soft_cap)
    super().__init__(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                     in_kv_features, attention_fn=attention_fn, rngs=rngs, **kwargs)
    self.is_causal = is_causal
    self.sinks = nnx.Param(jnp.zeros((num_heads,), self.param_dtype)) if sinks else None
    self.alibi_slopes = _module_alibi_slopes(alibi_slopes, num_heads, "FlashMultiHeadAttention")

  def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
               inputs_v: jax.Array | None = None, *, mask: jax.Array | None = None,
               deterministic: bool | None = None, rngs: Any = None, sow_weights: bool = False,
               decode: bool | None = None, is_causal: bool = False,
               query_seq_lengths: jax.Array | None = None,
               key_value_seq_lengths: jax.Array | None = None, out_sharding=None,
               qkv_sharding=None, q_segment_ids: jax.Array | None = None,
               kv_segment_ids: jax.Array | None = None,
               block_mask: jax.Array | None = None) -> jax.Array:
    """``nnx.MultiHeadAttention.__call__`` plus padding lengths, segment ids and a block mask.

    ``is_causal=True`` makes this call causal (or-ed with the constructor's ``is_causal``).
    ``query_seq_lengths`` / ``key_value_seq_lengths``: int arrays shaped like the batch dims of
    the inputs; keys past a length are ignored, output rows past a length are zero before the
    output projection (so they equal its bias); in a decode call the key lengths narrow the
    cache's valid prefix further. ``q_segment_ids`` / ``kv_segment_ids``: int32 ``(batch...,
    length)`` document ids of the query and key inputs (for self-attention over packed
    documents pass the same ids as both); a query attends only keys of its document. Not with
    ``decode``. ``block_mask``: block-sparse attention, a bool array broadcastable to
    ``(batch..., num_heads, Tb, Sb)`` (see :func:`dot_product_attention`); not with ``decode``.
    ``rngs``: as the stock module's, the dropout key's source (an ``nnx.Rngs``, whose
    ``dropout`` stream is used, or a stream itself); without it the constructor's
    (``keep_rngs``).
    """
    if rngs is None:
      rngs = self.rngs
    elif isinstance(rngs, nnx.Rngs):
      rngs = rngs.dropout
    decode = bool(self.decode) if decode is None else decode
    inputs_k, inputs_v = _keys_and_values(inputs_q, inputs_k, inputs_v, "nnx.MultiHeadAttention")
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(f"Incompatible input dimension, got {inputs_q.shape[-1]} but module "
                       f"expects {self.in_features}.")

    query = self.query(inputs_q, out_sharding=qkv_sharding)
    key = self.key(inputs_k, out_sharding=qkv_sharding)
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)

    attention_fn, step = self.attention_fn, None
    if decode:
      _no_segment_ids_in_decode("FlashMultiHeadAttention", q_segment_ids, kv_segment_ids,
                                block_mask)
      if self.cached_key is None or self.cached_value is None or self.cache_index is None:
        raise ValueError("FlashMultiHeadAttention: Autoregressive cache not initialized, call "
                         "``init_cache`` first (decode=True)")
      step = _flax_cache.write_and_attend(
          "FlashMultiHeadAttention", key, value, self.cached_key[...], self.cached_value[...],
          self.cache_index[...], key_value_seq_lengths)
      key, value = step.cached_key, step.cached_value
      key_value_seq_lengths, is_causal = step.key_value_seq_lengths, False
      attention_fn = _decoding(attention_fn, "FlashMultiHeadAttention")

    dropout_rng = None
    if self.dropout_rate > 0.0:
      deterministic = deterministic if deterministic is not None else self.deterministic
      if deterministic is None:
        raise ValueError("No `deterministic` argument was provided to FlashMultiHeadAttention "
                         "as either a __call__ argument, class attribute, or nnx.view")
      if not deterministic:
        if rngs is None:
          raise ValueError("FlashMultiHeadAttention: dropout applies (dropout_rate="
                           f"{self.dropout_rate}, deterministic=False) but no rngs: pass "
                           "rngs to __call__, or construct the module with keep_rngs=True")
        dropout_rng = rngs()
    else:
      deterministic = True
    x = attention_fn(
        query, key, value, mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout, deterministic=deterministic,
        dtype=self.dtype, precision=self.precision, module=self if sow_weights else None,
        is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, block_mask=block_mask,
        sinks=None if self.sinks is None else self.sinks[...],
        alibi_slopes=_slopes_array(self.alibi_slopes))
    if step is not None:  # the cache changes only once the call has succeeded
      self.cached_key[...] = step.cached_key
      self.cached_value[...] = step.cached_value
      self.cache_index[...] = step.cache_index
    return self.out(x, out_sharding=out_sharding)


# ---------------------------------------------------------------------------------------------
# Linen


class FlashMultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
  """``nn.MultiHeadDotProductAttention`` computed by jax_flash.

  Every attribute of the stock module, and the same parameters (``query``, ``key``, ``value``,
  ``out`` DenseGeneral, optional ``query_ln``/``key_ln``), so variables move between the stock
  and the flash module either way. Linen names an unnamed submodule after its class
  (``MultiHeadDotProductAttention_0`` vs ``FlashMultiHeadDotProductAttention_0``): give the
  attention submodule a ``name=`` for checkpoints that load into either. Added attributes:

  Attributes:
    num_kv_heads: key/value heads for grouped-query attention (``num_heads % num_kv_heads ==
      0``); ``None`` means ``num_heads``. With fewer heads than ``num_heads`` the ``key`` and
      ``value`` kernels are ``(features, num_kv_heads, head_dim)``, which stock Linen (no GQA)
      cannot load; repeating each kv head ``num_heads // num_kv_heads`` times gives the
      equivalent stock parameters.
    is_causal: causal self-attention (query ``i`` attends keys ``j <= i``).
    local_window_size: ``w`` or ``(left, right)`` sliding-window attention.
    implementation: jax_flash's kernel choice (``None``: the best for the backend).
    deterministic_backward: bit-reproducible backward pass (see jax_flash).
    logits_soft_cap: Gemma 2's cap ``c``: scores ``s`` become ``c * tanh(s / c)`` (a module
      attribute: ``nn.MultiHeadDotProductAttention`` has none); ``None``: no cap.
    sinks: learned attention sinks (gpt-oss): a parameter ``sinks`` ``(num_heads,)``
      (``param_dtype``, zeros), one logit per query head joining every row's softmax
      denominator (see :func:`dot_product_attention`). The stock module has no such parameter.
    alibi_slopes: fixed ALiBi slopes, one per query head (not a parameter).

  ``attention_fn`` must stay unset. ``dropout_rate > 0`` drops attention weights as the stock
  module does (``deterministic=False``; the call's ``dropout_rng``, else
  ``make_rng("dropout")``; ``broadcast_dropout`` shares one mask over the batch and the
  heads), fused into the kernels (not the stock module's bits); ``sow_weights`` and the
  ``*_einsum_cls`` attributes raise ``NotImplementedError``; the deprecated ``inputs_kv`` call
  argument is not taken (use ``inputs_k``).

  ``decode=True`` works as in the stock module: the first call (``init``, with the full-length
  input) makes the "cache" collection ``cached_key``, ``cached_value`` (shaped and typed like
  that call's keys: ``(batch..., max_length, num_kv_heads, head_dim)``) and ``cache_index``
  (int32 0) and attends as without decode; each later call (``apply(..., mutable=["cache"])``)
  takes one position, writes its key and value at ``cache_index`` and attends to positions
  ``0 .. cache_index`` (so ``is_causal`` is implied; ``local_window_size`` raises). Past
  ``max_length`` it does what the stock module does: no error, the last slot is overwritten.
  Unlike the stock module, which checks the query only, the key is checked against the cache
  too.
  """

  num_kv_heads: int | None = None
  is_causal: bool = False
  local_window_size: int | tuple[int, int] | None = None
  implementation: Implementation | None = None
  deterministic_backward: bool = False
  logits_soft_cap: float | None = None
  sinks: bool = False
  alibi_slopes: tuple[float, ...] | None = None

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
               inputs_v: jax.Array | None = None, *, mask: jax.Array | None = None,
               deterministic: bool | None = None, dropout_rng: jax.Array | None = None,
               sow_weights: bool = False, query_seq_lengths: jax.Array | None = None,
               key_value_seq_lengths: jax.Array | None = None,
               q_segment_ids: jax.Array | None = None,
               kv_segment_ids: jax.Array | None = None,
               block_mask: jax.Array | None = None) -> jax.Array:
    """``nn.MultiHeadDotProductAttention.__call__`` plus padding lengths: int arrays shaped
    like the batch dims of the inputs; keys past a length are ignored, output rows past a length
    are zero before the output projection (so they equal its bias); in a decode call the key
    lengths narrow the cache's valid prefix further. And segment ids: int32 ``(batch...,
    length)`` document ids of the query and key inputs (packed documents: the same ids as both
    for self-attention); a query attends only keys of its document. Not in a decode step. And
    a block mask (block-sparse attention: see :func:`dot_product_attention`), not in a decode
    step either."""
    if self.attention_fn is not nn.dot_product_attention:
      raise ValueError("FlashMultiHeadDotProductAttention computes attention with jax_flash; "
                       "for another attention_fn use nn.MultiHeadDotProductAttention")
    num_kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
    if num_kv_heads < 1 or self.num_heads % num_kv_heads != 0:
      raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                       f"({num_kv_heads})")
    attention_fn = make_attention_fn(
        is_causal=self.is_causal, local_window_size=self.local_window_size,
        implementation=self.implementation, deterministic_backward=self.deterministic_backward,
        logits_soft_cap=self.logits_soft_cap)

    inputs_k, inputs_v = _keys_and_values(inputs_q, inputs_k, inputs_v,
                                          "nn.MultiHeadDotProductAttention")
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads != 0:
      raise ValueError(f"Memory dimension ({qkv_features}) must be divisible by number of "
                       f"heads ({self.num_heads}).")
    head_dim = qkv_features // self.num_heads

    # The stock module's projections, parameter for parameter (kv heads aside).
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
        precision=self.precision, dot_general=self.qkv_dot_general,
        dot_general_cls=self.qkv_dot_general_cls)
    query = dense(features=(self.num_heads, head_dim), name="query")(inputs_q)
    key = dense(features=(num_kv_heads, head_dim), name="key")(inputs_k)
    value = dense(features=(num_kv_heads, head_dim), name="value")(inputs_v)
    if self.normalize_qk:
      layer_norm = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype,
                                     param_dtype=self.param_dtype)
      query = layer_norm(name="query_ln")(query)
      key = layer_norm(name="key_ln")(key)

    # Flax's cache: created (zeros, shaped like this call's keys) by the first call, which
    # attends as without decode; every later call writes one position and attends to the prefix.
    if self.decode:
      initialized = self.has_variable("cache", "cached_key")
      cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
      cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
      cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
      if initialized:
        owner = "FlashMultiHeadDotProductAttention"
        _no_segment_ids_in_decode(owner, q_segment_ids, kv_segment_ids, block_mask)
        # Flax checks the query against the cache (its heads are the query's there).
        _flax_cache.check_new_entry(owner, "query", query,
                                    (*cached_key.value.shape[:-2], self.num_heads, head_dim))
        step = _flax_cache.write_and_attend(owner, key, value, cached_key.value,
                                            cached_value.value, cache_index.value,
                                            key_value_seq_lengths)
        cached_key.value = key = step.cached_key
        cached_value.value = value = step.cached_value
        cache_index.value = step.cache_index
        key_value_seq_lengths = step.key_value_seq_lengths
        attention_fn = _decoding(attention_fn, owner)

    if self.dropout_rate > 0.0:
      deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
      if not deterministic and dropout_rng is None:
        dropout_rng = self.make_rng("dropout")
    else:
      deterministic = True
    einsums = {
        name: (cls() if cls else None) for name, cls in (
            ("qk_attn_weights_einsum", self.qk_attn_weights_einsum_cls),
            ("attn_weights_value_einsum", self.attn_weights_value_einsum_cls))}
    x = attention_fn(
        query, key, value, mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout, deterministic=deterministic,
        dtype=self.dtype, precision=self.precision, module=self if sow_weights else None,
        force_fp32_for_softmax=self.force_fp32_for_softmax, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, block_mask=block_mask,
        sinks=(self.param("sinks", nn.initializers.zeros_init(), (self.num_heads,),
                          self.param_dtype) if self.sinks else None),
        alibi_slopes=_slopes_array(self.alibi_slopes), **einsums)
    return nn.DenseGeneral(
        features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias,
        dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
        dot_general=self.out_dot_general, dot_general_cls=self.out_dot_general_cls,
        name="out")(x)
