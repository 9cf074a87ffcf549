"""Trace-time checks of the arguments themselves (shapes, dtypes, values), whichever
implementation runs; every message names the argument and the shapes involved. What an
implementation supports is checked in jax_flash._dispatch."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._block_sparse import BLOCK_MASK_BLOCK, block_mask_shape

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_qkv(query: jax.Array, key: jax.Array, value: jax.Array, *,
              any_batch_dims: bool = False) -> None:
  """Shapes and dtypes of query, key and value, each error naming the three shapes: rank 4
  (B, T|S, N|K, H) or rank 3, or with `any_batch_dims` any number of batch dims in front (the
  caller checks those ranks), then the same batch dims, head dim, dtype; N a multiple of K.
  The value's head dim Hv may differ from the query's and key's H (MLA-style attention: the
  output then has Hv); value has key's shape otherwise."""
  shapes = f"query{query.shape}, key{key.shape}, value{value.shape}"
  if not any_batch_dims and (query.ndim not in (3, 4) or key.ndim != query.ndim
                             or value.ndim != query.ndim):
    raise ValueError(
        "query, key and value must all be rank 4 (B, T|S, N|K, H) or all rank 3 (T|S, N|K, H); "
        f"got {shapes}")
  if key.shape[:-1] != value.shape[:-1] or key.ndim != value.ndim:
    raise ValueError("key and value must have the same shape but for the head dim (value's Hv "
                     f"may differ from key's H); got {shapes}")
  if query.shape[:-3] != key.shape[:-3]:
    raise ValueError(f"query and key must have the same batch size; got {shapes}")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"query and key must have the same head dim H; got {shapes}")
  if query.shape[-1] == 0:
    raise ValueError(f"the head dim H=0: query, key and value need H >= 1; got {shapes}")
  if value.shape[-1] == 0:
    raise ValueError(f"the value head dim Hv=0: value needs Hv >= 1; got {shapes}")
  heads_q, heads_k = query.shape[-2], key.shape[-2]
  if heads_k == 0 or heads_q % heads_k != 0:
    raise ValueError(
        f"the number of query heads N={heads_q} must be a multiple of the number of key/value "
        f"heads K={heads_k}; got {shapes}")
  dtypes = {query.dtype, key.dtype, value.dtype}
  if len(dtypes) != 1:
    raise ValueError(
        f"query, key and value must share one dtype; got query {query.dtype}, key {key.dtype}, "
        f"value {value.dtype}")
  if query.dtype not in SUPPORTED_DTYPES:
    raise ValueError(
        f"query, key and value must be float32, bfloat16 or float16; got {query.dtype}")


def check_seq_lengths(name: str, lengths, batch: int, full: int) -> jax.Array | None:
  """The lengths as int32 (the dtype jax.nn takes, and the only one: a narrower integer would
  wrap when compared with positions past its range, a wider one when cast); values past the
  sequence mean all of it."""
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape ({batch},) (one length per batch element); "
                     f"got {lengths.shape}")
  _require_int32(name, lengths, ", as jax.nn takes it")
  return jnp.clip(lengths, 0, full)


def _require_int32(name: str, array: jax.Array, why: str = "") -> None:
  """Raises unless `array` is int32, naming it and the cast to make (never cast silently: a
  wider integer could wrap)."""
  if array.dtype != jnp.int32:
    advice = (" (cast it with .astype(jnp.int32))"
              if jnp.issubdtype(array.dtype, jnp.integer) else "")
    raise ValueError(f"{name} must be an integer array of dtype int32{why}; got {array.dtype} "
                     f"({name}{array.shape}){advice}")


