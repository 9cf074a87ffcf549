"""Small odd-shaped attention calls for compute-sanitizer (memcheck, racecheck, initcheck): every
CUDA kernel family and pass on shapes that hit tile edges, T != S, head dims 40/96/256, lengths,
windows, GQA, deterministic, value head dims of their own, and the differentiated forward that
writes o in float32.

  compute-sanitizer --tool memcheck python3 .ci/gpu/sanitize_cases.py [--score-mods] [--segment-ids]
      [--block-sparse] [--cases 0,3]

--score-mods: every call with a soft cap and ALiBi slopes too; --segment-ids: with packed
documents (ids sorted, documents of 1..40 tokens, so that they straddle every block edge);
--block-sparse: with a random block mask (half the 128 x 128 blocks). Each runs the kernels' general (kGeneral)
instantiations. --dropout: with fused dropout (rate 0.2; the kernels' dropout
instantiations, experimental: the script sets JAX_FLASH_CUDA_DROPOUT=on; with deterministic=True
and at head dims up to 32 the mma.sync kernels'). --logit-arrays: with a (1, N, T, S) bias (its
gradient too) and a random (B, 1, T, S) mask (the Hopper kernels' kLogitArrays instantiations,
experimental: the script sets JAX_FLASH_CUDA_LOGIT_ARRAYS=on; the cases those refuse,
deterministic or head dims up to 32, are skipped); with --bias-alone too, the bias without the
mask (a 16-bit bias alone, staged: the kLogitArrays instantiations without the ids' code, where
the key count is a multiple of 8). --cases runs
only the listed CASES (by index), e.g. to give racecheck, which is slow, one case per process.
"""

from __future__ import annotations

import os
import sys

if "--dropout" in sys.argv[1:]:  # read when jax_flash is imported
  os.environ["JAX_FLASH_CUDA_DROPOUT"] = "on"
if "--logit-arrays" in sys.argv[1:]:
  os.environ["JAX_FLASH_CUDA_LOGIT_ARRAYS"] = "on"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_flash  # noqa: E402

CASES = [
    # (batch, T, S, heads_q, heads_k, head_dim, causal, window, lengths, deterministic[,
    #  value head dim Hv: head_dim where not given])
    (1, 17, 33, 2, 1, 40, False, None, False, False),
    (2, 65, 31, 4, 2, 96, True, None, True, False),
    # (A window wider than 16 keys: narrower calls run the mma.sync kernels, gpu/score_mods.cuh.)
    (1, 33, 33, 2, 2, 256, True, (20, 3), False, False),
    (1, 129, 70, 2, 1, 128, False, (16, 0), True, True),
    (2, 7, 130, 2, 2, 64, False, None, True, False),
    # Eight visits per key block (4 query blocks x 2 heads of a group): the backward's
    # per-visit hand-overs between its consumer warpgroups repeat.
    (1, 200, 150, 2, 1, 64, True, None, False, False),
    # Head dim 128's backward adds dQ in tiles (sm90/traits.cuh kTiledDq): lengths, GQA, a last
    # query block of 3 rows.
    (2, 131, 200, 4, 2, 128, True, None, True, False),
    # Narrow calls (the split's hi + lo P and dS on the mma.sync kernels, gpu/kernel_choice.h
    # narrow_shape): rows of at most 9 keys by a window; one key; 48 x 48 scores a head.
    (1, 70, 70, 2, 1, 64, False, (8, 0), True, False),
    (2, 20, 1, 2, 2, 128, False, None, False, False),
    (1, 48, 48, 4, 2, 32, True, None, True, True),
    # sm90ws_m80's 80-row visits (JAX_FLASH_CUDA_BACKWARD=sm90ws_m80, head dim 128, plain calls):
    # a last query block of 10 rows, a partial key block, GQA, two visits a head.
    (1, 170, 150, 4, 2, 128, False, None, False, False),
    # The split head-dim backward's shared 64-key blocks at head dim 256 (sm90/traits.cuh
    # kSplitHeadDim): GQA, lengths, a partial key block and a last query block of 5 rows; then head dim 200 on
    # the 256 kernel, causal.
    (2, 133, 150, 4, 2, 256, False, None, True, False),
    (1, 100, 90, 2, 1, 200, True, None, False, False),
    # Head dim 80 on the kernels of 96 (128-column tiles, products of N = 96): MQA, lengths, a
    # window, deterministic (the mma.sync dQ kernel at 128 beside the wgmma main kernel of 96).
    (2, 140, 200, 4, 1, 80, False, (60, 10), True, True),
    # The split backward of head dim 192 (its second warpgroup: 64 columns of dK and dV, two
    # blocks of dQ): head dim 176 causal with lengths and GQA; 192 with a window, deterministic.
    (2, 133, 150, 4, 2, 176, True, None, True, False),
    (1, 100, 90, 2, 1, 192, False, (40, 5), False, True),
    # A value head dim of its own (the pair kernels of 192 / 128, forward and split backward:
    # warpgroup 0 dV's 128 columns and dK's first 64, warpgroup 1 dK's other 128): causal, GQA,
    # lengths, partial blocks; then H 160 and Hv 120 on them (zero-filled columns), a window.
    (2, 133, 150, 4, 2, 192, True, None, True, False, 128),
    (1, 100, 90, 2, 1, 160, False, (40, 5), False, False, 120),
    # Head dim 64's causal forward on 192-row tiles (three consumer warpgroups): with
    # JAX_FLASH_CUDA_FWD_ROWS=end its first tile's padding warpgroups, with
    # JAX_FLASH_CUDA_FWD_UNSEEN=skip the warpgroups that see none of a tile's last blocks pass
    # over their blocks (lengths, GQA, 300 = 192 + 108 rows).
    (2, 300, 300, 4, 2, 64, True, None, True, False),
]


