"""Restoring a per-device state onto another number of devices: laid out again, or refused.

A per-device state is stacked along a leading axis of W, one entry per device, and the shard of a
parameter is the parameter padded and dealt out over the W devices (``shards.Layout``): a
checkpoint holds its W's layout. orbax restores it exactly onto a mesh of the same W; onto another
W it refuses (the shapes differ) and suggests ``strict=False``, which pads or truncates every
stacked axis and every shard: the parameters and the optimizer's moments come back scrambled, and
nothing says so. ``restore`` lays out a state saved at any W for this mesh (the ``# n:`` comments
below):

1. the saved arrays' shapes and the mesh they were saved from are read from the checkpoint's
   metadata (``saved_arrays``), by each array's name (its key path joined by dots, as orbax names
   it);
2. where the layout is this mesh's (the same W, the same cut), the checkpoint is restored as it
   is, exactly;
3. otherwise the arrays are restored as saved, replicated on this mesh (the whole state on every
   device, for the time of the restore), and each leaf is laid out again by its ``Kind``: a leaf's
   shards (a parameter's, or an optimizer state's shaped like it: Adam's moments, a master copy)
   are joined into the whole leaf with the saved layout and split with this one, exactly; a
   per-device copy of a value every device holds alike (a count) is copied to this mesh's
   devices; a value of each device's own (error feedback, Dion's momentum) cannot be laid out for
   other devices and starts afresh, from the state made for this mesh, with a warning naming it;
   a leaf that is not per device is restored as saved;
4. the result is placed with the shardings of the state made for this mesh.

``fully_sharded``'s state also records its layout (``FullyShardedState.layout``, ``marker``): its
step refuses a state laid out for another mesh before it runs (``CheckedStep``), e.g. one that
orbax's ``strict=False`` padded or truncated. ``restore_data_parallel`` (``DataParallel.restore``)
is the call for ``jaxcomp.data_parallel``'s loss form (``sharded_optimizer``'s shards, Dion's
momenta).

orbax-checkpoint is the caller's dependency (jaxcomp's ``examples`` extra), imported here when
called.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcomp._src import shards, spmd, zero
from jaxcomp._src.sharding import per_device_mask


class Kind(NamedTuple):
  """How a leaf of a state is laid out for another mesh (the module docstring's 3).

  Attributes:
    name: ``"leaf"``: stacked parts of the whole leaf of ``shape`` (a device's shard, or the whole
      leaf where ``whole(W)`` says it is kept whole on W devices); ``"copy"``: a value the same on
      every device; ``"own"``: each device's own, started afresh with a warning; ``"new"``: started
      afresh without one (a record of the layout itself); ``"global"``: not per device.
    shape: the whole leaf's shape (``"leaf"``).
    whole: ``whole(W)``: whether the leaf is kept whole (a copy per device) on W devices.
  """
  name: str
  shape: tuple = ()
  whole: Optional[Callable[[int], bool]] = None


def leaf_of(path: str, shape: tuple, paths: Sequence[str], shard_shapes: Sequence[tuple]):
  """The index of the parameter that a state leaf at ``path`` (a ``keystr``) of per-device
  ``shape`` is a part of, or None: the longest of ``paths`` it ends with whose shard has that
  shape (an optimizer's moments of a parameter end with its key path)."""
  best = None
  for i, (p, s) in enumerate(zip(paths, shard_shapes)):
    if path.endswith(p) and tuple(shape) == tuple(s) and (best is None or
                                                          len(p) > len(paths[best])):
      best = i
  return best


def array_name(path) -> str:
  """The name orbax gives the array at key path ``path``: its keys joined by dots."""
  return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _orbax():
  try:
    import orbax.checkpoint as ocp
  except ImportError as error:
    raise ImportError("restoring a checkpoint needs orbax-checkpoint (pip install "
                      "orbax-checkpoint, or jaxcomp[examples])") from error
  return ocp


def _metadata(directory):
  """The checkpoint's tree of array metadata (orbax's, saved by a ``StandardCheckpointer``)."""
  with _orbax().StandardCheckpointer() as checkpointer:
    metadata = checkpointer.metadata(directory)
  return getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)


def saved_arrays(directory) -> dict:
  """1: the arrays of the orbax checkpoint in ``directory``: ``{name: (shape, mesh)}``, ``mesh``
  the saving mesh's axis sizes by name (None where the metadata has none)."""
  found = {}
  for array in jax.tree.leaves(_metadata(directory)):
    sharding = getattr(array, "sharding", None)
    names = getattr(sharding, "axis_names", None)
    sizes = getattr(sharding, "shape", None)
    found[array.name] = (tuple(array.shape), None if names is None or sizes is None else
                         dict(zip(names, (int(n) for n in sizes))))
  return found


def _as_saved(directory, mesh: Mesh) -> dict:
  """3: every array of the checkpoint as saved, replicated on ``mesh``, by name."""
  tree = _metadata(directory)
  replicated = NamedSharding(mesh, PartitionSpec())
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                        tree)
  with _orbax().StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(directory, target)
  return {a.name: x for a, x in zip(jax.tree.leaves(tree), jax.tree.leaves(restored))}


