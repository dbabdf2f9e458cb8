"""jit-first data parallelism: a loss function (or a per-device step) and a ``Mesh`` → one jitted step.

Under plain ``jax.jit`` with a batch sharded over a mesh axis, the SPMD partitioner averages the
gradient itself, in full precision, before any optimizer sees it: a compressor has nothing left to
compress. ``data_parallel`` builds the step that lets it work, from what a jit user already has:

1. ``jax.shard_map`` over the data axis, so each device computes the gradient of its own shard of
   the batch and the compressor's collectives are the step's only gradient traffic;
2. the gradient is taken of ``lax.pcast(params, axis, to="varying")``, a per-device copy: taken of
   the replicated parameters, autodiff would insert a full float32 all-reduce of it (the transpose
   of the implicit ``pvary``), which ``jaxcomp.comm_report`` would show;
3. the state's specs come from ``jaxcomp.per_device_mask``: per-device leaves (error feedback,
   momenta, accumulators) are stored as ``jax.pmap`` stores them, stacked along a new leading axis of
   size W and sharded along it (which also holds 0-d leaves), the rest replicated; ``make_state``
   creates them that way;
4. the batch is sharded along its leading axis over the data axis (``shard`` places it);
5. meshes from ``jax.make_mesh`` work with Explicit or Auto axes: inside the step every axis but the
   data axis is left to the partitioner (Auto), so the model code that works under ``jit`` works
   here, and what the step returns has the shardings its inputs had. On a 2-D mesh the compressor
   averages over the data axis only; parameters may be sharded along the others.

The loss form takes a Flax NNX model as the parameters (with its ``nnx.Optimizer`` as the optimizer
state). The step splits the model into the parameters the optimizer updates (its ``wrt``) and the
other Variables, takes the gradient of a per-device copy of the former (2 above), and writes back what
the forward pass writes in the latter — BatchNorm statistics, RNG counters — which differ from device
to device: by the ``buffers`` policy their mean or device 0's, the same on every device, or kept per
device, stacked like per-device optimizer state. Flax is the caller's dependency, not jaxcomp's:
``flax.nnx`` is looked up where the caller imported it.

``shard_map`` runs with ``check_vma=True``: a value that differs from device to device but would be
returned as replicated — parameters a transformation did not average (``optax.masked`` around a
compressor, a hook that does not communicate), a per-device state leaf no state declares — is an
error naming the leaf, never a silent drift.

Optimizers that let the parameters differ between synchronizations — ``jaxcomp.local_sgd`` and
``jaxcomp.diloco``, whose states declare ``PARAMS_PER_DEVICE`` — need the parameters per device too.
The loss-function form reads the declaration from the optimizer state and keeps the parameters the
way it keeps per-device state leaves: stacked along a leading axis of W, sharded along it
(``make_params`` places them so); the per-device-step form is told by the state, where the
parameters are wrapped in ``jaxcomp.PerDevice``. The step returns them stacked, one copy per
device: the copies are bitwise identical right after a synchronization and differ in between. A
state without the declaration keeps replicated parameters, as before; parameters left replicated
under such an optimizer are refused (they differ from device to device), and parameters not
stacked are refused by shape — never averaged or reduced to one device's copy behind your back.

In a job of several processes (``jax.process_count() > 1``) every process must start from the
same state, as PyTorch DDP makes sure by broadcasting rank 0's at construction. The
per-device-step form's ``make_state`` does the same: every leaf of the state it is given becomes
process 0's (``jaxcomp.broadcast_replicated``'s mechanics, per-device leaves included: before
they are stacked they are one device's start). The loss-function form cannot replace the
parameters the caller keeps, so ``make_state`` and ``make_params`` check them
(``jaxcomp.check_replicated``) and raise ``ReplicaMismatchError`` naming the first leaf that
differs; ``params = jaxcomp.broadcast_replicated(params)`` before them is the fix. Leaves already
sharded over the mesh (a global ``jax.Array``, one value by construction) are left as they are.

Sharded optimizer state (ZeRO-1/2): with ``tx=jaxcomp.sharded_optimizer(exchange, optimizer)``
each device keeps 1/W of the optimizer's state and updates its shard of the parameters, between a
reduce-scatter of the gradient and an all-gather of the update (``jaxcomp._src.zero``). Nothing in
the step changes for it: its state declares those shards per device, so they are stored as
per-device leaves are, stacked along a leading axis of W and sharded along it — the global array of
a shard is its leaf, padded and rearranged — and ``make_state`` makes that state on every device
(each cuts its own shards) instead of stacking copies of one device's.

The interface is small on purpose (other parts of jaxcomp build on it): ``make_state`` (the state,
placed), ``make_params`` (the parameters of the loss-function form, placed), ``step`` (the jitted
global step), ``shard`` (a batch, placed) and ``shardings`` (of a state, e.g. as an orbax restore
target).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxcomp._src import axis, distributed, validate
from jaxcomp._src.sharding import params_per_device, per_device_mask
from jaxcomp._src.zero import holds_sharded_state


def _axes(axis_name) -> tuple:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _has_explicit_axes(mesh: Mesh) -> bool:
  return any(t == AxisType.Explicit for t in mesh.axis_types)


def _auto(mesh: Mesh) -> Mesh:
  """The same devices and axis names with every axis Auto (left to the partitioner)."""
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _explicit_spec(x) -> Optional[PartitionSpec]:
  """The spec of a value typed with Explicit mesh axes, or None (Auto axes, host arrays)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or not _has_explicit_axes(mesh):
    return None
  return sharding.spec


