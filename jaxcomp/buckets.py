"""Gradient pytrees as DDP sees them: a checked signature, flat buckets, and ``comm_hook``.

``comm_hook`` is the port of ``DistributedDataParallel.register_comm_hook``: the floating-point leaves
of the gradient pytree are packed into flat, single-dtype buckets by DDP's rule, a user hook reduces
each bucket, and the results are unpacked into the pytree again.

DDP's bucket rule (torch 2.13 after its first-iteration rebuild, recorded from torch in
``tests/golden/ddp_buckets.json``): parameters are taken in reverse order (the order their gradients
become ready); each dtype fills its own open bucket, and a bucket closes as soon as its size reaches the
cap (so it may exceed it by one tensor); the first bucket of each dtype is capped by
``first_bucket_cap_mb``. Buckets are numbered in the order they close; the buckets still open at the end
follow, the dtype seen last first. Bucket 0 therefore holds the last parameters; ``is_last`` is true for
the bucket with the highest index, the last to be reduced.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp import axis

_MIB = 1024 * 1024


def _shape(x) -> tuple:
  return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _dtype(x) -> np.dtype:
  return np.dtype(x.dtype) if hasattr(x, "dtype") else jnp.result_type(x)


def is_float(x) -> bool:
  """True for the leaves jaxcomp reduces: floating-point arrays. Others pass through untouched."""
  return jnp.issubdtype(_dtype(x), jnp.floating)


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
    """The signature of ``tree``, whose leaves may be arrays or ``jax.ShapeDtypeStruct``s."""
    leaves, treedef = jax.tree.flatten(tree)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      if jnp.issubdtype(_dtype(leaf), jnp.complexfloating):
        raise TypeError(f"params: complex leaf at {jax.tree_util.keystr(path)} is not supported")
    return cls(treedef, tuple(_shape(x) for x in leaves), tuple(_dtype(x).name for x in leaves))

  def check(self, tree, name: str = "updates", dtypes: bool = True) -> list:
    """Returns ``tree``'s leaves, or raises ValueError saying how ``tree`` differs from this one.

    With ``dtypes=False`` only structure and shapes must match (a hook under
    ``fp16_compress_wrapper`` sees its bucket in another float dtype than at ``init``).
    """
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != self.treedef:
      raise ValueError(f"{name}: the pytree structure changed between init and update: "
                       f"init saw {self.treedef}, update got {treedef}")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    for path, leaf, shape, dtype in zip(paths, leaves, self.shapes, self.dtypes):
      if _shape(leaf) != shape or (dtypes and _dtype(leaf).name != dtype):
        raise ValueError(f"{name}: leaf {path} changed between init and update: init saw "
                         f"{dtype}{list(shape)}, update got {_dtype(leaf).name}{list(_shape(leaf))}")
    return leaves

  @property
  def paths(self) -> tuple:
    dummy = jax.tree.unflatten(self.treedef, [0] * len(self.shapes))
    return tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(dummy))


def map_float_leaves(fn: Callable, tree):
  """Applies ``fn`` to the floating-point leaves of ``tree``; other leaves are returned untouched."""
  return jax.tree.map(lambda x: fn(x) if is_float(x) else x, tree)


@dataclasses.dataclass(frozen=True)
class GradBucket:
  """One bucket of gradients, as a hook sees it (torch's ``dist.GradBucket``).

  Attributes:
    index: the bucket's number; bucket 0 holds the last parameters.
    buffer: the flat 1-D buffer of this device's (unreduced, undivided) gradients.
    paths: the pytree path of each parameter in the buffer, in buffer order.
    shapes: the shape of each parameter in the buffer.
    is_last: true for the last bucket reduced in a step (the highest index).
    axis_name: the mapped axis the hook reduces over; pass it to ``jaxcomp.axis`` helpers.
  """
  index: int
  buffer: jax.Array
  paths: tuple
  shapes: tuple
  is_last: bool
  axis_name: axis.AxisName

  @property
  def offsets(self) -> tuple:
    sizes = [math.prod(s) for s in self.shapes]
    return tuple(int(o) for o in np.cumsum([0] + sizes))

  def gradients(self, buffer: Optional[jax.Array] = None) -> list:
    """Per-parameter views of ``buffer`` (default: this bucket's), reshaped to the parameter shapes."""
    buffer = self.buffer if buffer is None else buffer
    o = self.offsets
    return [buffer[o[i]:o[i + 1]].reshape(s) for i, s in enumerate(self.shapes)]

  def replace(self, **changes) -> "GradBucket":
    return dataclasses.replace(self, **changes)


@functools.lru_cache(maxsize=None)
def bucket_assignment(signature: TreeSignature, bucket_cap_bytes: float,
                      first_bucket_cap_bytes: float) -> tuple:
  """DDP's bucket assignment: a tuple of buckets, each a tuple of leaf indices in buffer order."""
  open_buckets: dict = {}  # dtype -> [indices, bytes, number of buckets closed so far]
  closed = []
  for i in reversed(range(len(signature.shapes))):
    dtype, size = np.dtype(signature.dtypes[i]), math.prod(signature.shapes[i])
    if not jnp.issubdtype(dtype, jnp.floating) or size == 0:
      continue
    bucket = open_buckets.setdefault(dtype, [[], 0, 0])
    bucket[0].append(i)
    bucket[1] += size * dtype.itemsize
    if bucket[1] >= (first_bucket_cap_bytes if bucket[2] == 0 else bucket_cap_bytes):
      closed.append(tuple(bucket[0]))
      open_buckets[dtype] = [[], 0, bucket[2] + 1]
  closed += [tuple(b[0]) for b in reversed(open_buckets.values()) if b[0]]
  return tuple(closed)


def _positive_mb(value, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
    raise ValueError(f"{name} must be a positive number of MiB; got {value!r}")
  return float(value)


class CommHookState(NamedTuple):
  """State of ``comm_hook``: the hook's state for each bucket, and the gradient signature.

  A hook state's per-device fields are declared by its own NamedTuple (see ``jaxcomp.sharding``).
  """
  hook_states: tuple
  signature: TreeSignature

  PER_DEVICE_FIELDS = ()


Hook = Callable[[Any, GradBucket], tuple]


def comm_hook(hook: Hook, state: Any = None, *, bucket_cap_mb: float = 25.0,
              first_bucket_cap_mb: Optional[float] = None,
              axis_name: axis.AxisName = "batch") -> optax.GradientTransformation:
  """Runs a DDP-style communication hook on DDP-style buckets of the gradient pytree.

  A hook is a function ``hook(state, bucket) -> (reduced_buffer, new_state)``. It receives the bucket
  of this device's gradients, not divided by the world size, and returns the buffer every device
  should use, of the same shape and dtype. Each bucket keeps its own hook state: ``state`` is either a
  pytree (every bucket starts from it) or a function ``bucket -> pytree`` called once per bucket at
  ``init`` (the bucket's buffer is zeros there). A hook state is left untouched on a step whose
  gradient is non-finite on any device.

  Args:
    hook: the per-bucket hook, e.g. ``jaxcomp.hooks.fp16_compress_hook``.
    state: the initial hook state, or a function of the bucket that makes it.
    bucket_cap_mb: bucket size cap in MiB (DDP's ``bucket_cap_mb``).
    first_bucket_cap_mb: cap of the first bucket of each dtype; default ``bucket_cap_mb``. DDP uses
      1 MiB here when its ``bucket_cap_mb`` is left unset.
    axis_name: the mapped axis to reduce over (see ``jaxcomp.axis``).

  Returns:
    A ``GradientTransformation`` whose output is the hooks' reduced gradients.

  References:
    PyTorch DDP communication hooks, ``torch.distributed.algorithms.ddp_comm_hooks``.
  """
  if not callable(hook):
    raise TypeError(f"hook must be callable as hook(state, bucket); got {hook!r}")
  cap = _positive_mb(bucket_cap_mb, "bucket_cap_mb") * _MIB
  first_cap = cap if first_bucket_cap_mb is None else (
      _positive_mb(first_bucket_cap_mb, "first_bucket_cap_mb") * _MIB)
  axis_name = axis.check_axis_name(axis_name)

  def buckets_of(signature, leaves):
    assignment = bucket_assignment(signature, cap, first_cap)
    paths = signature.paths
    for index, members in enumerate(assignment):
      yield members, GradBucket(
          index=index,
          buffer=jnp.concatenate([jnp.ravel(leaves[i]) for i in members]),
          paths=tuple(paths[i] for i in members),
          shapes=tuple(signature.shapes[i] for i in members),
          is_last=index == len(assignment) - 1,
          axis_name=axis_name)

  def init_fn(params):
    signature = TreeSignature.of(params)
    leaves = [jnp.zeros(s, d) for s, d in zip(signature.shapes, signature.dtypes)]
    hook_states = tuple(state(bucket) if callable(state) else state
                        for _, bucket in buckets_of(signature, leaves))
    return CommHookState(hook_states, signature)

  def update_fn(updates, hook_state: CommHookState, params=None):
    del params
    leaves = list(hook_state.signature.check(updates))
    new_states = []
    for (members, bucket), bucket_state in zip(buckets_of(hook_state.signature, leaves),
                                               hook_state.hook_states):
      reduced, bucket_state = hook(bucket_state, bucket)
      if reduced.shape != bucket.buffer.shape or reduced.dtype != bucket.buffer.dtype:
        raise ValueError(f"hook {getattr(hook, '__name__', hook)!r} returned a buffer of "
                         f"{reduced.dtype}{list(reduced.shape)} for bucket {bucket.index}; expected "
                         f"{bucket.buffer.dtype}{list(bucket.buffer.shape)}")
      for i, grad in zip(members, bucket.gradients(reduced)):
        leaves[i] = grad
      new_states.append(bucket_state)
    new_states = tuple(new_states)
    if jax.tree.leaves(new_states):
      new_states = axis.keep_if_finite(axis.all_finite(updates, axis_name), new_states,
                                       hook_state.hook_states)
    return jax.tree.unflatten(hook_state.signature.treedef, leaves), hook_state._replace(
        hook_states=new_states)

  return optax.GradientTransformation(init_fn, update_fn)
