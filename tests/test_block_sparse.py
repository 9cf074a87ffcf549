"""Block-sparse attention (issue 16 item 2): ``block_mask``, one bool per (query block, key block)
of ``jax_flash.BLOCK_MASK_BLOCK`` (128 x 128: each holds 2 x 2 of the CPU kernel's 64 x 64
tiles), broadcastable to (B, N, ceil(T / 128), ceil(S / 128)); False hides the key block from
the query block, on top of every other mask.

Each path ("cpu" kernel, "blockwise", "xla") is checked against a float32 reference written here
that expands the block mask to an element mask (plain jax.numpy, differentiated by JAX), by the
FlashAttention rule of tests/attention_testing.py: forward, lse and dq, dk, dv, at several
densities (all True == dense, all-False rows: empty rows), with causal, windows, lengths, GQA,
T != S with partial last blocks, segment ids; sinks, ALiBi and soft cap against "xla"; then
broadcasting over batch and heads, vmap, batch/head/sequence sharding, the errors, the CUDA
refusal at trace time, decode shapes, that the kernel never reads a hidden block (NaN keys
and values there do not reach the output), and that the CPU kernel's tiles take the bit of the
mask block holding them (a hidden block among visible ones, windows starting mid-block).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _registry
from jax_flash._reference import EMPTY_ROW_LSE
from tests.attention_testing import (F32, HIGHEST, Case, assert_within_rule, gradient_magnitude,
                                     packed_segment_ids, rounded, visible_keys)

IMPLEMENTATIONS = ["cpu", "blockwise", "xla"]


def test_block_size_is_128_a_multiple_of_the_cpu_kernels_tile():
  """The block is its own constant of the native module (128 x 128), not the CPU kernel's tile
  (64 x 64), which divides it."""
  constants = _registry.KERNEL_CONSTANTS
  assert jax_flash.BLOCK_MASK_BLOCK == (128, 128)
  assert jax_flash.BLOCK_MASK_BLOCK == (constants["block_mask_block_q"],
                                        constants["block_mask_block_k"])
  assert constants["block_mask_block_q"] % constants["cpu_block_q"] == 0
  assert constants["block_mask_block_k"] % constants["cpu_block_k"] == 0
  assert constants["block_mask_block_q"] > constants["cpu_block_q"]  # tiles straddle below
  assert jax_flash.block_mask_shape(1, 1) == (1, 1)
  assert jax_flash.block_mask_shape(300, 400) == (3, 4)
  bq, bk = jax_flash.BLOCK_MASK_BLOCK
  assert jax_flash.block_mask_shape(bq, bk + 1) == (1, 2)
  assert jax_flash.block_mask_shape(3 * bq - 1, 2 * bk) == (3, 2)


def expand(block_mask: np.ndarray, seq_q: int, seq_k: int) -> np.ndarray:
  """(..., T, S) from (..., Tb, Sb), written independently of jax_flash: element (i, j) is the
  bit of block (i // block_q, j // block_k)."""
  bq, bk = jax_flash.BLOCK_MASK_BLOCK
  rows = np.arange(seq_q) // bq
  cols = np.arange(seq_k) // bk
  return block_mask[..., rows[:, None], cols[None, :]]


@dataclasses.dataclass(frozen=True)
class SparseCase:
  case: Case
  density: float = 0.5  # of True blocks; 1.0: all True
  shape: str = "full"  # the mask's shape as passed: "full" (B, N, Tb, Sb), "heads" (N, Tb, Sb),
  # "batch" (B, 1, Tb, Sb), "blocks" (Tb, Sb)
  empty_rows: bool = False  # one query block of every (batch, head) sees no key block
  segment_ids: bool = False

  @property
  def id(self) -> str:
    return (f"{self.case.id}_d{self.density}_{self.shape}" + ("_emptyrows" if self.empty_rows
                                                              else "")
            + ("_ids" if self.segment_ids else ""))

  def block_mask(self) -> np.ndarray:
    c = self.case
    tb, sb = jax_flash.block_mask_shape(c.seq_q, c.seq_k)
    shape = {"full": (c.batch, c.heads_q, tb, sb), "heads": (c.heads_q, tb, sb),
             "batch": (c.batch, 1, tb, sb), "blocks": (tb, sb)}[self.shape]
    if c.rank3 and self.shape == "full":
      shape = shape[1:]
    rng = np.random.default_rng(c.seed + 5)
    mask = rng.random(shape) < self.density
    if self.empty_rows:
      mask[..., tb - 1, :] = False
    return mask

  def ids(self):
    return packed_segment_ids(self.case) if self.segment_ids else None

  def visible(self) -> np.ndarray:
    """(B, N, T, S) bool: every mask, the block mask expanded."""
    c = self.case
    vis = visible_keys(c, self.ids())[:, None]  # (B, 1, T, S)
    blocks = self.block_mask()
    if c.rank3:
      blocks = blocks[None] if blocks.ndim == 3 else blocks
    blocks = np.broadcast_to(blocks, (c.batch, c.heads_q, *blocks.shape[-2:]))
    return vis & expand(blocks, c.seq_q, c.seq_k)


def reference_attention(q, k, v, vis, *, scale, dtype=None):
  """(out, lse (..., T, N)) on float32 inputs from the definition, scores materialised and
  masked by `vis` ((B, N, T, S) bool); with `dtype` (16-bit) scores and probabilities rounded
  to it. Rows with no visible key give 0 and EMPTY_ROW_LSE."""
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  group = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
  rnd = (lambda x: x) if dtype is None else functools.partial(rounded, dtype=dtype)
  s = rnd(jnp.einsum("btnh,bsnh->bnts", q, k, precision=HIGHEST) * scale)
  vis = jnp.asarray(vis)
  has = vis.any(-1, keepdims=True)
  masked = jnp.where(vis, s, -0.7 * float(np.finfo(np.float32).max))
  p = rnd(jnp.where(has, jax.nn.softmax(masked, axis=-1), 0.0))
  out = jnp.einsum("bnts,bsnh->btnh", p, v, precision=HIGHEST)
  lse = jnp.where(has[..., 0], jax.nn.logsumexp(masked, axis=-1), EMPTY_ROW_LSE)
  lse = jnp.swapaxes(lse, -1, -2)
  if unbatched:
    out, lse = out[0], lse[0]
  return out, lse


def _grads(attention, q, k, v, g) -> dict:
  def loss(q, k, v):
    out, lse = attention(q, k, v)
    return jnp.sum(out.astype(F32) * g), (out, lse)

  (_, (out, lse)), (dq, dk, dv) = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return {n: np.asarray(jnp.asarray(x, F32), np.float64)
          for n, x in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv).items()}


