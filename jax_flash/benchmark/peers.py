"""The attention implementations measured beside jax_flash, and whether each can run here.

A peer builds, for one case, a step per pass that runs the forward pass to completion and one that
runs forward and backward; or it reports why it is unavailable (a package that does not import, a
kernel this build lacks), everywhere or for a kind of case (block-sparse cases: only the peers
that can express a block mask run them; packed-document cases: only those that take segment ids
or a mask, and whose kernel does not refuse them at trace time; cases with a value head dim
Hv != H (--value-head-dim): only those whose call takes such a value, jax_flash and tokamax; not
jax.nn's cudnn and xla, Pallas' mha or PyTorch's CPU flash kernel; grouped-query cases, K < N
key/value heads (--kv-heads): every peer given k and v of K heads as they are, none repeating
them to N, where its call takes them: jax_flash, jax.nn's xla and cudnn, tokamax, and PyTorch's
CPU flash kernel where it takes enable_gqa=True (probed); not Pallas' mha).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _dispatch
from jax_flash._block_sparse import expand_block_mask
from jax_flash.benchmark.cases import Case, Inputs
from jax_flash.benchmark.machine import usable_cores
from jax_flash.benchmark.measure import (ACCELERATOR_CALLS_PER_STEP, Compiled, Prepare,
                                         compile_step, failure_reason)

# An attention function over (B, S, N, H) queries, (B, S, K, H) keys and (B, S, K, Hv) values
# (K = N but in grouped-query cases): (query, key, value, is_causal) -> output; for a
# block-sparse case also block_mask=(Tb, Sb) bool, for a packed case documents=D (an int).
AttentionFn = Callable[..., jax.Array]
# Arrays an attention function also takes as keywords that the forward+backward pass
# differentiates (the bias of --bias-grad): (query, key) -> {keyword: array}, formed in the step
# from the shapes of query and key, outside the differentiated function, and given to jax.vjp
# as primals beside q, k and v (their gradients returned after dq, dk, dv).
Differentiated = Callable[[jax.Array, jax.Array], dict[str, jax.Array]]

NO_BLOCK_MASK = "takes no block mask (block-sparse cases run jax_flash's 'cpu' kernel and XLA)"
NO_DOCUMENTS = "takes no segment ids or mask (packed documents)"
# Why jax.nn's implementations and Pallas' mha run no case with a value head dim Hv != H: each
# checks that value has the head dim of query and key (a ValueError at trace time).
JAX_NN_NO_VALUE_HEAD_DIM = ("jax.nn.dot_product_attention takes no value head dim Hv != H "
                            "(ValueError: value must have key's shape)")
PALLAS_NO_VALUE_HEAD_DIM = ("Pallas' mha takes no value head dim Hv != H (ValueError: q, k and v "
                            "must have the same head dimension)")
# Why Pallas' mha runs no grouped-query case: it reads k and v at the query's head index (its
# grid runs over the query heads; nothing checks K), so K < N heads are not grouped but read
# out of bounds.
PALLAS_NO_GROUPED_HEADS = ("Pallas' mha takes no grouped K/V heads K != N (it reads k and v at "
                           "the query's head index)")
# A case's kinds a peer runs: a reason it does not, None where it does.
CaseKinds = Callable[[Case], str | None]


def case_kinds(block_sparse: str | None = NO_BLOCK_MASK,
               packed: str | None = NO_DOCUMENTS) -> CaseKinds:
  """A peer's case_unavailable: `block_sparse` for block-sparse cases and `packed` for
  packed-document ones (each a reason, or None where the peer runs them); None for the rest."""

  def unavailable(case: Case) -> str | None:
    if case.block_density is not None and block_sparse is not None:
      return block_sparse
    if case.documents is not None and packed is not None:
      return packed
    return None

  return unavailable


def _any_case(case: Case) -> str | None:
  return None


def _case_call(attention: AttentionFn, case: Case) -> Callable[..., jax.Array]:
  """attention as the case calls it: (q, k, v, *blocks, **arrays) -> output, its block mask (if
  any) the last positional argument, its documents (if packed) a constant, any differentiated
  arrays (Differentiated) passed on as keywords."""

  def forward(q: jax.Array, k: jax.Array, v: jax.Array, *blocks: jax.Array,
              **arrays: jax.Array) -> jax.Array:
    options: dict[str, object] = dict(block_mask=blocks[0]) if blocks else {}
    if case.documents is not None:
      options["documents"] = case.documents
    return attention(q, k, v, is_causal=case.causal, **options, **arrays)

  return forward


def _passes(forward: Callable[..., jax.Array], differentiated: Differentiated | None
            ) -> tuple[Callable[..., jax.Array], Callable[..., tuple[jax.Array, tuple]]]:
  """The forward pass (q, k, v, *blocks) -> output and the forward+backward pass (q, k, v,
  d_out, *blocks) -> (output, gradients) of `forward` (_case_call's): the gradients of q, k and
  v for the cotangent d_out, and with `differentiated` also those of its arrays (a dict, the
  fourth gradient), which both passes form in the step and pass to `forward`."""
  if differentiated is None:

    def forward_backward(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array,
                         *blocks: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
      out, vjp = jax.vjp(lambda q, k, v: forward(q, k, v, *blocks), q, k, v)
      return out, vjp(d_out)

    return forward, forward_backward

  def forward_only(q: jax.Array, k: jax.Array, v: jax.Array, *blocks: jax.Array) -> jax.Array:
    return forward(q, k, v, *blocks, **differentiated(q, k))

  def forward_backward_arrays(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array,
                              *blocks: jax.Array) -> tuple[jax.Array, tuple]:
    # Formed outside the differentiated function (from shapes only), then differentiated as
    # primals: the same arrays as the forward pass's, and no gradient flows into q or k.
    arrays = differentiated(q, k)
    out, vjp = jax.vjp(lambda q, k, v, arrays: forward(q, k, v, *blocks, **arrays),
                       q, k, v, arrays)
    return out, vjp(d_out)

  return forward_only, forward_backward_arrays


def trace_refusal(attention: AttentionFn, case: Case,
                  refused: tuple[type[Exception], ...] = (NotImplementedError,),
                  differentiated: Differentiated | None = None) -> str | None:
  """Why `attention` refuses the case at trace time (one of the `refused` errors, by default a
  NotImplementedError, in its forward or backward, the latter with the gradients of the
  `differentiated` arrays where given, as _build_jax's pass), or None; other errors are left to
  the run, which records them as failures. Not cached: each probe traces the call afresh."""
  dtype = jnp.dtype(case.dtype)
  rows, kv_rows = (case.batch, case.seq, case.heads), (case.batch, case.seq, case.num_kv_heads)
  query = jax.ShapeDtypeStruct((*rows, case.head_dim), dtype)
  key = jax.ShapeDtypeStruct((*kv_rows, case.head_dim), dtype)
  value = jax.ShapeDtypeStruct((*kv_rows, case.hv), dtype)
  d_out = jax.ShapeDtypeStruct((*rows, case.hv), dtype)
  mask = case.block_mask()
  blocks = () if mask is None else (jax.ShapeDtypeStruct(mask.shape, mask.dtype),)
  _, forward_backward = _passes(_case_call(attention, case), differentiated)

  try:
    jax.eval_shape(forward_backward, query, key, value, d_out, *blocks)
  except refused as e:
    return failure_reason(e)
  except Exception:  # noqa: BLE001  (not a refusal: the run records what it is)
    return None
  return None


def has_value_head_dim(case: Case) -> bool:
  """Whether the case's value head dim differs from its query/key head dim."""
  return case.hv != case.head_dim


def has_grouped_heads(case: Case) -> bool:
  """Whether the case's key and value have fewer heads than its query (grouped-query)."""
  return case.num_kv_heads != case.heads


def probed(attention: AttentionFn, kinds: CaseKinds,
           refused: tuple[type[Exception], ...] = (NotImplementedError,)) -> CaseKinds:
  """`kinds`, and for a packed case, one with a value head dim Hv != H or a grouped-query one
  (K < N key/value heads) that it runs, the refusal of `attention` at trace time
  (trace_refusal: e.g. cuDNN's ValueError for a call it does not support; jax_flash's "cpu"
  and "cuda" kernels take segment ids, Hv != H and K < N)."""

  def unavailable(case: Case) -> str | None:
    reason = kinds(case)
    if reason is None and (case.documents is not None or has_value_head_dim(case)
                           or has_grouped_heads(case)):
      reason = trace_refusal(attention, case, refused)
    return reason

  return unavailable


def value_head_dim_refusal(attention: AttentionFn, reason: str, kinds: CaseKinds,
                           refused: tuple[type[Exception], ...] = (ValueError,
                                                                   NotImplementedError)
                           ) -> CaseKinds:
  """`kinds`, and first, for a case with a value head dim Hv != H, `reason` where `attention`
  refuses such a value at trace time (one of `refused`, probed on the case's plain twin: dense,
  one sequence a row, K = N, so that the refusal is the value's). One line of reason for every
  case, where the error's own message would name each case's shapes; a peer that comes to take
  Hv != H runs such cases without a change here."""

  def unavailable(case: Case) -> str | None:
    if has_value_head_dim(case):
      plain = dataclasses.replace(case, block_density=None, documents=None, kv_heads=None)
      if trace_refusal(attention, plain, refused) is not None:
        return reason
    return kinds(case)

  return unavailable


def segment_ids(query: jax.Array, documents: int) -> jax.Array:
  """(B, T) int32 segment ids of a packed case's rows (cases.document_ids), formed in the step
  (a constant XLA folds)."""
  batch, seq = query.shape[:2]
  return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32) // (seq // documents), (batch, seq))


def segment_mask(query: jax.Array, documents: int) -> jax.Array:
  """The (B, 1, T, S) bool mask of a packed case's self-attention, formed in the step from its
  segment ids as a jax.nn user forms it: query and key in the same document."""
  ids = segment_ids(query, documents)
  return ids[:, None, :, None] == ids[:, None, None, :]


@dataclasses.dataclass(frozen=True)
class Peer:
  """An attention implementation to measure.

  `name` names it in results and rate columns, `label` in ratio and memory columns;
  `unavailable` returns why it cannot run here (None when it can), `case_unavailable` why it
  cannot run a case (a block-sparse one); `build` puts a case's inputs where the peer runs and
  returns a `Prepare` per pass, called just before that pass is timed (so a pass that fails to
  compile leaves the other one measured).
  """

  name: str
  label: str
  unavailable: Callable[[], str | None]
  build: Callable[[Case, Inputs], dict[str, Prepare]]
  case_unavailable: Callable[[Case], str | None] = _any_case


# ---------------------------------------------------------------------------------------------
# JAX peers


def _build_jax(attention: AttentionFn, device_kind: str, case: Case, inputs: Inputs, *,
               differentiated: Differentiated | None = None) -> dict[str, Prepare]:
  """Passes of a JAX attention function on the first `device_kind` device.

  The forward+backward pass returns the output with the gradients of query, key and value for a
  random output cotangent (those of sum(output · cotangent)): given only the gradients, XLA
  would drop the product P·V of its forward pass (and report less temp memory), while PyTorch
  and jax_flash compute it. With `differentiated` (the bias of --bias-grad), both passes form
  its arrays in the step and the forward+backward pass returns their gradients too (_passes).
  A block-sparse case's block mask is one more argument of both (attention's block_mask); a
  packed case's documents are a constant (attention's documents).
  """
  device = jax.devices(device_kind)[0]
  q, k, v, d_out = (jax.device_put(x, device) for x in inputs.arrays())
  blocks = () if inputs.block_mask is None else (jax.device_put(inputs.block_mask, device),)
  forward, forward_backward = _passes(_case_call(attention, case), differentiated)
  calls = 1 if device_kind == "cpu" else ACCELERATOR_CALLS_PER_STEP
  return {"fwd": functools.partial(compile_step, forward, (q, k, v, *blocks), calls),
          "fwd+bwd": functools.partial(compile_step, forward_backward, (q, k, v, d_out, *blocks),
                                       calls)}


def jax_peer(name: str, label: str, device_kind: str, attention: AttentionFn,
             unavailable: Callable[[], str | None] = lambda: None,
             case_unavailable: CaseKinds = case_kinds(),
             differentiated: Differentiated | None = None) -> Peer:
  """A peer that runs `attention` under jax.jit on the platform's JAX device (by default
  neither block-sparse nor packed cases: `attention` takes no block_mask or documents); with
  `differentiated`, arrays it takes as keywords that its forward+backward pass differentiates."""
  return Peer(name=name, label=label, unavailable=unavailable,
              build=functools.partial(_build_jax, attention, device_kind,
                                      differentiated=differentiated),
              case_unavailable=case_unavailable)


def _jax_flash_unavailable(kernel: str) -> str | None:
  if jax_flash.has_platform(kernel):
    return None
  return f"this jax_flash build has no {kernel!r} kernels"


def _flash_attention(kernel: str, deterministic: bool, query: jax.Array, key: jax.Array,
                     value: jax.Array, *, is_causal: bool, block_mask: jax.Array | None = None,
                     documents: int | None = None) -> jax.Array:
  """jax_flash's `kernel`; a packed case with q_segment_ids = kv_segment_ids (segment_ids)."""
  ids = None if documents is None else segment_ids(query, documents)
  return jax_flash.dot_product_attention(
      query, key, value, is_causal=is_causal, block_mask=block_mask, q_segment_ids=ids,
      kv_segment_ids=ids, implementation=kernel, deterministic=deterministic)


def flash_peer(kernel: str, device_kind: str, deterministic: bool = False) -> Peer:
  """jax_flash's `kernel` ("cpu" or "cuda") on the `device_kind` device; block-sparse cases
  with their block_mask (both kernels take it); packed cases with segment ids (both kernels take
  them; unavailable where a kernel refuses a call at trace time)."""
  attention = functools.partial(_flash_attention, kernel, deterministic)
  takes_blocks = _dispatch.capabilities(kernel).block_mask
  kinds = case_kinds(block_sparse=None if takes_blocks
                     else f"the {kernel!r} kernels take no block_mask yet", packed=None)
  return jax_peer("jax_flash", "flash", device_kind, attention,
                  functools.partial(_jax_flash_unavailable, kernel), probed(attention, kinds))


def _separate_attention(kernel: str, deterministic: bool, query: jax.Array, key: jax.Array,
                        value: jax.Array, *, is_causal: bool, documents: int) -> jax.Array:
  """jax_flash's `kernel` on a packed case's documents as separate rows: (B, S, N, H) arrays
  reshaped to (B * D, S / D, N, H) (the same tokens, no copy) and the output back."""

  def rows(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0] * documents, x.shape[1] // documents, *x.shape[2:])

  out = jax_flash.dot_product_attention(rows(query), rows(key), rows(value), is_causal=is_causal,
                                        implementation=kernel, deterministic=deterministic)
  return out.reshape(query.shape[0], query.shape[1], *out.shape[2:])


def separate_flash_peer(kernel: str, device_kind: str, deterministic: bool = False) -> Peer:
  """The baseline of packed cases ("jax_flash_separate"): jax_flash's `kernel` on the same
  tokens as B * D separate rows of S / D tokens, one document each (packed cases only)."""
  attention = functools.partial(_separate_attention, kernel, deterministic)
  return jax_peer("jax_flash_separate", "flash sep", device_kind, attention,
                  functools.partial(_jax_flash_unavailable, kernel),
                  lambda case: None if case.documents is not None and case.block_density is None
                  else "runs packed-document cases only (their documents as separate rows)")


def _jax_nn_attention(implementation: str, query: jax.Array, key: jax.Array, value: jax.Array,
                      *, is_causal: bool, block_mask: jax.Array | None = None,
                      documents: int | None = None) -> jax.Array:
  """jax.nn.dot_product_attention(implementation=...); a block mask expanded to the (T, S)
  bool element mask it takes (T x S bytes, besides its T x S scores), a packed case's
  documents as a (B, 1, T, S) bool mask (segment_mask), both formed in the step."""
  masks = []
  if block_mask is not None:
    masks.append(expand_block_mask(block_mask, query.shape[1], key.shape[1])[None, None])
  if documents is not None:
    masks.append(segment_mask(query, documents))
  mask = functools.reduce(jnp.logical_and, masks) if masks else None
  return jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=is_causal,
                                      implementation=implementation)


