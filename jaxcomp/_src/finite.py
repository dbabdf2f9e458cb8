"""The one non-finite policy of every jaxcomp compressor.

On a step whose gradient holds a NaN or an infinity on any device:

1. the compressor's state is left exactly as it was (error feedback, Q, momenta, counts): torch's
   PowerSGD is poisoned forever by one such step, jaxcomp's compressors are not;
2. every floating-point output leaf is NaN, on every device alike, so that a guard after the
   compressor (``optax.apply_if_finite``, a loss scaler, ``jaxcomp.skip_if_nonfinite``) skips the step
   on every device together.

The decision is taken from ``all_finite``, one 4-byte all-reduce, and so is the same on every device —
which it must be: a decision taken per device around a collective (``optax.apply_if_finite`` wrapped
around a compressor) makes one device skip collectives the others wait in. The stateless dense means
(``allreduce``, ``fp16_compress``, ``bf16_compress``) need no flag: a NaN on one device makes that
coordinate of the mean NaN on every device by itself.

The compressor adapter (``compressor.py``) applies the policy to every algorithm, ``comm_hook`` to
every stateful hook: the helpers below are its pieces.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxcomp._src import axis, kernels
from jaxcomp._src import tree as tree_lib


def all_finite(tree, axis_name: axis.AxisName) -> jax.Array:
  """A boolean scalar, the same on every device: is every leaf finite on every device?"""
  leaves = [x for x in jax.tree.leaves(tree) if tree_lib.is_reduced(x)]
  local_bad = sum(_not_finite(x).astype(jnp.int32) for x in leaves)
  return axis.psum(jnp.asarray(local_bad, jnp.int32), axis_name) == 0


def _not_finite(x: jax.Array) -> jax.Array:
  """Whether the floating-point ``x`` holds a NaN or an infinity: ``sum(x · 0)`` is NaN iff it
  does (∞ · 0 is NaN, and a sum propagates NaN), one fused pass over ``x``.

  Not ``max |x|``: XLA:CPU (jaxlib 0.10.2) reduces arrays of 4,096 elements or more with a ``max``
  that drops NaN (``jnp.max(jnp.abs(x))`` of a 4,096-element array with one NaN is 1.0), so a NaN
  in any large gradient went unseen. ``isfinite(x).all()`` is right too, but writes a boolean array
  before it reduces it.
  """
  return jnp.isnan(jnp.sum(x * jnp.zeros((), x.dtype)))


def keep_if_finite(finite: jax.Array, new_state, old_state):
  """Policy 1: ``new_state`` where ``finite``, else ``old_state`` (leaf by leaf)."""
  return jax.tree.map(functools.partial(kernels.where, finite), new_state, old_state)


def nan_unless_finite(finite: jax.Array, tree):
  """Policy 2: ``tree`` where ``finite``, else NaN in every floating-point leaf.

  Apply it where it is cheapest: to a small factor the output is made of (PowerSGD's Q), or to the
  outputs themselves.
  """
  return tree_lib.map_reduced(lambda x: jnp.where(finite, x, jnp.asarray(jnp.nan, x.dtype)), tree)


def gated(finite: jax.Array, outputs, new_state, old_state) -> tuple:
  """Both parts of the policy: ``(outputs or NaN, new_state or old_state)``."""
  return nan_unless_finite(finite, outputs), keep_if_finite(finite, new_state, old_state)
