"""Flax NNX is first class: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` works with every registry
compressor, every hook through ``comm_hook`` and ``accumulate``, and gives the parameters the same
chain gives on plain arrays; ``state_partition_specs`` and ``data_parallel`` understand its state.
``data_parallel``'s loss form takes an nnx model and keeps what its forward pass writes (BatchNorm
statistics, RNG counters) by the ``buffers`` policy, as a one-device reference does. Flax Linen's
``TrainState`` keeps working."""

import functools
import warnings

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
from compressors import ALGORITHMS, optimizer
from helpers import rounding_tol

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


# Each as a whole optimizer around momentum SGD: a compressor chained before it, local SGD and
# DiLoCo around it, 1-bit Adam alone.
OPTIMIZERS = {**{f"registry:{name}": functools.partial(optimizer, name) for name in ALGORITHMS},
              **{f"hook:{name}": _with_sgd(make) for name, make in HOOKS.items()},
              "accumulate(powersgd)": _with_sgd(lambda: jaxcomp.accumulate(
                  jaxcomp.powersgd(1, start_iter=1, min_compression_rate=1.0), every_k=2))}


# One of each kind of state in the fast tier (stateless mean, stateful compressor, bucketed hook,
# wrapper of the optimizer, fragments, whole optimizer, accumulation); every other one in the slow.
FAST = ("registry:allreduce", "registry:powersgd_r1", "registry:dgc", "registry:quantized_int8",
        "registry:onebit_adam", "registry:diloco_h20", "registry:streaming_diloco_h20_p2",
        "hook:dgc_hook", "accumulate(powersgd)")


@pytest.mark.parametrize("name", [
    name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(OPTIMIZERS)])
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
  specs = jaxcomp.state_partition_specs((model, optimizer), stacked=True)
  psgd = specs[1].opt_state[0]  # a group per leaf: hidden's bias and kernel, out's, scale
  assert psgd.error[1].get_value() == P("batch")  # hidden's kernel: per device, in its OptArray
  assert psgd.error[4].get_value() == P("batch")  # the 0-d scale: stacked, as pmap stores it
  assert psgd.q[1].get_value() == P()
  assert specs[0].hidden.kernel.get_value() == P()  # the model's parameters: replicated
  assert jaxcomp.state_partition_specs(optimizer.opt_state, stacked=True)[0].count.get_value() == (
      P())
  with pytest.raises(TypeError, match=r"nnx.state\(\) or nnx.split\(\).*Pass the nnx.Optimizer"):
    jaxcomp.state_partition_specs(nnx.state(optimizer))


@pytest.mark.numeric
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_nnx_model_under_data_parallel_matches_plain_arrays(kind):
  axis_type = jax.sharding.AxisType.Explicit if kind == "explicit" else jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((W,), ("batch",), axis_types=(axis_type,), devices=jax.devices()[:W])
  make_tx = lambda: optax.chain(jaxcomp.powersgd(1, start_iter=0, min_compression_rate=1.0),
                                optax.sgd(0.1, momentum=0.9))
  model = MLP(nnx.Rngs(0))
  graphdef, params = nnx.split(model)  # the functional style: a graph and a State of arrays

  def plain_loss(params, x, y):
    return loss_fn(nnx.merge(graphdef, params), x, y)

  nnx_dp = jaxcomp.data_parallel(loss_fn, mesh, tx=make_tx())
  plain_dp = jaxcomp.data_parallel(plain_loss, mesh, tx=make_tx())
  optimizer, opt_state = nnx_dp.make_state(model), plain_dp.make_state(params)
  assert isinstance(optimizer, nnx.Optimizer)
  assert optimizer.opt_state[0].error[4].shape == (W, 1, 1, 1)  # the 0-d scale's: per device
  rng = np.random.default_rng(1)
  for _ in range(3):
    batch = nnx_dp.shard((rng.normal(size=(16, 6)).astype(np.float32),
                          rng.normal(size=(16, 3)).astype(np.float32)))
    model, optimizer, loss = nnx_dp.step(model, optimizer, *batch)
    params, opt_state, plain = plain_dp.step(params, opt_state, *batch)
    np.testing.assert_allclose(loss, plain, rtol=1e-5)
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                              nnx.to_pure_dict(params), rtol=1e-5, atol=1e-6)
  assert int(optimizer.step[...]) == 3
  # A model without Variables other than parameters adds no traffic.
  report = jaxcomp.comm_report(nnx_dp.step, model, optimizer, *batch)
  plain_report = jaxcomp.comm_report(plain_dp.step, params, opt_state, *batch)
  assert report.payload_bytes == plain_report.payload_bytes
  assert report.payload_bytes < 4 * sum(np.size(x) for x in jax.tree.leaves(params)) // 2


