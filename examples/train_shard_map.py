"""``jax.shard_map`` with ``check_vma=True`` + a jaxcomp compressor, with the right optimizer-state specs.

Two things differ from ``pmap``:

* The state mixes per-device leaves (here PowerSGD's error feedback) and replicated ones (its Q, the
  step count, the momentum). ``jaxcomp.state_partition_specs`` gives each its spec.
* With replicated parameters and ``check_vma=True``, ``jax.grad`` all-reduces the gradient in full
  precision before the compressor sees it, which would then average a sum: jaxcomp refuses such a
  gradient. Taking the gradient of ``lax.pcast(params, "batch", to="varying")`` keeps it local;
  ``jaxcomp.comm_report`` checks that the compressor's collectives are all the step sends::

    python examples/train_shard_map.py --steps 200 --devices 4
"""

import argparse
import functools

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200, help="training steps")
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices (mesh size)")
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)  # before JAX starts its backends

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.train.tasks import digits_data  # noqa: E402


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


model = MLP()
tx = optax.chain(jaxcomp.powersgd(1, axis_name="batch", start_iter=0), optax.sgd(0.1, momentum=0.9))
mesh = jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(AxisType.Auto,))
train_x, train_y, test_x, test_y = digits_data()
params = jax.device_put(model.init(jax.random.key(0), train_x[:1])["params"],
                        jax.NamedSharding(mesh, P()))  # on the mesh, so the step can donate it

specs = jaxcomp.state_partition_specs(tx, params, axis_name="batch")
print("optimizer-state specs:")
for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P)):
  print(f"  state{jax.tree_util.keystr(path)}: {spec}")
opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)


def loss_fn(params, images, labels):
  logits = model.apply({"params": params}, images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_step(local_grads: bool, check_vma: bool = True):

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("batch"), P("batch")),
                     out_specs=(P(), specs, P()), check_vma=check_vma)
  def train_step(params, opt_state, images, labels):
    at = lax.pcast(params, "batch", to="varying") if local_grads else params
    loss, grads = jax.value_and_grad(loss_fn)(at, images, labels)  # this device's gradient
    updates, opt_state = tx.update(grads, opt_state, params)  # the compressed cross-device mean
    return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "batch")

  # Donated: XLA updates the parameters, the error feedback and the momentum in place.
  return jax.jit(train_step, donate_argnums=(0, 1))


train_step = make_step(local_grads=True)
batch = 16 * jax.device_count()
example = (params, opt_state, train_x[:batch], train_y[:batch])
report = jaxcomp.comm_report(train_step, *example)
print(report)
reference = jaxcomp.comm_report(make_step(local_grads=True, check_vma=False), *example)
assert report.payload_bytes == reference.payload_bytes, "an all-reduce beside the compressor's"
try:
  make_step(local_grads=False).lower(*example)
  raise AssertionError("a gradient autodiff summed over the devices was accepted")
except ValueError as e:
  print(f"without pcast, grad adds an all-reduce, which jaxcomp refuses: {str(e)[:60]}...")

rng = np.random.default_rng(0)
for step in range(args.steps):
  idx = rng.integers(0, len(train_y), batch)
  params, opt_state, loss = train_step(params, opt_state, train_x[idx], train_y[idx])
  loss = float(loss)  # reading a value every step keeps XLA:CPU from deadlocking
  if step % 50 == 0 or step == args.steps - 1:
    print(f"step {step:4d}  loss {loss:.4f}")

logits = model.apply({"params": params}, test_x)
print(f"held-out accuracy {float((logits.argmax(-1) == test_y).mean()):.3f} on "
      f"{jax.device_count()} devices")
