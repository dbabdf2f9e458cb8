"""``local_sgd``: torch's post-local SGD with periodic averaging, against NumPy and allreduce-SGD,
and its hierarchical forms on a 2-D mesh with ``comm_report`` per axis."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import optax
from jax.sharding import AxisType, PartitionSpec as P

import jaxcomp
from helpers import assert_identical_across_devices, replicate
from training import pmap_step, run

pytestmark = pytest.mark.numeric  # compares numbers: CI runs it again under a reduced ISA

LR, MOMENTUM = 0.05, 0.9
IN, OUT = 8, 6


def init_params():
  rng = np.random.default_rng(0)
  return {"w": rng.normal(0, 0.5, (IN, OUT)).astype(np.float32),
          "b": rng.normal(0, 0.5, OUT).astype(np.float32)}


def batch(step, n):
  """Each device's least-squares data: its own inputs and targets at every step."""
  rng = np.random.default_rng(100 + step)
  return (rng.normal(size=(n, 6, IN)).astype(np.float32),
          rng.normal(size=(n, 6, OUT)).astype(np.float32))


def loss_fn(params, x, y):
  return 0.5 * jnp.mean(jnp.sum((x @ params["w"] + params["b"] - y) ** 2, -1))


def numpy_grad(params, x, y):
  residual = x @ params["w"] + params["b"] - y
  return {"w": x.T @ residual / len(x), "b": residual.sum(0) / len(x)}


def pmap_run(tx, steps, n):
  """``steps`` pmapped steps of ``tx`` on the least-squares data on ``n`` devices
  (``training.run``): the parameters after each."""
  _, _, outputs = run(pmap_step(loss_fn, tx, n, returns=None), replicate(init_params(), n),
                      replicate(tx.init(init_params()), n), steps, n_devices=n, batch=batch)
  return [params for params, _ in outputs]


def reference(steps, n, sync_every, start_iter):
  """Post-local SGD in float64, from torch's definitions: the mean gradient before start_iter, then
  SGD with momentum on each device's own gradient, and PeriodicModelAverager's averaging after the
  steps t >= start_iter with (t - start_iter) % sync_every == 0."""
  params = [jax.tree.map(np.float64, init_params()) for _ in range(n)]
  momenta = [jax.tree.map(np.zeros_like, p) for p in params]
  history = []
  for t in range(steps):
    x, y = batch(t, n)
    grads = [numpy_grad(params[i], x[i].astype(np.float64), y[i]) for i in range(n)]
    if t < start_iter:
      grads = [jax.tree.map(lambda *g: np.mean(g, 0), *grads)] * n
    for i in range(n):  # optax.sgd: m <- g + mu m; p <- p - lr m
      momenta[i] = jax.tree.map(lambda m, g: g + MOMENTUM * m, momenta[i], grads[i])
      params[i] = jax.tree.map(lambda p, m: p - LR * m, params[i], momenta[i])
    if t >= start_iter and (t - start_iter) % sync_every == 0:
      params = [jax.tree.map(lambda *p: np.mean(p, 0), *params)] * n
    history.append(jax.tree.map(lambda *p: np.stack(p), *params))
  return history


def test_sync_every_1_is_allreduce_sgd():
  inner = optax.sgd(LR, momentum=MOMENTUM)
  local = pmap_run(jaxcomp.local_sgd(inner, sync_every=1), 20, 8)
  dense = pmap_run(optax.chain(jaxcomp.allreduce(), inner), 20, 8)
  for got, expected in zip(local, dense):
    assert_identical_across_devices(got)
    # The mean of SGD steps is the SGD step of the mean: equal to float32 rounding.
    chex.assert_trees_all_close(got, expected, rtol=0, atol=1e-5)


def test_matches_numpy_post_local_sgd_and_replicas_are_identical_exactly_after_each_average():
  steps, n, sync_every, start_iter = 60, 4, 4, 5
  tx = jaxcomp.local_sgd(optax.sgd(LR, momentum=MOMENTUM), sync_every=sync_every,
                         start_iter=start_iter)
  config = tx.init(init_params()).config
  for t, (got, expected) in enumerate(zip(pmap_run(tx, steps, n),
                                          reference(steps, n, sync_every, start_iter))):
    # float32 against float64: a few float32 roundings per step, over 60 steps of a contraction.
    chex.assert_trees_all_close(got, expected, rtol=0, atol=2e-5)
    assert bool(config.syncs_after(t)) == (t < 5 or (t - 5) % 4 == 0)
    if config.syncs_after(t):
      assert_identical_across_devices(got)  # max |Δparam| = 0
    else:
      assert max(float(np.abs(np.diff(np.asarray(x), axis=0)).max())
                 for x in jax.tree.leaves(got)) > 0


# ------------------------------------------------------------------------ hierarchical


def mesh_2d():
  return jax.make_mesh((2, 4), ("slow", "fast"), axis_types=(AxisType.Auto,) * 2)


def mesh_run(tx, mesh, steps, spec_axes):
  """Steps under shard_map(check_vma=True) on the 2-D mesh, parameters per device."""
  both = ("slow", "fast")
  specs = jaxcomp.state_partition_specs(tx, init_params(), axis_name=spec_axes)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(init_params())

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(both), specs, P(both), P(both)),
                     out_specs=(P(both), specs))
  def step(params, state, x, y):
    params = jax.tree.map(lambda p: p[0], params)
    updates, state = tx.update(jax.grad(loss_fn)(params, x[0], y[0]), state, params)
    return jax.tree.map(lambda p: p[None], optax.apply_updates(params, updates)), state

  params = replicate(init_params(), 8)
  history = []
  for t in range(steps):
    params, state = jax.block_until_ready(step(params, state, *batch(t, 8)))
    history.append(jax.tree.map(lambda p: np.asarray(p).reshape((2, 4) + p.shape[1:]), params))
  return history, jaxcomp.comm_report(step, params, state, *batch(0, 8)).by_axes(mesh)


