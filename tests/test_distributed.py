"""DDP's promises besides the hooks, in one process on 8 devices: identical replicas
(check_replicated / broadcast_replicated), buffer sync (sync_buffers), uneven inputs
(all_have_data). The same across two processes: tests/test_distributed_multihost.py."""

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp._src import distributed
from helpers import dyadic

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

N = 8
MESH = Mesh(np.array(jax.devices()[:N]), ("batch",), axis_types=(AxisType.Auto,))
REPLICATED = NamedSharding(MESH, P())


def with_copies(copies):
  """One replicated-looking array whose copy on device d is ``copies[d]`` (a drifted replica)."""
  copies = [np.asarray(c) for c in copies]
  return jax.make_array_from_single_device_arrays(
      copies[0].shape, REPLICATED, [jax.device_put(c, d) for c, d in zip(copies, MESH.devices)])


def copies_of(x):
  return [np.asarray(s.data) for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]


# --- identical start ------------------------------------------------------------------------------


def test_identical_replicas_pass_and_a_drifted_one_is_named_with_its_device():
  good = {"a": jax.device_put(jnp.arange(3.0), REPLICATED), "b": np.ones((2, 2), np.float64),
          "c": 7, "d": jax.device_put(jnp.ones(4, jnp.bfloat16), REPLICATED)}
  jaxcomp.check_replicated(good)
  c = np.ones(4, ml_dtypes.bfloat16)
  drifted = [c] * 3 + [c + 1] + [c] * 4
  bad = {**good, "d": with_copies(drifted), "e": with_copies([np.zeros(2)] * 5 + [np.ones(2)] * 3)}
  with pytest.raises(jaxcomp.ReplicaMismatchError,
                     match=r"leaf \['d'\] \(bfloat16\[4\]\) differs between the devices of "
                           r"process 0: its copy on local device 3"):
    jaxcomp.check_replicated(bad)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.int32,
                                   np.bool_, np.uint16])
def test_one_changed_element_anywhere_is_caught(dtype):
  rng = np.random.default_rng(0)
  base = (rng.integers(0, 2, 1001) if dtype == np.bool_
          else rng.integers(-50, 50, 1001)).astype(dtype)
  for position in (0, 500, 1000):
    other = base.copy()
    other[position] = np.logical_not(other[position]) if dtype == np.bool_ else other[position] + 1
    with pytest.raises(jaxcomp.ReplicaMismatchError, match=r"leaf \['w'\]"):
      jaxcomp.check_replicated({"w": with_copies([base] * 7 + [other])})


def test_a_host_value_and_a_device_value_of_the_same_bits_count_as_the_same():
  # Processes may hold a leaf as a NumPy array on one and as a jax.Array on another.
  x = np.random.default_rng(1).normal(size=(3, 5)).astype(np.float32)
  host = distributed._fingerprints([[x]])
  device = distributed._fingerprints([[jax.device_put(x, d) for d in MESH.devices]])
  np.testing.assert_array_equal(host[:, :3], device[:, :3])
  assert host[0, 3] == device[0, 3] == 0xFFFFFFFF


def test_broadcast_gives_every_copy_device_0s_bits_and_keeps_each_leafs_kind():
  special = np.array([-0.0, np.nan, 1e-45, -np.inf, 3.0], np.float32)
  special[1:2].view(np.uint32)[0] = 0x7FC0BEEF  # a NaN with a payload
  drifted = with_copies([special] + [np.full(5, d, np.float32) for d in range(1, N)])
  tree = {"w": drifted, "host": np.arange(3, dtype=np.float64), "n": 4, "flag": True,
          "local": jnp.ones(2, jnp.bfloat16)}
  out = jaxcomp.broadcast_replicated(tree)
  for copy in copies_of(out["w"]):
    np.testing.assert_array_equal(copy.view(np.uint32), special.view(np.uint32))
  assert out["w"].sharding == drifted.sharding
  assert isinstance(out["host"], np.ndarray) and out["host"].dtype == np.float64
  assert out["n"] == 4 and type(out["n"]) is int and out["flag"] is True
  assert out["local"].dtype == jnp.bfloat16 and not out["local"].committed
  jaxcomp.check_replicated(out)


