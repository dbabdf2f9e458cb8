"""kernels: each backend workaround computes what its one-line definition says.

Every kernel is checked against its obvious form (NumPy, or the jnp expression its docstring gives):
inside ``jax.pmap`` over simulated devices, each device with its own values, as the algorithms run
them; DGC's candidate selection and the float8 conversions on large inputs under ``jax.jit``. The
benchmark that times each kernel against its obvious form runs in the slow tier.
"""

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from jaxcomp._src import kernels
from helpers import dyadic, fetched, pmapped, rounding_tol

pytestmark = pytest.mark.numeric
W = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------ the benchmark


def run_script(name, *args):
  """A benchmark script in ``--quick`` mode, in its own process; it must leave BENCHMARKS.md
  alone."""
  from benchmarks import common
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  before = _read(common.BENCHMARKS_MD)
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", name), "--quick", *args],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  assert _read(common.BENCHMARKS_MD) == before, f"{name} --quick changed BENCHMARKS.md"
  return result.stdout


def _read(path):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return f.read()


def table_rows(text):
  """The data rows of the first Markdown table in ``text``, as lists of cells."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("|"))
  end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
  rows = [line.strip().strip("|").split("|") for line in lines[start:end]]
  return [[c.strip() for c in r] for r in rows[2:]]


@pytest.mark.slow  # an end-to-end run of a script or of several processes
def test_kernels_against_their_obvious_forms():
  rows = table_rows(run_script("kernels.py"))
  assert [r[1] for r in rows] == ["quantized_int8", "sign", "onebit_adam", "quantized_fp8",
                                  "quantized_int8", "onebit_adam", "quantized_int8", "onebit_adam",
                                  "quantized_int8", "sign", "powersgd_r1", "powersgd_r4", "fp16",
                                  "hook_fp16_allreduce", "batched_powersgd_r1",
                                  "batched_powersgd_r1", "powersgd_r1"]
  # Every kernel computes what its obvious form does, bit for bit, but device_mean's order of
  # operations (each term ÷W, then summed), which a mean of the stacked terms does not keep, and
  # transposed_product's (a vector–matrix product adds in another order than M.T @ P).
  assert all(r[7] == "yes" for r in rows if r[0] not in ("device_mean", "transposed_product")), rows


# ------------------------------------------------------------------------------ PowerSGD


def test_the_matrix_kernels_are_the_products_they_stand_for():
  """product, transposed_product and low_rank_product (the last two in their forms up to rank 8
  and beyond), zero_padded and in_place, per device, against NumPy in float64."""
  rng = np.random.default_rng(0)
  n, m = 12, 7
  g, e = (rng.standard_normal((W, n, m)).astype(np.float32) for _ in range(2))
  q, p = rng.standard_normal((W, m, 3)).astype(np.float32), rng.standard_normal((W, n, 3)).astype(
      np.float32)
  p9, q9 = rng.standard_normal((W, n, 9)).astype(np.float32), rng.standard_normal((W, m, 9)).astype(
      np.float32)
  scalar = rng.standard_normal((W,)).astype(np.float32)

  def kernels_of(g, e, q, p, p9, q9, scalar):
    return dict(product=kernels.product(kernels.Sum((g, e)), q),
                transposed=kernels.transposed_product(kernels.Sum((g, e)), p),
                transposed_9=kernels.transposed_product(kernels.Sum((g, e)), p9),
                low_rank=kernels.low_rank_product(p, q),
                low_rank_9=kernels.low_rank_product(p9, q9),
                padded=kernels.zero_padded([g, scalar, q], 2 * n * m),
                in_place=kernels.in_place(lambda old, a, b: 0.5 * old + a * b, e, g, scalar))

  out = fetched(pmapped(kernels_of, W)(g, e, q, p, p9, q9, scalar))
  f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  for d in range(W):
    m_d = f64(g[d]) + f64(e[d])
    # Sums of m (or n) products of unit-scale terms, and of 2 terms: a rounding per term.
    np.testing.assert_allclose(out["product"][d], m_d @ f64(q[d]), **rounding_tol(2 * m + 2, 4))
    for key, factor in (("transposed", p), ("transposed_9", p9)):
      np.testing.assert_allclose(out[key][d], m_d.T @ f64(factor[d]), **rounding_tol(2 * n + 2, 4))
    np.testing.assert_allclose(out["low_rank"][d], f64(p[d]) @ f64(q[d]).T, **rounding_tol(4, 4))
    np.testing.assert_allclose(out["low_rank_9"][d], f64(p9[d]) @ f64(q9[d]).T,
                               **rounding_tol(10, 4))
    expected = np.concatenate([g[d].ravel(), [scalar[d]], q[d].ravel(),
                               np.zeros(2 * n * m - g[d].size - 1 - q[d].size, np.float32)])
    np.testing.assert_array_equal(out["padded"][d], expected)
    np.testing.assert_allclose(out["in_place"][d], 0.5 * f64(e[d]) + f64(g[d]) * scalar[d],
                               **rounding_tol(2))


# ------------------------------------------------------------------------------ DGC


@pytest.mark.parametrize("n, density, capacity", [(1000, 0.3, 64), (1000, 0.3, 1000),
                                                  (4099, 0.01, 90), (100_003, 0.05, 2_000),
                                                  (37, 0.0, 8)])
def test_first_at_least_is_nonzero_of_the_threshold(n, density, capacity):
  # The compaction found slot by slot: the first `capacity` candidates in index order, whether
  # there are fewer (empty slots: n and -1) or more; sizes that leave the last block short.
  rng = np.random.default_rng(n)
  x = np.where(rng.random(n) < density, rng.standard_normal(n) + 5,
               rng.standard_normal(n)).astype(np.float32)
  threshold = np.float32(4.0)
  select = jax.jit(lambda x: kernels.first_at_least(x, kernels.bits_at_least(x, threshold)[0],
                                                    capacity))
  indices, magnitudes = map(np.asarray, select(x))
  expected = np.flatnonzero(np.abs(x) >= threshold)[:capacity]
  np.testing.assert_array_equal(indices[:len(expected)], expected)
  np.testing.assert_array_equal(indices[len(expected):], n)
  np.testing.assert_array_equal(magnitudes[:len(expected)], np.abs(x[expected]))
  np.testing.assert_array_equal(magnitudes[len(expected):], -1)
  words, finite = kernels.bits_at_least(x, threshold)
  assert int(jax.lax.population_count(words).sum()) == int(np.sum(np.abs(x) >= threshold))
  assert bool(finite)
  # A threshold of 0: every element a candidate, never the padding of a short last block.
  assert int(jax.lax.population_count(kernels.bits_at_least(x, 0.0)[0]).sum()) == n


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 4098])
def test_bits_at_least_says_whether_every_element_is_finite(bad, where):
  # One value not finite, in the first block or in the short last one (4,099 = 128·32 + 3): the
  # flag from the same pass as the candidates; the other candidates unchanged.
  x = np.random.default_rng(2).standard_normal(4099).astype(np.float32)
  x[where] = bad
  words, finite = jax.jit(kernels.bits_at_least)(x, np.float32(1.0))
  assert not bool(finite)
  hits = (np.asarray(words)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
  np.testing.assert_array_equal(hits.reshape(-1)[:x.size].astype(bool), np.abs(x) >= 1.0)


def test_the_scatters_kth_largest_and_the_guarded_loop_are_their_obvious_forms():
  """scatter_add (duplicates summed), zero_at and subtract_at (the filler index, the leaf's size,
  dropped), addressed in the leaf's shape; kth_largest; while_loop_if_needed entered or not."""
  rng = np.random.default_rng(1)
  shape = (6, 5)
  x = dyadic(rng, (W,) + shape)
  indices = np.stack([np.array([3, 3, 29, 0, d, 30, 30], np.int32) for d in range(W)])  # 30: filler
  values = dyadic(rng, (W, 7))
  starts = np.array([0, 5, 1, 7], np.int32)  # the loop runs while its counter is below 5

  def kernels_of(x, indices, values, start):
    flat = x.reshape(-1)
    loop = kernels.while_loop_if_needed(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] + 1),
                                        (start, jnp.int32(0)))
    return dict(scatter_add=kernels.scatter_add(shape, indices, values),
                zero_at=kernels.zero_at(x, indices),
                subtract_at=kernels.subtract_at(x, indices[:4], flat[indices[:4]]),
                kth=kernels.kth_largest(flat, 3), loop=loop[1])

  out = fetched(pmapped(kernels_of, W)(x, indices, values, starts))
  for d in range(W):
    kept = indices[d] < x[d].size
    expected = np.zeros(x[d].size, np.float32)
    np.add.at(expected, indices[d][kept], values[d][kept])
    np.testing.assert_array_equal(out["scatter_add"][d], expected.reshape(shape))
    zeroed = x[d].reshape(-1).copy()
    zeroed[indices[d][kept]] = 0
    np.testing.assert_array_equal(out["zero_at"][d], zeroed.reshape(shape))
    # Index 3 is sent twice, so it is subtracted twice: -x, not 0 (each slot its own value).
    subtracted = x[d].reshape(-1).copy()
    np.subtract.at(subtracted, indices[d][:4], x[d].reshape(-1)[indices[d][:4]])
    np.testing.assert_array_equal(out["subtract_at"][d], subtracted.reshape(shape))
    assert out["kth"][d] == np.sort(x[d].ravel())[-3]
  np.testing.assert_array_equal(out["loop"], np.maximum(5 - starts, 0))


