"""The one non-finite policy of jaxcomp: what every transformation does with a NaN or an infinity.

**A cross-device mean** (every compressor through the adapter, ``comm_hook``'s stateful hooks,
``skip_if_nonfinite``), on a step whose gradient holds a NaN or an infinity on any device:

1. the state is left exactly as it was (error feedback, Q, momenta, counts): torch's PowerSGD is
   poisoned forever by one such step, jaxcomp's compressors are not;
2. every floating-point output leaf is NaN, on every device alike, so that a guard after the
   compressor (``optax.apply_if_finite``, a loss scaler, ``jaxcomp.skip_if_nonfinite``) skips the
   step on every device together.

The decision is the same on every device — which it must be: a decision taken per device around a
collective (``optax.apply_if_finite`` wrapped around a compressor) makes one device skip collectives
the others wait in. It comes from ``all_finite``, one 4-byte all-reduce, or, at no cost, from values
the algorithm already reduced over the devices (``reduced_finite``: a NaN anywhere in the gradient
reaches every device's copy of an all-reduced product or sum). ``guarded`` applies it to a step:
skipped by a conditional (``"skip"``), or run with its results replaced (``"select"``). The
stateless dense means need no flag: a NaN on one device makes that coordinate of the mean NaN on
every device by itself.

**Local steps** (``local_sgd``, ``diloco``, ``streaming_diloco``, ``sparseloco``), which run the
inner optimizer on each device's own gradient between synchronizations:

3. a device whose new parameters are not finite after its inner step keeps its parameters and its
   inner state (``kept_locally``). The decision is this device's alone and needs no collective — a
   local step runs none that the devices must keep in step — so the other devices go on, and the
   next synchronization, to which the device brings its unchanged (finite) parameters, brings it
   back. A NaN on one device never reaches the average;
4. an outer step whose result is not finite (the average overflowed) keeps the synchronized
   parameters and the outer optimizer's state (``keep_if_finite``); its inputs are the same on
   every device, so the decision is too.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._src import axis, kernels, phases
from jaxcomp._src import tree as tree_lib


def _not_finite(x: jax.Array) -> jax.Array:
  """Whether the floating-point ``x`` holds a NaN or an infinity: ``sum(x · 0)`` is NaN iff it
  does (∞ · 0 is NaN, and a sum propagates NaN), one fused pass over ``x``.

  Not ``max |x|``: XLA:CPU (jaxlib 0.10.2) reduces arrays of 4,096 elements or more with a ``max``
  that drops NaN (``jnp.max(jnp.abs(x))`` of a 4,096-element array with one NaN is 1.0), so a NaN
  in any large gradient went unseen. ``isfinite(x).all()`` is right too, but writes a boolean array
  before it reduces it.
  """
  return jnp.isnan(jnp.sum(x * jnp.zeros((), x.dtype)))


def reduced_finite(tree) -> jax.Array:
  """A boolean scalar: is every reduced leaf of ``tree`` finite here? No collective: for values the
  same on every device (an all-reduced sum), this is the all-device flag, free."""
  leaves = [x for x in jax.tree.leaves(tree) if tree_lib.is_reduced(x)]
  return sum((_not_finite(x).astype(jnp.int32) for x in leaves), jnp.zeros([], jnp.int32)) == 0


def all_finite(tree, axis_name: axis.AxisName) -> jax.Array:
  """A boolean scalar, the same on every device: is every leaf finite on every device? One 4-byte
  all-reduce."""
  local_bad = (~reduced_finite(tree)).astype(jnp.int32)
  return axis.psum(local_bad, axis_name) == 0


def keep_if_finite(finite: jax.Array, new_state, old_state):
  """1 and 4: ``new_state`` where ``finite``, else ``old_state`` (leaf by leaf, in place)."""
  return jax.tree.map(functools.partial(kernels.where, finite), new_state, old_state)


def nan_unless_finite(finite: jax.Array, tree):
  """2: ``tree`` where ``finite``, else NaN in every floating-point leaf.

  Apply it where it is cheapest: to a small factor the output is made of (PowerSGD's Q), or to the
  outputs themselves.
  """
  return tree_lib.map_reduced(lambda x: jnp.where(finite, x, jnp.asarray(jnp.nan, x.dtype)), tree)


def gated(finite: jax.Array, outputs, new_state, old_state) -> tuple:
  """1 and 2: ``(outputs or NaN, new_state or old_state)``."""
  return nan_unless_finite(finite, outputs), keep_if_finite(finite, new_state, old_state)


def nan_outputs(shape_of: Callable, leaves: list) -> list:
  """2 for a step that did not run: NaN of ``shape_of(leaf)`` for every output."""
  return [jnp.full(shape_of(x), jnp.nan, x.dtype) for x in leaves]


def guarded(how: str, finite: jax.Array, run: Callable, shape_of: Callable, state,
            leaves: list) -> tuple:
  """1–2 around ``run(state, leaves) -> (outputs, new_state)``, given the all-device flag.

  ``how``: ``"skip"``, a ``lax.cond`` that does not run the step on a non-finite one (no
  collectives; with the state donated, XLA updates it in place inside the branch); or
  ``"select"``, the step runs and its results are replaced (``gated``) — for steps XLA:CPU
  compiles worse inside a conditional branch (``compressor.MeanConfig.NONFINITE``).
  ``shape_of(leaf)`` is the shape of its output.
  """
  if how == "skip":
    return lax.cond(finite, run, lambda s, g: (nan_outputs(shape_of, g), s), state, leaves)
  outputs, new_state = run(state, leaves)
  with kernels.part("nonfinite"):
    return gated(finite, outputs, new_state, state)


def kept_locally(new, old) -> tuple:
  """3: ``new`` (a tuple: this device's new parameters and inner state), or ``old`` where the new
  parameters (``new[0]``) are not finite on this device. No collective.

  A loop that restores the old values on the rare step that needs it (``phases.when``) leaves the
  new ones where the update wrote them; a select (``keep_if_finite``) reads and writes both once
  more.
  """
  ok = reduced_finite(new[0])
  return phases.when(~ok, None, lambda *_: tuple(old), *new)
