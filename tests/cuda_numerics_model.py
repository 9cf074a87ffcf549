"""A numpy model of the CUDA kernels' arithmetic (forward + backward), run on the differential
harness's configurations, to explain the 16-bit dq/dk misses of the H200 run and to try fixes.

Why: the seeded differential test (tests/differential.py) passes on the CPU kernel but the CUDA
kernels miss the 2x-jax.nn rule on dq/dk for 47 of the first 300 configurations of seed 0
(examples/results/h200/session9/differential_bulkdq_splitkv.log). Nothing CUDA runs here, so this
file reproduces the kernels' rounding points in float64 numpy with explicit rounding to float32
and to the 16-bit input dtype (ml_dtypes, through jax), feeds it the harness's exact inputs
(draw_config / Config.inputs are imported, not copied) and holds it to the same rule against the
same references (reference_f32, reference_in_dtype, compare).

What is modelled (the sm90 warp-specialised forward and the sm90/sm80 backward share it; the sm80
forward differs only in its key block (64) and warp rows (32), both modelled):

forward (sm90/flash_fwd_ws_kernel.cuh, sm80/flash_fwd_kernel.cuh, gpu/softmax.cuh, epilogue.cuh)
  - the scale made positive outside the kernels (q -> -q, or q * 0 with scale 1: _ops.py);
  - S = Q K^T on the tensor cores: 16-bit products exact, float32 accumulation (k-chunks of 16
    summed exactly, then added to a float32 accumulator);
  - key blocks visited last first (128 keys, 64 past head dim 128 and on sm80), masked scores
    -inf; the online softmax in base 2 with LAZY rescaling: a warp's rows (16 on sm90, 32 on
    sm80 up to head dim 128) keep a reference maximum that moves only when some row of the warp
    grows by more than 2^8, so P = exp2(S*c - ref*c) (c = scale*log2e in float32, one FFMA) is
    in (0, 256], not in (0, 1];
  - P rounded to the input dtype (round to nearest) for O += P~ V (tensor cores, float32);
  - the row sum l of the UNROUNDED float32 P;
  - O = acc * (1/l) in float32; lse = max*scale + log(l) (one FFMA), natural log, float32;
  - the output rounded to the input dtype (also the residual the backward reads: CUDA keeps o in
    16 bits, _ops.for_backward).
backward (sm90/bwd_steps.cuh, sm80/flash_bwd_kernel.cuh, gpu/bwd_postprocess.cuh)
  - delta D = sum_h O_h dO_h in float32: until session 16 the prepare kernel's (each thread 8
    elements at a time, FFMA chain, then a butterfly of shuffles: delta_prepare), since then
    XLA's reduction beside the call (another float32 order; delta_prepare stands in for it);
  - P = exp2(min(S*c - lse*log2e, 0)) in float32 (unrounded); dP = dO V^T on the tensor cores;
  - dS = (scale * P) * (dP - D) in float32, then ROUNDED to the input dtype for both dK = dS^T Q
    and dQ = dS K; dV = P~^T dO with P rounded; float32 accumulation, one final rounding of dq,
    dk, dv to the input dtype.

What is not bit-exact: the tensor cores' internal summation (modelled as exact per 16-product
chunk), exp2/log (ex2.approx: modelled exact, then rounded to float32), the order of the float32
row sums. Those are float32-level effects; every effect this model is used for is 16-bit-level,
except the single-key rows (dS = 0 in exact arithmetic), which it reproduces in kind (D and dP
summed in different orders) but not bit for bit.

Fixes (``--fix NAME``; see FIXES): where D comes from, how O is normalised, what is rounded.
The findings (on seed 0, 0-599) and the recommended kernel change are in
examples/results/h200/session9/differential_cuda_analysis.md: the model reproduces the H200
run's misses (46 of 47, ratios to two decimals); the recommendation is hilo8_lsum_split32_1key.

Command line:
  python tests/cuda_numerics_model.py --index 12 [--fix NAME ...]   one configuration, per fix
  python tests/cuda_numerics_model.py --configs 300 --fix all       the table of the report
  (--seed, --dtypes as the harness; --log the GPU log whose misses are "the GPU's", default the
  session-9 log; --json PATH writes per-configuration ratios.)

Not a pytest module (no test_ prefix): it is a tool. Running it on 300 configurations takes about
5-10 minutes on 2 cores (the float32 reference is compiled by XLA per configuration).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import differential as dh  # noqa: E402  (the harness: configurations, inputs, references, rule)
from attention_testing import DTYPES, EMPTY_ROW_LSE  # noqa: E402

LOG2E = np.float32(1.4426950408889634)
RESCALE_LOG2 = 8.0
DEFAULT_LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "results",
                           "h200", "session9", "differential_bulkdq_splitkv.log")
SM80_HEAD_DIMS = (32, 64, 128, 192, 256)


# ---------------------------------------------------------------------------------------------
# Rounding helpers (float64 arrays carrying float32 / 16-bit values)


def f32(x):
  with np.errstate(over="ignore"):  # values np.where discards (EMPTY_ROW_LSE * log2e)
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def rounder(dtype_name: str):
  """x -> x rounded to nearest in the 16-bit dtype (as MmaOp<T>::pack / cvt.rn), as float64."""
  dt = np.dtype(DTYPES[dtype_name])

  def rnd(x):
    with np.errstate(over="ignore"):
      return np.asarray(x, np.float64).astype(np.float32).astype(dt).astype(np.float64)

  return rnd


def tc_matmul(subscripts: str, a: np.ndarray, b: np.ndarray, axis_a: int, axis_b: int,
              chunk: int = 16) -> np.ndarray:
  """A tensor-core product: exact products, each k-chunk of `chunk` summed exactly (float64),
  the chunks added in order to a float32 accumulator. a, b: float64 arrays of 16-bit values;
  axis_a/axis_b: their contracted axes."""
  n = a.shape[axis_a]
  acc = None
  for k0 in range(0, max(n, 1), chunk):
    part = np.einsum(subscripts, np.take(a, range(k0, min(n, k0 + chunk)), axis=axis_a),
                     np.take(b, range(k0, min(n, k0 + chunk)), axis=axis_b), optimize=True)
    acc = f32(part) if acc is None else f32(acc + part)
  return acc


# ---------------------------------------------------------------------------------------------
# Fixes


@dataclasses.dataclass(frozen=True)
class Fix:
  """One variant of the kernels' arithmetic."""

  name: str
  doc: str
  o_residual: str = "16"  # what D is formed from: "16" (o rounded), "32" (float32 o), "hilo"
  #   (o rounded + its rounding error rounded to 16 bits: 16 more bits a value), "hilo8" (o
  #   rounded + its rounding error in units of 1/256 of o's 16-bit ulp, an int8), "exact"
  #   (D = sum_j P_j dP_j, the consistent D of a two-pass backward: diagnostic)
  sum_rounded: bool = False  # the forward normalises O by the sum of the ROUNDED probabilities
  lse_rounded: bool = False  # ... and lse = max + log of that sum too (the returned lse too)
  lse_bwd_rounded: bool = False  # the backward's P from max + log(sum of the rounded P), a second
  #   per-row float the forward writes; the returned lse stays max + log(l) (float32-accurate)
  round_ds: bool = True  # dS rounded to 16 bits before dQ, dK (False: float32 dS, diagnostic)
  split_ds_head_dim: int = 0  # compiled head dims up to this carry dS as hi + lo (two 16-bit
  #   operands, two products each for dQ and dK: float32-accurate dS) instead of one rounding
  round_p_dv: bool = True  # P rounded to 16 bits for dV (always, as the kernels)
  split_ds_narrow_keys: int = 0  # calls whose rows see at most this many keys by their shape
  #   and window alone (static_keys_per_row) carry dS as hi + lo at every head dim (the host
  #   routes them to the sm80 backward with the split, cuda/gpu/launch.cu)
  split_p_narrow_keys: int = 0  # such calls' forwards multiply V by P as hi + lo too (two
  #   products), so that O's weights are P's to about 16 bits, not P rounded once (cause 2)
  narrow_scores: int = 0  # calls of at most this many scores a head (seq_q * seq_k) count as
  #   narrow too: small problems, where the split costs nothing that matters
  narrow_o32: bool = False  # narrow calls keep the float32 o for delta (not o16 + int8)
  zero_single_key_ds: bool = False  # dS = 0 on rows whose mask leaves exactly one key (exact:
  #   P = 1 there), a per-row multiplier the backward's producer derives from key_range
  d_order_tc: bool = False  # D summed as the tensor cores sum dP (16-element chunks)
  int_ref: bool = False  # the forward's reference maximum rounded down to an integer in log2
  #   units, so every rescaling is an exact power of two and the rounded P the forward
  #   multiplied V by is r16(exp2(S c - R)) for the final R, whatever the visiting order
  bwd_rounded_p: bool = False  # the backward recomputes those rounded P (R and the rounded sum
  #   stored per row) and uses w = r16(exp2(S c - R)) / l~ in dS and dV: the forward's own weights


