"""Flax NNX with ``nnx.Optimizer`` across devices: ``jaxcomp.data_parallel`` on the model's loss.

Flax's current training API — a model, ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` — with PowerSGD of
rank 1 as the cross-device mean. ``data_parallel`` takes the loss of the model on one device's shard
of the batch and writes the step over the mesh's ``batch`` axis:

* the gradient of a per-device copy of the parameters, so the compressor's collectives are the only
  gradient traffic (``comm_report`` checks it);
* the optimizer state's per-device leaves (PowerSGD's error feedback) stacked and sharded, the rest
  replicated;
* every Variable the forward pass writes kept: BatchNorm's running statistics, averaged over the
  devices (``buffers="mean"``, the default), and Dropout's RNG counter, which advances once per step
  as on one device, while each device draws its own masks.

::

    python examples/train_nnx_optimizer.py --steps 200 --devices 4
"""

import argparse

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200, help="training steps")
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices (mesh size)")
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)  # before JAX starts its backends

import flax.nnx as nnx  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.train.tasks import digits_data  # noqa: E402


class MLP(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, 64, rngs=rngs)
    self.norm = nnx.BatchNorm(64, momentum=0.9, rngs=rngs)  # statistics settle in tens of steps
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))


def loss_fn(model, images, labels):  # one device's shard of the batch
  logits = model(images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


mesh = jax.make_mesh((jax.device_count(),), ("batch",))
model = MLP(nnx.Rngs(0, dropout=1))
tx = optax.chain(jaxcomp.powersgd(1, axis_name="batch", start_iter=10),
                 optax.sgd(0.1, momentum=0.9))
dp = jaxcomp.data_parallel(loss_fn, mesh, axis_name="batch", tx=tx)
optimizer = dp.make_state(model)  # nnx.Optimizer(model, tx, wrt=nnx.Param), placed on the mesh
error = optimizer.opt_state[0].error[1]  # hidden's kernel: the group of its shape, (64, 64)
print(f"PowerSGD's error feedback, per device: {error.shape} sharded {error.sharding.spec}")

train_x, train_y, test_x, test_y = digits_data()
batch = 16 * jax.device_count()
report = jaxcomp.comm_report(dp.step, model, optimizer,
                             *dp.shard((train_x[:batch], train_y[:batch])))
print(report)
dense_bytes = 4 * sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
# PowerSGD's plain mean before start_iter sits in a cond branch; a dense all-reduce outside one
# would be autodiff's, which data_parallel's per-device copy of the parameters avoids. (The mean of
# the running statistics is 2 x 64 floats.)
hidden = [c for c in report.collectives if not c.in_conditional and c.payload_bytes > dense_bytes // 2]
assert not hidden, "a hidden all-reduce of the gradient"

rng = np.random.default_rng(0)
for step in range(args.steps):
  idx = rng.integers(0, len(train_y), batch)
  model, optimizer, loss = dp.step(model, optimizer, *dp.shard((train_x[idx], train_y[idx])))
  loss = float(loss.mean())  # one loss per device; reading it blocks, which XLA:CPU needs
  if step % 50 == 0 or step == args.steps - 1:
    print(f"step {step:4d}  loss {loss:.4f}")

running_mean = float(np.abs(np.asarray(model.norm.mean[...])).mean())
dropout_draws = int(model.drop.rngs.count[...])
print(f"BatchNorm running mean (mean over the devices', |.| averaged): {running_mean:.3f}; "
      f"Dropout's RNG counter: {dropout_draws}")
assert running_mean > 0 and dropout_draws == args.steps, "state the forward pass wrote was lost"
model.eval()  # the running statistics, no dropout
accuracy = float((model(test_x).argmax(-1) == test_y).mean())
print(f"held-out accuracy {accuracy:.3f} on {jax.device_count()} devices, "
      f"{int(optimizer.step[...])} optimizer steps")
