"""Flax Linen + ``jax.pmap`` + a jaxcomp compressor: a small CNN on 8×8 digits.

The compressor heads the optax chain where plain data-parallel code would call ``lax.pmean``; here
PowerSGD of rank 2 (Flax's fan-in x fan-out view of the conv kernel), after 10 plain steps::

    python examples/train_linen_pmap.py --steps 200 --devices 4
"""

import argparse

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200, help="training steps")
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices (pmap width)")
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)  # before JAX starts its backends

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.train.tasks import digits_data  # noqa: E402


class CNN(nn.Module):

  @nn.compact
  def __call__(self, images):
    x = images.reshape(images.shape[:-1] + (8, 8, 1))
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.relu(nn.Dense(64)(x.reshape(x.shape[:-3] + (-1,))))
    return nn.Dense(10)(x)


model = CNN()
tx = optax.chain(jaxcomp.powersgd(2, axis_name="batch", start_iter=10),
                 optax.sgd(0.05, momentum=0.9))


def loss_fn(params, images, labels):
  logits = model.apply({"params": params}, images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train_step(params, opt_state, images, labels):
  loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)  # this device's gradient
  updates, opt_state = tx.update(grads, opt_state, params)  # the compressed cross-device mean
  return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "batch")


train_step = jax.pmap(train_step, axis_name="batch", donate_argnums=(0, 1))
n = jax.device_count()
train_x, train_y, test_x, test_y = digits_data()
params = model.init(jax.random.key(0), train_x[:1])["params"]
params = jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), params)
opt_state = jax.pmap(tx.init)(params)

rng = np.random.default_rng(0)
batch = 16 * n
for step in range(args.steps):
  idx = rng.integers(0, len(train_y), batch)
  params, opt_state, loss = train_step(params, opt_state, train_x[idx].reshape(n, -1, 64),
                                       train_y[idx].reshape(n, -1))
  loss = float(loss[0])  # reading a value every step keeps XLA:CPU from deadlocking
  if step % 50 == 0 or step == args.steps - 1:
    print(f"step {step:4d}  loss {loss:.4f}")

rate, before, after = jaxcomp.powersgd_stats(opt_state)
print(f"PowerSGD sent {after:,} numbers instead of {before:,} over its compressed steps "
      f"({rate:.1f}x fewer)")
logits = model.apply({"params": jax.tree.map(lambda x: x[0], params)}, test_x)
print(f"held-out accuracy {float((logits.argmax(-1) == test_y).mean()):.3f} on {n} devices")
