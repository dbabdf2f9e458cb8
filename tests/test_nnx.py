"""Flax NNX is first class: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` works with every registry
compressor, every hook through ``comm_hook`` and ``accumulate``, and gives the parameters the same
chain gives on plain arrays; ``state_partition_specs`` and ``data_parallel`` understand its state.
Flax Linen's ``TrainState`` keeps working."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import hooks
from compressors import COMPRESSORS, optimizer

W = 4


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(6, 8, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)
    self.scale = nnx.Param(jnp.ones(()))  # 0-d

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x))) * self.scale


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


# The registry already runs fp16_compress_wrapper(allreduce_hook) and powersgd_hook; these are the
# other built-in hooks.
HOOKS = {
    "allreduce_hook": lambda: jaxcomp.comm_hook(hooks.allreduce_hook),
    "fp16_compress_hook": lambda: jaxcomp.comm_hook(hooks.fp16_compress_hook),
    "bf16_compress_hook": lambda: jaxcomp.comm_hook(hooks.bf16_compress_hook),
    "noop_hook": lambda: jaxcomp.comm_hook(hooks.noop_hook),
    "bf16_wrapper(allreduce_hook)": lambda: jaxcomp.comm_hook(
        jaxcomp.bf16_compress_wrapper(hooks.allreduce_hook)),
    "batched_powersgd_hook": lambda: jaxcomp.comm_hook(
        hooks.batched_powersgd_hook, hooks.batched_powersgd_state(1, start_iter=1)),
    "dgc_hook": lambda: jaxcomp.comm_hook(hooks.dgc_hook, hooks.dgc_state(0.1)),
}
def _with_sgd(make):
  return lambda inner: optax.chain(make(), inner)


# Each as a whole optimizer around momentum SGD: a compressor chained before it, local SGD and DiLoCo
# around it, 1-bit Adam alone.
OPTIMIZERS = {**{f"registry:{name}": functools.partial(optimizer, name) for name in COMPRESSORS},
              **{f"hook:{name}": _with_sgd(make) for name, make in HOOKS.items()},
              "accumulate(powersgd)": _with_sgd(lambda: jaxcomp.accumulate(
                  jaxcomp.powersgd(1, start_iter=1, min_compression_rate=1.0), every_k=2))}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_nnx_optimizer_gives_the_parameters_of_plain_arrays(name):
  tx = OPTIMIZERS[name](optax.sgd(0.1, momentum=0.9))
  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  opt_state = tx.init(params)

  def step(nnx_state, plain_state, grads):
    model, optimizer = nnx_state
    nnx_grads = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(nnx_grads, grads)
    optimizer.update(model, nnx_grads)
    params, opt_state = plain_state
    updates, opt_state = tx.update(grads, opt_state, params)
    return (model, optimizer), (optax.apply_updates(params, updates), opt_state)

  step = jax.pmap(step, axis_name="batch", devices=jax.devices()[:W])
  stack = lambda tree: jax.tree.map(lambda x: np.stack([np.asarray(x)] * W), tree)
  nnx_state, plain_state = stack((model, optimizer)), stack((params, opt_state))
  rng = np.random.default_rng(0)
  for _ in range(4):  # PowerSGD compresses from step 1, accumulate communicates on steps 2 and 4
    grads = jax.tree.map(lambda p: rng.normal(size=(W,) + np.shape(p)).astype(np.float32), params)
    nnx_state, plain_state = jax.block_until_ready(step(nnx_state, plain_state, grads))
  trained = nnx.to_pure_dict(nnx.state(nnx_state[0], nnx.Param))
  # One program computes both, on the same gradients: the same parameters.
  chex.assert_trees_all_close(trained, plain_state[0], rtol=1e-6, atol=1e-7)


def test_state_partition_specs_of_an_nnx_optimizer():
  model = MLP(nnx.Rngs(0))
  tx = optax.chain(jaxcomp.powersgd(1, start_iter=0), optax.sgd(0.1, momentum=0.9))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  specs = jaxcomp.state_partition_specs((model, optimizer))
  psgd = specs[1].opt_state[0]
  assert psgd.error["hidden"]["kernel"].get_value() == P("batch")  # per device, in its OptArray
  assert psgd.error["scale"].get_value() == P("batch")  # 0-d: stacked, as pmap stores it
  assert psgd.q["hidden"]["kernel"].get_value() == P()
  assert specs[0].hidden.kernel.get_value() == P()  # the model's parameters: replicated
  assert jaxcomp.state_partition_specs(optimizer.opt_state)[0].count.get_value() == P()
  with pytest.raises(TypeError, match=r"nnx.state\(\) or nnx.split\(\).*Pass the nnx.Optimizer"):
    jaxcomp.state_partition_specs(nnx.state(optimizer))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_nnx_optimizer_under_data_parallel_matches_plain_arrays(kind):
  axis_type = jax.sharding.AxisType.Explicit if kind == "explicit" else jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(axis_type,), devices=jax.devices()[:W])
  make_tx = lambda: optax.chain(jaxcomp.powersgd(1, start_iter=0, min_compression_rate=1.0),
                                optax.sgd(0.1, momentum=0.9))
  model = MLP(nnx.Rngs(0))
  graphdef, params = nnx.split(model)  # the functional style: a graph and a State of arrays
  optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)

  def train_step(state, x, y):
    model, optimizer = state
    loss, grads = nnx.value_and_grad(loss_fn)(lax.pcast(model, "batch", to="varying"), x, y)
    optimizer.update(model, grads)
    return (model, optimizer), loss

  def plain_loss(params, x, y):
    return loss_fn(nnx.merge(graphdef, params), x, y)

  nnx_dp = jaxcomp.data_parallel(train_step, mesh)
  plain_dp = jaxcomp.data_parallel(plain_loss, mesh, tx=make_tx())
  state, opt_state = nnx_dp.make_state((model, optimizer)), plain_dp.make_state(params)
  assert state[1].opt_state[0].error["scale"].shape == (W,)
  rng = np.random.default_rng(1)
  for _ in range(3):
    batch = nnx_dp.shard((rng.normal(size=(16, 6)).astype(np.float32),
                          rng.normal(size=(16, 3)).astype(np.float32)))
    state, loss = nnx_dp.step(state, *batch)
    params, opt_state, plain = plain_dp.step(params, opt_state, *batch)
    np.testing.assert_allclose(loss, plain, rtol=1e-5)
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(state[0], nnx.Param)),
                              nnx.to_pure_dict(params), rtol=1e-5, atol=1e-6)
  report = jaxcomp.comm_report(nnx_dp.step, state, *batch)
  assert report.payload_bytes < 4 * sum(np.size(x) for x in jax.tree.leaves(params)) // 2


def test_linen_train_state_keeps_working():
  import flax.linen as nn

  class Dense(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))

  model = Dense()
  rng = np.random.default_rng(2)
  x, y = rng.normal(size=(16, 6)).astype(np.float32), rng.normal(size=(16, 3)).astype(np.float32)
  tx = optax.chain(jaxcomp.powersgd(1, start_iter=0), optax.sgd(0.1, momentum=0.9))
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=model.init(jax.random.key(0), x)["params"], tx=tx)

  def train_step(state, x, y):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(
        lax.pcast(state.params, "batch", to="varying"))
    return state.apply_gradients(grads=grads), None

  mesh = jax.make_mesh((W,), ("batch",), devices=jax.devices()[:W])
  dp = jaxcomp.data_parallel(train_step, mesh)
  placed = dp.make_state(state)
  assert placed.opt_state[0].error["Dense_1"]["kernel"].shape == (W, 6, 8)  # per device, stacked
  for _ in range(2):
    placed, _ = dp.step(placed, *dp.shard((x, y)))
  assert int(placed.step) == 2
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(placed.params))
