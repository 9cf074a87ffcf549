"""Block-sparse attention under context parallelism (issue 16): every strategy (ring contiguous
and zig-zag, all-to-all over heads, all-gather of K/V) carries a block_mask, inside shard_map
(context_parallel_attention and ring_attention: each device passes its block rows) and under jax.jit with a
sequence-sharded input (dot_product_attention's context_parallel), on simulated 2- and 4-device
meshes; output, log-sum-exp, dq, dk and dv against the single-device kernel with the same mask.

The masks are random, with one query block row hidden whole in every (batch, head) (empty rows:
0 output, EMPTY_ROW_LSE, no gradient), combined with causal masks, lengths and segment ids. The
rule (jax_flash._context_parallel._block_mask_problem): shards of whole 128 x 128 blocks; where
no strategy meets it, the automatic choice gathers the sequence (still the right answer) and a
requested strategy raises naming block_mask. The compiled HLO shows the ring carries the mask
with collective-permutes only: the sequence is not gathered.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import _context_parallel, _ops
from attention_testing import random_qkv_and_cotangent
from jax_flash._reference import EMPTY_ROW_LSE
from test_context_parallel import COLLECTIVES, SPEC, TOLERANCE

BLOCK = jax_flash.BLOCK_MASK_BLOCK[0]
IDS_SPEC = P(None, "seq")
BLOCK_ROWS_SPEC = P(None, None, "seq", None)


def _mesh(devices: int) -> Mesh:
  if len(jax.devices()) < devices:
    pytest.skip(f"needs {devices} devices")
  return Mesh(np.array(jax.devices()[:devices]), ("seq",))


def _inputs(seed: int, seq: int, batch=1, heads_q=4, heads_k=2, head_dim=16):
  rng = np.random.default_rng(seed)
  return random_qkv_and_cotangent(rng, batch, seq, heads_q, heads_k, head_dim)


def _block_mask(seed: int, seq: int, batch=1, heads=4, density=0.6) -> np.ndarray:
  """Random (B, N, Tb, Sb) bool, diagonal blocks visible, one query block row hidden whole."""
  rng = np.random.default_rng(seed + 100)
  tb, sb = jax_flash.block_mask_shape(seq, seq)
  mask = rng.random((batch, heads, tb, sb)) < density
  mask[..., np.arange(tb), np.arange(tb)] = True
  mask[..., rng.integers(tb), :] = False
  return mask


def _segment_ids(seed: int, seq: int, batch=1) -> np.ndarray:
  """Packed documents cut at random positions (crossing the shards' boundaries)."""
  rng = np.random.default_rng(seed + 200)
  cuts = np.sort(rng.choice(np.arange(1, seq), size=(batch, 4), replace=False), axis=-1)
  return np.stack([np.searchsorted(c, np.arange(seq), side="right") for c in cuts]).astype(
      np.int32)


def _compiled_results(fn, q, k, v, g, *extra) -> tuple[dict, str]:
  """fn(q, k, v, *extra) -> (out, lse): out, lse and the gradients of sum(out * g) as float64
  numpy, and the compiled program's HLO text."""

  def run(q, k, v, g, *extra):
    def loss(q, k, v):
      out, lse = fn(q, k, v, *extra)
      return jnp.sum(out.astype(jnp.float32) * g), (out, lse)

    (_, (out, lse)), (dq, dk, dv) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

  compiled = jax.jit(run).lower(q, k, v, g, *extra).compile()
  results = compiled(q, k, v, g, *extra)
  return {n: np.asarray(x, np.float64) for n, x in results.items()}, compiled.as_text()


def _results(fn, q, k, v, g, *extra) -> dict:
  return _compiled_results(fn, q, k, v, g, *extra)[0]


def _single(q, k, v, g, block_mask, ids=None, **options) -> dict:
  id_options = {} if ids is None else dict(q_segment_ids=ids, kv_segment_ids=ids)
  return _results(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, block_mask=block_mask, implementation="cpu", return_residual=True,
      **id_options, **options), q, k, v, g)


def _assert_matches(got: dict, want: dict, block_mask: np.ndarray, dense: dict | None = None):
  for name in want:
    np.testing.assert_allclose(got[name], want[name], err_msg=name, **TOLERANCE)
  rows = got["lse"].shape[1]
  empty = ~np.swapaxes(block_mask.any(-1), 1, 2).repeat(BLOCK, axis=1)[:, :rows]  # (B, T, N)
  assert empty.any() and np.all(got["lse"][empty] == EMPTY_ROW_LSE)
  assert np.all(got["out"][empty] == 0) and np.all(got["dq"][empty] == 0)
  if dense is not None:  # the mask matters: the cases do not pass vacuously
    assert not np.allclose(got["out"], dense["out"], atol=1e-3)


