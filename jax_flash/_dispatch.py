"""Which implementation runs an attention call, and whether it can: the one place that decides.

Every entry point (``dot_product_attention``, ``ring_attention``, ``paged_attention``, the Flax
functions and modules) describes its call as a :class:`Call` and asks :func:`select`, which

1. resolves ``implementation=None`` for the default backend and the input dtype (``"cpu"`` on
   the host; on NVIDIA GPUs ``"cuda"`` for bfloat16/float16 and ``"blockwise"`` for float32);
2. checks that a forced ``"cuda"`` can run here (kernels built, a CUDA GPU visible);
3. checks the call against what the chosen implementation states it supports
   (:func:`capabilities`), and raises the one error that names the option, the shapes the
   caller passed and what to use instead.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from jax_flash import _dropout, _logit_arrays, _registry

Implementation = Literal["cpu", "cuda", "xla", "blockwise"]
IMPLEMENTATIONS = (None, "cpu", "cuda", "xla", "blockwise")

# The mask forms every path takes as arguments (never as arrays).
MASK_FORMS = frozenset({"causal", "seq_lengths", "local_window"})

_FLOAT_DTYPES = frozenset(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))

_HALF_DTYPES = frozenset(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16))

_KERNEL_MASK_ADVICE = (
    "Express a mask as is_causal / query_seq_lengths / key_value_seq_lengths / "
    "local_window_size, which the kernels take, or pass implementation='blockwise' "
    "(FlashAttention in XLA, which takes both arrays) or 'xla' (on the host the 'cpu' kernel "
    "takes them too)")


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What one implementation supports, as it states it."""

  name: str
  kernel: bool  # a jax_flash kernel (a custom call), not plain XLA
  dtypes: frozenset  # input dtypes it computes in
  max_head_dim: int | None  # None: any head dim
  head_dim_multiple: int  # head dims are zero-padded up to a multiple of this (1: no padding)
  logit_arrays: bool  # takes jax.nn's `bias` and `mask` arrays
  mask_forms: frozenset  # of MASK_FORMS: the masks it takes as arguments
  deterministic_backward: bool  # honours deterministic=True (bit-identical gradients)
  ring: bool  # runs the blocks of ring attention (ring_attention, sequence-sharded calls)
  paged: bool = False  # runs jax_flash.paged_attention (K/V read through a page table)
  segment_ids: bool = False  # takes q_segment_ids / kv_segment_ids (packed documents)
  logits_soft_cap: bool = False  # takes logits_soft_cap (Gemma 2's tanh cap of the scores)
  sinks: bool = False  # takes sinks (gpt-oss: one logit per head in every row's denominator)
  alibi_slopes: bool = False  # takes alibi_slopes (ALiBi: slope * (j - i) added to the scores)
  block_mask: bool = False  # takes block_mask (block-sparse attention: hidden blocks skipped)
  dropout_rate: bool = False  # takes dropout_rate > 0 (fused dropout of the probabilities)
  # takes a value head dim Hv other than the query/key head dim H (MLA: value (..., S, K, Hv),
  # output (..., T, N, Hv))
  value_head_dim: bool = False
  # ... by zero-padding q and k, or v, to the larger of H and Hv (jax_flash._ops.call_kernels):
  # its kernels take one head dim (zero columns of q and k change no score, zero columns of v
  # give zero output columns, sliced off; JAX differentiates the padding)
  value_head_dim_by_padding: bool = False


