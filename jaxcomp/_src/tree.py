"""Gradient pytrees as jaxcomp sees them: which leaves it reduces, their signature, flat buffers.

* ``is_reduced``: the one leaf predicate. jaxcomp reduces floating-point leaves with at least one
  element; integer, boolean and zero-size leaves pass through untouched and are never averaged.
* ``TreeSignature``: the structure, shapes and dtypes of a gradient pytree, kept in every state as a
  static node, so that ``update`` names the leaf when it receives another pytree than ``init`` saw.
* ``flatten`` / ``unflatten``: arrays packed into one flat buffer and cut out of it again by offsets
  (a DDP bucket, one collective per dtype, a batched PowerSGD matrix).

Flax NNX states (``nnx.State`` of ``nnx.Variable``\\ s, as ``nnx.Optimizer`` passes to ``init``) and the
plain arrays of the gradients have the same leaves in the same order but different tree structures:
``TreeSignature`` records the tree with every such wrapper taken off (``unwrap``), so both match.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


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
  # one array and pretty-prints as its type. Anything with ``get_value`` and ``set_value`` qualifies.
  return hasattr(node, "get_value") and hasattr(node, "set_value") and hasattr(node, "value")


def unwrap(tree):
  """``tree`` with every Flax NNX ``Variable`` replaced by the array it holds (other trees as is)."""
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
  """The structure, shapes and dtypes of a gradient pytree, kept in a state as a static node.

  It has no array leaves, so it costs nothing under ``jit`` and in checkpoints, and it lets ``update``
  say exactly what changed when it receives a pytree other than the one ``init`` saw.
  """
  treedef: Any
  shapes: tuple
  dtypes: tuple

  @classmethod
  def of(cls, tree) -> "TreeSignature":
    """The signature of ``tree``, whose leaves may be arrays or ``jax.ShapeDtypeStruct``\\ s."""
    tree = unwrap(tree)
    leaves, treedef = jax.tree.flatten(tree)
    for path, leaf in zip(paths_of(tree), leaves):
      if jnp.issubdtype(dtype_of(leaf), jnp.complexfloating):
        raise TypeError(f"params: leaf {path} is complex ({dtype_of(leaf).name}); jaxcomp reduces "
                        "real floating-point leaves only")
    return cls(treedef, tuple(shape_of(x) for x in leaves), tuple(dtype_of(x).name for x in leaves))

  def check(self, tree, name: str = "updates", dtypes: bool = True) -> list:
    """Returns ``tree``'s leaves, or raises ValueError saying how ``tree`` differs from this one.

    With ``dtypes=False`` only structure and shapes must match (a hook under
    ``fp16_compress_wrapper`` sees its bucket in another float dtype than at ``init``).
    """
    tree = unwrap(tree)
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != self.treedef:
      raise ValueError(f"{name}: the pytree structure changed between init and update: "
                       f"init saw {self.treedef}, update got {treedef}")
    for path, leaf, shape, dtype in zip(paths_of(tree), leaves, self.shapes, self.dtypes):
      if shape_of(leaf) != shape or (dtypes and dtype_of(leaf).name != dtype):
        hint = ""
        if shape_of(leaf)[1:] == shape and shape_of(leaf):
          hint = (" (it has one more leading axis: under pmap, map the state with in_axes=0 and "
                  "give it a leading device axis too, e.g. jax.pmap(tx.init)(replicated_params))")
        elif shape_of(leaf) == shape[1:] and shape:
          hint = (" (one leading axis too few: a state stacked over devices was passed outside "
                  "pmap, or under pmap with in_axes=None; map the state with in_axes=0)")
        raise ValueError(f"{name}: leaf {path} changed between init and update: init saw "
                         f"{dtype}{list(shape)}, update got "
                         f"{dtype_of(leaf).name}{list(shape_of(leaf))}{hint}")
    return leaves

  @property
  def reduced(self) -> tuple:
    """The indices of the leaves ``is_reduced`` selects (floating point, non-empty)."""
    return tuple(i for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes))
                 if is_reduced(jax.ShapeDtypeStruct(shape, dtype)))

  @property
  def paths(self) -> tuple:
    return paths_of(jax.tree.unflatten(self.treedef, [0] * len(self.shapes)))

  def unflatten(self, leaves: Sequence):
    return jax.tree.unflatten(self.treedef, list(leaves))


def like(tree, leaves: Sequence):
  """``leaves`` in ``tree``'s own structure: outputs keep the gradients' pytree, NNX Variables too."""
  return jax.tree.unflatten(jax.tree.structure(tree), list(leaves))


def offsets(shapes: Sequence[tuple]) -> tuple:
  """Where each of arrays of these shapes starts in their flat concatenation, and the total length."""
  return tuple(int(o) for o in np.cumsum([0] + [math.prod(s) for s in shapes]))


def flatten(arrays: Sequence) -> jax.Array:
  """The arrays raveled and concatenated into one flat buffer (they must share a dtype)."""
  return jnp.concatenate([jnp.ravel(x) for x in arrays])


def unflatten(flat: jax.Array, shapes: Sequence[tuple]) -> list:
  """Cuts ``flat`` (its last axis) back into arrays of ``shapes``; leading axes are kept in front."""
  o = offsets(shapes)
  return [flat[..., o[i]:o[i + 1]].reshape(flat.shape[:-1] + tuple(s))
          for i, s in enumerate(shapes)]
