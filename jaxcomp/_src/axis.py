"""Named-axis helpers: every collective jaxcomp runs goes through this module.

A jaxcomp transformation names the mapped axis it averages over (pmap's ``axis_name``, a
``shard_map`` mesh axis, or a tuple of them). Inside a mapped context that binds it, the helpers
below are ``jax.lax`` collectives. The axis rules, in one place:

* bound: the collectives run over it;
* not bound, but another named axis is (a ``pmap(..., axis_name="data")`` around a transformation on
  the default ``"batch"``): an ``UnboundAxisError`` naming the missing axis and the bound ones —
  averaging over nothing there would let the replicas drift;
* no named axis bound at all (a plain ``jit`` in a notebook): a world of size 1, so the compression
  still runs and its effect on training can be studied on one device; it warns once for every new
  trace (every compilation), however often that trace calls the helpers.
  ``axis_name=None`` asks for that explicitly and silently.

A float16 sum over devices runs on XLA:CPU as an all-to-all and an all-gather, which XLA:CPU
computes faster than its all-reduce, bit for bit the same (``sum_in_rows``).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
import warnings
import weakref
from typing import Any, Hashable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp._src import jax_internals
from jaxcomp._src import tree as tree_lib

AxisName = Optional[Union[Hashable, tuple]]

_warned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # trace -> keys warned about
_PACKAGES = tuple(os.path.dirname(m.__file__) + os.sep
                  for m in (jax, optax, sys.modules[__name__.split(".")[0]]))


class UnboundAxisError(NameError):
  """A transformation's axis is not bound where named axes are: its collectives would do nothing."""


def check_axis_name(axis_name: Any) -> AxisName:
  """Validates ``axis_name`` (a str, a non-empty tuple of str, or None) and returns it.

  Raises:
    TypeError: naming ``axis_name`` and what was wrong with it.
  """
  if axis_name is None or isinstance(axis_name, str):
    return axis_name
  if isinstance(axis_name, tuple) and axis_name and all(isinstance(a, str) for a in axis_name):
    return axis_name
  raise TypeError(
      "axis_name must be a str, a non-empty tuple of str, or None (world size 1); "
      f"got {axis_name!r} of type {type(axis_name).__name__}")


def warn_once_per_trace(key, message: str) -> None:
  """Warns once per trace (per jit compilation; once for eager code) and ``key``.

  Python's own filter would show it only once per process; ``warn_explicit`` with a fresh registry
  shows it again for every new trace, at the first frame outside JAX and jaxcomp (the user's line).
  """
  trace = jax_internals.trace_key()
  seen = set() if trace is None else _warned.setdefault(trace, set())
  if key in seen:
    return
  seen.add(key)
  frame = inspect.currentframe()
  while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGES):
    frame = frame.f_back
  warnings.warn_explicit(message, UserWarning, frame.f_code.co_filename, frame.f_lineno,
                         registry={})


def bound_axis(axis_name: AxisName) -> AxisName:
  """Returns ``axis_name`` if it is bound in the current trace, or None for a world of size 1.

  Raises:
    UnboundAxisError: ``axis_name`` is not bound but other named axes are.
  """
  if axis_name is None:
    return None
  try:
    lax.axis_size(axis_name)
  except NameError:
    pass
  else:
    return axis_name
  bound = jax_internals.bound_axis_names()
  named = [n for n in bound if not (isinstance(n, str) and n.startswith("_"))]
  if bound and not named:  # only JAX's own names: jax.pmap(f) without axis_name
    raise UnboundAxisError(
        f"axis_name {axis_name!r} is not bound here: the mapped function was given no axis name "
        f"(jax.pmap(f) maps over an unnamed axis). Name it: jax.pmap(f, axis_name={axis_name!r})")
  if bound:
    raise UnboundAxisError(
        f"axis_name {axis_name!r} is not bound here; the bound axes are "
        f"{', '.join(map(repr, named))}. Pass the mapped axis, e.g. axis_name={named[0]!r} "
        "(a transformation averages over its own axis_name, not over whichever axis is mapped).")
  warn_once_per_trace(axis_name, (
      f"jaxcomp: axis {axis_name!r} is not bound here (no pmap/shard_map axis at all), so nothing "
      "is averaged over devices: this runs as world size 1. Under jax.jit on a mesh, build the "
      "step with jaxcomp.data_parallel(loss_fn, mesh, tx=tx), which maps it over the data axis; on "
      "one device "
      "on purpose, pass axis_name=None to do this without the warning."))
  return None