def _pallas_unavailable() -> str | None:
  try:
    from jax.experimental.pallas.ops.gpu import attention  # noqa: F401  (only whether it imports)
  except ImportError as e:
    return f"Pallas' GPU attention does not import ({e})"
  return None


def _pallas_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                      is_causal: bool, documents: int | None = None) -> jax.Array:
  """Pallas' Triton FlashAttention on (B, T, N, H) arrays, scaled by 1/sqrt(H) as jax.nn is;
  a packed case with its (B, T) segment ids (a value head dim Hv != H: its ValueError). A
  grouped-query case (k and v of K < N heads) raises NotImplementedError here
  (PALLAS_NO_GROUPED_HEADS): mha would index k and v by the query head, out of their bounds.

  Its signature has changed between JAX versions: `segment_ids`, `sm_scale` and `causal` are
  passed only where `mha` has them, and a causal or packed case fails where it has no
  `causal` or `segment_ids`.
  """
  if key.shape[2] != query.shape[2]:
    raise NotImplementedError(PALLAS_NO_GROUPED_HEADS)
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention

  parameters = inspect.signature(pallas_attention.mha).parameters
  options: dict[str, object] = {}
  if "segment_ids" in parameters:
    options["segment_ids"] = None if documents is None else segment_ids(query, documents)
  elif documents is not None:
    raise NotImplementedError("this JAX's Pallas mha has no `segment_ids` parameter")
  if "sm_scale" in parameters:
    options["sm_scale"] = 1.0 / math.sqrt(query.shape[-1])
  if "causal" in parameters:
    options["causal"] = is_causal
  elif is_causal:
    raise NotImplementedError("this JAX's Pallas mha has no `causal` parameter")
  return pallas_attention.mha(query, key, value, **options)


