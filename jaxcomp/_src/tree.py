"""Gradient pytrees as jaxcomp sees them: which leaves it reduces, their signature, flat buffers.

* ``is_reduced``: the one leaf predicate. jaxcomp reduces floating-point leaves with at least one
  element; integer, boolean and zero-size leaves pass through untouched and are never averaged.
* ``TreeSignature``: the structure, shapes and dtypes of a gradient pytree, kept in every state as a
  static node, so that ``update`` names the leaf when it receives another pytree than ``init`` saw.
* ``flatten`` / ``unflatten``: arrays packed into one flat buffer and cut out of it again by offsets
  (a DDP bucket, one collective per dtype, a batched PowerSGD matrix).

Flax NNX states (``nnx.State`` of ``nnx.Variable``\\ s, as ``nnx.Optimizer`` passes to ``init``) and
the plain arrays of the gradients have the same leaves in the same order but different tree
structures: ``TreeSignature`` records the tree with every such wrapper taken off (``unwrap``), so
both match.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax


def shape_of(x) -> tuple:
  """The shape of an array, a ``jax.ShapeDtypeStruct`` or a Python scalar."""
  return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def dtype_of(x) -> np.dtype:
  """The dtype of an array, a ``jax.ShapeDtypeStruct`` or a Python scalar."""
  return np.dtype(x.dtype) if hasattr(x, "dtype") else jnp.result_type(x)


def is_float(x) -> bool:
  """True for floating-point leaves."""
  return jnp.issubdtype(dtype_of(x), jnp.floating)


def is_reduced(x) -> bool:
  """True for the leaves jaxcomp reduces: floating point with at least one element."""
  return is_float(x) and math.prod(shape_of(x)) > 0


def map_reduced(fn: Callable, tree):
  """Applies ``fn`` to the leaves ``is_reduced`` selects; other leaves are returned untouched."""
  return jax.tree.map(lambda x: fn(x) if is_reduced(x) else x, tree)


def _is_variable(node) -> bool:
  # A Flax NNX Variable (nnx.Param, nnx.BatchStat, ...), recognised without importing Flax: it holds
  # one array and pretty-prints as its type. Anything with ``get_value`` and ``set_value``
  # qualifies. The class is asked for ``value``: reading it on a Variable is deprecated (Flax 0.12).
  return (hasattr(node, "get_value") and hasattr(node, "set_value")
          and hasattr(type(node), "value"))


def unwrap(tree):
  """``tree`` with every Flax NNX ``Variable`` replaced by the array it holds (others as is)."""
  if not any(_is_variable(x) for x in jax.tree.leaves(tree, is_leaf=_is_variable)):
    return tree
  return jax.tree.map(lambda x: x.get_value() if _is_variable(x) else x, tree,
                      is_leaf=_is_variable)


def paths_of(tree) -> tuple:
  """The ``jax.tree_util.keystr`` path of every leaf of ``tree``, in leaf order."""
  return tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class TreeSignature:
  """The structure, shapes, dtypes and paths of a gradient pytree, kept in a state as a static node.

  It has no array leaves, so it costs nothing under ``jit`` and in checkpoints, and it lets
  ``update`` say exactly what changed when it receives a pytree other than the one ``init`` saw.
  ``paths`` name the leaves for messages, for predicates (``powersgd(compress=...)``) and for the
  random draws keyed by leaf: the pytree's own key paths, or a bucket's parameter paths
  (``GradBucket.paths``), so that a leaf is treated alike whole and in a bucket.
  """
  treedef: Any
  shapes: tuple
  dtypes: tuple
  paths: tuple

  @classmethod
  def of(cls, tree, paths: Optional[Sequence[str]] = None) -> "TreeSignature":
    """The signature of ``tree``, whose leaves may be arrays or ``jax.ShapeDtypeStruct``\\ s.

    Args:
      tree: the gradient pytree (or parameters shaped like it).
      paths: a name for each leaf; default the leaves' ``jax.tree_util.keystr`` paths.
    """
    tree = unwrap(tree)
    leaves, treedef = jax.tree.flatten(tree)
    paths = paths_of(tree) if paths is None else tuple(paths)
    for path, leaf in zip(paths, leaves):
      if jnp.issubdtype(dtype_of(leaf), jnp.complexfloating):
        raise TypeError(f"params: leaf {path} is complex ({dtype_of(leaf).name}); jaxcomp reduces "
                        "real floating-point leaves only")
    return cls(treedef, tuple(shape_of(x) for x in leaves),
               tuple(dtype_of(x).name for x in leaves), paths)

  def check(self, tree, name: str = "updates", dtypes: bool = True) -> list:
    """Returns ``tree``'s leaves, or raises ValueError saying how ``tree`` differs from this one
    (TypeError for a float0 leaf, the gradient of an integer parameter).

    With ``dtypes=False`` only structure and shapes must match (a hook under
    ``fp16_compress_wrapper`` sees its bucket in another float dtype than at ``init``).
    """
    tree = unwrap(tree)
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != self.treedef:
      raise ValueError(f"{name}: the pytree structure changed between init and update: "
                       f"init saw {self.treedef}, update got {treedef}")
    for path, leaf, shape, dtype in zip(self.paths, leaves, self.shapes, self.dtypes):
      if dtype_of(leaf) == jax.dtypes.float0:
        raise TypeError(
            f"{name}: leaf {path} is float0, the gradient of the {dtype}{list(shape)} parameter "
            "from jax.grad(..., allow_int=True); neither jaxcomp nor optax's optimizers take "
            "float0 gradients. Differentiate only the floating-point parameters: keep integer "
            "leaves out of the tree given to jax.grad (a separate argument, or a Flax Variable "
            "that is not a parameter)")
      if shape_of(leaf) != shape or (dtypes and dtype_of(leaf).name != dtype):
        hint = _device_axis_hint(shape_of(leaf), shape, _UPDATES_HINTS)
        raise ValueError(f"{name}: leaf {path} changed between init and update: init saw "
                         f"{dtype}{list(shape)}, update got "
                         f"{dtype_of(leaf).name}{list(shape_of(leaf))}{hint}")
    return leaves

  @property
  def reduced(self) -> tuple:
    """The indices of the leaves ``is_reduced`` selects (floating point, non-empty)."""
    return tuple(i for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes))
                 if is_reduced(jax.ShapeDtypeStruct(shape, dtype)))

  def reduced_structs(self) -> list:
    """A ``jax.ShapeDtypeStruct`` for each reduced leaf, in order."""
    return [jax.ShapeDtypeStruct(self.shapes[i], self.dtypes[i]) for i in self.reduced]

  def pick(self, tree) -> list:
    """The entries of ``tree`` (the gradient's structure: a state's error) at the reduced leaves."""
    flat = self.treedef.flatten_up_to(tree)
    return [flat[i] for i in self.reduced]

  def place(self, values: Sequence, fill=None):
    """A tree of the gradient's structure with ``values`` at the reduced leaves, in order, and
    ``fill`` (default ``optax.MaskedNode()``, an empty node) at the others."""
    fill = optax.MaskedNode() if fill is None else fill
    flat = [fill] * len(self.shapes)
    for i, value in zip(self.reduced, values):
      flat[i] = value
    return self.unflatten(flat)

  def unflatten(self, leaves: Sequence):
    return jax.tree.unflatten(self.treedef, list(leaves))


_UNDER_PMAP = ("under pmap give the state a leading device axis — stack tx.init(params) W times or "
               "use jax.pmap(tx.init)(replicated_params) — and map it with in_axes=0")
_UPDATES_HINTS = (
    "gradients stacked over devices reached update unmapped: call update inside the pmap / "
    "shard_map "
    "step (or use jaxcomp.data_parallel), where each device sees its own gradient",
    "init was given parameters with a leading device axis: give init one device's parameters; "
    + _UNDER_PMAP)
_STATE_HINTS = (
    "a state stacked over devices reached update unmapped: " + _UNDER_PMAP
    + "; outside a mapped step pass one device's state",
    "a state without its leading device axis was mapped over devices: " + _UNDER_PMAP)


def _device_axis_hint(got: tuple, expected: tuple, hints: tuple) -> str:
  """``hints[0]`` if ``got`` has one more leading axis than ``expected``, ``hints[1]`` if one
  fewer."""
  if got and got[1:] == expected:
    return f" (one more leading axis: {hints[0]})"
  if expected and got == expected[1:]:
    return f" (one leading axis too few: {hints[1]})"
  return ""


def check_state(state, init_fn: Callable, name: str) -> None:
  """Raises unless ``state`` is what ``init_fn`` makes for the gradients its signature records.

  Every jaxcomp ``update`` calls it first, so a state stacked over devices but not mapped, one that
  lost its device axis, or another transformation's state is named — leaf, expected and received
  shape, and the fix — instead of failing deep inside the algorithm. It runs at trace time only:
  ``jax.eval_shape`` of ``init_fn`` on the recorded signature costs no computation.

  Args:
    state: the state ``update`` received.
    init_fn: the transformation's ``init``.
    name: the transformation, for the message (e.g. ``"powersgd"``).

  Raises:
    TypeError: ``state`` is not this transformation's kind of state (it names both kinds).
    ValueError: a leaf of ``state`` has another shape or dtype than ``init_fn`` gives it.
  """
  signature = getattr(state, "signature", None)
  if not isinstance(signature, TreeSignature):
    raise TypeError(f"{name}: update needs the state {name}'s init made; got "
                    f"{type(state).__name__}")
  expected = jax.eval_shape(init_fn, signature.unflatten(
      [jax.ShapeDtypeStruct(s, d) for s, d in zip(signature.shapes, signature.dtypes)]))
  if type(expected) is not type(state):
    raise TypeError(f"{name}: update got a {type(state).__name__}, the state of another "
                    f"transformation; {name}'s state is a {type(expected).__name__}. Pass each "
                    "transformation the state its own init made")
  expected_leaves, expected_def = jax.tree.flatten(expected)
  leaves, treedef = jax.tree.flatten(state)
  if treedef != expected_def:
    raise ValueError(f"{name}: the state's structure is not the one {name}'s init makes (another "
                     f"configuration's state?): expected {expected_def}, got {treedef}")
  for path, leaf, want in zip(paths_of(state), leaves, expected_leaves):
    if shape_of(leaf) != tuple(want.shape) or dtype_of(leaf) != want.dtype:
      hint = _device_axis_hint(shape_of(leaf), tuple(want.shape), _STATE_HINTS)
      raise ValueError(f"{name}: state leaf {path} should be {want.dtype.name}{list(want.shape)}, "
                       f"as {name}'s init makes it; got "
                       f"{dtype_of(leaf).name}{list(shape_of(leaf))}{hint}")


def like(tree, leaves: Sequence):
  """``leaves`` in ``tree``'s structure: outputs keep the gradients' pytree, NNX Variables too."""
  return jax.tree.unflatten(jax.tree.structure(tree), list(leaves))


def offsets(shapes: Sequence[tuple]) -> tuple:
  """Where each array of these shapes starts in their flat concatenation, and the total length."""
  return tuple(int(o) for o in np.cumsum([0] + [math.prod(s) for s in shapes]))


def flatten(arrays: Sequence) -> jax.Array:
  """The arrays raveled and concatenated into one flat buffer (they must share a dtype)."""
  return jnp.concatenate([jnp.ravel(x) for x in arrays])


def unflatten(flat: jax.Array, shapes: Sequence[tuple]) -> list:
  """Cuts ``flat`` (its last axis) back into arrays of ``shapes``; leading axes stay in front."""
  o = offsets(shapes)
  return [flat[..., o[i]:o[i + 1]].reshape(flat.shape[:-1] + tuple(s))
          for i, s in enumerate(shapes)]