# -------------------------------------------------------------------------- the non-finite policy


def test_where_with_a_scalar_predicate_is_jnp_where():
  rng = np.random.default_rng(2)
  new, old = dyadic(rng, (W, 3, 4)), dyadic(rng, (W, 3, 4))

  def select(new, old):
    even = jax.lax.axis_index("batch") % 2 == 0
    return kernels.where(even, new, old), kernels.where(even, new[0, 0], old[0, 0])

  leaf, scalar = fetched(pmapped(select, W)(new, old))
  for d in range(W):
    np.testing.assert_array_equal(leaf[d], new[d] if d % 2 == 0 else old[d])
    assert scalar[d] == (new if d % 2 == 0 else old)[d, 0, 0]


# ------------------------------------------------------------------------------ the exchange


def test_the_collectives_of_several_arrays_and_the_device_mean():
  """all_to_all (row j of a device's arrays to device j) and all_gather of arrays of two dtypes,
  one collective per dtype; device_mean of what arrived (each ÷W, then summed in device order)."""
  rng = np.random.default_rng(3)
  a = dyadic(rng, (W, W, 3, 2))  # per device: one row of (3, 2) for each device
  b = rng.integers(-100, 100, (W, W, 5)).astype(np.int32)
  c = dyadic(rng, (W, W))

  def exchange(a, b, c):
    ra, rb, rc = kernels.all_to_all([a, b, c], "batch")
    ga, gc = kernels.all_gather([a[0], c], "batch")
    mean = kernels.device_mean(lambda w: [ra[w], rc[w]], W)
    return ra, rb, rc, ga, gc, mean

  ra, rb, rc, ga, gc, mean = fetched(pmapped(exchange, W)(a, b, c))
  for d in range(W):
    np.testing.assert_array_equal(ra[d], a[:, d])
    np.testing.assert_array_equal(rb[d], b[:, d])
    np.testing.assert_array_equal(rc[d], c[:, d])
    np.testing.assert_array_equal(ga[d], a[:, 0])
    np.testing.assert_array_equal(gc[d], c)
    chex.assert_trees_all_close([mean[0][d], mean[1][d]],
                                [a[:, d].mean(0), c[:, d].mean(0)], **rounding_tol(W, 4))