def _live(sc: SparseCase) -> np.ndarray:
  """(..., T, N) bool: rows with a visible key."""
  live = np.swapaxes(sc.visible().any(-1), -1, -2)
  return live[0] if sc.case.rank3 else live


@functools.lru_cache(maxsize=16)
def references(sc: SparseCase):
  c = sc.case
  q, k, v, g = c.inputs()
  live = _live(sc)
  g = jnp.where(jnp.asarray(live)[..., None], g, 0.0)
  upcast = [x.astype(F32) for x in (q, k, v)]
  scale = c.scale if c.scale is not None else 1.0 / np.sqrt(c.head_dim)
  f32 = functools.partial(reference_attention, vis=sc.visible(), scale=scale)
  ref32 = _grads(f32, *upcast, g)
  if c.dtype == "float32":
    return ref32, ref32
  return ref32, _grads(functools.partial(f32, dtype=c.jdtype), *upcast, g)


def run(sc: SparseCase, implementation: str) -> dict:
  q, k, v, g = sc.case.inputs()
  opts = sc.case.options()
  ids = sc.ids()
  if ids is not None:
    opts.update(q_segment_ids=ids, kv_segment_ids=ids)
  block_mask = jnp.asarray(sc.block_mask())

  def attention(q, k, v):
    return jax_flash.dot_product_attention(q, k, v, implementation=implementation,
                                           return_residual=True, block_mask=block_mask, **opts)

  return _grads(attention, q, k, v, g)


