"""``shard_map`` specs for jaxcomp optimizer states: per-device leaves sharded, the rest replicated.

A jaxcomp state mixes two kinds of leaves. Some are per device — error feedback, DGC's momenta, the
accumulator of ``jaxcomp.accumulate`` — and differ from device to device (under ``check_vma=True`` they
are *varying* along the axis). The rest — counts, PowerSGD's Q, everything optax computes from the
averaged gradient — are identical on every device. Under ``jax.shard_map`` each needs its own spec, and
``state_partition_specs`` gives the whole tree of them.

The convention: a state NamedTuple names its per-device fields in a class attribute::

    class AccumulateState(NamedTuple):
      micro_step: jax.Array
      acc: tuple
      ...
      PER_DEVICE_FIELDS = ("acc",)

Every array under a per-device field gets ``PartitionSpec(axis_name)``: sharded along its first
dimension, so outside ``shard_map`` it is one array whose i-th block along dimension 0 is device i's
(a leaf of local shape ``(n, m)`` is ``(W·n, m)`` globally). Every other leaf gets ``PartitionSpec()``
(replicated). States that declare nothing (optax's own) are replicated throughout. A per-device leaf
that a state forgets to declare is caught by ``shard_map(check_vma=True)``, which refuses a varying
value under a replicated spec.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec

from jaxcomp._src import axis


def _declares(node) -> bool:
  return isinstance(node, tuple) and hasattr(type(node), "PER_DEVICE_FIELDS")


def _mark(tree, per_device: bool):

  def one(node):
    if _declares(node):
      fields = type(node).PER_DEVICE_FIELDS
      return type(node)(*(_mark(value, per_device or name in fields)
                          for name, value in zip(node._fields, node)))
    return per_device

  return jax.tree.map(one, tree, is_leaf=_declares)


def per_device_mask(tree):
  """``tree`` with every leaf replaced by True where it lies under a declared per-device field.

  Every other leaf — parameters, optax's own states, counts, PowerSGD's Q — becomes False: it is meant
  to be identical on every device.
  """
  return _mark(tree, False)


def state_partition_specs(state_or_tx: Any, params: Optional[Any] = None, *,
                          axis_name: axis.AxisName = "batch"):
  """The ``PartitionSpec`` tree of a jaxcomp optimizer state, for ``shard_map``'s in/out specs.

  Example::

    specs = jaxcomp.state_partition_specs(tx, params, axis_name="batch")
    opt_state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)
    step = jax.shard_map(train_step, mesh=mesh, in_specs=(P(), specs, P("batch")),
                         out_specs=(P(), specs, P()))

  Args:
    state_or_tx: an optimizer state (arrays or ``jax.ShapeDtypeStruct``\\s), or the
      ``GradientTransformation`` whose state is meant (then ``params`` is required).
    params: the parameters ``tx.init`` would see (only with a transformation; shapes suffice).
    axis_name: the mesh axis (or tuple of axes) the per-device leaves are sharded along.

  Returns:
    A pytree with the state's structure and a ``PartitionSpec`` at every array leaf:
    ``PartitionSpec(axis_name)`` under fields a state declares in ``PER_DEVICE_FIELDS``,
    ``PartitionSpec()`` elsewhere.

  Raises:
    ValueError: a per-device leaf is 0-d, so it cannot be sharded along a first dimension.
  """
  axis_name = axis.check_axis_name(axis_name)
  if axis_name is None:
    raise ValueError("axis_name must name the mesh axis the per-device leaves are sharded along; "
                     "got None")
  if isinstance(state_or_tx, optax.GradientTransformation):
    if params is None:
      raise ValueError("params is required when state_or_tx is a GradientTransformation")
    state = jax.eval_shape(state_or_tx.init, params)
  elif params is not None:
    raise ValueError("params is only used with a GradientTransformation; got a state and params")
  else:
    state = state_or_tx

  def spec(path, leaf, per_device):
    if not per_device:
      return PartitionSpec()
    if np.ndim(leaf) == 0:
      raise ValueError(f"state: per-device leaf {jax.tree_util.keystr(path)} is 0-d; per-device "
                       "leaves are sharded along their first dimension, so they need at least one")
    return PartitionSpec(axis_name)

  return jax.tree_util.tree_map_with_path(spec, state, per_device_mask(state))
