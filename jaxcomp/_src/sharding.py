"""Which leaves of an optimizer state are per device, and their ``shard_map`` specs.

A jaxcomp state mixes two kinds of leaves. Some are per device — error feedback, DGC's momenta,
the accumulator of ``jaxcomp.accumulate`` — and differ from device to device (under
``check_vma=True`` they are *varying* along the axis). The rest — counts, PowerSGD's Q, everything
optax computes from the averaged gradient — are identical on every device. Under
``jax.shard_map`` each needs its own spec.

The declarations, in one place:

* a state NamedTuple names its per-device fields in a class attribute::

    class AccumulateState(NamedTuple):
      micro_step: jax.Array
      acc: tuple
      ...
      PER_DEVICE_FIELDS = ("acc",)

* ``PerDevice(tree)`` declares every leaf of ``tree`` per device: the way to declare a plain-array
  state, e.g. a user hook's (``comm_hook(hook, jaxcomp.PerDevice({"error": ...}))``);
* ``optax.MultiStepsState``: its ``acc_grads`` (and ``skip_state``) are summed from each device's
  own gradients, so they are per device;
* a state whose optimizer moves each device's parameters on its own between synchronizations
  (``local_sgd``, ``diloco``) says so with ``PARAMS_PER_DEVICE = True``: the parameters it updates
  are then per device too (``params_per_device``), which ``jaxcomp.data_parallel`` reads to stack
  them.

Everything else is replicated, optax's own states included. Flax NNX wrappers change nothing: an
``nnx.Optimizer`` is a JAX pytree that keeps the state NamedTuples, with every array in an
``OptArray`` / ``OptVariable``; ``nnx.state(optimizer)`` does not keep them (its per-device leaves
cannot be told apart), so it is refused with the fix.

The layout of a per-device leaf outside the mapped function is the one ``jax.pmap`` uses: stacked
along a new leading axis, one entry per device (``(W, *shape)``, ``W`` the size of the axis), and
``PartitionSpec(axis_name)`` shards that axis. It works for every rank, 0-d leaves included
(there is no first dimension of a 0-d leaf to split), and a state stacked for ``pmap`` is the same
state. ``jaxcomp.data_parallel`` stores per-device leaves this way. In a ``shard_map`` of your own,
a leaf of rank ≥ 1 may instead stay unstacked, its local blocks side by side along its first
dimension (``(W·n, m)`` globally for a local ``(n, m)``); the spec is the same. A 0-d per-device
leaf cannot (``state_partition_specs`` refuses it unless told ``stacked=True``). A per-device leaf
that a state forgets to declare is caught by ``shard_map(check_vma=True)``, which refuses a varying
value under a replicated spec.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import optax
from jax.sharding import PartitionSpec

from jaxcomp._src import axis
from jaxcomp._src import tree as tree_lib


class PerDevice(NamedTuple):
  """Declares every leaf of ``tree`` per device (see ``jaxcomp.state_partition_specs``).

  ``comm_hook`` passes a hook the plain ``tree`` and wraps what the hook returns again, so a hook
  whose state is a plain pytree declares it per device with ``comm_hook(hook, PerDevice(state))``.

  Attributes:
    tree: any pytree; every leaf differs from device to device.
  """
  tree: Any

  PER_DEVICE_FIELDS = ("tree",)


# States of other libraries with per-device fields: optax.MultiSteps sums each device's own
# gradients.
_FOREIGN_PER_DEVICE_FIELDS = {optax.MultiStepsState: ("acc_grads", "skip_state")}


def _declared_fields(node) -> Optional[tuple]:
  if not isinstance(node, tuple):
    return None
  if type(node) in _FOREIGN_PER_DEVICE_FIELDS:
    return _FOREIGN_PER_DEVICE_FIELDS[type(node)]
  return getattr(type(node), "PER_DEVICE_FIELDS", None)


def _declares(node) -> bool:
  return _declared_fields(node) is not None


def _is_nnx_optimizer_state(leaf) -> bool:
  # flax.nnx's OptState (OptArray, OptVariable), recognised without importing Flax.
  return any(c.__name__ == "OptState" and c.__module__.startswith("flax.nnx")
             for c in type(leaf).__mro__)


def _refuse_flattened_nnx_optimizer(tree) -> None:
  """``nnx.state(optimizer)`` turned the state NamedTuples into dicts: per-device leaves are lost.

  There, every optimizer-state leaf is reached through dict keys alone; in an ``nnx.Optimizer`` (a
  JAX pytree) or its ``opt_state`` the path passes through a chain's tuple or a state's fields.
  """
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_nnx_optimizer_state):
    if _is_nnx_optimizer_state(leaf) and all(isinstance(k, jax.tree_util.DictKey) for k in path):
      raise TypeError(
          f"state: optimizer state {jax.tree_util.keystr(path)} comes from nnx.state() or "
          "nnx.split(), which drop the state types that say which leaves are per device. Pass the "
          "nnx.Optimizer itself (a JAX pytree that keeps them), e.g. "
          "jaxcomp.state_partition_specs((model, optimizer)), or optimizer.opt_state")


def per_device_mask(tree):
  """``tree`` with every leaf replaced by True where it is per device, else False.

  Per device: every leaf under a field a state declares in ``PER_DEVICE_FIELDS``, under
  ``PerDevice``, or under ``optax.MultiStepsState.acc_grads``. Everything else — parameters,
  optax's own states, counts, PowerSGD's Q — is False: it is meant to be identical on every
  device.

  Example:
    >>> import jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.quantized(8), optax.sgd(0.1, momentum=0.9))
    >>> mask = jaxcomp.per_device_mask(tx.init({"w": jnp.zeros((4, 2))}))
    >>> mask[0].count, mask[0].worker_error, mask[1][0].trace  # the errors are per device
    (False, {'w': True}, {'w': False})

  Raises:
    TypeError: ``tree`` holds an ``nnx.State`` of optimizer state, whose declarations are lost.
  """
  _refuse_flattened_nnx_optimizer(tree)

  def mark(node, per_device: bool):
    fields = _declared_fields(node)
    if fields is None:
      return per_device
    return type(node)(*(jax.tree.map(lambda x, name=name: mark(x, per_device or name in fields),
                                     value, is_leaf=_declares)
                        for name, value in zip(node._fields, node)))

  return jax.tree.map(lambda x: mark(x, False), tree, is_leaf=_declares)


def params_per_device(tree) -> bool:
  """Whether ``tree`` holds a state that declares ``PARAMS_PER_DEVICE = True``: its optimizer keeps
  the parameters per device between synchronizations (``local_sgd``, ``diloco``)."""
  declares = lambda node: getattr(type(node), "PARAMS_PER_DEVICE", False) is True
  return any(declares(node) for node in jax.tree.leaves(tree, is_leaf=declares))


def state_partition_specs(state_or_tx: Any, params: Optional[Any] = None, *,
                          axis_name: axis.AxisName = "batch", stacked: bool = False):
  """The ``PartitionSpec`` tree of an optimizer state, for ``shard_map``'s in/out specs.

  ``jaxcomp.data_parallel`` builds a whole jitted step with these; use them directly for a
  ``shard_map`` of your own::

    specs = jaxcomp.state_partition_specs(tx, params, axis_name="batch")
    opt_state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)
    step = jax.shard_map(train_step, mesh=mesh, in_specs=(P(), specs, P("batch")),
                         out_specs=(P(), specs, P()))

  (There each per-device leaf of rank ≥ 1 has its local blocks side by side along its first
  dimension; ``data_parallel`` stacks them along a new leading axis instead, as ``pmap`` does, which
  0-d per-device leaves need: see ``jaxcomp._src.sharding``.) A 0-d per-device leaf has no first
  dimension to split, so ``shard_map`` cannot return it as it is: it is refused unless
  ``stacked=True`` says that the per-device leaves are stacked (``x[None]`` in the mapped function,
  ``x[0]`` to read one back)::

    mask = jaxcomp.per_device_mask(jax.eval_shape(tx.init, params))
    stack = lambda tree: jax.tree.map(lambda x, m: x[None] if m else x, tree, mask)
    specs = jaxcomp.state_partition_specs(tx, params, stacked=True)
    opt_state = jax.shard_map(lambda p: stack(tx.init(p)), mesh=mesh, in_specs=P(),
                              out_specs=specs)(params)

  Args:
    state_or_tx: an optimizer state (arrays or ``jax.ShapeDtypeStruct``\\s), any pytree holding
      states — e.g. ``(params, opt_state)`` or a Flax ``(model, nnx.Optimizer)`` — or the
      ``GradientTransformation`` whose state is meant (then ``params`` is required).
    params: the parameters ``tx.init`` would see (only with a transformation; shapes suffice).
    axis_name: the mesh axis (or tuple of axes) the per-device leaves are sharded along.
    stacked: the per-device leaves are (or will be) stacked along a new leading axis of W, one
      entry per device, as ``jax.pmap`` and ``jaxcomp.data_parallel`` store them: the spec of every
      per-device leaf, 0-d ones included, is then ``PartitionSpec(axis_name)``.

  Returns:
    A pytree with the state's structure and a ``PartitionSpec`` at every array leaf:
    ``PartitionSpec(axis_name)`` for per-device leaves (``per_device_mask``), ``PartitionSpec()``
    elsewhere.

  Example:
    >>> import jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.quantized(8), optax.sgd(0.1, momentum=0.9))
    >>> specs = jaxcomp.state_partition_specs(tx, {"w": jnp.zeros((4, 2))})
    >>> specs[0].count, specs[0].worker_error, specs[1][0].trace  # the errors are per device
    (P(), {'w': P('batch',)}, {'w': P()})

  Raises:
    TypeError: ``state_or_tx`` is an ``nnx.State`` of optimizer state (pass the ``nnx.Optimizer``).
    ValueError: a per-device leaf is 0-d and ``stacked`` is False (``shard_map`` cannot return it
      unstacked).
  """
  axis_name = axis.check_axis_name(axis_name)
  if axis_name is None:
    raise ValueError("axis_name must name the mesh axis the per-device leaves are sharded along; "
                     "got None")
  if isinstance(state_or_tx, optax.MultiSteps):  # a class with init and update, not a NamedTuple
    state_or_tx = state_or_tx.gradient_transformation()
  if isinstance(state_or_tx, optax.GradientTransformation):
    if params is None:
      raise ValueError("params is required when state_or_tx is a GradientTransformation")
    state = jax.eval_shape(state_or_tx.init, params)
  elif params is not None:
    raise ValueError("params is only used with a GradientTransformation; got a state and params")
  else:
    state = state_or_tx
  mask = per_device_mask(state)
  if not stacked:
    for (path, x), per_device in zip(jax.tree_util.tree_leaves_with_path(state),
                                     jax.tree.leaves(mask)):
      if per_device and not tree_lib.shape_of(x):
        raise ValueError(
            f"state{jax.tree_util.keystr(path)} is per device and 0-d: shard_map can return it "
            f"only stacked along a new leading axis (P({axis_name!r}) needs a first dimension). "
            "Stack the per-device leaves in your mapped function (x[None]) and pass stacked=True, "
            "or build the step with jaxcomp.data_parallel, which stacks them")
  return jax.tree.map(
      lambda per_device: PartitionSpec(axis_name) if per_device else PartitionSpec(), mask)
