"""The attention implementations measured beside jax_flash, and whether each can run here.

A peer builds, for one case, a step per pass that runs the forward pass to completion and one that
runs forward and backward; or it reports why it is unavailable (a package that does not import, a
kernel this build lacks), everywhere or for a kind of case (block-sparse cases: only the peers
that can express a block mask run them).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable

import jax
import numpy as np

import jax_flash
from jax_flash import _dispatch
from jax_flash._block_sparse import expand_block_mask
from jax_flash.benchmark.cases import Case, Inputs
from jax_flash.benchmark.machine import usable_cores
from jax_flash.benchmark.measure import (ACCELERATOR_CALLS_PER_STEP, Compiled, Prepare,
                                         compile_step, failure_reason)

# An attention function over (B, S, N, H) arrays: (query, key, value, is_causal) -> output; for a
# block-sparse case also block_mask=(Tb, Sb) bool.
AttentionFn = Callable[..., jax.Array]

NO_BLOCK_MASK = "takes no block mask (block-sparse cases run jax_flash's 'cpu' kernel and XLA)"


def _dense_only(reason: str) -> Callable[[Case], str | None]:
  """A peer's case_unavailable: `reason` for block-sparse cases, None for dense ones."""
  return lambda case: None if case.block_density is None else reason


def _any_case(case: Case) -> str | None:
  return None


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


def _build_jax(attention: AttentionFn, device_kind: str, case: Case,
               inputs: Inputs) -> dict[str, Prepare]:
  """Passes of a JAX attention function on the first `device_kind` device.

  The forward+backward pass returns the output with the gradients of query, key and value for a
  random output cotangent (those of sum(output · cotangent)): given only the gradients, XLA
  would drop the product P·V of its forward pass (and report less temp memory), while PyTorch
  and jax_flash compute it.
  A block-sparse case's block mask is one more argument of both (attention's block_mask).
  """
  device = jax.devices(device_kind)[0]
  q, k, v, d_out = (jax.device_put(x, device) for x in inputs.arrays())
  blocks = () if inputs.block_mask is None else (jax.device_put(inputs.block_mask, device),)

  def forward(q: jax.Array, k: jax.Array, v: jax.Array, *blocks: jax.Array) -> jax.Array:
    sparse = dict(block_mask=blocks[0]) if blocks else {}
    return attention(q, k, v, is_causal=case.causal, **sparse)

  def forward_backward(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array,
                       *blocks: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, vjp = jax.vjp(lambda q, k, v: forward(q, k, v, *blocks), q, k, v)
    return out, vjp(d_out)

  calls = 1 if device_kind == "cpu" else ACCELERATOR_CALLS_PER_STEP
  return {"fwd": functools.partial(compile_step, forward, (q, k, v, *blocks), calls),
          "fwd+bwd": functools.partial(compile_step, forward_backward, (q, k, v, d_out, *blocks),
                                       calls)}


def jax_peer(name: str, label: str, device_kind: str, attention: AttentionFn,
             unavailable: Callable[[], str | None] = lambda: None,
             case_unavailable: Callable[[Case], str | None] = _dense_only(NO_BLOCK_MASK)) -> Peer:
  """A peer that runs `attention` under jax.jit on the platform's JAX device (by default dense
  cases only: `attention` takes no block_mask)."""
  return Peer(name=name, label=label, unavailable=unavailable,
              build=functools.partial(_build_jax, attention, device_kind),
              case_unavailable=case_unavailable)


def _jax_flash_unavailable(kernel: str) -> str | None:
  if jax_flash.has_platform(kernel):
    return None
  return f"this jax_flash build has no {kernel!r} kernels"


def flash_peer(kernel: str, device_kind: str, deterministic: bool = False) -> Peer:
  """jax_flash's `kernel` ("cpu" or "cuda") on the `device_kind` device; block-sparse cases
  with their block_mask on the kernels that take one (the CUDA kernels refuse it)."""
  attention = functools.partial(jax_flash.dot_product_attention, implementation=kernel,
                                deterministic=deterministic)
  takes_blocks = _dispatch.capabilities(kernel).block_mask
  sparse = _any_case if takes_blocks else _dense_only(
      f"the {kernel!r} kernels take no block_mask yet")
  return jax_peer("jax_flash", "flash", device_kind, attention,
                  functools.partial(_jax_flash_unavailable, kernel), sparse)


def _xla_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, is_causal: bool,
                   block_mask: jax.Array | None = None) -> jax.Array:
  """jax.nn.dot_product_attention(implementation="xla"); a block mask expanded to the (T, S)
  bool element mask it takes (T x S bytes, besides its T x S scores)."""
  mask = None
  if block_mask is not None:
    mask = expand_block_mask(block_mask, query.shape[1], key.shape[1])[None, None]
  return jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=is_causal,
                                      implementation="xla")