def main() -> None:
  score_mods = "--score-mods" in sys.argv[1:]
  segment_ids = "--segment-ids" in sys.argv[1:]
  block_sparse = "--block-sparse" in sys.argv[1:]
  dropout = "--dropout" in sys.argv[1:]
  logit_arrays = "--logit-arrays" in sys.argv[1:]
  bias_alone = "--bias-alone" in sys.argv[1:]
  chosen = range(len(CASES))
  if "--cases" in sys.argv[1:]:
    chosen = [int(c) for c in sys.argv[sys.argv.index("--cases") + 1].split(",")]
  for i, (b, t, s, n, kh, h, causal, window, lengths, det, *value_dim) in enumerate(CASES):
    if i not in chosen:
      continue
    hv = value_dim[0] if value_dim else h
    ks = jax.random.split(jax.random.key(i), 4)
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, kh, h), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, kh, hv), jnp.bfloat16)
    d_o = jax.random.normal(ks[3], (b, t, n, hv), jnp.bfloat16)
    kwargs = dict(is_causal=causal, local_window_size=window, implementation="cuda",
                  deterministic=det)
    if score_mods:
      kwargs["logits_soft_cap"] = 5.0
      kwargs["alibi_slopes"] = 2.0 ** (-8.0 * jnp.arange(1, n + 1, dtype=jnp.float32) / n)
    if segment_ids:
      # Document starts drawn per batch element; the key side's are the query side's where
      # T == S, else their own.
      def ids(key, length):
        starts = jax.random.randint(key, (b, length), 0, 40) == 0
        return jnp.cumsum(starts, axis=1).astype(jnp.int32)
      kwargs["q_segment_ids"] = ids(ks[0], t)
      kwargs["kv_segment_ids"] = kwargs["q_segment_ids"] if t == s else ids(ks[1], s)
    if block_sparse:
      tb, sb = jax_flash.block_mask_shape(t, s)
      kwargs["block_mask"] = jax.random.bernoulli(ks[2], 0.5, (b, n, tb, sb))
    if dropout:
      kwargs.update(dropout_rate=0.2, dropout_key=jax.random.key(100 + i))
    if lengths:
      kwargs["query_seq_lengths"] = jnp.array([max(1, t - 3)] * b, jnp.int32)
      kwargs["key_value_seq_lengths"] = jnp.array([max(1, s // 2)] * b, jnp.int32)
    bias = None
    if logit_arrays:
      if det or h <= 32 or score_mods or segment_ids or dropout:
        print(f"case {i}: skipped (the CUDA kernels' bias and mask arrays refuse it)")
        continue
      bias = jax.random.normal(ks[3], (1, n, t, s), jnp.bfloat16)
      if not bias_alone:
        kwargs["mask"] = jax.random.bernoulli(ks[0], 0.7, (b, 1, t, s))
    args = (q, k, v) if bias is None else (q, k, v, bias)
    out, vjp = jax.vjp(lambda *a: jax_flash.dot_product_attention(*a, **kwargs), *args)
    grads = vjp(d_o)
    plain = jax_flash.dot_product_attention(*args, **kwargs)
    jax.block_until_ready((out, grads, plain))
    finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (out, plain, *grads))
    print(f"case {i}: B{b} T{t} S{s} N{n}/{kh} H{h} Hv{hv} causal={causal} window={window} "
          f"lengths={lengths} deterministic={det} score_mods={score_mods} "
          f"segment_ids={segment_ids} block_sparse={block_sparse} dropout={dropout} "
          f"logit_arrays={logit_arrays}: finite={finite}")


if __name__ == "__main__":
  main()
