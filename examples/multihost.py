"""Multi-host data parallelism: one compressed training step across processes with jax.distributed.

``--launch 2`` runs the whole demonstration on this machine with one command: two processes with two
CPU devices each, joined by ``jax.distributed.initialize`` on 127.0.0.1 (gloo CPU collectives), train
together on a 4-device mesh; then one process with four devices runs the same steps, and the launcher
checks that both runs produced the same parameters and losses::

    python examples/multihost.py --launch 2 --steps 20

On GPU or TPU hosts the same script runs once per host, without ``--launch`` and without
``--local-devices`` (each process uses its accelerators)::

    python examples/multihost.py --coordinator HOST0:1234 --num-processes N --process-id I

(on Cloud TPU, or under SLURM / Open MPI, ``jax.distributed.initialize()`` finds these by itself).

The step is ``jaxcomp.data_parallel``'s, as on one host: its mesh spans every process's devices, and
``dp.shard`` makes each process's own rows part of the global batch.

Besides the gradient exchange the job keeps PyTorch DDP's other promises. Identical start: every
process takes process 0's initial parameters (``jaxcomp.broadcast_replicated``) and the job checks
that the replicas agree (``jaxcomp.check_replicated``, one fingerprint per leaf) after the start, after
a restore and at the end; ``--perturb-start --no-broadcast`` shows the check stopping the job, naming
the leaf that differs. Uneven inputs: each process reads its own batches, and before every step all of
them learn whether every one still has a batch (``jaxcomp.all_have_data``), so a process that runs out
(``--short K``: the last process has K batches fewer) ends the job for all at the same step instead of
leaving the others in a collective until the heartbeat timeout.

With ``--checkpoint-dir`` every process saves the step's state there (orbax-checkpoint) and a restarted
job resumes from the latest complete checkpoint, continuing exactly as the uninterrupted job would.
If a process dies, the others stop with an error from the JAX distributed service ("... detected
fatal errors. This most likely indicates that another task died") once the dead process has missed
its heartbeats for ``--heartbeat-timeout`` seconds; restart the job with the same command.
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--launch", type=int, metavar="P",
                    help="start P local processes and a single-process reference, and compare them")
parser.add_argument("--steps", type=int, default=20, help="training steps")
parser.add_argument("--coordinator", default=None,
                    help="HOST:PORT of process 0, for jax.distributed.initialize")
parser.add_argument("--num-processes", type=int, default=1, help="processes in the job")
parser.add_argument("--process-id", type=int, default=0, help="this process's index")
parser.add_argument("--local-devices", type=int, default=None,
                    help="CPU devices this process simulates (leave out on GPU/TPU hosts)")
parser.add_argument("--out", default=None,
                    help="process 0 saves the parameters and losses here (.npz); process i > 0 in "
                         "OUT with .process<i> before the suffix")
parser.add_argument("--perturb-start", action="store_true",
                    help="the last process starts from other parameters (one leaf changed)")
parser.add_argument("--no-broadcast", action="store_true",
                    help="do not broadcast process 0's initial parameters (the start check then fails "
                         "if the processes started differently)")
parser.add_argument("--short", type=int, default=0, metavar="K",
                    help="the last process has K batches fewer than --steps")
parser.add_argument("--checkpoint-dir", default=None,
                    help="save a checkpoint after every step here and resume from the latest one")
parser.add_argument("--heartbeat-timeout", type=int, default=30,
                    help="seconds without heartbeats after which a process counts as dead and the "
                         "job stops (jax.distributed's heartbeat_timeout_seconds; its default is 100)")
args = parser.parse_args()


def launch(processes: int) -> int:
  """Runs ``processes`` local processes with 2 CPU devices each, then the 1-process reference."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  me = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps)]
  with tempfile.TemporaryDirectory() as folder:
    multi, single = os.path.join(folder, "multi.npz"), os.path.join(folder, "single.npz")
    workers = [subprocess.Popen(me + ["--coordinator", f"127.0.0.1:{port}", "--num-processes",
                                      str(processes), "--process-id", str(i), "--local-devices",
                                      "2", "--out", multi]) for i in range(processes)]
    try:
      codes = [w.wait(timeout=300) for w in workers]
    finally:
      for w in workers:
        if w.poll() is None:
          w.kill()
    if any(codes):
      print(f"multi-process run failed: exit codes {codes}")
      return 1
    if subprocess.call(me + ["--local-devices", str(2 * processes), "--out", single], timeout=300):
      return 1
    import numpy as np
    a, b = np.load(multi), np.load(single)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
    same = all(np.allclose(a[k], b[k], rtol=1e-3, atol=1e-4) for k in a.files)
    # gloo and XLA:CPU add the four float16 contributions in different orders: equal up to rounding.
    print(f"{processes} processes x 2 devices vs 1 process x {2 * processes} devices: "
          f"{'equal' if same else 'DIFFERENT'} (largest difference {worst:.2g} over the losses and "
          f"{len(a.files) - 2} parameter arrays)")
    return 0 if same else 1


