"""One process of a 2-process job (2 CPU devices each, jax.distributed on 127.0.0.1) in which every
process initialises its parameters from another seed, then builds ``jaxcomp.data_parallel`` states:

* the per-device-step form (PowerSGD, whose error feedback is per device; and local SGD with
  ``jaxcomp.PerDevice`` parameters): ``make_state`` broadcasts process 0's state, so every copy on
  every process is process 0's, and one step later the replicated parameters are still identical;
* the loss-function form: ``make_state`` refuses the differing parameters naming the leaf; after
  ``jaxcomp.broadcast_replicated`` it and ``make_params`` accept them.

Writes this process's copies (every local device's) of what it built to ``--out``, and prints the
error of the loss-function form.

    python tests/workers/data_parallel_start.py --coordinator 127.0.0.1:PORT --process-id I --out F
"""

from two_processes import join, local_rows

args = join()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

import jaxcomp  # noqa: E402

W = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("batch",), axis_types=(AxisType.Explicit,))
rng = np.random.default_rng(args.process_id)  # every process starts from other parameters
params = {"w": rng.normal(size=(6, 4)).astype(np.float32), "b": np.float32(rng.normal())}


def loss_fn(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


data = np.random.default_rng(7)
x = data.normal(size=(4 * W, 6)).astype(np.float32)
y = data.normal(size=(4 * W, 4)).astype(np.float32)
mine = slice(jax.process_index() * 4 * jax.local_device_count(),
             (jax.process_index() + 1) * 4 * jax.local_device_count())


def copies(tree, prefix):
  """Every local device's copy of every leaf (one row per local device), keyed by path."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    out[prefix + jax.tree_util.keystr(path)] = local_rows(leaf)
  return out


results = {"start/" + k: np.asarray(v) for k, v in params.items()}

# Per-device-step form with PowerSGD: process 0's parameters and state everywhere, then a step.
tx = optax.chain(jaxcomp.powersgd(1, start_iter=0, min_compression_rate=1.0), optax.sgd(0.1))


def train_step(state, x, y):
  p, opt_state = state
  grads = jax.grad(loss_fn)(lax.pcast(p, "batch", to="varying"), x, y)
  updates, opt_state = tx.update(grads, opt_state, p)
  return (optax.apply_updates(p, updates), opt_state), None


dp = jaxcomp.data_parallel(train_step, mesh)
state = dp.make_state((params, tx.init(params)))
results.update(copies(state[0], "made/params"))
results.update(copies(state[1][0].error, "made/error"))
results.update(copies(state[1][0].q, "made/q"))
state, _ = dp.step(state, *dp.shard((x[mine], y[mine])))
jaxcomp.check_replicated(state)  # replicated leaves identical on every device of both processes
results.update(copies(state[0], "stepped/params"))

# Per-device-step form with local SGD: the per-device parameters start from process 0's too.
local = jaxcomp.local_sgd(optax.sgd(0.1), sync_every=2)
local_state = jaxcomp.data_parallel(train_step, mesh).make_state(
    (jaxcomp.PerDevice(params), local.init(params)))
results.update(copies(local_state[0].tree, "local/params"))

# Loss-function form: differing parameters are refused, naming the leaf.
dp_loss = jaxcomp.data_parallel(loss_fn, mesh, tx=tx)
try:
  dp_loss.make_state(params)
except jaxcomp.ReplicaMismatchError as e:
  print(f"process {jax.process_index()}: loss form refused: {e}", flush=True)
else:
  raise SystemExit("the loss form accepted parameters that differ between processes")
params = jaxcomp.broadcast_replicated(params)
opt_state, placed = dp_loss.make_state(params), dp_loss.make_params(params)
placed, opt_state, loss = dp_loss.step(placed, opt_state, *dp_loss.shard((x[mine], y[mine])))
results.update(copies(placed, "loss_form/params"))
np.savez(args.out, **results)
print(f"process {jax.process_index()}: done", flush=True)
jax.distributed.shutdown()