def check_segment_ids(q_segment_ids, kv_segment_ids, batch: int, seq_q: int, seq_k: int,
                      unbatched: bool) -> tuple[jax.Array, jax.Array] | None:
  """The segment ids as int32 arrays (B, T) and (B, S) (rank-3 calls pass (T,) and (S,), given
  a leading batch of 1 here), or None when neither is given. Both or neither: one alone raises.
  int32 only, as the sequence lengths: another integer dtype raises with the cast to make (a
  wider one could wrap two ids into one when cast, so it is never cast silently)."""
  if q_segment_ids is None and kv_segment_ids is None:
    return None
  if q_segment_ids is None or kv_segment_ids is None:
    given, missing = (("q_segment_ids", "kv_segment_ids") if kv_segment_ids is None else
                      ("kv_segment_ids", "q_segment_ids"))
    raise ValueError(f"{given} was given without {missing}: pass both (a query attends a key "
                     "only where their ids are equal; for self-attention over packed documents "
                     "pass the same ids as both)")
  out = []
  for name, ids, seq in (("q_segment_ids", q_segment_ids, seq_q),
                         ("kv_segment_ids", kv_segment_ids, seq_k)):
    ids = jnp.asarray(ids)
    axis = "T" if name[0] == "q" else "S"
    want = (seq,) if unbatched else (batch, seq)
    if ids.shape != want:
      form = f"({axis},)" if unbatched else f"(B, {axis})"
      raise ValueError(f"{name} must have shape {form} = {want} (one id per "
                       f"{'query' if name[0] == 'q' else 'key'} position); got {name}{ids.shape}")
    _require_int32(name, ids)
    out.append(ids[None] if unbatched else ids)
  return out[0], out[1]


def check_logit_array(name: str, x, batch: int, heads: int, seq_q: int,
                      seq_k: int) -> jax.Array | None:
  """`bias` or `mask` as a rank-4 array broadcastable to the scores (B, N, T, S), as jax.nn takes
  them: fewer dims gain leading ones, and each dim is 1 or the full size (the mask must be bool;
  a bias of any float dtype is added in float32)."""
  if x is None:
    return None
  x = jnp.asarray(x)
  given, want = x.shape, (batch, heads, seq_q, seq_k)
  if x.ndim > 4:
    raise ValueError(f"{name} must have at most 4 dims, broadcastable to (B, N, T, S) = {want}; "
                     f"got {name}{given}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if any(d not in (1, w) for d, w in zip(x.shape, want)):
    raise ValueError(f"{name} must be broadcastable to (B, N, T, S) = {want} (each dim 1 or "
                     f"that size, leading dims 1 if left out); got {name}{given}")
  if name == "mask" and x.dtype != jnp.bool_:
    raise ValueError(f"mask must be a bool array (True: attend), as in jax.nn; got {x.dtype}")
  if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"bias must be a float array; got {x.dtype}")
  return x


def check_window(local_window_size, reach: int) -> tuple[int, int] | None:
  """(left, right), each at most `reach` (T + S: a wider window masks nothing more, and the
  kernels' index arithmetic stays far from overflow)."""
  if local_window_size is None:
    return None
  window = local_window_size
  if isinstance(window, numbers.Integral):
    window = (window, window)
  if (not isinstance(window, (tuple, list)) or len(window) != 2
      or not all(isinstance(w, numbers.Integral) for w in window)):
    raise ValueError("local_window_size must be an int or a (left, right) pair of ints; got "
                     f"{local_window_size!r}")
  left, right = int(window[0]), int(window[1])
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size must be >= 0 on both sides; got {(left, right)} "
                     "(0 means the query's own position only)")
  return min(left, reach), min(right, reach)


_LOG2E = np.float32(np.log2(np.e))


def _scale_fits_float32(value: float) -> bool:
  """Whether `value` is a finite float32 whose float32 product with log2(e) is finite: the
  kernels take the scale as a float32 and form scale * log2(e) (exp2 in place of exp)."""
  with np.errstate(over="ignore"):
    scale32 = np.float32(abs(value))
    return bool(np.isfinite(scale32) and np.isfinite(scale32 * _LOG2E))


