"""Flax NNX + ``jax.pmap`` + a jaxcomp compressor: data-parallel training on 8×8 digits.

Each device computes the gradient of its share of the batch; the compressor at the head of the optax
chain is the cross-device mean (here PowerSGD of rank 1, after 10 plain steps), so every replica
applies the same update::

    python examples/train_nnx_pmap.py --steps 200 --devices 4
"""

import argparse

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200, help="training steps")
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices (pmap width)")
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
    self.out = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


graphdef, params = nnx.split(MLP(nnx.Rngs(0)))  # a static graph and an nnx.State pytree of arrays
tx = optax.chain(jaxcomp.powersgd(1, axis_name="batch", start_iter=10),
                 optax.sgd(0.1, momentum=0.9))


def loss_fn(params, images, labels):
  logits = nnx.merge(graphdef, params)(images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train_step(params, opt_state, images, labels):
  loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)  # this device's gradient
  updates, opt_state = tx.update(grads, opt_state, params)  # the compressed cross-device mean
  return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "batch")


train_step = jax.pmap(train_step, axis_name="batch", donate_argnums=(0, 1))
n = jax.device_count()
replicate = lambda tree: jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), tree)
params = replicate(params)
opt_state = jax.pmap(tx.init)(params)

train_x, train_y, test_x, test_y = digits_data()
rng = np.random.default_rng(0)
batch = 16 * n
for step in range(args.steps):
  idx = rng.integers(0, len(train_y), batch)
  params, opt_state, loss = train_step(params, opt_state, train_x[idx].reshape(n, -1, 64),
                                       train_y[idx].reshape(n, -1))
  loss = float(loss[0])  # reading a value every step keeps XLA:CPU from deadlocking
  if step % 50 == 0 or step == args.steps - 1:
    print(f"step {step:4d}  loss {loss:.4f}")

model = nnx.merge(graphdef, jax.tree.map(lambda x: x[0], params))
accuracy = float((model(test_x).argmax(-1) == test_y).mean())
print(f"held-out accuracy {accuracy:.3f} on {n} devices")
