"""exchange: the two-phase compressed mean (reduce-scatter as an all-to-all, encode, all-gather).

Its layouts against their definitions; the whole exchange with a codec that sends values exactly
(the mean itself, no error left) and with the int8 block codec of ``jaxcomp.quantized`` (the mean
within the codec's rounding, the rest held by the two errors, as the module docstring states); the
two halves apart, in the rows of sharded optimizer state. All under ``jax.pmap`` against NumPy.
(``tests/test_quantized.py`` checks the codes and scales the exchange sends bit for bit.)
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp._src import exchange, shards
from jaxcomp._src import quantized as quantized_lib
from helpers import assert_identical_across_devices, dyadic, fetched, pmapped, rounding_tol

pytestmark = pytest.mark.numeric
W = 8
SHAPES = [(5, 7), (), (13,), (2, 3, 4)]  # 73 values, not a multiple of W


def exact_codec(granule):
  """Sends the float32 rows as they are: the exchange is then the plain mean."""
  return exchange.Codec(encode=lambda rows, count, key: (list(rows), list(rows)),
                        decode=lambda payload, tails: list(payload), granule=granule)


def per_device(rng, shapes=SHAPES, make=dyadic):
  return [make(rng, (W,) + s) for s in shapes]


def test_shard_length_and_every_layouts_rows_valid_and_count():
  """For each owner d (a device's axis index): ``valid(d)`` marks the values of row d of
  ``split``, ``count(d)`` counts them, and ``join`` inverts ``split``."""
  assert exchange.shard_length(73, W, 4) == 12 and exchange.shard_length(73, W, 16) == 16
  assert exchange.shard_length(0, W, 4) == 4 and exchange.shard_length(64, W, 8) == 8
  rng = np.random.default_rng(0)
  arrays = per_device(rng, make=lambda r, s: dyadic(r, s) + 8)  # no zero value
  layouts = {"flat": exchange.flat_layout(SHAPES, W, 4), "leaf": exchange.leaf_layout(SHAPES, W),
             "shard": exchange.shard_layout(SHAPES, W), "row": exchange.row_layout(SHAPES, W, 1)}

  def rows_of(*arrays):
    owner = jax.lax.axis_index("batch")
    out = {}
    for name, rows_of in layouts.items():
      pieces = rows_of.split(arrays)
      out[name] = (pieces, rows_of.join(pieces), rows_of.valid(owner), rows_of.count(owner))
      if rows_of.row is not None:  # the owner's row, read, and written into zeros
        mine = rows_of.row(arrays, owner)
        out[name] += (mine, rows_of.with_row([jnp.zeros_like(a) for a in arrays], mine, owner))
    return out

  out = fetched(pmapped(rows_of, W)(*arrays))
  for name, (pieces, joined, valid, count, *row) in out.items():
    for d in range(W):
      chex.assert_trees_all_equal([j[d] for j in joined], [a[d] for a in arrays])
      mine = [p[d][d] != 0 for p in pieces]  # device d's own row of its own pieces
      chex.assert_trees_all_equal([v[d][0] for v in valid], mine)
      assert int(count[d]) == sum(int(m.sum()) for m in mine), (name, d)
      if row:
        chex.assert_trees_all_equal([r[d] for r in row[0]], [p[d][d:d + 1] for p in pieces])
        alone = [np.where(np.arange(W).reshape((W,) + (1,) * (p.ndim - 2)) == d, p[d], 0)
                 for p in pieces]
        chex.assert_trees_all_equal([x[d] for x in row[1]],
                                    [np.asarray(j) for j in layouts[name].join(alone)])
    assert sum(int(c) for c in count) == 73, name
  assert out["flat"][0][0].shape == (W, W, 12)  # one piece: (W, S), S a multiple of the granule
  # (2, 3, 4): 24 values, a multiple of W, W rows by a reshape; the rest flat, 49 in W rows of 7.
  assert [p.shape[1:] for p in out["row"][0]] == [(W, 3), (W, 7)]
  assert [p.shape[1:] for p in out["leaf"][0]] == [(W, 5, 1), (W, 1), (W, 2), (W, 2, 3, 1)]
  assert out["shard"][0][0].shape[1:] == (W, sum(math.prod(shards.Layout(W).shape(s))
                                                 for s in SHAPES))


def test_an_exact_codec_gives_the_mean_and_leaves_no_error():
  rng = np.random.default_rng(1)
  x = per_device(rng)
  zeros = [np.zeros_like(a) for a in x]

  def mean_of(x, worker, server):
    return exchange.compressed_mean(exact_codec(4), list(x), list(worker), list(server), "batch")

  mean, worker, server, ok = fetched(pmapped(mean_of, W)(x, zeros, zeros))
  assert np.asarray(ok).all()
  assert_identical_across_devices(mean)
  for a, m in zip(x, mean):
    np.testing.assert_allclose(m[0], a.mean(0), **rounding_tol(W, 4))
  chex.assert_trees_all_equal(worker, zeros)
  chex.assert_trees_all_equal(server, zeros)


def test_the_int8_codec_gives_the_mean_within_its_rounding_and_the_errors_hold_the_rest():
  """One step from zero errors, in float64: outputs = mean inputs − mean of the worker errors −
  the sum of the server errors (each device holds its own row's)."""
  rng = np.random.default_rng(2)
  magnitude = [10.0 ** rng.uniform(-2, 2, size=s) for s in SHAPES]
  x = [(rng.standard_normal((W,) + s) * m).astype(np.float32) for s, m in zip(SHAPES, magnitude)]
  codec = quantized_lib.block_codec(quantized_lib.QuantizedConfig(bits=8, block_size=16))
  zeros = [np.zeros_like(a) for a in x]

  def mean_of(x, worker, server):
    return exchange.compressed_mean(codec, list(x), list(worker), list(server), "batch")

  mean, worker, server, _ = fetched(pmapped(mean_of, W)(x, zeros, zeros))
  assert_identical_across_devices(mean)
  biggest = max(np.abs(a).max() for a in x)
  for a, m, w, s in zip(x, mean, worker, server):
    reference = a.astype(np.float64).mean(0)
    # Half a step of 1/127 of a block's maximum, twice (each device's codes, then the owner's).
    np.testing.assert_allclose(m[0], reference, rtol=0, atol=biggest / 127)
    rest = reference - np.asarray(w, np.float64).mean(0) - np.asarray(s, np.float64).sum(0)
    np.testing.assert_allclose(m[0], rest, rtol=0, atol=W * 4 * np.finfo(np.float32).eps * biggest)
  assert max(np.abs(np.asarray(w)).max() for w in worker) > 0
  assert max(np.abs(np.asarray(s)).max() for s in server) > 0
  # A device's server error lies in the row it owns: the rows of the flat layout (S = 16 here).
  placed = np.concatenate([np.asarray(s).reshape(W, -1) for s in server], axis=1)
  for d in range(W):
    outside = np.ones(placed.shape[1], bool)
    outside[d * 16:(d + 1) * 16] = False
    assert not placed[d, outside].any(), d


def test_scatter_mean_and_gather_rows_in_the_rows_of_sharded_state():
  """The halves of the exchange apart (sharded optimizer state): the owner's float32 mean of its
  shards of every leaf, then every device's shards gathered back into the whole leaves."""
  rng = np.random.default_rng(3)
  x = per_device(rng)
  cut = shards.Layout(W)

  def halves(*x):
    rows_of = exchange.shard_layout(SHAPES, W)
    owner = jax.lax.axis_index("batch")
    rows, worker, _ = exchange.scatter_mean(exact_codec(1), rows_of, list(x), None, "batch")
    owned = exchange.owned_shards(rows, SHAPES, W)
    again = exchange.shard_rows(owned)
    whole, _, _ = exchange.gather_rows(exact_codec(1), rows_of, again, rows_of.count(owner),
                                       "batch")
    return rows, owned, again, whole, worker

  rows, owned, again, whole, worker = fetched(pmapped(halves, W)(*x))
  assert worker is None
  chex.assert_trees_all_equal(again, rows)
  assert_identical_across_devices(whole)
  for a, o, w in zip(x, owned, whole):
    mean = a.mean(0)
    for d in range(W):
      assert o[d].shape == cut.shape(a.shape[1:])
      np.testing.assert_allclose(o[d], cut.split(mean)[d], **rounding_tol(W, 4))
    np.testing.assert_allclose(w[0], mean, **rounding_tol(W, 4))
  assert jnp.asarray(rows[0]).shape == (W, 1, sum(math.prod(cut.shape(s)) for s in SHAPES))
