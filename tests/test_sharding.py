"""``jaxcomp.state_partition_specs``: per-device leaves sharded, the rest replicated, and a
``shard_map(check_vma=True)`` training step built with them matching the ``pmap`` one."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

import jaxcomp
from helpers import rounding_tol

pytestmark = pytest.mark.numeric
W = 8


def init_params():
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(5, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}


def loss_fn(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def test_dense_state_has_no_per_device_leaves():
  params = init_params()
  tx = optax.chain(jaxcomp.fp16_compress(), optax.sgd(0.1, momentum=0.9))
  specs = jaxcomp.state_partition_specs(tx, params)
  assert not jax.tree.leaves(specs[0])  # the dense state holds no arrays
  assert jax.tree.leaves(specs[1]) == [P(), P()]  # the momentum: computed from the mean


def test_accumulator_is_sharded_and_the_rest_replicated():
  params = init_params()
  tx = jaxcomp.accumulate(optax.chain(jaxcomp.allreduce(), optax.sgd(0.1, momentum=0.9)), 4)
  specs = jaxcomp.state_partition_specs(jax.eval_shape(tx.init, params), axis_name="data")
  assert specs.acc == (P("data"), P("data"))
  assert specs.micro_step == P()
  assert jax.tree.leaves(specs.inner_state) == [P(), P()]
  assert jaxcomp.state_partition_specs(tx, params, axis_name=("a", "b")).acc[0] == P(("a", "b"))


def test_declared_states_nest_inside_undeclared_containers():
  params = init_params()
  inner = jaxcomp.accumulate(jaxcomp.allreduce(), 2)
  specs = jaxcomp.state_partition_specs({"opt": (inner.init(params), optax.EmptyState())})
  assert specs["opt"][0].acc == (P("batch"), P("batch"))


def test_zero_d_per_device_leaf_gets_the_stacked_spec_and_bad_arguments_are_refused():
  tx = jaxcomp.accumulate(optax.sgd(0.1), 2)
  # A 0-d per-device leaf is stored stacked, (W,) globally, as pmap stores it: P(axis) shards it.
  assert jaxcomp.state_partition_specs(tx, {"scale": jnp.ones(())}, stacked=True).acc == (
      P("batch"),)
  with pytest.raises(ValueError, match="params is required"):
    jaxcomp.state_partition_specs(tx)
  with pytest.raises(ValueError, match="params is only used"):
    jaxcomp.state_partition_specs(tx.init(init_params()), init_params())
  with pytest.raises(ValueError, match="axis_name must name the mesh axis"):
    jaxcomp.state_partition_specs(tx, init_params(), axis_name=None)
  with pytest.raises(TypeError, match="axis_name must be"):
    jaxcomp.state_partition_specs(tx, init_params(), axis_name=3)


@pytest.mark.parametrize("make", [  # an error feedback per leaf, an accumulator, per bucket
    lambda: jaxcomp.sign_compress(),
    lambda: jaxcomp.accumulate(optax.sgd(0.1), 2),
    lambda: jaxcomp.comm_hook(jaxcomp.hooks.sign_hook, jaxcomp.hooks.sign_state())],
    ids=["sign", "accumulate", "sign_hook"])
def test_zero_d_parameters_get_specs_for_their_stacked_per_device_leaves(make):
  params = {"scale": jnp.ones(()), "w": jnp.ones((4, 3))}
  specs = jax.tree.leaves(jaxcomp.state_partition_specs(make(), params, stacked=True))
  masks = jax.tree.leaves(jaxcomp.per_device_mask(jax.eval_shape(make().init, params)))
  shapes = [x.shape for x in jax.tree.leaves(jax.eval_shape(make().init, params))]
  assert () in [shape for shape, m in zip(shapes, masks) if m]  # a 0-d per-device leaf exists
  assert [spec for spec, m in zip(specs, masks) if m] == [P("batch")] * sum(masks)


def test_a_zero_d_per_device_leaf_is_refused_unstacked_and_the_stacked_fix_runs():
  """``shard_map`` cannot return a 0-d per-device leaf (DeMo's coefficients of a 0-d parameter)
  unstacked: refused, naming it; stacked along a new leading axis as the message says, the step
  gives the parameters ``data_parallel`` gives."""
  params = {"scale": jnp.ones(()), "w": jnp.asarray(init_params()["w"])}
  tx = jaxcomp.demo(0.01)
  with pytest.raises(ValueError, match=r"state.coefficients\['scale'\] is per device and 0-d.*"
                     "stacked=True"):
    jaxcomp.state_partition_specs(tx, params)
  specs = jaxcomp.state_partition_specs(tx, params, stacked=True)
  assert specs.coefficients == {"scale": P("batch"), "w": P("batch")} and specs.count == P()
  mask = jaxcomp.per_device_mask(jax.eval_shape(tx.init, params))
  stack = lambda tree: jax.tree.map(lambda x, m: x[None] if m else x, tree, mask)  # noqa: E731
  unstack = lambda tree: jax.tree.map(lambda x, m: x[0] if m else x, tree, mask)  # noqa: E731
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,))
  loss = lambda p, x: jnp.mean((x @ p["w"] * p["scale"]) ** 2)  # noqa: E731

  def step(params, opt_state, x):
    grads = jax.grad(loss)(lax.pcast(params, "batch", to="varying"), x)
    updates, opt_state = tx.update(grads, unstack(opt_state), params)
    return optax.apply_updates(params, updates), stack(opt_state)

  init = jax.jit(jax.shard_map(lambda p: stack(tx.init(p)), mesh=mesh, in_specs=P(),
                               out_specs=specs))
  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("batch")),
                              out_specs=(P(), specs)))
  x = np.random.default_rng(5).normal(size=(2 * W, 5)).astype(np.float32)
  got, _ = jax.block_until_ready(run(params, init(params), x))
  dp = jaxcomp.data_parallel(loss, mesh, tx=tx)
  want, _, _ = jax.block_until_ready(dp.step(params, dp.make_state(params), dp.shard(x)))
  chex.assert_trees_all_close(got, want, **rounding_tol(16))


def _shard_map_run(tx, xs, ys):
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(AxisType.Auto,))
  params = init_params()
  specs = jaxcomp.state_partition_specs(tx, params, axis_name="batch")
  opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("batch"), P("batch")),
                     out_specs=(P(), specs), check_vma=True)
  def step(params, opt_state, x, y):
    grads = jax.grad(loss_fn)(lax.pcast(params, "batch", to="varying"), x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x0 = xs[0].reshape(-1, xs.shape[-1])
  y0 = ys[0].reshape(-1, ys.shape[-1])
  report = jaxcomp.comm_report(step, params, opt_state, x0, y0)
  for x, y in zip(xs, ys):
    params, opt_state = step(params, opt_state, x.reshape(-1, x.shape[-1]),
                             y.reshape(-1, y.shape[-1]))
    jax.block_until_ready(params)
  return params, opt_state, report


def _pmap_run(tx, xs, ys):

  def step(params, opt_state, x, y):
    updates, opt_state = tx.update(jax.grad(loss_fn)(params, x, y), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.pmap(step, axis_name="batch")
  params = jax.tree.map(lambda a: np.broadcast_to(a, (W,) + a.shape), init_params())
  opt_state = jax.pmap(tx.init)(params)
  for x, y in zip(xs, ys):
    params, opt_state = step(params, opt_state, x, y)
    jax.block_until_ready(params)
  return params, opt_state


def test_shard_map_step_with_these_specs_matches_pmap():
  rng = np.random.default_rng(1)
  xs = rng.normal(size=(5, W, 2, 5)).astype(np.float32)
  ys = rng.normal(size=(5, W, 2, 3)).astype(np.float32)
  make = lambda: jaxcomp.accumulate(optax.chain(jaxcomp.fp16_compress(), optax.sgd(0.1, 0.9)), 2)
  params, opt_state, report = _shard_map_run(make(), xs, ys)
  ref_params, ref_state = _pmap_run(make(), xs, ys)
  # Two programs: where their float32 gradients differ, a device's float16 on the wire may round the
  # other way, once per step: one float16 rounding of a device's share of an lr = 0.1 step.
  tol = rounding_tol(len(xs), scale=0.1 / W, dtype=np.float16)
  chex.assert_trees_all_close(params, jax.tree.map(lambda a: a[0], ref_params), **tol)
  # The per-device accumulator, gathered outside shard_map, is the devices' blocks side by side.
  np.testing.assert_allclose(opt_state.acc[1], np.concatenate(list(ref_state.acc[1])), **tol)
  # Only the compressor's fp16 mean goes over the wire: no hidden f32 all-reduce of the gradient.
  assert set(report.bytes_by_dtype()) == {"f16"}


def test_dgc_momenta_are_per_device_and_its_shard_map_step_matches_pmap():
  params = init_params()
  make = lambda: optax.chain(jaxcomp.dgc(0.2, axis_name="batch"), optax.sgd(0.1))
  specs = jaxcomp.state_partition_specs(make(), params)
  assert specs[0].u["w"] == specs[0].v["w"] == P("batch")  # momentum correction: local
  assert specs[0].dense_u["b"] == specs[0].count == P()  # dense leaves: momentum of the mean
  rng = np.random.default_rng(2)
  xs = rng.normal(size=(3, W, 2, 5)).astype(np.float32)
  ys = rng.normal(size=(3, W, 2, 3)).astype(np.float32)
  params, opt_state, _ = _shard_map_run(make(), xs, ys)
  ref_params, ref_state = _pmap_run(make(), xs, ys)
  # Two programs: per step the 2-sample gradient, the momentum, v and the sum over W devices round.
  tol = rounding_tol(len(xs) * (2 + 3 + W))
  chex.assert_trees_all_close(params, jax.tree.map(lambda a: a[0], ref_params), **tol)
  np.testing.assert_allclose(opt_state[0].u["w"], np.concatenate(list(ref_state[0].u["w"])), **tol)


def test_powersgd_error_is_per_device_and_its_shard_map_step_matches_pmap():
  params = init_params()
  make = lambda: optax.chain(jaxcomp.powersgd(1, start_iter=0, min_compression_rate=1.0),
                             optax.sgd(0.1))
  specs = jaxcomp.state_partition_specs(make(), params)
  # Error feedback, a stack per group (b's, w's): local.
  assert specs[0].error == (P("batch"), P("batch"))
  # Q: from all-reduced factors, the same everywhere.
  assert specs[0].q[1] == specs[0].count == P()
  rng = np.random.default_rng(3)
  xs = rng.normal(size=(3, W, 2, 5)).astype(np.float32)
  ys = rng.normal(size=(3, W, 2, 3)).astype(np.float32)
  params, opt_state, report = _shard_map_run(make(), xs, ys)
  ref_params, ref_state = _pmap_run(make(), xs, ys)
  # Two programs: per step the 2-sample gradient, the 5 + 3 sums of P and Q and W devices round.
  tol = rounding_tol(len(xs) * (2 + 5 + 3 + W))
  chex.assert_trees_all_close(params, jax.tree.map(lambda a: a[0], ref_params), **tol)
  # shard_map's local blocks side by side along the first axis; pmap's stacked: w's group.
  np.testing.assert_allclose(opt_state[0].error[1], np.concatenate(list(ref_state[0].error[1])),
                             **tol)
  # P (5x1) and Q (3x1) and the uncompressed bias, never the full 5x3 kernel: nothing hidden.
  assert report.payload_bytes < 4 * (5 * 3 + 3)


@pytest.mark.parametrize("make", [
    lambda: optax.chain(jaxcomp.quantized(8, block_size=8), optax.sgd(0.1)),
    lambda: optax.chain(jaxcomp.sign_compress(), optax.sgd(0.1)),
    lambda: jaxcomp.onebit_adam(0.01, freeze_steps=1),
], ids=["quantized", "sign", "onebit_adam"])
def test_all_to_all_and_all_gather_compressors_run_under_check_vma_and_match_pmap(make):
  """Their errors are per device; their outputs, decoded from an all-gather, are replicated."""
  rng = np.random.default_rng(4)
  xs = rng.normal(size=(3, W, 2, 5)).astype(np.float32)
  ys = rng.normal(size=(3, W, 2, 3)).astype(np.float32)
  params, opt_state, report = _shard_map_run(make(), xs, ys)
  ref_params, _ = _pmap_run(make(), xs, ys)
  chex.assert_trees_all_close(params, jax.tree.map(lambda a: a[0], ref_params), rtol=1e-5,
                              atol=1e-6)
  # No hidden f32 all-reduce of the gradient (1-bit Adam's warm-up sends one, in its cond branch).
  assert not [c for c in report.collectives
              if c.op == "all-reduce" and "f32" in c.dtypes and not c.in_conditional]
