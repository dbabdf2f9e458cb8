"""Where a data-parallel step's state lives: ``DataParallel``, made by ``jaxcomp.data_parallel``.

The step takes its state placed on the mesh: per-device leaves (error feedback, momenta,
accumulators, a sharded optimizer's shards; the parameters of an optimizer that moves each
device's copy between synchronizations) stacked along a new leading axis of W and sharded along it,
as ``jax.pmap`` stores them, the rest replicated (``jaxcomp.per_device_mask``). ``DataParallel``
makes that state (``make_state``, ``make_params``), places a batch (``shard``), gives the
shardings of a state (an orbax restore target) and restores a checkpoint saved on any number of
devices (``restore``); ``jaxcomp._src.data_parallel`` builds the step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcomp._src import distributed, misuse, nnx_step, spmd
from jaxcomp._src import restore as restore_lib
from jaxcomp._src.sharding import params_per_device, per_device_mask
from jaxcomp._src.zero import holds_sharded_state

Optimizer = Union[optax.GradientTransformation, optax.MultiSteps]


def step_form_masks(states) -> list:
  """The per-device bool tree of the per-device-step form's state: what its states declare."""
  return [per_device_mask(states[0])]


def loss_form_masks(buffers: str, states) -> list:
  """The per-device bool trees of the loss form's ``(params, opt_state)``.

  The parameters are all per device under an optimizer that moves them between synchronizations
  (a state declares ``PARAMS_PER_DEVICE``); of an nnx model, with ``buffers="per_device"``, the
  Variables other than ``nnx.Param``.
  """
  params, opt_state = states
  if params_per_device(opt_state):
    params_mask = jax.tree.map(lambda _: True, params)
  elif nnx_step.is_module(params):
    params_mask = nnx_step.model_mask(params, buffers == "per_device")
  else:
    params_mask = per_device_mask(params)
  return [params_mask, per_device_mask(opt_state)]

