"""jax_flash under JAX transformations: jit, grad, vmap, checkpoint (remat), and the default
implementation. Single calls are checked against the references in test_forward_backward; here
transformed calls are checked against untransformed ones."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_testing import Case, check_against_references, random_array, run_jax_flash

import jax_flash

F32 = jnp.float32
OPTIONS = dict(is_causal=True, local_window_size=(40, 5))


def attention(q, k, v, implementation="cpu", **options):
  return jax_flash.dot_product_attention(q, k, v, implementation=implementation, **options)


def loss(q, k, v, g, **options):
  return jnp.sum(attention(q, k, v, **options).astype(F32) * g)


grad = jax.grad(loss, argnums=(0, 1, 2))


def assert_close(got, want, name=""):
  """Equal up to float32 round-off (e.g. the backward's dQ split count depends on the batch
  size, which changes the summation order): max|got - want| <= 1e-5 max|want| + 1e-6."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (name, got.shape, want.shape)
  err = np.max(np.abs(got - want))
  assert err <= 1e-5 * np.max(np.abs(want)) + 1e-6, f"{name}: max abs error {err:.3g}"


def assert_same(got, want, name=""):
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


def make_inputs(rng, lead=(2,), seq_q=70, seq_k=90, heads_q=4, heads_k=2, head_dim=40,
                dtype=F32):
  q = random_array(rng, (*lead, seq_q, heads_q, head_dim), dtype)
  k = random_array(rng, (*lead, seq_k, heads_k, head_dim), dtype)
  v = random_array(rng, (*lead, seq_k, heads_k, head_dim), dtype)
  g = random_array(rng, q.shape, F32)
  return q, k, v, g


def test_jit_matches_eager(rng):
  q, k, v, g = make_inputs(rng)
  lens = dict(query_seq_lengths=jnp.array([70, 33], jnp.int32),
              key_value_seq_lengths=jnp.array([0, 61], jnp.int32))
  assert_same(jax.jit(functools.partial(attention, **OPTIONS, **lens))(q, k, v),
              attention(q, k, v, **OPTIONS, **lens))
  for got, want in zip(jax.jit(functools.partial(grad, **OPTIONS, **lens))(q, k, v, g),
                       grad(q, k, v, g, **OPTIONS, **lens)):
    assert_same(got, want)


def test_jit_with_traced_lengths():
  """Lengths are runtime values: one compiled function serves different lengths correctly."""
  base = Case(batch=3, seq_q=70, seq_k=90, heads_q=4, heads_k=2, head_dim=40, is_causal=True)
  q, k, v, g = base.inputs()

  traces = []

  @jax.jit
  def run(q_lens, kv_lens):
    traces.append(1)
    return grad(q, k, v, g, is_causal=True, query_seq_lengths=q_lens,
                key_value_seq_lengths=kv_lens), attention(
                    q, k, v, is_causal=True, query_seq_lengths=q_lens,
                    key_value_seq_lengths=kv_lens, return_residual=True)

  for q_lens, kv_lens in [((70, 12, 0), (90, 0, 50)), ((5, 70, 70), (1, 90, 77))]:
    (dq, dk, dv), (out, lse) = run(jnp.array(q_lens, jnp.int32), jnp.array(kv_lens, jnp.int32))
    case = dataclasses.replace(base, q_lens=q_lens, kv_lens=kv_lens)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    check_against_references(case, {n: np.asarray(x, np.float64) for n, x in got.items()})
  assert len(traces) == 1


def test_grad_eager_matches_jit_reference_run():
  """jax.grad outside jit gives what the jitted value_and_grad of the grid tests gives."""
  case = Case(batch=2, seq_q=70, seq_k=90, heads_q=4, heads_k=2, head_dim=40, is_causal=True,
              kv_lens=(90, 20))
  q, k, v, g = case.inputs()
  dq, dk, dv = grad(q, k, v, g, **case.options())
  jitted = run_jax_flash(case, "cpu")
  for name, x in zip(("dq", "dk", "dv"), (dq, dk, dv)):
    assert_same(np.asarray(x, np.float64), jitted[name], name)


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16])
def test_vmap_leading_axis(rng, dtype):
  """vmap over an extra leading axis (query, key, value and lengths all mapped) equals the
  per-slice calls."""
  q, k, v, g = make_inputs(rng, lead=(3, 2), dtype=dtype)
  q_lens = jnp.array([[70, 40], [0, 70], [69, 1]], jnp.int32)
  kv_lens = jnp.array([[90, 0], [17, 90], [64, 65]], jnp.int32)

  def fwd(q, k, v, ql, kl):
    return attention(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl,
                     return_residual=True, **OPTIONS)

  def bwd(q, k, v, g, ql, kl):
    return grad(q, k, v, g, query_seq_lengths=ql, key_value_seq_lengths=kl, **OPTIONS)

  out, lse = jax.vmap(fwd)(q, k, v, q_lens, kv_lens)
  grads = jax.vmap(bwd)(q, k, v, g, q_lens, kv_lens)
  for i in range(q.shape[0]):
    out_i, lse_i = fwd(q[i], k[i], v[i], q_lens[i], kv_lens[i])
    assert_same(out[i], out_i, "out")  # the forward is independent of the batch size
    assert_same(lse[i], lse_i, "lse")
    for name, got, want in zip("qkv", grads, bwd(q[i], k[i], v[i], g[i], q_lens[i], kv_lens[i])):
      assert got.dtype == dtype
      assert_close(got[i].astype(F32), want.astype(F32), "d" + name)