def capabilities(name: str) -> Capabilities:
  """The record of implementation `name` ("cpu", "cuda", "xla" or "blockwise"); the kernels'
  limits come from the native modules (read at import by jax_flash._registry)."""
  if name == "cpu":
    return Capabilities(
        name, kernel=True, dtypes=_FLOAT_DTYPES,
        max_head_dim=_registry.KERNEL_CONSTANTS["max_head_dim"],
        head_dim_multiple=1,  # the kernel aligns its own float32 tiles
        # bias/mask arrays read where they lie (cuda/cpu/logit_arrays.h), dbias from the kernel
        logit_arrays=True, mask_forms=MASK_FORMS,
        deterministic_backward=True,  # always: dQ partials are summed in a fixed order
        ring=True, paged=True, segment_ids=True, logits_soft_cap=True, sinks=True,
        alibi_slopes=True, block_mask=True, dropout_rate=True, value_head_dim=True)
  if name == "cuda":
    cuda = _registry.CUDA_KERNEL_CONSTANTS or {}  # empty where no CUDA kernels were built
    return Capabilities(
        name, kernel=True, dtypes=_HALF_DTYPES, max_head_dim=cuda.get("max_head_dim"),
        head_dim_multiple=cuda.get("head_dim_multiple", 1),
        # bias/mask arrays: the Hopper kernels' kLogitArrays instantiations (cuda/gpu/
        # logit_arrays.cuh), experimental: only under JAX_FLASH_CUDA_LOGIT_ARRAYS=on
        # (jax_flash._logit_arrays); not beside some options (refused below)
        logit_arrays=_logit_arrays.cuda_kernels_take_logit_arrays(),
        mask_forms=MASK_FORMS, deterministic_backward=True, ring=True,
        # jax_flash.paged_attention: the CUDA decode kernel over the pages, or the pages
        # gathered for the tiled forward (chunked prefill; jax_flash._decode.cuda_paged_route)
        paged=True,
        # sinks: joined to the kernel's float32 o and lse in XLA (jax_flash._attention
        # ._join_sinks), so the kernels need none of their own; such calls run the tiled forward
        # (jax_flash._ops.for_backward), whose o can be float32, also where the decode kernel
        # would have run
        sinks=True,
        # the soft cap and ALiBi: the kernels' kGeneral instantiations (cuda/gpu/
        # score_mods.cuh), the tiled kernels only (jax_flash._ops.call_kernels)
        logits_soft_cap=True, alibi_slopes=True,
        # segment ids: the same kernels' (cuda/gpu/segment_ids.cuh: blocks whose ids cannot
        # meet are skipped)
        segment_ids=True,
        # block_mask: the same kernels walk only the live blocks (cuda/gpu/block_sparse.cuh)
        block_mask=True,
        # dropout: the kernels' dropout instantiations (cuda/gpu/dropout_fragments.h),
        # experimental: only under JAX_FLASH_CUDA_DROPOUT=on (jax_flash._dropout); not beside
        # segment ids or a block mask (refused below)
        dropout_rate=_dropout.cuda_kernels_take_dropout(),
        # Hv != H: q, k or v zero-padded to the larger head dim (the paged kernel refuses it)
        value_head_dim=True, value_head_dim_by_padding=True)
  if name in ("xla", "blockwise"):
    return Capabilities(
        name, kernel=False, dtypes=_FLOAT_DTYPES, max_head_dim=None, head_dim_multiple=1,
        logit_arrays=True, mask_forms=MASK_FORMS,
        deterministic_backward=True,  # XLA's products and scans: no atomics
        ring=False, paged=name == "xla",  # "xla": the pages gathered, then the reference
        segment_ids=True, logits_soft_cap=True, sinks=True, alibi_slopes=True, block_mask=True,
        dropout_rate=True, value_head_dim=True)
  raise ValueError(f"no implementation named {name!r}")


@dataclasses.dataclass(frozen=True)
class Call:
  """What one call asks of an implementation, with shapes as the caller passed them (for the
  messages: a (T, S) mask is reported as (T, S), not as its rank-4 broadcast form)."""

  query: tuple[int, ...]  # the query's shape; its last dim is the head dim
  dtype: jnp.dtype
  bias: tuple[int, ...] | None = None  # the bias's shape, None without one
  mask: tuple[int, ...] | None = None
  mask_forms: frozenset = frozenset()  # of MASK_FORMS
  deterministic: bool = False
  ring: bool = False  # the blocks of ring attention
  # The shapes of q_segment_ids and kv_segment_ids as passed, None without them.
  segment_ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None
  logits_soft_cap: float | None = None  # the cap c, None without one
  sinks: tuple[int, ...] | None = None  # the shape of the sinks, None without them
  alibi_slopes: tuple[int, ...] | None = None  # the shape of the ALiBi slopes, None without
  block_mask: tuple[int, ...] | None = None  # the shape of the block mask, None without
  dropout_rate: float | None = None  # the dropout rate, None without dropout (rate 0)
  # The value's shape as passed where its head dim Hv differs from the query's H; None where
  # they are equal (the output has Hv).
  value: tuple[int, ...] | None = None
  # jax_flash.paged_attention's call: only implementations with a paged form run it, and the
  # messages name those ("cpu", "xla"), not "blockwise".
  paged: bool = False

  @property
  def head_dim(self) -> int:
    return self.query[-1]

  @property
  def value_head_dim(self) -> int:
    """Hv: the value's (and the output's) head dim."""
    return self.query[-1] if self.value is None else self.value[-1]


def mask_forms(*, is_causal: bool, seq_lengths: bool, local_window: bool) -> frozenset:
  """The MASK_FORMS a call uses."""
  used = {"causal": is_causal, "seq_lengths": seq_lengths, "local_window": local_window}
  return frozenset(form for form, on in used.items() if on)


