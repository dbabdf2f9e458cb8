"""``skip_if_nonfinite``: ``optax.apply_if_finite`` for chains that communicate.

``optax.apply_if_finite`` wrapped around a jaxcomp compressor takes its decision on each device
alone: a device whose gradient is non-finite skips the compressor's collectives while the others
wait in them, and the job hangs. ``skip_if_nonfinite`` takes the decision from ``jaxcomp``'s
all-device finiteness flag (one 4-byte all-reduce), so every device skips or applies the step
together, and the inner transformation's collectives run on all of them or on none.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp._src import axis, finite, local_steps, validate
from jaxcomp._src import tree as tree_lib


class SkipIfNonfiniteState(NamedTuple):
  """State of ``skip_if_nonfinite``: ``optax.ApplyIfFiniteState``'s fields, the same on every
  device.

  Attributes:
    notfinite_count: consecutive steps skipped so far (int32).
    last_finite: whether the last step's gradient was finite on every device.
    total_notfinite: steps skipped in all (int32).
    inner_state: the inner transformation's state, kept as it was on a skipped step.
    signature: the gradient pytree's signature.
  """
  notfinite_count: jax.Array
  last_finite: jax.Array
  total_notfinite: jax.Array
  inner_state: Any
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ()  # the inner state declares its own (see jaxcomp.state_partition_specs)


def skip_if_nonfinite(inner: optax.GradientTransformation, max_consecutive_errors: int, *,
                      axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """Skips the step on every device together when the gradient is non-finite on any of them.

  Use it in place of ``optax.apply_if_finite`` around a chain that starts with a jaxcomp
  compressor::

    tx = jaxcomp.skip_if_nonfinite(
        optax.chain(jaxcomp.powersgd(rank=2), optax.adamw(1e-3)), max_consecutive_errors=10)

  On a step whose gradient holds a NaN or an infinity on any device, the update leaves the
  parameters as they are (zero; ``Assign`` of the parameters for an optimizer that sets them, such
  as ``jaxcomp.diloco``) and the inner state is kept, on every device alike; after more than
  ``max_consecutive_errors`` such steps in a row the update is applied anyway, as
  ``optax.apply_if_finite`` does. The decision comes from one 4-byte all-reduce of a flag, the same
  on every device, so the inner transformation (and its collectives) runs on every device or on
  none.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = jaxcomp.skip_if_nonfinite(optax.chain(jaxcomp.allreduce(), optax.sgd(0.1)), 3)
    >>> grads = jnp.ones((8, 4)).at[3, 0].set(jnp.nan)  # a NaN on device 3 only
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> updates, state = jax.pmap(tx.update, axis_name="batch")(grads, state)
    >>> bool((updates == 0).all()), int(state.total_notfinite[0])  # skipped on every device
    (True, 1)

  Args:
    inner: the transformation to guard, normally a chain that starts with a jaxcomp compressor.
    max_consecutive_errors: how many non-finite steps in a row are skipped before one is applied.
    axis_name: the mapped axis the gradient is spread over: the compressor's ``axis_name``.

  Returns:
    A ``GradientTransformation`` whose state is a ``SkipIfNonfiniteState``.

  References:
    ``optax.apply_if_finite``, whose semantics (and state fields) it keeps.
  """
  inner = validate.transformation(inner, "inner",
                                  "optax.chain(jaxcomp.powersgd(rank=2), optax.adamw(1e-3))")
  max_consecutive_errors = validate.integer(max_consecutive_errors, "max_consecutive_errors", 0)
  axis_name = axis.check_axis_name(axis_name)

  def init_fn(params):
    return SkipIfNonfiniteState(jnp.zeros([], jnp.int32), jnp.array(True), jnp.zeros([], jnp.int32),
                                inner.init(params), tree_lib.TreeSignature.of(params))

  def update_fn(updates, state: SkipIfNonfiniteState, params=None):
    tree_lib.check_state(state, init_fn, "skip_if_nonfinite")
    state.signature.check(updates)
    finite_everywhere = finite.all_finite(updates, axis_name)
    notfinite_count = jnp.where(finite_everywhere, 0, state.notfinite_count + 1)

    def apply():
      return inner.update(updates, state.inner_state, params)

    def skip():
      shapes = jax.eval_shape(inner.update, updates, state.inner_state, params)[0]
      return local_steps.unchanged(shapes, params), state.inner_state

    new_updates, inner_state = lax.cond(
        finite_everywhere | (notfinite_count > max_consecutive_errors), apply, skip)
    return new_updates, SkipIfNonfiniteState(
        notfinite_count, finite_everywhere,
        state.total_notfinite + (~finite_everywhere).astype(jnp.int32), inner_state,
        state.signature)

  return optax.GradientTransformation(init_fn, update_fn)
