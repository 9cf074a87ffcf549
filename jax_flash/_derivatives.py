"""The derivatives jax_flash's kernels do not have, refused in jax_flash's words.

The kernels' derivative is a ``jax.custom_vjp`` whose backward pass is another custom call: one
reverse-mode derivative, nothing more. JAX's own errors for the rest name neither jax_flash nor
what to do ("Differentiation rule for 'custom_partitioning' not implemented", "can't apply
forward-mode autodiff (jvp) to a custom_vjp function."); these helpers replace them where
public APIs allow:

* second and higher derivatives differentiate the kernel ops themselves (the custom VJP's
  forward and backward passes): :func:`first_order_only` gives each op a JVP rule that raises
  :data:`HIGHER_ORDER_MESSAGE` at trace time, under ``jit`` too;
* forward mode (``jax.jvp``, ``jax.jacfwd``) fails inside JAX when it evaluates the custom
  VJP's tangents: :func:`explain_forward_mode` rewords that error where it surfaces in
  jax_flash's call (eager evaluation). Under ``jit`` JAX raises it while compiling, outside
  any jax_flash code, and its own message stands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

HIGHER_ORDER_MESSAGE = (
    "jax_flash: the kernels' backward pass cannot be differentiated: second and higher "
    "derivatives (jax.grad of jax.grad, jax.hessian, jax.jacfwd of jax.grad) of "
    "jax_flash.dot_product_attention and ring_attention are not supported on the 'cpu' and "
    "'cuda' kernels. Take one reverse-mode derivative (jax.grad, jax.vjp, jax.jacrev), or pass "
    "implementation='blockwise' (FlashAttention in XLA) or 'xla' for higher derivatives")

# JAX's message when it evaluates a custom_vjp function's tangents (jax 0.10 and 0.11).
_JAX_FORWARD_MODE_ERROR = "forward-mode autodiff (jvp) to a custom_vjp"


def first_order_only(op: Callable, nondiff_argnums: tuple[int, ...] = ()) -> Callable:
  """`op` (a kernel op used inside a custom VJP; `nondiff_argnums` are its static arguments)
  with a JVP rule that refuses: differentiating it is what a second derivative of the attention
  does."""
  guarded = jax.custom_jvp(op, nondiff_argnums=nondiff_argnums)

  def refuse(*args):
    del args  # (static args..., primals, tangents): nothing to compute
    raise NotImplementedError(HIGHER_ORDER_MESSAGE)

  guarded.defjvp(refuse)
  return guarded


def forward_mode_message(caller: str, implementation: str) -> str:
  return (
      f"{caller}: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize) is not "
      f"supported on implementation {implementation!r}: its derivative is a custom_vjp, "
      "reverse mode only. Use jax.grad, jax.vjp or jax.jacrev, or implementation='xla' (plain "
      "XLA, differentiable in either mode)")


@contextlib.contextmanager
def explain_forward_mode(caller: str, implementation: str) -> Iterator[None]:
  """Re-raises JAX's forward-mode error from a custom VJP inside the block as a TypeError (the
  type JAX uses) that names jax_flash and what to use instead."""
  try:
    yield
  except TypeError as e:
    if _JAX_FORWARD_MODE_ERROR not in str(e):
      raise
    raise TypeError(forward_mode_message(caller, implementation)) from e


# Helpers of the custom VJPs defined with symbolic zeros (``defvjp(..., symbolic_zeros=True)``):
# their forward rules see which primals something differentiates, so that the backward forms
# only those gradients (a constant bias costs the backward no dbias).


def primal_values(primals):
  """The values of the primals a symbolic-zeros forward rule gets (CustomVJPPrimal leaves)."""
  return jax.tree.map(lambda primal: primal.value, primals)


def wants_gradient(primal) -> tuple:
  """Whether the backward forms the gradient of `primal` (a CustomVJPPrimal or None), as a
  residual: (None,) where something differentiates it (`perturbed`), () otherwise (static:
  the tuple's length)."""
  return (None,) if primal is not None and primal.perturbed else ()


def cotangent_array(cotangent):
  """A cotangent as an array (a SymbolicZero where it is zero becomes zeros)."""
  if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
    return jnp.zeros(cotangent.shape, cotangent.dtype)
  return cotangent