def _tokamax_unavailable() -> str | None:
  try:
    import tokamax
  # Not only ImportError: tokamax follows JAX's internals closely and may fail to import
  # against another JAX version in other ways; any failure means it cannot run here.
  except Exception as e:
    if isinstance(e, ModuleNotFoundError) and e.name == "tokamax":
      return f"tokamax is not installed ({e})"
    return f"tokamax does not import ({failure_reason(e)})"
  if not hasattr(tokamax, "dot_product_attention"):
    return "this tokamax has no dot_product_attention"
  return None


def _tokamax_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                       is_causal: bool, documents: int | None = None) -> jax.Array:
  """tokamax's Mosaic GPU FlashAttention (a Pallas kernel for Hopper) on (B, T, N, H) arrays,
  scaled by 1/sqrt(H) by default as jax.nn is; a packed case with the (B, 1, T, S) bool mask
  (segment_mask) where its dot_product_attention has a `mask` parameter, else a
  NotImplementedError. A value (B, S, N, Hv) of another head dim is passed as it is: tokamax's
  dot_product_attention takes one (value "*B S K h", output "*B T N h"; the Mosaic GPU kernels
  size v, the accumulator and the output by v's head dim, forward and backward). So are key
  and value of K < N heads (grouped-query): its K is their heads, N % K == 0, and the Mosaic
  kernels read K/V head h // (N / K) for query head h; a tokamax that refused them at trace
  time (NotImplementedError) would leave the case 'unavailable' with the reason.

  `implementation="mosaic"` holds tokamax to that kernel: left to choose, it falls back to
  Triton or XLA without a word where Mosaic does not apply, and the figure would not say which
  ran. A tokamax whose API differs raises here, and the benchmark records the reason.
  """
  import tokamax

  options = {}
  if documents is not None:
    if "mask" not in inspect.signature(tokamax.dot_product_attention).parameters:
      raise NotImplementedError("this tokamax's dot_product_attention takes no mask")
    options["mask"] = segment_mask(query, documents)
  return tokamax.dot_product_attention(query, key, value, is_causal=is_causal,
                                       implementation="mosaic", **options)