def _without(spec: PartitionSpec, axes: tuple) -> PartitionSpec:
  """``spec`` with ``axes`` removed: inside ``shard_map`` they are manual, not a sharding."""
  def keep(entry):
    names = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a not in axes)
    return names[0] if len(names) == 1 else (names or None)
  return PartitionSpec(*(None if entry is None else keep(entry) for entry in spec))


def _constrain(x, sharding: NamedSharding):
  """``x`` with ``sharding``, by the API its mesh's axis types call for."""
  if _has_explicit_axes(sharding.mesh):
    return jax.sharding.reshard(x, sharding)
  return lax.with_sharding_constraint(x, sharding)


def _to_auto(auto: Mesh, tree):
  """``tree``'s leaves typed with Explicit mesh axes, constrained to the same specs on ``auto``."""
  def to_auto(x):
    spec = _explicit_spec(x)
    return x if spec is None else lax.with_sharding_constraint(x, NamedSharding(auto, spec))
  return jax.tree.map(to_auto, tree)


def _flat_with_mask(trees, names, masks) -> tuple:
  """The leaves of all ``trees``, their per-device flags (from the bool trees ``masks``), paths
  (``names[i]`` + key path) and the treedefs."""
  leaves, flags, paths, treedefs = [], [], [], []
  for name, tree, mask in zip(names, trees, masks):
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves += [x for _, x in with_path]
    paths += [name + jax.tree_util.keystr(p) for p, _ in with_path]
    flags += jax.tree.leaves(mask)
    treedefs.append(treedef)
  return leaves, flags, paths, treedefs


def _unflatten(treedefs, leaves) -> list:
  trees, start = [], 0
  for treedef in treedefs:
    trees.append(treedef.unflatten(leaves[start:start + treedef.num_leaves]))
    start += treedef.num_leaves
  return trees


def _refuse_varying(leaves, masks, paths, axes, local_steps: bool) -> None:
  """A replicated output that differs per device would be silently reduced to one device's copy.

  ``local_steps``: the state holds an optimizer that keeps the parameters per device.
  """
  for x, per_device, path in zip(leaves, masks, paths):
    if not per_device and set(axes) & axis.varying_axes(x):
      why = ("The state holds an optimizer that moves each device's parameters on its own between "
             "synchronizations (local_sgd, diloco): declare the parameters per device, "
             "jaxcomp.PerDevice(params) (or PerDevice(model)) in the state, and make_state "
             "stacks them" if local_steps else
             "A parameter left out of the compressor (optax.masked: use powersgd(compress=...) "
             "or dgc(sparsify=...) instead), a hook that does not average, a per-device state "
             "leaf that no state declares (declare it: PER_DEVICE_FIELDS, or wrap it in "
             "jaxcomp.PerDevice), or model state the forward pass wrote (BatchNorm statistics: "
             "jaxcomp.sync_buffers in the step; for an nnx model, data_parallel's loss form keeps "
             "it)")
      raise ValueError(
          f"{path} differs from device to device after the step, but it is replicated: "
          "it was not averaged over " + repr(axes[0] if len(axes) == 1 else axes) + ". " + why)