def _accumulating_state():
  """A jaxcomp state after two steps: per-device leaves (accumulator, error feedback) differ."""
  tx = jaxcomp.accumulate(optax.chain(jaxcomp.powersgd(1, start_iter=0), optax.sgd(0.1)), 3)
  params = jax.device_put({"w": jnp.ones((8, 6))}, REPLICATED)
  specs = jaxcomp.state_partition_specs(tx, params, axis_name="batch")
  state = jax.jit(jax.shard_map(tx.init, mesh=MESH, in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=MESH, in_specs=(specs, P("batch")), out_specs=specs)
  def step(state, grads):
    return tx.update({"w": grads[0]}, state, params)[1]

  for i in range(4):
    state = step(state, jnp.asarray(dyadic(np.random.default_rng(i), (N, 8, 6))))
  return params, state


def test_per_device_fields_are_skipped_and_left_as_they_are():
  params, state = _accumulating_state()
  acc = state.acc[0]
  assert len({c.tobytes() for c in copies_of(acc)}) == N  # each device holds its own
  tree = {"params": params, "opt_state": state}
  jaxcomp.check_replicated(tree)
  out = jaxcomp.broadcast_replicated(tree)
  assert out["opt_state"].acc[0] is acc
  assert out["opt_state"].inner_state[0].error[0] is state.inner_state[0].error[0]
  chex.assert_trees_all_equal(out, tree)


def test_a_sharded_leaf_outside_per_device_fields_is_refused_by_name():
  sharded = jax.device_put(jnp.arange(16.0), NamedSharding(MESH, P("batch")))
  with pytest.raises(ValueError, match=r"leaf \['stats'\] is sharded .*PER_DEVICE_FIELDS"):
    jaxcomp.check_replicated({"params": jnp.ones(2), "stats": sharded})
  with pytest.raises(ValueError, match=r"leaf \['stats'\] is sharded"):
    jaxcomp.broadcast_replicated({"stats": sharded})


# --- buffer sync ----------------------------------------------------------------------------------


def stats_tree(rng):
  """Per-device BatchNorm-like statistics (dyadic: means over 8 devices are exact) and a counter."""
  return {"BatchNorm_0": {"mean": dyadic(rng, (N, 5)), "var": dyadic(rng, (N, 5)) ** 2},
          "half": dyadic(rng, (N, 3)).astype(np.float16), "seen": rng.integers(0, 9, (N, 2)),
          "flag": rng.integers(0, 2, (N,)).astype(bool)}


def floats(tree):
  return {k: v for k, v in tree.items() if k in ("BatchNorm_0", "half")}


def test_mean_is_the_mean_over_devices_and_first_is_device_0s_bit_for_bit():
  stats = stats_tree(np.random.default_rng(0))
  mean = jax.pmap(lambda s: jaxcomp.sync_buffers(s, "mean"), axis_name="batch")(floats(stats))
  first = jax.pmap(lambda s: jaxcomp.sync_buffers(s, "first"), axis_name="batch")(stats)
  expected_mean = jax.tree.map(
      lambda x: np.broadcast_to(x.mean(0, dtype=np.float64).astype(x.dtype), x.shape),
      floats(stats))
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, mean), expected_mean)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, first),
                              jax.tree.map(lambda x: np.broadcast_to(x[0], x.shape), stats))


def test_mean_refuses_integer_buffers_by_name():
  stats = stats_tree(np.random.default_rng(0))
  with pytest.raises(TypeError, match=r"leaf \['flag'\] is bool.*policy='first'"):
    jax.pmap(lambda s: jaxcomp.sync_buffers(s, "mean"), axis_name="batch")(stats)


def numpy_every_k(updates, k, steps):
  """Per-device buffers x_d ← x_d + u_d each step; averaged after the step when
  (step+1) % k == 0."""
  x, history = np.zeros_like(updates[0]), []
  for step in range(steps):
    x = x + updates[step]
    if (step + 1) % k == 0:
      x = np.broadcast_to(x.mean(0), x.shape)
    history.append(x)
  return history


