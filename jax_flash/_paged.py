"""jax_flash.paged_attention: decoding attention over a paged KV cache (vLLM / FlashAttention's
``flash_attn_with_kvcache(block_table=...)`` layout), forward only on the kernels."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _attention, _decode, _dispatch, _ops, _reference, _registry, _validation

CALLER = "jax_flash.paged_attention"
PAGED_IMPLEMENTATIONS = (None, "cpu", "xla", "cuda")


def _check_pages(query, key_pages, value_pages, page_table, kv_lengths) -> None:
  """Trace-time checks of the shapes and dtypes; every message names the argument and the
  shapes passed."""
  shapes = (f"query{query.shape}, key_pages{key_pages.shape}, value_pages{value_pages.shape}, "
            f"page_table{page_table.shape}, kv_lengths{kv_lengths.shape}")
  if query.ndim != 4:
    raise ValueError(f"{CALLER}: query must be (B, T, N, H); got {shapes}")
  if key_pages.ndim != 4:
    raise ValueError(f"{CALLER}: key_pages must be (num_pages, page_size, K, H); got {shapes}")
  if value_pages.ndim != 4 or value_pages.shape[:-1] != key_pages.shape[:-1]:
    raise ValueError(f"{CALLER}: value_pages must have the shape of key_pages but for the head "
                     f"dim (num_pages, page_size, K, Hv); got {shapes}")
  batch, _, heads_q, head_dim = query.shape
  _, page_size, heads_k, page_head_dim = key_pages.shape
  if page_size < 1:
    raise ValueError(f"{CALLER}: page_size (key_pages.shape[1]) must be >= 1; got {shapes}")
  if page_head_dim != head_dim:
    raise ValueError(f"{CALLER}: query and key_pages need the same head dim H; got {shapes}")
  if head_dim == 0:
    raise ValueError(f"{CALLER}: the head dim H=0: query and pages need H >= 1; got {shapes}")
  if value_pages.shape[-1] == 0:
    raise ValueError(f"{CALLER}: the value head dim Hv=0: value_pages need Hv >= 1; got {shapes}")
  if heads_k == 0 or heads_q % heads_k:
    raise ValueError(
        f"{CALLER}: the number of query heads N={heads_q} must be a multiple of the number of "
        f"key/value heads K={heads_k}; got {shapes}")
  if page_table.ndim != 2 or page_table.shape[0] != batch:
    raise ValueError(f"{CALLER}: page_table must be (B, pages_per_sequence) with B={batch} "
                     f"(query's batch); got {shapes}")
  if page_table.dtype != jnp.int32:
    raise ValueError(f"{CALLER}: page_table must be int32; got {page_table.dtype} ({shapes})")
  if page_table.shape[1] * page_size > np.iinfo(np.int32).max:
    raise ValueError(f"{CALLER}: pages_per_sequence * page_size must fit int32 (the lengths "
                     f"are int32); got {shapes}")
  if kv_lengths.shape != (batch,):
    raise ValueError(f"{CALLER}: kv_lengths must have shape ({batch},) (one length per "
                     f"sequence); got {shapes}")
  if kv_lengths.dtype != jnp.int32:
    raise ValueError(f"{CALLER}: kv_lengths must be int32; got {kv_lengths.dtype} ({shapes})")
  dtypes = {query.dtype, key_pages.dtype, value_pages.dtype}
  if len(dtypes) != 1:
    raise ValueError(f"{CALLER}: query, key_pages and value_pages must share one dtype; got "
                     f"{query.dtype}, {key_pages.dtype}, {value_pages.dtype}")
  if query.dtype not in _validation.SUPPORTED_DTYPES:
    raise ValueError(f"{CALLER}: query and pages must be float32, bfloat16 or float16; got "
                     f"{query.dtype}")


def _select(implementation, query, value_pages, *, logits_soft_cap=None, sinks=None,
            alibi_slopes=None) -> str:
  """The implementation that runs the call: `implementation`, or for None "cpu" on the host and
  "cuda" on an NVIDIA GPU (where the CUDA kernels were built); raises the error that says why
  it cannot run. The score variants (soft cap, sinks, ALiBi slopes, validated) go through
  jax_flash._dispatch.select, as dot_product_attention's do."""
  if implementation not in PAGED_IMPLEMENTATIONS:
    raise ValueError(f"{CALLER}: implementation must be one of {PAGED_IMPLEMENTATIONS}; got "
                     f"{implementation!r}")
  name = implementation
  if name is None:
    backend = jax.default_backend()
    if backend == "cpu":
      name = "cpu"
    elif (backend in ("gpu", "cuda") and _registry.has_platform("cuda")
          and _registry.cuda_gpu_present()):
      name = "cuda"
    else:
      raise NotImplementedError(
          f"{CALLER}: jax_flash has no paged kernel for the default backend {backend!r} in this "
          f"build (query{query.shape}); pass implementation='xla' (the pages gathered into a "
          "contiguous cache, plain XLA) or run on host devices with implementation='cpu'")
  if name == "cuda":
    if query.dtype not in (jnp.bfloat16, jnp.float16):
      raise NotImplementedError(
          f"{CALLER}: the CUDA paged kernel takes bfloat16 or float16; got {query.dtype} "
          f"(query{query.shape}); pass implementation='xla' for float32")
    _dispatch._check_cuda_runs()
  can = _dispatch.capabilities(name)
  if not can.paged:
    raise NotImplementedError(f"{CALLER}: implementation {name!r} has no paged form")
  # (The CUDA paged kernel takes one head dim: the tiled kernels' padding is not its.)
  takes_value_head_dim = can.value_head_dim and not can.value_head_dim_by_padding
  if value_pages.shape[-1] != query.shape[-1] and not takes_value_head_dim:
    raise NotImplementedError(
        f"{CALLER}: the {name!r} kernel takes no value head dim other than the query/key head "
        f"dim yet; got query{query.shape} (H={query.shape[-1]}) and "
        f"value_pages{value_pages.shape} (Hv={value_pages.shape[-1]}); pass "
        "implementation='xla' (or 'cpu' on host devices)")
  for what, dim, shape in (("head dim H", query.shape[-1], f"query{query.shape}"),
                           ("value head dim Hv", value_pages.shape[-1],
                            f"value_pages{value_pages.shape}")):
    if can.max_head_dim is not None and dim > can.max_head_dim:
      raise ValueError(f"{CALLER}: {what}={dim} ({shape}) is larger than the {name!r} kernel "
                       f"supports ({what.split()[-1]} <= {can.max_head_dim}); use "
                       "implementation='xla'")
  call = _dispatch.Call(
      query.shape, query.dtype, logits_soft_cap=logits_soft_cap,
      sinks=None if sinks is None else sinks.shape,
      alibi_slopes=None if alibi_slopes is None else alibi_slopes.shape,
      value=None if value_pages.shape[-1] == query.shape[-1] else value_pages.shape, paged=True)
  # None resolves to `name` there too: "cpu" on the host, "cuda" for 16-bit inputs on a GPU
  # (float32 on a GPU was refused above).
  _dispatch.select(implementation, call, caller=CALLER)
  return name


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _paged_kernel(q, key_pages, value_pages, page_table, kv_lengths, scale, is_causal,
                  window_left, window_right, splits, implementation):
  batch, seq_q, heads_q, _ = q.shape
  head_dim_v = value_pages.shape[-1]
  workspaces = _decode.workspace_shapes(splits, batch, seq_q, heads_q, head_dim_v)
  call = jax.ffi.ffi_call(
      f"jax_flash_{implementation}_paged",
      (jax.ShapeDtypeStruct((batch, seq_q, heads_q, head_dim_v), q.dtype),
       jax.ShapeDtypeStruct((batch, heads_q, seq_q), jnp.float32), *workspaces),
      # The pages are shared by the batch: a vmapped call runs once per mapped element.
      vmap_method="sequential")
  o, lse, _, _ = call(q, key_pages, value_pages, page_table, kv_lengths,
                      **_decode.attributes(scale, is_causal, window_left, window_right, splits))
  return o, lse