FIXES = {f.name: f for f in [
    Fix("none", "the kernels as they are: D from o rounded to 16 bits"),
    Fix("o32", "D from the float32 o (e0678b3's recipe, reverted on CUDA by a4fc541)",
        o_residual="32"),
    Fix("o16_lsum", "o normalised by the sum of the rounded P, still kept in 16 bits",
        sum_rounded=True),
    Fix("o32_lsum", "D from the float32 o normalised by the sum of the rounded P (lse unchanged)",
        o_residual="32", sum_rounded=True),
    Fix("o32_lsum_lse", "as o32_lsum, and lse from the rounded sum too", o_residual="32",
        sum_rounded=True, lse_rounded=True),
    Fix("o32_lsum_lseb", "D from the float32 o normalised by the sum of the rounded P, the "
        "backward's P normalised by that sum too (second lse)", o_residual="32", sum_rounded=True,
        lse_bwd_rounded=True),
    Fix("o16_lsum_lseb", "as o32_lsum_lseb but o kept in 16 bits", sum_rounded=True,
        lse_bwd_rounded=True),
    Fix("hilo", "D from o + its 16-bit rounding error (two 16-bit residuals)", o_residual="hilo"),
    Fix("hilo_lsum", "hilo with o normalised by the sum of the rounded P", o_residual="hilo",
        sum_rounded=True),
    Fix("hilo_lsum_lseb", "hilo with o32_lsum_lseb's normalisation", o_residual="hilo",
        sum_rounded=True, lse_bwd_rounded=True),
    Fix("hilo8_lsum_lseb", "o32_lsum_lseb with o as 16 bits + an int8 of its rounding error",
        o_residual="hilo8", sum_rounded=True, lse_bwd_rounded=True),
    Fix("pfwd_o32", "the backward uses the forward's rounded, normalised P (integer reference R, "
        "l~ = sum of the rounded P, both stored per row); D from the float32 o", o_residual="32",
        sum_rounded=True, int_ref=True, bwd_rounded_p=True),
    Fix("pfwd_hilo8", "pfwd_o32 with o as 16 bits + an int8 of its rounding error",
        o_residual="hilo8", sum_rounded=True, int_ref=True, bwd_rounded_p=True),
    Fix("pfwd_o16", "pfwd_o32 with o kept in 16 bits", sum_rounded=True, int_ref=True,
        bwd_rounded_p=True),
    Fix("hilo8_lsum", "o32_lsum with o as 16 bits + an int8 of its rounding error",
        o_residual="hilo8", sum_rounded=True),
    Fix("hilo8_lsum_split32", "hilo8_lsum, and dS split in hi + lo on the head-dim-32 (sm80) "
        "kernels", o_residual="hilo8", sum_rounded=True, split_ds_head_dim=32),
    Fix("pfwd_hilo8_split32", "pfwd_hilo8, and dS split in hi + lo on the head-dim-32 (sm80) "
        "kernels", o_residual="hilo8", sum_rounded=True, int_ref=True, bwd_rounded_p=True,
        split_ds_head_dim=32),
    Fix("hilo8_lsum_split32_1key", "hilo8_lsum_split32, and dS = 0 on single-key rows "
        "(the recommendation)", o_residual="hilo8", sum_rounded=True, split_ds_head_dim=32,
        zero_single_key_ds=True),
    Fix("hilo8_lsum_split_narrow_1key", "hilo8_lsum_split32_1key, and dS as hi + lo at every "
        "head dim on calls whose rows see at most 64 keys by shape and window", o_residual="hilo8", sum_rounded=True, split_ds_head_dim=32,
        split_ds_narrow_keys=64, zero_single_key_ds=True),
    Fix("hilo8_lsum_split_narrow_p_1key", "hilo8_lsum_split32_1key, and calls whose rows see at "
        "most 16 keys by shape and window with P (forward) and dS as hi + lo at every head dim", o_residual="hilo8", sum_rounded=True,
        split_ds_head_dim=32, split_ds_narrow_keys=16, split_p_narrow_keys=16,
        zero_single_key_ds=True),
    Fix("hilo8_lsum_split_small_p_1key", "hilo8_lsum_split_narrow_p_1key, and calls of at most "
        "64 x 64 scores a head (rows times their keys' bound) narrow too", o_residual="hilo8",
        sum_rounded=True, split_ds_head_dim=32, split_ds_narrow_keys=16, split_p_narrow_keys=16,
        narrow_scores=64 * 64, zero_single_key_ds=True),
    Fix("hilo8_lsum_split_small_o32_1key", "hilo8_lsum_split_small_p_1key, and the narrow calls' "
        "delta from the float32 o (the kernels since session 17)", o_residual="hilo8",
        sum_rounded=True, split_ds_head_dim=32, split_ds_narrow_keys=16, split_p_narrow_keys=16,
        narrow_scores=64 * 64, narrow_o32=True, zero_single_key_ds=True),
    Fix("hilo8_lsum_1key", "hilo8_lsum, and dS = 0 on single-key rows", o_residual="hilo8",
        sum_rounded=True, zero_single_key_ds=True),
    Fix("none_1key", "the kernels as they are, and dS = 0 on single-key rows",
        zero_single_key_ds=True),
    Fix("o32_lsum_tcd", "o32_lsum with D summed in the tensor cores' chunk order",
        o_residual="32", sum_rounded=True, d_order_tc=True),
    Fix("exact_d", "diagnostic: the consistent D = sum_j P_j dP_j (needs a second pass)",
        o_residual="exact"),
    Fix("ds32", "diagnostic: current D, dS kept in float32 for dQ and dK", round_ds=False),
    Fix("o32_lsum_ds32", "diagnostic: o32_lsum and dS in float32", o_residual="32",
        sum_rounded=True, round_ds=False),
    Fix("exact_d_ds32", "diagnostic: consistent D and float32 dS", o_residual="exact",
        round_ds=False),
]}