def check_logits_soft_cap(cap) -> float | None:
  """logits_soft_cap as a Python float, or None for no cap. It must be a concrete real number
  (not an array or a traced value: it is a static setting of the call), finite and > 0, and,
  as the kernels take it, a normal float32 whose product with log2(e) is finite (about
  1.1755e-38 <= c <= 2.3587e38)."""
  if cap is None:
    return None
  if isinstance(cap, (bool, np.bool_)) or not isinstance(cap, numbers.Real):
    raise ValueError("logits_soft_cap must be a positive Python float (a static setting, not an "
                     f"array or traced value) or None; got {cap!r}")
  value = float(cap)
  if not (np.isfinite(value) and value > 0):
    raise ValueError(f"logits_soft_cap must be finite and > 0 (or None for no cap); got {value!r}")
  if not (np.float32(value) >= np.finfo(np.float32).tiny and _scale_fits_float32(value)):
    raise ValueError(
        "logits_soft_cap must be a normal float32 whose product with log2(e) is finite, which the "
        f"kernels form (about 1.1755e-38 to 2.3587e38); got {value!r}")
  return value


def _per_head_floats(value, name: str, each: str, heads_q: int, query_shape) -> jax.Array:
  """`value` as a float32, bfloat16 or float16 array of shape exactly (N,), one `each` (e.g.
  "logit") per query head: no broadcasting, a scalar or a (1,) array raises too; errors name
  `name`. Its values are not checked (they may be traced)."""
  try:
    value = jnp.asarray(value)
  except TypeError as error:
    raise ValueError(f"{name} must be a float array of shape ({heads_q},) (one {each} per query "
                     f"head) or None; got {value!r}") from error
  if value.shape != (heads_q,):
    raise ValueError(
        f"{name} must have shape ({heads_q},): one {each} per query head N={heads_q} of "
        f"query{tuple(query_shape)} (no broadcasting); got {name}{value.shape}")
  if value.dtype not in SUPPORTED_DTYPES:
    raise ValueError(
        f"{name} must be float32, bfloat16 or float16 (shape ({heads_q},)); got {value.dtype} "
        f"{name}{value.shape}")
  return value


def check_sinks(sinks, heads_q: int, query_shape) -> jax.Array | None:
  """The attention sinks as an array of shape (N,), or None. One logit per query head, a
  floating-point array (float32, bfloat16 or float16; computed in float32, its gradient given
  back in its dtype) of shape exactly (N,): no broadcasting, a scalar or a (1,) array raises
  too. Its values are not checked (they may be traced)."""
  if sinks is None:
    return None
  return _per_head_floats(sinks, "sinks", "logit", heads_q, query_shape)


def check_alibi_slopes(slopes, heads_q: int, query_shape) -> jax.Array | None:
  """The ALiBi slopes as a float32 array of shape (N,), or None. One slope per query head, a
  floating-point array (float32, bfloat16 or float16; cast to float32, which every path
  computes in) of shape exactly (N,): no broadcasting, a scalar or a (1,) array raises too. Not
  differentiated: returned under stop_gradient. Its values are not checked (they may be
  traced); a NaN or inf slope gives NaN scores, as the same bias added by hand would."""
  if slopes is None:
    return None
  slopes = _per_head_floats(slopes, "alibi_slopes", "slope", heads_q, query_shape)
  return jax.lax.stop_gradient(slopes.astype(jnp.float32))


def check_dropout_rate(rate) -> float | None:
  """dropout_rate as a Python float in (0, 1), or None for no dropout (a rate of 0). It must be a
  concrete real number (not an array or a traced value: it is a static setting of the call, as
  the kernels' threshold and scale are), 0 <= rate < 1."""
  if isinstance(rate, (bool, np.bool_)) or not isinstance(rate, numbers.Real):
    raise ValueError("dropout_rate must be a Python float in [0, 1) (a static setting, not an "
                     f"array or traced value); got {rate!r}")
  value = float(rate)
  if not 0.0 <= value < 1.0:  # NaN fails too
    raise ValueError(f"dropout_rate must be in [0, 1); got {value!r}")
  return value or None