def _pallas_unavailable() -> str | None:
  try:
    from jax.experimental.pallas.ops.gpu import attention  # noqa: F401  (only whether it imports)
  except ImportError as e:
    return f"Pallas' GPU attention does not import ({e})"
  return None


def _pallas_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                      is_causal: bool) -> jax.Array:
  """Pallas' Triton FlashAttention on (B, T, N, H) arrays, scaled by 1/sqrt(H) as jax.nn is.

  Its signature has changed between JAX versions: `segment_ids`, `sm_scale` and `causal` are
  passed only where `mha` has them, and a causal case fails where it has no `causal`.
  """
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention

  parameters = inspect.signature(pallas_attention.mha).parameters
  options: dict[str, object] = {}
  if "segment_ids" in parameters:
    options["segment_ids"] = None
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
                       is_causal: bool) -> jax.Array:
  """tokamax's Mosaic GPU FlashAttention (a Pallas kernel for Hopper) on (B, T, N, H) arrays,
  scaled by 1/sqrt(H) by default as jax.nn is.

  `implementation="mosaic"` holds tokamax to that kernel: left to choose, it falls back to
  Triton or XLA without a word where Mosaic does not apply, and the figure would not say which
  ran. A tokamax whose API differs raises here, and the benchmark records the reason.
  """
  import tokamax

  return tokamax.dot_product_attention(query, key, value, is_causal=is_causal,
                                       implementation="mosaic")


# ---------------------------------------------------------------------------------------------
# PyTorch peer


def _torch_unavailable() -> str | None:
  try:
    import torch  # noqa: F401  (only whether it imports)
  except ImportError as e:
    return f"PyTorch is not installed ({e})"
  return None


def _build_torch_cpu(case: Case, inputs: Inputs) -> dict[str, Prepare]:
  """Passes of PyTorch's CPU scaled_dot_product_attention, held to its flash kernel, on
  (B, N, S, H) tensors of the case's dtype with a thread per usable core."""
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel

  # The cores this process may run on (taskset), not the machine's.
  torch.set_num_threads(usable_cores())
  # 16-bit inputs go through float32 (numpy's bfloat16 is not torch's): exact, same values.
  dtype = getattr(torch, case.dtype)
  q, k, v, d_out = (torch.from_numpy(np.ascontiguousarray(
      x.swapaxes(1, 2).astype(np.float32))).to(dtype) for x in inputs.arrays())
  leaves = [t.clone().requires_grad_() for t in (q, k, v)]
  attention = functools.partial(
      torch.nn.functional.scaled_dot_product_attention, is_causal=case.causal)

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

FLASH_CPU = flash_peer("cpu", "cpu")
XLA_CPU = jax_peer("xla", "xla", "cpu", _xla_attention, case_unavailable=_any_case)
TORCH_CPU = Peer(name="torch", label="torch", unavailable=_torch_unavailable,
                 build=_build_torch_cpu,
                 case_unavailable=_dense_only("its flash kernel (the one timed) takes no mask"))

FLASH_GPU = flash_peer("cuda", "gpu")
CUDNN_GPU = jax_peer("cudnn", "cudnn", "gpu",
                     functools.partial(jax.nn.dot_product_attention, implementation="cudnn"))
TOKAMAX_GPU = jax_peer("tokamax", "tokamax", "gpu", _tokamax_attention, _tokamax_unavailable)
XLA_GPU = jax_peer("xla", "xla", "gpu", _xla_attention, case_unavailable=_any_case)
PALLAS_GPU = jax_peer("pallas", "pallas", "gpu", _pallas_attention, _pallas_unavailable)
