"""Strict axes: inside a mapped context (pmap, vmap with an axis name, shard_map) that does not bind
a transformation's axis, every compressor raises ``UnboundAxisError`` naming the missing axis and
the bound ones — averaging over nothing there would let the replicas drift. (World size 1 where no
axis is bound at all, with a warning on every new trace: tests/test_dense.py,
tests/test_bad_input.py.)

A float16 sum over devices (``axis.psum``, which every mean goes through) runs on XLA:CPU as an
all-to-all, a sum in device order and an all-gather (``axis.sum_in_rows``): bit-identical to the
float16 all-reduce under pmap, shard_map and ``jaxcomp.data_parallel``, the all-reduce itself where
it would not pay (vmap, a mesh axis left to the partitioner) and on every other backend."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

import jaxcomp
from jaxcomp._src import axis
from compressors import ALGORITHMS, optimizer
from helpers import replicate

W = 4
MESSAGE = r"axis_name 'batch' is not bound here; the bound axes are 'data'.*axis_name='data'"


def setup(name):
  """The entry's whole optimizer on the default axis, "batch"; gradients, and its state and
  parameters replicated (the parameters: local SGD and DiLoCo need them)."""
  tx = optimizer(name, optax.sgd(0.1))
  rng = np.random.default_rng(0)
  grads = {"w": rng.normal(size=(W, 6, 5)).astype(np.float32),
           "b": rng.normal(size=(W, 5)).astype(np.float32)}
  params = jax.tree.map(lambda g: g[0], grads)
  return tx, grads, replicate((tx.init(params), params), W)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_pmap_over_another_axis_raises_naming_both(name):
  tx, grads, state = setup(name)
  step = jax.pmap(lambda g, s: tx.update(g, *s), axis_name="data", devices=jax.devices()[:W])
  with pytest.raises(jaxcomp.UnboundAxisError, match=MESSAGE):
    step(grads, state)


@pytest.mark.parametrize("make", [
    lambda: jaxcomp.sharded_optimizer(jaxcomp.allreduce(), optax.adam(1e-3)),
    lambda: jaxcomp.allreduce()])
def test_pmap_without_an_axis_name_says_which_to_pass(make):
  # jax.pmap(f) maps over an axis JAX names itself ('_internal_pmap_axis_name'): not a fix to offer.
  tx = make()
  params = {"w": np.ones((W, 3, 8), np.float32)}
  with pytest.raises(jaxcomp.UnboundAxisError, match=r"the mapped function was given no axis name "
                                                     r".*jax.pmap\(f, axis_name='batch'\)"):
    jax.pmap(lambda p: tx.update(p, tx.init(p), p), devices=jax.devices()[:W])(params)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_vmap_with_an_axis_name_raises_naming_both(name):
  tx, grads, state = setup(name)
  with pytest.raises(jaxcomp.UnboundAxisError, match=MESSAGE):
    jax.vmap(lambda g, s: tx.update(g, *s), axis_name="data")(grads, state)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_shard_map_over_another_axis_raises_naming_both(name):
  tx, grads, state = setup(name)
  mesh = jax.make_mesh((W,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:W])

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
  def step(g, s):
    local = lambda tree: jax.tree.map(lambda x: x[0], tree)
    return tx.update(local(g), *local(s))[0]

  with pytest.raises(jaxcomp.UnboundAxisError, match=MESSAGE):
    jax.jit(step)(grads, state)


# ------------------------------------------------------------------- float16 sums over devices

W16 = 8


def float16_values(rng, shape):
  """float16 values spread over six decades, whose sum depends on the order it is taken in."""
  return (rng.normal(size=shape) * 10.0 ** rng.uniform(-3, 3, size=shape)).astype(np.float16)


def native_sum(x):
  """The reference: XLA:CPU's float16 all-reduce of ``x`` (W16, ...) under pmap, as lax.psum."""
  return np.asarray(jax.pmap(lambda v: lax.psum(v, "batch"), axis_name="batch",
                             devices=jax.devices()[:W16])(x))[0]


def pmap_psum(x):
  step = jax.pmap(lambda v: axis.psum(v, "batch"), axis_name="batch", devices=jax.devices()[:W16])
  return step, np.asarray(step(x))


def test_float16_order_matters_in_these_values():
  """Not vacuous: summed in float32 and rounded once, the values below give other bits."""
  x = float16_values(np.random.default_rng(0), (W16, 1001))
  once = x.astype(np.float32).sum(0).astype(np.float16)
  assert (once != native_sum(x)).any()