# ---------------------------------------------------------------------------------------------
# PyTorch peer


def _torch_unavailable() -> str | None:
  try:
    import torch  # noqa: F401  (only whether it imports)
  except ImportError as e:
    return f"PyTorch is not installed ({e})"
  return None


@functools.lru_cache(maxsize=1)
def _torch_flash_mask_refusal() -> str | None:
  """Why PyTorch's CPU flash kernel takes no bool attn_mask here (a tiny forward and backward
  held to it), None where it takes one."""
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel

  q = torch.randn(1, 1, 8, 8, requires_grad=True)
  mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
  try:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
      torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum().backward()
  except RuntimeError as e:
    return f"its CPU flash kernel takes no attn_mask here ({failure_reason(e)})"
  return None


def _torch_flash_probe(step: Callable[[], object], errors: tuple[type[Exception], ...],
                       keyword: str, cut: str) -> str | None:
  """Runs `step` (a tiny forward and backward) held to PyTorch's CPU flash kernel: None where it
  runs, else why not: the first line of the warning naming `keyword` (up to `cut`), which says
  why, or else the error (one of `errors`), which says only that no kernel is left."""
  import warnings

  from torch.nn.attention import SDPBackend, sdpa_kernel

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        step()
    except errors as e:
      said = [str(w.message).split(cut)[0].strip() for w in caught if keyword in str(w.message)]
      return said[0].splitlines()[0] if said else failure_reason(e)
  return None