SHARD_MAP_CASES = [
    # devices, strategy, layout, sequence length, options (slices and zig-zag chunks of one
    # or two 128-row blocks)
    (4, "ring", "contiguous", 512, dict()),
    (4, "ring", "zigzag", 1024, dict(is_causal=True, ids=True)),
    (2, "ring", "zigzag", 512, dict(is_causal=True)),
    (4, "all_to_all", "contiguous", 512, dict(is_causal=True, ids=True)),
    (4, "all_to_all", "zigzag", 1024, dict()),
    (4, "all_gather", "contiguous", 512, dict(is_causal=True, ids=True)),
    (2, "all_gather", "zigzag", 512, dict(is_causal=True, local_window_size=(128, 0))),
]


# jax_flash.ring_attention (the ring strategy's own entry point) takes the same block rows:
# the first two ring cases again through it.
RING_ATTENTION_CASES = [(d, "ring_attention", l, t, o) for d, _, l, t, o in SHARD_MAP_CASES[:2]]


@pytest.mark.parametrize(
    "devices,strategy,layout,seq,options", SHARD_MAP_CASES + RING_ATTENTION_CASES,
    ids=[f"{d}dev-{s}-{l}-T{t}-{'-'.join(o) or 'full'}"
         for d, s, l, t, o in SHARD_MAP_CASES + RING_ATTENTION_CASES])
def test_shard_map_strategies_with_block_mask(devices, strategy, layout, seq, options):
  """Each strategy inside shard_map (and jax_flash.ring_attention, "ring_attention") against the
  single-device kernel with the same mask."""
  mesh = _mesh(devices)
  options = dict(options)
  with_ids = options.pop("ids", False)
  seed = len(SHARD_MAP_CASES) * devices + seq // 64 + len(strategy)
  q, k, v, g = _inputs(seed, seq)
  block_mask = _block_mask(seed, seq)
  ids = _segment_ids(seed, seq) if with_ids else None
  want = _single(q, k, v, g, jnp.asarray(block_mask),
                 None if ids is None else jnp.asarray(ids), **options)

  def local(q, k, v, blocks, *ids):
    id_options = {} if not ids else dict(q_segment_ids=ids[0], kv_segment_ids=ids[0])
    if strategy == "ring_attention":
      return jax_flash.ring_attention(
          q, k, v, axis_name="seq", layout=layout, block_mask=blocks, implementation="cpu",
          return_residual=True, **id_options, **options)
    return jax_flash.context_parallel_attention(
        q, k, v, axis_name="seq", strategy=strategy, layout=layout, block_mask=blocks,
        implementation="cpu", return_residual=True, **id_options, **options)

  extra_specs = () if ids is None else (IDS_SPEC,)
  sharded = jax.shard_map(local, mesh=mesh,
                          in_specs=(SPEC,) * 3 + (BLOCK_ROWS_SPEC,) + extra_specs,
                          out_specs=(SPEC, P(None, "seq", None)))
  tb = block_mask.shape[2]
  order = jax_flash.zigzag_indices(seq, devices) if layout == "zigzag" else np.arange(seq)
  block_order = (jax_flash.zigzag_indices(tb, devices) if layout == "zigzag" else np.arange(tb))
  extra = () if ids is None else (jnp.asarray(ids[:, order]),)
  got = _results(lambda q, k, v, blocks, *ids: sharded(q, k, v, blocks, *ids),
                 *(x[:, order] for x in (q, k, v, g)),
                 jnp.asarray(block_mask[:, :, block_order]), *extra)
  got = {n: x[:, np.argsort(order)] for n, x in got.items()}
  _assert_matches(got, want, block_mask)