@pytest.mark.parametrize("shape", [(1,), (5,), (8,), (1001,), (3, 7), (2, 3, 4)])
def test_float16_psum_under_pmap_is_the_all_reduce_bit_for_bit_run_as_all_to_all(shape):
  x = float16_values(np.random.default_rng(1), (W16,) + shape)
  step, out = pmap_psum(x)
  np.testing.assert_array_equal(out[0], native_sum(x))
  assert (out == out[:1]).all()  # the same on every device
  c, = jaxcomp.comm_report(step, x).collectives
  assert (c.op, c.runs_as, c.dtypes, c.shapes, c.payload_bytes) == (
      "all-reduce", ("all-to-all", "all-gather"), ("f16",), (shape,), 2 * x[0].size)


@pytest.mark.parametrize("shape", [(W16, 1), (W16, 37), (W16, 3, 5)])
def test_float16_psum_scatter_is_the_reduce_scatter_bit_for_bit_run_as_an_all_to_all(shape):
  """``axis.psum_scatter`` (the sharded optimizer's reduce-scatter): ``sum_in_rows``' first half."""
  x = float16_values(np.random.default_rng(6), (W16,) + shape)
  step = jax.pmap(lambda v: axis.psum_scatter(v, "batch"), axis_name="batch",
                  devices=jax.devices()[:W16])
  reference = jax.pmap(lambda v: lax.psum_scatter(v, "batch", scatter_dimension=0, tiled=False),
                       axis_name="batch", devices=jax.devices()[:W16])
  np.testing.assert_array_equal(np.asarray(step(x)), np.asarray(reference(x)))
  c, = jaxcomp.comm_report(step, x).collectives
  assert (c.op, c.runs_as, c.shapes, c.payload_bytes) == (
      "reduce-scatter", ("all-to-all",), (shape[1:],), 2 * x[0].size)


@pytest.mark.parametrize("check_vma", [True, False])
def test_float16_psum_under_shard_map_on_a_permuted_mesh_is_the_all_reduce(check_vma):
  x = float16_values(np.random.default_rng(2), (W16, 37))
  devices = np.array(jax.devices()[:W16])[[3, 0, 7, 5, 1, 6, 2, 4]]
  mesh = jax.sharding.Mesh(devices, ("batch",), axis_types=(AxisType.Explicit,))
  f = jax.jit(jax.shard_map(lambda v: axis.psum(v[0], "batch")[None], mesh=mesh,
                            in_specs=P("batch"), out_specs=P(), check_vma=check_vma))
  x_on_mesh = jax.device_put(x, jax.NamedSharding(mesh, P("batch")))
  reference = jax.jit(jax.shard_map(lambda v: lax.psum(v[0], "batch")[None], mesh=mesh,
                                    in_specs=P("batch"), out_specs=P(), check_vma=check_vma))
  np.testing.assert_array_equal(np.asarray(f(x_on_mesh)), np.asarray(reference(x_on_mesh)))
  np.testing.assert_array_equal(np.asarray(f(x_on_mesh))[0], native_sum(x))  # the axis' order
  assert [c.runs_as for c in jaxcomp.comm_report(f, x_on_mesh).collectives] == [
      ("all-to-all", "all-gather")]


def test_float16_psum_over_a_tuple_of_axes_and_over_one_axis_of_a_manual_2d_mesh():
  x = float16_values(np.random.default_rng(3), (2, 4, 13))
  mesh = jax.make_mesh((2, 4), ("model", "data"), axis_types=(AxisType.Explicit,) * 2)
  x_on_mesh = jax.device_put(x, jax.NamedSharding(mesh, P("model", "data")))
  for names in [("model", "data"), "data"]:
    def run(total):
      return jax.jit(jax.shard_map(lambda v: total(v[0, 0], names)[None, None], mesh=mesh,
                                   in_specs=P("model", "data"), out_specs=P("model", "data"),
                                   check_vma=True))
    f, reference = run(axis.psum), run(lax.psum)
    np.testing.assert_array_equal(np.asarray(f(x_on_mesh)), np.asarray(reference(x_on_mesh)))
    assert [c.runs_as for c in jaxcomp.comm_report(f, x_on_mesh).collectives] == [
        ("all-to-all", "all-gather")]