def check(sc: SparseCase, got: dict) -> None:
  ref32, refd = references(sc)
  live = _live(sc)
  for name, x in got.items():
    assert np.all(np.isfinite(x)), name
  assert_within_rule("out", got["out"], ref32["out"], refd["out"], live[..., None])
  assert_within_rule("lse", got["lse"], ref32["lse"], refd["lse"], live)
  for name in ("dq", "dk", "dv"):
    assert_within_rule(name, got[name], ref32[name], refd[name],
                       magnitude=gradient_magnitude(ref32))
  dead = np.broadcast_to(~live[..., None], got["out"].shape)
  assert np.all(got["out"][dead] == 0) and np.all(got["dq"][dead] == 0)
  assert np.all(got["lse"][~live] == EMPTY_ROW_LSE)


CASES = [
    # Dense (all True) == no block mask; T != S, both with partial last blocks (2 x 3 blocks),
    # GQA.
    SparseCase(Case(batch=2, seq_q=200, seq_k=300, heads_q=4, heads_k=2, head_dim=32),
               density=1.0),
    # Half the blocks, causal, GQA 4:1, T < S, partial blocks (3 x 4), one query block with no
    # key block (empty rows).
    SparseCase(Case(batch=1, seq_q=300, seq_k=400, heads_q=4, heads_k=1, head_dim=40,
                    is_causal=True), density=0.5, empty_rows=True),
    # Sparse (25%), T > S (4 x 3 blocks), bf16, mask over (N, Tb, Sb) broadcast over the batch.
    SparseCase(Case(batch=2, seq_q=400, seq_k=260, heads_q=2, heads_k=2, head_dim=32,
                    dtype="bfloat16"), density=0.25, shape="heads"),
    # A window and lengths with an empty batch element, mask (B, 1, Tb, Sb) over the heads:
    # windows starting and ending inside blocks (3 x 3).
    SparseCase(Case(batch=2, seq_q=300, seq_k=300, heads_q=2, heads_k=2, head_dim=16,
                    local_window_size=(150, 40), q_lens=(280, 300), kv_lens=(0, 277)),
               density=0.6, shape="batch"),
    # Packed documents with segment ids, causal, one (Tb, Sb) mask for everything (3 x 3).
    SparseCase(Case(batch=2, seq_q=384, seq_k=384, heads_q=2, heads_k=1, head_dim=16,
                    is_causal=True), density=0.7, shape="blocks", segment_ids=True),
    # Unbatched inputs: (N, Tb, Sb) (2 x 3).
    SparseCase(Case(batch=1, seq_q=140, seq_k=260, heads_q=2, heads_k=2, head_dim=32,
                    rank3=True), density=0.5),
    # A decode shape (the CPU runs it on the tiled kernel), lengths.
    SparseCase(Case(batch=2, seq_q=1, seq_k=300, heads_q=8, heads_k=2, head_dim=32,
                    kv_lens=(300, 123)), density=0.5),
    # Keys over three of "blockwise"'s scan steps (512, 512, 76): each step expands its own
    # columns of the block mask (4, 4, 1: jax_flash._blockwise._step_mask), the last partial.
    SparseCase(Case(batch=1, seq_q=130, seq_k=1100, heads_q=2, heads_k=1, head_dim=16),
               density=0.4, empty_rows=True),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("sc", CASES, ids=[c.id for c in CASES])
def test_against_reference(sc, implementation):
  check(sc, run(sc, implementation))


def test_all_true_is_dense_and_the_mask_matters():
  """All True gives exactly the call without a block mask on the kernel; a sparse mask
  changes the result (the cases above would otherwise pass vacuously)."""
  sc = CASES[0]
  q, k, v, _ = sc.case.inputs()
  tb, sb = jax_flash.block_mask_shape(q.shape[1], k.shape[1])
  f = jax.jit(lambda q, k, v, m: jax_flash.dot_product_attention(
      q, k, v, block_mask=m, is_causal=True, implementation="cpu"))
  dense = jax_flash.dot_product_attention(q, k, v, is_causal=True, implementation="cpu")
  np.testing.assert_array_equal(f(q, k, v, jnp.ones((tb, sb), bool)), dense)
  sparse = jnp.asarray([[True, True, True], [False, True, True]])
  assert not np.allclose(f(q, k, v, sparse), dense)


def test_all_false_gives_empty_rows():
  q, k, v, _ = CASES[0].case.inputs()
  tb, sb = jax_flash.block_mask_shape(q.shape[1], k.shape[1])
  for implementation in IMPLEMENTATIONS:
    def loss(q, k, v):
      out, lse = jax_flash.dot_product_attention(
          q, k, v, block_mask=jnp.zeros((tb, sb), bool), implementation=implementation,
          return_residual=True)
      return out.sum(), (out, lse)
    (_, (out, lse)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == EMPTY_ROW_LSE)
    for x in grads:
      assert np.all(np.asarray(x) == 0)


def test_hidden_blocks_are_never_read():
  """The "cpu" kernel never reads a hidden block: NaN keys and values in a key block the mask
  hides from every query block do not reach the output or any gradient, and dk, dv of that
  block are 0. And a block hidden from one query block only: that block's rows stay finite and
  match the reference with the NaNs replaced. (Not so on "blockwise" and "xla", which mask the
  scores of every block but multiply the hidden values by their zero probabilities: a NaN
  value there gives NaN, as in jax.nn.)"""
  implementation = "cpu"
  rng = np.random.default_rng(3)
  b, t, s, n, h = 1, 300, 400, 2, 32
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), F32)
  k = np.asarray(rng.standard_normal((b, s, n, h)), np.float32)
  v = np.asarray(rng.standard_normal((b, s, n, h)), np.float32)
  # Copies: jnp.asarray may share a NumPy buffer on the CPU, which the NaNs below would reach.
  clean_k, clean_v = jnp.asarray(k.copy()), jnp.asarray(v.copy())
  k[:, 128:256] = np.nan  # key block 1: both of the CPU kernel's 64-key tiles in it
  v[:, 128:256] = np.nan
  k, v = jnp.asarray(k), jnp.asarray(v)
  tb, sb = jax_flash.block_mask_shape(t, s)
  mask = np.ones((tb, sb), bool)
  mask[:, 1] = False  # key block 1 hidden from every query block
  f = jax.jit(jax.value_and_grad(lambda q, k, v: jax_flash.dot_product_attention(
      q, k, v, block_mask=jnp.asarray(mask), implementation=implementation).sum(), (0, 1, 2)))
  value, (dq, dk, dv) = f(q, k, v)
  want, (wdq, wdk, wdv) = f(q, clean_k, clean_v)
  assert np.isfinite(value)
  np.testing.assert_allclose(value, want, rtol=1e-5)
  for got, ref in ((dq, wdq), (dk, wdk), (dv, wdv)):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref, atol=1e-5)
  assert np.all(np.asarray(dk[:, 128:256]) == 0) and np.all(np.asarray(dv[:, 128:256]) == 0)
  # Hidden from query block 0 only: rows 0..127 (two query tiles) never see the NaNs.
  mask = np.ones((tb, sb), bool)
  mask[0, 1] = False
  out = jax_flash.dot_product_attention(q, k, v, block_mask=jnp.asarray(mask),
                                        implementation=implementation)
  ref = jax_flash.dot_product_attention(q, clean_k, clean_v, block_mask=jnp.asarray(mask),
                                        implementation="xla")
  np.testing.assert_allclose(out[:, :128], ref[:, :128], atol=1e-5)
  assert np.all(np.isnan(np.asarray(out[:, 128:])))  # the others do (the NaNs are real)


