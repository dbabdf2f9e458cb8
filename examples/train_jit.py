"""jit-first data parallelism with ``jaxcomp.data_parallel``: a mesh, a loss function, one jitted step.

The way most JAX code starts today — ``jax.make_mesh``, a batch sharded over its ``data`` axis, a
jitted step — with PowerSGD as the cross-device mean. ``data_parallel`` builds the step (the
``shard_map`` over ``data``, the per-device copy the gradient is taken of, the optimizer state's
shardings); ``jaxcomp.comm_report`` checks that the compressor's collectives are all that averages the
gradient. ``--model-axis 2`` makes a 2-D ``(data, model)`` mesh with the hidden layer sharded over
``model``: the compressor averages over ``data``, the partitioner handles ``model``::

    python examples/train_jit.py --steps 200 --devices 4
    python examples/train_jit.py --steps 200 --devices 8 --model-axis 2 --axis-types auto
"""

import argparse

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200, help="training steps")
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
parser.add_argument("--model-axis", type=int, default=1, help="size of a second, 'model' mesh axis")
parser.add_argument("--axis-types", choices=("explicit", "auto"), default="explicit",
                    help="the mesh's axis types (jax.make_mesh's default is explicit)")
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)  # before JAX starts its backends

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.train.tasks import digits_data  # noqa: E402


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))


model = MLP()


def loss_fn(params, images, labels):  # on one device's shard of the batch
  logits = model.apply({"params": params}, images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


data = args.devices // args.model_axis
axis_type = AxisType.Explicit if args.axis_types == "explicit" else AxisType.Auto
if args.model_axis == 1:
  mesh = jax.make_mesh((data,), ("data",), axis_types=(axis_type,))
else:
  mesh = jax.make_mesh((data, args.model_axis), ("data", "model"), axis_types=(axis_type,) * 2)

tx = optax.chain(jaxcomp.powersgd(2, axis_name="data", start_iter=0),
                 optax.sgd(0.1, momentum=0.9))
dp = jaxcomp.data_parallel(loss_fn, mesh, axis_name="data", tx=tx)

train_x, train_y, test_x, test_y = digits_data()
params = model.init(jax.random.key(0), train_x[:1])["params"]
if args.model_axis > 1:  # the hidden layer split over `model`, Megatron style
  shard = {"Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
           "Dense_1": {"kernel": P("model", None), "bias": P()}}
  params = jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params, shard)
opt_state = dp.make_state(params)  # error feedback per device (stacked), the rest replicated

batch = 32 * data
images, labels = dp.shard((train_x[:batch], train_y[:batch]))
report = jaxcomp.comm_report(dp.step, params, opt_state, images, labels)
print(report)
dense_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
over_data = [c for c in report.collectives if c.group_size == data]
print(f"over 'data': {sum(c.payload_bytes for c in over_data):,} B per step "
      f"(a dense f32 mean would be {dense_bytes:,} B)")
assert all(c.payload_bytes < dense_bytes // 2 for c in over_data), "a dense gradient all-reduce"

rng = np.random.default_rng(0)
for step in range(args.steps):
  idx = rng.integers(0, len(train_y), batch)
  params, opt_state, loss = dp.step(params, opt_state, *dp.shard((train_x[idx], train_y[idx])))
  loss = float(loss.mean())  # one loss per device; reading it blocks, which XLA:CPU needs
  if step % 50 == 0 or step == args.steps - 1:
    print(f"step {step:4d}  loss {loss:.4f}")

logits = model.apply({"params": jax.device_get(params)}, test_x)
print(f"held-out accuracy {float((logits.argmax(-1) == test_y).mean()):.3f} on "
      f"{args.devices} devices, mesh {dict(mesh.shape)}")