def is_bound(axis_name: AxisName) -> bool:
  """Whether ``axis_name`` is bound in the current trace (never raises, never warns)."""
  if axis_name is None:
    return False
  try:
    lax.axis_size(axis_name)
  except NameError:
    return False
  return True


def varying_axes(x) -> frozenset:
  """The manual axes along which ``x`` differs from device to device
  (``shard_map(check_vma=True)``'s type of it); empty elsewhere (pmap, ``check_vma=False``, no
  mapping)."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)  # jax 0.6 – 0.9
  if vma is None:  # jax 0.10: the aval's manual-axis type
    vma = getattr(getattr(aval, "mat", None), "varying", ())
  return frozenset(vma)


def vma_checked(axis_name: AxisName) -> bool:
  """Whether values are typed varying or invariant along the bound ``axis_name`` here:
  ``shard_map(check_vma=True)`` (``jaxcomp.data_parallel``) types them, ``pmap``, ``vmap`` and
  ``check_vma=False`` do not (there nothing is typed varying, not even a device's own index)."""
  name = bound_axis(axis_name)
  if name is None:
    return False
  names = name if isinstance(name, tuple) else (name,)
  return set(names) <= varying_axes(lax.axis_index(name))


def refuse_summed_gradient(leaves: Sequence, axis_name: AxisName, name: str) -> None:
  """Raises if every leaf is already invariant along a vma-checked axis: autodiff summed it.

  Under ``shard_map(check_vma=True)`` the gradient of replicated (invariant) parameters is the
  transpose of their implicit ``pvary``, a ``psum``: the SUM of every device's gradient, sent in
  full precision before any compressor sees it. Averaged again, the update is W times too large.

  Raises:
    ValueError: naming ``name`` (the transformation) and the fix.
  """
  if not leaves or not vma_checked(axis_name):
    return
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if any(set(names) & varying_axes(x) for x in leaves):
    return
  raise ValueError(
      f"{name}: the gradient it receives is already the same on every device along {axis_name!r}, "
      "so it would be averaged twice. Either a mean before it averaged it (jaxcomp.allreduce, or "
      f"any compressor, chained before {name}: {name} averages the gradient itself, so drop the "
      "other), or autodiff summed it over the devices (in float32, before any compression) because "
      "it was taken of parameters that are replicated there, and averaged again the update would "
      "be W times too large: take the gradient of a per-device copy, "
      f"jax.grad(loss)(jax.lax.pcast(params, {axis_name!r}, to='varying'), ...), as "
      "jaxcomp.data_parallel's loss form does for you")


def make_varying(x, axes: tuple):
  """``x`` marked varying along each of ``axes`` it does not already vary along (``lax.pcast``
  refuses an axis it already varies along)."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def axis_size(axis_name: AxisName) -> int:
  """The number of devices along ``axis_name`` (1 when it is None or nothing is mapped)."""
  name = bound_axis(axis_name)
  return 1 if name is None else lax.axis_size(name)


def psum(x, axis_name: AxisName):
  """Sum over the axis (identity at world size 1); float16 on XLA:CPU as ``sum_in_rows``."""
  name = bound_axis(axis_name)
  if name is None:
    return x
  if not _float16_over_devices(x, name):
    return lax.psum(x, name)
  # The backend is known only when the step is lowered (a CPU trace may be compiled for a GPU).
  return lax.platform_dependent(x, cpu=functools.partial(sum_in_rows, axis_name=name),
                                default=functools.partial(lax.psum, axis_name=name))


def psum_scatter(rows, axis_name: AxisName):
  """Row d of the sum over devices of ``rows`` (W, …) on device d: a reduce-scatter SUM (row 0 at
  world size 1); float16 on XLA:CPU as ``scatter_in_rows``."""
  name = bound_axis(axis_name)
  if name is None:
    return rows[0]
  scatter = functools.partial(lax.psum_scatter, axis_name=name, scatter_dimension=0, tiled=False)
  if not _float16_over_devices(rows, name):
    return scatter(rows)
  return lax.platform_dependent(rows, cpu=functools.partial(scatter_in_rows, axis_name=name),
                                default=scatter)


def _float16_over_devices(x, name) -> bool:
  """Whether ``x`` is a float16 sum between devices that ``sum_in_rows`` (``scatter_in_rows``) may
  run: over more than one device, ``x`` varying along the axis (a psum of a value typed invariant
  sends nothing), on a mesh mapped by hand (pmap, shard_map: not vmap's axis, a sum within one
  array) with no other axis left to the SPMD partitioner (which would replicate an all-to-all's
  operand across it)."""
  names = name if isinstance(name, tuple) else (name,)
  mesh = jax.sharding.get_abstract_mesh()
  by_hand = not mesh.empty and set(names) <= set(mesh.manual_axes) and all(
      size == 1 or a in mesh.manual_axes for a, size in zip(mesh.axis_names, mesh.axis_sizes))
  return (x.dtype == jnp.float16 and x.size > 0 and by_hand and lax.axis_size(name) > 1
          and (not vma_checked(name) or set(names) <= varying_axes(x)))


def stands_for_label(op: str, shape: tuple) -> str:
  """The name scope of the collectives that run in place of a collective ``op`` (``"all-reduce"``,
  ``"reduce-scatter"``) of an operand of ``shape``: ``jaxcomp.comm_report`` counts them as that
  one."""
  return f"jaxcomp_stands_for[{op}|{'x'.join(map(str, shape))}]"


def stands_for(op_name: str) -> Optional[tuple]:
  """The ``(op, operand shape)`` of the innermost ``stands_for_label`` in an instruction's
  ``op_name``, or None."""
  labels = re.findall(r"jaxcomp_stands_for\[([a-z-]+)\|([\dx]*)\]", op_name)
  if not labels:
    return None
  op, dims = labels[-1]
  return op, tuple(int(d) for d in dims.split("x") if d)


def _added_rows(rows, name):
  """The W rows (of ``rows``, W × …) that this device receives in an all-to-all, added in device
  order in their dtype: row d of the sum over devices, on device d."""
  received = all_to_all(rows, name)  # row d: device d's row for this device
  total = received[0]
  for d in range(1, received.shape[0]):
    total = total + received[d]
  return total


def sum_in_rows(x, axis_name: AxisName):
  """``lax.psum(x, axis_name)`` as XLA:CPU computes it in float16, in less than half its time: an
  all-to-all of ``x`` in W rows (zero-padded in front), the W rows this device receives added in
  device order, in ``x``'s dtype, and an all-gather of the sums.

  XLA:CPU's in-process all-reduce (and reduce-scatter) adds float16 values one at a time in software
  (float32 in vector instructions); the sum above is the same arithmetic, so the results are
  bit-identical (``tests/test_axis.py``), and it sends the same ring bytes, 2(W−1)/W of ``x``.
  ``psum`` uses it for float16 over devices when the step is lowered for CPU; GPUs and TPUs get the
  all-reduce. The main job's training step (the MLP 784-1024×3-10, W = 8) over allreduce's, the
  all-reduce before and this after: ``fp16_compress`` 1.91–1.95 → 1.24–1.27,
  ``fp16_compress_wrapper(allreduce_hook)`` 2.06–2.10 → 1.23–1.31 (BENCHMARKS.md, "Training step
  time against allreduce"; ``benchmarks/kernels.py --compressors fp16,hook_fp16_allreduce`` runs the
  update with either, side by side). The padding goes in front: at the end, XLA:CPU slices the first
  row straight from ``x``'s producer, which it then writes out whole beside the padded rows (a
  bucket's float32 concatenation, where the cast to float16 is otherwise fused into it). The
  collectives carry ``stands_for_label``, so ``jaxcomp.comm_report`` counts them as the all-reduce
  they replace.
  """
  name = bound_axis(axis_name)
  world = 1 if name is None else lax.axis_size(name)
  padding = -x.size % world
  rows = jnp.pad(x.reshape(-1), (padding, 0)).reshape(world, -1)
  with jax.named_scope(stands_for_label("all-reduce", x.shape)):
    return all_gather(_added_rows(rows, name), name).reshape(-1)[padding:].reshape(x.shape)


def scatter_in_rows(rows, axis_name: AxisName):
  """``lax.psum_scatter(rows, axis_name, tiled=False)`` as XLA:CPU computes it in float16: an
  all-to-all of the rows and the W rows received added in device order (``sum_in_rows``' first
  half; bit-identical, the same ring bytes, (W−1)/W of ``rows``). Labelled, as there, for
  ``jaxcomp.comm_report``."""
  with jax.named_scope(stands_for_label("reduce-scatter", rows.shape)):
    return _added_rows(rows, bound_axis(axis_name))


def pmax(x, axis_name: AxisName):
  """Maximum over the axis (identity at world size 1)."""
  name = bound_axis(axis_name)
  return x if name is None else lax.pmax(x, name)


def _as_bits(x):
  """float8 values as their uint8 bit patterns: XLA:CPU widens float8 collectives to float16 when it
  compiles (as it widens bfloat16 to float32), so they travel as the same bits in uint8."""
  if jnp.dtype(x.dtype).itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating):
    return lax.bitcast_convert_type(x, jnp.uint8), x.dtype
  return x, None


def _from_bits(x, dtype):
  return x if dtype is None else lax.bitcast_convert_type(x, dtype)


def all_gather(x, axis_name: AxisName):
  """Stacks every device's ``x`` along a new leading axis of size W (float8 travels as its bits).

  The result is the same on every device, and under ``shard_map(check_vma=True)`` it is typed so.
  """
  name = bound_axis(axis_name)
  if name is None:
    return x[None]
  bits, dtype = _as_bits(x)
  # vmap has no pvary: there, the plain all-gather.
  gather = jax_internals.all_gather_invariant() if vma_checked(name) else lax.all_gather
  return _from_bits(gather(bits, name), dtype)


def all_to_all(x, axis_name: AxisName):
  """The transpose across devices: row j of this device's ``x`` goes to device j.

  ``x`` has a leading axis of size W; row d of the result is what device d sent here (its row for
  this device). Each device sends and receives (W−1)/W of ``x``: a reduce-scatter whose reduction
  the receiver does itself, in whatever precision it likes (float8 travels as its bits).

  Raises:
    ValueError: ``x``'s leading axis is not W.
  """
  name = bound_axis(axis_name)
  world = 1 if name is None else lax.axis_size(name)
  if not x.shape or x.shape[0] != world:
    raise ValueError(f"all_to_all: the leading axis must be the world size {world}, one row per "
                     f"device; got shape {tuple(x.shape)}")
  if name is None:
    return x
  bits, dtype = _as_bits(x)
  return _from_bits(lax.all_to_all(bits, name, 0, 0), dtype)


def axis_index(axis_name: AxisName) -> jax.Array:
  """This device's position along the axis, an int32 scalar (0 at world size 1)."""
  name = bound_axis(axis_name)
  return jnp.zeros([], jnp.int32) if name is None else lax.axis_index(name).astype(jnp.int32)


def divide_by_world(x, axis_name: AxisName):
  """``x / W`` in ``x``'s own dtype."""
  return x / jnp.asarray(axis_size(axis_name), x.dtype)


def mean(x, axis_name: AxisName, wire_dtype=None):
  """Mean over the axis in torch's order: cast to ``wire_dtype`` → ÷W → sum → cast back.

  With ``wire_dtype=None`` the sum runs in ``x``'s own dtype (torch's ``allreduce_hook``); with
  ``jnp.float16`` or ``jnp.bfloat16`` it is ``fp16_compress_hook`` / ``bf16_compress_hook``.
  """
  wire = x if wire_dtype is None else x.astype(wire_dtype)
  return psum(divide_by_world(wire, axis_name), axis_name).astype(x.dtype)


def mean_leaves(arrays: Sequence, axis_name: AxisName, wire_dtype=None) -> list:
  """``mean`` of every array, each its own all-reduce, which XLA combines into one; but float16
  sums over devices on XLA:CPU (``sum_in_rows``: an all-to-all and an all-gather, which XLA does
  not combine) run once, on one buffer of them all, so that a step sends one message, not two per
  leaf (``tests/test_slow_link.py``: a multi-process step's collectives)."""
  wires = [x if wire_dtype is None else x.astype(wire_dtype) for x in arrays]
  name = bound_axis(axis_name)
  if name is None or not wires or not all(_float16_over_devices(w, name) for w in wires):
    return [mean(x, axis_name, wire_dtype) for x in arrays]
  shares = [divide_by_world(w, axis_name) for w in wires]
  sums = lax.platform_dependent(
      *shares, cpu=lambda *xs: _packed(sum_in_rows, xs, name),
      default=lambda *xs: [lax.psum(x, name) for x in xs])
  return [total.astype(x.dtype) for x, total in zip(arrays, sums)]


def _packed(collective, arrays: Sequence, axis_name: AxisName, keep: int = 0) -> list:
  """Runs ``collective`` once per dtype on one buffer holding all ``arrays`` of that dtype.

  The arrays keep their first ``keep`` axes (all_to_all's rows) and are raveled after them and
  concatenated along the last axis. ``collective(buffer, axis_name)`` returns the result with any
  leading axes it adds (all-gather's W); each array gets its slice back with those axes in front of
  its own shape.
  """
  out: list = [None] * len(arrays)
  by_dtype: dict = {}
  for i, x in enumerate(arrays):
    by_dtype.setdefault(x.dtype, []).append(i)
  for members in by_dtype.values():
    buffer = jnp.concatenate([arrays[i].reshape(arrays[i].shape[:keep] + (-1,)) for i in members],
                             axis=-1)
    result = collective(buffer, axis_name)
    for i, part in zip(members, tree_lib.unflatten(result, [arrays[i].shape[keep:]
                                                             for i in members])):
      out[i] = part
  return out


def psum_many(arrays: Sequence, axis_name: AxisName) -> list:
  """``psum`` of every array, as one all-reduce per dtype (how torch sends a bucket)."""
  return _packed(psum, arrays, axis_name)


def mean_many(arrays: Sequence, axis_name: AxisName) -> list:
  """The mean (÷W, then sum) of every array, as one all-reduce per dtype."""
  return psum_many([divide_by_world(x, axis_name) for x in arrays], axis_name)


def all_gather_many(arrays: Sequence, axis_name: AxisName) -> list:
  """``all_gather`` of every array, as one all-gather per dtype; results have a leading W axis."""
  return _packed(all_gather, arrays, axis_name)


def all_to_all_many(arrays: Sequence, axis_name: AxisName) -> list:
  """``all_to_all`` of every array (each with a leading axis of size W), one per dtype."""
  return _packed(all_to_all, arrays, axis_name, keep=1)