class NormDropNet(nnx.Module):
  """Linear, BatchNorm, Dropout, Linear: the forward pass writes running statistics and an RNG
  counter."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(6, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))


STEPS = 3


def norm_drop_data():
  rng = np.random.default_rng(3)  # inputs with a non-zero mean: non-zero running means
  return [(rng.normal(1.0, 2.0, size=(4 * W, 6)).astype(np.float32),
           rng.normal(size=(4 * W, 3)).astype(np.float32)) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def one_device_reference():
  """What W devices do, computed by plain NNX on one device shard by shard: each shard's loss,
  gradient and running statistics from its own forward pass, its dropout drawn from the key folded
  with its index; the mean gradient; SGD. Returns the parameters, every device's Variables other
  than parameters and keys (an ``nnx.State`` each) and the losses, per step and device."""
  graphdef, params, keys, rest = nnx.split(NormDropNet(nnx.Rngs(0, dropout=1)), nnx.Param,
                                           nnx.RngKey, ...)

  @jax.jit
  def shard_step(params, rest, x, y, device):
    own_keys = jax.tree.map(lambda key: jax.random.fold_in(key, device), keys)
    local = nnx.merge(graphdef, params, own_keys, rest)
    loss, grads = nnx.value_and_grad(loss_fn)(local, x, y)
    return loss, grads, nnx.split(local, nnx.Param, nnx.RngKey, ...)[3]

  rests, losses = [rest] * W, []
  for x, y in norm_drop_data():
    xs, ys = x.reshape(W, -1, 6), y.reshape(W, -1, 3)
    outs = [shard_step(params, rests[d], xs[d], ys[d], d) for d in range(W)]
    mean_grad = jax.tree.map(lambda *g: sum(g) / W, *[grads for _, grads, _ in outs])
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, mean_grad)
    rests = [rest for _, _, rest in outs]
    losses.append([float(loss) for loss, _, _ in outs])
  return nnx.to_pure_dict(params), [nnx.to_pure_dict(r) for r in rests], np.array(losses)


def kept(rests, buffers):
  """The running statistics ``buffers`` keeps, from every device's own: the running update is
  linear, so the mean (device 0's) of the devices' own trajectories is the trajectory of their mean
  (of device 0's) taken every step."""
  stats = [r["norm"] for r in rests]
  if buffers == "mean":
    return jax.tree.map(lambda *s: np.mean(s, axis=0), *stats)
  if buffers == "first":
    return stats[0]
  return jax.tree.map(lambda *s: np.stack(s), *stats)


@pytest.mark.numeric
@pytest.mark.parametrize("buffers", ["mean", "first", "per_device"])
def test_nnx_loss_form_keeps_what_the_forward_pass_writes(buffers, one_device_reference):
  ref_params, ref_rests, ref_losses = one_device_reference
  mesh = jax.make_mesh((W,), ("batch",), devices=jax.devices()[:W])
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=optax.chain(jaxcomp.allreduce(), optax.sgd(0.1)),
                             buffers=buffers)
  model = NormDropNet(nnx.Rngs(0, dropout=1))
  optimizer = dp.make_state(model)
  model = dp.make_params(model)  # stacks the statistics and counter with "per_device"
  tol = rounding_tol(64, scale=4.0)
  for (x, y), ref_loss in zip(norm_drop_data(), ref_losses):
    model, optimizer, loss = dp.step(model, optimizer, *dp.shard((x, y)))
    np.testing.assert_allclose(loss, ref_loss, **tol)  # reading it blocks, as XLA:CPU needs
  expected = kept(ref_rests, buffers)
  assert np.abs(expected["mean"]).max() > 0.5  # far from their start, 0: the forward pass wrote
  chex.assert_trees_all_close({"mean": model.norm.mean[...], "var": model.norm.var[...]},
                              expected, **tol)
  # Dropout's counter advanced once per step, as on one device (stacked with "per_device").
  np.testing.assert_array_equal(model.drop.rngs.count[...],
                                np.full((W,) if buffers == "per_device" else (), STEPS))
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), ref_params, **tol)
  assert int(optimizer.step[...]) == STEPS
  # Each device draws its own dropout masks: identical shards give different losses.
  x, y = norm_drop_data()[0]
  same = dp.shard((np.tile(x[:4], (W, 1)), np.tile(y[:4], (W, 1))))
  assert len(set(np.asarray(dp.step(model, optimizer, *same)[2]).tolist())) == W