@functools.lru_cache(maxsize=1)
def _torch_flash_value_head_dim_refusal() -> str | None:
  """Why PyTorch's CPU flash kernel takes no value of another head dim here (a tiny forward and
  backward with Hv != H held to it; torch 2.x refuses, warning that the flash kernel needs one
  last dimension for q, k and v: "Flash attention requires q,k,v to have the same last
  dimension. Got ..."), None where it takes one."""
  import torch

  q = torch.randn(1, 1, 8, 8, requires_grad=True)
  v = torch.randn(1, 1, 8, 4, requires_grad=True)
  why = _torch_flash_probe(
      lambda: torch.nn.functional.scaled_dot_product_attention(q, q, v).sum().backward(),
      (RuntimeError,), "dimension", ". Got")
  if why is None:
    return None
  return f"its CPU flash kernel (the one timed) takes no value head dim Hv != H here ({why})"


@functools.lru_cache(maxsize=1)
def _torch_flash_gqa_refusal() -> str | None:
  """Why PyTorch's CPU flash kernel takes no key and value of fewer heads than the query here
  (a tiny forward and backward, 4 query heads over 2 K/V heads, enable_gqa=True, held to it),
  None where it takes them (torch 2.13's does, K and V as they are: no repeat of them runs
  beside the flash op). A torch whose scaled_dot_product_attention has no enable_gqa (before
  2.5) raises TypeError; one whose flash kernel refuses grouped heads, RuntimeError, warning
  "... require query, key and value to have the same num_heads. Query ..."."""
  import torch

  q = torch.randn(1, 4, 8, 8, requires_grad=True)
  kv = torch.randn(1, 2, 8, 8, requires_grad=True)
  sdpa = torch.nn.functional.scaled_dot_product_attention
  why = _torch_flash_probe(lambda: sdpa(q, kv, kv, enable_gqa=True).sum().backward(),
                           (TypeError, RuntimeError), "num_heads", ". Query")
  if why is None:
    return None
  return f"its CPU flash kernel (the one timed) takes no grouped K/V heads K != N here ({why})"


