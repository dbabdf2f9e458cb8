"""Every registry entry and every built-in hook works in every loop the README shows: under
``jaxcomp.data_parallel`` (the loss form; the per-device-step form for one entry of each kind of
state), ``jax.pmap`` and ``jax.shard_map(check_vma=True)``, four steps of the same training give the
parameters of the ``pmap`` run (within float32 rounding: they are different programs) and identical
replicas (a wrapper of the optimizer: right after its synchronizations, which the last step is)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

import jaxcomp
from jaxcomp import hooks
from compressors import (ALGORITHMS, COMPRESSORS, OPTIMIZERS, PRESETS, WRAPPERS, optimizer,
                         synced_leaves)
from helpers import assert_identical_across_devices, replicate, rounding_tol

pytestmark = pytest.mark.numeric
W, STEPS, AXIS = 4, 4, "batch"
LR = 0.05


def init_params():
  rng = np.random.default_rng(0)
  return {"hidden": rng.normal(0, 0.4, (6, 16)).astype(np.float32),
          "bias": np.zeros(16, np.float32),
          "out": rng.normal(0, 0.4, (16, 3)).astype(np.float32)}


def loss_fn(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["hidden"] + params["bias"]) @ params["out"] - y) ** 2)


def batches():
  rng = np.random.default_rng(1)
  return [(rng.normal(size=(W * 4, 6)).astype(np.float32),
           rng.normal(size=(W * 4, 3)).astype(np.float32)) for _ in range(STEPS)]


HOOKS = {
    "allreduce_hook": lambda: jaxcomp.comm_hook(hooks.allreduce_hook, bucket_cap_mb=1e-3),
    "fp16_compress_hook": lambda: jaxcomp.comm_hook(hooks.fp16_compress_hook, bucket_cap_mb=1e-3),
    "bf16_compress_wrapper(powersgd_hook)": lambda: jaxcomp.comm_hook(
        jaxcomp.bf16_compress_wrapper(hooks.powersgd_hook),
        hooks.powersgd_state(2, start_iter=1, min_compression_rate=1.0), bucket_cap_mb=1e-3),
    "batched_powersgd_hook": lambda: jaxcomp.comm_hook(
        hooks.batched_powersgd_hook, hooks.batched_powersgd_state(1, start_iter=1),
        bucket_cap_mb=1e-3),
    "dgc_hook": lambda: jaxcomp.comm_hook(hooks.dgc_hook, hooks.dgc_state(0.1, warmup=None),
                                          bucket_cap_mb=1e-3),
    "quantized_hook": lambda: jaxcomp.comm_hook(hooks.quantized_hook, hooks.quantized_state(8),
                                                bucket_cap_mb=1e-3),
    "sign_hook": lambda: jaxcomp.comm_hook(hooks.sign_hook, hooks.sign_state(),
                                           bucket_cap_mb=1e-3),
    "chunked_topk_hook": lambda: jaxcomp.comm_hook(hooks.chunked_topk_hook,
                                                   hooks.chunked_topk_state(4, chunk=64),
                                                   bucket_cap_mb=1e-3),
    "onebit_adam_hook": lambda: jaxcomp.comm_hook(hooks.onebit_adam_hook,
                                                  hooks.onebit_adam_state(freeze_steps=2),
                                                  bucket_cap_mb=1e-3),
}


def whole_optimizer(name):
  """The optimizer a user would build around the entry: compressor + SGD, the wrapper around SGD,
  the whole optimizer alone, or a hook + SGD."""
  if name in HOOKS:
    return optax.chain(HOOKS[name](), optax.sgd(LR))
  if name in OPTIMIZERS:
    return COMPRESSORS[name]()
  return optimizer(name, optax.sgd(LR))


def assert_synced_replicas(name, params):
  """Identical replicas of every leaf the last step synchronized (all of them, but for Streaming
  DiLoCo, whose fragments land at different steps)."""
  leaves = jax.tree.leaves(params)
  flags = synced_leaves(name, whole_optimizer(name).init(init_params()), STEPS - 1, len(leaves))
  assert_identical_across_devices([x for x, synced in zip(leaves, flags) if synced])


def per_device(name) -> bool:
  """Whether the parameters differ from device to device between synchronizations."""
  return name in WRAPPERS


def local_grads(params, x, y):
  return jax.grad(loss_fn)(params, x, y)


def sgd_step(tx, params, opt_state, x, y, grad_params=None):
  grads = local_grads(params if grad_params is None else grad_params, x, y)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def run_pmap(tx):
  step = jax.pmap(lambda p, s, x, y: sgd_step(tx, p, s, x, y), axis_name=AXIS,
                  devices=jax.devices()[:W])
  params, state = replicate(init_params(), W), replicate(tx.init(init_params()), W)
  for x, y in batches():
    params, state = jax.block_until_ready(
        step(params, state, x.reshape(W, -1, 6), y.reshape(W, -1, 3)))
  return params


def mesh():
  return jax.make_mesh((W,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:W])


def run_shard_map(tx, wrapper):
  specs = jaxcomp.state_partition_specs(tx, init_params(), axis_name=AXIS)
  param_spec = P(AXIS) if wrapper else P()

  def step(params, opt_state, x, y):
    if wrapper:  # each device's own copy, stacked along a leading axis
      params, opt_state = jax.tree.map(lambda a: a[0], (params, opt_state))
      params, opt_state = sgd_step(tx, params, opt_state, x, y)
      return jax.tree.map(lambda a: jnp.asarray(a)[None], (params, opt_state))
    local = lax.pcast(params, AXIS, to="varying")
    return sgd_step(tx, params, opt_state, x, y, grad_params=local)

  state = tx.init(init_params())
  if wrapper:
    params, state = replicate(init_params(), W), replicate(state, W)
    state_specs = jax.tree.map(lambda _: P(AXIS), specs)
  else:
    params = init_params()
    state = jax.tree.map(lambda s, a: np.stack([a] * W) if s == P(AXIS) else a, specs, state)
    state_specs = specs
    step = _unstacking(step, specs)
  f = jax.jit(jax.shard_map(step, mesh=mesh(), in_specs=(param_spec, state_specs, P(AXIS), P(AXIS)),
                            out_specs=(param_spec, state_specs), check_vma=True))
  for x, y in batches():
    params, state = jax.block_until_ready(f(params, state, x, y))
  return params if wrapper else replicate(params, W)


def _unstacking(step, specs):
  """``step`` on the per-device leaves of the state without their leading device axis."""

  def unstacked(params, opt_state, x, y):
    opt_state = jax.tree.map(lambda s, a: a[0] if s == P(AXIS) else a, specs, opt_state)
    params, opt_state = step(params, opt_state, x, y)
    return params, jax.tree.map(lambda s, a: jnp.asarray(a)[None] if s == P(AXIS) else a, specs,
                                opt_state)

  return unstacked


def run_loss_form(tx, wrapper):
  dp = jaxcomp.data_parallel(loss_fn, mesh(), tx=tx)
  params = init_params()
  state = dp.make_state(params)
  if wrapper:
    params = dp.make_params(params)
  for batch in batches():
    params, state, loss = dp.step(params, state, *dp.shard(batch))
    jax.block_until_ready(loss)
  return params if wrapper else replicate(params, W)


def run_step_form(tx, wrapper):

  def step(state, x, y):
    params, opt_state = state
    if wrapper:  # this device's own copy: already varying
      params, opt_state = sgd_step(tx, params.tree, opt_state, x, y)
      return (jaxcomp.PerDevice(params), opt_state), ()
    local = lax.pcast(params, AXIS, to="varying")
    return sgd_step(tx, params, opt_state, x, y, grad_params=local), ()

  dp = jaxcomp.data_parallel(step, mesh())
  params = init_params()
  state = dp.make_state((jaxcomp.PerDevice(params) if wrapper else params, tx.init(params)))
  for batch in batches():
    state, out = dp.step(state, *dp.shard(batch))
    jax.block_until_ready(state)
  params = state[0].tree if wrapper else state[0]
  return params if wrapper else replicate(params, W)


LOOPS = {"shard_map": run_shard_map, "data_parallel loss form": run_loss_form,
         "data_parallel step form": run_step_form}

# data_parallel's two forms place the state alike and differ only in who calls the update: the step
# form runs for one entry of each kind of state (stateless mean, stateful compressor with per-device
# fields, whole optimizer, wrapper of the optimizer, fragments, bucketed hook); the other loops for
# all.
STEP_FORM = ("allreduce", "powersgd_r1", "dgc", "quantized_int8", "onebit_adam", "diloco_h20",
             "streaming_diloco_h20_p2", "dgc_hook")


def test_the_presets_left_to_this_file_are_papers_recipes_of_algorithms_tested_everywhere():
  from jaxcomp.train import papers
  assert set(PRESETS) <= {entry.name for entry in papers.ENTRIES}
  assert set(ALGORITHMS) | set(PRESETS) == set(COMPRESSORS)
  algorithms = {"diloco_h20", "sparseloco_h30", "streaming_diloco_h100_p4_int8", "muloco"}
  assert algorithms <= set(ALGORITHMS)


@pytest.mark.parametrize("name", sorted(COMPRESSORS) + sorted(HOOKS))
def test_every_loop_gives_the_pmap_parameters_and_identical_replicas(name):
  reference = run_pmap(whole_optimizer(name))
  assert_synced_replicas(name, reference)
  for loop, run in LOOPS.items():
    if loop == "data_parallel step form" and name not in STEP_FORM:
      continue
    params = run(whole_optimizer(name), per_device(name))
    assert_synced_replicas(name, params)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), **rounding_tol(256),
                                 err_msg=f"{name} under {loop}")