JIT_CASES = [
    # devices, context_parallel, sequence length, options, collectives of forward + backward
    (4, "ring:contiguous", 512, dict(), {"collective-permute"}),
    (4, "ring:zigzag", 1024, dict(is_causal=True, ids=True), {"collective-permute"}),
    (2, "all_to_all", 512, dict(is_causal=True), {"all-to-all"}),
    (4, "all_gather", 1024, dict(is_causal=True, ids=True),
     {"all-gather", "reduce-scatter", "collective-permute"}),
    # automatic, causal: the ring, zig-zag where each chunk is whole blocks (T = 1024 over 4:
    # 128-row chunks), else contiguous (T = 512 over 4: 64-row chunks, 128-row slices)
    (4, None, 1024, dict(is_causal=True), {"collective-permute"}),
    (4, None, 512, dict(is_causal=True, query_seq_lengths=(512, 400),
                        key_value_seq_lengths=(460, 512)), {"collective-permute"}),
]


def _jit_attention(context_parallel, options):
  options = dict(options)
  ids = options.pop("ids", False)
  lens = {n: jnp.asarray(options.pop(n), jnp.int32) for n in list(options)
          if n.endswith("lengths")}

  def attention(q, k, v, blocks, *id_arrays):
    id_options = {} if not ids else dict(q_segment_ids=id_arrays[0], kv_segment_ids=id_arrays[0])
    return jax_flash.dot_product_attention(
        q, k, v, block_mask=blocks, implementation="cpu", return_residual=True,
        context_parallel=context_parallel, **id_options, **lens, **options)

  return attention, ids, dict(**lens, **options)


@pytest.mark.parametrize(
    "devices,context_parallel,seq,options,collectives", JIT_CASES,
    ids=[f"{d}dev-{c}-T{t}-{'-'.join(o) or 'full'}" for d, c, t, o, _ in JIT_CASES])
def test_jit_sequence_sharded_with_block_mask(devices, context_parallel, seq, options,
                                              collectives):
  """dot_product_attention under jit, q, k, v (and the ids) sharded along the sequence, the
  block mask as the caller has it (replicated): the strategy runs with the mask's block rows,
  and the program holds only the strategy's collectives (the sequence is not gathered)."""
  mesh = _mesh(devices)
  batch = 2
  seed = devices + seq // 64 + len(options)
  q, k, v, g = _inputs(seed, seq, batch=batch)
  block_mask = jnp.asarray(_block_mask(seed, seq, batch=batch))
  attention, with_ids, single_options = _jit_attention(context_parallel, options)
  ids = (jnp.asarray(_segment_ids(seed, seq, batch=batch)),) if with_ids else ()
  want = _single(q, k, v, g, block_mask, ids[0] if ids else None, **single_options)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  sharded = [put(x, SPEC) for x in (q, k, v, g)]
  id_args = tuple(put(x, IDS_SPEC) for x in ids)
  got, hlo = _compiled_results(attention, *sharded, block_mask, *id_args)
  _assert_matches(got, want, np.asarray(block_mask),
                  dense=_single(q, k, v, g, jnp.ones_like(block_mask),
                                ids[0] if ids else None, **single_options))
  assert set(COLLECTIVES.findall(hlo)) == collectives  # forward and backward


FALLBACK_CASES = [
    # devices, sequence length, options, the strategies to request: none can carry the mask
    (2, 320, dict(), ("ring", "all_to_all", "all_gather")),  # 160-row slices
    # 64-row slices: whole blocks of the CPU kernel's tiles, not of the mask's
    (4, 256, dict(), ("ring", "all_to_all", "all_gather")),
    # 2 heads over 4 devices: no all-to-all; no ring with a window; the all-gather's key
    # ranges start 80 keys before each 128-row slice: inside a block
    (4, 512, dict(local_window_size=(80, 8)), ("all_gather",)),
]


@pytest.mark.parametrize("devices,seq,options,requests", FALLBACK_CASES,
                         ids=[f"{d}dev-T{t}-{'-'.join(o) or 'full'}"
                              for d, t, o, _ in FALLBACK_CASES])