STRADDLE_OPTIONS = [
    dict(),
    # Causal with a window: a query tile's first key (row - 100) lies mid-block, so its key
    # tiles start at a multiple of 64 inside a mask block (the bit is still that block's).
    dict(is_causal=True, local_window_size=(100, 0)),
    # Both edges mid-block: the backward's query tiles start at a multiple of 64 inside a block.
    dict(local_window_size=(70, 90)),
]


@pytest.mark.parametrize("options", STRADDLE_OPTIONS,
                         ids=["full", "causal_window", "window"])
def test_cpu_tiles_take_the_bit_of_their_mask_block(options):
  """Each 128 x 128 mask block holds 2 x 2 of the CPU kernel's 64 x 64 tiles: a tile is visited
  iff the bit of the block holding it is set. One block hidden among visible ones, one visible
  among hidden ones and a checkerboard of blocks (one per batch element; T = 320, S = 448: 3 x 4
  blocks, the last query block one tile, the last key block partial), against "xla" (the mask
  expanded element-wise), output, lse and gradients. A tile reading another block's bit (e.g.
  its own 64 x 64 index) hides or shows half a block and fails here."""
  rng = np.random.default_rng(11)
  t, s, n, nk, h = 320, 448, 2, 1, 32
  q = jnp.asarray(rng.standard_normal((3, t, n, h)), F32)
  k = jnp.asarray(rng.standard_normal((3, s, nk, h)), F32)
  v = jnp.asarray(rng.standard_normal((3, s, nk, h)), F32)
  g = jnp.asarray(rng.standard_normal((3, t, n, h)), F32)
  tb, sb = jax_flash.block_mask_shape(t, s)
  assert (tb, sb) == (3, 4)
  one_hidden = np.ones((tb, sb), bool)
  one_hidden[1, 1] = False
  one_visible = np.zeros((tb, sb), bool)
  one_visible[1, 1] = one_visible[2, 2] = one_visible[0, 0] = True
  checkerboard = (np.arange(tb)[:, None] + np.arange(sb)[None, :]) % 2 == 0
  mask = jnp.asarray(np.stack([one_hidden, one_visible, checkerboard])[:, None])  # (3, 1, 3, 4)

  def grads(implementation):
    def loss(q, k, v):
      out, lse = jax_flash.dot_product_attention(
          q, k, v, block_mask=mask, implementation=implementation, return_residual=True,
          **options)
      return jnp.sum(out * g), (out, lse)
    (_, (out, lse)), dqkv = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return out, lse, *dqkv

  got, want = grads("cpu"), grads("xla")
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5, err_msg=name)
  # Not vacuous: the mask changes every batch element's output.
  dense = jax_flash.dot_product_attention(q, k, v, implementation="cpu", **options)
  for b in range(3):
    assert not np.allclose(got[0][b], dense[b], atol=1e-3)