def test_float16_means_of_several_leaves_and_dtypes_under_data_parallel_are_the_all_reduce():
  """fp16_compress through ``jaxcomp.data_parallel`` (shard_map, check_vma=True): the gradient of
  sum(w·x) is x, so sgd(1) from zero parameters gives minus the mean, against a native psum."""
  rng = np.random.default_rng(4)
  shapes = {"w": (5,), "b": (3,), "k": (33, 7), "h": (9,)}
  dtypes = {"w": np.float32, "b": np.float32, "k": np.float32, "h": np.float16}
  xs = {k: (rng.normal(size=(W16,) + s) * 10.0 ** rng.uniform(-3, 3, size=(W16,) + s)).astype(
      dtypes[k]) for k, s in shapes.items()}
  params = {k: np.zeros(s, dtypes[k]) for k, s in shapes.items()}

  def loss(p, x):
    return sum(jnp.sum(p[k].astype(jnp.float32) * x[k][0].astype(jnp.float32)) for k in p)

  mesh = jax.make_mesh((W16,), ("batch",), axis_types=(AxisType.Explicit,))
  dp = jaxcomp.data_parallel(loss, mesh, tx=optax.chain(jaxcomp.fp16_compress(), optax.sgd(1.0)))
  batch = dp.shard((xs,))
  new, _, _ = dp.step(params, dp.make_state(params), *batch)
  for k, x in xs.items():
    wire = (x.astype(np.float16) / np.float16(W16)).astype(np.float16)
    np.testing.assert_array_equal(np.asarray(new[k]), -native_sum(wire).astype(dtypes[k]))
  report = jaxcomp.comm_report(dp.step, params, dp.make_state(params), *batch)
  # One message for all leaves, as XLA's combined all-reduce was (it does not combine all-to-alls).
  summed = [c for c in report.collectives if c.dtypes == ("f16",)]
  assert [c.shapes for c in summed] == [((sum(int(np.prod(s)) for s in shapes.values()),),)]
  assert summed[0].runs_as == ("all-to-all", "all-gather")


def test_vmap_an_invariant_value_and_a_mesh_axis_left_to_the_partitioner_keep_the_psum():
  x = float16_values(np.random.default_rng(5), (W16, 11))
  jaxpr = str(jax.make_jaxpr(jax.vmap(lambda v: axis.psum(v, "batch"), axis_name="batch"))(x))
  assert "all_to_all" not in jaxpr and "psum" in jaxpr
  # Typed invariant under check_vma (the same on every device): psum sends nothing, it scales.
  mesh = jax.make_mesh((W16,), ("batch",), axis_types=(AxisType.Explicit,))
  invariant = jax.jit(jax.shard_map(lambda v: axis.psum(v, "batch"), mesh=mesh, in_specs=P(),
                                    out_specs=P()))
  assert "all-to-all" not in invariant.lower(x[0]).as_text()
  np.testing.assert_array_equal(np.asarray(invariant(x[0])), np.asarray(jax.jit(jax.shard_map(
      lambda v: lax.psum(v, "batch"), mesh=mesh, in_specs=P(), out_specs=P()))(x[0])))
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  f = jax.jit(jax.shard_map(lambda v: axis.psum(v[0], "data")[None], mesh=mesh,
                            in_specs=P("data"), out_specs=P(), axis_names={"data"},
                            check_vma=False))
  report = jaxcomp.comm_report(f, x[:4])
  assert [(c.op, c.runs_as) for c in report.collectives] == [("all-reduce", ())]


@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
@pytest.mark.parametrize("op, total, out_spec", [("all-reduce", axis.psum, P()),
                                                 ("reduce-scatter", axis.psum_scatter, P("batch"))])
def test_other_backends_get_the_float16_collective_itself(platform, op, total, out_spec):
  """The choice is made when the step is lowered, for the backend it is lowered for: lowered for a
  GPU or a TPU (no such device needed), the same trace holds the collective alone."""
  mesh = jax.make_mesh((W16,), ("batch",), axis_types=(AxisType.Explicit,))
  f = jax.jit(jax.shard_map(lambda v: total(v[0], "batch")[None], mesh=mesh,
                            in_specs=P("batch"), out_specs=out_spec))
  x = jax.ShapeDtypeStruct((W16, W16, 125), jnp.float16,
                           sharding=jax.NamedSharding(mesh, P("batch")))
  for target in ("cpu", platform):
    text = f.trace(x).lower(lowering_platforms=(target,)).as_text(dialect="hlo", debug_info=True)
    report = jaxcomp._src.report.parse_hlo(text, W16)
    assert [(c.op, bool(c.runs_as)) for c in report.collectives] == [(op, target == "cpu")]
    assert ("all-to-all" in text) == (target == "cpu")
    assert report.bytes_by_dtype() == {"f16": 2 * W16 * 125}