def _refuse_differentiation(*args):
  raise NotImplementedError(
      f"{CALLER} is forward only (inference) on the 'cpu' and 'cuda' kernels: they have no "
      "backward pass. "
      "Differentiate jax_flash.dot_product_attention over a contiguous cache, or pass "
      "implementation='xla' (plain XLA, differentiable)")


_paged_kernel.defvjp(_refuse_differentiation, _refuse_differentiation)


def _query_positions(seq_q: int, kv_lengths):
  """(B, T): the position of each query row among its sequence's keys (the last T)."""
  return kv_lengths[:, None] - seq_q + jnp.arange(seq_q)[None, :]


def _paged_alibi_bias(slopes, positions, seq_k: int):
  """(B, N, T, S) float32: ALiBi's slopes[h] * (j - p) of key j and the query row at position
  p (`positions` (B, T), bottom-right as the masks place it); j - p formed as an integer and
  converted once, as the kernels form it."""
  distance = jnp.arange(seq_k, dtype=jnp.int32)[None, None, :] - positions[:, :, None]
  return slopes[None, :, None, None] * distance.astype(jnp.float32)[:, None]


def _paged_xla(q, key_pages, value_pages, page_table, kv_lengths, *, scale, is_causal,
               window_left, window_right, logits_soft_cap=None, sinks=None, alibi_slopes=None):
  """The plain-XLA path: pages gathered into a contiguous (B, S, K, H) cache, the bottom-right
  masks as a mask array, ALiBi's bottom-right bias as a bias array, jax_flash's reference
  attention (the cap and the sinks as there). A sequence whose length reaches a page table
  entry outside [0, num_pages) gets NaN everywhere (XLA cannot raise at run time)."""
  batch, seq_q, _, _ = q.shape
  num_pages, page_size, heads_k, _ = key_pages.shape
  pages_per_seq = page_table.shape[1]
  seq_k = pages_per_seq * page_size
  if num_pages == 0:  # nothing to gather from: every sequence that has a key is refused below
    key_pages, value_pages = (jnp.zeros((1, *x.shape[1:]), x.dtype)
                              for x in (key_pages, value_pages))

  def gather(pages):
    x = jnp.take(pages, page_table, axis=0, mode="clip")  # (B, pages_per_seq, page_size, K, H)
    return x.reshape(batch, seq_k, heads_k, pages.shape[-1])

  k, v = gather(key_pages), gather(value_pages)
  positions = _query_positions(seq_q, kv_lengths)  # (B, T)
  i = positions[:, :, None]
  j = jnp.arange(seq_k)[None, None, :]
  allowed = j < kv_lengths[:, None, None]
  if is_causal:
    allowed &= j <= i
  if window_left >= 0:
    allowed &= j >= i - window_left
  if window_right >= 0:
    allowed &= j <= i + window_right
  q_lens = jnp.full((batch,), seq_q, jnp.int32)
  bias = None if alibi_slopes is None else _paged_alibi_bias(alibi_slopes, positions, seq_k)
  out, lse = _reference.attention_reference(
      q, k, v, q_lens, kv_lengths, scale=scale, is_causal=False, mask=allowed[:, None],
      bias=bias, logits_soft_cap=logits_soft_cap, sinks=sinks)
  return _nan_where_bad_entry(out, lse, page_table, kv_lengths, page_size, num_pages)


