"""``jaxcomp.data_parallel``: the jit-first step equals the pmap one, keeps pmap's state layout (0-d
per-device leaves included), sends only the compressor's collectives, works on Explicit and Auto
meshes and on a 2-D mesh, takes an ``optax.MultiSteps``, and refuses what would make replicas drift
(or, once the compressor adapter detects it, a gradient averaged twice). The loss form with a Flax
NNX model is tested in test_nnx.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp import hooks
from helpers import replicate, rounding_tol
from training import pmap_step, run

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

W = 8
TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def init_params():
  rng = np.random.default_rng(0)
  return {"w1": rng.normal(size=(6, 8)).astype(np.float32),
          "w2": rng.normal(size=(8, 3)).astype(np.float32),
          "scale": np.float32(1.5)}  # a 0-d parameter: PowerSGD keeps a 0-d error for it


def loss_fn(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] * params["scale"] - y) ** 2)


def batches(n=3, rows=16, seed=1):
  rng = np.random.default_rng(seed)
  return [(rng.normal(size=(rows, 6)).astype(np.float32),
           rng.normal(size=(rows, 3)).astype(np.float32)) for _ in range(n)]


def powersgd_tx(axis_name="batch"):
  return optax.chain(jaxcomp.powersgd(1, axis_name=axis_name, start_iter=0,
                                      min_compression_rate=1.0), optax.sgd(0.1, momentum=0.9))


def mesh_1d(kind, n=W, name="batch"):
  return jax.make_mesh((n,), (name,), axis_types=(TYPES[kind],), devices=jax.devices()[:n])


def pmap_run(tx, data, n=W, axis_name="batch"):
  """The reference: the same training under pmap (``training.run``), state stacked over devices.
  Returns device 0's parameters and every device's state."""
  params, opt_state, _ = run(
      pmap_step(loss_fn, tx, n, returns=None, axis_name=axis_name), replicate(init_params(), n),
      replicate(tx.init(init_params()), n), len(data), n_devices=n,
      batch=lambda t, n: (data[t][0].reshape(n, -1, 6), data[t][1].reshape(n, -1, 3)))
  return jax.tree.map(lambda a: a[0], params), opt_state


def dp_run(dp, data, params=None):
  params = init_params() if params is None else params
  opt_state = dp.make_state(params)
  for batch in data:
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard(batch))
    jax.block_until_ready(loss)
  return params, opt_state, loss


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_loss_form_matches_pmap_and_stores_per_device_state_as_pmap_does(kind):
  data = batches()
  dp = jaxcomp.data_parallel(loss_fn, mesh_1d(kind), tx=powersgd_tx())
  params, opt_state, loss = dp_run(dp, data)
  ref_params, ref_state = pmap_run(powersgd_tx(), data)
  chex.assert_trees_all_close(params, ref_params, rtol=2e-6, atol=1e-6)
  # The error feedback is per device, stacked along a leading axis of W exactly as under pmap,
  # the 0-d parameter's error (its group, the first: scale, w1, w2) included; Q is replicated.
  assert opt_state[0].error[0].shape == (W, 1, 1, 1)
  assert opt_state[0].error[0].sharding.spec[0] == "batch"
  chex.assert_trees_all_close(opt_state[0].error, ref_state[0].error, rtol=2e-6, atol=1e-6)
  chex.assert_trees_all_close(opt_state[0].q[1], ref_state[0].q[1][0], rtol=2e-6, atol=1e-6)
  assert loss.shape == (W,) and loss.sharding.spec == P("batch")  # one loss per device


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_comm_report_shows_only_the_compressed_collectives(kind):
  mesh = mesh_1d(kind)
  params = init_params()
  n = sum(np.size(x) for x in jax.tree.leaves(params))
  x, y = batches(1)[0]

  def report(tx):
    dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
    return jaxcomp.comm_report(dp.step, params, dp.make_state(params), *dp.shard((x, y)))

  # fp16: one float16 all-reduce of the whole gradient (on XLA:CPU one all-to-all and one
  # all-gather of a buffer of all leaves), nothing else (no hidden float32 all-reduce, no loss
  # all-reduce: the losses come back per device).
  fp16 = report(optax.chain(jaxcomp.fp16_compress(), optax.sgd(0.1)))
  assert [(c.op, c.dtypes) for c in fp16.collectives] == [("all-reduce", ("f16",))]
  assert fp16.bytes_by_dtype() == {"f16": 2 * n}
  # PowerSGD: the P and Q factors (its finiteness flag read from their sums: no flag of its own);
  # the dense gradient would be 4·n bytes.
  psgd = report(powersgd_tx())
  assert {c.op for c in psgd.collectives} == {"all-reduce"}
  assert set(psgd.bytes_by_dtype()) == {"f32"}
  assert psgd.payload_bytes < 4 * n // 2


def test_step_form_is_the_loss_form_written_out():
  data = batches()
  tx = powersgd_tx()

  def train_step(state, x, y):  # as for pmap, with the gradient of a per-device copy
    params, opt_state = state
    grads = jax.grad(loss_fn)(lax.pcast(params, "batch", to="varying"), x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  dp = jaxcomp.data_parallel(train_step, mesh_1d("explicit"))
  state = dp.make_state((init_params(), tx.init(init_params())))
  for batch in data:
    state, _ = dp.step(state, *dp.shard(batch))
    jax.block_until_ready(state)
  ref_params, ref_state = pmap_run(tx, data)
  chex.assert_trees_all_close(state[0], ref_params, rtol=2e-6, atol=1e-6)
  chex.assert_trees_all_close(state[1][0].error, ref_state[0].error, rtol=2e-6, atol=1e-6)
  specs = jaxcomp.state_partition_specs(state)
  assert specs[1][0].error[1] == P("batch") and specs[0]["w1"] == P()
  assert jax.tree.leaves(dp.shardings(state))[0].spec == P()


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_2d_mesh_compresses_over_data_and_leaves_model_to_the_partitioner(kind):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(TYPES[kind],) * 2)
  shard = {"w1": P(None, "model"), "w2": P("model", None), "scale": P()}
  params = {k: jax.device_put(v, NamedSharding(mesh, shard[k])) for k, v in init_params().items()}
  data = batches()
  dp = jaxcomp.data_parallel(loss_fn, mesh, axis_name="data", tx=powersgd_tx("data"))
  out, opt_state, _ = dp_run(dp, data, params)
  ref_params, _ = pmap_run(powersgd_tx("data"), data, n=4, axis_name="data")
  chex.assert_trees_all_close(out, ref_params, rtol=1e-5, atol=1e-5)
  assert out["w1"].sharding.spec == P(None, "model")  # the parameters keep their sharding
  report = jaxcomp.comm_report(dp.step, out, opt_state, *dp.shard(data[0]))
  over_data = [c for c in report.collectives if c.group_size == 4]
  dense = 4 * sum(np.size(x) for x in jax.tree.leaves(init_params()))
  assert over_data and sum(c.payload_bytes for c in over_data) < dense // 2


def test_set_mesh_context_and_host_params_work():
  mesh = mesh_1d("explicit")
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=optax.chain(jaxcomp.allreduce(), optax.sgd(0.1)))
  with jax.set_mesh(mesh):
    params, _, loss = dp_run(dp, batches(1))
  assert np.isfinite(np.asarray(loss)).all() and params["w1"].shape == (6, 8)


def test_an_unaveraged_parameter_is_refused_naming_it():
  dp = jaxcomp.data_parallel(loss_fn, mesh_1d("auto"),
                             tx=optax.chain(jaxcomp.comm_hook(hooks.noop_hook), optax.sgd(0.1)))
  with pytest.raises(ValueError, match=r"params\['scale'\] differs from device to device"):
    dp_run(dp, batches(1))


def error_feedback_sign_hook(state, bucket):
  """A user hook with per-device error feedback in a plain dict: 1-bit signs times the mean size."""
  corrected = bucket.buffer + state["error"]
  sent = jnp.sign(corrected) * jnp.mean(jnp.abs(corrected))
  mean = jaxcomp.axis.psum(sent, bucket.axis_name) / jaxcomp.axis.axis_size(bucket.axis_name)
  return mean, {"error": corrected - sent}


def test_a_user_hook_state_is_declared_per_device_with_PerDevice():
  undeclared = jaxcomp.comm_hook(error_feedback_sign_hook,
                                 lambda bucket: {"error": jnp.zeros_like(bucket.buffer)})
  dp = jaxcomp.data_parallel(loss_fn, mesh_1d("auto"), tx=optax.chain(undeclared, optax.sgd(0.1)))
  with pytest.raises(ValueError, match=r"opt_state\[0\]\.hook_states\[0\]\['error'\] differs"):
    dp_run(dp, batches(1))

  def declared():
    return optax.chain(jaxcomp.comm_hook(
        error_feedback_sign_hook,
        lambda bucket: jaxcomp.PerDevice({"error": jnp.zeros_like(bucket.buffer)})),
        optax.sgd(0.1))

  specs = jaxcomp.state_partition_specs(declared(), init_params())
  assert specs[0].hook_states[0].tree["error"] == P("batch")
  data = batches()
  params, opt_state, _ = dp_run(jaxcomp.data_parallel(loss_fn, mesh_1d("auto"), tx=declared()),
                                data)
  ref_params, ref_state = pmap_run(declared(), data)
  chex.assert_trees_all_close(params, ref_params, rtol=2e-6, atol=1e-6)
  chex.assert_trees_all_close(opt_state[0].hook_states[0].tree,
                              ref_state[0].hook_states[0].tree, rtol=2e-6, atol=1e-6)


def test_bad_states_batches_and_arguments_are_named():
  mesh = mesh_1d("auto")
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=powersgd_tx())
  x, y = batches(1)[0]
  unstacked = powersgd_tx().init(init_params())
  with pytest.raises(ValueError, match=r"opt_state\[0\]\.error\[0\] is per device and must "
                                       r"be stacked along a leading axis of 8.*make_state"):
    dp.step(init_params(), unstacked, x, y)
  with pytest.raises(ValueError, match=r"batch\[0\].*multiple of 8; got shape \[12, 6\]"):
    dp.step(init_params(), dp.make_state(init_params()), x[:12], y[:12])
  with pytest.raises(ValueError, match="axis_name must name axes of the mesh"):
    jaxcomp.data_parallel(loss_fn, mesh, axis_name="data", tx=powersgd_tx())
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    jaxcomp.data_parallel(loss_fn, "mesh", tx=powersgd_tx())
  with pytest.raises(ValueError, match="has_aux applies to a loss function"):
    jaxcomp.data_parallel(loss_fn, mesh, has_aux=True)
  # The transformation's axis must be the mesh axis the step maps: strict axes name both.
  dp = jaxcomp.data_parallel(loss_fn, mesh_1d("auto", name="data"), axis_name="data",
                             tx=powersgd_tx("batch"))
  with pytest.raises(jaxcomp.UnboundAxisError, match="'batch' is not bound.*'data'"):
    dp_run(dp, batches(1))


def test_has_aux_returns_per_device_aux():
  def loss_with_aux(params, x, y):
    return loss_fn(params, x, y), {"rows": jnp.asarray(x.shape[0], jnp.float32)}

  dp = jaxcomp.data_parallel(loss_with_aux, mesh_1d("explicit"), has_aux=True,
                             tx=optax.chain(jaxcomp.allreduce(), optax.sgd(0.1)))
  params = init_params()
  _, _, (loss, aux) = dp.step(params, dp.make_state(params), *dp.shard(batches(1)[0]))
  assert loss.shape == (W,)
  np.testing.assert_array_equal(aux["rows"], np.full(W, 2.0))


def test_skip_if_nonfinite_and_accumulate_run_under_data_parallel():
  tx = jaxcomp.skip_if_nonfinite(jaxcomp.accumulate(powersgd_tx(), every_k=2), 3)
  dp = jaxcomp.data_parallel(loss_fn, mesh_1d("explicit"), tx=tx)
  params = init_params()
  opt_state = dp.make_state(params)
  assert opt_state.inner_state.acc[0].shape == (W,)  # the 0-d parameter's accumulator, per device
  (x, y), = batches(1)
  x_bad = x.copy()
  x_bad[3, 0] = np.nan  # one device's shard
  params, opt_state, _ = dp.step(params, opt_state, *dp.shard((x, y)))
  skipped, skipped_state, _ = dp.step(params, opt_state, *dp.shard((x_bad, y)))
  chex.assert_trees_all_equal(skipped, params)  # every device skipped together
  assert int(skipped_state.notfinite_count) == 1
  chex.assert_trees_all_equal(skipped_state.inner_state, opt_state.inner_state)


def test_an_optax_multi_steps_object_is_accepted_as_tx():
  # optax.MultiSteps is a class with init and update, not a GradientTransformation.
  make = lambda: optax.MultiSteps(optax.chain(jaxcomp.allreduce(), optax.sgd(0.1)), 2)
  data = batches(2)
  dp = jaxcomp.data_parallel(loss_fn, mesh_1d("auto"), tx=make())
  with pytest.warns(UserWarning, match="optax.MultiSteps runs jaxcomp\."):
    params, opt_state, _ = dp_run(dp, data)
  assert opt_state.acc_grads["w1"].shape == (W, 6, 8)  # each device's own sum, stacked
  ref_params, _ = pmap_run(make().gradient_transformation(), data)
  chex.assert_trees_all_close(params, ref_params, **rounding_tol(2 * W))
  assert not np.allclose(params["w1"], init_params()["w1"])  # the second micro-step applied


def test_a_step_taking_the_gradient_of_the_replicated_parameters_is_refused():
  # Written as for pmap, without lax.pcast: under check_vma the gradient of the replicated
  # parameters is already summed over the devices (autodiff's transpose of their implicit pvary is
  # a float32 psum), so allreduce would average a sum and the update would be W times too large.
  tx = optax.chain(jaxcomp.allreduce(), optax.sgd(0.1))

  def train_step(state, x, y):
    params, opt_state = state
    grads = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  dp = jaxcomp.data_parallel(train_step, mesh_1d("auto", n=4))
  state = dp.make_state((init_params(), tx.init(init_params())))
  with pytest.raises(ValueError, match="pcast"):
    jax.block_until_ready(dp.step(state, *dp.shard(batches(1)[0])))
