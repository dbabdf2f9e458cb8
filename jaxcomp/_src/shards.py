"""Shards: how a leaf is split among the W devices of an axis when the optimizer state is sharded.

With sharded optimizer state (``jaxcomp.sharded_optimizer``, DeepSpeed's ZeRO-1/2) each device owns
one shard of every reduced leaf: it receives the mean gradient of that shard only (a reduce-scatter),
updates it, and the updated shards are all-gathered. The layout, for a leaf of n values and W
devices:

* the leaf is raveled and zero-padded to W·S values, S = ⌈n/W⌉; device d owns values d·S to
  (d+1)·S − 1 (contiguous, so splitting and joining are reshapes: no transpose, and a copy only
  where there is padding);
* the shard keeps the leaf's rank: shape ``(1, …, 1, S)`` (a 0-d leaf's shard is 0-d, device 0
  owning the value), so that what an optimizer decides from the rank — a weight-decay mask on
  matrices only, say — chooses the same for the shard as for the whole leaf;
* the padding (W·S − n ≤ W − 1 values per leaf) is zero in every gradient shard and never reaches
  the parameters; it costs at most one value per leaf in each state array of a device, and
  (W − 1) values per leaf on the wire.

``split`` / ``join`` convert between a leaf and its W shards stacked ``(W, *shard_shape)`` — which is
also how ``jaxcomp.data_parallel`` stores a per-device state, so a sharded state's global array is
its leaf, padded and reshaped. ``own`` cuts this device's shard out of a leaf it holds whole;
``mean_scatter`` and ``gather`` are the collectives, each one per dtype for all leaves together (XLA:CPU
combines neither reduce-scatters nor all-gathers: one per leaf would pay one rendezvous per leaf).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._src import axis


def shard_shape(shape: tuple, world: int) -> tuple:
  """The shape of one device's shard of a leaf of ``shape``: ``(1, …, 1, ⌈n/W⌉)`` (``()`` for 0-d)."""
  if not shape:
    return ()
  return (1,) * (len(shape) - 1) + (-(-math.prod(shape) // world),)


def split(x: jax.Array, world: int) -> jax.Array:
  """``x`` cut into W shards, stacked: shape ``(W, *shard_shape)``; zero padding at the end."""
  shape = shard_shape(x.shape, world)
  flat = jnp.ravel(x)
  padding = world * max(math.prod(shape), 1) - flat.size
  if padding:
    flat = jnp.pad(flat, (0, padding))
  return flat.reshape((world,) + shape)


def join(rows: jax.Array, shape: tuple) -> jax.Array:
  """The inverse of ``split``: the leaf of ``shape`` from its W shards ``(W, *shard_shape)``."""
  return rows.reshape(-1)[:math.prod(shape)].reshape(shape)


def own(x: jax.Array, axis_name: axis.AxisName) -> jax.Array:
  """This device's shard of ``x``, which it holds whole (the whole of ``x`` at world size 1)."""
  world = axis.axis_size(axis_name)
  if world == 1:
    return split(x, 1)[0]
  return lax.dynamic_index_in_dim(split(x, world), axis.axis_index(axis_name), keepdims=False)


def _psum_scatter(rows: jax.Array, axis_name: axis.AxisName) -> jax.Array:
  """Row d of the sum over devices of ``rows`` (W, …) on device d: a reduce-scatter SUM.

  (Not yet in ``jaxcomp._src.axis``, where every other collective is.)
  """
  name = axis.bound_axis(axis_name)
  if name is None:
    return rows[0]
  return lax.psum_scatter(rows, name, scatter_dimension=0, tiled=False)


def mean_scatter(leaves: Sequence[jax.Array], axis_name: axis.AxisName,
                 wire_dtype=None) -> list:
  """This device's shard of each leaf's mean over the axis, in torch's order: cast to
  ``wire_dtype`` → ÷W → reduce-scatter SUM → cast back; one reduce-scatter per wire dtype."""
  world = axis.axis_size(axis_name)
  rows = [split(axis.divide_by_world(x if wire_dtype is None else x.astype(wire_dtype),
                                     axis_name), world) for x in leaves]
  owned = axis._packed(_psum_scatter, rows, axis_name, keep=1)  # noqa: SLF001 (axis' packing)
  return [shard.astype(x.dtype) for shard, x in zip(owned, leaves)]


def gather(owned: Sequence[jax.Array], shapes: Sequence[tuple],
           axis_name: axis.AxisName) -> list:
  """The whole leaves of ``shapes`` from every device's shard (``owned`` is this device's); one
  all-gather per dtype. The result is the same on every device."""
  return [join(rows, shape)
          for rows, shape in zip(axis.all_gather_many(list(owned), axis_name), shapes)]