def _nan_where_bad_entry(out, lse, page_table, kv_lengths, page_size: int, num_pages: int):
  """out (B, T, N, H) and lse (B, N, T) with NaN for every sequence whose length (clamped)
  reaches a page table entry outside [0, num_pages): what "xla", the CUDA kernel and the
  gathered path give, as none can raise at run time."""
  pages_per_seq = page_table.shape[1]
  reached = jnp.arange(pages_per_seq)[None, :] * page_size < kv_lengths[:, None]
  bad = jnp.any(reached & ((page_table < 0) | (page_table >= num_pages)), axis=1)  # (B,)
  out = jnp.where(bad[:, None, None, None], jnp.nan, out)
  lse = jnp.where(bad[:, None, None], jnp.nan, lse)
  return out, lse


def gathered_window(is_causal: bool, window_left: int,
                    window_right: int) -> tuple[int, int] | None:
  """The top-left (dot_product_attention) window that, on keys and queries each in reverse
  order, masks what the paged call's bottom-right `is_causal` and window mask.

  Reversed (key j' = L - 1 - j of a sequence of L keys, row t' = T - 1 - t at position
  p = L - 1 - t'), ``j <= p`` becomes ``j' >= t'`` and ``p - left <= j <= p + right`` becomes
  ``t' - right <= j' <= t' + left``: a window (right, left), its left side 0 under is_causal,
  either side unbounded (-1) where nothing limits it; None where there is no mask at all. The
  reversal takes the per-sequence offset L - T out of the masks, which the tiled forward
  (positions from 0 on both sides, one set of masks for the batch) cannot take."""
  left = window_right if window_right >= 0 else -1
  if is_causal:
    left = 0
  right = window_left if window_left >= 0 else -1
  if left < 0 and right < 0:
    return None
  return left, right


