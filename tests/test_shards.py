"""shards: how a leaf is cut among the W devices of an axis, and the collectives on the shards.

The layouts (``shards.Layout``) against the module docstring's definition, written in NumPy;
``own``, ``mean_scatter`` and ``gather`` under ``jax.pmap`` (the flat layout) and under
``jax.shard_map`` on a mesh whose other axis is left to the partitioner (by leaf), against NumPy's
mean.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from jaxcomp._src import shards
from helpers import assert_identical_across_devices, dyadic, fetched, rounding_tol

pytestmark = pytest.mark.numeric
W = 8
# 0-d, fewer values than devices, W divides the leaf (or its last axis), it does not, rank 3.
SHAPES = [(), (3,), (16,), (5, 7), (2, 3, 9), (4, 8)]


def reference_split(x, world, by_leaf):
  """The module docstring's layouts in NumPy: (W, *shard) for the leaf ``x``."""
  if x.ndim == 0 or not by_leaf:  # raveled, zero-padded to W·S, device d owning S values
    size = -(-x.size // world)
    flat = np.concatenate([x.ravel(), np.zeros(world * size - x.size, x.dtype)])
    return flat.reshape((world,) + ((1,) * (x.ndim - 1) + (size,) if x.ndim else ()))
  columns = -(-x.shape[-1] // world)  # the last axis dealt round-robin: value j to device j mod W
  padded = np.concatenate([x, np.zeros(x.shape[:-1] + (world * columns - x.shape[-1],), x.dtype)],
                          axis=-1)
  return np.stack([padded[..., d::world] for d in range(world)])


@pytest.mark.parametrize("by_leaf", [False, True], ids=["flat", "by_leaf"])
def test_split_and_join_are_the_documented_layouts_and_inverse(by_leaf):
  """Each device splits its own leaves and joins them back (in one pmapped program): the shards
  keep the leaf's rank, the padding is zero, and join(split(x)) is x."""
  cut = shards.Layout(W, by_leaf)
  rng = np.random.default_rng(0)
  leaves = [(dyadic(rng, (W,) + s) + 8).astype(np.float32) for s in SHAPES]  # no zero value

  def split_and_join(*leaves):
    rows = [cut.split(x) for x in leaves]
    return rows, [cut.join(r, x.shape) for r, x in zip(rows, leaves)]

  rows, joined = fetched(
      jax.pmap(split_and_join, axis_name="batch", devices=jax.devices()[:W])(*leaves))
  for shape, x, r, j in zip(SHAPES, leaves, rows, joined):
    shard = cut.shape(shape)
    assert len(shard) == len(shape) and r.shape == (W, W) + shard, (shape, shard, r.shape)
    if shape:
      assert math.prod(shard) == (-(-shape[-1] // W) * math.prod(shape[:-1]) if by_leaf
                                  else -(-math.prod(shape) // W))
    for d in range(W):
      np.testing.assert_array_equal(r[d], reference_split(x[d], W, by_leaf))
      np.testing.assert_array_equal(j[d], x[d])
    assert np.count_nonzero(r[0]) == x[0].size  # the rest is padding, zero


def test_shards_split_and_join_with_padding_in_both_layouts():
  x = jnp.arange(35.0).reshape(5, 7)
  flat, by_leaf = shards.Layout(8), shards.Layout(4, by_leaf=True)
  rows = flat.split(x)
  assert rows.shape == (8, 1, 5) and flat.shape((5, 7)) == (1, 5)
  np.testing.assert_array_equal(rows[7, 0], [0.0] * 5)  # 40 − 35 values of padding, at the end
  np.testing.assert_array_equal(flat.join(rows, (5, 7)), x)
  rows = by_leaf.split(x)  # the last axis dealt round-robin: column j to device j mod 4
  assert rows.shape == (4, 5, 2) and by_leaf.shape((5, 7)) == (5, 2)
  np.testing.assert_array_equal(rows[1], x[:, [1, 5]])
  np.testing.assert_array_equal(rows[3, :, 1], [0.0] * 5)  # column 7 is padding
  np.testing.assert_array_equal(by_leaf.join(rows, (5, 7)), x)
  for cut in (flat, by_leaf):  # 0-d: device 0 owns the value
    assert cut.shape(()) == ()
    assert cut.split(jnp.float32(2.0)).tolist() == [2.0] + [0.0] * (cut.world - 1)


def test_own_mean_scatter_and_gather_under_pmap_are_numpys_flat_shards():
  rng = np.random.default_rng(1)
  leaves = [dyadic(rng, (W,) + s) for s in SHAPES]
  leaves.append(dyadic(rng, (W, 6, 3)).astype(np.float16))  # a second dtype: its own collectives
  shapes = [x.shape[1:] for x in leaves]
  cut = shards.Layout(W)

  def step(*leaves):
    owned = [shards.own(x, "batch") for x in leaves]
    means = shards.mean_scatter(leaves, "batch")
    narrow = shards.mean_scatter(leaves, "batch", wire_dtype=jnp.bfloat16)
    return owned, means, narrow, shards.gather(means, shapes, "batch")

  owned, means, narrow, whole = fetched(
      jax.pmap(step, axis_name="batch", devices=jax.devices()[:W])(*leaves))
  assert_identical_across_devices(whole)
  for x, o, m, n, g in zip(leaves, owned, means, narrow, whole):
    mean = x.astype(np.float32).mean(0)
    assert m.dtype == n.dtype == g.dtype == x.dtype
    for d in range(W):
      np.testing.assert_array_equal(o[d], reference_split(x[d], W, False)[d])
      expected = reference_split(mean, W, False)[d]
      # The mean of W terms, in the leaf's dtype (float16: its own rounding), or through bfloat16.
      np.testing.assert_allclose(m[d].astype(np.float32), expected,
                                 **rounding_tol(W, 4, dtype=x.dtype))
      np.testing.assert_allclose(n[d].astype(np.float32), expected,
                                 **rounding_tol(W, 4, dtype=jnp.bfloat16))
    np.testing.assert_allclose(g[0].astype(np.float32), mean, **rounding_tol(W, 4, dtype=x.dtype))
  assert cut.shape(shapes[0]) == () and owned[0].shape == (W,)  # device 0 owns a 0-d leaf's value
  np.testing.assert_array_equal(owned[0][1:], 0)


def test_under_a_mesh_with_a_model_axis_the_shards_are_dealt_by_leaf():
  """shard_map over the data axis of a (4, 2) mesh whose model axis is left to the partitioner:
  ``layout`` deals each leaf's last axis, and the collectives give NumPy's shards of the mean."""
  world = 4
  mesh = jax.make_mesh((world, 2), ("batch", "model"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:2 * world])
  rng = np.random.default_rng(2)
  leaves = [dyadic(rng, (world,) + s) for s in [(), (3,), (5, 7), (2, 3, 9)]]
  shapes = [x.shape[1:] for x in leaves]
  cut = shards.Layout(world, by_leaf=True)
  layouts = []

  def step(*leaves):
    leaves = [x[0] for x in leaves]
    layouts.append(shards.layout("batch"))
    means = shards.mean_scatter(leaves, "batch")
    return [m[None] for m in means], [x[None] for x in shards.gather(means, shapes, "batch")]

  specs = [P("batch")] * len(leaves)
  means, whole = fetched(jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=tuple(specs), out_specs=(specs, specs), axis_names={"batch"},
      check_vma=False))(*leaves))
  assert layouts == [cut]
  for x, m, g in zip(leaves, means, whole):
    mean = x.mean(0)
    chex.assert_trees_all_close(np.asarray(m), reference_split(mean, world, True),
                                **rounding_tol(world, 4))
    for d in range(world):
      np.testing.assert_allclose(g[d], mean, **rounding_tol(world, 4))