# ---------------------------------------------------------------------------------------------
# The model


def static_keys_per_row(config: dh.Config) -> int:
  """The most keys a query row can see by the call's shape and window alone (lengths are device
  data the launch does not read): cuda/common/attention_params.h keys_per_row_bound."""
  window = config.window
  left, right = (window, window) if isinstance(window, int) else (window or (None, None))
  bound = config.seq_k
  if config.is_causal:
    right = 0 if right is None else min(right, 0)
    bound = min(bound, max(config.seq_q, 1))  # row i sees keys <= i
  if left is not None and right is not None:
    bound = min(bound, left + right + 1)
  return bound


def narrow_call(config: dh.Config, keys: int, scores: int) -> bool:
  """Whether the kernels take `config` as narrow: rows of at most `keys` keys by shape, causal mask
  and window, or at most `scores` such scores a head (seq_q times that bound;
  cuda/gpu/score_mods.cuh narrow_plain_call)."""
  bound = static_keys_per_row(config)
  return bound <= keys or config.seq_q * bound <= scores


def compiled_head_dim(head_dim: int) -> int:
  padded = head_dim + (-head_dim % 8)
  for d in SM80_HEAD_DIMS:
    if padded <= d:
      return d
  raise ValueError(head_dim)


def kernel_shape(head_dim: int) -> tuple[int, int]:
  """(keys a forward block, query rows a warp) of the forward the CUDA dispatch runs."""
  kd = compiled_head_dim(head_dim)
  if kd == 32:  # sm80 forward (no Hopper instantiation at 32): 64 keys, kMTiles 2 = 32 rows
    return 64, 32
  return (128 if kd <= 128 else 64), 16  # sm90 warp-specialised forward