def test_per_device_step_form_warns_when_the_forward_pass_writes_went_to_a_copy():
  mesh = jax.make_mesh((W,), ("batch",), devices=jax.devices()[:W])
  tx = optax.chain(jaxcomp.allreduce(), optax.sgd(0.1))

  def copied(state, x, y):  # the documented per-device step: the gradient of a pcast copy
    model, optimizer = state
    loss, grads = nnx.value_and_grad(loss_fn)(lax.pcast(model, "batch", to="varying"), x, y)
    optimizer.update(model, grads)
    return (model, optimizer), loss

  model = NormDropNet(nnx.Rngs(0, dropout=1))
  dp = jaxcomp.data_parallel(copied, mesh)
  state = dp.make_state((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
  x, y = norm_drop_data()[0]
  with pytest.warns(UserWarning, match=r"state\[0\]\.drop\.rngs\.count, state\[0\]\.norm\.mean.* "
                                       r"came back unchanged from the per-device step.*went to "
                                       r"the copy.*Use the loss form"):
    state, loss = dp.step(state, *dp.shard((x, y)))
  np.testing.assert_array_equal(state[0].norm.mean[...], 0)  # lost, as the warning says
  # A model whose forward pass writes nothing (the MLP) steps without a warning.
  plain = MLP(nnx.Rngs(0))
  dp = jaxcomp.data_parallel(copied, mesh)
  state = dp.make_state((plain, nnx.Optimizer(plain, tx, wrt=nnx.Param)))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.block_until_ready(dp.step(state, *dp.shard((x, y))))


class Counted(nnx.Module):
  """A model whose forward pass sets an integer Variable from its shard of the data."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(6, 3, rngs=rngs)
    self.positives = nnx.Variable(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    self.positives[...] = jnp.sum(x > 0).astype(jnp.int32)
    return self.linear(x)


class WritesAParameter(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    self.linear.bias[...] = self.linear.bias[...] + 1.0
    return self.linear(x)


def test_nnx_loss_form_refuses_what_it_cannot_keep_and_names_the_fix():
  mesh = jax.make_mesh((W,), ("batch",), devices=jax.devices()[:W])
  tx = optax.chain(jaxcomp.allreduce(), optax.sgd(0.1))
  rng = np.random.default_rng(4)
  x, y = rng.normal(size=(4 * W, 6)).astype(np.float32), np.zeros((4 * W, 3), np.float32)
  model = Counted(nnx.Rngs(0))
  dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
  batch = dp.shard((x, y))
  with pytest.raises(ValueError, match=r"params\['positives'\].*int32 Variable with a different "
                                       r"value on each device.*buffers='mean' averages "
                                       r"floating-point.*buffers='first'.*buffers='per_device'"):
    dp.step(model, dp.make_state(model), *batch)
  first = jaxcomp.data_parallel(loss_fn, mesh, tx=tx, buffers="first")
  counted, _, _ = first.step(model, first.make_state(model), *batch)
  assert int(counted.positives[...]) == np.sum(x[:4] > 0)  # device 0's shard
  with pytest.raises(TypeError, match=r"opt_state: with an nnx model as params the optimizer "
                                      r"state is an nnx.Optimizer.*dp.make_state\(model\)"):
    dp.step(model, tx.init(nnx.state(model, nnx.Param)), *batch)
  with pytest.raises(ValueError, match="another transformation than the tx given to data_parallel"):
    dp.step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), *batch)
  written = WritesAParameter(nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"params\['linear'\]\['bias'\].*the forward pass wrote "
                                       r"this parameter.*a Variable that wrt leaves out"):
    dp.step(written, dp.make_state(written), *batch)
  with pytest.raises(ValueError, match="buffers must be 'mean', 'first' or 'per_device'; got 'su"):
    jaxcomp.data_parallel(loss_fn, mesh, tx=tx, buffers="sum")


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
  # Dense_1's kernel, a group of its own: per device, stacked.
  assert placed.opt_state[0].by_leaf("error")["Dense_1"]["kernel"].shape == (W, 6, 8)
  for _ in range(2):
    placed, _ = dp.step(placed, *dp.shard((x, y)))
  assert int(placed.step) == 2
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(placed.params))