def test_vmap_query_only(rng):
  """in_axes=(0, None, None): many queries against one unbatched key/value set."""
  q, k, v, g = make_inputs(rng, lead=(3, 2))
  k, v = k[0], v[0]
  out = jax.vmap(functools.partial(attention, **OPTIONS), in_axes=(0, None, None))(q, k, v)
  grads = jax.vmap(functools.partial(grad, **OPTIONS), in_axes=(0, None, None, 0))(q, k, v, g)
  summed = jax.grad(lambda q, k, v: sum(loss(q[i], k, v, g[i], **OPTIONS) for i in range(3)),
                    argnums=(0, 1, 2))(q, k, v)
  for i in range(3):
    assert_same(out[i], attention(q[i], k, v, **OPTIONS), "out")
    for name, got, want in zip("qkv", grads, grad(q[i], k, v, g[i], **OPTIONS)):
      assert_close(got[i], want, "d" + name)
  # Gradient of the vmapped function with respect to the shared key/value: summed over queries.
  vmapped_loss = lambda q, k, v: jnp.sum(jax.vmap(
      functools.partial(loss, **OPTIONS), in_axes=(0, None, None, 0))(q, k, v, g))
  for name, got, want in zip("qkv", jax.grad(vmapped_loss, argnums=(0, 1, 2))(q, k, v), summed):
    assert_close(got, want, "d" + name)


def test_vmap_of_unbatched_inputs(rng):
  """vmap over rank-3 (T, N, H) inputs is the rank-4 call."""
  q, k, v, g = make_inputs(rng, lead=(3,))
  assert_same(jax.vmap(functools.partial(attention, **OPTIONS))(q, k, v),
              attention(q, k, v, **OPTIONS))
  for got, want in zip(jax.vmap(functools.partial(grad, **OPTIONS))(q, k, v, g),
                       grad(q, k, v, g, **OPTIONS)):
    assert_close(got, want)


def test_nested_vmap(rng):
  q, k, v, g = make_inputs(rng, lead=(2, 3, 2), seq_q=20, seq_k=30)
  out = jax.vmap(jax.vmap(functools.partial(attention, **OPTIONS)))(q, k, v)
  assert_same(out, attention(q.reshape(12, 20, 4, 40), k.reshape(12, 30, 2, 40),
                             v.reshape(12, 30, 2, 40), **OPTIONS).reshape(q.shape))


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable,
                                    jax.checkpoint_policies.everything_saveable])
def test_checkpoint_inside_grad(rng, policy):
  q, k, v, g = make_inputs(rng)
  remat = jax.checkpoint(functools.partial(attention, **OPTIONS), policy=policy)
  remat_grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(remat(q, k, v) * g),
                                 argnums=(0, 1, 2)))(q, k, v)
  for name, got, want in zip("qkv", remat_grads, grad(q, k, v, g, **OPTIONS)):
    assert_same(got, want, "d" + name)  # the recomputed forward is bit-identical


def test_return_residual_under_jit(rng):
  q, k, v, _ = make_inputs(rng)
  kv_lens = jnp.array([90, 0], jnp.int32)
  f = functools.partial(attention, key_value_seq_lengths=kv_lens, return_residual=True,
                        **OPTIONS)
  out, lse = jax.jit(f)(q, k, v)
  assert lse.shape == q.shape[:-1] and lse.dtype == jnp.float32
  want_out, want_lse = f(q, k, v)
  assert_same(out, want_out)
  assert_same(lse, want_lse)
  assert_same(out, attention(q, k, v, key_value_seq_lengths=kv_lens, **OPTIONS))
  # lse is under stop_gradient, as in jax.nn.
  for d in jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[1][0]), argnums=(0, 1, 2)))(
      q, k, v):
    assert not np.any(np.asarray(d))


def test_rank3_return_residual_shape(rng):
  q, k, v, _ = make_inputs(rng, lead=())
  out, lse = jax.jit(functools.partial(attention, return_residual=True))(q, k, v)
  assert out.shape == q.shape and lse.shape == q.shape[:-1]