def _torch_case_unavailable(case: Case) -> str | None:
  """PyTorch's flash kernel runs dense cases, packed ones where it takes an attn_mask, ones
  with a value head dim Hv != H where it takes such a value, and grouped-query ones (K < N
  key/value heads) where it takes them (enable_gqa=True)."""
  if case.block_density is not None:
    return "its flash kernel (the one timed) takes no block mask"
  for applies, refusal in ((has_value_head_dim(case), _torch_flash_value_head_dim_refusal),
                           (has_grouped_heads(case), _torch_flash_gqa_refusal)):
    reason = refusal() if applies else None
    if reason is not None:
      return reason
  return None if case.documents is None else _torch_flash_mask_refusal()


def torch_attn_mask(case: Case):
  """A packed case's (B, 1, T, S) bool attn_mask for PyTorch (a broadcast view of one (T, S)
  mask), the causal mask folded in (PyTorch takes is_causal or attn_mask, not both); None for
  other cases."""
  import torch

  ids = case.document_ids()
  if ids is None:
    return None
  ids = torch.from_numpy(ids)
  allowed = ids[:, None] == ids[None, :]
  if case.causal:
    allowed &= torch.ones_like(allowed).tril()
  return allowed.expand(case.batch, 1, case.seq, case.seq)


def _build_torch_cpu(case: Case, inputs: Inputs) -> dict[str, Prepare]:
  """Passes of PyTorch's CPU scaled_dot_product_attention, held to its flash kernel, on
  (B, N, S, H) tensors (value and cotangent Hv; key and value K heads) of the case's dtype
  with a thread per usable core; a packed case with a (B, 1, T, S) bool attn_mask of its
  documents, the causal mask folded in (PyTorch takes is_causal or attn_mask, not both), made
  before the steps; a grouped-query case (K < N) with enable_gqa=True (its kernel reads the
  K heads as they are)."""
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel

  # The cores this process may run on (taskset), not the machine's.
  torch.set_num_threads(usable_cores())
  # 16-bit inputs go through float32 (numpy's bfloat16 is not torch's): exact, same values.
  dtype = getattr(torch, case.dtype)
  q, k, v, d_out = (torch.from_numpy(np.ascontiguousarray(
      x.swapaxes(1, 2).astype(np.float32))).to(dtype) for x in inputs.arrays())
  leaves = [t.clone().requires_grad_() for t in (q, k, v)]
  mask = torch_attn_mask(case)
  options: dict[str, object] = (dict(is_causal=case.causal) if mask is None
                                else dict(attn_mask=mask))
  if has_grouped_heads(case):
    options["enable_gqa"] = True
  attention = functools.partial(torch.nn.functional.scaled_dot_product_attention, **options)

  def fwd() -> None:
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
      attention(q, k, v)

  def fwd_bwd() -> None:
    for leaf in leaves:
      leaf.grad = None
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
      attention(*leaves).backward(d_out)

  return {"fwd": lambda: Compiled(fwd, None), "fwd+bwd": lambda: Compiled(fwd_bwd, None)}


