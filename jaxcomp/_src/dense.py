"""Dense gradient means: the baseline ``allreduce`` and the fp16 / bf16 wire casts.

Each sits first in ``optax.chain`` where data-parallel code would call ``lax.pmean``. Integer, boolean
and zero-size leaves pass through untouched. They keep no state to protect: a NaN on one device makes
that coordinate of the mean NaN on every device (jaxcomp's non-finite policy, ``finite.py``).

References:
  PyTorch, ``default_hooks.allreduce_hook`` / ``fp16_compress_hook`` / ``bf16_compress_hook``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import optax

from jaxcomp._src import axis
from jaxcomp._src import tree as tree_lib


class DenseState(NamedTuple):
  """State of the dense means: only the gradient signature, to catch a changed pytree."""
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ()  # no per-device leaves (see jaxcomp.sharding)


def _dense_mean(name: str, wire_dtype, axis_name) -> optax.GradientTransformation:
  axis_name = axis.check_axis_name(axis_name)

  def init_fn(params):
    return DenseState(tree_lib.TreeSignature.of(params))

  def update_fn(updates, state, params=None):
    del params
    tree_lib.check_state(state, init_fn, name)
    state.signature.check(updates)
    return tree_lib.map_reduced(lambda g: axis.mean(g, axis_name, wire_dtype), updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def allreduce(*, axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """The plain cross-device mean (÷W, then sum), the baseline every compressor is measured against.

  Args:
    axis_name: the mapped axis to average over (see ``jaxcomp.axis``).

  Returns:
    A stateless ``GradientTransformation``.
  """
  return _dense_mean("allreduce", None, axis_name)


def fp16_compress(*, axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """The mean sent as float16: cast → ÷W → sum in float16 → cast back (torch's order).

  Half the bytes of ``allreduce``. Dividing before the sum keeps the float16 sum from overflowing;
  values below float16's range (about 6e-8) are lost, which a loss scaler before it avoids.

  Args:
    axis_name: the mapped axis to average over.

  Returns:
    A stateless ``GradientTransformation``; outputs keep the gradients' dtypes.

  References:
    PyTorch ``default_hooks.fp16_compress_hook``.
  """
  return _dense_mean("fp16_compress", jnp.float16, axis_name)


def bf16_compress(*, axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """As ``fp16_compress`` with bfloat16 on the wire: float32's range, 8 bits of mantissa.

  torch allows its ``bf16_compress_hook`` only on NCCL; jaxcomp runs it everywhere. XLA:CPU widens
  bfloat16 collectives to float32 when it compiles (``comm_report(..., stage="lowered")`` shows the
  requested dtype); GPU and TPU backends send bfloat16.

  Args:
    axis_name: the mapped axis to average over.

  Returns:
    A stateless ``GradientTransformation``; outputs keep the gradients' dtypes.
  """
  return _dense_mean("bf16_compress", jnp.bfloat16, axis_name)