@dataclasses.dataclass(frozen=True)
class DataParallel:
  """A jitted data-parallel step and how to place what it takes; made by ``jaxcomp.data_parallel``.

  Attributes:
    step: the jitted global step. Loss-function form: ``step(params, opt_state, *batch) -> (params,
      opt_state, loss)`` (``(params, opt_state, (loss, aux))`` with ``has_aux``); per-device-step
      form: ``step(state, *batch) -> (state, out)``. Per-device results (``loss``, ``aux``, ``out``)
      come back stacked, one entry per device along a new leading axis: no collective is spent on
      them (``loss.mean()`` is the batch's mean loss for equal shards). Under ``local_sgd`` or
      ``diloco`` the parameters, too, come back stacked, one copy per device (see
      ``make_params``). With an nnx model as the parameters: ``step(model, optimizer, *batch) ->
      (model, optimizer, loss)``.
    mesh: the mesh, as given.
    axis_name: the data axis (or tuple of axes) the step is mapped over and the compressor averages
      over.
    tx: the optimizer of the loss-function form, else None.
    buffers: what an nnx model's Variables that the forward pass writes become (loss-function
      form): ``"mean"``, ``"first"`` or ``"per_device"`` (see ``jaxcomp.data_parallel``).
  """
  step: Callable
  mesh: Mesh
  axis_name: Any
  tx: Optional[Optimizer]
  buffers: str = "mean"

  @property
  def world_size(self) -> int:
    """The number of devices along ``axis_name``."""
    return math.prod(self.mesh.shape[a] for a in spmd.axes(self.axis_name))

  @property
  def batch_sharding(self) -> NamedSharding:
    """Batches are split along their leading axis over ``axis_name``."""
    return NamedSharding(self.mesh, PartitionSpec(self.axis_name))

  def shard(self, batch):
    """``batch`` (any pytree) placed with ``batch_sharding``; with several processes each passes
    its own part (``jax.make_array_from_process_local_data``)."""
    if jax.process_count() > 1:
      return jax.tree.map(
          lambda x: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x)),
          batch)
    return jax.device_put(batch, self.batch_sharding)

  def make_state(self, tree):
    """The state ``step`` takes, placed on the mesh.

    Loss-function form: ``tree`` is the parameters as made on one device, and the result is
    ``tx.init(params)``; for an nnx model it is ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, and an
    ``nnx.Optimizer`` of ``tx`` made otherwise (another ``wrt``, restored from a checkpoint) is
    placed as it is. Per-device-step form: ``tree`` is the state as made on one device (e.g.
    ``(params, opt_state)``, a Flax ``(model, nnx.Optimizer)``, or for ``local_sgd`` / ``diloco``
    ``(jaxcomp.PerDevice(params), opt_state)``). Either way every per-device leaf is stacked along a
    new leading axis, one copy per device (every device starts from the same state), and sharded
    along it; other leaves keep their shardings.

    With several processes every process starts from process 0's state, as DDP's construction
    does: the per-device-step form broadcasts it (every leaf of ``tree`` becomes process 0's), the
    loss-function form checks the parameters, which it cannot replace for the caller, and raises
    ``jaxcomp.ReplicaMismatchError`` naming the first leaf that differs
    (``params = jaxcomp.broadcast_replicated(params)`` first is the fix).
    """
    misuse.check_state(tree)
    if self.tx is None or nnx_step.is_optimizer(tree):
      if self.tx is not None and tree.tx is not self.tx:
        raise ValueError("tree: this nnx.Optimizer was made with another transformation than the "
                         "tx given to data_parallel; make it with make_state(model)")
      _refuse_sharded_state(tree)
      make = lambda t: t
    elif nnx_step.is_module(tree):
      make = self._init
    else:
      tree = self._same_start(tree)
      if holds_sharded_state(self._abstract_state(tree)):
        return self._init_on_devices(tree)
      return self._place(tree, self._init, per_device_mask)
    return self._place(self._same_start(tree), make, per_device_mask)

  def make_params(self, params):
    """The parameters as the loss-function form's ``step`` takes them, placed on the mesh.

    Replicated for an ordinary optimizer (host arrays are put on the mesh; arrays on it keep their
    shardings; calling this is optional then). For an optimizer that keeps the parameters per device
    between synchronizations (``local_sgd``, ``diloco``: a state that declares
    ``PARAMS_PER_DEVICE``) stacked along a new leading axis of W and sharded along it, one copy per
    device, as ``step`` takes and returns them. Of an nnx model with ``buffers="per_device"``, the
    Variables other than ``nnx.Param`` are stacked so. Make the optimizer state from the unstacked
    parameters (``make_state(params)`` before this). With several processes the parameters are
    checked as ``make_state`` checks them.
    """
    if self.tx is None:
      raise ValueError("make_params places the parameters of the loss-function form (with tx); in "
                       "the per-device-step form make_state places the whole state (wrap the "
                       "parameters of local_sgd or diloco in jaxcomp.PerDevice there)")
    opt_state = (jax.eval_shape(self._init, params) if nnx_step.is_module(params)
                 else self._abstract_state(params))
    return self._place(self._same_start(params), lambda t: t,
                       lambda t: loss_form_masks(self.buffers, (t, opt_state))[0])

  def restore(self, directory, params):
    """The loss form's optimizer state saved in ``directory`` by an orbax ``StandardCheckpointer``,
    laid out for this mesh whatever number of devices it was saved from
    (``jaxcomp._src.restore``): a ``sharded_optimizer``'s shards of its optimizer's state (and
    master copy) exactly; each device's own leaves (error feedback, Dion's momentum) started
    afresh, with a warning naming them; the rest as saved.

    Args:
      directory: the checkpoint of ``step``'s optimizer state.
      params: the parameters (their structure, shapes and dtypes make the fresh state).

    Returns:
      The optimizer state, placed as ``make_state(params)`` places it.
    """
    if self.tx is None:
      raise ValueError("restore lays out the optimizer state of the loss-function form (with tx); "
                       "restore a per-device-step state with orbax, onto make_state's shardings")
    return restore_lib.restore_data_parallel(self, directory, params)

  def _init(self, params):
    """The loss form's optimizer state: ``tx.init(params)``, or for an nnx model
    ``nnx.Optimizer(model, tx, wrt=nnx.Param)``."""
    if nnx_step.is_module(params):
      optimizer = nnx_step.optimizer(params, self.tx)
      _refuse_sharded_state(optimizer)
      return optimizer
    state = self.tx.init(params)
    misuse.refuse_lookahead(state)
    return state

  def _init_per_device(self, params, mask=None):
    """``tx.init(params)`` run on every device of the data axis, inside ``shard_map``: the leaves
    ``mask`` marks (all of them if None) stacked along a new leading axis of W, sharded along it."""
    axes = spmd.axes(self.axis_name)
    auto = spmd.all_auto(self.mesh)

    def body(p):
      state = self.tx.init(p)
      marks = jax.tree.map(lambda _: True, state) if mask is None else mask
      return jax.tree.map(lambda x, m: jnp.asarray(x)[None] if m else x, state, marks)

    marks = PartitionSpec(axes) if mask is None else jax.tree.map(
        lambda m: PartitionSpec(axes) if m else PartitionSpec(), mask)
    with jax.sharding.use_abstract_mesh(auto.abstract_mesh):
      return jax.shard_map(body, mesh=auto, in_specs=PartitionSpec(), out_specs=marks,
                           axis_names=set(axes), check_vma=True)(spmd.to_auto(auto, params))

  def _abstract_state(self, params):
    """The loss form's optimizer state as ``jax.ShapeDtypeStruct``\\ s, made on the devices (as a
    sharded optimizer's must be), each leaf with a leading axis of W: for its structure."""
    return jax.eval_shape(self._init_per_device, params)

  def _init_on_devices(self, params):
    """The loss form's optimizer state made on every device (a sharded optimizer's init cuts each
    device's own shards), per-device leaves stacked and sharded, placed on the mesh."""
    mask = per_device_mask(self._abstract_state(params))
    specs = jax.tree.map(lambda m: PartitionSpec(self.axis_name) if m else PartitionSpec(), mask)

    def make(p):
      state = self._init_per_device(p, mask)
      if not spmd.has_explicit_axes(self.mesh):
        return state
      return jax.tree.map(lambda x, spec: jax.sharding.reshard(x, NamedSharding(self.mesh, spec)),
                          state, specs)

    with jax.set_mesh(self.mesh):
      return jax.jit(make)(self._on_mesh(params))

  def _same_start(self, tree):
    """With several processes: ``tree`` with process 0's value in every leaf (per-device-step form)
    or checked to hold it (loss-function form); in one process, ``tree``. Arrays already sharded
    over the mesh are one global value and are left out."""
    if jax.process_count() == 1:
      return tree
    copies = jax.tree.map(
        lambda x: not (isinstance(x, jax.Array) and not x.sharding.is_fully_replicated), tree)
    if self.tx is None:
      return distributed.broadcast_where(tree, copies)
    distributed.check_where(tree, copies)
    return tree

  def _place(self, tree, make, mask):
    """``make(tree)`` on the mesh (jitted), each leaf where ``mask`` of it is True stacked along a
    new leading axis of W and sharded along it."""
    per_device = NamedSharding(self.mesh, PartitionSpec(self.axis_name))
    world = self.world_size

    def stacked(t):
      state = make(t)
      leaves, treedef = jax.tree.flatten(state)
      return treedef.unflatten([
          spmd.constrain(jnp.broadcast_to(x, (world,) + jnp.shape(x)), per_device) if m else x
          for x, m in zip(leaves, jax.tree.leaves(mask(state)))])

    with jax.set_mesh(self.mesh):
      return jax.jit(stacked)(self._on_mesh(tree))

  def _on_mesh(self, tree):
    """``tree`` with its host arrays put on the mesh (replicated), so that a program runs on its
    devices; arrays already on them are left as they are."""
    replicated = NamedSharding(self.mesh, PartitionSpec())
    devices = set(self.mesh.devices.flat)
    return jax.tree.map(
        lambda x: x if isinstance(x, jax.Array) and x.sharding.device_set == devices
        else jax.device_put(x, replicated), tree)

  def shardings(self, state):
    """The ``NamedSharding`` of every leaf of a placed state (an orbax restore target, say)."""
    per_device = NamedSharding(self.mesh, PartitionSpec(self.axis_name))
    replicated = NamedSharding(self.mesh, PartitionSpec())
    return jax.tree.map(
        lambda x, m: per_device if m else getattr(x, "sharding", replicated), state,
        per_device_mask(state))

def _refuse_sharded_state(tree) -> None:
  """A ``jaxcomp.sharded_optimizer`` state is made on each device: one device's cannot be stacked.

  Raises:
    ValueError: ``tree`` holds one (naming the fix).
  """
  if holds_sharded_state(tree):
    raise ValueError(
        "tree holds a jaxcomp.sharded_optimizer state, which is made on each device (each keeps "
        "its own shards), so one device's state cannot be copied to the others. Use the "
        "loss-function form, data_parallel(loss_fn, mesh, tx=tx) with arrays as the parameters: "
        "its make_state(params) makes it on every device (an nnx model: nnx.split it and pass the "
        "nnx.Param state as the parameters)")
