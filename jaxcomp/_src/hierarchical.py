"""Several nodes: the hierarchical mean of a compressor, and the compositions jaxcomp refuses.

A cluster of several nodes has two kinds of links: a fast one between the devices of a node and a
slow one between nodes. On a mesh whose first axis joins the nodes — jaxcomp calls the axis named
``SLOW_AXIS`` (``"replica"``) the slow axis — and whose second stays inside one (``"data"``),
``hierarchical(compressor, fast_axis="data")`` averages the gradient over both axes and sends
only 1/F of the compressor's message across the slow link (F devices per node). The steps, per
device (the ``# n:`` comments below):

1. reduce-scatter over the fast axis, ÷F, summed in float32: this device holds its shard of the
   node's exact mean. Packed (``pack=True``), the leaves of each dtype are one vector, cut in F;
   otherwise each leaf's last axis is dealt round robin over the node's F devices
   (``shards.Layout(F, by_leaf=True)``: the shard keeps the leaf's rank, a Dense kernel stays a
   matrix);
2. the compressor averages the shards over the slow axis: each of the node's F devices sends 1/F
   of the message it would send for the whole gradient (``quantized(8)``: 1/F of the int8 codes
   and scales; PowerSGD: its factors of each device's block of columns);
3. all-gather over the fast axis: every device holds the whole mean, the same everywhere.

Elementwise codecs (``allreduce``, ``fp16_compress``, ``bf16_compress``, ``quantized``) compute
on a shard what they compute on that part of the gradient, up to where their blocks of 256 values
fall, and travel best packed: XLA:CPU's gloo collectives run one all-reduce per operand of a
combined (tuple) all-reduce, each with messages of its own (the main job's quick transformer, 22
leaves over a 100 Mbit/s link: 2.5 times the bytes of one packed all-reduce, ``python -m
jaxcomp.train --processes 2 --link 100mbit --quick`` counts them). A compressor whose math depends
on the leaf's shape (PowerSGD, ``chunked_topk``) runs on each device's shard of each leaf
(``pack=False``).

Inside ``jaxcomp.data_parallel(loss_fn, mesh, axis_name=("replica", "data"), tx=...)`` both axes
are mapped. The compositions that cannot work are refused when the step is built, in one line
naming the axis and the fix (``refuse_wrong_axes``): the exchange on the fast axis (a mesh with a
slow axis the step does not map, or an optimizer that owns the parameters synchronizing elsewhere
than over it); ``jaxcomp.fully_sharded`` over the slow axis, or with no optimizer over it
(``refuse_sharding_over``). An inner optimizer of ``diloco`` that communicates over the slow axis is
refused by ``local_steps``.

References:
  Jia et al., "Highly Scalable Deep Learning Training System with Mixed-Precision: Training
  ImageNet in Four Minutes", 2018 (https://arxiv.org/abs/1807.11205): hierarchical all-reduce.
  Wang et al., "ZeRO++", 2023 (https://arxiv.org/abs/2306.10209): hpZ and the quantized
  reduce-scatter across nodes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import axis, interface, shards, spmd, validate
from jaxcomp._src import tree as tree_lib

SLOW_AXIS = "replica"
"""The name of the mesh axis between nodes: the slow axis."""

ELEMENTWISE = frozenset({"allreduce", "fp16_compress", "bf16_compress", "quantized"})
"""The compressors (by name) that code each value alone or in blocks of values: they travel
packed unless told otherwise."""


class HierarchicalState(NamedTuple):
  """State of ``hierarchical``.

  Attributes:
    inner: the compressor's state of this device's shards. PER DEVICE: the shards differ along
      the fast axis.
    signature: the gradient's structure, shapes and dtypes.
  """
  inner: Any
  signature: tree_lib.TreeSignature

  PER_DEVICE_FIELDS = ("inner",)  # see jaxcomp.sharding


def fast_size(fast_axis) -> int:
  """The number of devices along ``fast_axis``: inside the mapped step, or in the mesh that
  ``jax.set_mesh`` set (``data_parallel``'s ``make_state`` does).

  Raises:
    ValueError: neither knows the axis.
  """
  if axis.is_bound(fast_axis):
    return axis.axis_size(fast_axis)
  sizes = dict(jax.sharding.get_abstract_mesh().shape)
  if all(a in sizes for a in spmd.axes(fast_axis)):
    return math.prod(sizes[a] for a in spmd.axes(fast_axis))
  raise ValueError(f"hierarchical: the state's shards need the size of {fast_axis!r}: make it "
                   "with data_parallel's make_state, inside the mapped step, or under "
                   "jax.set_mesh(mesh)")


def hierarchical(compressor, *, fast_axis: axis.AxisName = "data",
                 pack: bool | None = None) -> interface.Transformation:
  """The hierarchical mean: exact inside a node, ``compressor`` between nodes, 1/F of its message
  across the slow link.

  The module docstring numbers the steps: reduce-scatter over ``fast_axis`` (exact), the
  compressor's mean of each device's shard over its own axis (the slow one), all-gather over
  ``fast_axis``. Map both axes in the step::

    mesh = jax.make_mesh((nodes, devices_per_node), ("replica", "data"))
    tx = optax.chain(jaxcomp.hierarchical(jaxcomp.quantized(8, axis_name="replica")),
                     optax.adamw(1e-3))
    dp = jaxcomp.data_parallel(loss_fn, mesh, axis_name=("replica", "data"), tx=tx)

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((2, 4), ("replica", "data"))
    >>> tx = optax.chain(jaxcomp.hierarchical(jaxcomp.quantized(8, axis_name="replica")),
    ...                  optax.sgd(0.1))
    >>> dp = jaxcomp.data_parallel(lambda p, x: ((x @ p) ** 2).mean(), mesh,
    ...                            axis_name=("replica", "data"), tx=tx)
    >>> params = jnp.ones((64, 256))
    >>> state = dp.make_state(params)
    >>> x = dp.shard(jnp.ones((16, 64)))
    >>> report = jaxcomp.comm_report(dp.step, params, state, x).by_axes(mesh)
    >>> report[("replica",)].bytes_by_dtype()["s8"]  # 64 x 256 / 4 int8 codes, out and back
    8192

  Args:
    compressor: a jaxcomp compressor over the slow axis, e.g. ``jaxcomp.quantized(8,
      axis_name="replica")``, ``jaxcomp.allreduce(axis_name="replica")``.
    fast_axis: the mesh axis (or axes) inside a node.
    pack: the leaves of each dtype travel as one vector (``True``), or each leaf's shard keeps its
      rank (``False``: PowerSGD compresses matrices, and a packed vector it would send whole).
      ``None``: packed for the elementwise codecs (``ELEMENTWISE``), by leaf for the others.

  Returns:
    A ``jaxcomp.Transformation`` whose output, the mean over both axes, is the same on every
    device; it averages over ``(compressor's axes, fast axes)``.

  Raises:
    TypeError: ``compressor`` is not a jaxcomp compressor.
    ValueError: ``fast_axis`` is one of the compressor's axes.
  """
  compressor = interface.mean(compressor, "compressor",
                              "jaxcomp.quantized(8, axis_name='replica')")
  fast_axis = axis.check_axis_name(fast_axis)
  slow, fast = spmd.axes(compressor.axis_name), spmd.axes(fast_axis)
  if set(slow) & set(fast):
    raise ValueError(f"fast_axis: the compressor averages over {compressor.axis_name!r}, the axis "
                     f"between nodes; fast_axis must be the axis inside a node (e.g. 'data'); got "
                     f"{fast_axis!r}")
  both = slow + fast
  pack = compressor.name in ELEMENTWISE if pack is None else validate.boolean(pack, "pack")

  def init_fn(params):
    signature = tree_lib.TreeSignature.of(tree_lib.unwrap(params))
    world = fast_size(fast_axis)
    if pack:
      owned = {d: jnp.zeros(-(-size // world), d) for d, size in _sizes(signature).items()}
    else:
      cut = shards.Layout(world, by_leaf=True)
      owned = _tree(signature, [jnp.zeros(cut.shape(signature.shapes[i]), signature.dtypes[i])
                                for i in signature.reduced])
    return HierarchicalState(compressor.init(owned), signature)

  def update_fn(updates, state, params=None):
    del params
    if not isinstance(state, HierarchicalState):
      raise TypeError(f"hierarchical: update needs the state its init made; got "
                      f"{type(state).__name__}")
    signature = state.signature
    leaves = signature.check(updates)
    world = axis.axis_size(fast_axis)
    cut = shards.Layout(world, by_leaf=not pack)
    reduced = [axis.divide_by_world(leaves[i], fast_axis) for i in signature.reduced]
    if pack:  # each dtype's leaves as one vector, cut in F
      vectors = {d: jnp.concatenate([jnp.ravel(x) for x in reduced if x.dtype == d])
                 for d in _sizes(signature)}
    else:
      vectors = _tree(signature, reduced)
    # 1: this device's shard of the node's exact mean (a float32 reduce-scatter over fast).
    owned = jax.tree.map(lambda v: axis.psum_scatter(cut.split(v), fast_axis), vectors)
    # 2: the compressor's mean of the shards over the slow axis.
    means, inner = compressor.update(owned, state.inner)
    # 3: the whole mean on every device (all-gather over fast).
    whole = jax.tree.map(lambda m, v: cut.join(axis.all_gather(m, fast_axis), v.shape), means,
                         vectors)
    if pack:
      offsets = {d: 0 for d in whole}
      for i in signature.reduced:
        d, size = jnp.dtype(signature.dtypes[i]), math.prod(signature.shapes[i])
        leaves[i] = whole[d][offsets[d]:offsets[d] + size].reshape(signature.shapes[i])
        offsets[d] += size
    else:
      for i, mean in zip(signature.reduced, jax.tree.leaves(whole)):
        leaves[i] = mean
    return tree_lib.like(updates, leaves), state._replace(inner=inner)

  return interface.Transformation(init_fn, update_fn, name=f"hierarchical {compressor.name}",
                                  axis_name=both,
                                  scatter=interface.own_shard_of(update_fn, both))


def _sizes(signature: tree_lib.TreeSignature) -> dict:
  """``{dtype: values}`` of the reduced leaves, packed one vector per dtype."""
  sizes: dict = {}
  for i in signature.reduced:
    d = jnp.dtype(signature.dtypes[i])
    sizes[d] = sizes.get(d, 0) + math.prod(signature.shapes[i])
  return sizes


def _tree(signature: tree_lib.TreeSignature, owned: list):
  """The compressor's input: the shards at the reduced leaves, the others left out (masked)."""
  flat = [optax.MaskedNode()] * len(signature.shapes)
  for i, x in zip(signature.reduced, owned):
    flat[i] = x
  return signature.unflatten(flat)


# ----------------------------------------------------------------------- compositions refused


def refuse_wrong_axes(mesh, axis_name, tx) -> None:
  """Raises where a step over ``mesh`` mapping ``axis_name`` would put the exchange on the fast
  axis: the mesh has a slow axis (``SLOW_AXIS``, more than one device) that the step does not map,
  or ``tx`` owns the parameters (``diloco``, ``local_sgd``, ...) and synchronizes elsewhere.

  Raises:
    ValueError: one line naming the axis and the fix.
  """
  if mesh.shape.get(SLOW_AXIS, 1) <= 1:
    return
  mapped = spmd.axes(axis_name)
  if SLOW_AXIS not in mapped:
    raise ValueError(
        f"axis_name: the step maps {axis_name!r} but not {SLOW_AXIS!r}, the axis between nodes, so "
        f"the exchange would run on the fast axis inside a node: map it, axis_name="
        f"{(SLOW_AXIS,) + tuple(a for a in mapped if a != SLOW_AXIS)!r}, with the exchange over "
        f"{SLOW_AXIS!r} (jaxcomp.hierarchical(compressor) for a compressor)")
  synced = spmd.axes(getattr(tx, "axis_name", None) or ())
  if getattr(tx, "owns_params", False) and SLOW_AXIS not in synced:
    raise ValueError(
        f"tx: jaxcomp.{tx.name} synchronizes over {tx.axis_name!r}, the fast axis inside a node; "
        f"its exchange belongs on {SLOW_AXIS!r}: {tx.name}(..., axis_name={SLOW_AXIS!r}), with "
        f"data_parallel(..., axis_name={SLOW_AXIS!r}) so that the partitioner averages inside a "
        "node")


def refuse_sharding_over(axis_name, mesh, outer: tuple) -> None:
  """Raises where ``jaxcomp.fully_sharded`` would shard the parameters over the slow axis, or
  leave a slow axis of ``mesh`` to no exchange (``outer``: the axes its optimizer synchronizes
  over, when it owns the parameters).

  Raises:
    ValueError: one line naming the axis and the fix.
  """
  fix = (f"shard inside a node (axis_name='fsdp') and synchronize over {SLOW_AXIS!r} with the "
         f"optimizer (jaxcomp.diloco(..., axis_name={SLOW_AXIS!r}))")
  if SLOW_AXIS in spmd.axes(axis_name):
    raise ValueError(
        f"axis_name: fully_sharded would gather every layer and scatter its gradient over "
        f"{SLOW_AXIS!r}, the axis between nodes, on every step; {fix}")
  if mesh.shape.get(SLOW_AXIS, 1) > 1 and SLOW_AXIS not in outer:
    raise ValueError(f"optimizer: the mesh has {SLOW_AXIS!r}, the axis between nodes, and "
                     f"nothing exchanges over it: {fix}")