def _gather_reversed(pages, page_table, kv_lengths, page_size: int):
  """(B, pages_per_seq * page_size, K, H): key j' of sequence b is its key L - 1 - j' (L its
  length), read from row (L - 1 - j') % page_size of page page_table[b, (L - 1 - j') //
  page_size]; positions j' >= L (masked by the length) read key 0. Entries are clamped into
  [0, num_pages), as the kernels clamp them, so nothing outside the pool is read."""
  num_pages = pages.shape[0]
  seq_k = page_table.shape[1] * page_size
  source = jnp.clip(kv_lengths[:, None] - 1 - jnp.arange(seq_k)[None, :], 0, seq_k - 1)  # (B, S)
  page = jnp.take_along_axis(page_table, source // page_size, axis=1)
  page = jnp.clip(page, 0, num_pages - 1)
  return pages.at[page, source % page_size].get(mode="promise_in_bounds")  # (B, S, K, H)


def _forward_o_float32(q, k, v, q_lens, kv_lens, config, *extra):
  """The kernels' forward with o in float32 (for_backward's config: on CUDA the tiled forward,
  whose o can be float32, where the decode kernel would run), for the sinks' join."""
  return _ops.flash_fwd(q, k, v, q_lens, kv_lens, _ops.for_backward(config), *extra)


def paged_gathered(q, key_pages, value_pages, page_table, kv_lengths, scale, is_causal,
                   window_left, window_right, implementation, *, logits_soft_cap=None,
                   alibi_slopes=None, o_float32=False):
  """(out (B, T, N, Hv), lse (B, N, T)) of the paged call by the contiguous forward of
  `implementation` (the tiled forward, or on "cpu" the contiguous decode kernel where the
  shapes take it; "cuda" for chunked prefill, the kernels for the score variants, or any
  kernel in tests): each sequence's keys gathered, in reverse order, into a contiguous
  (B, pages_per_sequence * page_size, K, H) cache (one gather from each pool, entries
  clamped), the query rows reversed too, the bottom-right masks as the window of
  gathered_window, the lengths as key_value_seq_lengths; the rows put back in order. A
  sequence whose length reaches an entry outside [0, num_pages) is NaN, as on "xla". Reads
  the cache once per 128 query rows (the tiled forward's) for one extra copy of the batch's K/V
  (the gathered cache, temporary memory).

  `logits_soft_cap` goes to the kernels as it is. `alibi_slopes` (N,) float32 go negated: on
  the reversed keys j' = L - 1 - j and rows t' = T - 1 - t the kernels' -slope * (j' - t') is
  slope * (j - p), p = L - T + t the row's position, exactly (the integers are negated). With
  `o_float32` out is float32 (for the sinks' join); else q's dtype."""
  return _paged_gathered(q, key_pages, value_pages, page_table, kv_lengths, alibi_slopes, scale,
                         is_causal, window_left, window_right, implementation, logits_soft_cap,
                         o_float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(6, 13)))