def _body(local, treedefs, masks, paths, axes, names, mask_of, pins, leaves, batch):
  """The per-device step inside ``shard_map``: unstack per-device leaves, run, stack them again.

  ``mask_of(states)``: the per-device bool tree of each state. ``pins``: None, or for an Explicit
  mesh the spec over the other axes each returned leaf must have (that of its input), so that
  returning to the Explicit mesh moves no data.
  """
  leaves = [x[0] if per_device else x for x, per_device in zip(leaves, masks)]
  *states, out = local(*_unflatten(treedefs, leaves), *batch)
  new_leaves, new_masks, _, new_treedefs = _flat_with_mask(states, names, mask_of(states))
  if new_treedefs != treedefs or new_masks != masks:
    raise ValueError(f"the step must return {', '.join(names)} with the structure it received: "
                     f"got {new_treedefs}, expected {treedefs}")
  _refuse_varying(new_leaves, masks, paths, axes, params_per_device(states))
  if pins is not None:
    mesh = jax.sharding.get_abstract_mesh()
    new_leaves = [lax.with_sharding_constraint(x, NamedSharding(mesh, pin))
                  for x, pin in zip(new_leaves, pins)]
    out = lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec()))
  new_leaves = [jnp.asarray(x)[None] if per_device else x
                for x, per_device in zip(new_leaves, masks)]
  return new_leaves, jax.tree.map(lambda x: jnp.asarray(x)[None], out)


def _global_step(local, mesh: Mesh, axes: tuple, names: tuple, mask_of: Callable, *args):
  """The jitted global step: check and place the inputs, ``shard_map`` the body, restore shardings.

  ``args`` are the states (one per entry of ``names``), then the batch; ``mask_of(states)`` gives
  the per-device bool tree of each state.
  """
  states, batch = args[:len(names)], args[len(names):]
  world = math.prod(mesh.shape[a] for a in axes)
  leaves, masks, paths, treedefs = _flat_with_mask(states, names, mask_of(states))
  for x, per_device, path in zip(leaves, masks, paths):
    if per_device and (not np.shape(x) or np.shape(x)[0] != world):
      fix = ("Place the parameters with make_params, which stacks what is per device (all of them "
             "under an optimizer that moves them between synchronizations, an nnx model's other "
             "Variables with buffers='per_device')" if path.startswith("params") else
             "Make the state with make_state, which stacks it")
      raise ValueError(
          f"{path} is per device and must be stacked along a leading axis of {world} (one "
          f"entry per device along {axes}); got shape {list(np.shape(x))}. {fix}")
  for path, x in jax.tree_util.tree_leaves_with_path(batch):
    if not np.shape(x) or np.shape(x)[0] % world:
      raise ValueError(f"batch{jax.tree_util.keystr(path)}: the leading axis is split over the "
                       f"{world} devices along {axes}, so its size must be a multiple of {world}; "
                       f"got shape {list(np.shape(x))}")
  explicit = _has_explicit_axes(mesh)
  specs = [PartitionSpec(axes) if per_device else PartitionSpec() for per_device in masks]
  # On an Explicit mesh the results get the shardings their inputs had (the per-device leaves:
  # along the data axis, replicated over the others), pinned inside the body.
  user_specs = [_explicit_spec(x) or PartitionSpec() for x in leaves]
  out_specs = [spec if per_device else user
               for spec, per_device, user in zip(specs, masks, user_specs)]
  pins = None
  if explicit:
    pins = [PartitionSpec() if per_device else _without(user, axes)
            for per_device, user in zip(masks, user_specs)]
  auto = _auto(mesh)
  with jax.sharding.use_abstract_mesh(auto.abstract_mesh):
    if explicit:  # every axis Auto inside: the partitioner handles the others
      leaves, batch = _to_auto(auto, (leaves, batch))
    new_leaves, out = jax.shard_map(
        functools.partial(_body, local, treedefs, masks, paths, axes, names, mask_of, pins),
        mesh=auto,
        in_specs=(specs, PartitionSpec(axes)), out_specs=(specs, PartitionSpec(axes)),
        axis_names=set(axes), check_vma=True)(leaves, batch)
  if explicit:  # back to the caller's mesh
    new_leaves = [jax.sharding.reshard(x, NamedSharding(mesh, spec))
                  for x, spec in zip(new_leaves, out_specs)]
    out = jax.sharding.reshard(out, NamedSharding(mesh, PartitionSpec(axes)))
  return (*_unflatten(treedefs, new_leaves), out)


