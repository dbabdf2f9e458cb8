"""Gradient pytrees as DDP sees them: flat, single-dtype buckets, and ``comm_hook``.

``comm_hook`` is the port of ``DistributedDataParallel.register_comm_hook``: the floating-point
leaves of the gradient pytree are packed into flat, single-dtype buckets by DDP's rule, a user hook
reduces each bucket, and the results are unpacked into the pytree again.

DDP's bucket rule (torch 2.13 after its first-iteration rebuild, recorded from torch in
``tests/golden/ddp_buckets.json``): parameters are taken in reverse order (the order their gradients
become ready); each dtype fills its own open bucket, and a bucket closes as soon as its size reaches
the cap (so it may exceed it by one tensor); the first bucket of each dtype is capped by
``first_bucket_cap_mb``. Buckets are numbered in the order they close; the buckets still open at the
end follow, the dtype seen last first. Bucket 0 therefore holds the last parameters; ``is_last`` is
true for the bucket with the highest index, the last to be reduced.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src import axis, finite, interface, validate
from jaxcomp._src import tree as tree_lib
from jaxcomp._src.sharding import PerDevice

_MIB = 1024 * 1024


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

  def gradients(self, buffer: Optional[jax.Array] = None) -> list:
    """Per-parameter views of ``buffer`` (default: this bucket's), in the parameters' shapes."""
    return tree_lib.unflatten(self.buffer if buffer is None else buffer, self.shapes)

  def replace(self, **changes) -> "GradBucket":
    return dataclasses.replace(self, **changes)


@functools.lru_cache(maxsize=None)
def bucket_assignment(signature: tree_lib.TreeSignature, bucket_cap_bytes: float,
                      first_bucket_cap_bytes: float) -> tuple:
  """DDP's bucket assignment: a tuple of buckets, each a tuple of leaf indices in buffer order."""
  open_buckets: dict = {}  # dtype -> [indices, bytes, number of buckets closed so far]
  closed = []
  for i in reversed(range(len(signature.shapes))):
    dtype, shape = np.dtype(signature.dtypes[i]), signature.shapes[i]
    if not tree_lib.is_reduced(jax.ShapeDtypeStruct(shape, dtype)):
      continue
    bucket = open_buckets.setdefault(dtype, [[], 0, 0])
    bucket[0].append(i)
    bucket[1] += math.prod(shape) * dtype.itemsize
    if bucket[1] >= (first_bucket_cap_bytes if bucket[2] == 0 else bucket_cap_bytes):
      closed.append(tuple(bucket[0]))
      open_buckets[dtype] = [[], 0, bucket[2] + 1]
  closed += [tuple(b[0]) for b in reversed(open_buckets.values()) if b[0]]
  return tuple(closed)


class CommHookState(NamedTuple):
  """State of ``comm_hook``: the hook's state for each bucket, and the gradient signature.

  A hook state's per-device leaves are declared by the hook state itself: a NamedTuple with
  ``PER_DEVICE_FIELDS``, or a plain pytree wrapped in ``jaxcomp.PerDevice`` (see
  ``jaxcomp.state_partition_specs``).
  """
  hook_states: tuple
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ()


Hook = Callable[[Any, GradBucket], tuple]


def comm_hook(hook: Hook, state: Any = None, *, axis_name: axis.AxisName = "batch",
              bucket_cap_mb: float = 25.0,
              first_bucket_cap_mb: Optional[float] = None) -> interface.Transformation:
  """Runs a DDP-style communication hook on DDP-style buckets of the gradient pytree.

  A hook is a function ``hook(state, bucket) -> (reduced_buffer, new_state)``. It receives the
  bucket of this device's gradients, not divided by the world size, and returns the buffer every
  device should use, of the same shape and dtype. Each bucket keeps its own hook state: ``state`` is
  either a pytree (every bucket starts from it) or a function ``bucket -> pytree`` called once per
  bucket at ``init`` (the bucket's buffer is zeros there). On a step whose gradient is non-finite on
  any device, a stateful hook's state is kept and the output is NaN (jaxcomp's non-finite policy).

  A hook state that differs from device to device (error feedback, say) must say so for
  ``shard_map`` and ``jaxcomp.data_parallel``: a NamedTuple declares its ``PER_DEVICE_FIELDS``; a
  plain pytree is wrapped, ``comm_hook(hook, jaxcomp.PerDevice(state))`` — the hook still receives
  and returns the plain pytree.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.chain(jaxcomp.comm_hook(jaxcomp.hooks.fp16_compress_hook, bucket_cap_mb=0.0005),
    ...                  optax.sgd(0.1))
    >>> grads = {"a": jnp.ones((8, 256)), "b": jnp.ones((8, 256))}  # 1 KiB each per device
    >>> state = jax.pmap(tx.init, axis_name="batch")(grads)
    >>> report = jaxcomp.comm_report(jax.pmap(tx.update, axis_name="batch"), grads, state)
    >>> len(state[0].hook_states), report.bytes_by_dtype()  # 2 buckets of 512 B in float16
    (2, {'f16': 1024})

  Args:
    hook: the per-bucket hook, e.g. ``jaxcomp.hooks.fp16_compress_hook``.
    state: the initial hook state, or a function of the bucket that makes it.
    axis_name: the mapped axis to reduce over (see ``jaxcomp.axis``).
    bucket_cap_mb: bucket size cap in MiB (DDP's ``bucket_cap_mb``).
    first_bucket_cap_mb: cap of the first bucket of each dtype; default ``bucket_cap_mb``. DDP uses
      1 MiB here when its ``bucket_cap_mb`` is left unset.

  Returns:
    A ``jaxcomp.Transformation`` whose output is the hooks' reduced gradients.

  References:
    PyTorch DDP communication hooks, ``torch.distributed.algorithms.ddp_comm_hooks``.
  """
  validate.function(hook, "hook", "hook(state, bucket)")
  cap = validate.number(bucket_cap_mb, "bucket_cap_mb", 0, low_open=True) * _MIB
  first_cap = cap if first_bucket_cap_mb is None else (
      validate.number(first_bucket_cap_mb, "first_bucket_cap_mb", 0, low_open=True) * _MIB)
  axis_name = axis.check_axis_name(axis_name)

  def buckets_of(signature, leaves):
    assignment = bucket_assignment(signature, cap, first_cap)
    paths = signature.paths
    for index, members in enumerate(assignment):
      yield members, GradBucket(
          index=index,
          buffer=tree_lib.flatten([leaves[i] for i in members]),
          paths=tuple(paths[i] for i in members),
          shapes=tuple(signature.shapes[i] for i in members),
          is_last=index == len(assignment) - 1,
          axis_name=axis_name)

  def init_fn(params):
    signature = tree_lib.TreeSignature.of(params)
    leaves = [jnp.zeros(s, d) for s, d in zip(signature.shapes, signature.dtypes)]
    hook_states = tuple(state(bucket) if callable(state) else state
                        for _, bucket in buckets_of(signature, leaves))
    return CommHookState(hook_states, signature)

  def update_fn(updates, hook_state: CommHookState, params=None):
    del params
    tree_lib.check_state(hook_state, init_fn, "comm_hook")
    leaves = list(hook_state.signature.check(updates))
    axis.refuse_summed_gradient([leaves[i] for i in hook_state.signature.reduced], axis_name,
                                getattr(hook, "__name__", "comm_hook"))
    new_states = []
    for (members, bucket), bucket_state in zip(buckets_of(hook_state.signature, leaves),
                                               hook_state.hook_states):
      declared = isinstance(bucket_state, PerDevice)
      result = hook(bucket_state.tree if declared else bucket_state, bucket)
      if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"hook {getattr(hook, '__name__', hook)!r} must return (buffer, state), the reduced "
            f"buffer and the hook's new state; got {type(result).__name__} for bucket "
            f"{bucket.index}. A hook without state returns (buffer, state) with the state it was "
            "given")
      reduced, bucket_state = result
      bucket_state = PerDevice(bucket_state) if declared else bucket_state
      if reduced.shape != bucket.buffer.shape or reduced.dtype != bucket.buffer.dtype:
        raise ValueError(f"hook {getattr(hook, '__name__', hook)!r} returned a buffer of "
                         f"{reduced.dtype}{list(reduced.shape)} for bucket {bucket.index}; "
                         "expected "
                         f"{bucket.buffer.dtype}{list(bucket.buffer.shape)}")
      for i, grad in zip(members, bucket.gradients(reduced)):
        leaves[i] = grad
      new_states.append(bucket_state)
    outputs, new_states = tree_lib.like(updates, leaves), tuple(new_states)
    if jax.tree.leaves(new_states):
      outputs, new_states = finite.gated(finite.all_finite(updates, axis_name), outputs,
                                         new_states, hook_state.hook_states)
    return outputs, hook_state._replace(hook_states=new_states)

  return interface.Transformation(init_fn, update_fn, name="comm_hook", axis_name=axis_name,
                                  scatter=interface.own_shard_of(update_fn, axis_name))
