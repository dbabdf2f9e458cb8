"""Stacks of same-shape leaves: how an algorithm takes a pytree's leaves of one shape through its
math as one batch, and keeps its state as the stacks.

A step that handles each leaf on its own runs a few kernels per leaf: XLA fuses elementwise work
across leaves of one computation only where one consumer reads them all (a concatenation), and
XLA:CPU writes each output array in a loop of its own. Leaves of one shape, stacked (G, …), go
through the math as one batch, and a state kept as the stacks is written in one loop each: the
kernels of a step grow with the shapes, not the leaves (``benchmarks/step_profile.py --layers``;
PowerSGD's and Dion's stacks are torch's ``batch_tensors_with_same_shape``). A state field of
stacks is a tuple, one ``(G, …)`` array (or ``optax.MaskedNode()``) per stack; ``by_leaf`` and
``with_leaves`` give and take it in the params' structure.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import tree as tree_lib


def groups_of(keys: Sequence) -> list:
  """The positions of equal ``keys``, grouped, in the order of each key's first position."""
  groups = {}
  for i, key in enumerate(keys):
    groups.setdefault(key, []).append(i)
  return list(groups.values())


def member(stack: jax.Array, i: int, tail: int, shape: tuple) -> jax.Array:
  """Member ``i`` of a stack ``(…, G, *tail)`` (``tail`` axes after the group's), in ``shape``
  after the stack's leading axes (a stacked state's W)."""
  lead = stack.shape[:stack.ndim - tail - 1]
  return stack[(Ellipsis, i) + (slice(None),) * tail].reshape(lead + tuple(shape))


def by_leaf(signature: tree_lib.TreeSignature, members: Sequence, field: tuple, tail: int,
            leaf_shaped: bool):
  """A field of stacks in the params' structure: stack j's member i at the reduced leaf
  ``members[j][i]``, in that leaf's shape (``leaf_shaped``) or its own ``tail`` axes;
  ``optax.MaskedNode()`` elsewhere; leading axes (a stacked state's) kept."""
  values = [optax.MaskedNode()] * len(signature.reduced)
  structs = signature.reduced_structs()
  for positions, x in zip(members, field):
    for i, k in enumerate(positions if not isinstance(x, optax.MaskedNode) else ()):
      values[k] = member(x, i, tail, structs[k].shape if leaf_shaped else x.shape[-tail:])
  return signature.place(values)


def with_leaves(signature: tree_lib.TreeSignature, members: Sequence, field: tuple, tree,
                tail: int, leaf_shaped: bool) -> tuple:
  """``by_leaf``'s inverse: the field of stacks (shaped as ``field``) holding ``tree``'s leaves."""
  leaves, structs = signature.pick(tree), signature.reduced_structs()
  out = []
  for positions, x in zip(members, field):
    if isinstance(x, optax.MaskedNode):
      out.append(x)
      continue
    arrays = [jnp.asarray(leaves[k]) for k in positions]
    own = [len(structs[k].shape) if leaf_shaped else tail for k in positions]
    out.append(jnp.stack([a.reshape(a.shape[:a.ndim - n] + x.shape[-tail:])
                          for a, n in zip(arrays, own)], axis=-1 - tail))
  return tuple(out)
