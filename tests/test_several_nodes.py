"""Several nodes on 8 simulated devices, as ``("replica", "data")`` meshes of (2, 4) and (4, 2): the
low-communication optimizers over ``"replica"`` with exact data parallelism inside a node against
one device per replica, and fully sharded inside a node against exact inside; the hierarchical
mean (exact inside, a compressor between nodes) and its bytes per axis; the compositions jaxcomp
refuses. Two processes: test_several_nodes_processes.py.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import jaxcomp
import nodes_harness as harness
from helpers import assert_identical_across_devices, rounding_tol

MESHES = [(2, 4), (4, 2)]
# SparseLoCo's and Streaming DiLoCo's programs take 5-20 s to compile each: the slow tier's.
ALGORITHMS = ["diloco", pytest.param("sparseloco", marks=pytest.mark.slow),
              pytest.param("streaming_diloco", marks=pytest.mark.slow)]


@pytest.mark.numeric
@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("name", ALGORITHMS)
def test_exact_inside_a_node_equals_one_device_per_replica_on_its_averaged_gradient(name, shape):
  steps = 7  # two or three synchronizations
  got = harness.exact_inside(name, harness.node_mesh(shape), steps)
  want = harness.reference(name, shape[0], steps)
  for t, (params, expected) in enumerate(zip(got, want)):
    chex.assert_trees_all_close(jax.tree.map(np.asarray, params), expected,
                                **rounding_tol(64 * (t + 1)))
  # DiLoCo's replicas hold the same parameters right after a synchronization (step 3, 6).
  if name == "diloco":
    assert_identical_across_devices(jax.tree.map(np.asarray, got[5]))


@pytest.mark.numeric
@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("name", ["diloco", pytest.param("streaming_diloco",
                                                        marks=pytest.mark.slow)])
def test_fully_sharded_inside_a_node_equals_exact_inside_to_rounding(name, shape):
  steps = 7
  fs, states = harness.fully_sharded_inside(name, harness.fsdp_mesh(shape), steps)
  want = harness.exact_inside(name, harness.node_mesh(shape), steps)
  replicas, per_node = shape
  cut = fs._layout()  # how the shards of a leaf join
  for t, (state, expected) in enumerate(zip(states, want)):
    for (path, shards), whole in zip(jax.tree_util.tree_leaves_with_path(state.params),
                                     jax.tree.leaves(expected)):
      rows = np.asarray(shards).reshape((replicas, per_node) + shards.shape[1:])
      for r in range(replicas):
        np.testing.assert_allclose(cut.join(rows[r], whole.shape[1:]), np.asarray(whole)[r],
                                   **rounding_tol(64 * (t + 1)), err_msg=f"{t} {path} {r}")
  chex.assert_trees_all_close(fs.gather_params(states[-1]),
                              jax.tree.map(lambda x: np.asarray(x)[0], want[-1]),
                              **rounding_tol(64 * steps))
  # The outer state is sharded as the parameters are: θ is each device's shards.
  theta = states[-1].inner.outer_params
  assert [x.shape for x in jax.tree.leaves(theta)] == [
      x.shape for x in jax.tree.leaves(states[-1].params)]


@pytest.mark.slow  # SparseLoCo's program takes 20 s to compile
def test_sparseloco_fully_sharded_inside_selects_from_each_devices_shards_and_stays_in_sync():
  # Its chunks are cut from each device's shards, so its selection is not the unsharded one; the
  # replicas hold the same shards right after every synchronization (steps 3 and 6).
  fs, states = harness.fully_sharded_inside("sparseloco", harness.fsdp_mesh((2, 4)), 6)
  for t in (2, 5):
    for shards in jax.tree.leaves(states[t].params):
      rows = np.asarray(shards).reshape((2, 4) + shards.shape[1:])
      np.testing.assert_array_equal(rows[0], rows[1])
  losses = [float(harness.loss_fn(fs.gather_params(s), *harness.batch(0))) for s in states]
  assert losses[-1] < losses[0]


def test_fully_sharded_inside_sends_a_node_share_of_the_pseudo_gradient_across_replica():
  shape = (2, 4)
  fs, (state,) = harness.fully_sharded_inside("diloco", harness.fsdp_mesh(shape), 1)
  compiled = fs.step.lower(state, *fs.shard(harness.batch(0))).compile()
  report = jaxcomp.comm_report(compiled, num_devices=8).by_axes(fs.mesh)
  numel = sum(x.size for x in jax.tree.leaves(harness.init_params()))
  sync = report[("replica",)].phase("diloco.sync")
  assert [c.op for c in sync.collectives] == ["all-reduce"]
  assert sync.payload_bytes == 4 * numel / shape[1]  # every leaf splits evenly over 4


@pytest.mark.numeric
@pytest.mark.parametrize("shape", MESHES)
def test_diloco_through_the_hierarchical_mean_equals_exact_inside_for_a_node_share_of_the_bytes(
    shape):
  steps, mesh = 7, harness.node_mesh(shape)
  dp = harness.through_the_hierarchical_mean(mesh)
  got, want = harness.run(dp, mesh, steps), harness.exact_inside("diloco", mesh, steps)
  replicas, per_node = shape
  for t, (params, expected) in enumerate(zip(got, want)):
    for device in range(per_node):  # every device of a node holds its replica's parameters
      chex.assert_trees_all_close(
          jax.tree.map(lambda x: np.asarray(x).reshape((replicas, per_node) + x.shape[1:])[
              :, device], params), jax.tree.map(np.asarray, expected),
          **rounding_tol(64 * (t + 1)))
  params = harness.init_params()
  report = jaxcomp.comm_report(dp.step, dp.make_params(params), dp.make_state(params),
                               *dp.shard(harness.batch(0))).by_axes(mesh)
  numel = sum(x.size for x in jax.tree.leaves(params))
  sync = report[("replica",)].phase("diloco.sync")
  assert sync.payload_bytes == 4 * numel / per_node  # not the whole pseudo-gradient per device


def _mean_step(exchange, mesh):
  """The update of one SGD(1) step through ``exchange`` over both axes, and its report by axes."""
  tx = optax.chain(exchange, optax.sgd(1.0))
  dp = jaxcomp.data_parallel(harness.loss_fn, mesh, axis_name=("replica", "data"), tx=tx)
  params = harness.init_params()
  state = dp.make_state(params)
  x = dp.shard(harness.batch(0))
  new, _, _ = dp.step(params, state, *x)
  report = jaxcomp.comm_report(dp.step, params, state, *x).by_axes(mesh)
  return jax.tree.map(lambda p, q: np.asarray(p) - np.asarray(q), params, new), report


def _wide_mesh_params():
  """Parameters whose leaves split evenly into int8 blocks of 256 on every device."""
  rng = np.random.default_rng(1)
  return {"w": rng.normal(size=(8, 1024)).astype(np.float32)}


@pytest.mark.parametrize("shape", MESHES)
def test_hierarchical_int8_sends_a_node_share_of_the_flat_int8_bytes_across_replica(shape):
  mesh, per_node = harness.node_mesh(shape), shape[1]
  loss = lambda p, x, y: jnp.mean((x @ p["w"][:, :4] - y) ** 2 + jnp.sum(p["w"] ** 2))
  reports, updates = {}, {}
  for kind, exchange in [("flat", jaxcomp.quantized(8, axis_name=("replica", "data"))),
                         ("hierarchical",
                          jaxcomp.hierarchical(jaxcomp.quantized(8, axis_name="replica"))),
                         ("exact", jaxcomp.allreduce(axis_name=("replica", "data")))]:
    dp = jaxcomp.data_parallel(loss, mesh, axis_name=("replica", "data"),
                               tx=optax.chain(exchange, optax.sgd(1.0)))
    params = _wide_mesh_params()
    state, x = dp.make_state(params), dp.shard(harness.batch(0))
    new, _, _ = dp.step(params, state, *x)
    updates[kind] = np.asarray(params["w"]) - np.asarray(new["w"])
    reports[kind] = jaxcomp.comm_report(dp.step, params, state, *x).by_axes(mesh)
  # The flat exchange runs over every device: all of it crosses the nodes; the hierarchical one
  # sends its int8 codes and scales over replica alone, the exact mean inside a node.
  flat = reports["flat"][("replica", "data")]
  across = reports["hierarchical"][("replica",)]
  assert set(reports["hierarchical"]) == {("replica",), ("data",)}
  assert across.payload_bytes <= flat.payload_bytes / per_node
  assert across.bytes_by_dtype()["s8"] == flat.bytes_by_dtype()["s8"] / per_node
  assert set(reports["hierarchical"][("data",)].bytes_by_dtype()) == {"f32"}
  # Both are the mean within int8's error: a step of the scale (max / 127) per block, twice.
  scale = np.abs(updates["exact"]).max() / 127
  for kind in ("flat", "hierarchical"):
    assert np.abs(updates[kind] - updates["exact"]).max() <= 2 * scale


@pytest.mark.numeric
@pytest.mark.parametrize("shape, pack", [((2, 4), True), ((4, 2), True), ((2, 4), False)])
def test_hierarchical_exact_mean_is_the_flat_mean_to_rounding(shape, pack):
  mesh = harness.node_mesh(shape)
  flat, _ = _mean_step(jaxcomp.allreduce(axis_name=("replica", "data")), mesh)
  nested, report = _mean_step(
      jaxcomp.hierarchical(jaxcomp.allreduce(axis_name="replica"), pack=pack), mesh)
  chex.assert_trees_all_close(nested, flat, **rounding_tol(8))
  # Across replica each device sends a 1/F share of the gradient: packed, one all-reduce of all
  # of it; leaf by leaf, one per leaf, each padded to a multiple of F.
  numel = sum(x.size for x in jax.tree.leaves(harness.init_params()))
  across = report[("replica",)]
  assert [len(c.shapes) for c in across.collectives] == [1 if pack else 4]
  assert numel / shape[1] <= across.payload_bytes / 4 <= numel / shape[1] + (0 if pack else 16)


@pytest.mark.parametrize("compressor, packed", [(jaxcomp.quantized, True),
                                                 (jaxcomp.powersgd, False)])
def test_by_default_an_elementwise_codec_travels_packed_and_powersgd_keeps_its_matrices(
    compressor, packed):
  settings = {"rank": 1} if compressor is jaxcomp.powersgd else {"bits": 8}
  with jax.set_mesh(harness.node_mesh((2, 4))):
    default, chosen = (jaxcomp.hierarchical(compressor(axis_name="replica", **settings),
                                            pack=pack).init(harness.init_params())
                       for pack in (None, packed))
  shapes = [[x.shape for x in jax.tree.leaves(s.inner)] for s in (default, chosen)]
  assert shapes[0] == shapes[1]


def test_by_axes_reads_groups_by_position_in_the_mesh_not_by_device_id():
  order = [3, 1, 7, 5, 0, 2, 4, 6]
  mesh = Mesh(np.asarray(jax.devices())[order].reshape(2, 4), ("replica", "data"),
              axis_types=(AxisType.Auto,) * 2)
  step = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                               in_specs=P(("replica", "data")), out_specs=P(("replica", "data"))))
  report = jaxcomp.comm_report(step, jnp.ones(8)).by_axes(mesh)
  assert list(report) == [("data",)]


# ------------------------------------------------------------------------------------ refused


def _one_line(error):
  assert "\n" not in str(error.value), str(error.value)
  return str(error.value)


def test_the_exchange_on_the_fast_axis_is_refused():
  mesh = harness.node_mesh((2, 4))
  tx = jaxcomp.diloco(harness.inner(), sync_every=3, axis_name="data")
  with pytest.raises(ValueError, match="but not 'replica', the axis between nodes") as error:
    jaxcomp.data_parallel(harness.loss_fn, mesh, axis_name="data", tx=tx)
  assert "axis_name=('replica', 'data')" in _one_line(error)
  with pytest.raises(ValueError, match="synchronizes over 'data', the fast axis") as error:
    jaxcomp.data_parallel(harness.loss_fn, mesh, axis_name=("replica", "data"), tx=tx)
  assert "diloco(..., axis_name='replica')" in _one_line(error)


def test_an_inner_optimizer_communicating_over_replica_is_refused():
  mesh = harness.node_mesh((2, 4))
  inner = optax.chain(jaxcomp.allreduce(axis_name="replica"), harness.inner())
  tx = jaxcomp.diloco(inner, sync_every=3, axis_name="replica")
  dp = jaxcomp.data_parallel(harness.loss_fn, mesh, axis_name="replica", tx=tx)
  state, params = dp.make_state(harness.init_params()), dp.make_params(harness.init_params())
  with pytest.raises(ValueError, match="communicates over 'replica' on every local step") as error:
    dp.step(params, state, *dp.shard(harness.batch(0)))
  assert "jaxcomp.allreduce(axis_name='fast')" in _one_line(error)


def test_fully_sharded_over_replica_or_without_an_exchange_over_it_is_refused():
  mesh = harness.fsdp_mesh((2, 4))
  with pytest.raises(ValueError, match="fully_sharded would gather every layer and scatter") as e:
    jaxcomp.fully_sharded(harness.loss_fn, mesh, jaxcomp.allreduce(axis_name="replica"),
                          optax.sgd(0.1), axis_name="replica")
  assert "axis_name='fsdp'" in _one_line(e)
  with pytest.raises(ValueError, match="the mesh has 'replica'.* nothing exchanges over it") as e:
    jaxcomp.fully_sharded(harness.loss_fn, mesh, jaxcomp.allreduce(axis_name="fsdp"),
                          optax.sgd(0.1), axis_name="fsdp")
  assert "jaxcomp.diloco(..., axis_name='replica')" in _one_line(e)
  with pytest.raises(TypeError, match="jaxcomp.diloco is a whole optimizer"):
    jaxcomp.fully_sharded(harness.loss_fn, mesh, jaxcomp.allreduce(axis_name="fsdp"),
                          harness.ALGORITHMS["diloco"]("fsdp"), axis_name="fsdp")
