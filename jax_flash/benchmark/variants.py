"""Score variants (--logits-soft-cap, --alibi, --sinks, --dropout-rate, --bias, --bias-grad,
--mask): jax_flash timed with them beside the plain jax_flash kernel, on the same inputs in the
same run, and every other peer timed with them where it takes them.

A variant run's peers are the plain jax_flash (the baseline, named "jax_flash"), jax_flash with
the variant ("jax_flash+variant") and each other peer with the variant ("cudnn+variant", ...).
A peer that cannot take the variant is unavailable with the reason: for the whole run when it
has no such option (jax.nn.dot_product_attention takes ALiBi only as a bias array, and bias and
mask arrays; Pallas' mha and PyTorch's flash kernel take none of them), per case when its kernel
refuses the call at trace time (a NotImplementedError: the CUDA kernels refuse dropout, and the
bias and mask arrays unless JAX_FLASH_CUDA_LOGIT_ARRAYS=on).

The bias and mask arrays are formed in the step from positions (no random draw, so no peer pays
for one): bias[0, h, i, j] = sin(0.01 (i + 2 j) + h) in the query's dtype, (1, N, T, S); the mask
a (T, S) band, key j visible to row i when i - S/4 < j <= i + S/4 (a quarter of the (T, S) blocks
or so hidden whole at T = S). With --bias the bias is a constant of the call (no gradient
formed); with --bias-grad (which implies --bias) the same bias is differentiated: each pass forms
it in the step, outside the differentiated function, and the fwd+bwd pass gives it to jax.vjp as
a primal beside q, k and v (peers.Differentiated), so that it returns dbias, (1, N, T, S), summed
over the batch the bias broadcasts along (as jax.nn's gradient is), after dq, dk and dv; the
forward pass is the --bias one. Every peer that takes the bias runs it so (jax_flash, jax.nn's
cudnn and xla, tokamax where its signature has a bias); one whose kernel refuses the bias's
gradient at trace time (a NotImplementedError in the backward) reads unavailable with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash.benchmark.peers import (AttentionFn, Differentiated, Peer, jax_peer,
                                       trace_refusal)
from jax_flash.benchmark.platforms import FLASH_KERNELS, Platform, beside_baseline

# Appended to a peer's name (results, rate columns) and label (ratio, memory columns) when it
# runs the variant.
VARIANT_SUFFIX = "+variant"
VARIANT_LABEL_SUFFIX = "+v"
# The seeds of the sink logits and of the dropout key: fixed, so that every run and every
# peer of a run computes the same thing.
SINKS_SEED = 0
DROPOUT_SEED = 0


@dataclasses.dataclass(frozen=True)
class Variant:
  """What the variant adds to each call: a logit soft cap, ALiBi slopes (geometric, one per
  head), sink logits (one per head), dropout at a rate (a fixed key), the position bias
  (differentiated with bias_grad, which needs bias) and the band mask."""

  logits_soft_cap: float | None = None
  alibi: bool = False
  sinks: bool = False
  dropout_rate: float | None = None
  bias: bool = False
  mask: bool = False
  bias_grad: bool = False

  def __post_init__(self) -> None:
    if self.bias_grad and not self.bias:
      raise ValueError("bias_grad differentiates the bias: it needs bias=True")

  def features(self) -> tuple[str, ...]:
    """The jax_flash keywords the variant sets."""
    return tuple(name for name, on in (("logits_soft_cap", self.logits_soft_cap is not None),
                                       ("alibi_slopes", self.alibi), ("sinks", self.sinks),
                                       ("dropout_rate", self.dropout_rate is not None),
                                       ("bias", self.bias), ("mask", self.mask)) if on)

  def describe(self) -> str:
    """One line for the table's caption."""
    parts = []
    if self.logits_soft_cap is not None:
      parts.append(f"logits_soft_cap={self.logits_soft_cap:g}")
    if self.alibi:
      parts.append("alibi_slopes 2^(-8h/N), h = 1..N")
    if self.sinks:
      parts.append(f"sinks: a random normal logit per head (seed {SINKS_SEED}, mean 0)")
    if self.dropout_rate is not None:
      parts.append(f"dropout_rate={self.dropout_rate:g} (key seed {DROPOUT_SEED})")
    if self.bias:
      bias = "bias: a (1, N, T, S) array sin(0.01 (i + 2j) + h), formed in the step"
      if self.bias_grad:
        bias += " and differentiated (fwd+bwd returns dbias, summed over the batch)"
      parts.append(bias)
    if self.mask:
      parts.append("mask: a (T, S) band |j - i| <= S/4 (j > i - S/4), formed in the step")
    return ", ".join(parts)

  def arrays(self, query: jax.Array, key: jax.Array) -> dict[str, jax.Array]:
    """The constant bias and mask arrays of the variant for these inputs (none where it has
    neither; not the bias with bias_grad: that one comes from differentiated_arrays)."""
    arrays = {}
    if self.bias and not self.bias_grad:
      arrays["bias"] = position_bias(query, key)
    if self.mask:
      arrays["mask"] = band_mask(query.shape[1], key.shape[1])
    return arrays

  def differentiated_arrays(self, query: jax.Array, key: jax.Array) -> dict[str, jax.Array]:
    """The arrays the fwd+bwd pass differentiates (peers.Differentiated): with bias_grad the
    position bias, the same values as arrays' constant one."""
    return {"bias": position_bias(query, key)} if self.bias_grad else {}

  def differentiated(self) -> Differentiated | None:
    """What the peers' passes form and differentiate (None: nothing, the passes as without a
    variant)."""
    return self.differentiated_arrays if self.bias_grad else None

  def flash_options(self, heads: int) -> dict[str, object]:
    """jax_flash.dot_product_attention's keywords for `heads` query heads."""
    options: dict[str, object] = {}
    if self.logits_soft_cap is not None:
      options["logits_soft_cap"] = self.logits_soft_cap
    if self.alibi:
      options["alibi_slopes"] = jnp.asarray(alibi_slopes(heads))
    if self.sinks:
      options["sinks"] = jnp.asarray(sink_logits(heads))
    if self.dropout_rate is not None:
      options.update(dropout_rate=self.dropout_rate, dropout_key=jax.random.key(DROPOUT_SEED))
    return options


