"""BatchNorm under data parallelism: what jaxcomp does with running statistics, and the choice.

A jaxcomp transformation averages gradients. BatchNorm's running statistics (Linen's ``batch_stats``,
NNX's ``nnx.BatchStat``) are not gradients: they never pass through it, so jaxcomp leaves them alone and
each device keeps the statistics of its own shard of the batch — they drift apart ("local" below).
``jaxcomp.sync_buffers`` called inside the step chooses otherwise: their mean over the devices, device
0's on every device (PyTorch DDP's ``broadcast_buffers``), either on every step or every k steps.

The script trains a small Linen MLP with two BatchNorm layers under ``jax.pmap``, under
``jax.jit`` + ``jax.shard_map``, and under ``jaxcomp.data_parallel`` (the per-device-step form), with
every policy. The first BatchNorm normalises the raw pixels, so
its running statistics depend on the data alone: the script recomputes them in NumPy for every device
and step, applying the policy, and compares. For both layers it then says whether the statistics are
the same on every device (and process)::

    python examples/batchnorm.py --devices 4            # one process, 4 CPU devices
    python examples/batchnorm.py --launch 2             # 2 processes x 2 CPU devices on 127.0.0.1

Under ``shard_map`` the statistics are kept per device (``PartitionSpec("batch")``, stacked over the
devices), as pmap keeps them; with ``every_k=1`` and ``"mean"`` or ``"first"`` they are the same on
every device after each step and could be replicated (``PartitionSpec()``) instead. Under
``data_parallel`` the state wraps them in ``jaxcomp.PerDevice``, which makes ``make_state`` stack them
over the devices and the step keep them per device; the step counter that ``every_k`` needs lives in
the state (the batch arguments are split over the devices).
"""

import argparse
import os
import socket
import subprocess
import sys

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--launch", type=int, metavar="P", help="start P local processes and wait for them")
parser.add_argument("--steps", type=int, default=6, help="training steps per policy")
parser.add_argument("--every-k", type=int, default=3, help="k of the 'mean every k' policy")
parser.add_argument("--devices", type=int, default=4, help="CPU devices this process simulates")
parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
parser.add_argument("--num-processes", type=int, default=1, help="processes in the job")
parser.add_argument("--process-id", type=int, default=0, help="this process's index")
parser.add_argument("--mappings", default="pmap,shard_map,data_parallel",
                    help="comma-separated: pmap, shard_map, data_parallel")
args = parser.parse_args()

if args.launch:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  workers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--steps", str(args.steps),
                               "--every-k", str(args.every_k), "--devices", "2",
                               "--mappings", args.mappings, "--coordinator",
                               f"127.0.0.1:{port}", "--num-processes", str(args.launch),
                               "--process-id", str(i)]) for i in range(args.launch)]
  try:
    codes = [w.wait(timeout=300) for w in workers]
  finally:
    for w in workers:
      if w.poll() is None:
        w.kill()
  sys.exit(1 if any(codes) else 0)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.devices)  # before JAX starts its backends
if args.num_processes > 1:
  jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                             process_id=args.process_id, heartbeat_timeout_seconds=30)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.train.tasks import digits_data  # noqa: E402

MOMENTUM = 0.9  # BatchNorm's: running = MOMENTUM * running + (1 - MOMENTUM) * this batch's statistic
PER_DEVICE = 8  # examples per device per step


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM)(x)  # on the raw pixels
    x = nn.relu(nn.Dense(32)(x))
    x = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM)(x)
    return nn.Dense(10)(x)


# Each policy is what the step does with the updated statistics; "local" is what jaxcomp does by itself.
POLICIES = {
    "local": lambda stats, step: stats,
    "mean": lambda stats, step: jaxcomp.sync_buffers(stats, "mean", axis_name="batch"),
    "first": lambda stats, step: jaxcomp.sync_buffers(stats, "first", axis_name="batch"),
    f"mean every {args.every_k}": lambda stats, step: jaxcomp.sync_buffers(
        stats, "mean", axis_name="batch", every_k=args.every_k, step=step),
}