def prepare_threads_per_row(head_dim: int) -> int:
  t = 1
  while t < 32 and t * 8 < head_dim:
    t *= 2
  return t


def delta_prepare(o: np.ndarray, do: np.ndarray, compiled_dim: int) -> np.ndarray:
  """The former flash_bwd_prepare_kernel's D (a float32 order standing in for XLA's reduction,
  which forms D now): per thread, FFMA over its 8-element groups, then a butterfly.
  o, do: (..., H) float64 carrying float32 values."""
  h = o.shape[-1]
  threads = prepare_threads_per_row(compiled_dim)
  partial = []
  for t in range(threads):
    s = np.zeros(o.shape[:-1])
    for c in range(t * 8, h, threads * 8):
      for e in range(c, min(c + 8, h)):
        s = f32(s + o[..., e] * do[..., e])  # FFMA: exact product, one rounding
    partial.append(s)
  offset = threads // 2
  while offset > 0:
    partial = [f32(partial[t] + partial[t ^ offset]) for t in range(threads)]
    offset //= 2
  return partial[0]


def ulp16(x: np.ndarray, dtype_name: str) -> np.ndarray:
  """The spacing of the 16-bit dtype at |x| (x holding 16-bit values), subnormals included."""
  mant, tiny = (7, -133) if dtype_name == "bfloat16" else (10, -24)
  with np.errstate(divide="ignore"):
    e = np.floor(np.log2(np.abs(x)))
  e = np.where(np.isfinite(e), e, -1000)
  return np.exp2(np.maximum(e - mant, tiny))