def test_default_implementation_is_cpu_kernel_bit_for_bit(rng):
  if jax.default_backend() != "cpu":
    pytest.skip("the default implementation is the CPU kernel only on CPU hosts")
  q, k, v, g = make_inputs(rng, dtype=jnp.bfloat16)
  lens = dict(key_value_seq_lengths=jnp.array([90, 7], jnp.int32))
  for implementation in ("cpu", None):
    out, lse = attention(q, k, v, implementation=implementation, return_residual=True,
                         **OPTIONS, **lens)
    grads = grad(q, k, v, g, implementation=implementation, **OPTIONS, **lens)
    if implementation == "cpu":
      want = (out, lse, *grads)
  for got, w in zip((out, lse, *grads), want):
    assert_same(got, w)
  # And what runs is the kernel's custom call, not the plain reference path.
  hlo = jax.jit(jax.grad(functools.partial(loss, implementation=None), argnums=(0, 1, 2))).lower(
      q, k, v, g).as_text()
  assert "jax_flash_cpu_fwd" in hlo and "jax_flash_cpu_bwd" in hlo


def test_higher_order_and_forward_mode_refuse_loudly(rng):
  """Second derivatives and forward mode are not implemented (custom_vjp over FFI calls): JAX
  must refuse with an error, never return made-up numbers."""
  q, k, v, g = make_inputs(rng, seq_q=8, seq_k=8)
  # The backward's custom call sits inside custom_partitioning, which has no derivative rule.
  with pytest.raises((ValueError, NotImplementedError),
                     match="cannot be differentiated|Differentiation rule .* not implemented"):
    jax.grad(lambda q: jnp.sum(grad(q, k, v, g)[0]))(q)
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda q: attention(q, k, v), (q,), (q,))


def test_second_derivatives_name_jax_flash(rng):
  """A second derivative on the kernels raises at trace time (under jit too) with a message that
  names jax_flash and what to do, not JAX's "Differentiation rule for 'custom_partitioning' not
  implemented"; so does differentiating the backward pass alone (through the cotangent)."""
  q, k, v, g = make_inputs(rng, lead=(1,), seq_q=5, seq_k=6, heads_q=2, heads_k=1, head_dim=8)
  f = lambda q: loss(q, k, v, g, **OPTIONS)
  grad_of_grad = jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2))
  through_cotangent = jax.grad(lambda g: jnp.sum(grad(q, k, v, g)[0]))
  message = "jax_flash.*second and higher derivatives.*implementation='blockwise'"
  for second, x in ((grad_of_grad, q), (jax.hessian(f), q), (through_cotangent, g)):
    for wrapped in (second, jax.jit(second)):
      with pytest.raises(NotImplementedError, match=message):
        wrapped(x)


def test_second_derivatives_on_the_xla_paths():
  """What the message above points to: the blockwise path has second derivatives, equal to the
  plain reference's."""
  rng = np.random.default_rng(3)
  q, k, v, g = make_inputs(rng, lead=(1,), seq_q=5, seq_k=6, heads_q=2, heads_k=1, head_dim=8)

  def grad_of_grad(implementation):
    f = lambda q: loss(q, k, v, g, implementation=implementation, **OPTIONS)
    return jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2))(q)

  want = grad_of_grad("xla")
  assert_close(grad_of_grad("blockwise"), want)
  assert np.max(np.abs(np.asarray(want))) > 0


@pytest.mark.parametrize("implementation", ["cpu", "blockwise"])
def test_forward_mode_names_jax_flash_where_jax_lets_it(rng, implementation):
  """Forward mode on a custom_vjp fails inside JAX. Evaluated eagerly (jax.jvp, jax.jacfwd on
  concrete values) the error surfaces in jax_flash's call and is reworded; under jit JAX raises
  its own message while compiling, outside jax_flash's code. Either way a TypeError, never
  numbers; the plain reference ("xla") differentiates in forward mode."""
  q, k, v, _ = make_inputs(rng, lead=(1,), seq_q=5, seq_k=6, heads_q=2, heads_k=1, head_dim=8)
  f = lambda q: attention(q, k, v, implementation=implementation)
  message = (f"jax_flash.dot_product_attention: forward-mode differentiation.*"
             f"'{implementation}'.*jax.grad.*implementation='xla'")
  with pytest.raises(TypeError, match=message):
    jax.jvp(f, (q,), (q,))
  with pytest.raises(TypeError, match=message):
    jax.jacfwd(f)(q)
  with pytest.raises(TypeError, match="forward-mode|custom_vjp"):
    jax.jit(lambda q: jax.jvp(f, (q,), (q,)))(q)
  out, tangent = jax.jvp(lambda q: attention(q, k, v, implementation="xla"), (q,), (q,))
  assert tangent.shape == out.shape


def test_deterministic_flag_on_cpu():
  """The CPU backward is always deterministic: the flag is accepted and changes nothing."""
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 70, 4, 24)), jnp.float32) for _ in range(3))

  def grads(deterministic):
    loss = lambda q, k, v: jnp.sum(jax_flash.dot_product_attention(
        q, k, v, is_causal=True, implementation="cpu", deterministic=deterministic) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  for a, b in zip(grads(False), grads(True)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_deterministic_must_be_bool():
  x = jnp.ones((1, 4, 1, 8))
  with pytest.raises(ValueError, match="deterministic"):
    jax_flash.dot_product_attention(x, x, x, deterministic="yes")