def test_decode_shapes_run_the_tiled_kernel():
  q = jnp.ones((2, 1, 8, 32))
  kv = jnp.ones((2, 300, 2, 32))
  def hlo(**blocks):
    return jax.jit(lambda q, kv: jax_flash.dot_product_attention(
        q, kv, kv, implementation="cpu", **blocks)).lower(q, kv).as_text()
  assert "jax_flash_cpu_decode" in hlo()
  with_mask = hlo(block_mask=jnp.ones((1, 3), bool))
  assert "jax_flash_cpu_decode" not in with_mask and "jax_flash_cpu_fwd" in with_mask


@pytest.mark.parametrize("block_mask, match", [
    (np.ones((1, 2, 2), bool), r"block_mask must be a bool array broadcastable to \(2, 4, 3, 2\)"
                               r".*128 x 128.*query\(2, 300, 4, 8\).*got block_mask\(1, 2, 2\)"),
    (np.ones((3, 3), bool), r"got block_mask\(3, 3\)"),
    (np.ones((3,), bool), r"got block_mask\(3,\)"),
    (np.ones((2, 2, 3, 2), bool), r"got block_mask\(2, 2, 3, 2\)"),  # N=4: 2 is not 1 or 4
    (np.ones((1, 2, 4, 3, 2), bool), r"got block_mask\(1, 2, 4, 3, 2\)"),
    (np.ones((3, 2), np.int32), r"got int32 block_mask\(3, 2\)"),
    (np.ones((2, 4, 300, 150), bool), r"got block_mask\(2, 4, 300, 150\)"),  # an element mask
    (np.ones((2, 4, 5, 3), bool), r"got block_mask\(2, 4, 5, 3\)"),  # 64 x 64 blocks' shape
    ("x", r"block_mask must be a bool array"),
])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_invalid_masks_raise(block_mask, match, implementation):
  q = jnp.ones((2, 300, 4, 8))
  kv = jnp.ones((2, 150, 2, 8))
  with pytest.raises(ValueError, match=match):
    jax_flash.dot_product_attention(q, kv, kv, block_mask=block_mask,
                                    implementation=implementation)