def test_shards_of_partial_blocks_gather_the_sequence(devices, seq, options, requests):
  """Where the shards are not whole 128 x 128 blocks the automatic choice gathers the sequence
  (the right answer, an all-gather in the program) and a requested strategy raises naming
  block_mask; so does context_parallel_attention."""
  mesh = _mesh(devices)
  heads_q = 4 if "all_to_all" in requests else 2
  q, k, v, g = _inputs(seq, seq, heads_q=heads_q, heads_k=heads_q)
  block_mask = jnp.asarray(_block_mask(seq, seq, heads=heads_q))
  attention, _, single_options = _jit_attention(None, options)
  want = _single(q, k, v, g, block_mask, **single_options)
  sharded = [jax.device_put(x, NamedSharding(mesh, SPEC)) for x in (q, k, v, g)]
  got, hlo = _compiled_results(attention, *sharded, block_mask)
  _assert_matches(got, want, np.asarray(block_mask))
  assert "all-gather" in hlo
  for request in requests:
    requested, _, _ = _jit_attention(request, options)
    # A ValueError raised in the partitioner, which XLA's runtime error carries.
    with pytest.raises(Exception, match="cannot run this call: .*block_mask"):
      jax.jit(requested).lower(*sharded[:3], block_mask).compile()
  rows = jax_flash.block_mask_shape(seq // devices, seq)
  local = lambda q, k, v, blocks: jax_flash.context_parallel_attention(
      q, k, v, axis_name="seq", strategy="all_gather", block_mask=blocks, implementation="cpu",
      local_window_size=options.get("local_window_size"))
  with pytest.raises(ValueError, match="block_mask"):
    jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 3 + (BLOCK_ROWS_SPEC,), out_specs=SPEC)(
        *sharded[:3], jnp.ones((1, heads_q, rows[0] * devices, rows[1]), bool))


def test_ring_attention_refuses_partial_blocks():
  """jax_flash.ring_attention with a block_mask over slices that are not whole 128-row blocks
  (T = 256 over 4 devices: 64-row slices) raises naming the rule, inside shard_map."""
  mesh = _mesh(4)
  q, k, v, _ = _inputs(3, 256, heads_q=2, heads_k=2)
  rows = jax_flash.block_mask_shape(256 // 4, 256)
  local = lambda q, k, v, blocks: jax_flash.ring_attention(
      q, k, v, axis_name="seq", block_mask=blocks, implementation="cpu")
  with pytest.raises(ValueError, match=r"ring_attention .*block_mask needs each device's query"):
    jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 3 + (BLOCK_ROWS_SPEC,), out_specs=SPEC)(
        q, k, v, jnp.ones((1, 2, rows[0] * 4, rows[1]), bool))


def test_choose_takes_only_layouts_that_carry_the_block_mask():
  """The automatic choice falls back from the zig-zag layout to the contiguous one, then to the
  next strategy, then to gathering (None), as the shards stop being whole blocks; requested
  strategies and layouts that cannot carry the mask raise naming it."""
  causal = _ops.KernelConfig("cpu", 1.0, True, -1, -1)
  full = _ops.KernelConfig("cpu", 1.0, False, -1, -1)
  choose = functools.partial(_context_parallel.choose, block_mask=True)
  Strategy = _context_parallel.Strategy
  assert choose(None, num=4, seq_q=1024, seq_k=1024, heads_q=4, config=causal) == Strategy(
      "ring", "zigzag", relayout=True)
  assert choose(None, num=4, seq_q=512, seq_k=512, heads_q=4, config=causal) == Strategy("ring")
  # 64-row slices (whole CPU tiles, not whole 128-row mask blocks): no strategy.
  assert choose(None, num=4, seq_q=256, seq_k=256, heads_q=4, config=causal) is None
  assert _context_parallel.choose(None, num=4, seq_q=256, seq_k=256, heads_q=4,
                                  config=causal) == Strategy("ring", "zigzag", relayout=True)
  # 192-key slices: not the ring; the all-to-all where the heads split, else the all-gather.
  assert choose(None, num=2, seq_q=512, seq_k=384, heads_q=4, config=full) == Strategy(
      "all_to_all")
  assert choose(None, num=2, seq_q=512, seq_k=384, heads_q=3, config=full) == Strategy(
      "all_gather")
  with pytest.raises(ValueError, match="block_mask needs each device's query zig-zag chunk to "
                                       "be whole 128-row blocks"):
    choose("ring:zigzag", num=4, seq_q=512, seq_k=512, heads_q=4, config=causal)
  with pytest.raises(ValueError, match="ring with a block_mask needs each device's key slice"):
    choose("ring", num=2, seq_q=512, seq_k=384, heads_q=4, config=full)
  window = _ops.KernelConfig("cpu", 1.0, False, 64, 0)
  with pytest.raises(ValueError, match="left size of local_window_size \\(64\\) must be a "
                                       "multiple of 128"):
    choose("all_gather", num=2, seq_q=512, seq_k=512, heads_q=4, config=window)
  window = _ops.KernelConfig("cpu", 1.0, False, 128, 0)
  assert choose("all_gather", num=2, seq_q=512, seq_k=512, heads_q=4, config=window) == Strategy(
      "all_gather")