def _paged_gathered(q, key_pages, value_pages, page_table, kv_lengths, alibi_slopes, scale,
                    is_causal, window_left, window_right, implementation, logits_soft_cap,
                    o_float32):
  batch, seq_q, _, _ = q.shape
  num_pages, page_size = key_pages.shape[:2]
  if num_pages == 0:  # nothing to gather from: every sequence that has a key is NaN below
    key_pages, value_pages = (jnp.zeros((1, *x.shape[1:]), x.dtype)
                              for x in (key_pages, value_pages))
  window = gathered_window(is_causal, window_left, window_right)
  left, right = window if window is not None else (-1, -1)
  k = _gather_reversed(key_pages, page_table, kv_lengths, page_size)
  v = _gather_reversed(value_pages, page_table, kv_lengths, page_size)
  q_lens = jnp.full((batch,), seq_q, jnp.int32)
  out, lse = _ops.call_kernels(
      _forward_o_float32 if o_float32 else _ops.flash_fwd, q[:, ::-1], k, v, q_lens,
      kv_lengths, implementation=implementation, scale=scale, is_causal=False,
      window_left=left, window_right=right, caller=CALLER, logits_soft_cap=logits_soft_cap,
      alibi_slopes=None if alibi_slopes is None else -alibi_slopes)
  out, lse = out[:, ::-1], lse[..., ::-1]
  return _nan_where_bad_entry(out, lse, page_table, kv_lengths, page_size, num_pages)


_paged_gathered.defvjp(_refuse_differentiation, _refuse_differentiation)


def _kernel_route(implementation: str, query, heads_k: int, *, logits_soft_cap, sinks,
                  alibi_slopes) -> str:
  """How the kernels run a paged call: "kernel" (the paged decode kernel reading the pages) or
  "gather" (paged_gathered). The paged kernels take no soft cap or slopes, and write o in the
  input dtype, so sinks (joined in XLA to a float32 o, as dot_product_attention joins them)
  stay on the kernel for float32 inputs only; on CUDA chunked prefill gathers too
  (jax_flash._decode.cuda_paged_route)."""
  if logits_soft_cap is not None or alibi_slopes is not None:
    return "gather"
  if sinks is not None and query.dtype != jnp.float32:
    return "gather"
  if implementation == "cuda":
    return _decode.cuda_paged_route(query.shape[1], query.shape[2], heads_k)
  return "kernel"