# ---------------------------------------------------------------------------------------------
# The peers of each platform

# XLA takes every kind of case but a value head dim Hv != H (as cuDNN, both through jax.nn); the
# rest take packed cases where they do not refuse them at trace time (cuDNN through jax.nn
# raises ValueError for what it does not support), and Hv != H where their call takes it.
# Grouped-query cases (K < N key/value heads): jax.nn takes them natively (N % K == 0), XLA
# without a probe, the others where they do not refuse them at trace time (probed; Pallas'
# mha refuses them: PALLAS_NO_GROUPED_HEADS).
_XLA = functools.partial(_jax_nn_attention, "xla")
_CUDNN = functools.partial(_jax_nn_attention, "cudnn")
_PACKED_TOO = case_kinds(packed=None)
_XLA_KINDS = value_head_dim_refusal(_XLA, JAX_NN_NO_VALUE_HEAD_DIM, case_kinds(None, None))

FLASH_CPU = flash_peer("cpu", "cpu")
XLA_CPU = jax_peer("xla", "xla", "cpu", _XLA, case_unavailable=_XLA_KINDS)
TORCH_CPU = Peer(name="torch", label="torch", unavailable=_torch_unavailable,
                 build=_build_torch_cpu, case_unavailable=_torch_case_unavailable)

FLASH_GPU = flash_peer("cuda", "gpu")
CUDNN_GPU = jax_peer("cudnn", "cudnn", "gpu", _CUDNN,
                     case_unavailable=value_head_dim_refusal(
                         _CUDNN, JAX_NN_NO_VALUE_HEAD_DIM,
                         probed(_CUDNN, _PACKED_TOO, (NotImplementedError, ValueError))))
TOKAMAX_GPU = jax_peer("tokamax", "tokamax", "gpu", _tokamax_attention, _tokamax_unavailable,
                       probed(_tokamax_attention, _PACKED_TOO))
XLA_GPU = jax_peer("xla", "xla", "gpu", _XLA, case_unavailable=_XLA_KINDS)
PALLAS_GPU = jax_peer("pallas", "pallas", "gpu", _pallas_attention, _pallas_unavailable,
                      value_head_dim_refusal(_pallas_attention, PALLAS_NO_VALUE_HEAD_DIM,
                                             probed(_pallas_attention, _PACKED_TOO)))
