"""Loads the native extension and registers its XLA FFI targets with JAX, once, at import."""

from __future__ import annotations

import functools
import math

import jax

try:
  from jax_flash import _native
except ImportError as e:  # pragma: no cover - only on broken installs
  raise ImportError(
      "jax_flash's native extension is missing; reinstall with `pip install -e .`"
  ) from e

_PLATFORM_NAMES = {"cpu": "cpu", "cuda": "CUDA"}


def _import_native_cuda():
  """The CUDA extension, or None: built only where a CUDA compiler was found; it imports
  without a driver (static runtime)."""
  try:
    from jax_flash import _native_cuda
  except ImportError:
    return None
  return _native_cuda


_native_cuda = _import_native_cuda()


def _register_all() -> dict[str, set[str]]:
  registered: dict[str, set[str]] = {}
  for module in (_native, _native_cuda):
    if module is None:
      continue
    for platform, targets in module.registrations().items():
      for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform=_PLATFORM_NAMES[platform])
      registered.setdefault(platform, set()).update(targets)
  return registered


REGISTERED = _register_all()

# The kernels' constants the Python side needs (max head dim, CPU tile sizes, the empty row's
# lse, ...), read from the native modules once, never copied; CUDA's only where it was built.
KERNEL_CONSTANTS: dict = dict(_native.kernel_constants())
CUDA_KERNEL_CONSTANTS: dict | None = (
    dict(_native_cuda.kernel_constants()) if _native_cuda is not None else None)


def cpu_dq_accum_elements(dq_splits: int, batch: int, seq_q: int, heads_q: int,
                          head_dim: int) -> int:
  """Elements of the CPU backward's float32 dQ workspace, as its handler checks them."""
  return int(_native.cpu_dq_accum_elements(dq_splits, batch, seq_q, heads_q, head_dim))


def cpu_dbias_accum_elements(bias_elements: int, keys_broadcast: bool, float32: bool,
                             dq_splits: int, one_each: bool) -> int:
  """Elements of the CPU backward's float32 dbias workspace (0: none), as its handler checks
  them: `keys_broadcast` where the bias's key dim is 1, `float32` for a float32 bias, `one_each`
  where each dbias element takes one dS (cpu_dbias_one_each)."""
  return int(_native.cpu_dbias_accum_elements(bias_elements, bool(keys_broadcast), bool(float32),
                                              dq_splits, bool(one_each)))


def cpu_dbias_one_each(bias_shape: tuple[int, ...], batch: int, heads_q: int, seq_q: int,
                       seq_k: int) -> bool:
  """Whether each element of the CPU backward's dbias takes one dS, for a bias of `bias_shape`
  (q's rank: leading dims, then heads, T, S, each of the call's size or 1) in a call of `batch`
  (q's leading dims' product), `heads_q`, `seq_q` and `seq_k`: then the backward stores dS into
  dbias directly, with no float32 workspace, as its handler decides."""
  *lead, heads, rows, keys = bias_shape
  return bool(_native.cpu_dbias_one_each(math.prod(lead), heads, rows, keys, batch, heads_q, seq_q,
                                         seq_k))


def cuda_dq_accum_elements(batch: int, seq_q: int, seq_k: int, heads_q: int, heads_k: int,
                           head_dim: int, deterministic: bool, head_dim_v: int | None = None) -> int:
  """Elements of the CUDA backward's float32 workspace (dQ's accumulator, and dK's and dV's
  where the Hopper backward splits a group's query heads over CTAs), as its handler checks
  them; `head_dim_v`: v's head dim as the call passes it (None: `head_dim`)."""
  if _native_cuda is None:
    raise RuntimeError("jax_flash was built without CUDA kernels")
  head_dim_v = head_dim if head_dim_v is None else head_dim_v
  return int(_native_cuda.dq_accum_elements(batch, seq_q, seq_k, heads_q, heads_k, head_dim,
                                            head_dim_v, deterministic))


def cuda_narrow_split_call(is_causal: bool, window_left: int, window_right: int, seq_q: int,
                           seq_k: int) -> bool:
  """Whether a plain CUDA call of this mask and shape runs the narrow split (the default;
  JAX_FLASH_CUDA_NARROW=off turns it off: cuda/common/mask.h narrow_shape); False without
  CUDA."""
  if _native_cuda is None:
    return False
  return bool(_native_cuda.narrow_split_call(is_causal, window_left, window_right, seq_q, seq_k))


def cuda_forward_takes_value_head_dim(head_dim: int, head_dim_v: int) -> bool:
  """Whether a CUDA forward of query/key head dim `head_dim` and value head dim `head_dim_v`
  (both padded to the kernels' multiple, different) runs a kernel of that pair taking v as it is
  (on Hopper where the pair is compiled, unless JAX_FLASH_CUDA_VALUE_HEAD_DIM=padded:
  cuda/gpu/launch.h forward_takes_value_head_dim); False without CUDA."""
  if _native_cuda is None:
    return False
  return bool(_native_cuda.forward_takes_value_head_dim(head_dim, head_dim_v))


def cuda_backward_takes_value_head_dim(head_dim: int, head_dim_v: int, deterministic: bool) -> bool:
  """Whether a CUDA backward of these head dims (padded, different) runs a kernel of the pair
  taking v and dO as they are (cuda/gpu/launch.h backward_takes_value_head_dim: as the forward,
  and not deterministic); False without CUDA."""
  if _native_cuda is None:
    return False
  return bool(_native_cuda.backward_takes_value_head_dim(head_dim, head_dim_v, deterministic))


def has_platform(platform: str) -> bool:
  """Whether kernels for `platform` ("cpu" or "cuda") were built and registered."""
  return bool(REGISTERED.get(platform))


def cpu_kernel_isa() -> str:
  """The instruction set of the CPU kernel variant this processor runs: "avx512_amx",
  "avx512_bf16", "avx512", "avx2" or "baseline". The best the CPU supports (bfloat16 products on
  AMX tiles where they are usable; on `vdpbf16ps` on AMD's AVX-512 CPUs with avx512_bf16), or the
  one the environment variable JAX_FLASH_CPU_ISA names where this CPU can run it."""
  return _native.cpu_kernel_isa()


@functools.cache
def cuda_gpu_present() -> bool:
  """Whether JAX has a CUDA device (asked lazily: it initialises JAX's backends)."""
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False