def test_one_row_of_the_flat_layout_and_back():
  """row_of_arrays: row d of the arrays raveled, concatenated, zero-padded and cut into rows
  (the last row all padding here); row_update_arrays: arrays holding zeros outside row d (and old
  values in it) with row d set, zeros elsewhere. Each device takes its own row (axis_index, as
  the exchange's owner does)."""
  shapes = [(3, 5), (), (7,)]  # 23 values in rows of 8: rows 2 and 3 hold padding
  length = 8
  rng = np.random.default_rng(4)
  arrays = [dyadic(rng, (W,) + s) for s in shapes]
  rows = dyadic(rng, (W, length))
  old_rows = dyadic(rng, (W, length))  # what each device's row held before
  olds = []
  for d in range(W):
    flat = np.zeros(W * length, np.float32)
    flat[d * length:(d + 1) * length] = old_rows[d]
    olds.append(np.split(flat[:23], [15, 16]))
  olds = [np.stack([olds[d][i].reshape(s) for d in range(W)]) for i, s in enumerate(shapes)]

  def rows_of(rows, *arrays_and_olds):
    owner = jax.lax.axis_index("batch")
    arrays, old = arrays_and_olds[:len(shapes)], arrays_and_olds[len(shapes):]
    return (kernels.row_of_arrays(list(arrays), owner, length, W),
            kernels.row_update_arrays(list(old), rows, owner))

  row, placed = fetched(pmapped(rows_of, W)(rows, *arrays, *olds))
  for d in range(W):
    flat = np.concatenate([x[d].ravel() for x in arrays] + [np.zeros(W * length - 23, np.float32)])
    np.testing.assert_array_equal(row[d], flat[d * length:(d + 1) * length])
    expected = np.zeros(W * length, np.float32)
    expected[d * length:(d + 1) * length] = rows[d]
    got = np.concatenate([np.asarray(p[d]).ravel() for p in placed])
    assert [np.shape(p[d]) for p in placed] == shapes
    np.testing.assert_array_equal(got, expected[:23])