def paged_attention(
    query: jax.typing.ArrayLike,
    key_pages: jax.typing.ArrayLike,
    value_pages: jax.typing.ArrayLike,
    page_table: jax.typing.ArrayLike,
    kv_lengths: jax.typing.ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.typing.ArrayLike | None = None,
    alibi_slopes: jax.typing.ArrayLike | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention of new query tokens over a paged KV cache: forward only (inference) on the kernels.

  The cache layout of vLLM and of FlashAttention's ``flash_attn_with_kvcache(block_table=...)``:
  each sequence's keys and values live in fixed-size pages of one shared pool, listed in order
  by its row of the page table. Key ``j`` of sequence ``b`` is row ``j % page_size`` of page
  ``page_table[b, j // page_size]``.

  Args:
    query: ``(B, T, N, H)``: the T newest tokens of each sequence (T = 1 for a decode step, more
      for speculative decoding or chunked prefill); float32, bfloat16 or float16.
    key_pages: ``(num_pages, page_size, K, H)``, query's dtype, ``N % K == 0`` (GQA/MQA).
    value_pages: ``(num_pages, page_size, K, Hv)``: like ``key_pages`` but for its head dim
      ``Hv``, which may differ from ``H`` (MLA-style; the output then has ``Hv``) on "cpu" and
      "xla"; "cuda" raises ``NotImplementedError`` for ``Hv != H``.
    page_table: ``(B, pages_per_sequence)`` int32: the pages of each sequence, in order.
    kv_lengths: ``(B,)`` int32: how many keys each sequence has, the T query tokens' own
      included (vLLM's ``seq_lens``); clamped to ``[0, pages_per_sequence * page_size]``. A
      sequence of length 0 gives zeros (and the empty-row lse).
    scale: logit scale, ``1 / sqrt(H)`` by default (as ``dot_product_attention``).
    is_causal: query row ``t`` sits at position ``p = kv_lengths[b] - T + t`` (the queries are
      the last T tokens: bottom-right aligned, as FlashAttention's kv-cache call and vLLM align
      it, unlike ``dot_product_attention``'s top-left ``is_causal``) and attends keys
      ``j <= p``. Rows whose position is negative (``kv_lengths[b] < T``) see no key.
    local_window_size: ``w`` or ``(left, right)``: row at position ``p`` attends keys
      ``p - left <= j <= p + right`` (positions as for ``is_causal``).
    logits_soft_cap: ``c`` (Gemma 2): every score ``s = scale * q.k`` becomes
      ``c * tanh(s / c)`` before ALiBi, the masks and the softmax; validated as in
      ``dot_product_attention`` (a concrete float > 0, or ``None``). "cpu" and "xla"; "cuda"
      as in ``dot_product_attention`` (where its kernels take no cap, ``NotImplementedError``
      naming it while tracing).
    sinks: ``(N,)`` float32/bfloat16/float16, one logit per query head that joins every row's
      softmax denominator without a value (gpt-oss), as in ``dot_product_attention``; the lse
      includes it, and a row with no key gives zeros and lse ``sinks[h]``. "cpu", "cuda" and
      "xla": the kernels' o and lse are joined with the sinks in XLA (o in float32, rounded
      once), so that the gradient of the sinks exists on every path (see below).
    alibi_slopes: ``(N,)`` float32/bfloat16/float16, one slope per query head: the score of
      the row at position ``p`` (as for ``is_causal``: ``kv_lengths[b] - T + t``) and key
      ``j`` gains ``alibi_slopes[h] * (j - p)``, after the soft cap, before the masks (so a
      decode step's bias is that of its row in the full causal ``dot_product_attention``).
      Not differentiated. "cpu" and "xla"; "cuda" as for the cap.
    implementation: ``None`` (the "cpu" kernel on host devices, "cuda" on an NVIDIA GPU),
      ``"cpu"``, ``"cuda"`` (bfloat16/float16; float32 raises ``NotImplementedError``: use
      "xla"), or ``"xla"`` (the pages gathered into a contiguous cache, then plain XLA;
      quadratic memory, any backend).
    return_residual: also return the log-sum-exp of each row's logits, ``(B, T, N)`` float32.

  Page table entries: the entries a sequence's length reaches (its first
  ``ceil(kv_lengths[b] / page_size)``) must lie in ``[0, num_pages)``; the others are never
  read and may hold anything (padding such as -1). On the "cpu" kernel a reached entry outside
  that range is an error when the call runs (``XlaRuntimeError`` ``INVALID_ARGUMENT`` naming
  the entry), raised before anything is read; the kernel also clamps every entry it reads into
  range, so the native code never reads outside ``key_pages``/``value_pages``. On "xla" and
  "cuda" (which cannot raise at run time: the table is device memory; the CUDA kernel and the
  gather clamp the entries they read) such a sequence's output and lse are NaN.

  Returns:
    ``(B, T, N, Hv)`` in query's dtype; with ``return_residual``, ``(out, lse)``.

  The "cpu" kernel is the split-KV decode kernel of ``dot_product_attention`` (query heads of a
  kv head packed, the key range cut into chunks run in parallel, see ``jax_flash._decode``),
  reading K/V through the page table. So is "cuda" where a contiguous call of the same shape
  runs the CUDA decode kernel, ``T * (N / K) <= 64`` packed query rows per kv head; with more
  (chunked prefill) the pages are gathered into a contiguous cache (an extra copy of the
  batch's K/V in temporary memory) for the tiled forward, which reads K/V once per 128 query
  rows where the decode kernel's 16-row tiles would read them once per tile
  (``jax_flash._decode.cuda_paged_route``; ``JAX_FLASH_CUDA_DECODE=tiled`` gathers for every
  shape). The paged kernels take no soft cap or ALiBi and write o in the input dtype: a call
  with ``logits_soft_cap`` or ``alibi_slopes``, or with ``sinks`` on 16-bit inputs, gathers
  the pages the same way for the contiguous forward (on "cpu" the contiguous decode kernel
  where the shape takes it, else the tiled one; on "cuda" the tiled one, whose o is float32
  for the sinks' join), and float32 calls with ``sinks`` alone keep the paged kernel. The
  kernels have no derivative: differentiating the call in ``query`` or the pages raises
  ``NotImplementedError``; the sinks, joined in XLA, differentiate on every path ("xla"
  differentiates all but the slopes). Under ``vmap`` the paged kernels run once per mapped
  element.
  """
  query, key_pages, value_pages = (jnp.asarray(x) for x in (query, key_pages, value_pages))
  page_table, kv_lengths = jnp.asarray(page_table), jnp.asarray(kv_lengths)
  _check_pages(query, key_pages, value_pages, page_table, kv_lengths)
  batch, seq_q, heads_q, head_dim = query.shape
  logits_soft_cap = _validation.check_logits_soft_cap(logits_soft_cap)
  sinks = _validation.check_sinks(sinks, heads_q, query.shape)
  alibi_slopes = _validation.check_alibi_slopes(alibi_slopes, heads_q, query.shape)
  implementation = _select(implementation, query, value_pages, logits_soft_cap=logits_soft_cap,
                           sinks=sinks, alibi_slopes=alibi_slopes)
  _, page_size, heads_k, _ = key_pages.shape
  seq_k = page_table.shape[1] * page_size
  window = _validation.check_window(local_window_size, seq_q + seq_k)
  window_left, window_right = window if window is not None else (-1, -1)
  scale = _validation.check_scale(scale, head_dim)
  kv_lengths = jnp.clip(kv_lengths, 0, seq_k)

  join_sinks = False  # the kernels' (o, lse) of the keys, to be joined with the sinks
  if query.size == 0 or seq_k == 0:  # no output, or no key for any row
    out = jnp.zeros((*query.shape[:-1], value_pages.shape[-1]), query.dtype)
    lse = _reference.empty_lse(batch, heads_q, seq_q, sinks)
  elif implementation == "xla":
    out, lse = _paged_xla(query, key_pages, value_pages, page_table, kv_lengths, scale=scale,
                          is_causal=bool(is_causal), window_left=window_left,
                          window_right=window_right, logits_soft_cap=logits_soft_cap,
                          sinks=sinks, alibi_slopes=alibi_slopes)
  elif _kernel_route(implementation, query, heads_k, logits_soft_cap=logits_soft_cap,
                     sinks=sinks, alibi_slopes=alibi_slopes) == "gather":
    out, lse = paged_gathered(query, key_pages, value_pages, page_table, kv_lengths, scale,
                              bool(is_causal), window_left, window_right, implementation,
                              logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                              o_float32=sinks is not None)
    join_sinks = sinks is not None
  else:
    q, kernel_scale = _ops.positive_scale(query, scale)
    pages_k, pages_v = key_pages, value_pages
    if implementation == "cuda":
      splits = _decode.cuda_num_splits(batch, seq_q, heads_q, heads_k, seq_k)
      # The CUDA kernel reads rows in 16-byte chunks: a head dim not a multiple of 8 is padded
      # with zero columns (which change no score), the pools included (a copy of the cache:
      # use such head dims for tests, not for speed).
      pad = _ops.head_dim_padding("cuda", head_dim)
      if pad:  # (Hv == H here: _select refuses another Hv on CUDA)
        widths = [(0, 0)] * 3 + [(0, pad)]
        q, pages_k, pages_v = (jnp.pad(x, widths) for x in (q, pages_k, pages_v))
    else:
      splits = _decode.num_splits(batch, seq_q, heads_q, heads_k, seq_k)
    out, lse = _paged_kernel(q, pages_k, pages_v, page_table, kv_lengths,
                             float(kernel_scale), bool(is_causal), window_left, window_right,
                             splits, implementation)
    out = out[..., :value_pages.shape[-1]]
    join_sinks = sinks is not None  # (float32 inputs: _kernel_route)
  if join_sinks:  # o in float32 here, rounded to the input dtype once, after the join
    out, lse = _attention._join_sinks(out.astype(jnp.float32), lse, sinks)
    out = out.astype(query.dtype)
  lse = jax.lax.stop_gradient(lse)
  if not return_residual:
    return out
  return out, jnp.swapaxes(lse, -1, -2)