def alibi_slopes(heads: int) -> np.ndarray:
  """ALiBi's geometric slopes, 2^(-8h/N) for heads h = 1..N (the paper's for N a power of 2)."""
  return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


def sink_logits(heads: int) -> np.ndarray:
  """A random normal logit per head (seed SINKS_SEED), less their mean."""
  logits = np.random.default_rng(SINKS_SEED).standard_normal(heads)
  return (logits - logits.mean()).astype(np.float32)


def alibi_bias(query: jax.Array, key: jax.Array) -> jax.Array:
  """ALiBi as the (1, N, T, S) bias array jax.nn takes: slope_h * (j - i), the query's dtype
  (formed in the step, as a jax.nn user forms it)."""
  heads, t, s = query.shape[2], query.shape[1], key.shape[1]
  distance = jnp.arange(s, dtype=jnp.float32)[None, :] - jnp.arange(t, dtype=jnp.float32)[:, None]
  slopes = jnp.asarray(alibi_slopes(heads))[:, None, None]
  return (slopes * distance)[None].astype(query.dtype)


def position_bias(query: jax.Array, key: jax.Array) -> jax.Array:
  """The --bias array: (1, N, T, S), sin(0.01 (i + 2 j) + h) in the query's dtype."""
  heads, t, s = query.shape[2], query.shape[1], key.shape[1]
  rows = jnp.arange(t, dtype=jnp.float32)[None, :, None]
  keys = jnp.arange(s, dtype=jnp.float32)[None, None, :]
  head = jnp.arange(heads, dtype=jnp.float32)[:, None, None]
  return jnp.sin(0.01 * (rows + 2 * keys) + head)[None].astype(query.dtype)