model = MLP()
tx = optax.chain(jaxcomp.fp16_compress(axis_name="batch"), optax.sgd(0.05))
train_x, train_y, _, _ = digits_data()
variables = model.init(jax.random.key(0), train_x[:2], train=False)
params = jaxcomp.broadcast_replicated(variables["params"])  # the same start on every process
n_local, n_global = jax.local_device_count(), jax.device_count()
first_device = jax.process_index() * n_local  # the global index of this process's first device
mine = slice(first_device, first_device + n_local)  # this process's devices among all
mesh = Mesh(np.array(jax.devices()), ("batch",), axis_types=(AxisType.Auto,))


def grads_and_stats(params, stats, images, labels):
  """This device's gradient and its updated running statistics."""
  def loss_fn(params):
    logits, updates = model.apply({"params": params, "batch_stats": stats}, images, train=True,
                                  mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, updates["batch_stats"]
  return jax.grad(loss_fn, has_aux=True)(params)


def make_data_parallel_step(sync):
  """The per-device step for ``jaxcomp.data_parallel``: the statistics are per device."""
  def step_fn(state, images, labels):
    params, stats, opt_state, step = state
    grads, new_stats = grads_and_stats(lax.pcast(params, "batch", to="varying"), stats.tree, images,
                                       labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), jaxcomp.PerDevice(sync(new_stats, step)),
            opt_state, step + 1), None
  return jaxcomp.data_parallel(step_fn, mesh)


def make_step(sync, mapping):
  def step_fn(params, stats, opt_state, images, labels, step):
    grad_params = lax.pcast(params, "batch", to="varying") if mapping == "shard_map" else params
    grads, stats = grads_and_stats(grad_params, stats, images, labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), sync(stats, step), opt_state

  if mapping == "pmap":
    return jax.pmap(step_fn, axis_name="batch", in_axes=(0, 0, 0, 0, 0, None))
  return jax.jit(jax.shard_map(step_fn, mesh=mesh, in_specs=(P(), P("batch"), P(), P("batch"),
                                                            P("batch"), P()),
                               out_specs=(P(), P("batch"), P())))


def global_batch(step):
  """The step's whole batch; device d trains on rows d*PER_DEVICE .. (d+1)*PER_DEVICE - 1."""
  idx = np.random.default_rng([0, step]).integers(0, len(train_y), PER_DEVICE * n_global)
  return train_x[idx].reshape(n_global, PER_DEVICE, 64), train_y[idx].reshape(n_global, PER_DEVICE)


def numpy_statistics(policy):
  """The first BatchNorm's running mean and variance on every device after every step, in NumPy."""
  mean, var, history = np.zeros((n_global, 64)), np.ones((n_global, 64)), []
  for step in range(args.steps):
    x = global_batch(step)[0].astype(np.float64)
    batch_mean = x.mean(1)
    batch_var = (x * x).mean(1) - batch_mean ** 2  # Flax's fast variance, E[x²] − E[x]²
    mean = MOMENTUM * mean + (1 - MOMENTUM) * batch_mean
    var = MOMENTUM * var + (1 - MOMENTUM) * batch_var
    if policy == "mean" or (policy.startswith("mean every") and (step + 1) % args.every_k == 0):
      mean, var = np.broadcast_to(mean.mean(0), mean.shape), np.broadcast_to(var.mean(0), var.shape)
    elif policy == "first":
      mean, var = np.broadcast_to(mean[0], mean.shape), np.broadcast_to(var[0], var.shape)
    history.append({"mean": mean, "var": var})
  return history


def local_rows(x):
  """This process's devices' rows of a per-device array, in device order, as one NumPy array."""
  shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
  return np.concatenate([np.asarray(s.data).reshape((-1,) + x.shape[1:]) for s in shards])