def int8_residual(err: np.ndarray, hi: np.ndarray, dtype_name: str) -> np.ndarray:
  """err (|err| <= half an ulp of hi) kept as an int8 count of ulp(hi)/256: what an 8-bit
  correction beside the 16-bit o carries (the decode: hi + k * ulp(hi) / 256)."""
  unit = ulp16(hi, dtype_name) / 256.0
  k = np.clip(np.round(err / unit), -128, 127)
  return k * unit


def delta_tc_order(o: np.ndarray, do: np.ndarray) -> np.ndarray:
  """D summed as the tensor cores sum dP: exact 16-element chunks added to a float32 sum."""
  h = o.shape[-1]
  acc = np.zeros(o.shape[:-1])
  for k0 in range(0, h, 16):
    acc = f32(acc + np.sum(o[..., k0:k0 + 16] * do[..., k0:k0 + 16], axis=-1))
  return acc


def model(config: dh.Config, inputs, fix: Fix) -> dict[str, np.ndarray]:
  """The CUDA kernels' out, lse, dq, dk, dv for `config` under `fix`, batched, float64."""
  rnd = rounder(config.dtype)
  q, k, v, g = (np.asarray(x, np.float32).astype(np.float64) for x in inputs)
  if config.unbatched:
    q, k, v, g = (x[None] for x in (q, k, v, g))
  scale = 1.0 / math.sqrt(config.head_dim) if config.scale is None else config.scale
  sign = 1.0
  if abs(np.float32(scale)) < np.finfo(np.float32).tiny:
    q, scale, sign = q * 0.0, 1.0, 0.0
  elif scale < 0:
    q, scale, sign = -q, -scale, -1.0
  scale = float(np.float32(scale))
  c = float(np.float32(np.float32(scale) * LOG2E))
  batch, seq_q, heads_q, hd = q.shape
  seq_k, heads_k = k.shape[1], k.shape[2]
  group = heads_q // heads_k
  kd = compiled_head_dim(hd)
  block_n, warp_rows = kernel_shape(hd)
  vis = config.visibility()  # (B, T, S)
  # (B, K, G, T, H) queries and cotangent; (B, K, S, H) keys and values.
  qg = q.reshape(batch, seq_q, heads_k, group, hd).transpose(0, 2, 3, 1, 4)
  gg = g.reshape(batch, seq_q, heads_k, group, hd).transpose(0, 2, 3, 1, 4)
  kk = k.transpose(0, 2, 1, 3)
  vv = v.transpose(0, 2, 1, 3)
  mask = vis[:, None, None]  # (B, 1, 1, T, S)
  live = vis.any(-1)[:, None, None]  # (B, 1, 1, T)

  # ---- forward
  s = tc_matmul("bkgth,bksh->bkgts", qg, kk, 4, 3)
  s = np.where(mask, s, -np.inf)
  shape_rows = s.shape[:-1]
  ref = np.full(shape_rows, -np.inf)
  l_sum = np.zeros(shape_rows)
  l_rounded = np.zeros(shape_rows)
  acc = np.zeros(shape_rows + (hd,))
  blocks = list(range(0, max(seq_k, 1), block_n))[::-1]
  warp_of_row = np.arange(seq_q) // warp_rows
  n_warps = int(warp_of_row.max()) + 1 if seq_q else 0
  for n0 in blocks:
    sb = s[..., n0:n0 + block_n]
    if sb.shape[-1] == 0:
      continue
    with np.errstate(invalid="ignore"):
      tile_max = sb.max(-1)
      new = np.fmax(ref, tile_max)
      grow = np.where(ref == -np.inf, new != -np.inf, (new - ref) * c > RESCALE_LOG2)
    # the warp votes: any row of it growing moves all its rows
    move = np.zeros_like(grow)
    for w in range(n_warps):
      rows = warp_of_row == w
      any_w = grow[..., rows].any(-1, keepdims=True)
      move[..., rows] = np.broadcast_to(any_w, move[..., rows].shape)
    base_new = np.where(new == -np.inf, 0.0, f32(new * c))
    with np.errstate(invalid="ignore"):
      if fix.int_ref:
        corr = np.where(move, np.exp2(np.floor(f32(ref * c)) - np.floor(base_new)), 1.0)
      else:
        corr = np.where(move, f32(np.exp2(f32(f32(ref * c) - base_new))), 1.0)
    corr = np.where(move & (ref == -np.inf), 0.0, corr)
    ref = np.where(move, new, ref)
    l_sum = f32(l_sum * corr)
    l_rounded = f32(l_rounded * corr)
    acc = f32(acc * corr[..., None])
    base = np.where(ref == -np.inf, 0.0, f32(ref * c))[..., None]
    if fix.int_ref:
      base = np.floor(base)
    with np.errstate(invalid="ignore"):
      p = f32(np.exp2(f32(sb * c - base)))  # FFMA: exact product, one rounding
    p = np.where(np.isnan(p), 0.0, p)
    pr = rnd(p)
    if narrow_call(config, fix.split_p_narrow_keys, fix.narrow_scores if fix.split_p_narrow_keys else 0):
      pr = f32(pr + rnd(p - pr))
    l_sum = f32(l_sum + p.sum(-1))
    l_rounded = f32(l_rounded + pr.sum(-1))
    acc = f32(acc + tc_matmul("bkgts,bksh->bkgth", pr, vv[:, :, n0:n0 + block_n], 4, 2))
  l_norm = l_rounded if fix.sum_rounded else l_sum
  l_lse = l_rounded if fix.lse_rounded else l_sum
  with np.errstate(divide="ignore", invalid="ignore"):
    inv = np.where(live, f32(1.0 / l_norm), 0.0)
    o32 = f32(acc * inv[..., None])
    lse = np.where(live, f32(ref * scale + f32(np.log(l_lse))), EMPTY_ROW_LSE)
    if fix.int_ref:  # lse = R ln2 + log(l): one FFMA
      lse = np.where(live, f32(np.floor(f32(ref * c)) * np.log(2.0) + f32(np.log(l_lse))),
                     EMPTY_ROW_LSE)
    r_final = np.where(ref == -np.inf, 0.0, np.floor(f32(ref * c)))
    l_bwd = l_rounded if (fix.lse_bwd_rounded or fix.lse_rounded) else l_sum
    lse_bwd = np.where(live, f32(ref * scale + f32(np.log(l_bwd))), EMPTY_ROW_LSE)
  o16 = rnd(o32)

  # ---- backward
  lse2 = np.where(lse_bwd == EMPTY_ROW_LSE, np.inf, f32(lse_bwd * float(LOG2E)))
  with np.errstate(invalid="ignore"):
    p = f32(np.exp2(np.minimum(f32(s * c - lse2[..., None]), 0.0)))
  if fix.bwd_rounded_p:
    with np.errstate(invalid="ignore", divide="ignore"):
      pr_fwd = rnd(f32(np.exp2(f32(s * c - r_final[..., None]))))
      p = f32(pr_fwd * f32(1.0 / l_rounded)[..., None])
  p = np.where(mask & live[..., None], p, 0.0)
  dp = tc_matmul("bkgth,bksh->bkgts", gg, vv, 4, 3)
  narrow_o32 = fix.narrow_o32 and narrow_call(config, fix.split_ds_narrow_keys, fix.narrow_scores)
  if fix.o_residual == "16" and not narrow_o32:
    o_res = o16
  elif fix.o_residual == "32" or narrow_o32:
    o_res = o32
  elif fix.o_residual == "hilo":
    o_res = f32(o16 + rnd(o32 - o16))
  elif fix.o_residual == "hilo8":
    o_res = f32(o16 + int8_residual(o32 - o16, o16, config.dtype))
  else:
    o_res = None
  if o_res is None:
    delta = f32(np.sum(p * dp, -1))
  elif fix.d_order_tc:
    delta = delta_tc_order(o_res, gg)
  else:
    delta = delta_prepare(o_res, gg, kd)
  ds = f32(f32(scale * p) * f32(dp - delta[..., None]))
  ds = np.where(mask & live[..., None], ds, 0.0)
  if fix.zero_single_key_ds:
    single = vis.sum(-1) == 1  # (B, T): the mask leaves the row one key
    ds = np.where(single[:, None, None, :, None], 0.0, ds)
  if not fix.round_ds:
    dsr = ds
  elif kd <= fix.split_ds_head_dim or narrow_call(config, fix.split_ds_narrow_keys,
                                                  fix.narrow_scores if fix.split_ds_narrow_keys else 0):
    dsr = rnd(ds) + rnd(ds - rnd(ds))  # the two 16-bit operands' products, summed in float32
  else:
    dsr = rnd(ds)
  pr = rnd(p) if fix.round_p_dv else p
  dv = rnd(np.einsum("bkgts,bkgth->bksh", pr, gg, optimize=True))
  dk = rnd(np.einsum("bkgts,bkgth->bksh", dsr, qg, optimize=True))
  dq = rnd(np.einsum("bkgts,bksh->bkgth", dsr, kk, optimize=True)) * sign
  out = np.where(live[..., None], o16, 0.0)
  to_btnh = lambda x: x.transpose(0, 3, 1, 2, 4).reshape(batch, seq_q, heads_q, hd)
  return dict(out=to_btnh(out), lse=lse.reshape(batch, heads_q, seq_q).transpose(0, 2, 1),
              dq=to_btnh(dq) + 0.0, dk=dk.transpose(0, 2, 1, 3), dv=dv.transpose(0, 2, 1, 3))


