"""Named-axis helpers: every collective jaxcomp runs goes through this module.

A jaxcomp transformation names the mapped axis it averages over (pmap's ``axis_name``, a ``shard_map``
mesh axis, or a tuple of them). Inside a mapped context the helpers below are ``jax.lax`` collectives;
outside one (a plain ``jit`` in a notebook) the axis is unbound and they act as a world of size 1, so the
compression still runs and its effect on training can be studied on one device. That fallback warns once
per axis name; ``axis_name=None`` asks for it explicitly and silently.
"""

from __future__ import annotations

import warnings
from typing import Any, Hashable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AxisName = Optional[Union[Hashable, tuple]]

_warned_unbound: set = set()


def check_axis_name(axis_name: Any) -> AxisName:
  """Validates ``axis_name`` (a str, a non-empty tuple of str, or None) and returns it.

  Raises:
    TypeError: naming ``axis_name`` and what was wrong with it.
  """
  if axis_name is None or isinstance(axis_name, str):
    return axis_name
  if isinstance(axis_name, tuple) and axis_name and all(isinstance(a, str) for a in axis_name):
    return axis_name
  raise TypeError(
      "axis_name must be a str, a non-empty tuple of str, or None (world size 1); "
      f"got {axis_name!r} of type {type(axis_name).__name__}")


def bound_axis(axis_name: AxisName) -> AxisName:
  """Returns ``axis_name`` if it is bound in the current trace, else None (warning once)."""
  if axis_name is None:
    return None
  try:
    lax.axis_size(axis_name)
  except NameError:
    if axis_name not in _warned_unbound:
      _warned_unbound.add(axis_name)
      warnings.warn(
          f"jaxcomp: axis {axis_name!r} is not bound here (not inside pmap/shard_map over it); "
          "running as world size 1. Pass axis_name=None to do this without the warning.",
          stacklevel=3)
    return None
  return axis_name


def axis_size(axis_name: AxisName) -> int:
  """The number of devices along ``axis_name`` (1 when it is None or unbound)."""
  name = bound_axis(axis_name)
  return 1 if name is None else lax.axis_size(name)


def psum(x, axis_name: AxisName):
  """Sum over the axis (identity at world size 1)."""
  name = bound_axis(axis_name)
  return x if name is None else lax.psum(x, name)


def pmax(x, axis_name: AxisName):
  """Maximum over the axis (identity at world size 1)."""
  name = bound_axis(axis_name)
  return x if name is None else lax.pmax(x, name)


def mean(x, axis_name: AxisName, wire_dtype=None):
  """Mean over the axis in torch's order: cast to ``wire_dtype`` → ÷W → sum → cast back.

  With ``wire_dtype=None`` the sum runs in ``x``'s own dtype (torch's ``allreduce_hook``); with
  ``jnp.float16`` or ``jnp.bfloat16`` it is ``fp16_compress_hook`` / ``bf16_compress_hook``.
  """
  wire = x if wire_dtype is None else x.astype(wire_dtype)
  return psum(wire / jnp.asarray(axis_size(axis_name), wire.dtype), axis_name).astype(x.dtype)


def all_gather(x, axis_name: AxisName):
  """Stacks every device's ``x`` along a new leading axis of size W."""
  name = bound_axis(axis_name)
  return x[None] if name is None else lax.all_gather(x, name)


def _packed(collective, arrays: list, axis_name: AxisName) -> list:
  """Runs ``collective`` once per dtype on one flat buffer holding all ``arrays`` of that dtype.

  ``collective(flat, axis_name)`` returns the flat result with any leading axes it adds (all-gather's
  W); each array gets its slice back with those axes in front of its own shape.
  """
  out: list = [None] * len(arrays)
  by_dtype: dict = {}
  for i, x in enumerate(arrays):
    by_dtype.setdefault(x.dtype, []).append(i)
  for members in by_dtype.values():
    flat = collective(jnp.concatenate([jnp.ravel(arrays[i]) for i in members]), axis_name)
    offsets = np.cumsum([0] + [arrays[i].size for i in members])
    for k, i in enumerate(members):
      part = flat[..., offsets[k]:offsets[k + 1]]
      out[i] = part.reshape(part.shape[:-1] + arrays[i].shape)
  return out


def psum_many(arrays: list, axis_name: AxisName) -> list:
  """``psum`` of every array, as one all-reduce per dtype (how torch sends a bucket)."""
  return _packed(psum, arrays, axis_name)


def all_gather_many(arrays: list, axis_name: AxisName) -> list:
  """``all_gather`` of every array, as one all-gather per dtype; results have a leading W axis."""
  return _packed(all_gather, arrays, axis_name)


def all_finite(tree, axis_name: AxisName):
  """A boolean scalar, the same on every device: is every leaf finite on every device?"""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
  # max |x| is finite iff every element is (max propagates NaN): one fused reduction per leaf, about
  # half the time of isfinite(x).all(), which XLA:CPU runs as a boolean array and then a reduction.
  local_bad = sum((~jnp.isfinite(jnp.max(jnp.abs(x)))).astype(jnp.int32) for x in leaves)
  return psum(jnp.asarray(local_bad, jnp.int32), axis_name) == 0


def keep_if_finite(finite, new_state, old_state):
  """Selects ``new_state`` where ``finite`` is true, else ``old_state`` (leaf by leaf)."""
  return jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, old_state)