def train_data_parallel(policy):
  dp = make_data_parallel_step(POLICIES[policy])
  # Every device starts from the same state (process 0's, with several processes).
  state = dp.make_state((params, jaxcomp.PerDevice(variables["batch_stats"]), tx.init(params),
                         jnp.zeros([], jnp.int32)))
  history = []
  for step in range(args.steps):
    images, labels = (x[mine] for x in global_batch(step))
    state, _ = dp.step(state, *dp.shard((images.reshape(-1, 64), labels.reshape(-1))))
    # This process's devices' statistics, one row per device (reading them blocks).
    history.append(jax.tree.map(local_rows, state[1].tree))
  return history


def train(policy, mapping):
  if mapping == "data_parallel":
    return train_data_parallel(policy)
  stats = variables["batch_stats"]
  if mapping == "pmap":
    stack = lambda tree: jax.tree.map(lambda x: np.stack([np.asarray(x)] * n_local), tree)
    state = (stack(params), stack(stats), stack(tx.init(params)))
  else:  # per-device statistics: device d's block of each leaf along its first axis
    tile = lambda x: jax.make_array_from_callback(
        (n_global * x.shape[0],) + x.shape[1:], NamedSharding(mesh, P("batch")),
        lambda index: np.asarray(x))
    state = (jax.device_put(params, NamedSharding(mesh, P())), jax.tree.map(tile, stats),
             jax.device_put(tx.init(params), NamedSharding(mesh, P())))
  step_fn = make_step(POLICIES[policy], mapping)
  data = NamedSharding(mesh, P("batch"))
  history = []
  for step in range(args.steps):
    images, labels = (x[mine] for x in global_batch(step))
    if mapping == "shard_map":
      images = jax.make_array_from_process_local_data(data, images.reshape(-1, 64))
      labels = jax.make_array_from_process_local_data(data, labels.reshape(-1))
    state = step_fn(*state, images, labels, step)
    # This process's devices' statistics, a leading device axis on every leaf (reading them blocks).
    history.append(jax.tree.map(lambda x: np.asarray(x) if mapping == "pmap" else
                                local_rows(x).reshape((n_local, -1) + x.shape[1:]), state[1]))
  return history


for mapping in args.mappings.split(","):
  for policy in POLICIES:
    history, expected = train(policy, mapping), numpy_statistics(policy)
    # XLA's float32 against NumPy's float64. The pixels are multiples of 1/16, so sums and means of
    # x and x² over 8 rows are exact in float32; only E[x]² and the running updates round (≤ 6e-8
    # each, on values ≤ 1), and the decaying average keeps the sum of those below ~2e-6.
    worst = max(float(np.abs(got["BatchNorm_0"][k] - want[k][mine]).max())
                for got, want in zip(history, expected) for k in ("mean", "var"))
    last = history[-1]
    spread = max(float(np.abs(x - x[:1]).max()) for x in jax.tree.leaves(last))
    try:  # across processes too: every process compares its first device's statistics
      jaxcomp.check_replicated(jax.tree.map(lambda x: x[0], last))
      identical = spread == 0
    except jaxcomp.ReplicaMismatchError:
      identical = False
    sys.stdout.write(  # one write per line: the processes share the launcher's output
        f"process {jax.process_index()}: {mapping:13s} {policy:12s} BatchNorm_0 statistics after "
        f"every step {'match' if worst < 1e-5 else 'DO NOT MATCH'} NumPy (largest difference "
        f"{worst:.1e}); at the end both layers' statistics {'identical' if identical else 'differ'} "
        f"on the {n_global} devices\n")
    sys.stdout.flush()
    if worst >= 1e-5 or identical != bool(np.all(expected[-1]["mean"] == expected[-1]["mean"][0])):
      sys.exit(f"{mapping} {policy}: the statistics do not follow the policy")

if args.num_processes > 1:
  jax.distributed.shutdown()