class _OnMesh:
  """A jitted function called (and lowered) with its mesh set, as Explicit mesh axes require."""

  def __init__(self, jitted, mesh: Mesh):
    self._jitted, self._mesh = jitted, mesh
    functools.update_wrapper(self, jitted)

  def __call__(self, *args):
    with jax.set_mesh(self._mesh):
      return self._jitted(*args)

  def lower(self, *args):
    with jax.set_mesh(self._mesh):
      return self._jitted.lower(*args)


_LOSS_FORM = ("params", "opt_state")
_Optimizer = Union[optax.GradientTransformation, optax.MultiSteps]
BUFFER_POLICIES = ("mean", "first", "per_device")


def _step_form_masks(states) -> list:
  """The per-device bool tree of the per-device-step form's state: what its states declare."""
  return [per_device_mask(states[0])]


def _loss_form_masks(buffers: str, states) -> list:
  """The per-device bool trees of the loss form's ``(params, opt_state)``.

  The parameters are all per device under an optimizer that moves them between synchronizations
  (a state declares ``PARAMS_PER_DEVICE``); of an nnx model, with ``buffers="per_device"``, the
  Variables other than ``nnx.Param``.
  """
  params, opt_state = states
  if params_per_device(opt_state):
    params_mask = jax.tree.map(lambda _: True, params)
  elif _is_module(params):
    params_mask = _model_mask(params, buffers == "per_device")
  else:
    params_mask = per_device_mask(params)
  return [params_mask, per_device_mask(opt_state)]