# ---------------------------------------------------------------------------------------------
# Running against the harness's references


def gpu_misses(path: str) -> set[tuple[int, str]]:
  """(index, category) of every MISS line of a GPU differential log."""
  found = set()
  if not os.path.exists(path):
    return found
  with open(path) as f:
    for line in f:
      m = re.match(r"MISS \[(\d+)\] .*?: (\w+) rule", line)
      if m:
        found.add((int(m.group(1)), m.group(2)))
  return found


@dataclasses.dataclass
class ConfigResult:
  index: int
  describe: str
  misses: dict[str, list[tuple[str, float]]]  # fix -> [(category, err/bound)]
  ratios: dict[str, dict[str, float]]  # fix -> category -> err/bound


def run_config(config: dh.Config, fixes: Sequence[Fix]) -> ConfigResult | None:
  """The model under each fix against the harness's references; None when there is nothing to
  compare (empty arrays)."""
  inputs = config.inputs()
  if any(x.size == 0 for x in inputs):
    return None
  ref32 = dh.reference_f32(config, inputs)
  refd = dh.reference_in_dtype(config, inputs, ref32)
  misses, ratios = {}, {}
  for fix in fixes:
    got = model(config, inputs, fix)
    r = {}
    found = dh.compare(config, got, ref32, refd, r)
    misses[fix.name] = [(m.category, (m.error / m.bound) if m.kind == "rule" else math.inf)
                        for m in found]
    ratios[fix.name] = r
  return ConfigResult(config.index, config.describe(), misses, ratios)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtypes", default="bfloat16,float16")
  parser.add_argument("--index", type=int, nargs="+", default=None)
  parser.add_argument("--configs", type=int, default=300)
  parser.add_argument("--fix", nargs="+", default=["none"],
                      help=f"fix names, or 'all': {', '.join(FIXES)}")
  parser.add_argument("--log", default=DEFAULT_LOG, help="the GPU run's log (its MISS lines)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  names = list(FIXES) if args.fix == ["all"] else args.fix
  fixes = [FIXES[n] for n in names]
  dtypes = args.dtypes.split(",")
  indices = args.index if args.index is not None else range(args.configs)
  gpu = gpu_misses(args.log)
  start = time.perf_counter()
  results = []
  import jax
  for count, index in enumerate(indices, 1):
    config = dh.draw_config(args.seed, index, dtypes)
    result = run_config(config, fixes)
    if count % 100 == 0:
      jax.clear_caches()
    if result is None:
      continue
    results.append(result)
    if args.index is not None:
      print(f"[{index}] {result.describe}")
      for name in names:
        gpu_here = sorted(cat for i, cat in gpu if i == index)
        r = result.ratios[name]
        print(f"  {name:<15} dq {r.get('dq', 0):.2f} dk {r.get('dk', 0):.2f} dv {r.get('dv', 0):.2f}"
              f" fwd {r.get('fwd', 0):.2f}  misses {result.misses[name]}"
              + (f"   (GPU missed: {gpu_here})" if name == "none" else ""))
    elif count % 50 == 0:
      print(f"-- {count} configurations, {time.perf_counter() - start:.0f} s", file=sys.stderr,
            flush=True)
  if args.index is None:
    print(summary(results, names, gpu, args.seed, len(list(indices))))
  if args.json:
    with open(args.json, "w") as f:
      json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
  return 0


def summary(results: list[ConfigResult], names: Sequence[str], gpu: set[tuple[int, str]],
            seed: int, configs: int) -> str:
  """Per fix: its (index, category) misses, how many of the GPU's it shares, how many are new."""
  lines = [f"seed {seed}, configurations 0..{configs - 1} (bf16/f16; {len(results)} non-empty); "
           f"the GPU log has {len(gpu)} dq/dk misses",
           f"{'fix':<15}{'misses':>7}{'dq':>5}{'dk':>5}{'other':>6}{'of GPU':>8}{'new':>5}"
           f"{'max ratio':>10}  description"]
  for name in names:
    found = {(r.index, cat): ratio for r in results for cat, ratio in r.misses[name]}
    dq = sum(1 for (_, cat) in found if cat == "dq")
    dk = sum(1 for (_, cat) in found if cat == "dk")
    shared = len(set(found) & gpu)
    worst = max([ratio for r in results for cat, ratio in r.ratios[name].items()], default=0)
    lines.append(f"{name:<15}{len(found):>7}{dq:>5}{dk:>5}{len(found) - dq - dk:>6}{shared:>8}"
                 f"{len(set(found) - gpu):>5}{worst:>10.2f}  {FIXES[name].doc}")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
