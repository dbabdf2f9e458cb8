"""Flax NNX in ``jaxcomp.data_parallel``'s loss form: an nnx model as the parameters.

Flax is the caller's dependency, not jaxcomp's: ``flax.nnx`` is looked up where the caller has
imported it (it has, to make the model), never imported here. ``loss_step`` is the per-device step
of the loss form for a model and its ``nnx.Optimizer`` (its docstring numbers the steps).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._src import axis, distributed
from jaxcomp._src.sharding import params_per_device


def _nnx():
  """``flax.nnx`` if the caller has imported it, else None."""
  return sys.modules.get("flax.nnx")


def is_module(x) -> bool:
  nnx = _nnx()
  return nnx is not None and isinstance(x, nnx.Module)


def is_optimizer(x) -> bool:
  nnx = _nnx()
  return nnx is not None and isinstance(x, nnx.Optimizer)


def model_mask(model, buffers_per_device: bool):
  """``model`` with True at the leaves of its Variables other than ``nnx.Param`` if
  ``buffers_per_device``, False everywhere else."""
  nnx = _nnx()
  is_variable = lambda x: isinstance(x, nnx.Variable)

  def flag(node):
    per_device = buffers_per_device and is_variable(node) and not isinstance(node, nnx.Param)
    return jax.tree.map(lambda _: per_device, node)

  return jax.tree.map(flag, model, is_leaf=is_variable)


def optimizer(model, tx):
  """``nnx.Optimizer(model, tx, wrt=nnx.Param)``: the loss form's optimizer state of ``model``."""
  nnx = _nnx()
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def check_nnx(model, optimizer, tx) -> None:
  """An nnx model comes with the ``nnx.Optimizer`` of ``tx``.

  Raises:
    TypeError: one of the two is not an nnx object.
    ValueError: the optimizer was made with another transformation than ``tx``.
  """
  if not is_module(model):
    raise TypeError(f"params: an nnx.Optimizer (opt_state) updates an nnx model; got params of "
                    f"type {type(model).__name__}. Pass the model as params")
  if not is_optimizer(optimizer):
    raise TypeError(f"opt_state: with an nnx model as params the optimizer state is an "
                    f"nnx.Optimizer; got {type(optimizer).__name__}. Make it with "
                    "dp.make_state(model)")
  if optimizer.tx is not tx:
    raise ValueError("opt_state: this nnx.Optimizer was made with another transformation than the "
                     "tx given to data_parallel, and its update would run that one. Make it with "
                     "dp.make_state(model), or nnx.Optimizer(model, tx, wrt=...) with the same tx")