def band_mask(t: int, s: int) -> jax.Array:
  """The --mask array: (T, S) bool, key j visible to row i when i - S/4 < j <= i + S/4."""
  width = max(1, s // 4)
  distance = jnp.arange(s)[None, :] - jnp.arange(t)[:, None]
  return (distance > -width) & (distance <= width)


def _join(features: tuple[str, ...]) -> str:
  return ", ".join(features)


def _flash_attention(kernel: str, deterministic: bool, variant: Variant) -> AttentionFn:
  """jax_flash's `kernel` with the variant; the differentiated bias (bias_grad) as a keyword."""
  def attention(query: jax.Array, key: jax.Array, value: jax.Array, *, is_causal: bool,
                **differentiated: jax.Array) -> jax.Array:
    return jax_flash.dot_product_attention(query, key, value, is_causal=is_causal,
                                           implementation=kernel, deterministic=deterministic,
                                           **variant.flash_options(query.shape[2]),
                                           **variant.arrays(query, key), **differentiated)
  return attention


def _jax_nn_attention(implementation: str, variant: Variant) -> AttentionFn:
  """jax.nn.dot_product_attention with ALiBi as a bias array, and the bias and mask arrays (the
  variants it takes; the differentiated bias, bias_grad, as a keyword: its gradient flows
  through the sum with ALiBi's)."""
  def attention(query: jax.Array, key: jax.Array, value: jax.Array, *, is_causal: bool,
                **differentiated: jax.Array) -> jax.Array:
    arrays = {**variant.arrays(query, key), **differentiated}
    bias = arrays.get("bias")
    if variant.alibi:
      bias = alibi_bias(query, key) if bias is None else bias + alibi_bias(query, key)
    mask = arrays.get("mask")
    return jax.nn.dot_product_attention(query, key, value, bias=bias,
                                        mask=None if mask is None else mask[None, None],
                                        is_causal=is_causal, implementation=implementation)
  return attention


def _tokamax_attention(variant: Variant) -> AttentionFn:
  """tokamax's Mosaic attention with the soft cap and ALiBi (as a bias array), and the bias and
  mask arrays, where its dot_product_attention has such parameters, else a NotImplementedError
  naming them; the differentiated bias (bias_grad) as a keyword (a tokamax whose backward
  refuses its gradient at trace time reads unavailable: variant_peer's probe)."""
  def attention(query: jax.Array, key: jax.Array, value: jax.Array, *, is_causal: bool,
                **differentiated: jax.Array) -> jax.Array:
    import tokamax

    parameters = inspect.signature(tokamax.dot_product_attention).parameters
    options: dict[str, object] = {}
    if variant.logits_soft_cap is not None:
      options["logits_soft_cap"] = variant.logits_soft_cap
    options.update(variant.arrays(query, key), **differentiated)
    if variant.alibi:
      options["bias"] = alibi_bias(query, key) + options.get("bias", 0)
    if "mask" in options:
      options["mask"] = options["mask"][None, None]
    lacking = [name for name in options if name not in parameters]
    if lacking:
      raise NotImplementedError(f"this tokamax's dot_product_attention takes no {_join(lacking)}")
    return tokamax.dot_product_attention(query, key, value, is_causal=is_causal,
                                         implementation="mosaic", **options)
  return attention


def _variant_attention(name: str, kernel: str, deterministic: bool,
                       variant: Variant) -> AttentionFn | str:
  """Peer `name`'s attention with the variant, or why it takes none."""
  features = variant.features()
  if name == "jax_flash":
    return _flash_attention(kernel, deterministic, variant)
  if name in ("cudnn", "xla"):
    lacking = tuple(f for f in features if f not in ("alibi_slopes", "bias", "mask"))
    if lacking:
      return f"jax.nn.dot_product_attention takes no {_join(lacking)}"
    return _jax_nn_attention(name, variant)
  if name == "tokamax":
    lacking = tuple(f for f in features if f in ("sinks", "dropout_rate"))
    if lacking:
      return f"tokamax's dot_product_attention is not given {_join(lacking)} here"
    return _tokamax_attention(variant)
  who = {"pallas": "Pallas' mha", "torch": "its flash kernel (the one timed)"}.get(name, name)
  return f"{who} takes no {_join(features)}"


def variant_peer(peer: Peer, device_kind: str, kernel: str, deterministic: bool,
                 variant: Variant) -> Peer:
  """`peer` running the variant: unavailable, with the reason, where it takes none of it or
  its kernel refuses a case (at trace time, the bias's gradient too with bias_grad)."""
  name, label = peer.name + VARIANT_SUFFIX, peer.label + VARIANT_LABEL_SUFFIX
  attention = _variant_attention(peer.name, kernel, deterministic, variant)
  if isinstance(attention, str):
    reason = attention
    return Peer(name=name, label=label, unavailable=lambda: peer.unavailable() or reason,
                build=peer.build)
  differentiated = variant.differentiated()
  return jax_peer(name, label, device_kind, attention, peer.unavailable,
                  lambda case: peer.case_unavailable(case) or trace_refusal(
                      attention, case, differentiated=differentiated),
                  differentiated=differentiated)


def with_variant(platform: Platform, variant: Variant, deterministic: bool = False) -> Platform:
  """The platform for a variant run: the plain jax_flash, then every peer with the variant;
  its table keeps the platform's case columns and, for the variant peers, the rate, ratio and
  memory columns the platform has for their plain selves, with jax_flash's plain rate and the
  variant's time over the plain one's after jax_flash's variant rate."""
  kernel = FLASH_KERNELS[platform.name]
  plain, *others = platform.peers
  flash = variant_peer(plain, platform.device_kind, kernel, deterministic, variant)
  others = [variant_peer(p, platform.device_kind, kernel, deterministic, variant)
            for p in others]

  def base(peer: Peer) -> Peer:
    return next(p for p in platform.peers if p.name + VARIANT_SUFFIX == peer.name)

  columns = beside_baseline(platform, plain, flash, others, "variant/plain time", base)
  return dataclasses.replace(platform, peers=(plain, flash, *others), columns=columns)


def variant_caption(variant: Variant) -> str:
  """The caption line of a variant run."""
  return f"variant (jax_flash+variant, and each peer that takes it): {variant.describe()}"