def test_rank3_takes_at_most_rank3_masks():
  q = jnp.ones((140, 2, 8))
  jax_flash.dot_product_attention(q, q, q, block_mask=jnp.ones((2, 2, 2), bool))
  match = r"broadcastable to \(2, 2, 2\).*got block_mask\(1, 2, 2, 2\)"
  with pytest.raises(ValueError, match=match):
    jax_flash.dot_product_attention(q, q, q, block_mask=jnp.ones((1, 2, 2, 2), bool))


def test_vmap_mapped_and_unmapped_masks():
  sc = CASES[1]
  q, k, v, _ = sc.case.inputs()
  tb, sb = jax_flash.block_mask_shape(q.shape[1], k.shape[1])
  rng = np.random.default_rng(9)
  masks = jnp.asarray(rng.random((2, tb, sb)) < 0.5)
  f = lambda q, k, v, m: jax_flash.dot_product_attention(q, k, v, block_mask=m,
                                                         implementation="cpu")
  qs, ks, vs = (jnp.concatenate([x, x * 0.5]) for x in (q, k, v))  # batch 2
  got = jax.vmap(f, (0, 0, 0, None))(qs[:, None], ks[:, None], vs[:, None], masks[0])[:, 0]
  np.testing.assert_allclose(got, f(qs, ks, vs, masks[0]), atol=1e-6)
  got = jax.vmap(f)(qs[:, None], ks[:, None], vs[:, None], masks)[:, 0]
  for b in range(2):
    np.testing.assert_allclose(got[b], f(qs[b:b + 1], ks[b:b + 1], vs[b:b + 1], masks[b])[0],
                               atol=1e-6)


@pytest.mark.parametrize("spec", ["batch", "heads", "sequence"])
def test_sharded_calls(spec):
  """Batch and head sharding carry the mask with no communication; a sequence-sharded call
  whose shards are not whole 128 x 128 blocks (T = 200 over 2 devices) gathers the sequence, and a
  requested strategy raises naming block_mask (context-parallel strategies carrying the mask:
  tests/test_context_parallel_block_mask.py)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  q, k, v, _ = CASES[0].case.inputs()  # batch 2, 4 query heads, 2 kv heads
  tb, sb = jax_flash.block_mask_shape(q.shape[1], k.shape[1])
  mask = jnp.asarray(np.random.default_rng(4).random((2, 4, tb, sb)) < 0.5)

  def value_and_grads(**cp):
    def loss(q, k, v):
      return (jax_flash.dot_product_attention(q, k, v, block_mask=mask, is_causal=True,
                                              implementation="cpu", **cp) ** 2).sum()
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))

  mesh = jax.make_mesh((2,), ("x",))
  p = {"batch": P("x"), "heads": P(None, None, "x", None),
       "sequence": P(None, "x", None, None)}[spec]
  sharded = [jax.device_put(x, NamedSharding(mesh, p)) for x in (q, k, v)]
  want, want_g = value_and_grads()(q, k, v)
  got, got_g = value_and_grads()(*sharded)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(got_g, want_g):
    np.testing.assert_allclose(a, b, atol=2e-5)
  if spec == "sequence":
    with pytest.raises(Exception, match="block_mask"):
      value_and_grads(context_parallel="all_gather")(*sharded)


def test_with_sinks_alibi_and_soft_cap():
  """The score variants and sinks combine with the block mask: "cpu" and "blockwise" give what
  "xla" gives, forward and gradients (sinks included)."""
  q, k, v, g = CASES[1].case.inputs()
  tb, sb = jax_flash.block_mask_shape(q.shape[1], k.shape[1])
  mask = jnp.asarray(np.random.default_rng(6).random((tb, sb)) < 0.5).at[-1].set(False)
  sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], F32)
  slopes = jnp.asarray([0.1, -0.05, 0.02, 0.0], F32)

  def grads(implementation):
    def loss(q, k, v, sinks):
      out = jax_flash.dot_product_attention(
          q, k, v, block_mask=mask, sinks=sinks, alibi_slopes=slopes, logits_soft_cap=5.0,
          is_causal=True, implementation=implementation)
      return jnp.sum(out * g)
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(q, k, v, sinks)

  want, want_g = grads("xla")
  for implementation in ("cpu", "blockwise"):
    got, got_g = grads(implementation)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, want_g):
      np.testing.assert_allclose(a, b, atol=2e-5)