def check_dropout_key(key, rate: float | None) -> jax.Array | None:
  """dropout_key as one JAX PRNG key (a typed key whose data is two uint32 words, the default
  threefry2x32's, or a raw uint32[2] key as jax.random.PRNGKey gives), or None. Required when
  `rate` (check_dropout_rate's) is not None; checked whenever given. Its values may be
  traced."""
  if key is None:
    if rate is not None:
      raise ValueError(
          f"dropout_rate={rate!r} needs a dropout_key: a JAX PRNG key (jax.random.key(seed) or "
          "jax.random.PRNGKey(seed)) from which the dropout mask is drawn; got dropout_key=None")
    return None
  what = ("dropout_key must be one JAX PRNG key: a typed key of the threefry2x32 "
          "implementation (jax.random.key) or a raw uint32 key of shape (2,) "
          "(jax.random.PRNGKey)")
  try:
    key = jnp.asarray(key) if not hasattr(key, "dtype") else key
  except TypeError as error:
    raise ValueError(f"{what}; got {key!r}") from error
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(key)
    if key.shape != () or data.shape != (2,) or data.dtype != jnp.uint32:
      raise ValueError(f"{what}; got a typed key array of shape {key.shape} ({key.dtype}) whose "
                       f"data is {data.dtype}{data.shape}")
  elif key.shape != (2,) or key.dtype != jnp.uint32:
    raise ValueError(f"{what}; got dropout_key{key.shape} {key.dtype}")
  return key


def check_block_mask(block_mask, batch: int, heads_q: int, seq_q: int, seq_k: int,
                     unbatched: bool, query_shape, key_shape) -> jax.Array | None:
  """The block-sparse mask as a rank-4 bool array (B|1, N|1, Tb, Sb), or None.
  (Tb, Sb) = jax_flash.block_mask_shape(T, S): blocks of jax_flash.BLOCK_MASK_BLOCK. It must
  be bool and broadcastable to (B, N, Tb, Sb) ((N, Tb, Sb) for rank-3 inputs): fewer dims gain
  leading ones, each of B and N is 1 or full, Tb and Sb are exact. Its values are not checked
  (they may be traced)."""
  if block_mask is None:
    return None
  blocks = block_mask_shape(seq_q, seq_k)
  target = (heads_q, *blocks) if unbatched else (batch, heads_q, *blocks)
  what = (f"block_mask must be a bool array broadcastable to {target} (query and key blocks of "
          f"{BLOCK_MASK_BLOCK[0]} x {BLOCK_MASK_BLOCK[1]}, jax_flash.BLOCK_MASK_BLOCK, for "
          f"query{tuple(query_shape)} and key{tuple(key_shape)})")
  try:
    block_mask = jnp.asarray(block_mask)
  except TypeError as error:
    raise ValueError(f"{what}; got {block_mask!r}") from error
  if block_mask.dtype != jnp.bool_:
    raise ValueError(f"{what}; got {block_mask.dtype} block_mask{block_mask.shape}")
  shape = block_mask.shape
  fits = (2 <= len(shape) <= len(target) and shape[-2:] == tuple(blocks) and
          all(have in (1, want) for have, want in zip(shape[::-1][2:], target[::-1][2:])))
  if not fits:
    raise ValueError(f"{what}; got block_mask{shape}")
  return block_mask.reshape((1,) * (4 - len(shape)) + shape)


def check_scale(scale, head_dim: int) -> float:
  """The logit scale as a Python float; 1 / sqrt(H) for None. Every path computes in float32 and
  the kernels multiply the scale by log2(e): both must stay finite (1e39 is a finite double but
  inf in float32, which would give NaN or zeros everywhere)."""
  if scale is None:
    return 1.0 / float(np.sqrt(head_dim))
  try:
    value = float(scale)
  except jax.errors.ConcretizationTypeError as e:
    raise ValueError("scale must be a concrete Python number, not a traced value") from e
  except (TypeError, ValueError) as e:
    raise ValueError(f"scale must be a real number; got {scale!r}") from e
  if not np.isfinite(value):
    raise ValueError(f"scale must be finite; got {value}")
  if not _scale_fits_float32(value):
    raise ValueError(
        f"scale must be finite in float32, and so must scale * log2(e), which the kernels "
        f"form (|scale| up to about 2.3587e38); got {value!r}")
  return value