def _loss_step(loss_fn, tx, axes, has_aux, buffers, params, opt_state, *batch):
  """The per-device step of the loss-function form: local gradient, compressed mean, update."""
  if _is_module(params) or _is_optimizer(opt_state):
    return _nnx_loss_step(loss_fn, tx, axes, has_aux, buffers, params, opt_state, *batch)
  # 2: no hidden all-reduce of the gradient (per-device parameters already are a per-device copy).
  local_params = jax.tree.map(lambda p: axis.make_varying(p, axes), params)
  value, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(local_params, *batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value


# --- Flax NNX: the loss form with an nnx model as the parameters ---------------------------------
# Flax is the caller's dependency, not jaxcomp's: ``flax.nnx`` is looked up where the caller has
# imported it (it has, to make the model), never imported here.


def _nnx():
  """``flax.nnx`` if the caller has imported it, else None."""
  return sys.modules.get("flax.nnx")


def _is_module(x) -> bool:
  nnx = _nnx()
  return nnx is not None and isinstance(x, nnx.Module)


def _is_optimizer(x) -> bool:
  nnx = _nnx()
  return nnx is not None and isinstance(x, nnx.Optimizer)


def _model_mask(model, buffers_per_device: bool):
  """``model`` with True at the leaves of its Variables other than ``nnx.Param`` if
  ``buffers_per_device``, False everywhere else."""
  nnx = _nnx()
  is_variable = lambda x: isinstance(x, nnx.Variable)

  def flag(node):
    per_device = buffers_per_device and is_variable(node) and not isinstance(node, nnx.Param)
    return jax.tree.map(lambda _: per_device, node)

  return jax.tree.map(flag, model, is_leaf=is_variable)


def _check_nnx(model, optimizer, tx) -> None:
  """An nnx model comes with the ``nnx.Optimizer`` of ``tx``.

  Raises:
    TypeError: one of the two is not an nnx object.
    ValueError: the optimizer was made with another transformation than ``tx``.
  """
  if not _is_module(model):
    raise TypeError(f"params: an nnx.Optimizer (opt_state) updates an nnx model; got params of "
                    f"type {type(model).__name__}. Pass the model as params")
  if not _is_optimizer(optimizer):
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


def _nnx_loss_step(loss_fn, tx, axes, has_aux, buffers, model, optimizer, *batch):
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
  _check_nnx(model, optimizer, tx)
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
  tx: Optional[_Optimizer]
  buffers: str = "mean"

  @property
  def world_size(self) -> int:
    """The number of devices along ``axis_name``."""
    return math.prod(self.mesh.shape[a] for a in _axes(self.axis_name))

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
    if self.tx is None or _is_optimizer(tree):
      if self.tx is not None and tree.tx is not self.tx:
        raise ValueError("tree: this nnx.Optimizer was made with another transformation than the "
                         "tx given to data_parallel; make it with make_state(model)")
      _refuse_sharded_state(tree)
      make = lambda t: t
    elif _is_module(tree):
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
    opt_state = (jax.eval_shape(self._init, params) if _is_module(params)
                 else self._abstract_state(params))
    return self._place(self._same_start(params), lambda t: t,
                       lambda t: _loss_form_masks(self.buffers, (t, opt_state))[0])

  def _init(self, params):
    """The loss form's optimizer state: ``tx.init(params)``, or for an nnx model
    ``nnx.Optimizer(model, tx, wrt=nnx.Param)``."""
    if _is_module(params):
      optimizer = _nnx().Optimizer(params, self.tx, wrt=_nnx().Param)
      _refuse_sharded_state(optimizer)
      return optimizer
    return self.tx.init(params)

  def _init_per_device(self, params, mask=None):
    """``tx.init(params)`` run on every device of the data axis, inside ``shard_map``: the leaves
    ``mask`` marks (all of them if None) stacked along a new leading axis of W, sharded along it."""
    axes = _axes(self.axis_name)
    auto = _auto(self.mesh)

    def body(p):
      state = self.tx.init(p)
      marks = jax.tree.map(lambda _: True, state) if mask is None else mask
      return jax.tree.map(lambda x, m: jnp.asarray(x)[None] if m else x, state, marks)

    marks = PartitionSpec(axes) if mask is None else jax.tree.map(
        lambda m: PartitionSpec(axes) if m else PartitionSpec(), mask)
    with jax.sharding.use_abstract_mesh(auto.abstract_mesh):
      return jax.shard_map(body, mesh=auto, in_specs=PartitionSpec(), out_specs=marks,
                           axis_names=set(axes), check_vma=True)(_to_auto(auto, params))

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
      if not _has_explicit_axes(self.mesh):
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
          _constrain(jnp.broadcast_to(x, (world,) + jnp.shape(x)), per_device) if m else x
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


def data_parallel(fn: Callable, mesh: Mesh, *, axis_name: axis.AxisName = "batch",
                  tx: Optional[_Optimizer] = None,
                  has_aux: bool = False, buffers: str = "mean") -> DataParallel:
  """A jitted data-parallel training step for a jaxcomp optimizer, from a function and a ``Mesh``.

  Two forms. With ``tx``, ``fn`` is the loss, ``fn(params, *batch) -> loss`` (or ``(loss, aux)``
  with ``has_aux``) on one device's shard of the batch, and the step is
  ``step(params, opt_state, *batch) -> (params, opt_state, loss)``::

    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    tx = optax.chain(jaxcomp.powersgd(rank=2), optax.adamw(1e-3))
    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    opt_state = dp.make_state(params)
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard((x, y)))

  The parameters may be a Flax NNX model, ``fn(model, *batch)``; the optimizer state is then its
  ``nnx.Optimizer``::

    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    optimizer = dp.make_state(model)        # nnx.Optimizer(model, tx, wrt=nnx.Param), placed
    model, optimizer, loss = dp.step(model, optimizer, *dp.shard((x, y)))

  The gradient is taken of a per-device copy of the parameters, and every other Variable the
  forward pass writes — BatchNorm's running statistics, the RNG counters of Dropout, any Variable —
  is written back into the model. Each device computes them from its own shard, so they differ
  from device to device; ``buffers`` says what they become:

  * ``"mean"`` (the default): their mean over the devices, one all-reduce per dtype per step
    (``jaxcomp.sync_buffers``). With equal shards the running mean is the one a single device
    would keep for the whole batch (the running variance misses the spread between the shards'
    means), and the model stays one model, identical everywhere: ready to evaluate and save.
    Floating-point Variables only: an integer one that differs from device to device is refused.
  * ``"first"``: device 0's, PyTorch DDP's ``broadcast_buffers`` (from 1/W of the batch).
  * ``"per_device"``: each device keeps its own, stacked along a leading axis of W like per-device
    optimizer state (``make_params`` stacks them), at no communication; pick a copy (``x[0]``) or
    reduce them yourself to evaluate.

  A Variable that comes back identical on every device (an RNG counter, which advances alike) is
  left as it is; a parameter (a Variable the optimizer's ``wrt`` selects) that the forward pass
  writes is refused, since the optimizer computes those. Each device draws its own random numbers
  (dropout masks): the streams' keys are folded with the device's index for the forward pass, and
  kept unchanged. Under ``local_sgd`` or ``diloco`` the whole model is per device, these Variables
  too.

  Without ``tx``, ``fn`` is a per-device step written as for ``jax.pmap`` — ``fn(state, *batch) ->
  (state, out)``, with ``tx.update`` inside it as the cross-device mean — and the step is
  ``step(state, *batch) -> (state, out)``. ``state`` is any pytree (``(params, opt_state)``, a Flax
  ``(model, nnx.Optimizer)``); take gradients of ``lax.pcast(params, axis_name, to="varying")``,
  as the loss form does for you. The gradient of the replicated parameters themselves is already
  summed over the devices (autodiff's transpose of their implicit ``pvary`` is a float32
  ``psum``): the compressor then averages a sum, and the update is W times too large. Of an nnx
  model, ``pcast`` makes a copy, and what the forward pass writes in it is lost: use the loss form.

  ``jaxcomp.local_sgd`` and ``jaxcomp.diloco`` move each device's parameters on its own between
  synchronizations, so the parameters are per device: stacked along a leading axis of W (one copy
  per device), sharded over ``axis_name``. The step takes and returns them so, and the copies are
  bitwise identical right after every synchronization (any one copy is then *the* parameters,
  e.g. ``jax.tree.map(lambda p: np.asarray(p)[0], params)``) and differ in between. Loss-function form::

    tx = jaxcomp.local_sgd(optax.sgd(0.1, momentum=0.9), sync_every=8)
    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    opt_state = dp.make_state(params)       # from the parameters of one device
    params = dp.make_params(params)         # stacked: (W, ...) per leaf
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard((x, y)))

  Per-device-step form: wrap the parameters in ``jaxcomp.PerDevice`` in the state
  (``(jaxcomp.PerDevice(params), opt_state)``, ``(jaxcomp.PerDevice(model), optimizer)``); inside
  the step they are this device's own copy, already varying, so take the gradient of them directly
  (no ``pcast``). Left replicated, they are refused with an error naming them.

  Models that fill the devices shard the optimizer state over them (ZeRO-1/2): with
  ``tx=jaxcomp.sharded_optimizer(exchange, optimizer)`` in place of ``optax.chain(exchange,
  optimizer)`` each device keeps 1/W of the optimizer's state, receives its shard of the mean
  gradient (a reduce-scatter through the compressor ``exchange``) and updates that shard of the
  parameters, which are all-gathered (loss-function form, arrays as the parameters)::

    tx = jaxcomp.sharded_optimizer(jaxcomp.bf16_compress(), optax.adamw(1e-3),
                                   gather_dtype="bfloat16")
    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    opt_state = dp.make_state(params)       # made on every device: each keeps its own shards

  In a job of several processes ``make_state`` starts every process from process 0's state (see
  ``DataParallel.make_state``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.quantized(8), optax.sgd(0.1))
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> dp = jaxcomp.data_parallel(lambda p, x: ((x @ p) ** 2).mean(), mesh, tx=tx)
    >>> params = jnp.ones((4, 1))
    >>> opt_state = dp.make_state(params)
    >>> params, opt_state, loss = dp.step(params, opt_state, dp.shard(jnp.ones((16, 4))))
    >>> params.shape, loss.shape  # the parameters, and one loss per device
    ((4, 1), (8,))

  Args:
    fn: the loss (with ``tx``) or the per-device step (without).
    mesh: the device mesh; its other axes (a model axis, say) are left to the partitioner.
    axis_name: the mesh axis (or tuple of axes) the batch is split over; it must be the
      ``axis_name`` of the jaxcomp transformations in the optimizer.
    tx: the optimizer, normally ``optax.chain(<jaxcomp compressor>, <optax optimizer>)``, or
      ``jaxcomp.sharded_optimizer(<jaxcomp compressor>, <optax optimizer>)`` to shard its state;
      an ``optax.MultiSteps`` too.
    has_aux: ``fn`` returns ``(loss, aux)`` (loss-function form only).
    buffers: ``"mean"``, ``"first"`` or ``"per_device"``: what an nnx model's Variables that the
      forward pass writes become (loss-function form; see above).

  Returns:
    A ``DataParallel``: ``step``, ``make_state``, ``make_params``, ``shard``, ``shardings``.

  Raises:
    TypeError: ``mesh`` is not a ``Mesh``, or ``tx`` not an optax transformation.
    ValueError: ``axis_name`` is not an axis of ``mesh``; ``has_aux`` or ``buffers`` given without
      ``tx``; ``buffers`` is not a policy above.
  """
  validate.function(fn, "fn", "fn(params, *batch)" if tx is not None else "fn(state, *batch)")
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh(...)); got "
                    f"{type(mesh).__name__}")
  axis_name = axis.check_axis_name(axis_name)
  missing = [a for a in _axes(axis_name) if a not in mesh.axis_names] if axis_name else [None]
  if missing:
    raise ValueError(f"axis_name must name axes of the mesh {tuple(mesh.axis_names)}; got "
                     f"{axis_name!r}")
  has_aux = validate.boolean(has_aux, "has_aux")
  buffers = validate.choice(buffers, "buffers", BUFFER_POLICIES)
  axes = _axes(axis_name)
  if tx is None:
    if has_aux:
      raise ValueError("has_aux applies to a loss function, with tx; a per-device step returns "
                       "(state, out)")
    if buffers != "mean":
      raise ValueError(f"buffers applies to a loss function of an nnx model, with tx; got "
                       f"buffers={buffers!r} for a per-device step, which keeps its model state "
                       "itself (jaxcomp.sync_buffers)")
    step = functools.partial(_global_step, fn, mesh, axes, ("state",), _step_form_masks)
  else:
    # optax.MultiSteps is a class with init and update, not a GradientTransformation.
    if not isinstance(tx, (optax.GradientTransformation, optax.MultiSteps)):
      raise TypeError(f"tx must be an optax.GradientTransformation (or optax.MultiSteps); got "
                      f"{type(tx).__name__}")
    local = functools.partial(_loss_step, fn, tx, axes, has_aux, buffers)
    step = functools.partial(_global_step, local, mesh, axes, _LOSS_FORM,
                             functools.partial(_loss_form_masks, buffers))
  return DataParallel(_OnMesh(jax.jit(step), mesh), mesh, axis_name, tx, buffers)
