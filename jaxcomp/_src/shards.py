"""Shards: how a leaf is split among the W devices of an axis when the optimizer state is sharded.

With sharded optimizer state (``jaxcomp.sharded_optimizer``, DeepSpeed's ZeRO-1/2) each device owns
one shard of every reduced leaf: it receives the mean gradient of that shard only (a
reduce-scatter), updates it, and the updated shards are all-gathered. Every shard keeps its leaf's
rank, so that what an optimizer decides from the rank — a weight-decay mask on matrices only, say —
chooses the same for the shard as for the whole leaf; a 0-d leaf's shard is 0-d, device 0 owning the
value. Two layouts (``Layout``), for a leaf of n values and W devices:

* flat (a mesh with no other axis in scope: ``jax.pmap``, a 1-D ``jaxcomp.data_parallel`` mesh): the
  leaf raveled and zero-padded to W·S values, S = ⌈n/W⌉, device d owning values d·S to (d+1)·S − 1,
  its shard shaped ``(1, …, 1, S)``. Splitting and joining are reshapes (a copy only where there is
  padding), the padding is at most W − 1 values per leaf, and the collectives run once per dtype
  on all leaves together. XLA:CPU combines neither reduce-scatters nor all-gathers (it does
  all-reduces), and one pair per leaf took 1.72× the time of the packed pair for the main job's
  transformer (38 leaves, W = 8: 30.6 against 17.7 ms; ``benchmarks/sharded.py packing``);
* by leaf (another mesh axis left to the SPMD partitioner, such as a model axis that may shard the
  parameters): the leaf's last axis, of B values, zero-padded to W·C, C = ⌈B/W⌉, and dealt
  round-robin (value j to device j mod W), every other axis kept: the shard is ``(…, C)``. Raveling
  a leaf sharded over a model axis would move its values across that axis; dealt this way, its
  model sharding carries over to the shards (and the optimizer state is sharded over both axes). The
  padding is up to (W − 1)·n/B values per leaf (none where W divides B), and each leaf has its own
  collectives.

In both, the padding is zero in every gradient shard and never reaches the parameters. ``split`` /
``join`` convert between a leaf and its W shards stacked ``(W, *shard_shape)`` — which is also how
``jaxcomp.data_parallel`` stores a per-device state, so a sharded state's global array is its leaf,
padded and rearranged. ``own`` cuts this device's shard out of a leaf it holds whole;
``mean_scatter`` and ``gather`` are the collectives.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._src import axis, kernels


class Layout(NamedTuple):
  """How leaves are cut into the shards of W devices (the module docstring).

  Attributes:
    world: W.
    by_leaf: deal each leaf's last axis (True), or cut the raveled leaf (False).
  """
  world: int
  by_leaf: bool = False

  def shape(self, shape: tuple) -> tuple:
    """The shape of one device's shard of a leaf of ``shape``."""
    if not shape:
      return ()
    if self.by_leaf:
      return tuple(shape[:-1]) + (-(-shape[-1] // self.world),)
    return (1,) * (len(shape) - 1) + (-(-math.prod(shape) // self.world),)

  def split(self, x: jax.Array) -> jax.Array:
    """``x`` cut into W shards, stacked: shape ``(W, *self.shape(x.shape))``."""
    shard = self.shape(x.shape)
    if not self.by_leaf or not shard:
      flat = jnp.ravel(x)
      padding = self.world * max(math.prod(shard), 1) - flat.size
      return jnp.pad(flat, (0, padding)).reshape((self.world,) + shard)
    padding = self.world * shard[-1] - x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padding)])
    return jnp.moveaxis(x.reshape(shard + (self.world,)), -1, 0)

  def join(self, rows: jax.Array, shape: tuple) -> jax.Array:
    """The inverse of ``split``: the leaf of ``shape`` from its W shards."""
    if not self.by_leaf or not shape:
      return rows.reshape(-1)[:math.prod(shape)].reshape(shape)
    dealt = jnp.moveaxis(rows, 0, -1)
    return dealt.reshape(dealt.shape[:-2] + (-1,))[..., :shape[-1]]


def layout(axis_name: axis.AxisName) -> Layout:
  """The layout of shards over ``axis_name`` here: by leaf where other mesh axes are in scope
  (``kernels.keeps_leaves``)."""
  return Layout(axis.axis_size(axis_name), kernels.keeps_leaves())


def own(x: jax.Array, axis_name: axis.AxisName) -> jax.Array:
  """This device's shard of ``x``, which it holds whole."""
  cut = layout(axis_name)
  if cut.world == 1:
    return cut.split(x)[0]
  return lax.dynamic_index_in_dim(cut.split(x), axis.axis_index(axis_name), keepdims=False)


def mean_scatter(leaves: Sequence[jax.Array], axis_name: axis.AxisName,
                 wire_dtype=None) -> list:
  """This device's shard of each leaf's mean over the axis, in torch's order: cast to
  ``wire_dtype`` → ÷W → reduce-scatter SUM → cast back (flat: one reduce-scatter per wire dtype)."""
  cut = layout(axis_name)
  rows = [cut.split(axis.divide_by_world(x if wire_dtype is None else x.astype(wire_dtype),
                                         axis_name)) for x in leaves]
  if cut.by_leaf:
    owned = [axis.psum_scatter(r, axis_name) for r in rows]
  else:
    owned = axis._packed(axis.psum_scatter, rows, axis_name, keep=1)  # noqa: SLF001 (axis' packing)
  return [shard.astype(x.dtype) for shard, x in zip(owned, leaves)]


def gather(owned: Sequence[jax.Array], shapes: Sequence[tuple],
           axis_name: axis.AxisName) -> list:
  """The whole leaves of ``shapes`` from every device's shard (``owned`` is this device's), the
  same on every device (flat: one all-gather per dtype)."""
  cut = layout(axis_name)
  rows = kernels.all_gather(list(owned), axis_name)
  return [cut.join(r, shape) for r, shape in zip(rows, shapes)]