def _synchronised(written, policy: str, axes: tuple):
  """The Variables the forward pass wrote (an ``nnx.State``), the same on every device.

  Those that differ from device to device become, by ``policy``, their mean (``"mean"``:
  floating-point Variables only) or device 0's (``"first"``), through ``jaxcomp.sync_buffers``;
  those that came back identical everywhere (a counter advanced alike, a Variable left unwritten)
  are left alone.

  Raises:
    ValueError: ``"mean"`` meets a non-floating-point Variable that differs from device to device.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(written)
  varying = {jax.tree_util.keystr(path): x for path, x in flat
             if set(axes) & axis.varying_axes(x)}
  if policy == "mean":
    for path, x in varying.items():
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"params{path}: the forward pass wrote this {x.dtype.name} Variable with a "
            "different value on each device, and buffers='mean' averages floating-point Variables "
            "only. Pass buffers='first' (device 0's value on every device) or "
            "buffers='per_device' (one copy per device) to data_parallel")
  synced = distributed.sync_buffers(varying, policy, axis_name=axes)
  return treedef.unflatten([synced.get(jax.tree_util.keystr(path), x) for path, x in flat])


def _refuse_written(params, after):
  """The forward pass must not write a parameter: the optimizer computes the parameters.

  An unwritten Variable still holds the very value it was given.

  Raises:
    ValueError: naming the first parameter written.
  """
  given_with_path = jax.tree_util.tree_leaves_with_path(params)
  for (path, given), now in zip(given_with_path, jax.tree.leaves(after)):
    if now is not given:
      raise ValueError(
          f"params{jax.tree_util.keystr(path)}: the forward pass wrote this parameter (the "
          "optimizer's wrt selects it), but the optimizer computes the parameters from their "
          "gradients. Keep state the forward pass writes in a Variable that wrt leaves out "
          "(nnx.BatchStat, nnx.Variable)")


def loss_step(loss_fn, tx, axes, has_aux, buffers, model, optimizer, *batch):
  """The loss form's per-device step for an nnx model and its ``nnx.Optimizer``.

  1. The gradient is taken of a per-device copy of the parameters (``optimizer.wrt``), as for
     arrays; the forward pass runs on a model merged from that copy and the model's other
     Variables.
  2. Every random stream draws from its key folded with this device's index, so that each device
     has its own dropout masks; the keys kept are unchanged, the counters advance as on one device.
  3. Every Variable other than a parameter that the forward pass wrote (BatchNorm statistics, RNG
     counters, any Variable; writing a parameter is refused) is written back into the model, made
     the same on every device by ``buffers`` unless the model keeps them per device
     (``buffers="per_device"``, or an optimizer that keeps the parameters per device).
  4. ``optimizer.update(model, grads)``: the compressed mean and the optimizer.
  """
  nnx = _nnx()
  check_nnx(model, optimizer, tx)
  graphdef, params, keys, rest = nnx.split(model, optimizer.wrt, nnx.RngKey, ...)
  local_params = jax.tree.map(lambda p: axis.make_varying(p, axes), params)  # 1
  index = lax.axis_index(axes)
  own_keys = jax.tree.map(lambda key: jax.random.fold_in(key, index), keys)  # 2

  def local_loss(params, rest):
    local = nnx.merge(graphdef, params, own_keys, rest, copy=True)
    value = loss_fn(local, *batch)
    loss, aux = value if has_aux else (value, None)
    _, new_params, _, written = nnx.split(local, optimizer.wrt, nnx.RngKey, ...)
    _refuse_written(params, new_params)
    return loss, (aux, written)

  (loss, (aux, written)), grads = jax.value_and_grad(local_loss, has_aux=True)(local_params, rest)
  if buffers != "per_device" and not params_per_device(optimizer):  # 3
    written = _synchronised(written, buffers, axes)
  nnx.update(model, written)
  optimizer.update(model, grads)  # 4
  return model, optimizer, ((loss, aux) if has_aux else loss)


def _written_by_forward(state) -> list:
  """``(path, value)`` of every Variable that a forward pass writes (BatchNorm's ``BatchStat``,
  the ``RngCount`` of a stream) in the nnx models of ``state`` (not in an optimizer's state)."""
  nnx = _nnx()
  if nnx is None:
    return []
  kinds = (nnx.BatchStat, nnx.RngCount)
  in_optimizer = lambda path: any(isinstance(k, jax.tree_util.GetAttrKey) and k.name == "opt_state"
                                  for k in path)
  found = jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return [("state" + jax.tree_util.keystr(path), v.get_value()) for path, v in found
          if isinstance(v, kinds) and not in_optimizer(path)]


def warn_if_lost(step, state, *batch):
  """``step(state, *batch)`` (the per-device-step form), warning once per trace if ``state`` holds
  an nnx model whose BatchNorm statistics and RNG counters all come back unchanged: the forward
  pass ran on a copy (the gradient of ``lax.pcast(model, ...)``) and what it wrote there is lost."""
  before = _written_by_forward(state)
  new_state, out = step(state, *batch)
  after = dict(_written_by_forward(new_state))
  if before and all(after.get(path) is value for path, value in before):
    axis.warn_once_per_trace("nnx.written", (
        f"jaxcomp.data_parallel: {', '.join(path for path, _ in before[:3])}"
        f"{' and more' if len(before) > 3 else ''} came back unchanged from the per-device step. "
        "If its forward pass writes them (BatchNorm in training mode, Dropout), the writes went to "
        "the copy the gradient was taken of (lax.pcast) and are lost. Use the loss form, "
        "jaxcomp.data_parallel(loss_fn, mesh, tx=tx) with the model as the parameters, which "
        "writes them back (averaged over the devices by default)"))
  return new_state, out
