"""Local steps: the protocol of the optimizers that own the parameters, and the mechanics they
share.

Local SGD, DiLoCo, Streaming DiLoCo and SparseLoCo run an inner optimizer on each device's own
gradient, with no communication, and every few steps set every device's parameters to one
synchronized value. Each is a module that holds its math and nothing else:

* a **configuration**: a frozen dataclass derived from ``LocalStepsConfig`` (its fields declared
  with ``validate.setting``) with the ``inner`` optimizer and a public ``name``; it says when the
  devices synchronize (``syncs_after``, and the phases its step labels, ``"<name>.sync"``);
* ``init(config, signature, params) -> state``: a NamedTuple with ``count``, ``config`` and
  ``signature``, ``PER_DEVICE_FIELDS`` (the inner optimizer's state) and ``PARAMS_PER_DEVICE``;
* ``step(config, state, grads, params, axis_name) -> (new params, new state)`` on whole pytrees,
  its steps numbered in the module docstring, its synchronizations ``phases.when`` branches.

The factory builds the configuration once and hands it, with ``init`` and ``step``, to
``transformation``, which checks the state and the gradient, counts the steps and returns the new
parameters as ``Assign`` updates. These pieces serve them all:

* ``Assign``, the update that sets a parameter exactly. An optax update is *added* to the parameters
  (``optax.apply_updates`` computes ``params + updates``), and in floating point ``p + (t − p)`` is
  not always ``t``: with W = 8 replicas that drifted by N(0, 0.01) from N(0, 0.1) weights, 8% of the
  elements land one rounding away from the average on some device. No additive update can avoid it:
  from ``p₁ = −(0.5 − 2⁻²⁵)`` the float32 sums ``p₁ + u`` near 2⁻²¹ are odd multiples of 2⁻²⁵, from
  ``p₂ = −(0.5 − 2⁻²⁴)`` even ones, so no value near their average is reachable from both.
  ``params + Assign(t)`` is ``t`` itself, so ``optax.apply_updates``, ``nnx.Optimizer`` and any
  hand-written ``params + updates`` leave every device bitwise the same parameters.
* ``local_update``: one step of the inner optimizer on this device's gradient, under the local-step
  part of the non-finite policy (``finite.kept_locally``): a device whose new parameters are not
  finite keeps its parameters and its inner state as they were, which needs no collective. (Step
  counters advance on every step regardless, so that all devices agree on when to communicate.)
  The inner optimizer must not communicate over the axis the local steps average over, or the
  steps would not be local: that is refused while the step is traced (``jaxprs``).
* ``unchanged``: the update that leaves the parameters as they are, for a wrapper that skips a
  step (``accumulate``'s held micro-steps, ``skip_if_nonfinite``): zero for an additive update,
  ``Assign(params)`` for an optimizer that sets them.
* ``to_device`` / ``from_device``: the inner optimizer's state is kept with a leading axis of length
  1. It differs from device to device (momenta, Adam's moments, the count of a device that skipped a
  step), and under ``shard_map`` every per-device leaf is sharded along its first dimension
  (``jaxcomp.state_partition_specs``): the extra axis gives every leaf one, 0-d counts included.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import axis, finite, interface, jaxprs, kernels, validate
from jaxcomp._src import tree as tree_lib


@jax.tree_util.register_pytree_node_class
class Assign:
  """An update that sets a parameter: ``params + Assign(value)`` is ``value``, exactly.

  ``jaxcomp.local_sgd`` and ``jaxcomp.diloco`` return one for every parameter leaf, so that
  ``optax.apply_updates`` (which computes ``params + updates``), ``nnx.Optimizer`` and hand-written
  ``params + updates`` give every device bitwise the synchronized parameters. It supports nothing
  else: ``updates - x`` or ``2 * updates`` raise ``TypeError``. A transformation chained after
  ``local_sgd`` or ``diloco`` would receive the new parameters as its input, so nothing may follow
  them: they are the whole optimizer.

  Attributes:
    value: the parameter's new value.
  """
  __array_ufunc__ = None  # NumPy arrays, too, leave ``ndarray + Assign`` to ``__radd__``

  def __init__(self, value):
    self.value = value

  def __radd__(self, params):
    if jnp.shape(params) != jnp.shape(self.value):
      raise ValueError(f"params + Assign: the parameter has shape {jnp.shape(params)}, the value "
                       f"assigned {jnp.shape(self.value)}")
    return self.value

  def tree_flatten(self):
    return (self.value,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(*children)

  def __repr__(self) -> str:
    return f"Assign({self.value!r})"


def assign(params):
  """``params`` as updates that set them: an ``Assign`` at every leaf."""
  return jax.tree.map(Assign, params)


def local_update(config, grads, inner_state, params, axis_name: axis.AxisName) -> tuple:
  """One step of ``config.inner`` on this device's gradient: ``(new params, new inner state)``.

  A device whose new parameters are not finite keeps ``params`` and ``inner_state``
  (``finite.kept_locally``). Only reduced (floating-point, non-empty) parameters move; the others
  keep their values, so they stay the same on every device. The inner optimizer may communicate
  over another axis (an ``allreduce`` over a fast axis: hierarchical averaging), where a NaN then
  reaches every device of that axis, which all keep their parameters together. It is traced once:
  its program is read for collectives over ``axis_name``, then run.

  Raises:
    ValueError: the inner optimizer communicates over ``axis_name``: it would send on every local
      step, and the synchronization would average what is already averaged.
  """
  if not axis.is_bound(axis_name):
    updates, new_state = config.inner.update(grads, inner_state, params)
  else:
    (updates, new_state), program = jaxprs.traced_once(config.inner.update, grads, inner_state,
                                                        params)
    axes = frozenset(axis_name if isinstance(axis_name, tuple) else (axis_name,))
    sent = jaxprs.collectives_over(program.jaxpr, axes)
    if sent:
      kinds = sorted({found.split(" at ")[0] for found in sent})
      raise ValueError(
          f"{config.name}: its inner optimizer communicates over {axis_name!r} on every local "
          f"step ({', '.join(kinds)}), so the steps would not be local and the synchronization "
          "would average what is already averaged. Pass the optimizer alone as inner "
          f"(optax.adamw(1e-3)); the exchange of the synchronization is {config.name}'s own "
          "(diloco's compressor=); an all-reduce over a faster axis names that axis "
          "(hierarchical averaging: jaxcomp.allreduce(axis_name='fast'))")
  # Integer, boolean and zero-size parameters are left as they are: never trained, never averaged,
  # so they stay the same on every device.
  new_params = jax.tree.map(lambda p, new: new if tree_lib.is_reduced(p) else p, params,
                            optax.apply_updates(params, updates))
  # The inner state keeps its dtypes (optax's Adam makes an integer parameter's first moment a
  # float): the state's type must not change from one step to the next.
  new_state = jax.tree.map(lambda new, old: new.astype(jnp.result_type(old)), new_state,
                           inner_state)
  return finite.kept_locally((new_params, new_state), (params, inner_state))


def unchanged(update_shapes, params):
  """The update that leaves ``params`` as they are, for updates shaped as ``update_shapes``
  (``jax.eval_shape`` of the update): ``Assign(p)`` where the update sets a parameter, zeros
  where it is added to one."""
  is_assign = lambda x: isinstance(x, Assign)
  if not any(is_assign(x) for x in jax.tree.leaves(update_shapes, is_leaf=is_assign)):
    return jax.tree.map(lambda s: axis.make_varying(jnp.zeros(s.shape, s.dtype),  # typed as s
                                                    tuple(axis.varying_axes(s))), update_shapes)
  if params is None:
    raise ValueError("the optimizer sets the parameters (jaxcomp.Assign updates), so a step that "
                     "leaves them unchanged needs them: call tx.update(grads, state, params)")
  return jax.tree.map(lambda _, p: Assign(p), update_shapes, tree_lib.unwrap(params),
                      is_leaf=is_assign)


def mean_reduced(tree, axis_name: axis.AxisName):
  """The mean over the axis of ``tree``'s reduced leaves (÷W, then sum); others as they are.

  One all-reduce per leaf, which XLA's all-reduce combiner sends as one (checked in
  ``tests/test_local_sgd.py``): torch packs the parameters into one flat buffer
  (``average_parameters``), but a buffer packed here (``axis.mean_many``) is a concatenation and a
  result of the gradient's size besides the parameters: local SGD's update of ResNet-18, W = 8,
  donated, temporaries 2.00 → 1.00 times the gradient, DiLoCo's 2.27 → 2.00, Streaming DiLoCo's
  (P = 2) 1.85 → 1.33 (``PYTHONPATH=. python benchmarks/memory.py --compressors
  local_sgd_h8,diloco_h20,streaming_diloco_h20_p2``).
  """
  return jax.tree.map(lambda x: axis.mean(x, axis_name) if tree_lib.is_reduced(x) else x, tree)


def varying_like(tree, like):
  """``tree`` marked varying along every axis along which ``like`` (same structure) varies.

  The two branches of a ``lax.cond`` must agree on it under ``shard_map(check_vma=True)``: an
  average (invariant) on one side, this device's parameters (varying) on the other. Elsewhere (pmap,
  ``check_vma=False``, no mapping) nothing varies and nothing changes.
  """
  return jax.tree.map(lambda x, ref: axis.make_varying(x, tuple(sorted(axis.varying_axes(ref)))),
                      tree, like)


def to_device(inner_state):
  """``inner_state`` with a leading axis of length 1 on every leaf (this device's copy)."""
  return jax.tree.map(lambda x: jnp.expand_dims(x, 0), inner_state)


def from_device(stored):
  """The inner state stored by ``to_device``, leading axis removed."""
  return jax.tree.map(lambda x: x[0], stored)


class LocalStepsConfig(validate.Config):
  """The configuration of an optimizer that owns the parameters: its settings (``inner``, the
  optimizer each device runs, among them), and ``output``: its updates are ``Assign``, so nothing
  may follow it in an ``optax.chain``."""
  output: ClassVar[str] = "assign"


class Init(Protocol):
  def __call__(self, config: LocalStepsConfig, signature: tree_lib.TreeSignature,
               params: Any) -> Any: ...


class Step(Protocol):
  def __call__(self, config: LocalStepsConfig, state: Any, grads: Any, params: Any,
               axis_name: axis.AxisName) -> tuple: ...


def transformation(config: LocalStepsConfig, init: Init, step: Step,
                   axis_name: axis.AxisName) -> interface.Transformation:
  """The optax transformation of an optimizer that owns the parameters (the module docstring).

  Args:
    config: the validated configuration, with its public ``name``.
    init: ``init(config, signature, params) -> state``.
    step: ``step(config, state, grads, params, axis_name) -> (new params, new state)``.
    axis_name: the mapped axis the devices synchronize over.

  Returns:
    An ``interface.Transformation`` whose ``update(grads, state, params)`` needs the parameters
    and returns ``Assign`` updates.
  """
  axis_name = axis.check_axis_name(axis_name)
  name = config.name

  def init_fn(params):
    params = tree_lib.unwrap(params)
    return init(config, tree_lib.TreeSignature.of(params), params)

  def update_fn(updates, state, params=None):
    if type(getattr(state, "config", None)) is not type(config):
      raise TypeError(f"{name}: update needs the state {name}'s init made; got "
                      f"{type(state).__name__}")
    grads = state.signature.unflatten(state.signature.check(updates))
    if params is None:
      raise ValueError(f"{name} sets the parameters, so its update needs them: call "
                       "tx.update(grads, state, params) (nnx.Optimizer and the usual optax loop "
                       "do)")
    params = state.signature.unflatten(state.signature.check(params, "params"))
    axis.refuse_summed_gradient(state.signature.pick(grads), axis_name, name)
    with kernels.part("update"):
      new_params, new_state = step(state.config, state, grads, params, axis_name)
    return assign(new_params), new_state._replace(count=state.count + 1)

  return interface.Transformation(init_fn, update_fn, name=name, axis_name=axis_name,
                                  output="assign")
