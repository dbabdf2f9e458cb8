"""The global step of ``jaxcomp.data_parallel``: a per-device function ``shard_map``-ped over a
mesh.

``global_step`` checks and places the inputs (per-device leaves stacked along a leading axis of W,
the batch split along its leading axis), maps the per-device function over the data axis with
``jax.shard_map(check_vma=True)`` — every other axis left to the partitioner — refuses a replicated
result that differs from device to device, and gives the results the shardings their inputs had
(``data_parallel``'s module docstring says why each of these is needed).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxcomp._src import axis, jaxprs, misuse
from jaxcomp._src.sharding import params_per_device


def axes(axis_name) -> tuple:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def has_explicit_axes(mesh: Mesh) -> bool:
  return any(t == AxisType.Explicit for t in mesh.axis_types)


def all_auto(mesh: Mesh) -> Mesh:
  """The same devices and axis names with every axis Auto (left to the partitioner)."""
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def explicit_spec(x) -> Optional[PartitionSpec]:
  """The spec of a value typed with Explicit mesh axes, or None (Auto axes, host arrays)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or not has_explicit_axes(mesh):
    return None
  return sharding.spec


def without(spec: PartitionSpec, axes: tuple) -> PartitionSpec:
  """``spec`` with ``axes`` removed: inside ``shard_map`` they are manual, not a sharding."""
  def keep(entry):
    names = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a not in axes)
    return names[0] if len(names) == 1 else (names or None)
  return PartitionSpec(*(None if entry is None else keep(entry) for entry in spec))


def constrain(x, sharding: NamedSharding):
  """``x`` with ``sharding``, by the API its mesh's axis types call for."""
  if has_explicit_axes(sharding.mesh):
    return jax.sharding.reshard(x, sharding)
  return lax.with_sharding_constraint(x, sharding)


def to_auto(auto: Mesh, tree):
  """``tree``'s leaves typed with Explicit mesh axes, constrained to the same specs on ``auto``."""
  def to_auto(x):
    spec = explicit_spec(x)
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
  # The per-device step, traced once: its program is checked for a collective under a decision
  # taken on each device alone (misuse.py), then run.
  (*states, out), program = jaxprs.traced_once(local, *_unflatten(treedefs, leaves), *batch)
  misuse.check_program(program.jaxpr, [jaxprs.declared_varying(v) for v in program.jaxpr.invars])
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


def global_step(local, mesh: Mesh, axes: tuple, names: tuple, mask_of: Callable, *args):
  """The jitted global step: check and place the inputs, ``shard_map`` the body, restore shardings.

  ``args`` are the states (one per entry of ``names``), then the batch; ``mask_of(states)`` gives
  the per-device bool tree of each state.
  """
  states, batch = args[:len(names)], args[len(names):]
  misuse.check_state(states)
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
  explicit = has_explicit_axes(mesh)
  specs = [PartitionSpec(axes) if per_device else PartitionSpec() for per_device in masks]
  # On an Explicit mesh the results get the shardings their inputs had over the other axes (a
  # per-device leaf's entry, after its stacked axis, as a leaf's), pinned inside the body.
  pins = [without(explicit_spec(x) or PartitionSpec(), axes) for x in leaves]
  pins = [PartitionSpec(*pin[1:]) if per_device else pin for pin, per_device in zip(pins, masks)]
  out_specs = [PartitionSpec(axes, *pin) if per_device else pin
               for pin, per_device in zip(pins, masks)]
  if not explicit:
    pins = None
  auto = all_auto(mesh)
  body = functools.partial(_body, local, treedefs, masks, paths, axes, names, mask_of, pins)
  with jax.sharding.use_abstract_mesh(auto.abstract_mesh):
    if explicit:  # every axis Auto inside: the partitioner handles the others
      leaves, batch = to_auto(auto, (leaves, batch))
    mapped = functools.partial(jax.shard_map, body, mesh=auto,
                               in_specs=(specs, PartitionSpec(axes)),
                               out_specs=(specs, PartitionSpec(axes)), axis_names=set(axes))
    try:
      new_leaves, out = mapped(check_vma=True)(leaves, batch)
    except (TypeError, ValueError) as error:
      # JAX refuses some hazards by their types before the step's program exists (a conditional
      # whose branches differ in what varies between devices): find them untyped, and name them.
      misuse.diagnose(mapped(check_vma=False), leaves, batch, error=error)
      raise
  if explicit:  # back to the caller's mesh
    new_leaves = [jax.sharding.reshard(x, NamedSharding(mesh, spec))
                  for x, spec in zip(new_leaves, out_specs)]
    out = jax.sharding.reshard(out, NamedSharding(mesh, PartitionSpec(axes)))
  return (*_unflatten(treedefs, new_leaves), out)


class OnMesh:
  """A jitted function called (and lowered) with its mesh set, as Explicit mesh axes require.

  jaxcomp's own steps are these: they check their program as they trace it (``misuse``), so
  ``comm_report`` does not check them again (``checks_itself``)."""
  checks_itself = True

  def __init__(self, jitted, mesh: Mesh):
    self._jitted, self._mesh = jitted, mesh
    functools.update_wrapper(self, jitted)

  def __call__(self, *args):
    with jax.set_mesh(self._mesh):
      return self._jitted(*args)

  def lower(self, *args):
    with jax.set_mesh(self._mesh):
      return self._jitted.lower(*args)