def test_hierarchical_mean_over_fast_every_step_and_parameters_over_slow_every_period():
  tx = jaxcomp.local_sgd(optax.chain(jaxcomp.allreduce(axis_name="fast"), optax.sgd(LR)),
                         sync_every=3, axis_name="slow")
  history, by_axes = mesh_run(tx, mesh_2d(), 7, ("slow", "fast"))
  for t, params in enumerate(history):
    for slow in range(2):  # the devices along fast hold the same parameters after every step
      assert_identical_across_devices(jax.tree.map(lambda p: p[slow], params))
    slow_groups = jax.tree.map(lambda p: p[:, 0], params)
    if t % 3 == 0:  # averaged over slow after steps 0, 3, 6
      assert_identical_across_devices(slow_groups)
    else:
      assert max(float(np.abs(p[1] - p[0]).max()) for p in jax.tree.leaves(slow_groups)) > 0
  numel = sum(x.size for x in jax.tree.leaves(init_params()))
  fast, slow = by_axes[("fast",)], by_axes[("slow",)]
  assert set(by_axes) == {("fast",), ("slow",)}
  # The gradient mean over fast, every step; the parameter average over slow, once a period.
  assert not any(c.phases for c in fast.collectives)
  assert all(c.phases == (("local_sgd.sync", 1 / 3),) for c in slow.collectives)
  assert fast.payload_bytes == slow.phase("local_sgd.sync").payload_bytes == 4 * numel
  assert slow.payload_bytes == pytest.approx(4 * numel / 3)


def test_nested_local_sgd_averages_at_two_periods():
  """HierarchicalModelAverager's idea: parameters averaged over fast every 2 steps, over all
  every 6."""
  inner = jaxcomp.local_sgd(optax.sgd(LR), sync_every=2, axis_name="fast")
  tx = jaxcomp.local_sgd(inner, sync_every=6, axis_name="slow")
  history, by_axes = mesh_run(tx, mesh_2d(), 7, ("slow", "fast"))
  for t, params in enumerate(history):
    if t % 6 == 0:
      assert_identical_across_devices(jax.tree.map(lambda p: p.reshape((8,) + p.shape[2:]), params))
    elif t % 2 == 0:
      for slow in range(2):
        assert_identical_across_devices(jax.tree.map(lambda p: p[slow], params))
    else:
      assert max(float(np.abs(p[0, 1] - p[0, 0]).max()) for p in jax.tree.leaves(params)) > 0
  assert set(by_axes) == {("fast",), ("slow",)}
  # Each average is its own local_sgd's sync phase: every 2 steps over fast, every 6 over slow.
  assert [(c.phase, c.share) for c in by_axes[("fast",)].collectives] == [("local_sgd.sync", 1 / 2)]
  assert [(c.phase, c.share) for c in by_axes[("slow",)].collectives] == [("local_sgd.sync", 1 / 6)]


def test_per_step_hierarchical_compression_sends_the_dense_mean_over_fast_and_powersgd_over_slow():
  tx = optax.chain(jaxcomp.allreduce(axis_name="fast"),
                   jaxcomp.powersgd(2, axis_name="slow", start_iter=0, min_compression_rate=1.0),
                   optax.sgd(LR))
  # The mean over fast makes PowerSGD's input, and so its error feedback, the same along fast.
  history, by_axes = mesh_run(tx, mesh_2d(), 3, "slow")
  for params in history:
    assert_identical_across_devices(jax.tree.map(lambda p: p.reshape((8,) + p.shape[2:]), params))
  numel = sum(x.size for x in jax.tree.leaves(init_params()))
  assert set(by_axes) == {("fast",), ("slow",)}
  assert by_axes[("fast",)].payload_bytes == 4 * numel
  assert all(c.group_size == 4 for c in by_axes[("fast",)].collectives)
  # Over slow: P (8×2) and Q (6×2) of the kernel, the bias (6,) dense (no finiteness flag:
  # PowerSGD reads it from their sums).
  assert by_axes[("slow",)].payload_bytes == 4 * (IN * 2 + OUT * 2 + OUT)
  assert all(c.group_size == 2 for c in by_axes[("slow",)].collectives)


def test_the_average_is_one_all_reduce_and_needs_no_packed_copy_of_the_parameters():
  """The sync averages leaf by leaf; XLA's combiner sends one all-reduce, and the donated update
  needs no more scratch than the plain mean's (a packed flat buffer needed two gradients' worth)."""
  tx = jaxcomp.local_sgd(optax.sgd(0.1), sync_every=2)
  params = {f"w{i}": jax.ShapeDtypeStruct((8, 256, 64 + i), jnp.float32) for i in range(6)}
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8,) + x.shape, x.dtype),
                       jax.eval_shape(tx.init, one))
  step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name="batch", devices=jax.devices()[:8],
                  donate_argnums=(0, 1))
  report = jaxcomp.comm_report(step, params, state, params)
  assert [(c.op, c.phase) for c in report.collectives] == [("all-reduce", "local_sgd.sync")]
  grad_bytes = sum(4 * np.prod(x.shape) for x in jax.tree.leaves(one))
  temp = step.lower(params, state, params).compile().memory_analysis().temp_size_in_bytes
  assert temp < 1.1 * grad_bytes