if args.launch:
  sys.exit(launch(args.launch))

import jax  # noqa: E402

if args.local_devices:
  jax.config.update("jax_num_cpu_devices", args.local_devices)  # before JAX starts its backends
if args.num_processes > 1:
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes, process_id=args.process_id,
                             heartbeat_timeout_seconds=args.heartbeat_timeout)

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

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
                                    optax.sgd(0.1, momentum=0.9)), every_k=2)
# All devices of all processes, process by process: each process holds a contiguous block.
mesh = Mesh(np.array(jax.devices()), ("batch",), axis_types=(AxisType.Auto,))
dp = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
train_x, train_y, _, _ = digits_data()
params = model.init(jax.random.key(0), train_x[:1])["params"]
last_process = jax.process_index() == jax.process_count() - 1
if args.perturb_start and last_process:  # as if this process had loaded another checkpoint
  params = {**params, "Dense_1": {**params["Dense_1"], "bias": params["Dense_1"]["bias"] + 1e-3}}
if not args.no_broadcast:
  params = jaxcomp.broadcast_replicated(params)  # DDP's start: process 0's parameters everywhere
jaxcomp.check_replicated(params)  # ReplicaMismatchError naming the first leaf that differs
opt_state = dp.make_state(params)  # the accumulator per device (stacked), the rest replicated
params = dp.make_params(params)  # on the mesh, replicated

batch = 8 * jax.device_count()
rows = batch // jax.process_count()  # this process feeds its own devices' share of the batch


def local_batches(first_step):
  """This process's share of every step's batch, as long as its data lasts (--short: the last
  process's runs out K steps early)."""
  last = args.steps - (args.short if last_process else 0)
  for step in range(first_step, last):
    idx = np.random.default_rng([0, step]).integers(0, len(train_y), batch)
    mine = idx[jax.process_index() * rows:(jax.process_index() + 1) * rows]
    yield train_x[mine], train_y[mine]


first_step = 0
manager = ocp.CheckpointManager(os.path.abspath(args.checkpoint_dir)) if args.checkpoint_dir else None
if manager is not None and manager.latest_step() is not None:
  first_step = manager.latest_step()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
  restored = manager.restore(first_step, args=ocp.args.StandardRestore(abstract))
  params, opt_state = restored["params"], restored["opt_state"]
  jaxcomp.check_replicated({"params": params, "opt_state": opt_state})  # all read the same one
  print(f"process {jax.process_index()}: resumed from the checkpoint of step {first_step}", flush=True)
losses = []
step = first_step
batches = local_batches(first_step)
# Every process asks before every step whether all still have a batch: all stop at the same step.
while jaxcomp.all_have_data((local := next(batches, None)) is not None):
  params, opt_state, loss = dp.step(params, opt_state, *dp.shard(local))  # each its own rows
  losses.append(float(loss.mean()))  # one loss per device; reading it blocks: no XLA:CPU deadlock
  step += 1
  if manager is not None:
    manager.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
if manager is not None:
  manager.wait_until_finished()
jaxcomp.check_replicated({"params": params, "opt_state": opt_state})  # the replicas never drifted

trained = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no step to run"
print(f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local of "
      f"{jax.device_count()} devices, {trained}, stopped after step {step} of {args.steps}, "
      "replicas identical", flush=True)
if args.out:
  arrays = {jax.tree_util.keystr(k): np.asarray(v.addressable_data(0))
            for k, v in jax.tree_util.tree_leaves_with_path(params)}
  stem, suffix = os.path.splitext(args.out)
  out = args.out if jax.process_index() == 0 else f"{stem}.process{jax.process_index()}{suffix}"
  np.savez(out, losses=np.array(losses), first_step=first_step, **arrays)
if args.num_processes > 1:
  jax.distributed.shutdown()
