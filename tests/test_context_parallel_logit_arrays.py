"""jax.nn's bias and mask arrays under context parallelism: dot_product_attention under jax.jit
with the sequence sharded, and context_parallel_attention inside shard_map, on simulated 2- and
4-device meshes, run every strategy (ring, all-gather, all-to-all) with each device's rows of the
arrays (jax_flash._logit_rows) instead of gathering the sequence: output, dq, dk, dv and dbias
against the single-device kernel with the same arrays.

The cases cover every broadcast form of the bias ((B, N, T, S), (1, 1, T, S), a per-key (B, 1,
1, S), a per-query (1, N, T, 1) whose gradient is exactly 0), a (B, 1, T, S) mask (with one
query row hidden whole: 0 output, no gradient), causal masks in both layouts, lengths, T != S,
a window, segment ids beside them, and a bfloat16 bias. The compiled programs hold only the
strategy's collectives (and an all-reduce where the bias has no query dim: its gradient summed
over the sequence's devices; a reduce-scatter where the all-to-all gathers the rows of a bias
without heads): the sequence is not gathered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from attention_testing import ffi_calls, random_array
from test_context_parallel import COLLECTIVES, SPEC
from test_context_parallel_block_mask import _mesh, _segment_ids

B, N, K, H = 2, 4, 2, 16
BIAS_ROWS_SPEC = P(None, None, "seq", None)


def _inputs(seed: int, t: int, s: int, bias_shape, bias_dtype=jnp.float32, masked=True):
  """q, k, v, the cotangent g, a bias of `bias_shape` and (where `masked`) a (B, 1, T, S) mask
  with each row's key min(i, S - 1) visible but for one row of batch element 0 hidden whole."""
  rng = np.random.default_rng(seed)
  q = random_array(rng, (B, t, N, H), jnp.float32)
  k, v = (random_array(rng, (B, s, K, H), jnp.float32) for _ in range(2))
  g = random_array(rng, q.shape, jnp.float32)
  bias = random_array(rng, bias_shape, bias_dtype)
  mask = None
  if masked:
    m = rng.random((B, 1, t, s)) < 0.7
    m[:, :, np.arange(t), np.minimum(np.arange(t), s - 1)] = True
    m[0, 0, t // 3] = False
    mask = jnp.asarray(m)
  return q, k, v, g, bias, mask


def _attention(mask, context_parallel=None, **options):
  lens = {n: jnp.asarray(options.pop(n), jnp.int32) for n in list(options) if n.endswith("lengths")}

  def attention(q, k, v, bias, *ids):
    id_options = dict(q_segment_ids=ids[0], kv_segment_ids=ids[1]) if ids else {}
    return jax_flash.dot_product_attention(q, k, v, bias, mask, implementation="cpu",
                                           context_parallel=context_parallel, **lens, **options,
                                           **id_options)
  return attention


def _run(attention, q, k, v, bias, g, *ids) -> tuple[dict, str]:
  """out, dq, dk, dv, dbias (float64 numpy) of attention under jit, and the compiled HLO."""

  def results(q, k, v, bias, g, *ids):
    out, vjp = jax.vjp(lambda q, k, v, bias: attention(q, k, v, bias, *ids), q, k, v, bias)
    dq, dk, dv, dbias = vjp(g.astype(out.dtype))
    return dict(out=out, dq=dq, dk=dk, dv=dv, dbias=dbias)

  compiled = jax.jit(results).lower(q, k, v, bias, g, *ids).compile()
  got = compiled(q, k, v, bias, g, *ids)
  return ({n: np.asarray(jnp.asarray(x, jnp.float32), np.float64) for n, x in got.items()},
          compiled.as_text())


CASES = [
    # devices, context_parallel, T, S, bias shape, options, collectives of forward + backward
    (4, "ring", 256, 256, (B, N, 256, 256), dict(), {"collective-permute"}),
    (4, "ring:zigzag", 256, 256, (1, 1, 256, 256),
     dict(is_causal=True, query_seq_lengths=(256, 200), key_value_seq_lengths=(230, 256)),
     {"collective-permute"}),
    (2, "ring", 128, 192, (B, 1, 1, 192), dict(), {"collective-permute", "all-reduce"}),
    (4, "ring:zigzag", 256, 256, (1, N, 256, 1), dict(is_causal=True, ids=True),
     {"collective-permute"}),
    (4, "all_gather", 256, 384, (B, N, 256, 384), dict(),
     {"all-gather", "reduce-scatter"}),
    (4, "all_gather:zigzag", 256, 256, (B, 1, 256, 256), dict(is_causal=True, ids=True),
     {"all-gather", "reduce-scatter", "collective-permute"}),
    # the all-to-all: heads split, rows gathered (B N T S); rows gathered whole, the gradient
    # reduce-scattered (no heads); a head slice (no query dim: the gradient summed over the
    # devices)
    (2, "all_to_all", 128, 128, (B, N, 128, 128), dict(is_causal=True, ids=True),
     {"all-to-all"}),
    (4, "all_to_all", 256, 256, (1, 1, 256, 256), dict(query_seq_lengths=(256, 190)),
     {"all-to-all", "reduce-scatter"}),
    (4, "all_to_all", 256, 384, (B, N, 1, 384), dict(), {"all-to-all", "all-reduce"}),
    # automatic: a window leaves the all-to-all (the ring takes none; 4 heads split over 4)
    (4, None, 256, 256, (1, N, 256, 256), dict(local_window_size=(40, 8)), {"all-to-all"}),
    # automatic, causal: the ring in the zig-zag layout
    (2, None, 256, 256, (B, N, 256, 256), dict(is_causal=True), {"collective-permute"}),
]


@pytest.mark.parametrize(
    "devices,context_parallel,t,s,bias_shape,options,collectives", CASES,
    ids=[f"{d}dev-{c}-T{t}-S{s}-bias{'x'.join(map(str, b))}-{'-'.join(o) or 'full'}"
         for d, c, t, s, b, o, _ in CASES])
def test_jit_sequence_sharded_with_bias_and_mask(devices, context_parallel, t, s, bias_shape,
                                                 options, collectives):
  """The strategy runs with each device's rows of the arrays (the bias and mask passed as the
  caller has them, replicated) and gives the single-device results; the program holds only the
  strategy's collectives."""
  mesh = _mesh(devices)
  options = dict(options)
  with_ids = options.pop("ids", False)
  seed = devices * 100 + t + s + len(bias_shape) + len(options)
  q, k, v, g, bias, mask = _inputs(seed, t, s, bias_shape)
  ids = tuple(jnp.asarray(_segment_ids(seed, n, batch=B)) for n in (t, s)) if with_ids else ()
  want, _ = _run(_attention(mask, **dict(options)), q, k, v, bias, g, *ids)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  sharded = [put(x, SPEC) for x in (q, k, v, g)]
  got, hlo = _run(_attention(mask, context_parallel, **dict(options)), *sharded[:3], bias,
                  sharded[3], *(put(x, P(None, "seq")) for x in ids))
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
  if bias_shape[3] == 1:  # a per-query bias: the softmax cancels it
    assert np.all(got["dbias"] == 0)
  else:
    assert np.abs(want["dbias"]).max() > 1e-3
  empty = np.asarray(mask[0, 0].any(-1) == False)  # noqa: E712 (the rows hidden whole)
  assert empty.any() and np.all(got["out"][0, empty] == 0) and np.all(got["dq"][0, empty] == 0)
  assert set(COLLECTIVES.findall(hlo)) == collectives


def test_bias_rows_sharded_by_the_caller():
  """A bias whose query rows the caller already shards along the sequence: the same results,
  nothing moved for it (only the ring's collective-permutes)."""
  mesh = _mesh(4)
  q, k, v, g, bias, mask = _inputs(7, 256, 256, (B, N, 256, 256), masked=False)
  want, _ = _run(_attention(None), q, k, v, bias, g)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  got, hlo = _run(_attention(None, "ring"), *(put(x, SPEC) for x in (q, k, v)),
                  put(bias, BIAS_ROWS_SPEC), put(g, SPEC))
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
  assert set(COLLECTIVES.findall(hlo)) == {"collective-permute"}


@pytest.mark.parametrize("bias_shape", [(B, N, 256, 256), (B, 1, 1, 256)], ids=["BNTS", "B11S"])
def test_bfloat16_bias(bias_shape):
  """A bfloat16 bias: the output and dq, dk, dv as on one device; dbias within a bfloat16
  rounding of it (the two round the same float32 sums, which the ring forms in another order;
  a bias with no query dim is summed in float32 over the blocks and the devices, rounded once)."""
  mesh = _mesh(4)
  q, k, v, g, bias, mask = _inputs(11, 256, 256, bias_shape, jnp.bfloat16)
  want, _ = _run(_attention(mask), q, k, v, bias, g)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  got, _ = _run(_attention(mask, "ring"), *(put(x, SPEC) for x in (q, k, v)), bias, put(g, SPEC))
  for name in ("out", "dq", "dk", "dv"):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
  np.testing.assert_allclose(got["dbias"], want["dbias"], rtol=2 ** -7, atol=1e-6)
  assert np.abs(want["dbias"]).max() > 1e-3


SHARD_MAP_CASES = [
    # devices, strategy, layout, T, S, bias shape (global), options
    (4, "ring", "contiguous", 256, 256, (B, N, 256, 256), dict()),
    (4, "ring", "zigzag", 256, 256, (1, 1, 256, 256), dict(is_causal=True)),
    (2, "ring", "contiguous", 128, 192, (B, 1, 1, 192), dict()),
    (4, "all_gather", "zigzag", 256, 256, (B, 1, 256, 256), dict(is_causal=True)),
    (2, "all_gather", "contiguous", 128, 256, (1, N, 128, 256), dict(local_window_size=(24, 8))),
    (4, "all_to_all", "zigzag", 256, 256, (B, N, 256, 256), dict(is_causal=True)),
    (2, "all_to_all", "contiguous", 128, 128, (1, 1, 128, 128), dict(local_window_size=(24, 8))),
    (4, "all_to_all", "contiguous", 256, 256, (B, N, 1, 256), dict()),
    # jax_flash.ring_attention (the ring's own entry point) takes the same rows
    (4, "ring_attention", "zigzag", 256, 256, (B, 1, 256, 256), dict(is_causal=True)),
    (2, "ring_attention", "contiguous", 128, 192, (B, 1, 1, 192), dict()),
]


@pytest.mark.parametrize(
    "devices,strategy,layout,t,s,bias_shape,options", SHARD_MAP_CASES,
    ids=[f"{d}dev-{st}-{l}-T{t}-S{s}-bias{'x'.join(map(str, b))}-{'-'.join(o) or 'full'}"
         for d, st, l, t, s, b, o in SHARD_MAP_CASES])
def test_shard_map_strategies_with_bias_and_mask(devices, strategy, layout, t, s, bias_shape,
                                                 options):
  """context_parallel_attention (and ring_attention) inside shard_map, each device passing its
  rows of the bias and the mask (in the layout), against the single-device kernel: out, dq, dk, dv and dbias (a bias
  without the query dim passed whole to every device: shard_map sums its gradient)."""
  mesh = _mesh(devices)
  q, k, v, g, bias, mask = _inputs(devices + t + s, t, s, bias_shape)
  want, _ = _run(_attention(mask, **dict(options)), q, k, v, bias, g)
  order = jax_flash.zigzag_indices(t, devices) if layout == "zigzag" else np.arange(t)
  k_order = jax_flash.zigzag_indices(s, devices) if layout == "zigzag" else np.arange(s)
  bias_rows = bias_shape[2] != 1
  bias_spec = BIAS_ROWS_SPEC if bias_rows else P()

  def local(q, k, v, bias, mask):
    if strategy == "ring_attention":
      return jax_flash.ring_attention(q, k, v, axis_name="seq", layout=layout, bias=bias,
                                      mask=mask, implementation="cpu", **options)
    return jax_flash.context_parallel_attention(
        q, k, v, axis_name="seq", strategy=strategy, layout=layout, bias=bias, mask=mask,
        implementation="cpu", **options)

  sharded = jax.shard_map(local, mesh=mesh, in_specs=(SPEC, SPEC, SPEC, bias_spec, BIAS_ROWS_SPEC),
                          out_specs=SPEC)
  got, _ = _run(lambda q, k, v, bias: sharded(q, k, v, bias, mask[:, :, order]),
                q[:, order], k[:, k_order], v[:, k_order],
                bias[:, :, order] if bias_rows else bias, g[:, order])
  got = {n: (x[:, :, np.argsort(order)] if n == "dbias" and bias_rows else
             x[:, np.argsort(k_order)] if n in ("dk", "dv") else
             x if n == "dbias" else x[:, np.argsort(order)]) for n, x in got.items()}
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
  assert np.abs(want["dbias"]).max() > 1e-3


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "all_to_all"])
def test_shard_map_bias_nothing_differentiates_gets_no_dbias(strategy):
  """Inside shard_map, a bias that nothing differentiates (a constant of the loss) costs the
  backward kernels no dbias: each returns a (0,) result, as on one device, and dq, dk, dv are
  those of the call that differentiates the bias too (within the order of sums)."""
  devices, t = 2, 128
  mesh = _mesh(devices)
  q, k, v, g, bias, mask = _inputs(7, t, t, (B, N, t, t))

  def loss(q, k, v, bias):
    local = lambda q, k, v, bias, mask: jax_flash.context_parallel_attention(
        q, k, v, axis_name="seq", strategy=strategy, bias=bias, mask=mask, implementation="cpu")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(SPEC,) * 3 + (BIAS_ROWS_SPEC,) * 2,
                            out_specs=SPEC)
    return jnp.sum(sharded(q, k, v, bias, mask) * g)

  def backward_results(argnums):
    calls = ffi_calls(jax.grad(loss, argnums=argnums), q, k, v, bias)
    return [results for name, _, _, results in calls if "bwd" in name]

  without, with_dbias = backward_results((0, 1, 2)), backward_results((0, 1, 2, 3))
  assert without and len(without) == len(with_dbias)
  dbias = 5  # the kernel's dbias result (as test_bias_mask_kernel reads it)
  assert all(tuple(results[dbias].shape) == (0,) for results in without)
  assert all(len(results[dbias].shape) == 4 for results in with_dbias)  # the strategy's cut
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, bias)
  grads_too = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)[:3]
  for a, b in zip(grads, grads_too):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_shard_map_cuda_mask_skips_its_hidden_blocks(monkeypatch):
  """Inside shard_map on the "cuda" kernels (traced on a simulated CUDA host, the arrays' switch
  patched on), a mask's rows go to each block pair's kernel as its bits, with the blocks the
  mask hides whole as a block mask over the whole sequence's key blocks (here the causal
  mask's upper blocks: the kernels' block_sparse attribute, and the ring skips the pair above
  the diagonal); slices that are not whole 128-row blocks are refused, naming the reason."""
  from attention_testing import simulate_cuda_host
  from jax_flash import _dispatch, _logit_arrays
  simulate_cuda_host(monkeypatch)
  monkeypatch.setattr(_logit_arrays, "_CUDA_LOGIT_ARRAYS", True)
  monkeypatch.setattr(_dispatch, "_check_cuda_runs", lambda: None)
  mesh = _mesh(2)

  def calls(t):
    q = jnp.ones((1, t, N, 64), jnp.bfloat16)
    mask = jnp.tril(jnp.ones((1, 1, t, t), bool))
    local = lambda q, mask: jax_flash.context_parallel_attention(
        q, q, q, axis_name="seq", strategy="ring", mask=mask, implementation="cuda")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(SPEC, BIAS_ROWS_SPEC), out_specs=SPEC)
    return ffi_calls(lambda q: sharded(q, mask).astype(jnp.float32).sum(), q)

  found = calls(512)
  forward = [(attributes, operands) for name, attributes, operands, _ in found
             if name == "jax_flash_cuda_fwd"]
  assert forward
  for attributes, operands in forward:  # each pair: 256 query rows, 256 keys of bits
    assert bool(attributes["mask"]) and bool(attributes["block_sparse"])
    assert ((1, 1, 256, 8), jnp.dtype(jnp.uint32)) in {(tuple(x.shape), jnp.dtype(x.dtype))
                                                      for x in operands}
  with pytest.raises(NotImplementedError, match="whole 128-row blocks"):
    calls(128)