def run_every_k(mapping, updates, k, step_offset):
  def step_fn(x, u, step):
    # The step as each device passes it; with an offset per device the decision must still agree.
    step = step + lax.axis_index("batch") * step_offset
    return jaxcomp.sync_buffers({"s": x + u}, "mean", every_k=k, step=step)["s"]

  if mapping == "pmap":
    fn = jax.pmap(step_fn, axis_name="batch", in_axes=(0, 0, None))
  else:  # check_vma=True: the buffers are varying, the synchronised branch must be typed alike
    fn = jax.jit(jax.shard_map(step_fn, mesh=MESH, in_specs=(P("batch"), P("batch"), P()),
                               out_specs=P("batch")))
  x, history = jnp.zeros_like(updates[0]), []
  for step, u in enumerate(updates):
    x = fn(x, u, step)
    history.append(np.asarray(x))  # reading blocks every step
  return history


@pytest.mark.parametrize("mapping", ["pmap", "shard_map"])
def test_every_k_averages_on_the_kth_steps_only_and_matches_numpy(mapping):
  rng = np.random.default_rng(3)
  updates = [dyadic(rng, (N, 4)) for _ in range(7)]
  for got, want in zip(run_every_k(mapping, updates, 3, 0), numpy_every_k(updates, 3, 7)):
    np.testing.assert_array_equal(got, want)


def test_every_k_decides_on_the_largest_step_so_devices_never_disagree():
  # Device d passes step + d: the devices disagree, yet all synchronise together (no deadlock), on
  # the steps where the largest (step + 7) + 1 is a multiple of 3 — steps 1 and 4 of 6.
  rng = np.random.default_rng(4)
  updates = [dyadic(rng, (N, 4)) for _ in range(6)]
  got = run_every_k("pmap", updates, 3, 1)
  x = np.zeros_like(updates[0])
  for step, u in enumerate(updates):
    x = x + u
    if (step + N - 1 + 1) % 3 == 0:
      x = np.broadcast_to(x.mean(0), x.shape)
    np.testing.assert_array_equal(got[step], x)


def test_shard_map_every_step_keeps_the_buffers_replicated():
  stats = floats(stats_tree(np.random.default_rng(5)))
  # check_vma: invariant.
  fn = jax.jit(jax.shard_map(
      lambda s: jaxcomp.sync_buffers(jax.tree.map(lambda x: x[0], s), "first"),
      mesh=MESH, in_specs=P("batch"), out_specs=P()))
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, fn(stats)),
                              jax.tree.map(lambda x: x[0], stats))


def test_nnx_batch_stats_keep_their_structure():
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
  stats = nnx.state(model, nnx.BatchStat)
  per_device = jax.tree.map(lambda x: jnp.stack([x + d for d in range(N)]), stats)
  out = jax.vmap(lambda s: jaxcomp.sync_buffers(s, "mean"), axis_name="batch")(per_device)
  assert jax.tree.structure(out) == jax.tree.structure(per_device)
  assert isinstance(out["layers"][1]["mean"], nnx.BatchStat)
  np.testing.assert_array_equal(out["layers"][1]["mean"][...], np.full((N, 4), 3.5, np.float32))


def test_without_a_bound_axis_the_buffers_are_returned_as_they_are():
  stats = {"mean": jnp.arange(3.0)}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    assert jax.jit(lambda s: jaxcomp.sync_buffers(s, "first"))(stats)["mean"].shape == (3,)
  assert jaxcomp.sync_buffers(stats, "mean", axis_name=None) is stats


@pytest.mark.parametrize("kwargs, error, match", [
    ({"policy": "median"}, ValueError, r"policy must be 'mean' or 'first'; got 'median'"),
    ({"every_k": 0}, ValueError, r"every_k must be a positive int; got 0"),
    ({"every_k": 2}, ValueError, r"step is required with every_k > 1"),
    ({"every_k": jnp.int32(2), "step": 0}, TypeError, r"every_k is static"),
    ({"axis_name": 3}, TypeError, r"axis_name must be"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxcomp.sync_buffers({"mean": jnp.zeros(2)}, **kwargs)


# --- uneven inputs --------------------------------------------------------------------------------


def test_all_have_data_in_one_process_is_the_flag_itself():
  assert jaxcomp.all_have_data(True) is True
  assert jaxcomp.all_have_data(np.bool_(False)) is False
  with pytest.raises(TypeError, match=r"has_data must be a bool; got None"):
    jaxcomp.all_have_data(None)
