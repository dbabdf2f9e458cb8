"""Checkpoint a compressed run with orbax-checkpoint mid-run, resume it, and get the same result.

A jaxcomp state is an optax state: orbax saves it and restores it with its shardings — per-device
leaves stacked and sharded along the mesh axis (as ``jaxcomp.data_parallel``'s ``make_state`` places
them), the rest replicated. The run is
interrupted between micro-steps of ``jaxcomp.accumulate``, with a half-filled accumulator, and the
resumed run must end exactly where the uninterrupted one does::

    python examples/checkpoint_resume.py --steps 40 --devices 4
"""

import argparse
import tempfile

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=40, help="training steps (interrupted halfway)")
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices (mesh size)")
args = parser.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)  # before JAX starts its backends

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.train.tasks import digits_data  # noqa: E402


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


model = MLP()


def loss_fn(params, images, labels):  # on one device's shard of the batch
  logits = model.apply({"params": params}, images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


tx = jaxcomp.accumulate(optax.chain(jaxcomp.fp16_compress(axis_name="batch"),
                                    optax.sgd(0.1, momentum=0.9)), every_k=3)
mesh = jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(AxisType.Auto,))
dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
train_x, train_y, _, _ = digits_data()
params0 = model.init(jax.random.key(0), train_x[:1])["params"]


def train(params, opt_state, start, stop):
  batch = 8 * jax.device_count()
  for step in range(start, stop):
    idx = np.random.default_rng([0, step]).integers(0, len(train_y), batch)  # batch of `step`
    params, opt_state, loss = dp.step(params, opt_state, *dp.shard((train_x[idx], train_y[idx])))
    float(loss.mean())  # reading a value every step keeps XLA:CPU from deadlocking
  return params, opt_state


start = (dp.make_params(params0), dp.make_state(params0))
final = train(*start, 0, args.steps)

half = args.steps // 2
with tempfile.TemporaryDirectory() as folder:
  with ocp.CheckpointManager(folder) as manager:
    params, opt_state = train(*start, 0, half)
    print(f"step {half}: saving; accumulator holds {int(opt_state.micro_step)} micro-batch(es)")
    manager.save(half, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    manager.wait_until_finished()
  del params, opt_state  # the interruption

  with ocp.CheckpointManager(folder) as manager:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": start[0],
                                                              "opt_state": start[1]})
    step = manager.latest_step()
    restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
  print(f"step {step}: restored; the accumulator is sharded as "
        f"{restored['opt_state'].acc[0].sharding.spec}")
  resumed = train(restored["params"], restored["opt_state"], step, args.steps)

same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), final, resumed)
assert all(jax.tree.leaves(same)), "the resumed run differs from the uninterrupted one"
print(f"step {args.steps}: resumed run equals the uninterrupted run, bit for bit")