def _relaid(x, fresh, kind: Kind, old: shards.Layout, new: shards.Layout):
  """3: one leaf, restored as saved (``x``), laid out for ``new``."""
  if kind.name in ("own", "new"):
    return fresh
  if kind.name == "global":
    return x
  if kind.name == "copy":
    return jnp.broadcast_to(x[0], (new.world,) + tuple(x.shape[1:]))
  whole = x[0] if kind.whole(old.world) else old.join(x, kind.shape)
  if kind.whole(new.world):
    return jnp.broadcast_to(whole, (new.world,) + tuple(kind.shape))
  return new.split(whole)


def restore(directory, fresh, kinds: Sequence[Kind], mesh: Mesh, axis_name,
            new: shards.Layout):
  """1–4: the state saved in ``directory``, laid out for ``new`` on ``mesh``.

  Args:
    directory: an orbax ``StandardCheckpointer`` checkpoint of the state.
    fresh: the state made for this mesh (placed): its structure, shardings and the values of the
      leaves that start afresh.
    kinds: a ``Kind`` per leaf of ``fresh`` (``jax.tree.leaves`` order).
    mesh: this mesh.
    axis_name: the axis (or axes) the per-device leaves are stacked over.
    new: this mesh's layout of shards.

  Returns:
    The restored state, placed as ``fresh`` is.

  Raises:
    ValueError: the checkpoint lacks an array of the state, a leaf that is not per device has
      another shape, the per-device leaves disagree on their W, or the saving mesh is unknown.
  """
  saved = saved_arrays(directory)  # 1: the saved arrays' shapes, and the mesh they came from
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(fresh)
  names = [array_name(path) for path, _ in with_paths]
  leaves = [x for _, x in with_paths]
  for name, x, kind in zip(names, leaves, kinds):
    if name not in saved and kind.name not in ("own", "new"):  # those start afresh anyway
      raise ValueError(f"directory: the checkpoint holds no array {name!r} of this state (it "
                       f"holds {len(saved)}): restore a checkpoint of this kind of state")
    if kind.name == "global" and saved[name][0] != tuple(x.shape):
      raise ValueError(f"directory: {name} was saved with shape {saved[name][0]}, this state's "
                       f"is {tuple(x.shape)}: a checkpoint of other parameters")
  worlds = {saved[n][0][0] for n, k in zip(names, kinds) if k.name != "global" and n in saved}
  if len(worlds) > 1:
    raise ValueError(f"directory: the per-device arrays are stacked for {sorted(worlds)} devices: "
                     "not one state's")
  sizes = next((s[1] for s in saved.values() if s[1] is not None), None)
  old_world = worlds.pop() if worlds else new.world
  if sizes is None and old_world != new.world:
    raise ValueError("directory: the checkpoint does not say which mesh it was saved from, so its "
                     "shards cannot be laid out again: restore it on that mesh")
  axes = spmd.axes(axis_name)
  old = shards.Layout(old_world, any(s > 1 for a, s in (sizes or {}).items() if a not in axes)
                      if sizes is not None else new.by_leaf)
  ocp = _orbax()
  if old == new:  # 2: this mesh's layout: as it is
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          fresh)
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.restore(directory, target)
  # 3: as saved, replicated on this mesh ...
  by_name = _as_saved(directory, mesh)
  raw = [by_name.get(n, x) for n, x in zip(names, leaves)]  # (what starts afresh: the fresh)

  # ... and laid out for this mesh; 4: placed as the state made for it.
  def relaid(raw, leaves):
    return [_relaid(x, f, k, old, new) for x, f, k in zip(raw, leaves, kinds)]
  with jax.set_mesh(mesh):
    out = jax.jit(relaid, out_shardings=[x.sharding for x in leaves])(raw, leaves)
  afresh = [jax.tree_util.keystr(p) for (p, _), k in zip(with_paths, kinds) if k.name == "own"]
  if afresh:
    warnings.warn(
        f"restore: state{', state'.join(afresh)} (each device's own: error feedback, momenta) "
        f"cannot be laid out for {new.world} devices from the {old.world} it was saved from, and "
        "starts afresh", stacklevel=3)
  return treedef.unflatten(out)


# --------------------------------------------------------------- jaxcomp.data_parallel's loss form


def data_parallel_kinds(state, new: shards.Layout) -> list:
  """The ``Kind`` of every leaf of a placed loss-form optimizer state of ``data_parallel``, laid
  out as ``new``: in a ``sharded_optimizer``'s state, its optimizer's state and master copy hold
  each device's shard of every reduced leaf (``"leaf"``; their other leaves, counts, ``"copy"``);
  every other per-device leaf (error feedback, Dion's momentum) is ``"own"``, the rest
  ``"global"``."""
  is_sharded = lambda node: isinstance(node, zero.ShardedOptimizerState)  # noqa: E731
  own = lambda flags: [Kind("own") if m else Kind("global") for m in flags]  # noqa: E731
  mask = jax.tree.leaves(per_device_mask(state))
  kinds = []
  for node in jax.tree.leaves(state, is_leaf=is_sharded):
    flags, mask = mask[:len(jax.tree.leaves(node))], mask[len(jax.tree.leaves(node)):]
    if not is_sharded(node):
      kinds += own(flags)
      continue
    signature = node.signature
    kinds += own(flags[:len(jax.tree.leaves(node.exchange))])
    shard_shapes = [new.shape(shape) for shape in signature.shapes]
    for part in (node.inner, node.master):
      for path, x in jax.tree_util.tree_leaves_with_path(part):
        i = leaf_of(jax.tree_util.keystr(path), tuple(x.shape[1:]), signature.paths, shard_shapes)
        kinds.append(Kind("leaf", signature.shapes[i], lambda w: False)
                     if i in signature.reduced else Kind("copy"))
  return kinds


