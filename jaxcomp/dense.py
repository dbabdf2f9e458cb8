"""Dense gradient means: the baseline ``allreduce`` and the fp16 / bf16 wire casts.

Each sits first in ``optax.chain`` where data-parallel code would call ``lax.pmean``. Integer and boolean
leaves pass through untouched.

References:
  PyTorch, ``default_hooks.allreduce_hook`` / ``fp16_compress_hook`` / ``bf16_compress_hook``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import optax

from jaxcomp import axis
from jaxcomp.buckets import TreeSignature, map_float_leaves


class DenseState(NamedTuple):
  """State of the dense means: only the gradient signature, to catch a changed pytree."""
  signature: TreeSignature

  PER_DEVICE_FIELDS = ()  # no per-device leaves (see jaxcomp.sharding)


def _dense_mean(wire_dtype, axis_name) -> optax.GradientTransformation:
  axis_name = axis.check_axis_name(axis_name)

  def init_fn(params):
    return DenseState(TreeSignature.of(params))

  def update_fn(updates, state, params=None):
    del params
    state.signature.check(updates)
    return map_float_leaves(lambda g: axis.mean(g, axis_name, wire_dtype), updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def allreduce(*, axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """The plain cross-device mean (÷W, then sum), the baseline every compressor is measured against.

  Args:
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).

  Returns:
    A stateless ``GradientTransformation``.
  """
  return _dense_mean(None, axis_name)


def fp16_compress(*, axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """The mean sent as float16: cast → ÷W → sum in float16 → cast back (torch's order).

  Args:
    axis_name: the mapped axis to average over.

  Returns:
    A stateless ``GradientTransformation``; outputs keep the gradients' dtypes.
  """
  return _dense_mean(jnp.float16, axis_name)


def bf16_compress(*, axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """The mean sent as bfloat16: cast → ÷W → sum in bfloat16 → cast back (torch's order).

  Args:
    axis_name: the mapped axis to average over.

  Returns:
    A stateless ``GradientTransformation``; outputs keep the gradients' dtypes.
  """
  return _dense_mean(jnp.bfloat16, axis_name)