def check_implementation(implementation) -> None:
  """A ValueError unless `implementation` is one of IMPLEMENTATIONS."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")


def default_implementation(dtype) -> str:
  """What implementation=None runs for inputs of `dtype` on the default backend."""
  backend = jax.default_backend()
  if backend == "cpu":
    return "cpu"
  if backend in ("gpu", "cuda") and _registry.has_platform("cuda") and _registry.cuda_gpu_present():
    # The CUDA kernels take 16-bit inputs: float32 runs FlashAttention in XLA.
    return "blockwise" if jnp.dtype(dtype) == jnp.float32 else "cuda"
  raise NotImplementedError(
      f"jax_flash has no kernel for the default backend {backend!r} in this build; pass "
      "implementation='blockwise' for the linear-memory XLA path, 'xla' for the plain "
      "reference (or 'cpu' to run on host devices)")


def _check_cuda_runs() -> None:
  """A ValueError unless the CUDA kernels were built and JAX sees a CUDA GPU."""
  if not _registry.has_platform("cuda"):
    raise ValueError(
        "implementation='cuda' was requested but this jax_flash build has no CUDA kernels "
        "(no CUDA compiler when it was built); use implementation='cpu' or 'xla'")
  if not _registry.cuda_gpu_present():
    raise ValueError(
        "implementation='cuda' was requested but JAX sees no CUDA GPU; use "
        "implementation='cpu' or 'xla'")


def _takers(supports) -> str:
  """The implementations whose capabilities `supports` accepts, for a message ("'cpu', 'xla')."""
  return ", ".join(repr(n) for n in ("cpu", "blockwise", "xla") if supports(capabilities(n)))


def select(implementation: str | None, call: Call, *,
           caller: str = "jax_flash.dot_product_attention",
           mask_advice: str | None = None) -> str:
  """The implementation that runs `call`: `implementation` itself, or for None the best one for
  the default backend and the dtype; raises the one error that says why it cannot.

  Args:
    implementation: one of IMPLEMENTATIONS.
    call: the normalised arguments.
    caller: the public function named at the start of every message.
    mask_advice: what to do instead of bias/mask arrays on the kernels (the Flax functions name
      Flax's own ways); the default names jax_flash's arguments.

  Raises:
    ValueError: an unknown implementation, a forced "cuda" that cannot run here, a head dim past
      a kernel's limit, an XLA path asked to run ring attention.
    NotImplementedError: an option the implementation does not take (bias/mask arrays on the
      kernels, float32 on the CUDA kernels), or no kernel for the default backend.
  """
  check_implementation(implementation)
  if implementation == "cuda":
    _check_cuda_runs()
  name = implementation if implementation is not None else default_implementation(call.dtype)
  can = capabilities(name)
  picked = (f"implementation=None picks {name!r} here" if implementation is None else
            f"implementation={name!r}")
  if call.ring and not can.ring:
    if implementation is not None:
      raise ValueError(
          f"{caller} needs a kernel: implementation must be None, 'cpu' or 'cuda'; got "
          f"{name!r} (the plain-XLA paths have no ring form)")
    raise NotImplementedError(
        f"{caller} runs on jax_flash's kernels only, and {picked} for {call.dtype} inputs "
        f"(query{call.query}): the CUDA kernels take bfloat16 or float16, so cast the inputs")
  if (call.bias is not None or call.mask is not None) and not can.logit_arrays:
    given = " and ".join(f"{n}{s}" for n, s in (("bias", call.bias), ("mask", call.mask))
                         if s is not None)
    raise NotImplementedError(
        f"{caller}: the {name!r} kernels ({picked}) take no bias or mask arrays; got {given}. "
        f"They never build the (T, S) scores. {mask_advice or _KERNEL_MASK_ADVICE}"
        + (f" (the CUDA kernels take them, experimentally, under "
           f"{_logit_arrays.CUDA_LOGIT_ARRAYS_VARIABLE}=on)" if name == "cuda" else ""))
  if call.segment_ids is not None and not can.segment_ids:
    q_ids, kv_ids = call.segment_ids
    takers = _takers(lambda other: other.segment_ids)
    raise NotImplementedError(
        f"{caller}: the {name!r} kernels ({picked}) take no segment ids yet; got "
        f"q_segment_ids{q_ids} and kv_segment_ids{kv_ids} with query{call.query}. "
        f"Implementations {takers} take them: pass implementation='blockwise' on a GPU "
        "(FlashAttention in XLA)")
  if call.paged and not can.paged:
    raise NotImplementedError(f"{caller}: implementation {name!r} has no paged form")
  # The score variants, block masks and dropout some implementations do not take yet:
  # (argument, how the call passed it, the pronoun the message uses).
  optional = (("logits_soft_cap", f"logits_soft_cap={call.logits_soft_cap!r}", "it"),
              ("sinks", f"sinks{call.sinks}", "them"),
              ("alibi_slopes", f"alibi_slopes{call.alibi_slopes}", "them"),
              ("block_mask", f"block_mask{call.block_mask}", "it"),
              ("dropout_rate", f"dropout_rate={call.dropout_rate!r}", "it"))
  for argument, passed, pronoun in optional:
    if getattr(call, argument) is None or getattr(can, argument):
      continue
    takers = _takers(lambda other: getattr(other, argument) and (other.paged or not call.paged))
    instead = ("implementation='xla' (the pages gathered into a contiguous cache, plain XLA)"
               if call.paged else "implementation='blockwise' on a GPU (FlashAttention in XLA)")
    raise NotImplementedError(
        f"{caller}: the {name!r} kernels ({picked}) take no {argument} yet; got {passed} with "
        f"query{call.query}. Implementations {takers} take {pronoun}: pass {instead}")
  if name == "cuda" and call.dropout_rate is not None and (call.segment_ids or call.block_mask):
    # What the CUDA kernels' dropout (experimental) does not cover yet: the handlers refuse it
    # too (cuda/gpu/ffi_handlers.cc check_dropout), here it is said at trace time.
    raise NotImplementedError(
        f"{caller}: the 'cuda' kernels take dropout_rate={call.dropout_rate!r} but not with "
        f"segment ids or a block mask beside it; got query{call.query}; pass "
        "implementation='blockwise'")
  if name == "cuda" and (call.bias is not None or call.mask is not None):
    # What the CUDA kernels' bias and mask arrays (experimental) do not cover yet: the handlers
    # refuse it too (cuda/gpu/ffi_handlers.cc check_logit_arrays), here it is said at trace time.
    beside = [what for what, given in (
        ("deterministic=True", call.deterministic),
        (f"dropout_rate={call.dropout_rate!r}", call.dropout_rate is not None),
        ("segment ids", call.segment_ids is not None),
        (f"logits_soft_cap={call.logits_soft_cap!r} with a bias",
         call.logits_soft_cap is not None and call.bias is not None)) if given]
    if beside:
      given = " and ".join(f"{n}{s}" for n, s in (("bias", call.bias), ("mask", call.mask))
                           if s is not None)
      raise NotImplementedError(
          f"{caller}: the 'cuda' kernels take bias and mask arrays but not with "
          f"{', '.join(beside)} beside them yet; got {given} with query{call.query}; pass "
          "implementation='blockwise'")
  if call.value is not None and not can.value_head_dim:
    takers = _takers(lambda other: other.value_head_dim)
    raise NotImplementedError(
        f"{caller}: the {name!r} kernels ({picked}) take no value head dim other than the "
        f"query/key head dim yet; got query{call.query} (H={call.head_dim}) and "
        f"value{call.value} (Hv={call.value_head_dim}). Implementations {takers} take it: "
        "pass implementation='blockwise' (or 'xla') on a GPU")
  if can.max_head_dim is not None and call.head_dim > can.max_head_dim:
    instead = ("ring attention has no path for larger heads" if call.ring else
               "use implementation='blockwise' (or 'xla') for larger heads")
    raise ValueError(
        f"head dim H={call.head_dim} (query{call.query}) is larger than the {name!r} kernels "
        f"support (H <= {can.max_head_dim}); {instead}")
  if can.max_head_dim is not None and call.value_head_dim > can.max_head_dim:
    instead = ("ring attention has no path for larger heads" if call.ring else
               "use implementation='blockwise' (or 'xla') for larger heads")
    raise ValueError(
        f"value head dim Hv={call.value_head_dim} (value{call.value}) is larger than the "
        f"{name!r} kernels support (Hv <= {can.max_head_dim}); {instead}")
  if jnp.dtype(call.dtype) not in can.dtypes:
    wanted = " or ".join(sorted(str(d) for d in can.dtypes))
    instead = ("cast the inputs, or use implementation='cpu' on host devices" if call.ring else
               "use implementation=None or 'blockwise' (FlashAttention in XLA at JAX's default "
               "float32 matmul precision)")
    raise NotImplementedError(
        f"{caller}: jax_flash's {name!r} kernels take {wanted}; for {call.dtype} inputs "
        f"(query{call.query}) {instead}")
  missing = sorted(call.mask_forms - can.mask_forms)
  if missing:
    raise NotImplementedError(f"{caller}: {name!r} does not take {', '.join(missing)} masks")
  if call.deterministic and not can.deterministic_backward:
    raise NotImplementedError(f"{caller}: {name!r} has no deterministic backward pass")
  return name