def restore_data_parallel(dp, directory, params):
  """The loss form's optimizer state of ``dp`` (a ``jaxcomp.data_parallel(loss_fn, mesh,
  tx=...)``) saved in ``directory`` by an orbax ``StandardCheckpointer``, laid out for ``dp``'s
  mesh whatever number of devices it was saved from (the module docstring): a
  ``sharded_optimizer``'s shards of its optimizer's state (and master copy) exactly; each device's
  own leaves (error feedback, Dion's momentum) started afresh, with a warning naming them.

  ``DataParallel.restore`` is this call::

    opt_state = dp.restore("/ckpt/100", params)

  Args:
    dp: the ``DataParallel`` whose state it is (loss form, arrays as the parameters).
    directory: the checkpoint.
    params: the parameters (their structure, shapes and dtypes make the fresh state).

  Returns:
    The optimizer state, placed as ``dp.make_state(params)`` places it.
  """
  fresh = dp.make_state(params)
  others = [s for a, s in dp.mesh.shape.items() if a not in spmd.axes(dp.axis_name)]
  new = shards.Layout(dp.world_size, any(s > 1 for s in others))
  return restore(directory, fresh, data_parallel_kinds(fresh, new), dp.mesh, dp.axis_name, new)


# ------------------------------------------------------------------ a layout recorded in the state


def marker(world: int, by_leaf: bool) -> jax.Array:
  """The record of a layout that ``fully_sharded``'s state keeps: ``[W, by_leaf]`` per device,
  stacked ``(W, 2)``."""
  return jnp.broadcast_to(jnp.array([world, int(by_leaf)], jnp.int32), (world, 2))


def check_layout(state_marker, world: int, by_leaf: bool, axis_name) -> None:
  """Raises unless ``state_marker`` (a state's ``marker``) records this layout: W devices along
  ``axis_name``, cut by leaf or flat. Reads this process's rows of it (abstract values pass).

  Raises:
    ValueError: the state is laid out for another mesh (naming it and the fix).
  """
  if isinstance(state_marker, jax.core.Tracer) or getattr(
      type(state_marker), "addressable_shards", None) is None:  # traced, or abstract
    return
  rows = (np.concatenate([np.asarray(s.data).reshape(-1, 2)
                          for s in state_marker.addressable_shards])
          if tuple(state_marker.shape[1:]) == (2,) else np.zeros((1, 2), int))
  bad = next((tuple(int(v) for v in r) for r in rows if tuple(r) != (world, int(by_leaf))), None)
  if bad is None and state_marker.shape[0] % world == 0:  # stacked once per replica, or more
    return
  bad = bad or (int(state_marker.shape[0]), int(by_leaf))
  cut = lambda leaf: "cut by leaf" if leaf else "flat"  # noqa: E731
  saved = f"{bad[0]} devices ({cut(bad[1])})" if bad[0] else "fewer devices (padded)"
  raise ValueError(
      f"state: laid out for {saved} along {axis_name!r}, and this step runs on {world} "
      f"({cut(by_leaf)}): a checkpoint from another mesh (orbax's strict=False pads or truncates "
      "the shards), or a state made for one. Restore the checkpoint with fs.restore(directory, "
      "params), which lays it out for this mesh")


class CheckedStep:
  """A ``fully_sharded`` step that refuses a state laid out for another mesh before it runs
  (``check_layout``): the layout of a state it did not make is read once. The step it wraps checks
  its program as it traces it (``spmd.OnMesh``)."""
  checks_itself = True

  def __init__(self, step, world: int, by_leaf: bool, axis_name):
    self._step, self._layout = step, (world, by_leaf, axis_name)
    self._known = collections.deque(maxlen=4)  # the latest markers it made or checked

  def knows(self, state_marker) -> None:
    """Marks ``state_marker`` (of a state made for this mesh) as checked."""
    self._known.append(state_marker)

  def _check(self, state) -> None:
    found = getattr(state, "layout", None)
    if found is None or any(found is k for k in self._known):
      return
    check_layout(found, *self._layout)
    self.knows(found)

  def __call__(self, state, *batch) -> Any:
    self._check(state)
    new_state, out = self._step(state, *batch)
    self.knows(new_state.layout)
    return new_state, out

  def lower(self, state, *batch):
    self._check(state)
    return self._step.lower(state, *batch)