@pytest.mark.numeric
def test_the_float8_kernels_equal_ml_dtypes_bit_for_bit():
  """kernels.to_float8_e4m3fn / from_float8_e4m3fn, which the fp8 codec uses in place of XLA's
  conversions: every float8 value decodes exactly; every value, every midpoint between two (a tie,
  to even), their float32 neighbours and a spread of magnitudes encode as ml_dtypes rounds them."""
  codes = np.arange(256, dtype=np.uint8)
  codes = codes[codes & 0x7F != 0x7F]  # NaN is never sent
  exact = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  decoded = np.asarray(jax.jit(kernels.from_float8_e4m3fn)(codes))
  np.testing.assert_array_equal(decoded.view(np.uint32), exact.view(np.uint32))  # -0 too
  values = np.unique(np.abs(exact))
  ties = ((values[1:].astype(np.float64) + values[:-1]) / 2).astype(np.float32)
  x = np.concatenate([values, ties, 10.0 ** np.linspace(-12, np.log10(448), 20_001)]).astype(
      np.float32)
  x = np.concatenate([x, np.nextafter(x, np.float32(0)), np.nextafter(x, np.float32(np.inf))])
  x = x[x <= 448]
  x = np.concatenate([x, -x])
  np.testing.assert_array_equal(np.asarray(jax.jit(kernels.to_float8_e4m3fn)(x)),
                                x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


# ------------------------------------------------------------------------------ chunked top-k


def test_scatter_rows_add_sums_the_terms_row_by_row():
  rng = np.random.default_rng(5)
  rows_, columns, k, terms = 3, 10, 4, 3
  positions = np.stack([np.stack([np.stack([rng.permutation(columns)[:k] for _ in range(rows_)])
                                  for _ in range(terms)]) for _ in range(W)]).astype(np.int32)
  values = dyadic(rng, (W, terms, rows_, k))

  def scatter(positions, values):
    return kernels.scatter_rows_add([(positions[t], values[t]) for t in range(terms)],
                                    (rows_, columns))

  out = fetched(pmapped(scatter, W)(positions, values))
  for d in range(W):
    expected = np.zeros((rows_, columns), np.float32)
    for t in range(terms):
      for r in range(rows_):
        expected[r, positions[d, t, r]] += values[d, t, r]
    np.testing.assert_array_equal(out[d], expected)


# ------------------------------------------------------------------------------ the layout


def test_keeps_leaves_only_where_another_mesh_axis_is_left_to_the_partitioner():
  seen = []

  def record(x):
    seen.append(kernels.keeps_leaves())
    return x

  jax.block_until_ready(pmapped(record, W)(np.zeros(W, np.float32)))
  flat = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,), devices=jax.devices()[:W])
  jax.block_until_ready(jax.jit(jax.shard_map(record, mesh=flat, in_specs=P("batch"),
                                              out_specs=P("batch")))(np.zeros(W, np.float32)))
  grid = jax.make_mesh((W, 2), ("batch", "model"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:2 * W])
  jax.block_until_ready(jax.jit(jax.shard_map(record, mesh=grid, in_specs=P("batch"),
                                              out_specs=P("batch"), axis_names={"batch"}))(
      np.zeros(W, np.float32)))
  assert seen == [False, False, True]
